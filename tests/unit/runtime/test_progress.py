"""Long work keeps talking: the progress meter's cadence and figures, the answer build's lines and its rows
sized from free memory, the preflight's host scaling and eval memory check, the run's closing stage table."""
from __future__ import annotations

import pytest

from eagle3.runtime.progress import Meter


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_meter_says_a_line_at_most_every_20_s_and_at_the_end_with_rate_and_eta():
    clock, lines = Clock(), []
    m = Meter("answers", 100, "steps", say=lines.append, clock=clock)
    for i in range(1, 100):
        clock.t = i * 1.5  # a step every 1.5 s
        m.update(i, f"{100 - i} rows")
    assert len(lines) == 7  # at 21, 42, ..., 147 s: never more than one per 20 s
    assert lines[0] == "answers: 14/100 steps (14%), 0.7 steps/s, ETA 2m09s; 86 rows"
    clock.t = 200.0
    m.update(100)  # the end is always said
    assert lines[-1] == "answers: 100/100 steps (100%), 0.5 steps/s, ETA 0m00s" and len(lines) == 8
    m.update(150)  # done never passes total
    assert m.done == 100


def test_a_ticking_meter_talks_between_steps_longer_than_its_cadence():
    import threading

    clock, lines = Clock(), []
    m = Meter("extract", 0, "tokens", say=lines.append, clock=clock)
    clock.t = 24.0
    m.tick()  # under 1.25 x 20 s of silence: nothing
    assert lines == []
    clock.t = 25.0
    m.tick()  # a model loading: nothing counted yet
    assert lines == ["extract: 0m25s in; working"]
    m.update(100, total=1000)
    clock.t = 40.0
    m.tick()  # 15 s after the last line: the meter's own cadence, not a silence
    assert len(lines) == 1
    clock.t = 50.0
    m.tick()  # one long batch
    assert lines[-1] == "extract: 100/1,000 tokens (10%), ? tokens/s, ETA ?; working"
    m.update(400)
    clock.t = 75.0
    m.tick()
    assert lines[-1] == "extract: 400/1,000 tokens (40%), 6.0 tokens/s, ETA 1m40s; working"

    # the thread polls `tick` until the block ends
    heard = threading.Event()
    t = Meter("load", 0, say=lambda line: heard.set(), clock=clock)
    clock.t = 200.0
    with t.ticking(poll_s=0.01):
        assert heard.wait(30)
    assert not any(th.name == "meter load" for th in threading.enumerate())


def test_a_record_restarts_the_cadence_and_a_bar_replaces_the_lines(monkeypatch):
    import io

    clock, lines = Clock(), []
    m = Meter("train", 100, "steps", say=lines.append, clock=clock)
    m.update(1)
    clock.t = 19.0
    m.report("train step 10/100  loss 1.0")
    clock.t = 30.0
    m.update(20)  # 11 s after the record: no line
    assert lines == ["train step 10/100  loss 1.0"]
    clock.t = 39.0
    m.update(30)
    assert lines[-1] == "train: 30/100 steps (30%), 0.7 steps/s, ETA 1m34s"
    said: list[str] = []
    slow = Meter("train", 51, "steps", say=said.append, clock=Clock())
    slow.update(1)
    slow.clock.t = 200.0
    slow.update(6)  # 5 steps in 200 s
    assert said[-1] == "train: 6/51 steps (12%), 40.0 s per step, ETA 30m00s"

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    err = Tty()
    monkeypatch.setattr("sys.stderr", err)
    b = Meter("prepare", 10, "records", say=lines.append, clock=clock, bar=True)
    n = len(lines)
    for i in range(1, 11):
        b.update(i, "kept 3")
    b.report("a record", postfix="loss 1.0")
    b.close()
    assert len(lines) == n and "10/10" in err.getvalue() and "loss 1.0" in err.getvalue()


def test_answer_rows_fit_free_memory_and_refuse_below_the_floor():
    from eagle3.decoding.batch_decode import answer_rows

    per_token, seq = 46_080, 1_000  # SmolLM2 fp32: 30 layers x 2 x 3 kv heads x 64 x 4 bytes
    row = 2 * per_token * seq  # counted twice
    assert answer_rows(per_token, seq, None, 128) == 128  # free memory unknown: the cap
    assert answer_rows(per_token, seq, 1 << 40, 128) == 128
    assert answer_rows(per_token, seq, int(20 * row / 0.9) + 1, 128) == 20
    with pytest.raises(MemoryError, match=r"8 rows of 1000 tokens.*lower eval.max_new_tokens or eval.limit"):
        answer_rows(per_token, seq, 7 * row, 128)


