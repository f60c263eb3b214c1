"""Prefect task for stage 3 (verifier weights)."""
from __future__ import annotations

from prefect import get_run_logger

from eagle3.storage.manifests import VerifierWeights
from eagle3.verifier import extract_verifier
from tasks._cache import stage_task


def publish(m: VerifierWeights, out: str) -> None:
    """Nothing to show beyond the log line: the verifier is three tensors of the target."""


@stage_task("verifier", retries=2, delay=5)
def verifier_task(model: str, prepared: str, out: str) -> VerifierWeights:
    """Read the target's embedding, final norm and lm_head (plus the draft-vocab rows)."""
    m = extract_verifier(model, prepared, out)
    get_run_logger().info("verifier: %s, tied=%s, tensors %s", m.architecture, m.tied_embeddings,
                          {k: v.shape for k, v in m.tensors.items()})
    return m
