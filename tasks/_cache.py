"""Cache keys built from content fingerprints, never from path strings.

Prefect's INPUTS policy hashes a path as a string, so an edited file at the same path would
still hit the cache. A stage's key here is sha256 over: the stage name, its format version and
the stage's own `inputs()` (eagle3/registry.py) -- the content fingerprints of its inputs and the settings that change
its output, the same dict the library's "already done" check compares. The flow refreshes a
cached stage whose output dir is gone (see `flows.stages`), so a hit never points at missing files.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from prefect import task
from prefect.cache_policies import TASK_SOURCE, CachePolicy

from eagle3.registry import STAGES
from eagle3.storage.hashing import sha256_json


@dataclass
class ContentKey(CachePolicy):
    """`fingerprints(inputs) -> dict` names everything the stage's output depends on."""

    stage: str = ""
    fingerprints: Optional[Callable[[dict[str, Any]], dict[str, Any]]] = None

    def compute_key(self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any):
        if self.fingerprints is None:
            return None
        return sha256_json({"stage": self.stage, **self.fingerprints(inputs)})


def content_policy(stage: str, fingerprints: Callable[[dict[str, Any]], dict[str, Any]]) -> CachePolicy:
    """Content key + the task's own source (an edited task body is a new key)."""
    return ContentKey(stage=stage, fingerprints=fingerprints) + TASK_SOURCE


def stage_key(stage: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The registered stage's fingerprints of a task run's inputs, with its manifest's format version."""
    s = STAGES[stage]

    def key(i: dict[str, Any]) -> dict[str, Any]:
        args = {k: v for k, v in i.items() if k != "cfg"}
        return {"format": s.manifest.format_version, **s.inputs(i.get("cfg"), **args)}

    return key


def stage_task(stage: str, retries: int, delay: int,
               key: Callable[[dict[str, Any]], dict[str, Any]] | None = None, **kw: Any):
    """The @task of a registered stage: named after it (also in the UI's task-run list), content-keyed (by
    `key`, default `stage_key(stage)`), with explicit retries. `delay` is one number of seconds: the UI shows
    a list of delays as "None"."""
    return task(name=stage, task_run_name=stage, cache_policy=content_policy(stage, key or stage_key(stage)),
                retries=retries, retry_delay_seconds=delay, **kw)
