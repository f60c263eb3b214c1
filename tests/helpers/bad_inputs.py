"""The bad-input corpus: malformed inputs across every stage, each with the clean outcome it must get.

Shared by tests/integration/test_bad_inputs.py (in process) and benchmarks/drills/faults.py (real subprocesses). A case
writes its bad input under a fresh dir and returns an `eagle3` command line. It is handled cleanly
when the command either
- fails with exit status != 0, no traceback, and an `eagle3 <cmd>...error:` line that matches
  `expect` (the file or record named, and the reason), leaving no new file in its --out dir but
  the lock file; or
- succeeds with exactly the `skipped` counts in its manifest (a counted skip).
"""
from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[2]
GOOD = [{"conversations": [{"from": "human", "value": f"question {i}: what is {i} plus {i}?"},
                           {"from": "gpt", "value": f"{i} plus {i} is {2 * i}. " * 3}]} for i in range(6)]
AUX = "1,3,4"  # the 6-layer tiny Llama


@dataclass
class Base:
    """Good inputs the cases start from: a model dir and finished prepare / extract / verifier dirs."""

    model: Path
    prep: Path
    hid: Path
    ver: Path


def build_base(root: Path, model: Path) -> Base:
    from eagle3.config import ExtractConfig, PrepareConfig
    from eagle3.extract import run_extract
    from eagle3.prepare import prepare
    from eagle3.verifier import extract_verifier

    src = jsonl(root / "good.jsonl", GOOD)
    b = Base(model, root / "prep", root / "hid", root / "ver")
    prepare(model, b.prep, PrepareConfig(data=str(src), draft_vocab=128, val_fraction=0.3), progress=False)
    run_extract(model, b.prep, b.hid, ExtractConfig(aux_layer_ids=[1, 3, 4]), show_progress=False)
    extract_verifier(model, b.prep, b.ver)
    return b


@dataclass
class Case:
    kind: str
    stage: str
    build: Callable[[Path, Base], list[str]]  # (work dir, base) -> argv of `eagle3`
    expect: str = ""  # regex over the error line
    skipped: dict[str, int] | None = None  # a counted skip: the manifest's exact `skipped`
    kept: int | None = None


@dataclass
class Outcome:
    kind: str
    clean: bool
    detail: str
    rc: int = 0
    stderr: str = field(default="", repr=False)


# ---------------------------------------------------------------- builders
def jsonl(path: Path, rows: list, extra: list[bytes] = ()) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r).encode() for r in rows] + list(extra)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def conv(*turns: tuple) -> dict:
    return {"conversations": [dict(zip(("from", "value"), t, strict=True)) for t in turns]}


def prep_cmd(w: Path, b: Base, data: Path | str, *flags: str, model: Path | None = None) -> list[str]:
    return ["prepare", "--model", str(model or b.model), "--data", str(data), "--out", str(w / "out"), *flags]


def skip_case(kind: str, bad: list, reason: str, n: int = 1, raw: list[bytes] = ()) -> Case:
    """GOOD plus `bad` records (and raw lines): prepare keeps GOOD and counts `n` skips of `reason`."""
    return Case(kind, "prepare", lambda w, b: prep_cmd(w, b, jsonl(w / "in.jsonl", GOOD + bad, raw)),
                skipped={reason: n}, kept=len(GOOD))


def model_copy(w: Path, b: Base, drop: tuple[str, ...] = ()) -> Path:
    m = w / "model"
    shutil.copytree(b.model, m, ignore=shutil.ignore_patterns(*drop))
    return m


