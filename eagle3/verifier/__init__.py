"""Stage 3: the target's embedding, final norm and lm_head, read tensor by tensor from its safetensors
shards (run.py).

    extract_verifier(model, prepared, out)  -> VerifierWeights manifest
"""
from __future__ import annotations

from eagle3.flags import MODEL, OUT, PREPARED
from eagle3.stage import Stage, lazy_exports
from eagle3.storage.manifests import VerifierWeights

__getattr__ = lazy_exports("eagle3.verifier.run")  # OUT_FILE, extract_verifier, inputs


def _run(out, cfg: None = None, *, model, prepared) -> VerifierWeights:
    from eagle3.verifier.run import extract_verifier

    return extract_verifier(model, prepared, out)


def _inputs(cfg: None = None, *, model, prepared, **_) -> dict:
    from eagle3.verifier.run import inputs

    return inputs(model, prepared)


def summary(m: VerifierWeights) -> dict:
    return {"architecture": m.architecture, "tied_embeddings": m.tied_embeddings,
            "tensors": {k: v.shape for k, v in m.tensors.items()}}


def headline(m: VerifierWeights) -> str:
    return f"{m.architecture}, tied embeddings: {m.tied_embeddings}"


STAGE = Stage(
    name="verifier", help="stage 3: read the target's embedding, final norm and lm_head",
    manifest=VerifierWeights, locked=True, flags=(MODEL, PREPARED, OUT),
    run=_run, inputs=_inputs, summary=summary, headline=headline,
)
