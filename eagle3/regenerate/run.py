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
from eagle3.regenerate.resume import FORMAT, OUT_FILE, PREVIOUS, ReuseIndex, State, commit, finished, resume
from eagle3.runtime.heap import retain_freed_memory
from eagle3.storage.hashing import sha256_file, sha256_json
from eagle3.storage.manifests import RegeneratedData

log = logging.getLogger("eagle3.regenerate")

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
    st: State
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
        commit(self.out, self.st, lines)

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
    done = finished(out, fp)
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
    st, index = resume(out, signature, reuse)
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
