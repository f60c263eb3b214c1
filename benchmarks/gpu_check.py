"""GPU readiness: every CUDA path of eagle3 measured on one GPU, in under 8 minutes, in one command.

Sections, each in its own child process with its own time budget (a section that fails, runs out
of memory or out of time records why, and the next one still runs):

  trainer    the trainer's own TTT module + optimizer_step, bf16 autocast, at Llama-3.1-8B draft
             shapes (H 4096, draft vocab 32000, k=7, 8192-token packs of 4 documents, random
             hidden states), wrapped by eagle3.train.distributed.wrap as DDP and as FSDP2 in a
             process group of one: tok/s, peak memory, model FLOP/s as MFU (vs the datasheet
             peak, and vs a bf16 matmul measured in the same run), and the two runs' losses,
             which must agree step by step.
  attention  one TTT attention step at j=6 (k=7 key blocks), 32 query / 8 kv heads x 128, bf16:
             ours (eagle3.model.attention) vs flex_attention with a block mask vs SDPA with a
             dense L x 7L mask, at L = 4096 / 8192 / 16384: forward and backward time, and the
             memory each adds (masks included); an OOM is recorded as such. At a small L with
             three documents, the outputs and all input gradients of the three are compared to
             an fp32 (smoke: fp64) reference.
  extract    the hf extraction stage (run_extract) on a random-init Llama of Llama-3.2-1B's shape:
             the stage's tok/s over bare forwards of the same batches in the same run
             (benchmarks/speed/extract.py's TimedHF), and stored bytes per token over 4*H*2.
  evaluator  `eagle3 eval`'s own code path (eagle3.eval.run.evaluate) with a bf16 target and
             draft: the draft's rotary cos/sin tables equal the fp32 ones; lossless on a random
             target (a mismatch counts only if it is not a near-tie of the target's logits); and
             on a target + draft whose every argmax is decisive by construction, tau and outputs
             equal those of the fp32 CPU run.
  gpu_tests  `pytest -m gpu` over the test files that carry the marker; its counts and outcomes.

Budgets (s, child start included): trainer 70, attention 120, extract 60, evaluator 70, gpu_tests
150 (the CUDA training test runs twice, DDP and FSDP2), i.e. 470 s. A section checks its deadline
between measurements and records what it leaves out; one still running at its budget is stopped
(SIGTERM to its process group) and keeps what it had measured, marked partial. Writes
OUT/gpu_check.json (rewritten after each section, so a cut-off run keeps what finished) and
OUT/gpu_check.log (everything printed, children included). Exit status 1 when a check fails or a
section errs or times out.

On an H200 machine without network access (an image with torch, transformers, pyarrow,
safetensors, pyyaml, pytest but no pydantic): first, here, `benchmarks/fetch_gpu_wheels.sh`
(writes the ignored folder .gpu/: pydantic's wheels for Python 3.12 and the small test assets
the gpu tests need), then, on the GPU machine, with the checkout and .gpu/ copied there, from the
checkout's root (`-m` puts it on the import path: eagle3 is imported from the checkout, not installed; allow ~540 s):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
      .gpu/wheels/*.whl && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 || exit; \
    python3 -m benchmarks.gpu_check --out $OUT

A rerun of some sections only: `--sections trainer attention`.
`--smoke`: tiny shapes on the CPU, every section, well under a minute (tests/integration/test_gpu_check.py).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import math
import os
import platform
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

H200_BF16_TFLOPS = 989.0  # dense bf16, the vendor's datasheet (H100 / H200 SXM)
ROPE_LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
LLAMA31_8B = dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, vocab_size=128256,
                  max_position_embeddings=131072, rope_parameters=ROPE_LLAMA3)
LLAMA32_1B = dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, vocab_size=128256,
                  max_position_embeddings=131072, rope_parameters=ROPE_LLAMA3, tie_word_embeddings=True)
TINY = dict(num_hidden_layers=8, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, rms_norm_eps=1e-5, vocab_size=1024, max_position_embeddings=16384,
            rope_parameters=ROPE_LLAMA3)

# Everything that differs between the GPU run and --smoke. Budgets are seconds per section
# (child start included); on the GPU they add up to 470 s, inside the 8 minutes.
SETTINGS = {
    "gpu": dict(
        train_target=LLAMA31_8B, draft_vocab=32000, k=7, pack=8192, docs=4, warmup=2, steps=5, attn_block=256,
        attn_lengths=[4096, 8192, 16384], attn_heads=(32, 8, 128), attn_j=6, attn_check_len=512, attn_reps=3,
        extract_target=LLAMA32_1B, extract_words=8000, extract_convs=96, extract_turn_words=520,
        eval_target=TINY, eval_prompts=6, eval_k=3, eval_max_new=48, rope_positions=8192,
        budget={"trainer": 70, "attention": 120, "extract": 60, "evaluator": 70, "gpu_tests": 150},
    ),
    "smoke": dict(
        train_target=TINY, draft_vocab=256, k=3, pack=256, docs=4, warmup=1, steps=2, attn_block=32,
        attn_lengths=[128, 256], attn_heads=(4, 2, 16), attn_j=2, attn_check_len=96, attn_reps=1,
        extract_target=TINY, extract_words=600, extract_convs=12, extract_turn_words=40,
        eval_target=TINY, eval_prompts=3, eval_k=3, eval_max_new=16, rope_positions=8192,
        budget={"trainer": 120, "attention": 120, "extract": 120, "evaluator": 120, "gpu_tests": 120},
    ),
}
SECTIONS = ("trainer", "attention", "extract", "evaluator", "gpu_tests")


# ================================================================ helpers
def sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def reset_peak(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def peak_gib(dev) -> float:
    """Peak CUDA memory allocated since reset_peak, or on the CPU the process's peak RSS (never reset)."""
    import torch

    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def free(dev) -> None:
    import torch

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def rel_err(x, ref) -> float:
    """||x - ref|| / ||ref||, in float64 on the CPU."""
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def matmul_tflops(dev, n: int) -> float:
    """Measured bf16 [n, n] x [n, n] rate on `dev`: the ceiling the trainer's MFU is also read against."""
    import torch

    a, b = (torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    reps = 20 if dev.type == "cuda" else 3
    sync(dev)
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(dev)
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e12


def word_tokenizer(out: Path, n_words: int):
    """A word-level fast tokenizer with a ChatML template, saved to `out` (no hub here, none there).

    Ids: 0 <unk>, 1 <|im_start|>, 2 <|im_end|> (eos), then 'user', 'assistant', 'system', then w0, w1, ...
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]
    words += [f"w{i}" for i in range(n_words - len(words))]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece()  # joins words with spaces
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<unk>",
                                  additional_special_tokens=["<|im_start|>"], chat_template=template)
    tok.save_pretrained(out)
    return tok


def words(rng: random.Random, n_words: int, n: int) -> str:
    return " ".join(f"w{rng.randrange(n_words - 6)}" for _ in range(n))


def llama_config(shape: dict, eos: int = 2):
    """A LlamaConfig of `shape` whose special ids are word_tokenizer's."""
    from transformers import LlamaConfig

    return LlamaConfig(**shape, bos_token_id=1, eos_token_id=eos, pad_token_id=0)


# ================================================================ trainer
def train_flops_per_token(c, k: int, L: int, docs: int) -> float:
    """Model FLOPs of one trained token: k TTT steps forward (x3 with backward) + the target head.

    Per step: q/k/v from the 2H input, o_proj, the 3-matrix MLP, lm_head over the draft vocab,
    and attention (scores + weighted sum) over the causal keys of the token's document (mean
    (L/docs + 1) / 2) plus the j diagonal keys; fc once. The frozen embedding is a lookup. The
    target head (no grad): draft-vocab logits plus the full-vocab argmax, V x H.
    """
    H, Hi, D = c.hidden_size, c.intermediate_size, c.head_dim
    Hq, Hkv, Vd, V = c.num_attention_heads, c.num_key_value_heads, c.draft_vocab_size, c.vocab_size
    dense = 2 * (2 * H * (Hq + 2 * Hkv) * D + Hq * D * H + 3 * H * Hi + H * Vd)
    keys = sum((L / docs + 1) / 2 + j for j in range(k))
    fwd = k * dense + 2 * 3 * c.target_hidden_size * H + 4 * Hq * D * keys
    return 3 * fwd + 2 * H * (Vd + V)


def random_pack(L: int, docs: int, V: int, H: int, dev, seed: int) -> dict:
    """One packed row as eagle3.train.data.collate returns it: `docs` documents, random states."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n = L // docs
    b = {"input_ids": torch.randint(0, V, (1, L), generator=g), "aux": torch.randn(1, L, 3, H, generator=g),
         "position_ids": torch.arange(L).remainder(n)[None], "doc": (torch.arange(L) // n).clamp_max(docs - 1)[None],
         "loss_mask": torch.ones(1, L, dtype=torch.long), "final": torch.randn(1, L, H, generator=g)}
    return {k: v.to(dev) for k, v in b.items()}


def trainer(s: dict, dev, work: Path, deadline: float, out: dict) -> None:
    import torch
    import torch.distributed as tdist

    from eagle3.model.draft import DraftConfig, Eagle3Draft
    from eagle3.train import distributed as dist
    from eagle3.train.loop import TTT
    from eagle3.train.loss import TargetHead, step_weights
    from eagle3.train.optim import step as optimizer_step
    from eagle3.train.validate import row_pass

    cuda = dev.type == "cuda"
    c = DraftConfig.from_target(s["train_target"], draft_vocab_size=s["draft_vocab"])
    V, H, L, k = c.vocab_size, c.hidden_size, s["pack"], s["k"]
    flops = train_flops_per_token(c, k, L, s["docs"])
    ceiling = matmul_tflops(dev, 8192 if cuda else 256)
    out.update(shape={"hidden": H, "draft_vocab": c.draft_vocab_size, "vocab": V, "k": k, "pack": L,
                      "docs_per_pack": s["docs"], "dtype": "bf16 autocast"},
               gflop_per_token=flops / 1e9, matmul_tflops=ceiling,
               memory="torch.cuda.max_memory_allocated" if cuda else "process peak RSS (cumulative)")
    print(f"matmul ceiling {ceiling:.3g} TFLOP/s; {flops / 1e9:.3g} GFLOP per trained token", flush=True)
    # A process group of one, as torchrun would give a single GPU; wrap() then builds real DDP / FSDP2.
    tdist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{work / 'rendezvous'}",
                             rank=0, world_size=1)
    d = dist.Dist(rank=0, world=1, local_rank=0, device=dev)
    torch.manual_seed(1)
    d2t = torch.randperm(V)[: c.draft_vocab_size].sort().values - torch.arange(c.draft_vocab_size)
    head = TargetHead(torch.ones(H), c.rms_norm_eps, torch.randn(V, H, device=dev) * 0.02, d2t).to(dev)
    packs = [random_pack(L, s["docs"], V, H, dev, seed) for seed in (2, 3)]
    # bf16 autocast as the trainer on CUDA; in --smoke on the CPU too, so CI runs the mixed-precision path
    amp = torch.autocast(dev.type, dtype=torch.bfloat16)
    losses = {}
    for mode in ("ddp", "fsdp"):
        if time.monotonic() > deadline:
            out[mode] = {"skipped": "time budget"}
            continue
        torch.manual_seed(0)  # the same init for both
        with torch.device(dev):
            draft = Eagle3Draft(c)
        with torch.no_grad():
            draft.d2t.copy_(d2t)
        model = dist.wrap(TTT(draft, k, s["attn_block"], step_weights(k)), d, fsdp=mode == "fsdp")
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))
        reset_peak(dev)
        times, losses[mode] = [], []
        for i in range(s["warmup"] + s["steps"]):
            sync(dev)
            t = time.perf_counter()
            b = packs[i % 2]
            targets = head(b["final"])  # every first-epoch step pays the full-vocab argmax
            o = row_pass(model, targets, b, amp)
            o.loss.backward()
            optimizer_step(params, opt, 0.5)
            sync(dev)
            losses[mode].append(float(o.loss.detach()))
            if i >= s["warmup"]:
                times.append(time.perf_counter() - t)
        step = statistics.median(times)
        achieved = flops * L / step / 1e12
        out[mode] = {"tokens_per_s": L / step, "step_s": step, "peak_memory_gib": peak_gib(dev),
                     "model_tflops": achieved, "mfu_vs_matmul": achieved / ceiling,
                     "mfu": achieved / H200_BF16_TFLOPS if cuda else None, "losses": losses[mode],
                     "wrapper": type(model).__name__}
        print(f"{mode}: {L / step:,.0f} tok/s, {step:.3f} s/step, peak {peak_gib(dev):.2f} GiB, "
              f"{achieved:.3g} TFLOP/s ({achieved / ceiling:.1%} of the measured matmul), losses "
              f"{[round(x, 5) for x in losses[mode]]}", flush=True)
        del model, opt, params, draft, o, targets
        free(dev)
    tdist.destroy_process_group()
    checks = {"losses_finite": all(math.isfinite(x) for ls in losses.values() for x in ls)}
    if len(losses) == 2:
        a, b = losses["ddp"], losses["fsdp"]
        diff = max(abs(x - y) for x, y in zip(a, b, strict=False))
        out["loss_max_abs_diff"] = diff
        # bf16 matmuls may be scheduled differently after the first update: a relative 1e-3 then
        checks["ddp_fsdp_equal_losses"] = len(a) == len(b) and diff <= (1e-3 if cuda else 1e-5) * max(map(abs, a))
    out["checks"] = checks


# ================================================================ TTT attention
def attention(s: dict, dev, work: Path, deadline: float, out: dict) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from eagle3.model.attention import ttt_attention

    cuda = dev.type == "cuda"
    Hq, Hkv, D = s["attn_heads"]
    j = s["attn_j"]
    dtype = torch.bfloat16 if cuda else torch.float32
    # compiled on CUDA (the fused kernel); on the CPU the eager reference (scores materialized), tiny L only
    flex = torch.compile(flex_attention, dynamic=False) if cuda else flex_attention

    def has_bwd(impl: str) -> bool:
        return cuda or impl != "flex"  # torch's flex_attention has no CPU backward (NotImplementedError)

    def inputs(L: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        shapes = [(1, Hq, L, D)] + [(1, Hkv, L, D)] * (2 + 2 * j)  # q, k0, v0, k_1..k_j, v_1..v_j
        return [torch.randn(*sh, generator=g).to(dev, dtype).requires_grad_() for sh in shapes]

    def mask_mod(L: int, doc):
        # key index kv in [0, (j+1) L): block kv // L (0 = step-0 keys), position kv % L
        def m(b, h, q, kv):
            blk, pos = kv // L, kv % L
            return ((blk == 0) & (pos <= q) & (doc[pos] == doc[q])) | ((blk > 0) & (pos == q))
        return m

    def dense_mask(L: int, doc):
        q, kv = torch.arange(L, device=dev)[:, None], torch.arange(L, device=dev)[None]
        step0 = (kv <= q) & (doc[kv] == doc[q])
        return torch.cat([step0] + [kv == q] * j, 1)  # [L, (j+1) L] bool

    def cat_kv(x):
        return torch.cat([x[1], *x[3 : 3 + j]], 2), torch.cat([x[2], *x[3 + j :]], 2)  # [1, Hkv, (j+1) L, D]

    def run(impl: str, x, doc, mask):
        if impl == "ours":
            return ttt_attention(x[0], x[1], x[2], x[3 : 3 + j], x[3 + j :], doc[None])
        k, v = cat_kv(x)
        if impl == "flex":
            return flex(x[0], k, v, block_mask=mask, enable_gqa=True)
        # kv heads repeated, not enable_gqa: on CUDA that keeps SDPA on its memory-efficient kernel,
        # which takes an arbitrary mask (with GQA it falls back to the math path)
        k, v = (t.repeat_interleave(Hq // Hkv, 1) for t in (k, v))
        return F.scaled_dot_product_attention(x[0], k, v, attn_mask=mask)

    def make_mask(impl: str, L: int, doc):
        if impl == "flex":
            return create_block_mask(mask_mod(L, doc), None, None, L, (j + 1) * L, device=dev, _compile=cuda)
        return dense_mask(L, doc) if impl == "sdpa" else None

    out.update(shape={"q_heads": Hq, "kv_heads": Hkv, "head_dim": D, "j": j, "dtype": str(dtype).split(".")[-1]},
               memory="torch.cuda.max_memory_allocated minus the inputs (masks and SDPA's repeated k/v count)"
               if cuda else "not measured on the CPU",
               flex_backward="measured" if cuda else "none: torch's flex_attention has no CPU backward")
    # ---- equality at a small L, three documents, against a high-precision reference
    L = s["attn_check_len"]
    doc = torch.arange(L, device=dev) * 3 // L
    x = inputs(L, 0)
    ref_x = [t.detach().double().cpu().requires_grad_() for t in x]
    rk, rv = (t.repeat_interleave(Hq // Hkv, 1) for t in cat_kv(ref_x))  # GQA: q head h reads kv head h // G
    scores = (ref_x[0] @ rk.transpose(-1, -2)) / math.sqrt(D)
    ref = scores.masked_fill(~dense_mask(L, doc).cpu(), float("-inf")).softmax(-1) @ rv
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    ref.backward(dout)
    tol = 2e-2 if cuda else 1e-5  # bf16 operands: 1e-3 .. 1e-2; fp32 against fp64: far below 1e-5
    errs = {}
    for impl in ("ours", "flex", "sdpa"):
        for t in x:
            t.grad = None
        o = run(impl, x if has_bwd(impl) else [t.detach() for t in x], doc, make_mask(impl, L, doc))
        errs[impl] = {"out": rel_err(o, ref), "grads": None}
        if has_bwd(impl):
            o.backward(dout.to(dev, dtype))
            errs[impl]["grads"] = max(rel_err(a.grad, r.grad) for a, r in zip(x, ref_x, strict=True))
    out["equality"] = {"L": L, "documents": 3, "tolerance": tol, "reference": "fp64 math on the CPU", **errs}
    print(f"equality at L={L}: "
          + ", ".join(f"{i} out {e['out']:.1e} grads {e['grads'] or 0:.1e}" for i, e in errs.items()),
          flush=True)
    out["checks"] = {f"{i}_equals_reference": e["out"] <= tol and (e["grads"] or 0) <= tol for i, e in errs.items()}
    del x, ref_x, ref, scores, rk, rv
    free(dev)

    # ---- time and memory: one document per row (ours then takes its plain-causal path)
    out["lengths"] = {}
    for L in s["attn_lengths"]:
        res = out["lengths"][str(L)] = {}
        for impl in ("ours", "flex", "sdpa"):
            if time.monotonic() > deadline:
                res[impl] = {"skipped": "time budget"}
                continue
            try:
                x = inputs(L, 1)
                doc = torch.zeros(L, dtype=torch.long, device=dev)
                g = torch.randn(1, Hq, L, D, device=dev, dtype=dtype)
                sync(dev)
                reset_peak(dev)
                base = torch.cuda.memory_allocated(dev) if cuda else 0
                mask = make_mask(impl, L, doc)
                fwd, bwd = [], []
                for r in range(1 + s["attn_reps"]):  # the first is warm-up (and flex's compile)
                    sync(dev)
                    t0 = time.perf_counter()
                    o = run(impl, x if has_bwd(impl) else [t.detach() for t in x], doc, mask)
                    sync(dev)
                    t1 = time.perf_counter()
                    if has_bwd(impl):
                        o.backward(g)
                    sync(dev)
                    if r:
                        fwd.append(t1 - t0)
                        bwd.append(time.perf_counter() - t1)
                    for t in x:
                        t.grad = None
                    del o
                res[impl] = {"fwd_ms": 1e3 * statistics.median(fwd),
                             "bwd_ms": 1e3 * statistics.median(bwd) if has_bwd(impl) else None,
                             "extra_gib": (torch.cuda.max_memory_allocated(dev) - base) / 2**30 if cuda else None}
                bwd_text = f"{res[impl]['bwd_ms']:9.2f} ms" if has_bwd(impl) else "     none"
                print(f"L={L:6d} {impl:5s} fwd {res[impl]['fwd_ms']:9.2f} ms  bwd {bwd_text}"
                      + (f"  extra {res[impl]['extra_gib']:7.2f} GiB" if cuda else ""), flush=True)
            except torch.OutOfMemoryError as e:
                res[impl] = {"oom": str(e).splitlines()[0][:200]}
                print(f"L={L:6d} {impl:5s} OOM", flush=True)
            finally:
                x = g = mask = o = None  # noqa: F841  an OOM can leave o bound: drop every ref before free(dev)
                free(dev)
        for other in ("flex", "sdpa"):
            a, b = res.get("ours", {}), res.get(other, {})
            if "fwd_ms" in a and "fwd_ms" in b:
                res[f"fwd_time_ratio_{other}"] = a["fwd_ms"] / b["fwd_ms"]
            if a.get("bwd_ms") and b.get("bwd_ms"):
                res[f"time_ratio_{other}"] = (a["fwd_ms"] + a["bwd_ms"]) / (b["fwd_ms"] + b["bwd_ms"])
                if cuda:
                    res[f"memory_ratio_{other}"] = a["extra_gib"] / b["extra_gib"]


# ================================================================ extraction
def extract(s: dict, dev, work: Path, deadline: float, out: dict) -> None:
    import torch
    from transformers import LlamaForCausalLM

    from benchmarks.speed.extract import TimedHF
    from eagle3.config import ExtractConfig, PrepareConfig
    from eagle3.extract import run_extract
    from eagle3.extract.hf import HFBackend
    from eagle3.model.target import Target
    from eagle3.prepare import prepare
    from eagle3.storage.store import open_store

    class Timed(TimedHF):
        extract = HFBackend.extract  # TimedHF's keeps an fp32 copy of every state for its fp8 replays: not here

    cuda = dev.type == "cuda"
    shape = s["extract_target"]
    model_dir, prep, hid = work / "target", work / "prep", work / "hidden"
    word_tokenizer(model_dir, s["extract_words"])
    torch.manual_seed(0)
    with torch.device(dev):
        lm = LlamaForCausalLM(llama_config(shape))
    lm.to(torch.bfloat16).save_pretrained(model_dir)
    del lm
    free(dev)
    rng = random.Random(0)
    n = s["extract_turn_words"]
    with open(work / "convs.jsonl", "w") as f:
        for i in range(s["extract_convs"]):
            turns = [{"from": "human", "value": words(rng, s["extract_words"], n // 4)},
                     {"from": "gpt", "value": words(rng, s["extract_words"], n)}] * 2
            f.write(json.dumps({"id": f"c{i}", "conversations": turns}) + "\n")
    prepare(model_dir, prep, PrepareConfig(data=str(work / "convs.jsonl"), max_len=4096, val_fraction=0.0),
            progress=False)
    target = Target.open(model_dir)
    target.fingerprint()  # hashed once per file and cached, as on any rerun: not the stage's per-token cost
    base = target.load_model(head=False, device=dev)  # what the hf backend loads: bf16 on CUDA
    N, H = shape["num_hidden_layers"], shape["hidden_size"]
    be = Timed(base, [2, N // 2, N - 3, N], batch_tokens=ExtractConfig().batch_tokens)
    warm = torch.zeros(1, 256, dtype=torch.long)
    be.forward(warm)
    be._bare(warm)
    be.bare_s = be.hook_s = be.bench_s = 0.0
    t = time.perf_counter()
    m = run_extract(model_dir, prep, hid, ExtractConfig(), backend=be, show_progress=False)
    stage_s = time.perf_counter() - t - be.bare_s  # the stage's own time: all but the side bare forwards
    tps, bare_tps = m.num_tokens / stage_s, m.num_tokens / be.bare_s
    out.update({"target": {k: shape[k] for k in ("num_hidden_layers", "hidden_size", "vocab_size")},
           "params_billion": sum(p.numel() for p in base.parameters()) / 1e9,
           "dtype": str(next(base.parameters()).dtype).split(".")[-1], "tokens": m.num_tokens,
           "samples": m.num_samples, "stage_s": stage_s, "bare_s": be.bare_s, "hooked_forward_s": be.hook_s,
           "tokens_per_s": tps, "bare_tokens_per_s": bare_tps, "throughput_ratio": tps / bare_tps,
           "bytes_per_token": m.num_bytes / m.num_tokens, "bytes_ratio": m.num_bytes / m.num_tokens / (4 * H * 2)})
    print(f"{m.num_tokens:,} tokens: stage {tps:,.0f} tok/s, bare forwards {bare_tps:,.0f} tok/s, ratio "
          f"{tps / bare_tps:.3f}; {out['bytes_per_token']:.0f} B/token = {out['bytes_ratio']:.4f} x 4*H*2", flush=True)
    # the stored aux states of the longest sample (batched, padded) equal an unbatched forward's
    store = open_store(hid)
    smp = max(store, key=lambda x: len(x["input_ids"]))
    with torch.inference_mode():
        hs = base(input_ids=torch.as_tensor(smp["input_ids"]).long()[None].to(dev),
                  output_hidden_states=True).hidden_states
    ref = torch.stack([hs[i][0] for i in (2, N // 2, N - 3)], 1)  # [T, 3, H]; HF's hidden_states[k] enters layer k
    out["aux_rel_err"] = rel_err(smp["aux_hidden_states"].float(), ref.float())
    tol = 2e-2 if cuda else 5e-3  # bf16 storage rounds by ~2e-3; on CUDA bf16 batched vs unbatched kernels too
    print(f"stored aux states vs an unbatched forward: relative error {out['aux_rel_err']:.1e}", flush=True)
    out["checks"] = {"stored_states_equal_forward": out["aux_rel_err"] <= tol}


# ================================================================ evaluator
@contextlib.contextmanager
def evaluator_bf16(on_cpu: bool):
    """Run eagle3.eval.run.evaluate as on a GPU; yields the list of drafts its DraftProposer received.

    On CUDA the evaluator loads the target in bf16 and casts the draft to it by itself. On the CPU
    (--smoke) its target loader is wrapped to return the target in bf16, so the evaluator's own
    cast of the draft runs here too.
    """
    import torch

    import eagle3.eval.run as ev

    seen: list = []
    proposer, loader = ev.DraftProposer, ev.load_target

    class Recording(proposer):
        def __init__(self, draft):
            seen.append(draft)
            super().__init__(draft)

    def load_bf16(*args, **kwargs):
        model, *rest = loader(*args, **kwargs)
        return (model.to(torch.bfloat16), *rest)

    ev.DraftProposer = Recording
    if on_cpu:
        ev.load_target = load_bf16
    try:
        yield seen
    finally:
        ev.DraftProposer, ev.load_target = proposer, loader


def evaluator(s: dict, dev, work: Path, deadline: float, out: dict) -> None:
    import torch
    from transformers import LlamaForCausalLM

    from eagle3.config import EvalConfig
    from eagle3.eval.decode import TargetLM, greedy_generate
    from eagle3.eval.run import evaluate, load_target
    from eagle3.model.draft import DraftConfig, Eagle3Draft
    from eagle3.model.formats import export, load_draft
    from eagle3.model.target import prompt_ids

    cuda = dev.type == "cuda"
    shape, k, max_new = s["eval_target"], s["eval_k"], s["eval_max_new"]
    V, H, N = shape["vocab_size"], shape["hidden_size"], shape["num_hidden_layers"]
    aux = (2, N // 2, N - 3)
    rng = random.Random(0)
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": words(rng, V, 12)}) + "\n" for _ in range(s["eval_prompts"])))

    def target_dir(name: str, decisive: bool) -> Path:
        """A random-init Llama; `decisive`: unit-variance embeddings (rows ~sqrt(H) long, far above the
        std-0.02 layers' contributions) and lm_head row perm[x] = embedding row x, so its greedy
        next token is perm[x] by a wide margin: no argmax is a near-tie, in fp32 or bf16."""
        d = work / name
        tok = word_tokenizer(d, V)
        torch.manual_seed(1)
        lm = LlamaForCausalLM(llama_config({**shape, "tie_word_embeddings": False}, tok.eos_token_id))
        if decisive:
            with torch.no_grad():
                e = lm.model.embed_tokens.weight.normal_(0, 1)
                lm.lm_head.weight[PERM] = e
        lm.save_pretrained(d)
        return d

    def draft_dir(name: str, tgt: Path, decisive: bool) -> Path:
        """A draft over a random half of the vocab; `decisive`: fc passes the high aux state (~ the
        embedding of the token at p) and lm_head row d = embedding row x with perm[perm[x]] = target id
        of d, so step 0 proposes perm[perm[x_p]], the target's token after x_{p+1}."""
        torch.manual_seed(2)
        c = DraftConfig.from_target(tgt, V // 2, aux_layer_ids=aux)
        dr = Eagle3Draft(c)
        tid = torch.randperm(V)[: V // 2].sort().values  # target ids of the draft vocab
        with torch.no_grad():
            dr.d2t.copy_(tid - torch.arange(V // 2))
            if decisive:
                e = LlamaForCausalLM.from_pretrained(tgt).model.embed_tokens.weight
                inv2 = torch.empty_like(PERM)
                inv2[PERM[PERM]] = torch.arange(V)
                dr.fc.weight.zero_()
                dr.fc.weight[:, 2 * H :] = torch.eye(H)
                dr.lm_head.weight.copy_(e[inv2[tid]])
        return export(dr.state_dict(), c, k, work / name)

    PERM = torch.randperm(V, generator=torch.Generator().manual_seed(3))
    out.update(target={"layers": N, "hidden": H, "vocab": V}, k=k, max_new_tokens=max_new, prompts=s["eval_prompts"],
               device=dev.type)

    def run_eval(tgt: Path, drf: Path, name: str, bf16: bool):
        """evaluate() as `eagle3 eval` runs it; returns (report, samples, the draft its proposer got)."""
        where = work / name
        with (evaluator_bf16(on_cpu=not cuda) if bf16 else contextlib.nullcontext([])) as seen:
            evaluate(tgt, drf, where, EvalConfig(prompts=str(prompts), k=k, max_new_tokens=max_new),
                     device=str(dev) if bf16 else "cpu")
        report = json.loads((where / "report.json").read_text())
        samples = [json.loads(ln) for ln in (where / "samples.jsonl").read_text().splitlines()]
        return report, samples, (seen[0] if seen else None)

    # ---- a random target: rotary tables of the bf16 draft, and lossless (near-ties aside)
    t1 = target_dir("random-target", decisive=False)
    d1 = draft_dir("random-draft", t1, decisive=False)
    r1, _, drafted = run_eval(t1, d1, "eval-random", bf16=True)
    ref_draft, _ = load_draft(d1, t1, LlamaForCausalLM.from_pretrained(t1).model.embed_tokens.weight)  # fp32, CPU
    pos = torch.arange(s["rope_positions"])[None]
    cos_b, sin_b = drafted.rope(torch.zeros(1, dtype=torch.bfloat16, device=dev), pos.to(dev))
    cos_f, sin_f = ref_draft.rope(torch.zeros(1), pos)
    rope_err = max((cos_b.float().cpu() - cos_f).abs().max().item(), (sin_b.float().cpu() - sin_f).abs().max().item())
    out["rotary"] = {"positions": s["rope_positions"], "max_abs_diff": rope_err,
                     "draft_dtype": str(drafted.fc.weight.dtype).split(".")[-1],
                     "inv_freq_dtype": str(drafted.rotary_emb.inv_freq.dtype).split(".")[-1]}
    print(f"rotary tables of the evaluator's bf16 draft vs fp32, positions < {s['rope_positions']}: max |diff| "
          f"{rope_err:.4f} (inv_freq {out['rotary']['inv_freq_dtype']})", flush=True)

    # a lossless failure is excused only at a near-tie: the target's top-2 logits within 1/32 of the top one
    failures = []
    if r1["lossless_failures"]:
        model, tok, eos = load_target(t1, str(dev))
        model = model.to(torch.bfloat16)  # bf16 already on CUDA; on the CPU as evaluator_bf16 loads it
        msgs = [json.loads(ln) for ln in prompts.read_text().splitlines()]
        by_id = {str(i + 1): m["prompt"] for i, m in enumerate(msgs)}
        for f in r1["lossless_failures"]:
            prompt = prompt_ids(tok, [{"role": "user", "content": by_id[f["id"]]}])
            ref = greedy_generate(TargetLM(model), prompt, max_new, eos)
            i = f["first_mismatch"]
            with torch.inference_mode():
                top = model(input_ids=torch.tensor([prompt + ref[:i]], device=dev)).logits[0, -1].float().topk(2).values
            gap = float(top[0] - top[1])
            failures.append({**f, "top2_gap": gap, "top1": float(top[0]), "near_tie": gap <= abs(float(top[0])) / 32})
        del model
    out["lossless_random"] = {"lossless": r1["lossless"], "turns": r1["num_turns"], "failures": failures,
                              "tau": r1["acceptance_length"], "tokens_per_s": r1["tokens_per_second"],
                              "speedup": r1["speedup_vs_target"]}
    print(f"random target, bf16: lossless {r1['lossless']}, {len(failures)} mismatching turn(s), "
          f"{sum(f['near_tie'] for f in failures)} at a near-tie", flush=True)

    # ---- decisive target + draft: bf16 (device) tau and outputs equal the fp32 CPU run's
    t2 = target_dir("decisive-target", decisive=True)
    d2 = draft_dir("decisive-draft", t2, decisive=True)
    r32, s32, _ = run_eval(t2, d2, "eval-fp32-cpu", bf16=False)
    r16, s16, _ = run_eval(t2, d2, "eval-bf16", bf16=True)
    same_text = [a["turns"] == b["turns"] for a, b in zip(s32, s16, strict=True)]
    out["tau_vs_fp32_cpu"] = {"tau_bf16": r16["acceptance_length"], "tau_fp32_cpu": r32["acceptance_length"],
                              "per_position_bf16": r16["per_position_acceptance"],
                              "per_position_fp32_cpu": r32["per_position_acceptance"],
                              "same_outputs": sum(same_text), "of": len(same_text),
                              "lossless_bf16": r16["lossless"], "lossless_fp32": r32["lossless"]}
    print(f"decisive models: tau bf16 {r16['acceptance_length']:.4f} vs fp32 CPU {r32['acceptance_length']:.4f}, "
          f"{sum(same_text)}/{len(same_text)} outputs equal", flush=True)
    out["checks"] = {
        "rotary_tables_fp32": rope_err <= 1e-2,  # bf16 rounds values in [-1, 1] by <= 2^-9
        "lossless_random_target": all(f["near_tie"] for f in failures),
        "tau_equals_fp32_cpu": r16["acceptance_length"] == r32["acceptance_length"] and all(same_text),
        "decisive_tau_above_1": r32["acceptance_length"] > 1.0,  # the draft really is accepted
    }


# ================================================================ pytest -m gpu
def gpu_tests(s: dict, dev, work: Path, deadline: float, out: dict) -> None:
    import xml.etree.ElementTree as ET

    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text())
    env = dict(os.environ)
    # staged by benchmarks/fetch_gpu_wheels.sh (SmolLM2's tokenizer, 40 ShareGPT records)
    assets = REPO / ".gpu" / "assets"
    if assets.is_dir():
        env.setdefault("EAGLE3_TEST_TOKENIZER", str(assets / "smollm2-tokenizer"))
        env.setdefault("EAGLE3_TEST_SHAREGPT", str(assets / "sharegpt-40.json"))
    junit = work / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *files]
    print(" ".join(cmd[1:]), flush=True)
    out["files"] = files
    try:
        p = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=max(10.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired as e:
        text = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        print(text[-4000:], flush=True)
        out.update(returncode=None, summary=f"killed at the section's time budget after {e.timeout:.0f} s",
                   checks={"gpu_tests_pass": False})
        return
    print(p.stdout[-4000:], flush=True)
    cases = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        kids = {c.tag: (c.get("message") or "").splitlines()[0][:300] if c.get("message") else "" for c in case}
        outcome = next((t for t in ("failure", "error", "skipped") if t in kids), "passed")
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), "message": kids.get(outcome, "")})
    count = {o: sum(c["outcome"] == o for c in cases) for o in ("passed", "failure", "error", "skipped")}
    summary = (p.stdout.strip().splitlines() or [""])[-1]
    out.update(returncode=p.returncode, summary=summary, **count, cases=cases,
               checks={"gpu_tests_pass": p.returncode in (0, 5) and not count["failure"] and not count["error"]})


# ================================================================ driver
def child(a) -> None:
    """Run one section in this process; write its result JSON (or let the exception end the process)."""
    import torch

    smoke = a.smoke
    s = SETTINGS["smoke" if smoke else "gpu"]
    dev = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    if smoke:
        torch.set_num_threads(1)  # tiny shapes on shared cores: one thread avoids OpenMP barrier waits
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")  # the CPU's only way
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + s["budget"][a.child] - 10
    out: dict = {}

    def write(partial: bool) -> None:
        Path(a.result).write_text(json.dumps({**out, "partial": partial}, default=str))

    def on_term(signum, frame):  # the parent's budget ran out: keep what is measured
        write(partial=True)
        os._exit(3)

    signal.signal(signal.SIGTERM, on_term)
    globals()[a.child](s, dev, work, deadline, out)
    write(partial=False)


def machine() -> dict:
    import torch

    m = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
         "cpus": os.cpu_count(), "cuda": torch.cuda.is_available()}
    if m["cuda"]:
        p = torch.cuda.get_device_properties(0)
        m.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), cuda_version=torch.version.cuda)
    try:
        import transformers

        m["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        m["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                     text=True).stdout.strip() or None
    except OSError:
        m["commit"] = None
    return m


