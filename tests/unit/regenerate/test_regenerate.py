"""eagle3 regenerate: equality with the target's own greedy generation, resume after SIGKILL, reuse, bad input."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3.config import PrepareConfig, RegenConfig
from eagle3.decoding.generate import Gen
from eagle3.model.target import Target, prompt_ids
from eagle3.regenerate.hf import load_hf
from eagle3.regenerate.resume import OUT_FILE, PREVIOUS, PROGRESS
from eagle3.regenerate.run import clean_answer, read_records, regenerate
from tests.helpers.regen import check_equal_to_target, write_source

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.usefixtures("one_thread")  # the CPU is shared: 2 threads decode tiny models slower


def test_hf_equals_target_greedy_tiny_llama(tmp_path, tiny_llama_dir):
    src = write_source(tmp_path / "src.jsonl", 7)  # r0, r3, r6 have two turns: 10 turns
    cfg = RegenConfig(max_new_tokens=12, batch_size=4, chunk_records=4)
    m = regenerate(tiny_llama_dir, str(src), tmp_path / "out", cfg)
    assert (m.records_read, m.records_written, m.turns_written, m.skipped) == (7, 7, 10, {})
    assert m.stats["tokens_generated"] == sum(
        t["tokens"] + (t["finish"] == "stop") for r in read_records(tmp_path / "out") for t in r["provenance"]["turns"])
    recs = read_records(tmp_path / "out")
    # User turns and ids are the source's; provenance names the source record, model and settings.
    assert [r["id"] for r in recs] == [f"r{i}" for i in range(7)]
    assert [m_["content"] for m_ in recs[3]["messages"] if m_["role"] == "user"] == [
        "question 3: what is 3 plus 3?", "and 3 times 3?"]
    assert recs[3]["provenance"]["source_index"] == 3
    assert recs[0]["provenance"]["model"] == m.model_fingerprint
    assert recs[0]["provenance"]["settings"] == {
        "backend": "hf", "dtype": "float32", "max_new_tokens": 12, "temperature": 0.0, "top_p": 1.0, "seed": None,
        "reasoning": "keep", "max_len": 4096}
    assert check_equal_to_target(tiny_llama_dir, tmp_path / "out", 12) == 10
    # Rerun: the finished manifest is returned, nothing recomputed.
    again = regenerate(tiny_llama_dir, str(src), tmp_path / "out", cfg)
    assert again.fingerprint == m.fingerprint and again.created_at == m.created_at


@pytest.mark.slow
def test_hf_equals_target_greedy_and_resumes_smollm2(tmp_path, smollm2_dir):
    src = tmp_path / "src.jsonl"
    rows = [{"id": "a", "messages": [{"role": "user", "content": "What is the capital of France?"},
                                     {"role": "assistant", "content": "Paris."},
                                     {"role": "user", "content": "And of Italy?"},
                                     {"role": "assistant", "content": "Rome."}]},
            {"id": "b", "conversations": [{"from": "human", "value": "Name a primary color."},
                                          {"from": "gpt", "value": "Red."}]},
            {"id": "c", "messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi"}]}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = RegenConfig(max_new_tokens=8, batch_size=2, chunk_records=2)  # a and b share a batch
    hf, _ = load_hf(Target.open(smollm2_dir), cfg)
    m = regenerate(smollm2_dir, str(src), tmp_path / "out", cfg, generator=hf)
    assert (m.records_written, m.turns_written) == (3, 4)
    recs = read_records(tmp_path / "out")
    assert recs[0]["messages"][1]["content"] != "Paris."  # the target's own words, not the source's
    assert check_equal_to_target(smollm2_dir, tmp_path / "out", 8) == 4
    # Killed during the second chunk (after a's second turn), then rerun: the same bytes.
    with pytest.raises(KeyboardInterrupt):
        regenerate(smollm2_dir, str(src), tmp_path / "again", cfg, generator=Crashing(hf, after=2))
    assert json.loads((tmp_path / "again" / PROGRESS).read_text())["records_read"] == 2
    m = regenerate(smollm2_dir, str(src), tmp_path / "again", cfg, generator=hf)
    assert m.stats["records_resumed"] == 2
    assert (tmp_path / "again" / OUT_FILE).read_bytes() == (tmp_path / "out" / OUT_FILE).read_bytes()


def _cli(model: Path, src: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "eagle3.cli", "regenerate", "--model", str(model), "--data", str(src),
            "--out", str(out), "--max-new-tokens", "16", "--chunk-records", "2", "--batch-size", "2",
            "--threads", "1", *extra]


def test_sigkill_then_rerun_writes_the_same_bytes(tmp_path, tiny_llama_dir):
    src = write_source(tmp_path / "src.jsonl", 40)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    subprocess.run(_cli(tiny_llama_dir, src, ref), check=True, env=env, capture_output=True, cwd=REPO)

    p = subprocess.Popen(_cli(tiny_llama_dir, src, killed), env=env, cwd=REPO,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    committed = 0
    while time.monotonic() < deadline and p.poll() is None:
        try:
            committed = json.loads((killed / PROGRESS).read_text())["records_read"]
        except (FileNotFoundError, ValueError, KeyError):
            committed = 0
        if committed >= 4:
            break
        time.sleep(0.01)
    assert p.poll() is None, "the run finished before it could be killed; make it longer"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert not (killed / "manifest.json").exists()
    prog = json.loads((killed / PROGRESS).read_text())
    assert 4 <= prog["records_read"] < 40
    # A kill in the middle of an append leaves a torn line after the committed bytes: it must go.
    with open(killed / OUT_FILE, "ab") as f:
        f.write(b'{"id": "r99", "messa')

    r = subprocess.run(_cli(tiny_llama_dir, src, killed), env=env, capture_output=True, cwd=REPO, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    stats = json.loads(r.stdout)
    assert stats["records_resumed"] == prog["records_written"] >= 4
    assert stats["records_written"] == 40
    assert (killed / OUT_FILE).read_bytes() == (ref / OUT_FILE).read_bytes()
    assert json.loads((killed / "manifest.json").read_text())["fingerprint"] == \
        json.loads((ref / "manifest.json").read_text())["fingerprint"]


class Counting:
    """Wraps a generator; records every prompt it is asked to answer."""

    def __init__(self, inner):
        self.inner, self.name, self.dtype, self.prompts = inner, inner.name, inner.dtype, []

    def generate(self, prompts, seeds):
        self.prompts += list(prompts)
        return self.inner.generate(prompts, seeds)


class Crashing(Counting):
    def __init__(self, inner, after: int):
        super().__init__(inner)
        self.left = after

    def generate(self, prompts, seeds):
        if self.left == 0:
            raise KeyboardInterrupt("simulated crash")
        self.left -= 1
        return super().generate(prompts, seeds)


def test_crash_resume_and_incremental_reuse_equal_fresh_runs(tmp_path, tiny_llama_dir):
    cfg = RegenConfig(max_new_tokens=8, batch_size=3, chunk_records=3)
    hf, _ = load_hf(Target.open(tiny_llama_dir), cfg)
    a = write_source(tmp_path / "a.jsonl", 6)  # r0..r5
    b = tmp_path / "b.jsonl"  # r0..r5 plus r6..r8; r4's question is edited
    b.write_text(a.read_text().replace("question 4:", "question four:") +
                 write_source(tmp_path / "extra.jsonl", 3, start=6).read_text())

    # Fresh references.
    regenerate(tiny_llama_dir, str(b), tmp_path / "fresh_b", cfg, generator=hf)

    # A crash mid-run (second wave of the second chunk), then a rerun: same file.
    with pytest.raises(KeyboardInterrupt):
        regenerate(tiny_llama_dir, str(b), tmp_path / "crashed", cfg, generator=Crashing(hf, after=3))
    assert json.loads((tmp_path / "crashed" / PROGRESS).read_text())["records_read"] == 3
    c = Counting(hf)
    m = regenerate(tiny_llama_dir, str(b), tmp_path / "crashed", cfg, generator=c)
    assert m.stats["records_resumed"] == 3
    assert (tmp_path / "crashed" / OUT_FILE).read_bytes() == (tmp_path / "fresh_b" / OUT_FILE).read_bytes()

    # Incremental: a earlier, then b reusing a's output. Only r4 (edited) and r6..r8 are generated.
    regenerate(tiny_llama_dir, str(a), tmp_path / "run_a", cfg, generator=hf)
    c = Counting(hf)
    m = regenerate(tiny_llama_dir, str(b), tmp_path / "run_b", cfg, reuse=[tmp_path / "run_a"], generator=c)
    assert m.stats["records_reused"] == 5
    assert len(c.prompts) == 1 + 3 + 1  # r4; r6, r7, r8; r6's second turn
    assert (tmp_path / "run_b" / OUT_FILE).read_bytes() == (tmp_path / "fresh_b" / OUT_FILE).read_bytes()

    # The same dir fed a grown source reuses its own previous output, then drops it.
    c = Counting(hf)
    m = regenerate(tiny_llama_dir, str(b), tmp_path / "run_a", cfg, generator=c)
    assert m.stats["records_reused"] == 5 and len(c.prompts) == 5
    assert not (tmp_path / "run_a" / PREVIOUS).exists()
    assert (tmp_path / "run_a" / OUT_FILE).read_bytes() == (tmp_path / "fresh_b" / OUT_FILE).read_bytes()

    # Other settings are another key: nothing is reused.
    c = Counting(hf)
    m = regenerate(tiny_llama_dir, str(b), tmp_path / "run_c", cfg.model_copy(update={"reasoning": "drop"}),
                   reuse=[tmp_path / "fresh_b"], generator=c)
    assert m.stats["records_reused"] == 0 and len(c.prompts) == 12


def test_bad_input_is_counted_and_named(tmp_path, tiny_llama_dir):
    src = tmp_path / "src.jsonl"
    good = {"id": "g1", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    src.write_text("\n".join([
        json.dumps(good),
        '{"id": "broken", "messages": [',
        json.dumps({"id": "alien", "messages": [{"role": "robot", "content": "x"}]}),
        json.dumps({"id": "lonely", "messages": [{"role": "user", "content": "anyone?"}]}),
        json.dumps({"id": "blank",
                    "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]}),
        json.dumps({**good, "id": "g2"}),
    ]) + "\n")
    m = regenerate(tiny_llama_dir, str(src), tmp_path / "out", RegenConfig(max_new_tokens=4))
    assert m.records_read == 6 and m.records_written == 2
    assert m.skipped == {"malformed_json": 1, "unknown_role": 1, "no_assistant_turn": 1, "empty_turn": 1}
    assert m.records_written + sum(m.skipped.values()) == m.records_read  # nothing lost silently
    assert m.skip_examples["malformed_json"][0].startswith("src.jsonl:2")
    assert m.skip_examples["unknown_role"][0].startswith("alien")
    with pytest.raises(ValueError, match="no conversation could be regenerated"):
        regenerate(tiny_llama_dir, str(src), tmp_path / "none", RegenConfig(max_new_tokens=4, max_len=16))


class Scripted:
    """A generator that answers from a script of texts (in prompt order), for the text-handling rules."""

    name, dtype = "hf", "float32"

    def __init__(self, tok, texts: list[str]):
        self.tok, self.texts = tok, list(texts)

    def generate(self, prompts, seeds):
        return [Gen(self.tok(self.texts.pop(0), add_special_tokens=False)["input_ids"], "stop") for _ in prompts]


def test_reasoning_empty_answers_and_long_prompts(tmp_path, tiny_llama_dir):

    tok = Target.open(tiny_llama_dir).tokenizer()
    assert clean_answer("<think>plan\nmore</think>\n\nAnswer.", "drop") == "Answer."
    assert clean_answer("<think>cut short", "drop") == ""
    assert clean_answer("<think>a</think>B", "keep") == "<think>a</think>B"
    src = write_source(tmp_path / "src.jsonl", 3)  # r0 has two turns
    texts = ["<think>r0 t1</think>Zero.", "<think>r1</think>One.", "<think>r2</think>", "<think>r0 t2</think>Sq."]
    m = regenerate(tiny_llama_dir, str(src), tmp_path / "drop", RegenConfig(reasoning="drop"),
                   generator=Scripted(tok, texts))
    recs = read_records(tmp_path / "drop")
    assert ([[x["content"] for x in r["messages"] if x["role"] == "assistant"] for r in recs]
            == [["Zero.", "Sq."], ["One."]])
    assert m.skipped == {"empty_answer": 1}  # r2 answered nothing but reasoning
    m = regenerate(tiny_llama_dir, str(src), tmp_path / "keep", RegenConfig(reasoning="keep"),
                   generator=Scripted(tok, texts))
    assert read_records(tmp_path / "keep")[0]["messages"][1]["content"] == "<think>r0 t1</think>Zero."
    assert m.records_written == 3 and m.samples[0]["original"] == "0 plus 0 is 0."
    # A second turn that would not fit max_len ends the conversation after the first one.
    n = len(prompt_ids(tok, [{"role": "user", "content": "question 0: what is 0 plus 0?"}]))
    m = regenerate(tiny_llama_dir, str(src), tmp_path / "short", RegenConfig(max_len=n + 8, max_new_tokens=8),
                   generator=Scripted(tok, ["A.", "B.", "C."]))
    assert m.conversations_shortened == 1 and m.turns_written == 3


def test_sampling_is_seeded_per_turn_not_per_batch(tmp_path, tiny_llama_dir):
    src = write_source(tmp_path / "src.jsonl", 5)
    base = RegenConfig(max_new_tokens=8, temperature=0.9, top_p=0.95, seed=7)
    outs = {}
    for name, cfg in {"b1": base.model_copy(update={"batch_size": 1}), "b4": base.model_copy(update={"batch_size": 4}),
                      "s8": base.model_copy(update={"seed": 8})}.items():
        regenerate(tiny_llama_dir, str(src), tmp_path / name, cfg)
        outs[name] = [r["messages"] for r in read_records(tmp_path / name)]
    assert outs["b1"] == outs["b4"]
    assert sum(a != b for a, b in zip(outs["b1"], outs["s8"], strict=True)) == 5
    greedy = regenerate(tiny_llama_dir, str(src), tmp_path / "g", RegenConfig(max_new_tokens=8))
    assert greedy.settings["seed"] is None and greedy.settings["top_p"] == 1.0  # irrelevant to greedy: not in the key


def test_prepare_reads_the_output_and_cli(tmp_path, tiny_llama_dir, capsys):
    from eagle3.cli import main
    from eagle3.prepare import prepare

    src = write_source(tmp_path / "src.jsonl", 5)
    out = tmp_path / "out"
    assert main(["regenerate", "--model", str(tiny_llama_dir), "--data", str(src), "--out", str(out),
                 "--max-new-tokens", "6", "--limit", "4"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["records_read"], printed["records_written"], printed["turns_written"]) == (4, 4, 6)
    p = prepare(tiny_llama_dir, tmp_path / "prep", PrepareConfig(data=str(out / OUT_FILE), draft_vocab=64),
                progress=False)
    assert (p.records_read, p.records_kept, p.skipped) == (4, 4, {})
    assert main(["regenerate", "--model", str(tiny_llama_dir), "--data", str(tmp_path / "nope.jsonl"),
                 "--out", str(out)]) == 2
    assert "nope.jsonl" in capsys.readouterr().err


def test_batches_respect_rows_and_padded_tokens():
    from eagle3.decoding.generate import HFGenerator

    g = HFGenerator.__new__(HFGenerator)
    g.cfg = RegenConfig(batch_size=3, batch_tokens=300)
    # longest first: 200 alone (2 x 200 > 300); then 100, 90, 80 (3 x 100 = 300); then 70, 10
    assert g.batches([200, 100, 90, 80, 70, 10]) == [[0], [1, 2, 3], [4, 5]]
    g.cfg = RegenConfig(batch_size=8, batch_tokens=64)
    assert g.batches([500, 20, 20, 20, 20]) == [[0], [1, 2, 3], [4]]  # a too-long prompt still runs, alone
