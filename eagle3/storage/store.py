"""The hidden-state store: many samples per safetensors shard, an index, a memory-mapped reader.

Layout of an extract dir:

    manifest.json          HiddenStates (written last: its presence means "done")
    index.parquet          sample_id -> (split, shard, offset, length)
    shards/{split}-{i:05d}.safetensors

One shard holds the concatenation of its samples along the token axis (Ttot = sum of T):

    input_ids   [Ttot]            int32
    loss_mask   [Ttot]            int8
    aux         [Ttot, n_aux, H]  bf16 | fp32 | fp8 e4m3
    final       [Ttot, H]         bf16 | fp32 | fp8 e4m3   (final *pre-norm* state, vLLM id N)
    aux_scale   [Ttot, n_aux]     fp32   only when aux is fp8   (one scale per token and layer)
    final_scale [Ttot]            fp32   only when final is fp8

and one metadata entry `eagle3` (a JSON string: the shard's plan key, sample ids and lengths),
so a resumed run can tell a committed shard from a stale one without any other file.
Everything written is a pure function of (model, samples, layer ids, storage), so a rerun
writes byte-identical shards.
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3.storage.atomic import atomic_path, write_safetensors
from eagle3.storage.hashing import sha256_file_cached, sha256_json

FORMAT_VERSION = 1
META_KEY = "eagle3"
SHARD_DIR = "shards"
INDEX_FILE = "index.parquet"
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448.0

# storage choice -> (dtype of aux, dtype of final)
STORAGE_DTYPES: dict[str, tuple[torch.dtype, torch.dtype]] = {
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp32": (torch.float32, torch.float32),
    "fp8": (FP8, FP8),
    "fp8-aux": (FP8, torch.bfloat16),  # fp8 on the final state costs argmax agreement; keep it bf16
}

_ST_DTYPES = {
    "BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16, "F8_E4M3": FP8,
    "I32": torch.int32, "I64": torch.int64, "I8": torch.int8, "U8": torch.uint8,
}


def bytes_per_token(n_aux: int, hidden: int, storage: str) -> int:
    """Stored bytes of one token: ids (4) + mask (1) + states + fp8 scales (4 per scaled vector)."""
    aux_dt, fin_dt = STORAGE_DTYPES[storage]
    n = 4 + 1 + n_aux * hidden * aux_dt.itemsize + hidden * fin_dt.itemsize
    n += 4 * n_aux * (aux_dt == FP8) + 4 * (fin_dt == FP8)
    return n


# ---------------------------------------------------------------- fp8
def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] -> (q [..., H] e4m3, scale [...] fp32) with x ~= q * scale.

    One scale per vector (per token and layer): hidden states have a few huge channels whose
    magnitude varies a lot from token to token, so a per-tensor scale would crush the rest.
    """
    x = x.float()
    scale = x.abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.unsqueeze(-1)


# ---------------------------------------------------------------- validation
def validate_sample(
    sample_id: str,
    expected_ids: torch.Tensor,
    token_ids: torch.Tensor,
    hidden: torch.Tensor,
    n_layers: int,
    hidden_size: int,
    where: str = "",
) -> None:
    """Check one extracted sample before its shard may be committed; ValueError names the sample.

    expected_ids [T] (the prepared ids), token_ids [T] (what the backend says it ran),
    hidden [T, n_layers, H] (aux ids, then id N).
    """
    at = f"{where}: " if where else ""
    T = int(expected_ids.numel())
    if hidden.dim() != 3 or hidden.shape[1] != n_layers:
        raise ValueError(
            f"{at}sample {sample_id}: expected hidden states [T, {n_layers} layers, H], got "
            f"{tuple(hidden.shape)} (a backend that dropped layers -- see the collective_rpc trap)"
        )
    if hidden.shape[0] != T or hidden.shape[2] != hidden_size:
        raise ValueError(
            f"{at}sample {sample_id}: expected [T, H] = [{T}, {hidden_size}] per layer, "
            f"got [{hidden.shape[0]}, {hidden.shape[2]}]"
        )
    tok = token_ids.reshape(-1).to(torch.int64)
    if tok.numel() != T or not torch.equal(tok, expected_ids.reshape(-1).to(torch.int64)):
        raise ValueError(
            f"{at}sample {sample_id}: the backend's token ids ({tok.numel()} tokens) differ from "
            f"the prepared ids ({T} tokens)"
        )
    bad = (~torch.isfinite(hidden)).sum().item()
    if bad:
        raise ValueError(f"{at}sample {sample_id}: {bad} non-finite (NaN/Inf) hidden-state values")