def no_template(w: Path, b: Base) -> list[str]:
    m = model_copy(w, b, drop=("chat_template.jinja",))
    cfg = json.loads((m / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (m / "tokenizer_config.json").write_text(json.dumps(cfg))
    return prep_cmd(w, b, jsonl(w / "in.jsonl", GOOD), model=m)


def sharded_index_missing(w: Path, b: Base) -> list[str]:
    m = model_copy(w, b, drop=("model.safetensors",))
    t = load_file(str(b.model / "model.safetensors"))
    names = sorted(t)
    half = len(names) // 2
    save_file({k: t[k] for k in names[:half]}, str(m / "model-00001-of-00002.safetensors"))
    wmap = {k: ("model-00001-of-00002.safetensors" if i < half else "model-00002-of-00002.safetensors")
            for i, k in enumerate(names)}  # the second file is never written
    (m / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    return ["verifier", "--model", str(m), "--prepared", str(b.prep), "--out", str(w / "out")]


def prep_variant(w: Path, b: Base, edit: Callable[[Path], None]) -> Path:
    """A copy of the good prepared dir with `edit` applied (manifest checksums refreshed when asked)."""
    p = w / "prep"
    shutil.copytree(b.prep, p)
    edit(p)
    return p


def token_id_past_vocab(p: Path) -> None:
    """Sample 0 of the first train shard holds an id the target has no embedding row for; the manifest's
    checksum is made to match (as a prepare with another tokenizer would have written it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle3.storage.hashing import sha256_file

    f = p / "train-00000.parquet"
    t = pq.read_table(f)
    ids = t["input_ids"].to_pylist()
    ids[0][1] = 10**6
    pq.write_table(t.set_column(t.schema.get_field_index("input_ids"), "input_ids",
                                pa.array(ids, type=t.schema.field("input_ids").type)), f)
    m = json.loads((p / "manifest.json").read_text())
    m["splits"]["train"][0]["sha256"] = sha256_file(f)
    (p / "manifest.json").write_text(json.dumps(m))


def d2t_mismatch(w: Path, b: Base) -> list[str]:
    from eagle3.storage.hashing import sha256_file
    from eagle3.storage.manifests import PreparedData

    def edit(p: Path) -> None:
        t = load_file(str(p / "vocab_map.safetensors"))
        d2t = t["d2t"].clone()
        d2t[-1] += 1  # the last draft id now points one past the target id t2d marks
        save_file({"d2t": d2t, "t2d": t["t2d"]}, str(p / "vocab_map.safetensors"))
        m = PreparedData.read(p)
        m.vocab_map.sha256 = sha256_file(p / "vocab_map.safetensors")  # checksum fine: the maps disagree
        m.write(p)

    return ["verifier", "--model", str(b.model), "--prepared", str(prep_variant(w, b, edit)), "--out", str(w / "out")]


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def hid_variant(w: Path, b: Base, edit: Callable[[Path], None]) -> Path:
    h = w / "hid"
    shutil.copytree(b.hid, h)
    edit(h)
    return h


def train_cmd(w: Path, b: Base, *flags: str, hid: Path | None = None, ver: Path | None = None) -> list[str]:
    return ["train", "--hidden", str(hid or b.hid), "--verifier", str(ver or b.ver), "--out", str(w / "out"),
            "--max-steps", "1", "--ttt-steps", "2", "--pack-tokens", "128", "--threads", "1", *flags]


def index_offset_past_shard(h: Path) -> None:
    """The store's index with record 1's offset moved past its shard's end, and the manifest's index checksum
    made to match (so only the offset check can catch it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle3.storage.hashing import sha256_file

    tab = pq.read_table(h / "index.parquet").to_pydict()
    tab["offset"][1] = 10**6
    pq.write_table(pa.table(tab), h / "index.parquet")
    m = json.loads((h / "manifest.json").read_text())
    m["index_sha256"] = sha256_file(h / "index.parquet")
    (h / "manifest.json").write_text(json.dumps(m))


def foreign_checkpoint(w: Path, b: Base) -> list[str]:
    """--out holds a valid checkpoint of another draft config (another ttt_steps)."""
    from eagle3.train import checkpoint as ckpt

    ckpt.save(w / "out", "step-00000001", {"fc.weight": torch.zeros(2, 2)}, {"pos": {}},
              {"config": {"ttt_steps": 7}, "inputs": {}, "step": 1})
    return train_cmd(w, b)


class _RunsCode:
    """A pickled object whose unpickling would call os.system (creating `marker`)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def pickled_checkpoint(w: Path, b: Base) -> list[str]:
    """--out holds a checkpoint whose state.pt carries a pickled object (meta.json's checksum fixed to match)."""
    from eagle3.storage.hashing import sha256_file
    from eagle3.train import checkpoint as ckpt

    d = ckpt.save(w / "out", "step-00000001", {"fc.weight": torch.zeros(2, 2)}, {"pos": {}},
                  {"config": {}, "inputs": {}, "step": 1})
    torch.save({"pos": {}, "rng": _RunsCode(w / "code-ran")}, d / "state.pt")
    meta = json.loads((d / "meta.json").read_text())
    meta["files"]["state.pt"] = sha256_file(d / "state.pt")
    (d / "meta.json").write_text(json.dumps(meta))
    return train_cmd(w, b)


def foreign_init(w: Path, b: Base) -> list[str]:
    """--init-from an exported draft of another config: right vocab map, other layer shapes."""
    d2t = load_file(str(b.ver / "verifier.safetensors"))["d2t"]
    (w / "other").mkdir(parents=True)
    save_file({"d2t": d2t, "fc.weight": torch.zeros(64, 96)}, str(w / "other" / "model.safetensors"))
    return train_cmd(w, b, "--config", str(config_file(w, f"init_from: {w / 'other'}\n")))


def other_target_verifier(w: Path, b: Base) -> list[str]:
    from eagle3.storage.manifests import VerifierWeights

    v = w / "ver"
    shutil.copytree(b.ver, v)
    m = VerifierWeights.read(v)
    m.hidden_size = 4096  # the verifier of a bigger target
    m.write(v)
    return train_cmd(w, b, ver=v)


def config_file(w: Path, text: str) -> Path:
    w.mkdir(parents=True, exist_ok=True)
    (w / "cfg.yaml").write_text(text)
    return w / "cfg.yaml"


def run_cmd(w: Path, b: Base, text: str) -> list[str]:
    return ["run", "--config", str(config_file(w, text)), "--dry-run"]


def manifest_dir(w: Path, text: str) -> list[str]:
    """`eagle3 verify` on a stage dir whose manifest.json holds `text`."""
    (w / "stage").mkdir(parents=True, exist_ok=True)
    (w / "stage" / "manifest.json").write_text(text)
    return ["verify", str(w)]


def parquet_wrong_columns(w: Path, b: Base) -> list[str]:
    w.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": ["a", "b"], "label": [1, 0]}), w / "in.parquet")
    return prep_cmd(w, b, w / "in.parquet")


CASES: list[Case] = [
    # ---- prepare: records (counted skips; the good records are kept)
    skip_case("broken_jsonl_line", [], "malformed_json", raw=[b'{"conversations": [{"from": "human", "value": "x"']),
    skip_case("non_utf8_line", [], "non_utf8",
              raw=['{"conversations": [{"from": "human", "value": "caf\xe9"}]}'.encode("latin-1")]),
    skip_case("line_not_an_object", [], "not_an_object", raw=[b"[1, 2, 3]"]),
    # nested 100,000 deep (Python's decoder recurses once per level): a counted skip, not an aborted prepare
    skip_case("record_nested_too_deep", [], "too_deep", n=2,
              raw=[b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000]),
    skip_case("unknown_role", [conv(("human", "hi"), ("robot", "beep"))], "unknown_role"),
    skip_case("missing_role", [{"conversations": [{"value": "hi"}, {"from": "gpt", "value": "hello"}]}],
              "unknown_role"),
    skip_case("empty_content", [conv(("human", "hi"), ("gpt", "  "))], "empty_turn"),
    skip_case("null_content", [conv(("human", "hi"), ("gpt", None))], "missing_content"),
    skip_case("no_assistant_turn", [conv(("human", "anyone?"))], "no_assistant_turn"),
    skip_case("empty_conversation", [{"conversations": []}], "empty_conversation"),
    skip_case("no_turns_field", [{"text": "just text"}], "bad_schema"),
    skip_case("turn_not_an_object", [{"conversations": ["hi", "hello"]}], "bad_schema"),
    skip_case("system_not_first", [conv(("human", "hi"), ("system", "be brief"), ("gpt", "ok"))], "system_not_first"),
    skip_case("duplicate_conversation", [GOOD[0]], "duplicate"),
    # a giant user turn: the assistant's answer starts beyond max_len, so nothing is trainable
    skip_case("giant_single_turn", [conv(("human", "word " * 50_000), ("gpt", "short answer"))], "no_trainable_tokens"),
    # ---- prepare: sources and models (refused in one line, nothing written)
    Case("broken_json_array", "prepare",
         lambda w, b: prep_cmd(w, b, jsonl(w / "in.json", [], [b'{"conversations": 3}'])),
         r"in\.json: not a JSON array"),
    Case("empty_dataset", "prepare", lambda w, b: prep_cmd(w, b, jsonl(w / "in.jsonl", [])), r"in\.jsonl: no usable"),
    Case("all_records_bad", "prepare",
         lambda w, b: prep_cmd(w, b, jsonl(w / "in.jsonl", [conv(("robot", "x"))] * 3)),
         r"in\.jsonl: no usable.*unknown_role"),
    Case("missing_data_path", "prepare", lambda w, b: prep_cmd(w, b, w / "nope.jsonl"), r"nope\.jsonl does not exist"),
    Case("unsupported_file_type", "prepare",
         lambda w, b: prep_cmd(w, b, jsonl(w / "in.csv", GOOD)), r"in\.csv: unsupported file type"),
    Case("parquet_wrong_columns", "prepare", parquet_wrong_columns, r"in\.parquet: no usable.*bad_schema"),
    Case("model_dir_missing", "prepare",
         lambda w, b: prep_cmd(w, b, jsonl(w / "in.jsonl", GOOD), model=w / "no-model"), r"no-model does not exist"),
    Case("model_without_tokenizer", "prepare",
         lambda w, b: prep_cmd(w, b, jsonl(w / "in.jsonl", GOOD), model=model_copy(w, b, drop=("tokenizer*",))),
         r"model: no tokenizer files"),
    Case("model_without_chat_template", "prepare", no_template, r"chat template"),
    Case("max_len_negative", "prepare",
         lambda w, b: prep_cmd(w, b, jsonl(w / "in.jsonl", GOOD), "--max-len", "-5"), r"max_len"),
    Case("max_len_below_template", "prepare",
         lambda w, b: prep_cmd(w, b, jsonl(w / "in.jsonl", GOOD), "--max-len", "20"), r"--max-len 20 leaves no room"),
    Case("draft_vocab_too_big", "prepare",
         lambda w, b: prep_cmd(w, b, jsonl(w / "in.jsonl", GOOD), "--draft-vocab", "10000000"),
         r"exceeds the target vocab"),
    Case("val_fraction_above_one", "prepare",
         lambda w, b: prep_cmd(w, b, jsonl(w / "in.jsonl", GOOD), "--val-fraction", "1.5"), r"val_fraction"),
    # ---- extract
    Case("aux_layer_out_of_range", "extract",
         lambda w, b: ["extract", "--model", str(b.model), "--prepared", str(b.prep), "--out", str(w / "out"),
                       "--aux-layers", "1,3,99"], r"aux layer ids \[1, 3, 99\] must lie in \[0, 6\)"),
    Case("aux_layers_unsorted", "extract",
         lambda w, b: ["extract", "--model", str(b.model), "--prepared", str(b.prep), "--out", str(w / "out"),
                       "--aux-layers", "4,1,3"], r"aux layer ids \[4, 1, 3\] must be strictly increasing"),
    Case("aux_layer_negative", "extract",
         lambda w, b: ["extract", "--model", str(b.model), "--prepared", str(b.prep), "--out", str(w / "out"),
                       "--aux-layers=-1,3,4"], r"in \[0, 6\)"),
    Case("aux_layers_not_integers", "extract",
         lambda w, b: ["extract", "--model", str(b.model), "--prepared", str(b.prep), "--out", str(w / "out"),
                       "--aux-layers", "a,b,c"], r"--aux-layers: expected comma-separated int values, got 'a,b,c'"),
    Case("prepared_dir_without_manifest", "extract",
         lambda w, b: ["extract", "--model", str(b.model), "--prepared", str(w), "--out", str(w / "out")],
         r"manifest\.json: no prepare manifest"),
    Case("prepared_shard_corrupt", "extract",
         lambda w, b: ["extract", "--model", str(b.model), "--out", str(w / "out"), "--aux-layers", AUX, "--prepared",
                       str(prep_variant(w, b, lambda p: corrupt(p / "train-00000.parquet")))],
         r"train-00000\.parquet: sha256 does not match"),
    Case("prepared_token_id_past_vocab", "extract",
         lambda w, b: ["extract", "--model", str(b.model), "--out", str(w / "out"), "--aux-layers", AUX, "--prepared",
                       str(prep_variant(w, b, token_id_past_vocab))],
         r"train-00000\.parquet: sample .*: token id 1000000 is outside the target's \d+ embedding rows"),
    Case("model_without_weights", "extract",
         lambda w, b: ["extract", "--model", str(model_copy(w, b, drop=("*.safetensors",))), "--prepared", str(b.prep),
                       "--out", str(w / "out"), "--aux-layers", AUX], r"model: no weight files"),
    # ---- verifier
    Case("index_points_at_missing_shard", "verifier", sharded_index_missing,
         r"model\.safetensors\.index\.json points at 1 missing file\(s\): model-00002-of-00002\.safetensors"),
    Case("d2t_does_not_match_t2d", "verifier", d2t_mismatch,
         r"vocab_map\.safetensors: t2d does not mark exactly the target ids that d2t maps to"),
    Case("vocab_map_missing", "verifier",
         lambda w, b: ["verifier", "--model", str(b.model), "--out", str(w / "out"), "--prepared",
                       str(prep_variant(w, b, lambda p: (p / "vocab_map.safetensors").unlink()))],
         r"vocab_map\.safetensors: vocab map named by the prepare manifest is missing"),
    # ---- train
    Case("checkpoint_of_another_draft_config", "train", foreign_checkpoint,
         r"step-00000001: checkpoint of a different config"),
    Case("checkpoint_carrying_pickled_object", "train", pickled_checkpoint,
         r"step-00000001/state\.pt: refused, it carries pickled Python objects \(.*posix\.system"),
    Case("init_from_another_draft_config", "train", foreign_init,
         r"init_from: .*other has other shapes for \['fc\.weight'\]"),
    Case("verifier_of_another_target", "train", other_target_verifier, r"verifier hidden size 4096"),
    Case("hidden_state_shard_corrupt", "train",
         lambda w, b: train_cmd(w, b, hid=hid_variant(w, b,
                                                     lambda h: corrupt(h / "shards" / "train-00000.safetensors"))),
         r"train-00000\.safetensors: sha256 differs from the manifest"),
    Case("hidden_state_shard_truncated", "train",
         lambda w, b: train_cmd(w, b, hid=hid_variant(
             w, b, lambda h: (h / "shards/train-00000.safetensors").write_bytes(
                 (h / "shards/train-00000.safetensors").read_bytes()[:1000]))),
         r"train-00000\.safetensors: truncated"),
    Case("hidden_state_index_edited", "train",
         lambda w, b: train_cmd(w, b, hid=hid_variant(w, b, lambda h: corrupt(h / "index.parquet"))),
         r"index\.parquet: checksum does not match the manifest's index_sha256"),
    Case("hidden_state_index_offset_past_shard", "train",
         lambda w, b: train_cmd(w, b, hid=hid_variant(w, b, index_offset_past_shard)),
         r"index\.parquet: record 1 \(sample '.*'\): tokens 1000000\.\.1000000\+\d+ lie outside shard 0"),
    Case("train_negative_pack_tokens", "train", lambda w, b: train_cmd(w, b, "--pack-tokens", "-5"), r"pack_tokens"),
    Case("train_config_unknown_key", "train",
         lambda w, b: train_cmd(w, b, "--config", str(config_file(w, "train:\n  ttt_stepz: 3\n"))), r"ttt_stepz"),
    Case("hidden_dir_missing", "train", lambda w, b: train_cmd(w, b, hid=w / "no-hid"), r"no-hid.*no extract manifest"),
    # ---- run (pipeline config)
    Case("config_not_yaml", "run", lambda w, b: run_cmd(w, b, "model: [unclosed\n"),
         r"cfg\.yaml: not valid YAML/JSON: while parsing a flow sequence .*line 1"),
    Case("config_unknown_key", "run", lambda w, b: run_cmd(w, b, f"model: {b.model}\nprepare:\n  max_lenn: 5\n"),
         r"max_lenn"),
    Case("config_negative_size", "run", lambda w, b: run_cmd(w, b, f"model: {b.model}\ntrain:\n  pack_tokens: -1\n"),
         r"pack_tokens"),
    Case("config_file_missing", "run", lambda w, b: ["run", "--config", str(w / "nope.yaml"), "--dry-run"],
         r"nope\.yaml does not exist"),
    Case("config_not_a_mapping", "run", lambda w, b: run_cmd(w, b, "- a\n- b\n"), r"top level must be a mapping"),
    # ---- eval and verify
    Case("eval_prompts_missing", "eval",
         lambda w, b: ["eval", "--model", str(b.model), "--draft", str(w / "no-draft"), "--prompts",
                       str(w / "no-prompts.jsonl"), "--out", str(w / "out")], r"no-(draft|prompts)"),
    Case("eval_k_zero", "eval",
         lambda w, b: ["eval", "--model", str(b.model), "--draft", str(b.ver), "--k", "0", "--out", str(w / "out")],
         r"\bk\b"),
    Case("verify_missing_dir", "verify", lambda w, b: ["verify", str(w / "nothing")], r"nothing does not exist"),
    Case("verify_manifest_empty_object", "verify", lambda w, b: manifest_dir(w, "{}"),
         r"manifest\.json: kind None is no stage's"),
    Case("verify_manifest_a_list", "verify", lambda w, b: manifest_dir(w, "[]"),
         r"manifest\.json: a JSON list, not a manifest"),
    Case("verify_manifest_keys_missing", "verify", lambda w, b: manifest_dir(w, '{"kind": "extract", "version": 1}'),
         r"manifest\.json: its fingerprint does not match its content"),
]


# ---------------------------------------------------------------- running a case
def _files(d: Path | None) -> set[str]:
    if d is None or not d.exists():
        return set()
    return {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and p.name != ".eagle3.lock"}


def _out(argv: list[str]) -> Path | None:
    return Path(argv[argv.index("--out") + 1]) if "--out" in argv else None


def run_cli(argv: list[str], subprocess_mode: bool) -> tuple[int, str]:
    """(exit status, stderr) of `eagle3 ARGV`: a real process, or `flows.cli.main` in this one (an
    exception escaping main counts as a traceback)."""
    if subprocess_mode:
        r = subprocess.run([sys.executable, "-m", "flows.cli", *argv], capture_output=True, text=True, cwd=REPO,
                           timeout=600)
        return r.returncode, r.stderr
    from flows.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse refusals
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:
            return 1, err.getvalue() + traceback.format_exc()
    return rc, err.getvalue()


def run_case(case: Case, work: Path, base: Base, subprocess_mode: bool = False) -> Outcome:
    argv = case.build(work, base)
    out = _out(argv)
    before = _files(out)
    rc, err = run_cli(argv, subprocess_mode)

    def done(ok: bool, why: str) -> Outcome:
        return Outcome(case.kind, ok, why, rc, err)

    if "Traceback" in err:
        return done(False, "traceback on stderr")
    if case.skipped is not None:
        if rc != 0:
            return done(False, f"exit {rc}, expected a counted skip: {err.strip().splitlines()[-1:]}")
        m = json.loads((out / "manifest.json").read_text())
        if m["skipped"] != case.skipped or (case.kept is not None and m["records_kept"] != case.kept):
            return done(False, f"skipped {m['skipped']} kept {m['records_kept']}, expected {case.skipped} {case.kept}")
        return done(True, f"counted skip {case.skipped}")
    if rc == 0:
        return done(False, "exit 0, expected a refusal")
    lines = err.rstrip().splitlines()
    first = next((i for i, ln in enumerate(lines) if "error: " in ln), None)
    if first is None:
        return done(False, f"no error line: {lines[-3:]}")
    if any("error: " not in ln for ln in lines[first:]):  # a torchrun-style wrapper may add its own error line
        return done(False, f"the message spans several lines: {lines[first:first + 3]}")
    hit = next((ln for ln in lines[first:] if re.search(case.expect, ln)), None)
    if hit is None:
        return done(False, f"no error line matches {case.expect!r}: {lines[first:]}")
    new = _files(out) - before
    if new:
        return done(False, f"left partial output: {sorted(new)[:5]}")
    return done(True, hit.strip())
