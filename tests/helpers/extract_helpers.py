"""Test helpers for the extract stage: small prepared dirs written the way `eagle3 prepare` does."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3.storage.hashing import sha256_file
from eagle3.storage.manifests import PreparedData, ShardInfo

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It was a sunny day in the park.",
    "Write a Python function that returns the n-th Fibonacci number using memoization.",
    "Explain why the sky is blue in two sentences, for a ten-year-old.",
    "List three differences between TCP and UDP, and give one use case for each.",
    "What is the capital of France? Answer with one word, then explain its history briefly.",
    "Translate 'good morning, how are you?' into Spanish, German and Italian.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "How do I sort a list of dictionaries by a key in Python? Show an example.",
    "Give me a recipe for pancakes with exact quantities.",
    "Why do cats purr? Describe the current scientific explanations.",
    "Compose a haiku about autumn leaves falling into a quiet river.",
    "What are the main causes of inflation, and how do central banks respond?",
]


def sample_id(ids: list[int], mask: list[int]) -> str:
    return hashlib.sha256(repr((ids, mask)).encode()).hexdigest()


def write_prepared(out: Path, splits: dict[str, list[tuple[list[int], list[int]]]],
                   per_file: int = 1000) -> PreparedData:
    """splits: name -> [(input_ids, loss_mask)]. Writes Parquet shards + a sealed PreparedData manifest."""
    out.mkdir(parents=True, exist_ok=True)
    infos: dict[str, list[ShardInfo]] = {}
    for split, rows in splits.items():
        infos[split] = []
        for k in range(0, len(rows), per_file):
            chunk = rows[k : k + per_file]
            f = f"{split}-{k // per_file:05d}.parquet"
            tab = pa.table(
                {
                    "sample_id": [sample_id(i, m) for i, m in chunk],
                    "record_id": [f"r{k + j}" for j in range(len(chunk))],
                    "input_ids": pa.array([i for i, _ in chunk], type=pa.list_(pa.int32())),
                    "loss_mask": pa.array([m for _, m in chunk], type=pa.list_(pa.int8())),
                }
            )
            pq.write_table(tab, out / f)
            infos[split].append(
                ShardInfo(
                    file=f, sha256=sha256_file(out / f), num_samples=len(chunk),
                    num_tokens=sum(len(i) for i, _ in chunk), num_trainable_tokens=sum(sum(m) for _, m in chunk),
                )
            )
    man = PreparedData(splits=infos, source="test", num_tokens=sum(s.num_tokens for v in infos.values() for s in v))
    man.write(out)
    return PreparedData.read(out)


def chat_samples(tokenizer, n: int, max_len: int = 10_000, repeat: int = 1) -> list[tuple[list[int], list[int]]]:
    """n real chat-templated samples (user text, assistant echo) with the assistant part masked in."""
    rows = []
    for i in range(n):
        text = " ".join([TEXTS[i % len(TEXTS)]] * repeat)
        msgs = [{"role": "user", "content": text}, {"role": "assistant", "content": TEXTS[(i + 1) % len(TEXTS)]}]
        ids = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        ids = list(ids)[:max_len]
        cut = len(ids) // 2
        rows.append((ids, [0] * cut + [1] * (len(ids) - cut)))
    return rows


def random_samples(vocab: int, lengths: list[int], seed: int = 0) -> list[tuple[list[int], list[int]]]:
    import random

    rng = random.Random(seed)
    return [([rng.randrange(vocab) for _ in range(n)], [rng.randrange(2) for _ in range(n)]) for n in lengths]
