"""The prepared-data shard format, written by `eagle3 prepare` and read by the stages after it.

Each split is a list of Parquet shards named in the prepare manifest with their sha256:
one row per sample, `sample_id` (content hash of ids + mask), `record_id` (the source record),
`input_ids` int32 [T] and `loss_mask` int8 [T].
"""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3.storage.hashing import sha256_file_cached
from eagle3.storage.manifests import PreparedData

SCHEMA = pa.schema([
    ("sample_id", pa.string()),
    ("record_id", pa.string()),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
])


def read_shard(prepared: str | Path, info, columns: list[str] | None = None) -> pa.Table:
    """One shard the prepare manifest lists (`info`: its file and sha256), checked first: a missing file or one
    whose checksum differs is refused with its path."""
    path = Path(prepared) / info.file
    if not path.is_file():
        raise ValueError(f"{path}: prepared shard listed in the manifest is missing")
    if sha256_file_cached(path) != info.sha256:
        raise ValueError(f"{path}: sha256 does not match the prepare manifest (corrupt or replaced)")
    return pq.read_table(path, columns=columns)


def read_split(prepared: str | Path, split: str) -> pa.Table:
    """All samples of one split as one Arrow table (each shard checked by `read_shard`)."""
    m = PreparedData.read(prepared)
    tables = [read_shard(prepared, info) for info in m.splits.get(split, [])]
    return pa.concat_tables(tables) if tables else SCHEMA.empty_table()
