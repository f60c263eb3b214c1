"""Stage 2: hidden-state extraction (transformers or vLLM backend) into a sharded, checksummed store.

    run_extract(model, prepared, out, cfg)  -> HiddenStates manifest

The store's format and its reader (`eagle3.storage.store.open_store`) live below the stages: training reads it.
"""
from eagle3.extract.run import run_extract

__all__ = ["run_extract"]
