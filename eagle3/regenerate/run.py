"""`eagle3 regenerate`: rewrite every assistant turn of a chat dataset with the target model itself.

A draft learns to predict the *target's* continuations; ShareGPT's answers were written by other
models, so a head trained on them learns the wrong distribution (SpecForge, ModelOpt and
ArcticTraining all ship this step). For each conversation the user (and system) turns are kept and
assistant turn i is generated from the target's chat template over the *regenerated* history
[system, u_1, a'_1, ..., u_i] -- the history the target would really see when serving.

Scheduling: conversations are read in chunks of `chunk_records`. Within a chunk, turn 1 of every
conversation is generated as one wave, then turn 2 of those that have one, and so on; a backend
batches a wave however it likes (hf: length-sorted batches of `batch_size` with a KV cache; vllm:
one `LLM.generate` call, continuous batching inside).

Output `regenerated.jsonl`: one line per kept record, in source order:
    {"id": <source id>, "messages": [{"role", "content"}, ...],
     "provenance": {"source_id", "source_index", "model", "settings", "key",
                    "turns": [{"tokens": n, "finish": "stop"|"length"}, ...]}}

Resume: after each chunk its lines are appended and fsynced, then `progress.json` (byte length
of the committed file, records read, counters) is replaced atomically. A restart truncates the
file to the committed length and continues at the next chunk; chunk boundaries depend only on
the source order, so a resumed run writes the same bytes as an uninterrupted one.

Reuse: each record's key is sha256(model fingerprint, settings, its system + user turns). Lines
of earlier outputs (`reuse=` dirs, and this dir's own previous file when the source or limit
changed) with the same key are copied instead of regenerated; only id/source fields are
rewritten. So a nightly dataset that grew by 5% costs about 5% of a full regeneration.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.config import RegenConfig
from eagle3.data.normalize import Skip, normalize
from eagle3.data.readers import Bad, ReadStats, fingerprint_source, iter_source, resolve_source
from eagle3.decoding.generate import Generator
from eagle3.model.target import Target, prompt_ids
from eagle3.runtime.heap import retain_freed_memory
from eagle3.storage.atomic import atomic_write_json, clean_temp_files, fsync_dir
from eagle3.storage.hashing import sha256_file, sha256_json
from eagle3.storage.manifests import MANIFEST, RegeneratedData

log = logging.getLogger("eagle3.regenerate")

OUT_FILE = "regenerated.jsonl"
PROGRESS = "progress.json"
PREVIOUS = ".previous.jsonl"  # this dir's earlier output, kept as a reuse source until the run ends
FORMAT = 1  # of the JSONL records and of progress.json
_EXAMPLES = 3  # record ids kept per skip reason
_SAMPLES = 3  # records shown side by side in the manifest
_SAMPLE_CHARS = 600
_THINK = re.compile(r"<think>.*?(</think>|\Z)", re.S)  # an unclosed block (cut by max_new_tokens) runs to the end

Progress = Callable[[dict[str, Any]], None]


# ================================================================ records
def record_key(model_fp: str, settings: dict[str, Any], msgs: list[dict[str, str]]) -> str:
    """Reuse key: the target, the settings and the prompt side of the conversation (assistant text excluded)."""
    prompt_side = [(m["role"], m["content"] if m["role"] != "assistant" else None) for m in msgs]
    return sha256_json({"model": model_fp, "settings": settings, "turns": prompt_side})


def turn_seed(seed: int, key: str, turn: int) -> int:
    """A sampling seed per (record, turn): the same record gets the same draws in any batch or run."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}:{turn}".encode()).digest()[:7], "big")


def clean_answer(text: str, reasoning: str) -> str:
    if reasoning == "drop":
        text = _THINK.sub("", text).lstrip()
    return text


@dataclass
class _Conv:
    """One conversation being regenerated: the fixed prompt side and the answers so far."""

    index: int  # position in the source (records read before it)
    rid: str
    key: str
    original: list[dict[str, str]]
    users: list[int]  # indices in `original` of the user turns that get an answer
    msgs: list[dict[str, str]] = field(default_factory=list)  # regenerated history so far
    turns: list[dict[str, Any]] = field(default_factory=list)
    open: bool = True  # more turns to generate
    shortened: str = ""  # why the conversation ended before its last user turn


@dataclass
class _State:
    """What progress.json holds: enough to continue a killed run at the next chunk."""

    signature: str
    bytes: int = 0
    records_read: int = 0
    records_written: int = 0
    turns_written: int = 0
    turns_cut: int = 0
    shortened: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    skip_examples: dict[str, list[str]] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    format: int = FORMAT

    def skip(self, rid: str, reason: str, detail: str = "") -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        ex = self.skip_examples.setdefault(reason, [])
        if len(ex) < _EXAMPLES:
            ex.append(f"{rid}: {detail}" if detail else rid)