# ---------------------------------------------------------------- writing
@dataclass
class ShardPlan:
    """One shard to write: which prepared rows go in it, in order, and the key that names its content."""

    split: str
    index: int
    rows: list[int]  # global row numbers into the prepared samples
    sample_ids: list[str]
    lengths: list[int]
    key: str = ""

    @property
    def file(self) -> str:
        return f"{SHARD_DIR}/{self.split}-{self.index:05d}.safetensors"

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


@dataclass
class ShardWriter:
    """Collects a shard's samples (any order), validates each one, writes the shard in plan order."""

    plan: ShardPlan
    n_aux: int
    hidden_size: int
    storage: str
    _rec: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    def add(
        self,
        sample_id: str,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
    ) -> None:
        """hidden [T, n_aux + 1, H]: aux ids in order, then id N (the final pre-norm state)."""
        validate_sample(
            sample_id, input_ids, token_ids, hidden, self.n_aux + 1, self.hidden_size, where=f"shard {self.plan.file}"
        )
        aux_dt, fin_dt = STORAGE_DTYPES[self.storage]
        rec = {"input_ids": input_ids.to(torch.int32), "loss_mask": loss_mask.to(torch.int8)}
        aux, fin = hidden[:, : self.n_aux], hidden[:, self.n_aux]
        if aux_dt == FP8:
            rec["aux"], rec["aux_scale"] = quantize_fp8(aux)
        else:
            rec["aux"] = aux.to(aux_dt).contiguous()
        if fin_dt == FP8:
            rec["final"], rec["final_scale"] = quantize_fp8(fin)
        else:
            rec["final"] = fin.to(fin_dt).contiguous()
        self._rec[sample_id] = rec

    def add_stored(self, sample_id: str, rec: dict[str, torch.Tensor]) -> None:
        """Reuse a sample exactly as an earlier run stored it (same storage format): no requantization."""
        self._rec[sample_id] = {k: v.clone() for k, v in rec.items()}

    def missing(self) -> list[str]:
        return [s for s in self.plan.sample_ids if s not in self._rec]

    def write(self, root: Path) -> str:
        """Concatenate in plan order, write atomically, return the shard's sha256."""
        miss = self.missing()
        if miss:
            raise ValueError(f"shard {self.plan.file}: no hidden states for sample(s) {miss[:5]}")
        recs = [self._rec[s] for s in self.plan.sample_ids]
        tensors = {k: torch.cat([r[k] for r in recs]).contiguous() for k in recs[0]}
        del recs
        self._rec.clear()  # only the concatenated copy stays alive while the file is written
        meta = {
            "format_version": FORMAT_VERSION,
            "key": self.plan.key,
            "split": self.plan.split,
            "storage": self.storage,
            "sample_ids": self.plan.sample_ids,
            "lengths": self.plan.lengths,
        }
        final = Path(root) / self.plan.file
        with atomic_path(final) as tmp:
            # One metadata key only: safetensors keeps metadata in a hash map, so with several keys
            # their order in the header (and so the shard's bytes) could change from run to run.
            write_safetensors(tmp, tensors, metadata={META_KEY: json.dumps(meta, sort_keys=True)})
        return sha256_file_cached(final)  # also this host's stamp: the trainer's ranks need not hash it again


