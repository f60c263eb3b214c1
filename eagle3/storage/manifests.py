"""Typed stage outputs. Each stage ends by writing one of these as `manifest.json` in its dir.

A manifest records the fingerprints of its inputs, its config, the format version, and counts
and checksums of what it wrote. Its `fingerprint` is a hash of all of that (never of a path or
a timestamp), so the next stage -- and the Prefect cache key -- can key on content.
"""
from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, Field

from eagle3 import __version__
from eagle3.storage.atomic import atomic_write_json, read_json_object
from eagle3.storage.hashing import sha256_json

MANIFEST = "manifest.json"
M = TypeVar("M", bound="StageManifest")


class StageManifest(BaseModel):
    """Fields every stage manifest carries."""

    stage: ClassVar[str] = "stage"
    format_version: ClassVar[int] = 1

    kind: str = ""
    version: int = 0
    eagle3_version: str = __version__
    created_at: str = ""
    config: dict[str, Any] = Field(default_factory=dict)
    inputs: dict[str, Any] = Field(
        default_factory=dict, description="what the output depends on: input name -> content fingerprint, and the "
        "settings that change the output (the stage's `inputs()`; also its Prefect cache key)",
    )
    fingerprint: str = ""

    # Fields that name places, not content: left out of the fingerprint so that moving a
    # directory does not invalidate every downstream cache.
    volatile: ClassVar[set[str]] = set()

    def _content(self) -> dict[str, Any]:
        # Everything but volatile fields: the fingerprint depends on content only.
        return self.model_dump(exclude={"created_at", "fingerprint", "eagle3_version", *self.volatile})

    def seal(self: M) -> M:
        """Fill kind/version/created_at and compute the content fingerprint."""
        self.kind = self.stage
        self.version = self.format_version
        if not self.created_at:
            self.created_at = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        self.fingerprint = sha256_json(self._content())
        return self

    def write(self, out_dir: str | Path) -> Path:
        """Seal and write `manifest.json` atomically. Written last: its presence means 'done'."""
        self.seal()
        path = Path(out_dir) / MANIFEST
        atomic_write_json(path, self.model_dump(mode="json"))
        return path

    @classmethod
    def read(cls: type[M], out_dir: str | Path) -> M:
        path = Path(out_dir) / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no {cls.stage} manifest (has the {cls.stage} stage finished?)")
        data = read_json_object(path, "a manifest (a JSON object)")
        if data.get("kind") != cls.stage:
            raise ValueError(f"{path}: is a {data.get('kind')!r} manifest, expected {cls.stage!r}")
        if data.get("version") != cls.format_version:
            raise ValueError(
                f"{path}: format version {data.get('version')} but this eagle3 reads "
                f"{cls.format_version}; rerun the {cls.stage} stage"
            )
        return cls.model_validate(data)

    @classmethod
    def kinds(cls) -> dict[str, type["StageManifest"]]:
        """Every stage manifest class by its `kind`."""
        out, todo = {}, list(cls.__subclasses__())
        while todo:
            c = todo.pop()
            out[c.stage] = c
            todo += c.__subclasses__()
        return out

    @classmethod
    def exists(cls, out_dir: str | Path) -> bool:
        try:
            cls.read(out_dir)
            return True
        except (FileNotFoundError, ValueError):
            return False


class ShardInfo(BaseModel):
    """One Parquet shard of prepared samples."""

    file: str = Field(description="path relative to the stage dir")
    sha256: str
    num_samples: int
    num_tokens: int
    num_trainable_tokens: int


class VocabMapInfo(BaseModel):
    file: str = "vocab_map.safetensors"
    sha256: str
    draft_vocab_size: int
    target_vocab_size: int
    coverage: float = Field(description="share of loss-masked tokens whose id is in the draft vocab")


