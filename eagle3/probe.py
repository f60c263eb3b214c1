"""How fast this host runs the pipeline's CPU kernels, against the host the preflight's rates were measured on.

Hosts of one kind (2 cores, the same memory) run this code 1.2-1.8x apart, so fixed rates misplan a slow host
by as much. A few seconds of the same kernels tell the preflight which one it is on:

- forward: a batched forward of two SmolLM2-wide decoder layers on oneDNN-prepacked linears (what extraction
  and the replay's aux-state pass run);
- decode: 16 steps of batched greedy decoding, 32 rows, the KV cache in preallocated buffers (`HFGenerator`, what
  builds the replay answers and the trainer's replay set; the live check decodes too);
- train: forward + backward + AdamW of the same layers with a 4,096-way loss (the trainer's step is linear
  layers and a softmax over the draft vocab, forward and backward).

Three rounds of the three kernels, each kernel warmed up and timed once a round, its fastest run kept (noise only
ever slows a run down; rounds spread a kernel's runs over the whole probe); ~10 s in all on a 2-core host.
`HostSpeed` holds this host's rate over the reference host's per kernel (1.0: as fast; 0.6: 1/0.6 = 1.67x the time).
"""
from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass

# The same probe on the reference host (2-core AMD EPYC, idle, torch 2.13 CPU, 2 threads), the host the preflight's
# CPU planning rates were measured on. Units: tokens/s (forward, train) and decoded tokens/s (decode). Four processes
# there read 8,979-10,038 / 948-1,025 / 2,231-2,416 (`python -m benchmarks.speed.probe` prints them).
REFERENCE = {"forward": 9600.0, "decode": 1000.0, "train": 2300.0}
ROUNDS = 3  # of the three kernels in turn (`rates`)


@dataclass(frozen=True)
class HostSpeed:
    """This host's rate / the reference host's, per kernel; `measured` False: the reference itself (1.0 each)."""

    forward: float = 1.0
    decode: float = 1.0
    train: float = 1.0
    measured: bool = False
    seconds: float = 0.0  # what measuring took

    def line(self) -> str:
        if not self.measured:
            return "host speed: not measured (the reference host's rates)"
        return (f"host speed vs the reference host: forward {self.forward:.2f}x, decode {self.decode:.2f}x, "
                f"train {self.train:.2f}x (measured in {self.seconds:.1f} s)")

    def as_dict(self) -> dict:
        return asdict(self)


def _model(vocab: int = 4096, layers: int = 2):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=vocab, max_position_embeddings=2048, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).float().eval()


def _best(fn, reps: int = 3) -> float:
    fn()  # warm-up: oneDNN primitives, the allocator
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def rates() -> dict[str, float]:
    """This host's raw probe rates (the REFERENCE units), at torch's current thread count."""
    import torch

    from eagle3.config import RegenConfig
    from eagle3.decoding.cpu_linear import packed_linears
    from eagle3.decoding.generate import HFGenerator

    model = _model()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4096, (4, 512), generator=g)  # [B, T]

    def forward() -> None:
        with torch.inference_mode():
            model.model(input_ids=ids, use_cache=False)

    rows, steps = 32, 16
    gen = HFGenerator(model, {-1}, RegenConfig(max_new_tokens=steps, batch_size=rows, batch_tokens=1 << 20), 0)
    gen.cpu_linear = False  # packed once, below: each entry would repack every weight and time its kernels again
    prompts = [torch.randint(1, 4096, (128,), generator=g).tolist() for _ in range(rows)]

    def decode() -> None:
        gen.generate(prompts, [0] * rows)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tids = ids[:2]  # [2, 512]

    def step() -> None:
        model(input_ids=tids, labels=tids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    # Rounds of all three kernels, each kernel's fastest run kept: a slow spell of a few seconds (another process,
    # the page cache writing back a fresh install) then costs one sample per kernel, not a kernel's every sample.
    # Run back to back, one such spell read forward 0.58x on a host whose extraction then ran at 1.02x.
    # The kernels alone: packing the weights (fresh pages, faulted in) inside the timed calls made the forward's
    # figure swing 0.78x-1.29x between processes on one idle host.
    t_fwd = t_dec = t_train = float("inf")
    for _ in range(ROUNDS):
        model.eval()
        with packed_linears(model.model, timed=False):
            t_fwd = min(t_fwd, _best(forward, reps=1))
        with packed_linears(model):
            t_dec = min(t_dec, _best(decode, reps=1))
        model.train()  # the same layers, trained a step (the AdamW steps change no shape, so no kernel's speed)
        t_train = min(t_train, _best(step, reps=1))
    return {"forward": ids.numel() / t_fwd, "decode": rows * steps / t_dec, "train": tids.numel() / t_train}


@functools.lru_cache(maxsize=1)
def measure() -> HostSpeed:
    """This host's HostSpeed, measured once per process (~12 s on a 2-core host)."""
    t0 = time.perf_counter()
    r = rates()
    return HostSpeed(**{k: r[k] / REFERENCE[k] for k in REFERENCE}, measured=True,
                     seconds=round(time.perf_counter() - t0, 1))