# ================================================================ reuse index
class ReuseIndex:
    """key -> (file, byte offset, length) over earlier regenerated JSONL files; lines read on demand."""

    def __init__(self) -> None:
        self.where: dict[str, tuple[Path, int, int]] = {}

    def add_file(self, path: Path, limit: int | None = None) -> int:
        n = 0
        with open(path, "rb") as f:
            off = 0
            for line in f:
                if limit is not None and off + len(line) > limit:
                    break
                try:
                    key = json.loads(line)["provenance"]["key"]
                except (ValueError, KeyError, TypeError):
                    key = None  # not one of ours, or torn: ignored
                if isinstance(key, str) and key not in self.where:
                    self.where[key] = (path, off, len(line))
                    n += 1
                off += len(line)
        return n

    def add_dir(self, d: str | Path) -> int:
        """An earlier output dir (finished, or the committed part of an unfinished one)."""
        d = Path(d)
        f = d / OUT_FILE
        if not f.is_file():
            raise ValueError(f"--reuse {d}: no {OUT_FILE} (not a regenerate output dir)")
        limit = None if (d / MANIFEST).is_file() else _committed_bytes(d / PROGRESS)
        return self.add_file(f, limit)

    def get(self, key: str) -> dict[str, Any] | None:
        hit = self.where.get(key)
        if hit is None:
            return None
        path, off, n = hit
        try:  # the file may have been rewritten since it was indexed: then the key check fails
            with open(path, "rb") as f:
                f.seek(off)
                rec = json.loads(f.read(n))
        except (OSError, ValueError):
            return None
        return rec if isinstance(rec, dict) and rec.get("provenance", {}).get("key") == key else None


