"""Every kind of the bad-input corpus (tests/helpers/bad_inputs.py) gets a one-line refusal or a counted skip."""
from __future__ import annotations

import pytest

from tests.helpers.bad_inputs import CASES, build_base, run_case


@pytest.fixture(scope="module")
def base(tiny_llama_dir, tmp_path_factory):
    return build_base(tmp_path_factory.mktemp("bad-base"), tiny_llama_dir)


def test_the_corpus_covers_thirty_kinds_across_stages():
    assert len({c.kind for c in CASES}) == len(CASES) >= 30
    assert {c.stage for c in CASES} >= {"prepare", "extract", "verifier", "train", "run"}


@pytest.mark.parametrize("case", CASES, ids=[c.kind for c in CASES])
def test_bad_input_is_handled_cleanly(case, base, tmp_path, one_thread):
    r = run_case(case, tmp_path, base)
    assert r.clean, f"{case.kind}: {r.detail}\n{r.stderr[-3000:]}"
