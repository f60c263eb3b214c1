"""Stage 2: hidden-state extraction (transformers or vLLM backend) into a sharded, checksummed store.

    run_extract(model, prepared, out, cfg)  -> HiddenStates manifest
    open_store(out, split=None)             -> sequence of {sample_id, input_ids, loss_mask,
                                               aux_hidden_states [T, n_aux, H], final_hidden_states [T, H]}
"""
from eagle3.extract.run import run_extract
from eagle3.extract.store import HiddenStateStore, open_store

__all__ = [
    "HiddenStateStore",
    "open_store",
    "run_extract",
]