class PreparedData(StageManifest):
    """Output of `eagle3 prepare`: tokenized, loss-masked samples + the draft vocab map.

    Parquet columns: `sample_id` (str, sha256 of the token ids and mask -- the key the
    incremental extract store reuses), `record_id` (str, the source record), `input_ids`
    (list<int32>), `loss_mask` (list<int8>, 1 = trainable assistant token).
    """

    stage: ClassVar[str] = "prepare"
    format_version: ClassVar[int] = 1
    volatile: ClassVar[set[str]] = {"model_dir", "source"}

    model_dir: str = ""
    tokenizer_fingerprint: str = ""
    source: str = ""
    source_fingerprint: str = ""
    splits: dict[str, list[ShardInfo]] = Field(default_factory=dict)
    records_read: int = 0
    records_kept: int = 0
    skipped: dict[str, int] = Field(default_factory=dict, description="reason -> count")
    skip_examples: dict[str, list[str]] = Field(default_factory=dict, description="reason -> first record ids + detail")
    num_tokens: int = 0
    num_trainable_tokens: int = 0
    vocab_map: VocabMapInfo | None = None
    unreadable_tail_bytes: int = 0

    def _content(self) -> dict[str, Any]:
        c = super()._content()
        # paths; content is in inputs
        c["config"] = {k: v for k, v in c["config"].items() if k not in ("data", "vocab_from")}
        return c

    def shard_paths(self, root: str | Path, split: str) -> list[Path]:
        return [Path(root) / s.file for s in self.splits.get(split, [])]


class HiddenShardInfo(BaseModel):
    """One safetensors shard of extracted hidden states."""

    file: str = Field(description="path relative to the stage dir")
    sha256: str
    split: str
    num_samples: int
    num_tokens: int
    num_bytes: int


class HiddenStates(StageManifest):
    """Output of `eagle3 extract`: aux + final pre-norm hidden states, sharded and checksummed.

    Layer ids follow vLLM: id k is the residual stream entering decoder layer k, id N the final
    pre-norm output. Read it with `eagle3.extract.open_store(dir)`.
    """

    stage: ClassVar[str] = "extract"
    format_version: ClassVar[int] = 1

    model_dir: str = ""
    model_fingerprint: str = ""
    backend: str = ""
    num_hidden_layers: int = 0
    hidden_size: int = 0
    aux_layer_ids: list[int] = Field(default_factory=list, description="the 3 aux ids (vLLM convention)")
    layer_ids: list[int] = Field(default_factory=list, description="aux ids + [N], the order stored")
    storage: str = "bf16"
    index_file: str = "index.parquet"
    index_sha256: str = ""
    shards: list[HiddenShardInfo] = Field(default_factory=list)
    splits: dict[str, dict[str, int]] = Field(default_factory=dict, description="split -> samples/tokens")
    num_samples: int = 0
    num_tokens: int = 0
    num_bytes: int = 0
    stats: dict[str, Any] = Field(
        default_factory=dict, description="run statistics (tok/s, reused samples); not part of the fingerprint"
    )

    def _content(self) -> dict[str, Any]:
        # A resumed or incremental run stores the same content with different run statistics; a store extracted
        # by several workers is the one a single worker writes.
        c = self.model_dump(exclude={"created_at", "fingerprint", "eagle3_version", "stats", "model_dir"})
        c["config"] = {k: v for k, v in c["config"].items() if k != "workers"}
        return c


class HiddenRange(StageManifest):
    """Output of one range of a several-worker extraction (`ranges/{k:03d}-of-{n:03d}/manifest.json`): its shards,
    checksummed, before the commit step moves them into the store (eagle3/extract/ranges.py). `inputs` are the
    store's inputs plus `range: [k, n]`."""

    stage: ClassVar[str] = "extract-range"
    format_version: ClassVar[int] = 1

    part: int = 0
    parts: int = 1
    shards: list[HiddenShardInfo] = Field(default_factory=list)
    num_tokens: int = 0
    stats: dict[str, Any] = Field(default_factory=dict, description="run statistics; not part of the fingerprint")

    def _content(self) -> dict[str, Any]:
        return self.model_dump(exclude={"created_at", "fingerprint", "eagle3_version", "stats"})