def test_the_answer_build_reports_progress_and_a_tight_memory_splits_it_into_batches(tiny_llama_dir, tmp_path):
    from eagle3.decoding.batch_decode import kv_bytes_per_token
    from eagle3.eval.prompts import load_prompts
    from eagle3.eval.replay import continuations
    from eagle3.model.target import Target

    p = tmp_path / "p.jsonl"
    p.write_text("".join(f'{{"prompt": "question number {i}: what comes after {i}?"}}\n' for i in range(12)))
    convs, _ = load_prompts(str(p), None)
    target = Target.open(tiny_llama_dir)
    model = target.load_model(head=True, device="cpu")
    lines: list[str] = []
    one, _, _ = continuations(target, model, convs, 12, 4, cache=tmp_path / "a", progress=lines.append)
    assert lines[-1].startswith("replay answers: 16/16 steps (100%)") and "turn 1/1: 12 answers" in lines[-1]
    # room for 8 rows' KV caches only: two batches (8 + 4), the same answers
    longest = max(len(t.ids) for t in one)
    per_token = kv_bytes_per_token(model.config, next(model.parameters()).dtype)
    free = int(8.5 * 2 * per_token * longest / 0.9)
    two, _, _ = continuations(target, model, convs, 12, 4, cache=tmp_path / "b", free_bytes=free)
    assert [t.ids for t in two] == [t.ids for t in one]
    with pytest.raises(MemoryError, match="the replay answers need"):
        continuations(target, model, convs, 12, 4, cache=tmp_path / "c", free_bytes=free // 4)


def test_preflight_scales_cpu_stages_by_the_host_and_checks_the_eval_memory(smollm2_dir):
    from pathlib import Path

    from eagle3.config import PipelineConfig
    from eagle3.planning import GIB, plan
    from eagle3.probe import HostSpeed

    demo = PipelineConfig.from_file(Path(__file__).parents[3] / "examples" / "smollm2-sharegpt.yaml")
    demo = demo.model_copy(update={"run_dir": "runs/none-yet"})
    ref = plan(demo, free_bytes=1 << 50, free_mem=1 << 40)
    slow = plan(demo, free_bytes=1 << 50, free_mem=1 << 40, host=HostSpeed(0.5, 0.5, 0.5, measured=True))
    assert {k: round(slow.seconds[k] / ref.seconds[k], 6) for k in ref.seconds} == {
        "prepare": 1.0, "extract": 2.0, "verifier": 1.0, "train": 2.0, "eval": 2.0}
    assert "decode 0.50x" in slow.markdown() and "not measured" in ref.markdown()
    # only the decoding slower: the eval's answers and live check, and the trainer's replay set
    dec = plan(demo, free_bytes=1 << 50, free_mem=1 << 40, host=HostSpeed(decode=0.5, measured=True))
    assert dec.seconds["extract"] == ref.seconds["extract"] and dec.seconds["eval"] > 1.5 * ref.seconds["eval"]
    # train = the steps (train rate) + the replay set built first (decode rate): T + R, T + 2R and 2T + R
    trn = plan(demo, free_bytes=1 << 50, free_mem=1 << 40, host=HostSpeed(train=0.5, measured=True))
    assert ref.seconds["train"] < dec.seconds["train"] < trn.seconds["train"]
    assert dec.seconds["train"] + trn.seconds["train"] == pytest.approx(3 * ref.seconds["train"])
    # max_steps ends training early: the estimate takes that share of the epochs' steps (the replay set stays)
    short = demo.model_copy(update={"train": demo.train.model_copy(update={"max_steps": 20})})
    assert plan(short, free_bytes=1 << 50, free_mem=1 << 40).seconds["train"] < 0.25 * ref.seconds["train"]
    # ... and, as in the trainer, it overrides epochs upward too: more steps than the epochs' cost more
    long = demo.model_copy(update={"train": demo.train.model_copy(update={"max_steps": 4 * demo.train.max_steps})})
    assert plan(long, free_bytes=1 << 50, free_mem=1 << 40).seconds["train"] > 2 * ref.seconds["train"]
    need = next(r.bytes for r in ref.rows if r.what.startswith("memory of the replay answers, 80 rows"))
    assert 6 * GIB < need < 10 * GIB  # the demo's build peaked at 8.5-10.8 GiB measured
    tight = plan(demo, free_bytes=1 << 50, free_mem=int(need * 0.6))
    assert not tight.problems and any("smaller batches" in r.what for r in tight.rows)
    refused = plan(demo, free_bytes=1 << 50, free_mem=int(1.5 * GIB))
    assert any(x.startswith("memory: the eval's replay answers need") for x in refused.problems)


def test_times_table_puts_the_estimate_beside_the_measured_time():
    from flows.pipeline import times_table

    times = {"prepare": {"seconds": 3.2, "how": "done", "peak_rss": 1 << 30, "subprocesses_rss": None},
             "train": {"seconds": 1500.0, "how": "done", "peak_rss": None, "subprocesses_rss": 4 << 30},
             "eval": {"seconds": 10.0, "how": "cached (inputs unchanged)", "peak_rss": 2 << 29,
                      "subprocesses_rss": None}}
    rows = times_table(times, {"prepare": 4.0, "train": 1200.0, "eval": 400.0})
    assert rows[0] == {"stage": "prepare", "wall": "0m03s", "seconds": 3.2, "peak RSS": "1.00 GiB",
                       "subprocesses": "", "estimate": "0m04s", "measured / estimate": 0.8, "how": "done"}
    assert (rows[1]["peak RSS"], rows[1]["subprocesses"], rows[1]["measured / estimate"]) == (
        "(elsewhere)", "4.00 GiB", 1.25)
    assert rows[2]["measured / estimate"] == ""  # a cached stage is no measurement of the estimate
