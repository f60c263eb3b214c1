"""Extract (hf backend) on real data: 200 ShareGPT conversations through SmolLM2, max 1024 tokens.

Prints
- throughput_ratio: the hf backend's tokens/s (the whole stage: forward with hooks, copies,
  storage conversion, validation, shard writes, sha256, index) divided by a bare `model.model`
  forward over the very same batches in the same process. The two are interleaved batch by
  batch (alternating which goes first), so load from other processes hits both alike.
- bytes_ratio{,_fp8,_fp8_aux}: stored bytes per token (shards on disk, headers included)
  divided by 4*H*2 (4 states of H values in bf16); goals <= 1.01, 0.51, 0.64.
- argmax agreement of lm_head(norm(final)) with the fp32 target on the first --agree-tokens
  tokens, for each storage choice, read back from the stores on disk (tau needs the trainer).
The fp8 stores are written by replaying the exact fp32 states of the bf16 run through the same
writer, so they cost no second forward. Last line: one JSON object.

With --dtypes, instead: the whole stage computing in fp32 and in bf16 (`extract.dtype`), each twice, in the
order fp32, bf16, bf16, fp32 (load from other processes hits both alike), on the same prepared samples: tokens/s
of each, the ratio bf16 / fp32, and how far the bf16 store is from the fp32 one (argmax agreement of
lm_head(norm(final)), and the relative RMS error of each stored state).

    .venv/bin/python -m benchmarks.speed.extract [--limit 200] [--max-len 1024] [--prepared DIR] [--dtypes]
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from eagle3.assets import materialize_smollm2
from eagle3.config import ExtractConfig, PrepareConfig
from eagle3.extract import run_extract
from eagle3.extract.hf import HFBackend
from eagle3.model.target import Target
from eagle3.storage.store import open_store

REPO = Path(__file__).resolve().parents[2]


class TimedHF(HFBackend):
    """The hf backend, plus a bare forward of each batch timed on the side; keeps fp32 states."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.bare_s = 0.0
        self.hook_s = 0.0
        self.bench_s = 0.0
        self.calls = 0
        self.states: dict[str, torch.Tensor] = {}

    @torch.inference_mode()
    def _bare(self, ids):
        cuda = self.device.type == "cuda"  # CUDA runs ahead of Python: time between synchronizations
        if cuda:
            torch.cuda.synchronize(self.device)
        t = time.perf_counter()
        self.model(input_ids=ids.to(self.device), use_cache=False)  # model.model: decoder stack + final norm
        if cuda:
            torch.cuda.synchronize(self.device)
        self.bare_s += time.perf_counter() - t

    def forward(self, ids):
        self.calls += 1
        if self.calls % 2:
            self._bare(ids)
        t = time.perf_counter()
        h = super().forward(ids)
        self.hook_s += time.perf_counter() - t
        if not self.calls % 2:
            self._bare(ids)
        return h

    def extract(self, samples, on_tokens=None):
        for sid, tok, h in super().extract(samples, on_tokens):
            t = time.perf_counter()
            self.states[sid] = h.clone()  # fp32 [T, 4, H], for the replayed fp8 stores
            self.bench_s += time.perf_counter() - t  # instrumentation: not the stage's time
            yield sid, tok, h


class Replay:
    """A backend that returns states captured earlier (no forward)."""

    name = "hf"

    def __init__(self, states):
        self.states = states

    def extract(self, samples, on_tokens=None):
        for sid, ids in samples:
            yield sid, ids, self.states[sid]


def agreement(lm_head, norm, store, ref_final, n_tokens: int) -> float:
    hit = tot = 0
    with torch.inference_mode():
        for s in store:
            if tot >= n_tokens:
                break
            want = ref_final[s["sample_id"]]
            got = s["final_hidden_states"].float()
            a = lm_head(norm(want)).argmax(-1)
            b = lm_head(norm(got)).argmax(-1)
            hit += (a == b).sum().item()
            tot += len(a)
    return hit / tot