def plan_key(common: dict[str, Any], sample_ids: list[str]) -> str:
    """Content key of a shard: what it was computed from (model, layers, storage, samples)."""
    return sha256_json({**common, "sample_ids": sample_ids})


# ---------------------------------------------------------------- reading
def read_header(path: str | os.PathLike) -> tuple[int, dict[str, Any]]:
    """(data start offset, header dict) of a safetensors file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > 1 << 30:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        head = json.loads(f.read(n))
    return 8 + n, head


def shard_meta(path: str | os.PathLike) -> dict[str, Any] | None:
    """The eagle3 metadata of a shard, or None when the file is unreadable or not ours."""
    try:
        _, head = read_header(path)
        return json.loads(head.get("__metadata__", {})[META_KEY])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def shard_problem(path: str | os.PathLike, sha256: str | None = None) -> str | None:
    """Why the shard at `path` cannot be used (missing, truncated, or not the bytes `sha256` names), or None.

    Without a checksum only the header is checked against the file size, which catches truncation.
    The sha256 is computed once per file identity on this host (`sha256_file_cached`)."""
    path = Path(path)
    if not path.is_file():
        return f"{path}: missing"
    try:
        start, head = read_header(path)
    except (OSError, ValueError) as e:
        return f"{path}: unreadable header ({e})"
    end = max((info["data_offsets"][1] for k, info in head.items() if k != "__metadata__"), default=0)
    size = path.stat().st_size
    if start + end != size:
        return f"{path}: truncated or padded ({size} bytes, its header says {start + end})"
    if sha256 is not None and sha256_file_cached(path) != sha256:
        return f"{path}: sha256 differs from the manifest (corrupt)"
    return None


def mmap_shard(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file as views of one private (copy-on-write) memory map."""
    start, head = read_header(path)
    size = os.path.getsize(path)
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
    out = {}
    for name, info in head.items():
        if name == "__metadata__":
            continue
        dt = _ST_DTYPES[info["dtype"]]
        b, e = info["data_offsets"]
        off = start + b
        if off % dt.itemsize:  # safetensors aligns data; a misaligned file is not ours
            raise ValueError(f"{path}: tensor {name} is not aligned for {dt}")
        shape = tuple(info["shape"])
        t = torch.empty(0, dtype=dt)
        t.set_(storage, off // dt.itemsize, shape)
        if (e - b) != t.numel() * dt.itemsize:
            raise ValueError(f"{path}: tensor {name} has {e - b} bytes, expected {t.numel() * dt.itemsize}")
        out[name] = t
    return out


class HiddenStateStore(Sequence):
    """A read-only sequence of samples of one extract dir (optionally one split).

    store[i] -> {sample_id, input_ids [T], loss_mask [T], aux_hidden_states [T, n_aux, H],
    final_hidden_states [T, H]}. bf16/fp32 tensors are views of memory-mapped shards;
    fp8 ones are dequantized to fp32 on access.
    """

    def __init__(self, root: str | os.PathLike, split: str | None = None):
        from eagle3.storage.manifests import HiddenStates

        self.root = Path(root)
        self.manifest = HiddenStates.read(self.root)
        tab = read_index(self.root, self.manifest)
        keep = [i for i, s in enumerate(tab["split"]) if split is None or s == split]
        if split is not None and split not in self.manifest.splits:
            raise ValueError(f"{self.root}: no split {split!r} (have {sorted(self.manifest.splits)})")
        self.sample_ids: list[str] = [tab["sample_id"][i] for i in keep]
        self._loc = [(tab["shard"][i], tab["offset"][i], tab["length"][i]) for i in keep]
        self._pos = {s: i for i, s in enumerate(self.sample_ids)}
        self._shards: dict[int, dict[str, torch.Tensor]] = {}
        self.aux_layer_ids = list(self.manifest.aux_layer_ids)
        self.storage = self.manifest.storage

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def lengths(self) -> list[int]:
        """Token count of each sample, from the index (no shard is read)."""
        return [n for _, _, n in self._loc]

    def _shard(self, k: int) -> dict[str, torch.Tensor]:
        if k not in self._shards:
            # Checked against the manifest before any of its bytes is trusted (a flipped bit would
            # otherwise train silently on garbage): hashed once per host and file identity, so the
            # other ranks, retries and later runs find this host's stamp instead of re-reading it.
            info = self.manifest.shards[k]
            bad = shard_problem(self.root / info.file, info.sha256)
            if bad:
                raise ValueError(f"{bad}; rerun `eagle3 extract` with the same arguments: it rebuilds only this shard")
            self._shards[k] = mmap_shard(self.root / info.file)
        return self._shards[k]

    def raw(self, i: int) -> dict[str, torch.Tensor]:
        """Sample i exactly as stored (storage dtypes, scales included): views, no copy."""
        k, off, n = self._loc[i]
        return {name: t[off : off + n] for name, t in self._shard(k).items()}

    def find(self, sample_id: str) -> int | None:
        return self._pos.get(sample_id)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return as_sample(self.sample_ids[i], self.raw(i))


INDEX_COLUMNS = ("sample_id", "split", "shard", "offset", "length")


def read_index(root: Path, m) -> dict[str, list]:
    """The store's index as columns, checked before any of it is used: its checksum against the manifest's
    (hashed once per host and file identity), its columns, and each record's shard, offset and length against
    the manifest's shards, so a wrong offset is an error naming the record instead of a silent wrong slice."""
    import pyarrow.parquet as pq

    path = root / m.index_file
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the store's index is missing; rerun `eagle3 extract` with the same "
                                "arguments")
    if m.index_sha256 and sha256_file_cached(path) != m.index_sha256:
        raise ValueError(f"{path}: checksum does not match the manifest's index_sha256 (the index was changed "
                         "or damaged); rerun `eagle3 extract` with the same arguments")
    try:
        tab = pq.read_table(path).to_pydict()
    except Exception as e:  # pyarrow's errors are of many kinds: any of them means an unreadable index
        raise ValueError(f"{path}: not a readable Parquet index ({type(e).__name__}: {e})") from None
    missing = [c for c in INDEX_COLUMNS if c not in tab]
    if missing:
        raise ValueError(f"{path}: no column {', '.join(missing)}")
    if len(tab["sample_id"]) != m.num_samples:
        raise ValueError(f"{path}: {len(tab['sample_id'])} records, the manifest counts {m.num_samples}")
    for i, (sid, k, off, n) in enumerate(zip(tab["sample_id"], tab["shard"], tab["offset"], tab["length"],
                                             strict=True)):
        if not (isinstance(k, int) and 0 <= k < len(m.shards)):
            raise ValueError(f"{path}: record {i} (sample {sid!r}): shard {k!r} is not one of the manifest's "
                             f"{len(m.shards)} shards")
        total = m.shards[k].num_tokens
        if not (isinstance(off, int) and isinstance(n, int) and off >= 0 and n > 0 and off + n <= total):
            raise ValueError(f"{path}: record {i} (sample {sid!r}): tokens {off!r}..{off!r}+{n!r} lie outside "
                             f"shard {k} ({m.shards[k].file}: {total} tokens)")
    return tab


def as_sample(sample_id: str, r: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A stored sample `r` (as `raw` returns it) as the dict readers hand out; fp8 states dequantized to fp32."""
    aux = dequantize_fp8(r["aux"], r["aux_scale"]) if "aux_scale" in r else r["aux"]
    fin = dequantize_fp8(r["final"], r["final_scale"]) if "final_scale" in r else r["final"]
    return {
        "sample_id": sample_id,
        "input_ids": r["input_ids"],
        "loss_mask": r["loss_mask"],
        "aux_hidden_states": aux,
        "final_hidden_states": fin,
    }


def open_store(root: str | os.PathLike, split: str | None = None) -> HiddenStateStore:
    """Open a finished extract dir: a sequence of sample dicts (see HiddenStateStore)."""
    return HiddenStateStore(root, split)
