"""How a config's JSON schema becomes Prefect's run form (both UIs): keys as titles, limits stated in each
field's description, plain inputs for fields whose default is None. `FORM` is the model_config of every
config model (eagle3/config.py) and of the nightly flow's parameters."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


def _num(v: float) -> str:
    return f"{v:,}" if isinstance(v, int) else f"{v:g}"


def _limits(p: dict[str, Any]) -> str:
    """A field's bounds in words: "16 to 1,048,576", "at least 1", "above 0, at most 1"."""
    lo = (_num(p["minimum"]), "at least") if "minimum" in p else (_num(p["exclusiveMinimum"]), "above") \
        if "exclusiveMinimum" in p else None
    hi = (_num(p["maximum"]), "at most") if "maximum" in p else (_num(p["exclusiveMaximum"]), "below") \
        if "exclusiveMaximum" in p else None
    if lo and hi and lo[1] == "at least" and hi[1] == "at most":
        return f"{lo[0]} to {hi[0]}"
    return ", ".join(f"{word} {v}" for v, word in (x for x in (lo, hi) if x))


def form_schema(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """Shape a config's JSON schema for Prefect's run form (both UIs), in place.

    - A field whose default is None gets a plain input (left empty: the default) instead of a
      type/None toggle; Prefect's validation still admits null for a field without a default.
    - A field with any other default is listed as required: the form is filled from the defaults,
      and the UI labels every field outside `required` "(Optional)". Parameters sent through the
      API must then hold every such key (send `model_dump()`), or the server refuses the run.
    - Each field's limits join its description, so the form states them before Submit.
    - A fixed-length tuple of one type becomes a list of that type (V1 reads no prefixItems).
    """
    for p in schema.get("properties", {}).values():
        opts = p.get("anyOf", [])
        if "default" in p and p["default"] is None and len(opts) == 2 and {"type": "null"} in opts:
            (inner,) = [o for o in opts if o != {"type": "null"}]
            if "$ref" not in inner:  # an optional section (target, regenerate) keeps its on/off toggle
                del p["anyOf"], p["default"]
                p.update(inner)
        items = p.pop("prefixItems", None)
        if items and all(i == items[0] for i in items):
            p["items"] = items[0]
        said = _limits(p)
        if p.get("type") == "array" and p.get("minItems") is not None and p.get("minItems") == p.get("maxItems"):
            each = _limits(p.get("items", {}))
            said = f"exactly {p['minItems']} values" + (f", each {each}" if each else "")
        if said:
            p["description"] = f"{p.get('description', '').rstrip('.')} ({said})".lstrip()
    fields = model.model_fields
    schema["required"] = [k for k in schema.get("properties", {})
                           if fields[k].is_required() or fields[k].default_factory or fields[k].default is not None]


# Titles are the config keys (what a YAML config and the CLI flags spell), not "Max Len".
FORM = ConfigDict(extra="forbid", field_title_generator=lambda name, _: name, json_schema_extra=form_schema)