def dtypes(model: Path, prep: Path, tmp: Path, n_tokens: int) -> None:
    """The stage in fp32 and in bf16 compute, side by side (see the module docstring)."""
    seconds: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    for i, dt in enumerate(["float32", "bfloat16", "bfloat16", "float32"]):
        t = time.perf_counter()
        m = run_extract(model, prep, tmp / f"{dt}-{i}", ExtractConfig(dtype=dt), show_progress=False)
        seconds[dt].append(time.perf_counter() - t)
    tokens = m.num_tokens
    rate = {dt: tokens / min(s) for dt, s in seconds.items()}
    ref, got = open_store(tmp / "float32-0"), open_store(tmp / "bfloat16-1")
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    hit = tot = 0
    err = torch.zeros(4, dtype=torch.float64)
    norm = torch.zeros(4, dtype=torch.float64)
    with torch.inference_mode():
        for a, b in zip(ref, got, strict=True):
            if tot >= n_tokens:
                break
            x = torch.cat([a["aux_hidden_states"], a["final_hidden_states"][:, None]], 1).double()  # [T, 4, H]
            y = torch.cat([b["aux_hidden_states"], b["final_hidden_states"][:, None]], 1).double()
            err += (x - y).pow(2).sum((0, 2))
            norm += x.pow(2).sum((0, 2))
            top = [lm.lm_head(lm.model.norm(h[:, -1].float())).argmax(-1) for h in (x, y)]
            hit += (top[0] == top[1]).sum().item()
            tot += len(top[0])
    rel = (err / norm).sqrt()
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads")
    print(f"data: {m.num_samples} samples, {tokens} tokens")
    for dt, s in seconds.items():
        print(f"extract, {dt:8s} compute: {rate[dt]:7.1f} tok/s (best of {', '.join(f'{x:.1f}' for x in s)} s)")
    print(f"bf16 / fp32 = {rate['bfloat16'] / rate['float32']:.3f}x")
    print(f"bf16 against fp32 on {tot} tokens: argmax agreement {100 * hit / tot:.2f}%, relative RMS error of the "
          f"stored states (3 aux, final) {', '.join(f'{v:.4f}' for v in rel.tolist())}")
    print(json.dumps({"tokens": tokens, "tok_s": {k: round(v, 1) for k, v in rate.items()},
                      "ratio": round(rate["bfloat16"] / rate["float32"], 3), "argmax_agreement": round(hit / tot, 5),
                      "relative_rms_error": [round(v, 5) for v in rel.tolist()]}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--model", default=str(REPO / "assets" / "smollm2"))
    ap.add_argument("--prepared", default=None, help="an existing prepare dir (default: prepare ShareGPT here)")
    ap.add_argument("--agree-tokens", type=int, default=20000)
    ap.add_argument("--dtypes", action="store_true", help="the stage in fp32 and in bf16 compute, side by side")
    a = ap.parse_args()
    model = materialize_smollm2(a.model) if Path(a.model).name == "smollm2" else Path(a.model)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prep = Path(a.prepared) if a.prepared else tmp / "prep"
        if not a.prepared:
            from eagle3.prepare import prepare

            prepare(model, prep, PrepareConfig(data="sharegpt", limit=a.limit, max_len=a.max_len), progress=False)
        if a.dtypes:
            return dtypes(model, prep, tmp, a.agree_tokens)
        base = Target.open(model).load_model(head=False, device="cpu")
        n = base.config.num_hidden_layers
        H = base.config.hidden_size
        ids = [2, n // 2, n - 3, n]
        be = TimedHF(base, ids, batch_tokens=ExtractConfig().batch_tokens)
        be.forward(torch.zeros(1, 64, dtype=torch.long))  # warm-up, not counted
        be.bare_s = be.hook_s = be.bench_s = 0.0
        be.states.clear()

        t0 = time.perf_counter()
        m = run_extract(model, prep, tmp / "bf16", ExtractConfig(), backend=be, show_progress=False)
        total_s = time.perf_counter() - t0
        # the stage's own time: everything but the side bare forwards and the benchmark's copies
        stage_s = total_s - be.bare_s - be.bench_s
        tokens = m.num_tokens
        tput, bare_tput = tokens / stage_s, tokens / be.bare_s

        ratios = {"bf16": m.num_bytes / tokens / (4 * H * 2)}
        stores = {"bf16": tmp / "bf16"}
        for st in ["fp8", "fp8-aux", "fp32"]:
            mm = run_extract(model, prep, tmp / st, ExtractConfig(storage=st), backend=Replay(be.states),
                             show_progress=False)
            ratios[st] = mm.num_bytes / mm.num_tokens / (4 * H * 2)
            stores[st] = tmp / st

        from transformers import AutoModelForCausalLM

        lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        ref_final = {sid: h[:, -1] for sid, h in be.states.items()}
        agree = {st: agreement(lm.lm_head, lm.model.norm, open_store(d), ref_final, a.agree_tokens)
                 for st, d in stores.items()}

        print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads")
        print(f"data: {m.num_samples} samples, {tokens} tokens (max {a.max_len}), {len(m.shards)} shard(s)")
        print(f"hf backend (whole stage): {tput:8.1f} tok/s  ({stage_s:.1f} s; hooked forwards {be.hook_s:.1f} s)")
        print(f"bare model.model forward: {bare_tput:8.1f} tok/s  ({be.bare_s:.1f} s, same batches)")
        print(f"throughput_ratio = {tput / bare_tput:.4f}   (goal >= 0.95)")
        goals = {"bf16": 1.01, "fp8": 0.51, "fp8-aux": 0.64, "fp32": 2.01}
        for st in ["bf16", "fp8", "fp8-aux", "fp32"]:
            print(f"storage {st:8s}: bytes/token / (4*H*2) = {ratios[st]:.4f} (goal <= {goals[st]}); "
                  f"argmax agreement {100 * agree[st]:.2f}%")
        print(json.dumps({
            "throughput_ratio": round(tput / bare_tput, 4),
            "bytes_ratio": round(ratios["bf16"], 4),
            "bytes_ratio_fp8": round(ratios["fp8"], 4),
            "bytes_ratio_fp8_aux": round(ratios["fp8-aux"], 4),
            "tokens_per_second": round(tput, 1),
            "bare_tokens_per_second": round(bare_tput, 1),
            "tokens": tokens,
            "argmax_agreement": {k: round(v, 5) for k, v in agree.items()},
        }))


if __name__ == "__main__":
    main()