def skipped(obj, path: str = "") -> list[str]:
    """Paths of the measurements a section left out for its time budget."""
    if isinstance(obj, dict):
        if isinstance(obj.get("skipped"), str):  # {"skipped": "time budget"}
            return [path.strip(".")]
        return [p for k, v in obj.items() for p in skipped(v, f"{path}.{k}")]
    return []


def run_section(name: str, a, budget: float, work: Path, log) -> dict:
    """One section in a child process, its output streamed with a prefix; killed at its budget."""
    result = work / f"{name}.json"
    cmd = [sys.executable, "-m", __spec__.name, "--child", name, "--result", str(result), "--work", str(work / name)]
    cmd += ["--smoke"] * a.smoke
    t = time.monotonic()
    quiet = {"PYTHONUNBUFFERED": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
             "TOKENIZERS_PARALLELISM": "false"}  # no weight-loading bars and notes in the log
    # cwd: the repo root, where `-m benchmarks.gpu_check` finds the package (and eagle3 next to it);
    # start_new_session: its own process group, so a budget stop reaches its children too
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, **quiet}, start_new_session=True)
    killed = threading.Event()

    def signal_group(sig) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, sig)

    def kill():  # SIGTERM: the child writes its partial result; SIGKILL if it has not gone 15 s later
        killed.set()
        signal_group(signal.SIGTERM)
        threading.Timer(15, signal_group, (signal.SIGKILL,)).start()

    timer = threading.Timer(budget, kill)
    timer.start()
    tail: list[str] = []
    for line in p.stdout:
        log(f"[{name}] {line.rstrip()}")
        tail = (tail + [line.rstrip()])[-15:]
    p.wait()
    timer.cancel()
    sec = {"seconds": round(time.monotonic() - t, 1), "budget_s": budget}
    if killed.is_set():
        part = json.loads(result.read_text()) if result.is_file() else {}
        return {**sec, "status": "timeout", "error": f"stopped at its {budget:.0f} s budget", "log_tail": tail,
                "result": {k: v for k, v in part.items() if k != "checks"}}
    if p.returncode or not result.is_file():
        err = next((ln for ln in reversed(tail) if ln.strip()), f"exit status {p.returncode}")
        return {**sec, "status": "error", "error": err, "log_tail": tail}
    return {**sec, "status": "ok", "result": json.loads(result.read_text())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", required=False, help="folder for gpu_check.json and gpu_check.log")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (what make test runs)")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--child", choices=SECTIONS, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return 0
    if not a.out:
        ap.error("--out DIR is required")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    mode = "smoke" if a.smoke else "gpu"
    budget = SETTINGS[mode]["budget"]
    logf = open(out / "gpu_check.log", "a")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    report = {"mode": mode, "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "sections": {}}
    log(f"gpu_check {mode}: {report['machine']}")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        for name in a.sections:
            log(f"== {name} (budget {budget[name]} s; {time.monotonic() - t0:.0f} s so far)")
            try:
                sec = run_section(name, a, budget[name], Path(tmp), log)
            except Exception as e:  # the driver itself must go on to the next section
                sec = {"status": "error", "error": f"{type(e).__name__}: {e}"}
            report["sections"][name] = sec
            checks = sec.get("result", {}).get("checks", {})
            log(f"== {name}: {sec['status']} in {sec.get('seconds', 0)} s"
                + (f" ({sec['error']})" if "error" in sec else "")
                + "".join(f"; {c} {'ok' if v else 'FAILED'}" for c, v in checks.items()))
            report["wall_s"] = round(time.monotonic() - t0, 1)
            report["failed"] = [f"{n}.{c}" for n, sc in report["sections"].items()
                                for c, v in sc.get("result", {}).get("checks", {}).items() if not v]
            report["failed"] += [n for n, sc in report["sections"].items() if sc["status"] != "ok"]
            report["ok"] = not report["failed"]
            report["skipped"] = [f"{n}.{path}" for n, sc in report["sections"].items()
                                 for path in skipped(sc.get("result"))]
            tmp_json = out / "gpu_check.json.tmp"
            tmp_json.write_text(json.dumps(report, indent=1, default=str))
            tmp_json.replace(out / "gpu_check.json")
    log(f"gpu_check {mode}: {'all checks passed' if report['ok'] else 'FAILED: ' + ', '.join(report['failed'])} "
        f"in {report['wall_s']} s; {out / 'gpu_check.json'}"
        + (f"; left out for time: {', '.join(report['skipped'])}" if report["skipped"] else ""))
    logf.close()
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