class SpoolSource(StageManifest):
    """What an online producer's hidden states are, written first into its spool dir (`source.json`, not
    `manifest.json`: the stage is not done when it appears). The trainer reads it where an offline run reads
    HiddenStates: the same fields, plus every sample's token count, from which both sides plan the same
    windows (eagle3.storage.spool)."""

    stage: ClassVar[str] = "spool-source"
    format_version: ClassVar[int] = 1
    volatile: ClassVar[set[str]] = {"model_dir"}
    FILE: ClassVar[str] = "source.json"

    model_dir: str = ""
    model_fingerprint: str = ""
    num_hidden_layers: int = 0
    hidden_size: int = 0
    aux_layer_ids: list[int] = Field(default_factory=list)
    layer_ids: list[int] = Field(default_factory=list)
    storage: str = "bf16"
    lengths: dict[str, list[int]] = Field(default_factory=dict, description="split -> token count of each sample, "
                                          "in prepared order")
    splits: dict[str, dict[str, int]] = Field(default_factory=dict, description="split -> samples/tokens")

    def write(self, out_dir: str | Path) -> Path:
        self.seal()
        path = Path(out_dir) / self.FILE
        atomic_write_json(path, self.model_dump(mode="json"))
        return path

    @classmethod
    def read(cls, out_dir: str | Path) -> "SpoolSource":
        path = Path(out_dir) / cls.FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no spool source (has the online producer started?)")
        return cls.model_validate(json.loads(path.read_text()))


class SpooledStates(StageManifest):
    """Output of an online producer, written once the trainer has read every window: what it produced, and
    the spool's peak. Nothing of the states is kept (the spool's shards are deleted)."""

    stage: ClassVar[str] = "extract-online"
    format_version: ClassVar[int] = 1
    volatile: ClassVar[set[str]] = {"model_dir"}

    model_dir: str = ""
    backend: str = ""
    source_fingerprint: str = ""
    spool_bytes: int = 0
    num_windows: int = 0
    stats: dict[str, Any] = Field(default_factory=dict, description="run statistics; not part of the fingerprint")

    def _content(self) -> dict[str, Any]:
        return self.model_dump(exclude={"created_at", "fingerprint", "eagle3_version", "stats", "model_dir"})


class TensorInfo(BaseModel):
    """One stored tensor: its shape, dtype and where it came from."""

    shape: list[int]
    dtype: str
    source: str = Field(description="tensor name in the source checkpoint, or how it was derived")


class VerifierWeights(StageManifest):
    """Output of `eagle3 verifier`: `verifier.safetensors` with the target's embed_tokens [V, H],
    final norm [H], lm_head [V, H], lm_head_draft [Vd, H] (the draft-vocab rows), d2t [Vd], t2d [V]."""

    stage: ClassVar[str] = "verifier"
    format_version: ClassVar[int] = 1

    model_dir: str = ""
    architecture: str = ""
    file: str = "verifier.safetensors"
    sha256: str = ""
    tensors: dict[str, TensorInfo] = Field(default_factory=dict)
    source_files: dict[str, str] = Field(default_factory=dict, description="source file -> sha256")
    tied_embeddings: bool = False
    hidden_size: int = 0
    vocab_size: int = 0
    draft_vocab_size: int = 0
    rms_norm_eps: float = 0.0

    def _content(self) -> dict[str, Any]:
        # Keyed on content (source checksums, tensors), not on where the model dir happens to be.
        return self.model_dump(exclude={"created_at", "fingerprint", "eagle3_version", "model_dir", "config"})


class TrainedDraft(StageManifest):
    """Output of `eagle3 train`: `final/` (servable by vLLM as is), checkpoints, metrics and curves."""

    stage: ClassVar[str] = "train"
    format_version: ClassVar[int] = 1

    final_dir: str = "final"
    export_format: str = "vllm"
    steps: int = 0
    exported_step: int = -1  # the step final/ holds (config's export_step: the best validation's or the last)
    best_step: int = -1
    best_metric: str = Field("sim_tau", description="what chose the best checkpoint: replay_tau, else sim_tau")
    best_sim_tau: float = 0.0
    best_replay_tau: float | None = None
    val: dict[str, Any] = Field(default_factory=dict, description="the last validation record")
    draft_config: dict[str, Any] = Field(default_factory=dict)
    weights_sha256: str = ""


