"""Stage 1: render conversations with the target's chat template, mask all but the assistant tokens,
write Parquet shards and build the draft vocabulary (run.py).

    prepare(model, out, cfg)  -> PreparedData manifest
"""
from eagle3.prepare.run import VOCAB_FILE, inputs, prepare, show_samples

__all__ = ["VOCAB_FILE", "inputs", "prepare", "show_samples"]
