"""Stage 3: the target's embedding, final norm and lm_head, read tensor by tensor from its safetensors
shards (run.py).

    extract_verifier(model, prepared, out)  -> VerifierWeights manifest
"""
from eagle3.verifier.run import OUT_FILE, extract_verifier, inputs

__all__ = ["OUT_FILE", "extract_verifier", "inputs"]
