"""Stage 0 (optional): the target rewrites every assistant turn of a chat dataset.

    regenerate(model, data, out, cfg) -> RegeneratedData (regenerated.jsonl, read by `eagle3 prepare`)

Backends: hf.py (transformers, batched) and vllm.py (GPU host); the driver is run.py.
"""
from eagle3.regenerate.run import OUT_FILE, progress_line, read_records, regenerate

__all__ = ["OUT_FILE", "progress_line", "read_records", "regenerate"]