class EvalReport(StageManifest):
    """Output of `eagle3 eval`: `report.json` (acceptance, speed, lossless), `acceptance.png`,
    `samples.jsonl` (the speculative outputs, per turn, with their lossless flag).

    tau = 1 + accepted / drafts, counted as vLLM counts (one draft per verify pass). The
    fingerprint covers what the run is about and its deterministic results (tau, lossless);
    wall-clock figures vary from run to run and stay out of it.
    """

    stage: ClassVar[str] = "eval"
    format_version: ClassVar[int] = 1
    volatile: ClassVar[set[str]] = {"model_dir", "draft_dir"}
    # Fields copied from the report dict of `eagle3.eval.decode.measure`.
    RESULTS: ClassVar[tuple[str, ...]] = (
        "backend", "draft_format", "k", "num_prompts", "num_turns", "acceptance_length",
        "per_position_acceptance", "lossless", "num_drafts", "num_accepted_tokens", "generated_tokens",
        "tokens_per_second", "target_tokens_per_second", "speedup_vs_target",
    )
    TIMINGS: ClassVar[set[str]] = {"tokens_per_second", "target_tokens_per_second", "speedup_vs_target"}

    model_dir: str = ""
    draft_dir: str = ""
    backend: str = "hf"
    draft_format: str = Field("", description="'vllm' (native EAGLE-3 dir) or 'speculators'")
    k: int = 0
    num_prompts: int = 0
    num_turns: int = 0
    mode: str = Field("live", description="'live' (decoded and timed) or 'replay' (exact tau, no speed, no lossless)")
    acceptance_length: float = 0.0
    acceptance_length_ci: list[float] | None = Field(None, description="replay: 95% bootstrap CI over prompts")
    per_position_acceptance: list[float] = Field(default_factory=list)
    lossless: bool | None = Field(False, description="live: every output equals the target's greedy one; replay: None")
    num_drafts: int = 0
    num_accepted_tokens: int = 0
    generated_tokens: int = 0
    tokens_per_second: float | None = 0.0
    target_tokens_per_second: float | None = 0.0
    speedup_vs_target: float | None = 0.0
    report_file: str = "report.json"
    plot_file: str = Field("", description="acceptance.png, or '' when matplotlib is absent")

    def _content(self) -> dict[str, Any]:
        c = self.model_dump(exclude={"created_at", "fingerprint", "eagle3_version", *self.volatile, *self.TIMINGS})
        c["config"] = {k: v for k, v in c["config"].items() if k != "replay_cache"}  # a place, not content
        return c


class RegeneratedData(StageManifest):
    """Output of `eagle3 regenerate`: `regenerated.jsonl`, the source conversations with every assistant
    turn rewritten by the target (OpenAI `messages` form, read by `prepare`), one record per line, each
    with its provenance (source record id, model fingerprint, generation settings, reuse key).

    The fingerprint covers the inputs, the settings and the file's sha256; run statistics (tok/s,
    records reused or resumed) vary between equivalent runs and stay out of it.
    """

    stage: ClassVar[str] = "regenerate"
    format_version: ClassVar[int] = 1
    volatile: ClassVar[set[str]] = {"model_dir", "source"}

    model_dir: str = ""
    model_fingerprint: str = Field("", description="sha256 over weights, config, tokenizer/template, generation config")
    source: str = ""
    source_fingerprint: str = ""
    backend: str = "hf"
    settings: dict[str, Any] = Field(default_factory=dict, description="what changes the text (provenance)")
    file: str = "regenerated.jsonl"
    sha256: str = ""
    records_read: int = 0
    records_written: int = 0
    skipped: dict[str, int] = Field(default_factory=dict, description="reason -> count")
    skip_examples: dict[str, list[str]] = Field(default_factory=dict, description="reason -> first record ids + detail")
    turns_written: int = Field(0, description="assistant turns in the output")
    turns_cut: int = Field(0, description="turns that hit max_new_tokens (kept, unfinished)")
    conversations_shortened: int = Field(0, description="conversations ended early (context full or empty answer)")
    samples: list[dict[str, Any]] = Field(default_factory=list, description="first records: original vs regenerated")
    stats: dict[str, Any] = Field(
        default_factory=dict, description="run statistics (tok/s, reused, resumed); not part of the fingerprint"
    )

    def _content(self) -> dict[str, Any]:
        c = self.model_dump(exclude={"created_at", "fingerprint", "eagle3_version", "stats", *self.volatile})
        c["config"] = {k: v for k, v in c["config"].items()
                       if k not in ("chunk_records", "batch_size", "batch_tokens", "tensor_parallel_size",
                                "gpu_memory_utilization")}
        return c