def _committed_bytes(progress: Path) -> int:
    """Length of the committed part of an unfinished output (0 when unknown)."""
    try:
        return int(json.loads(progress.read_text()).get("bytes", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


# ================================================================ driver
def _open_state(out: Path, signature: str, reuse: ReuseIndex) -> _State:
    """Continue a run with the same signature, or start over keeping the old output as a reuse source."""
    f, prog, prev = out / OUT_FILE, out / PROGRESS, out / PREVIOUS
    if prog.is_file():
        try:
            st = _State(**json.loads(prog.read_text()))
        except (ValueError, TypeError):
            st = None
        if st is not None and st.signature == signature and st.format == FORMAT and f.is_file() \
                and f.stat().st_size >= st.bytes:
            with open(f, "rb+") as fh:  # drop a chunk that was appended but never committed
                fh.truncate(st.bytes)
                os.fsync(fh.fileno())
            if prev.is_file():
                reuse.add_file(prev)
            return st
    # A different run (or none) was here: what it committed may still be reused.
    finished = (out / MANIFEST).is_file()
    (out / MANIFEST).unlink(missing_ok=True)  # first: a manifest must never describe a file being replaced
    if f.is_file():
        size = f.stat().st_size
        committed = size if finished else min(_committed_bytes(prog), size)
        if committed > 0:
            with open(f, "rb+") as fh:
                fh.truncate(committed)
                os.fsync(fh.fileno())
            os.replace(f, prev)  # replaces an even older .previous.jsonl: this one has all we kept
        else:
            f.unlink()
    if prev.is_file():
        reuse.add_file(prev)
    st = _State(signature=signature)
    atomic_write_json(prog, st.__dict__)  # before the empty file: a crash in between starts over cleanly
    f.write_bytes(b"")
    return st


def _chunks(src: Path, stats: ReadStats, size: int, limit: int | None) -> Iterator[tuple[int, list]]:
    """(index of its first record, records) in chunks of `size` read records (bad ones included), up to `limit`."""
    buf: list = []
    start = 0
    for rec in iter_source(src, stats):
        if limit is not None and start + len(buf) >= limit:
            break
        buf.append(rec)
        if len(buf) == size:
            yield start, buf
            start, buf = start + size, []
    if buf:
        yield start, buf


def inputs(model: str | Path, data: str, cfg: RegenConfig, trust_remote_code: bool = False) -> dict[str, Any]:
    """What the regenerated answers depend on: the source's content, the target's (weights, tokenizer,
    template, stop ids) and the settings that change the text (batch, chunk and parallelism settings
    change speed only). The stage's "already done" check and the Prefect task's cache key are both this dict."""
    return {
        "source": fingerprint_source(resolve_source(data)),
        "model": Target.open(model, trust_remote_code).generation_fingerprint(),
        "config": cfg.model_dump(mode="json", exclude={"chunk_records", "batch_size", "batch_tokens",
                                                       "tensor_parallel_size", "gpu_memory_utilization"}),
    }


def _finished(out: Path, fp: dict[str, Any]) -> RegeneratedData | None:
    """The manifest in `out` if it was written for exactly these inputs (`fp`, see `inputs`) and its output
    file is there, else None."""
    if (out / MANIFEST).is_file():
        try:
            done = RegeneratedData.read(out)
            if done.inputs == fp and (out / OUT_FILE).is_file():
                return done
        except ValueError:
            pass
    return None


def _resume(out: Path, signature: str, reuse: Sequence[str | Path]) -> tuple[_State, ReuseIndex]:
    """Open `out` for the run named by `signature`: the committed state to continue from (see `_open_state`)
    and the index of earlier outputs (`reuse` dirs, other than `out` itself) whose lines can be copied."""
    out.mkdir(parents=True, exist_ok=True)
    clean_temp_files(out)
    index = ReuseIndex()
    for d in reuse:
        if Path(d).resolve() != out.resolve():
            index.add_dir(d)
    return _open_state(out, signature, index), index


@dataclass
class _Run:
    """One regeneration in progress: the fixed setup and this process's counters.

    `st` is what progress.json commits (it survives a restart); the counters here describe the work of
    this process only (reused lines, tokens, time) and go to the manifest's stats.
    """

    out: Path
    cfg: RegenConfig
    tok: Any  # the target's tokenizer
    generator: Generator
    max_len: int  # prompt + answer tokens a turn may span
    model_fp: str
    settings: dict[str, Any]
    index: ReuseIndex
    st: _State
    read_stats: ReadStats = field(default_factory=ReadStats)
    t0: float = field(default_factory=time.perf_counter)
    gen_s: float = 0.0  # seconds spent inside the backend
    reused: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    resumed_records: int = field(init=False)  # records and bytes already committed when this process started
    resumed_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.resumed_records, self.resumed_bytes = self.st.records_written, self.st.bytes

    def chunk(self, start: int, chunk: list) -> None:
        """Regenerate one chunk (`chunk`: read records, the first at source index `start`) and commit its
        lines: appended to the output, then progress.json records the new length and `records_read`."""
        convs, slots = self.plan(start, chunk)
        t = time.perf_counter()
        ntok, nprompt = _run_waves(convs, self.generator, self.tok, self.cfg, self.max_len)
        self.gen_s += time.perf_counter() - t
        self.generated_tokens += ntok
        self.prompt_tokens += nprompt
        lines = self.lines(slots)
        self.st.records_read = start + len(chunk)
        _commit(self.out, self.st, lines)

    def plan(self, start: int, chunk: list) -> tuple[list[_Conv], list[tuple[int, _Conv | dict]]]:
        """Sort a chunk's records: skipped (unreadable, invalid), reused (a line with the same key is indexed)
        or to generate. Returns (conversations to generate, slots): slots are (source index, conversation or
        reused record) for every record that may be written, in source order."""
        convs: list[_Conv] = []
        slots: list[tuple[int, _Conv | dict]] = []  # (source index, conversation or reused record), in order
        for j, rec in enumerate(chunk):
            i = start + j
            if isinstance(rec, Bad):
                self.st.skip(rec.record_id, rec.reason, rec.detail)
                continue
            try:
                msgs = normalize(rec.obj, self.cfg.same_role)
            except Skip as s:
                self.st.skip(rec.record_id, s.reason, s.detail)
                continue
            key = record_key(self.model_fp, self.settings, msgs)
            hit = self.index.get(key)
            if hit is not None:
                self.reused += 1
                slots.append((i, _relabel(hit, rec.record_id, i, msgs)))
                continue
            c = _Conv(i, rec.record_id, key, msgs, [k for k, m in enumerate(msgs) if m["role"] == "user"],
                      msgs=[m for m in msgs if m["role"] == "system"])
            convs.append(c)
            slots.append((i, c))
        return convs, slots

    def lines(self, slots: list[tuple[int, _Conv | dict]]) -> list[bytes]:
        """The JSONL lines of a chunk's generated or reused records, in source order; a conversation that got
        no answer is counted as skipped. Updates the committed counters and samples in `st`."""
        st = self.st
        lines: list[bytes] = []
        for _, s in slots:
            if isinstance(s, dict):  # reused
                orig = s.pop("_original")
                rec = s
            else:
                if not s.turns:
                    st.skip(s.rid, s.shortened or "no_answer", "no assistant turn could be generated")
                    continue
                if s.shortened:
                    st.shortened += 1
                rec = _record(s, self.model_fp, self.settings)
                orig = s.original
            st.records_written += 1
            st.turns_written += len(rec["provenance"]["turns"])
            st.turns_cut += sum(t["finish"] == "length" for t in rec["provenance"]["turns"])
            if len(st.samples) < _SAMPLES:
                st.samples.append(_sample(rec, orig))
            lines.append((json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8"))
        return lines

    def progress(self) -> dict[str, Any]:
        """What the `progress` callback gets after each committed chunk."""
        dt = max(self.gen_s, 1e-9)
        return {"records_read": self.st.records_read, "records_written": self.st.records_written,
                "tokens_generated": self.generated_tokens, "tokens_per_second": self.generated_tokens / dt}

    def stats(self) -> dict[str, Any]:
        """The manifest's `stats`: this process's throughput, reuse and resume counts."""
        gen_s, wall = self.gen_s, time.perf_counter() - self.t0
        return {"tokens_generated": self.generated_tokens, "prompt_tokens": self.prompt_tokens,
                "generate_seconds": round(gen_s, 3),
                "tokens_per_second": round(self.generated_tokens / gen_s, 2) if gen_s else 0.0,
                "wall_seconds": round(wall, 3), "records_reused": self.reused,
                "records_resumed": self.resumed_records, "bytes_resumed": self.resumed_bytes,
                "unreadable_tail_bytes": self.read_stats.unreadable_tail_bytes}


def _counts(st) -> dict:
    """The manifest's record and turn counts from the run's state."""
    return dict(records_read=st.records_read, records_written=st.records_written,
                skipped=dict(sorted(st.skipped.items())), skip_examples=st.skip_examples,
                turns_written=st.turns_written, turns_cut=st.turns_cut, conversations_shortened=st.shortened,
                samples=st.samples)


def regenerate(
    model: str | Path,
    data: str,
    out: str | Path,
    cfg: RegenConfig,
    reuse: Sequence[str | Path] = (),
    generator: Generator | None = None,
    progress: Progress | None = None,
    trust_remote_code: bool = False,
) -> RegeneratedData:
    """Run the stage; returns the manifest (also written to `out/manifest.json`).

    `generator` replaces the backend cfg.backend would build (tests, benchmarks; it must use the
    target in `model`). Rerunning with the same inputs returns the finished manifest untouched.
    """
    model, out = Path(model), Path(out)
    retain_freed_memory()
    target = Target.open(model, trust_remote_code)
    src = resolve_source(data)
    fp = inputs(model, data, cfg, trust_remote_code)
    done = _finished(out, fp)
    if done is not None:
        log.info("regenerate: %s already holds this exact result; nothing to do", out)
        return done

    tok = target.tokenizer()
    eos = target.stop_ids()
    max_len = cfg.max_len or target.max_position_embeddings
    own = generator is None  # an engine built here is stopped here, once the answers are written
    if own:
        generator = make_generator(target, cfg, max_len, eos)
    settings = cfg.settings(generator.dtype, max_len)
    signature = sha256_json({"format": FORMAT, "inputs": fp, "settings": settings, "limit": cfg.limit,
                             "same_role": cfg.same_role, "chunk": cfg.chunk_records})
    st, index = _resume(out, signature, reuse)
    run = _Run(out, cfg, tok, generator, max_len, fp["model"], settings, index, st)

    for start, chunk in _chunks(src, run.read_stats, cfg.chunk_records, cfg.limit):
        if start < st.records_read:  # committed before a restart (commits fall on chunk boundaries)
            continue
        run.chunk(start, chunk)
        if progress is not None:
            progress(run.progress())

    if own and hasattr(generator, "close"):
        generator.close()
    if st.records_written == 0:
        raise ValueError(f"{data}: no conversation could be regenerated among {st.records_read} read; "
                         f"skipped: {st.skipped}; examples: {st.skip_examples}")
    m = RegeneratedData(
        config=cfg.model_dump(mode="json"), inputs=fp, model_dir=str(model), model_fingerprint=fp["model"],
        source=str(src), source_fingerprint=fp["source"], backend=generator.name, settings=settings,
        sha256=sha256_file(out / OUT_FILE), **_counts(st), stats=run.stats())
    m.write(out)
    (out / PREVIOUS).unlink(missing_ok=True)
    log.info("regenerate: %d of %d records written (%d reused, %d resumed), %d tokens generated at %.1f tok/s; "
             "skipped %s", st.records_written, st.records_read, run.reused, run.resumed_records,
             run.generated_tokens, m.stats["tokens_per_second"], st.skipped)
    return m


def _run_waves(convs: list[_Conv], gen: Generator, tok, cfg: RegenConfig, max_len: int) -> tuple[int, int]:
    """Generate every turn of `convs`: wave t answers user turn t of each conversation still open.

    Returns (tokens generated (stop tokens included: they were computed too), prompt tokens prefilled).
    """
    ntok = nprompt = 0
    t = 0
    while True:
        wave, prompts, seeds = [], [], []
        for c in convs:
            if not c.open:
                continue
            if t >= len(c.users):
                c.open = False
                continue
            ids = prompt_ids(tok, c.msgs + [c.original[c.users[t]]])
            if len(ids) + cfg.max_new_tokens > max_len:
                # The answer might not fit the context: end the conversation before this turn.
                c.open, c.shortened = False, "prompt_too_long"
                continue
            wave.append(c)
            prompts.append(ids)
            seeds.append(turn_seed(cfg.seed, c.key, t))
        if not wave:
            return ntok, nprompt
        nprompt += sum(map(len, prompts))
        outs = gen.generate(prompts, seeds)
        if len(outs) != len(wave):
            raise RuntimeError(f"backend {gen.name} returned {len(outs)} answers for {len(wave)} prompts")
        for c, g in zip(wave, outs, strict=True):
            ntok += len(g.ids) + (g.finish == "stop")
            text = clean_answer(tok.decode(g.ids, skip_special_tokens=True), cfg.reasoning)
            if not text.strip():
                # An empty turn would make prepare drop the whole conversation: end it here instead.
                c.open, c.shortened = False, "empty_answer"
                continue
            c.msgs += [c.original[c.users[t]], {"role": "assistant", "content": text}]
            c.turns.append({"tokens": len(g.ids), "finish": g.finish})
        t += 1


def _record(c: _Conv, model_fp: str, settings: dict[str, Any]) -> dict[str, Any]:
    return {"id": c.rid, "messages": c.msgs,
            "provenance": {"source_id": c.rid, "source_index": c.index, "model": model_fp, "settings": settings,
                           "key": c.key, "turns": c.turns}}


def _relabel(rec: dict[str, Any], rid: str, index: int, msgs: list[dict[str, str]]) -> dict[str, Any]:
    """A reused record under this source's id and position (the same conversation may sit elsewhere)."""
    prov = {**rec["provenance"], "source_id": rid, "source_index": index}
    return {"id": rid, "messages": rec["messages"], "provenance": prov, "_original": msgs}


def _sample(rec: dict[str, Any], original: list[dict[str, str]] | None) -> dict[str, Any]:
    """The first user turn with its original and regenerated answers, cut to a few hundred characters."""
    original = original if original is not None else rec.get("_original", [])
    first = lambda msgs, role: next((m["content"] for m in msgs if m["role"] == role), "")  # noqa: E731
    cut = lambda s: s if len(s) <= _SAMPLE_CHARS else s[:_SAMPLE_CHARS] + " [...]"  # noqa: E731
    return {"id": rec["id"], "user": cut(first(rec["messages"], "user")),
            "original": cut(first(original, "assistant")), "regenerated": cut(first(rec["messages"], "assistant")),
            "turns": len(rec["provenance"]["turns"])}


def _commit(out: Path, st: _State, lines: list[bytes]) -> None:
    """Append a chunk's lines (fsynced), then record the new committed length atomically."""
    data = b"".join(lines)
    with open(out / OUT_FILE, "ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    st.bytes += len(data)
    atomic_write_json(out / PROGRESS, st.__dict__)
    fsync_dir(out)


def make_generator(target: Target, cfg: RegenConfig, max_len: int, eos: set[int]) -> Generator:
    """The backend cfg.backend names, loaded for the target."""
    if cfg.backend == "vllm":
        from eagle3.regenerate.vllm import VllmGenerator

        return VllmGenerator(target.path, cfg, max_len, eos, trust_remote_code=target.trust_remote_code)
    from eagle3.regenerate.hf import load_hf

    gen, _ = load_hf(target, cfg)
    return gen


def read_records(out: str | Path) -> list[dict[str, Any]]:
    """All records of a finished (or the committed part of an unfinished) regenerate dir."""
    path = Path(out) / OUT_FILE
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def progress_line(p: dict) -> str:
    """One line of a regeneration's progress (the `progress` callback's dict), for logs and the terminal."""
    return (f"regenerate: {p['records_read']} records read, {p['records_written']} written, "
            f"{p['tokens_generated']} tokens at {p['tokens_per_second']:.1f} tok/s")
