"""Eval stage as a Prefect task: report + artifacts under a test-harness server, content-keyed cache."""
from __future__ import annotations

import json

import torch

from eagle3.config import EvalConfig


def test_eval_task_writes_report_and_artifacts_and_caches(tiny_llama_dir, tmp_path, prefect_env):
    from prefect import flow
    from prefect.client.orchestration import get_client

    from tasks.eval import eval_task, publish
    from tests.helpers.drafts import random_draft, write_native

    draft = write_native(random_draft(tiny_llama_dir, seed=7), tmp_path / "final")
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "Hello"}) + "\n")
    cfg = EvalConfig(prompts=str(p), k=2, max_new_tokens=6)

    @flow
    def f():
        s = eval_task(str(tiny_llama_dir), str(draft), str(tmp_path / "eval"), cfg, return_state=True)
        publish(s.result(), str(tmp_path / "eval"))  # the flow that ran the stage makes its artifacts
        return s.name, s.result()

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        name1, m = f()
        name2, m2 = f()
    finally:
        torch.set_num_threads(n)
    assert (name1, name2) == ("Completed", "Cached")
    assert m2.fingerprint == m.fingerprint and m.lossless and 1.0 <= m.acceptance_length <= 3.0
    assert (tmp_path / "eval" / "report.json").is_file() and (tmp_path / "eval" / "acceptance.png").is_file()
    with get_client(sync_client=True) as c:
        arts = {a.key: a for a in c.read_artifacts() if a.key in ("eval-results", "eval-report")}
    assert set(arts) == {"eval-results", "eval-report"}
    assert "data:image/png;base64," in arts["eval-report"].data
    rows = (json.loads(arts["eval-results"].data) if isinstance(arts["eval-results"].data, str)
            else arts["eval-results"].data)
    assert {"what": "lossless", "value": True} in rows
