"""All torch.distributed code of eagle3 lives here: the model file holds none (parallelism is applied to
a built model, as torchtitan does).

Runs under `torchrun` (RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR in the environment) or as
one plain process. gloo on CPU, nccl on CUDA. Parallelism is applied to a built model by
`wrap`: DDP, or FSDP2 (`fully_shard`; the trainer offers it on CUDA).

Several nodes: torchrun over a c10d rendezvous (eagle3/train/launch.py builds its flags); RANK is global,
so rank 0 is one process over every node.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def init(timeout_s: int = 1800) -> Dist:
    """Join the process group torchrun set up (or none, for one process)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    return Dist(rank, world, local, device)


def shutdown() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def wrap(model: nn.Module, d: Dist, fsdp: bool = False) -> nn.Module:
    """DDP or FSDP2 around a built model, over the process group; without a group (one plain
    process) DDP is the model itself. FSDP2 also runs over gloo on the CPU (benchmarks/gpu_check.py
    --smoke checks it there against DDP); the trainer offers --fsdp on CUDA only."""
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        if not dist.is_initialized():  # FSDP2 needs a process group, even of one (torchrun set the env)
            dist.init_process_group("nccl" if d.device.type == "cuda" else "gloo")
        # One group at the root: FSDP2 gathers a module's shards in that module's forward hooks, and
        # the draft layer's forward never runs (TTT calls its `project` and `finish` k times each), so
        # a group of its own would leave its weights sharded inside them (found by gpu_check --smoke).
        fully_shard(model)
        return model
    if not dist.is_initialized():  # init() starts a group only for world > 1
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None)


@contextmanager
def gathered(model: nn.Module, fsdp: bool) -> Iterator[None]:
    """Inside the block every FSDP2 module of `model` holds its full parameters, so its submodules can
    run outside the wrapped forward (the replay validation calls the draft directly); no-op without FSDP."""
    if not fsdp:
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in mods:
        m.unshard()
    try:
        yield
    finally:
        for m in mods:
            m.reshard()


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A plain (unsharded, CPU) state dict; FSDP2 DTensors are gathered. Call on every rank."""
    out = {}
    for k, v in unwrap(model).state_dict().items():
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        out[k] = v.detach().to("cpu").clone()
    return out


def all_sum(values: list[float], d: Dist) -> list[float]:
    """Sum a list of floats over ranks (fp64, so counts stay exact)."""
    if d.world == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=d.device if d.device.type == "cuda" else "cpu")
    dist.all_reduce(t)
    return t.tolist()


def broadcast_object(obj: Any, d: Dist) -> Any:
    if d.world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def optimizer_state(model: nn.Module, opt: torch.optim.Optimizer, fsdp: bool) -> dict:
    """The optimizer state as one unsharded dict (gathered under FSDP2; a collective there)."""
    if not fsdp:
        return opt.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer, state: dict, fsdp: bool) -> None:
    if not fsdp:
        opt.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, opt, state,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False))
