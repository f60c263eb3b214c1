"""`eagle3 prepare` end to end: counts by reason, masks over real data, determinism, resume."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from eagle3.config import PrepareConfig
from eagle3.data.vocab import load_maps
from eagle3.model.target import Target
from eagle3.prepare import prepare
from eagle3.storage.manifests import PreparedData
from eagle3.storage.shards import read_split

REPO = Path(__file__).resolve().parents[3]


def sg(i, *turns):
    return {"id": f"c{i}", "conversations": [{"from": r, "value": v} for r, v in turns]}


GOOD = [sg(i, ("human", f"question number {i}?"), ("gpt", f"answer number {i}, with some words."),
           ("human", "and then?"), ("gpt", "then " * (i % 7 + 1) + "done.")) for i in range(40)]


def write_mixed(path: Path) -> dict[str, int]:
    """A JSONL file with every kind of bad record between good ones; returns expected skips."""
    lines = [json.dumps(r) for r in GOOD]
    bad = [
        ("malformed_json", "{\"conversations\": [oops"),
        ("non_utf8", None),
        ("unknown_role", json.dumps(sg(100, ("human", "q"), ("wizard", "a")))),
        ("missing_content", json.dumps({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt"}]})),
        ("empty_turn", json.dumps(sg(101, ("human", "q"), ("gpt", "  ")))),
        ("empty_conversation", json.dumps({"conversations": []})),
        ("no_assistant_turn", json.dumps(sg(102, ("human", "only a question")))),
        ("duplicate", json.dumps(GOOD[3])),
        ("no_trainable_tokens", json.dumps(sg(103, ("human", "long " * 400), ("gpt", "short")))),
        ("not_an_object", "[\"a list\"]"),
        ("bad_schema", json.dumps({"prompt": "x", "completion": "y"})),
    ]
    raw = [ln.encode() for ln in lines]
    for j, (_, text) in enumerate(bad):
        b = b'{"conversations": [{"from": "human", "value": "caf\xe9"}]}' if text is None else text.encode()
        raw.insert(3 * j + 1, b)
    path.write_bytes(b"\n".join(raw) + b"\n")
    return {reason: 1 for reason, _ in bad}


def test_counts_every_skip_reason_and_loses_nothing(tmp_path, smollm2_dir):
    src = tmp_path / "mixed.jsonl"
    expected = write_mixed(src)
    m = prepare(smollm2_dir, tmp_path / "out", PrepareConfig(data=str(src), max_len=256, draft_vocab=500,
                                                             val_fraction=0.1), progress=False)
    assert m.skipped == dict(sorted(expected.items()))
    assert m.records_read == len(GOOD) + len(expected)
    assert m.records_kept == len(GOOD)  # the duplicate of GOOD[3] is the skipped copy
    assert m.records_kept + sum(m.skipped.values()) == m.records_read
    assert all(len(v) >= 1 for v in m.skip_examples.values())
    assert any("mixed.jsonl:" in e for e in m.skip_examples["malformed_json"])
    n = {s: sum(i.num_samples for i in m.splits[s]) for s in ("train", "val")}
    assert n["train"] + n["val"] == m.records_kept and n["val"] >= 1
    # Every kept sample: ids/mask aligned, some trainable token, ends within max_len.
    tok = Target.open(smollm2_dir).tokenizer()
    rows = read_split(tmp_path / "out", "train").to_pylist() + read_split(tmp_path / "out", "val").to_pylist()
    by_id = {r["record_id"]: r for r in rows}
    for r in rows:
        assert len(r["input_ids"]) == len(r["loss_mask"]) <= 256 and sum(r["loss_mask"]) > 0
    r = by_id["c5"]
    ids, mask = np.array(r["input_ids"]), np.array(r["loss_mask"])
    assert tok.decode(ids[mask == 1]) == "answer number 5, with some words.<|im_end|>" + "then " * 6 + "done.<|im_end|>"


def test_vocab_counts_only_masked_tokens(tmp_path, smollm2_dir):
    # User turns repeat one word 50x; assistant turns use other words. With a draft vocab of
    # 8 the user word must not be chosen.
    recs = [sg(i, ("human", "zebra " * 50), ("gpt", "yes no maybe")) for i in range(30)]
    recs += [sg(100 + i, ("human", f"q{i}"), ("gpt", "yes no maybe " + "ok " * (i % 3))) for i in range(30)]
    src = tmp_path / "v.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in recs))
    m = prepare(smollm2_dir, tmp_path / "o", PrepareConfig(data=str(src), draft_vocab=8, val_fraction=0.0),
                progress=False)
    tok = Target.open(smollm2_dir).tokenizer()
    d2t, t2d = load_maps(tmp_path / "o" / "vocab_map.safetensors")
    chosen = {tok.convert_ids_to_tokens(int(i)) for i in t2d.nonzero().flatten()}
    zebra = set(tok.tokenize(" zebra")) | set(tok.tokenize("zebra"))
    assert not (chosen & zebra)
    assert {"yes", "Ġno", "Ġmaybe", "<|im_end|>"} <= chosen
    assert int(t2d.sum()) == 8 and torch.equal(torch.arange(8) + d2t, t2d.nonzero().flatten())
    # Coverage: share of trainable train tokens the 8 ids cover.
    rows = read_split(tmp_path / "o", "train").to_pylist()
    masked = np.concatenate([np.array(r["input_ids"])[np.array(r["loss_mask"]) == 1] for r in rows])
    assert m.vocab_map.coverage == pytest.approx(float(np.isin(masked, t2d.nonzero().numpy()).mean()))


def test_rerun_is_bitwise_identical_and_path_independent(tmp_path, smollm2_dir):
    src = tmp_path / "d.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in GOOD))
    cfg = PrepareConfig(data=str(src), max_len=128, draft_vocab=300, val_fraction=0.2, shard_samples=7)
    a = prepare(smollm2_dir, tmp_path / "a", cfg, progress=False)
    src2 = tmp_path / "copy.jsonl"
    src2.write_bytes(src.read_bytes())
    b = prepare(smollm2_dir, tmp_path / "b", cfg.model_copy(update={"data": str(src2)}), progress=False)
    assert len(a.splits["train"]) > 1
    assert a.splits == b.splits and a.fingerprint == b.fingerprint
    assert a.vocab_map == b.vocab_map
    # A finished dir is not rewritten.
    mtime = (tmp_path / "a" / "train-00000.parquet").stat().st_mtime_ns
    again = prepare(smollm2_dir, tmp_path / "a", cfg, progress=False)
    assert again.fingerprint == a.fingerprint
    assert (tmp_path / "a" / "train-00000.parquet").stat().st_mtime_ns == mtime


def test_split_is_stable_when_data_grows(tmp_path, smollm2_dir):
    src = tmp_path / "d.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in GOOD[:30]))
    cfg = PrepareConfig(data=str(src), val_fraction=0.25)
    prepare(smollm2_dir, tmp_path / "a", cfg, progress=False)
    src.write_text("\n".join(json.dumps(r) for r in GOOD))
    prepare(smollm2_dir, tmp_path / "b", cfg, progress=False)
    val_a = set(read_split(tmp_path / "a", "val").column("sample_id").to_pylist())
    val_b = set(read_split(tmp_path / "b", "val").column("sample_id").to_pylist())
    assert val_a and val_a <= val_b


def test_interrupted_run_leaves_no_manifest_and_rerun_equals_clean(tmp_path, smollm2_dir):
    src = tmp_path / "d.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in GOOD))
    cfg = PrepareConfig(data=str(src), shard_samples=5, batch_size=4)
    seen = []

    def boom(rid, ids, mask):
        seen.append(rid)
        if len(seen) == 23:
            raise KeyboardInterrupt  # as if killed mid-stage

    with pytest.raises(KeyboardInterrupt):
        prepare(smollm2_dir, tmp_path / "x", cfg, progress=False, on_sample=boom)
    assert not (tmp_path / "x" / "manifest.json").exists()
    assert not list((tmp_path / "x").glob(".*.tmp"))
    assert not PreparedData.exists(tmp_path / "x")
    resumed = prepare(smollm2_dir, tmp_path / "x", cfg, progress=False)
    clean = prepare(smollm2_dir, tmp_path / "y", cfg, progress=False)
    assert resumed.splits == clean.splits and resumed.fingerprint == clean.fingerprint
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == sorted(p.name for p in (tmp_path / "y").iterdir())


def test_min_val_guarantee(tmp_path, smollm2_dir):
    src = tmp_path / "d.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in GOOD[:5]))
    m = prepare(smollm2_dir, tmp_path / "o", PrepareConfig(data=str(src), val_fraction=0.0, min_val=1),
                progress=False)
    assert [i.num_samples for i in m.splits["val"]] == [1]
    assert sum(i.num_samples for i in m.splits["train"]) == 4


def test_errors_leave_no_output(tmp_path, smollm2_dir):
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps(GOOD[0]))
    with pytest.raises(ValueError, match="--max-len 20 leaves no room.*31 tokens"):
        prepare(smollm2_dir, tmp_path / "o1", PrepareConfig(data=str(src), max_len=20), progress=False)
    assert not (tmp_path / "o1").exists()
    only_bad = tmp_path / "bad.jsonl"
    only_bad.write_text("{oops\n" + json.dumps(sg(1, ("human", "q"))) + "\n")
    with pytest.raises(ValueError, match=r"no usable conversation among 2 read.*malformed_json"):
        prepare(smollm2_dir, tmp_path / "o2", PrepareConfig(data=str(only_bad)), progress=False)
    assert not (tmp_path / "o2" / "manifest.json").exists()
    with pytest.raises(ValueError, match="exceeds the target vocab"):
        prepare(smollm2_dir, tmp_path / "o3", PrepareConfig(data=str(src), draft_vocab=10**6), progress=False)


def test_tokenizer_without_template_or_missing(tmp_path, smollm2_dir):
    import shutil

    d = tmp_path / "notemplate"
    shutil.copytree(smollm2_dir, d, ignore=shutil.ignore_patterns("*.safetensors"))
    (d / "chat_template.jinja").unlink()
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps(GOOD[0]))
    with pytest.raises(ValueError, match="has no chat template"):
        prepare(d, tmp_path / "o", PrepareConfig(data=str(src)), progress=False)
    e = tmp_path / "empty-model"
    e.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        prepare(e, tmp_path / "o", PrepareConfig(data=str(src)), progress=False)
    shutil.copy(smollm2_dir / "config.json", e / "config.json")
    with pytest.raises(ValueError, match="no tokenizer files"):
        prepare(e, tmp_path / "o", PrepareConfig(data=str(src)), progress=False)


def test_real_sharegpt_limit_and_cli(tmp_path, smollm2_dir):
    out = tmp_path / "sg"
    r = subprocess.run([sys.executable, "-m", "eagle3.cli", "prepare", "--model", str(smollm2_dir), "--data",
                        "sharegpt", "--limit", "300", "--max-len", "1024", "--draft-vocab", "4096",
                        "--out", str(out), "--show", "1"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    m = PreparedData.read(out)
    assert m.records_read == 300 and m.records_kept + sum(m.skipped.values()) == 300
    assert m.vocab_map.draft_vocab_size == 4096 and 0.9 < m.vocab_map.coverage <= 1.0
    assert 0.5 < m.num_trainable_tokens / m.num_tokens < 0.95  # ShareGPT with SmolLM2's template: ~73% assistant tokens
    assert "«" in r.stdout  # --show highlights trainable spans (no TTY: «…» markers)
    t = pq.read_table(out / m.splits["train"][0].file)
    assert t.schema.field("input_ids").type.value_type.bit_width == 32


def test_cli_bad_input_is_one_line_no_traceback(tmp_path, smollm2_dir):
    r = subprocess.run([sys.executable, "-m", "eagle3.cli", "prepare", "--model", str(smollm2_dir), "--data",
                        str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2
    assert r.stderr.startswith("eagle3 prepare: error:") and "Traceback" not in r.stderr


def test_vocab_from_reuses_the_map_exactly(tmp_path, smollm2_dir):
    src = tmp_path / "d.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in GOOD[:20]))
    a = prepare(smollm2_dir, tmp_path / "a", PrepareConfig(data=str(src), draft_vocab=64), progress=False)
    src.write_text("\n".join(json.dumps(r) for r in GOOD))  # the data grew: counts change
    b = prepare(smollm2_dir, tmp_path / "b", PrepareConfig(data=str(src), vocab_from=str(tmp_path / "a")),
                progress=False)
    da, ta = load_maps(tmp_path / "a" / "vocab_map.safetensors")
    db, tb = load_maps(tmp_path / "b" / "vocab_map.safetensors")
    assert torch.equal(da, db) and torch.equal(ta, tb)
    assert b.vocab_map.draft_vocab_size == 64 and b.vocab_map.sha256 == a.vocab_map.sha256
    assert 0 < b.vocab_map.coverage <= 1
    with pytest.raises(ValueError, match="does not exist"):
        prepare(smollm2_dir, tmp_path / "c", PrepareConfig(data=str(src), vocab_from=str(tmp_path / "nope")),
                progress=False)
