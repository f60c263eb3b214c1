"""The run forms' JSON schemas, as Prefect builds them from the flows' signatures (what both UIs render)."""
from __future__ import annotations

import json
import re

import pytest

from eagle3.config import PipelineConfig, TrainConfig


def flow_schema(fn) -> dict:
    from prefect.utilities.callables import parameter_schema

    return parameter_schema(fn).model_dump()


def properties(schema: dict):
    """(where, name, property) for every field of every model in a flow's schema."""
    for model, d in schema["definitions"].items():
        for name, p in d.get("properties", {}).items():
            yield f"{model}.{name}", name, p
    for name, p in schema["properties"].items():
        yield name, name, p


@pytest.fixture(scope="module")
def schemas():
    from flows.nightly import nightly
    from flows.pipeline import pipeline

    return {"pipeline": flow_schema(pipeline.fn), "nightly": flow_schema(nightly.fn)}


def test_every_model_is_in_the_form(schemas):
    # Prefect silently drops a parameter whose schema fails to build: the form would be one raw JSON field.
    assert set(schemas["pipeline"]["definitions"]) == {"PipelineConfig", "PrepareConfig", "ExtractConfig",
                                                       "TrainConfig", "EvalConfig", "TargetPlan", "RegenConfig"}
    assert "NightlyConfig" in schemas["nightly"]["definitions"]


def test_descriptions_render_alike_in_both_uis(schemas):
    # V1 renders markdown (angle brackets vanish as HTML, asterisks turn italic); V2 shows backticks raw.
    for flow, schema in schemas.items():
        texts = [(w, p.get("description", "")) for w, _, p in properties(schema)]
        texts += [(m, d.get("description", "")) for m, d in schema["definitions"].items()]
        for where, text in texts:
            assert not re.search(r"[<>*`]|__|\b_\w+_\b", text), f"{flow} {where}: {text!r}"


def test_titles_are_keys_and_limits_are_stated(schemas):
    pipe = schemas["pipeline"]
    for where, name, p in properties(pipe):
        assert p.get("title") == name, where
    d = pipe["definitions"]
    assert d["PrepareConfig"]["properties"]["max_len"]["description"] == \
        "truncate each sample to this many tokens (16 to 1,048,576)"
    assert d["TrainConfig"]["properties"]["lr"]["description"].endswith("(above 0)")
    assert d["TrainConfig"]["properties"]["step_decay"]["description"].endswith("(above 0, at most 1)")
    assert d["PrepareConfig"]["properties"]["val_fraction"]["description"].endswith("(at least 0, below 1)")
    # every bounded field says so in its own text, before anything is submitted
    for where, _, p in properties(pipe):
        if any(k in p for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
            assert re.search(r"\((.*\d.*)\)$", p["description"]), where
    # the optional sections toggle under their own names
    assert (d["TargetPlan"]["title"], d["RegenConfig"]["title"]) == ("target", "regenerate")


def test_optional_label_only_where_empty_means_the_default(schemas):
    d = schemas["pipeline"]["definitions"]
    prep = d["PrepareConfig"]
    assert set(prep["required"]) == {"data", "max_len", "val_fraction", "min_val", "seed", "shard_samples", "same_role",
                                     "batch_size"}
    # a None default is a plain input, left empty; no type/None toggle, and the text says what empty means
    limit = prep["properties"]["limit"]
    assert (limit["type"], "anyOf" in limit, "default" in limit) == ("integer", False, False)
    assert "empty: all" in limit["description"]
    assert set(d["PipelineConfig"]["required"]) >= {"model", "run_dir", "prepare", "extract", "train", "eval"}
    assert "target" not in d["PipelineConfig"]["required"] and "regenerate" not in d["PipelineConfig"]["required"]


def test_untouched_form_values_validate_and_empty_fields_mean_unset(schemas):
    """The form submits the schema's defaults (nulls included) and "" or [] for an emptied field."""
    from prefect.utilities.schema_tools.validation import validate

    schema = schemas["pipeline"]
    default = schema["properties"]["config"]["default"]
    assert validate({"config": default, "max_hours": 1.0}, schema) == []
    betas = schema["definitions"]["TrainConfig"]["properties"]["betas"]
    assert "prefixItems" not in betas and betas["items"]["type"] == "number"  # V1 reads no prefixItems
    bad = json.loads(json.dumps(default))
    bad["prepare"]["max_len"] = 5
    bad["train"]["betas"] = [0.9, 1.0]
    errors = validate({"config": bad}, schema)
    assert {tuple(e.path) for e in errors} == {("config", "prepare", "max_len"), ("config", "train", "betas", 1)}
    # emptied fields
    cfg = PipelineConfig.model_validate({"prepare": {"limit": "", "vocab_from": ""}, "extract": {"aux_layer_ids": []}})
    assert (cfg.prepare.limit, cfg.prepare.vocab_from, cfg.extract.aux_layer_ids) == (None, None, None)
    with pytest.raises(ValueError):
        TrainConfig(betas=(0.9, 1.0))  # AdamW refuses beta = 1; so does the form


def test_form_default_is_the_demo_preset_in_its_own_dir_within_budget(smollm2_dir):
    from eagle3.planning import plan
    from flows.pipeline import DEMO, FORM_DEFAULT

    demo = PipelineConfig.from_file(DEMO)
    assert FORM_DEFAULT == demo.model_copy(update={"run_dir": "runs/ui-{date}"})
    p = plan(FORM_DEFAULT.model_copy(update={"run_dir": "runs/ui-x"}), max_hours=1.0)
    assert not p.problems and set(p.seconds) >= {"prepare", "extract", "train", "eval"}


def test_deployments_yaml_ui_defaults():
    from pathlib import Path

    import yaml

    prefect_yaml = Path(__file__).resolve().parents[3] / "deployments" / "prefect.yaml"
    deps = {d["name"]: d for d in yaml.safe_load(prefect_yaml.read_text())["deployments"]}
    assert deps["eagle3-pipeline"]["parameters"] == {"max_hours": 1.0}
    (sched,) = deps["eagle3-nightly"]["schedules"]
    assert sched["active"] is False and sched["timezone"] == "Europe/Berlin"
    assert "parameters" not in deps["eagle3-nightly"]  # conversations unset until deployments/nightly.py
    assert {"extract-gpu", "train-gpu", "eval-gpu"} <= set(deps)
