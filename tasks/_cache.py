"""Cache keys built from content fingerprints, never from path strings.

Prefect's INPUTS policy hashes a path as a string, so an edited file at the same path would
still hit the cache. A stage's key here is sha256 over: the stage name, its format version and
the stage's own `inputs()` (eagle3/registry.py) -- the content fingerprints of its inputs and the settings that change
its output, the same dict the library's "already done" check compares. The flow refreshes a
cached stage whose output dir is gone (`fresh`, below), so a hit never points at missing files.

A cached result is a stage manifest, and Prefect keeps it as a result record in its result storage
(`$PREFECT_HOME/storage` unless set). Prefect's default serializer is cloudpickle, and a record names
its own serializer, so a record replaced by a pickle payload would run code when the cache is read,
whatever the task asked for. Here the record is JSON (`ManifestSerializer`), and before Prefect looks
up a key, `guard` reads the record stored under it: anything but a record this project writes (a
pickle, another serializer, a truncated or edited file) is emptied with a warning, so Prefect sees no
cached result, the stage recomputes (its library call finds its finished output and returns it) and
the record is written again.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional

from prefect import task
from prefect.cache_policies import TASK_SOURCE, CachePolicy
from prefect.results import get_default_result_storage
from prefect.serializers import Serializer

from eagle3.registry import STAGES
from eagle3.storage.hashing import sha256_json
from eagle3.storage.manifests import StageManifest


class ManifestSerializer(Serializer):
    """A stage manifest as JSON: `{"kind": <its stage kind>, "data": <its fields>}`. Reads back only the kinds
    of `StageManifest`, validated by their own model, with the fingerprint checked against the content."""

    type: Literal["eagle3-manifest"] = "eagle3-manifest"

    def dumps(self, obj: Any) -> bytes:
        if not isinstance(obj, StageManifest):
            raise TypeError(f"a cached eagle3 stage returns a stage manifest, not {type(obj).__name__}")
        if obj.fingerprint != sha256_json(obj._content()):  # unsealed: `loads` would refuse it (a silent rerun)
            obj = obj.model_copy().seal()
        return json.dumps({"kind": obj.kind, "data": obj.model_dump(mode="json")}).encode()

    def loads(self, blob: bytes) -> StageManifest:
        d = json.loads(blob)
        if not isinstance(d, dict) or not isinstance(d.get("data"), dict):
            raise ValueError("not a stage manifest record")
        cls = StageManifest.kinds().get(d.get("kind"))
        if cls is None:
            raise ValueError(f"no stage manifest of kind {d.get('kind')!r}")
        m = cls.model_validate(d["data"])
        if m.kind != cls.stage or m.fingerprint != sha256_json(m._content()):
            raise ValueError(f"a {cls.stage} manifest whose fingerprint does not match its content")
        return m


SERIALIZER = ManifestSerializer()


def guard(key: str) -> None:
    """Empty the result record stored under `key` unless `checked_record` passes it (see the module's docstring).
    Runs inside the cache policy, before Prefect reads the record."""
    storage = get_default_result_storage(_sync=True)
    try:
        content = storage.read_path(key, _sync=True)
    except (ValueError, OSError):  # no record under this key
        return
    try:
        checked_record(content)
    except ValueError as e:
        logging.getLogger("eagle3").warning("cached result %s ignored (%s); the stage runs again", key, e)
        storage.write_path(key, b"", _sync=True)


def checked_record(content: bytes) -> bytes:
    """`content` if it is a result record this project wrote (JSON, `ManifestSerializer`, a valid manifest), else
    ValueError. Checked before Prefect parses it, because Prefect picks the serializer the record names."""
    try:
        rec = json.loads(content)
        ser = rec["metadata"]["serializer"]
        ok = isinstance(ser, dict) and ser.get("type") == SERIALIZER.type and isinstance(rec.get("result"), str)
    except (ValueError, TypeError, KeyError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise ValueError("not an eagle3 result record (JSON with the eagle3-manifest serializer)")
    SERIALIZER.loads(rec["result"].encode())
    return content


def cached_task(**kw: Any):
    """A content-keyed @task whose cached result is a stage manifest, stored and read back as checked JSON."""
    return task(result_serializer=SERIALIZER, persist_result=True, **kw)


@dataclass
class ContentKey(CachePolicy):
    """`fingerprints(inputs) -> dict` names everything the stage's output depends on; the task's own source is
    part of the key too (an edited task body is a new key). The key is where Prefect stores the result record,
    so `guard` checks that record here, before Prefect reads it."""

    stage: str = ""
    fingerprints: Optional[Callable[[dict[str, Any]], dict[str, Any]]] = None

    def compute_key(self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any):
        if self.fingerprints is None:
            return None
        source = TASK_SOURCE.compute_key(task_ctx, inputs, flow_parameters, **kwargs)
        key = sha256_json({"stage": self.stage, "task_source": source, **self.fingerprints(inputs)})
        guard(key)
        return key


def content_policy(stage: str, fingerprints: Callable[[dict[str, Any]], dict[str, Any]]) -> CachePolicy:
    """The content key of `stage` (see `ContentKey`)."""
    return ContentKey(stage=stage, fingerprints=fingerprints)


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
    a list of delays as "None". A `Final` failure (tasks/_failures.py) is not retried."""
    from tasks._failures import retry_unless_final

    return cached_task(name=stage, task_run_name=stage, cache_policy=content_policy(stage, key or stage_key(stage)),
                       retries=retries, retry_delay_seconds=delay, retry_condition_fn=retry_unless_final, **kw)


def fresh(t, manifest_cls: type[StageManifest], out: str | Path):
    """Task `t` as a flow calls it for output dir `out`: a cached result whose dir is gone must rerun, not return a
    dangling manifest, so the cache is refreshed where `manifest_cls` is not in `out`."""
    return t if manifest_cls.exists(out) else t.with_options(refresh_cache=True)
