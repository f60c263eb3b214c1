"""Everything eagle3 knows about a target model dir, read in one place.

Every stage asks a `Target` for the facts it needs; nothing else parses a target's files. One module on
purpose (over the house's 450 lines): the quirks of real checkpoints below (wrappers, aliases, padded vocabs,
custom tokenizers) interact, and each is resolved once here for config, weights and tokenizer alike.

    t = Target.open("/models/Kimi-K2.5", trust_remote_code=True)
    t.num_layers, t.hidden_size, t.vocab_rows     # the text model's shape (61, 7168, 163840)
    t.layer_ids(None)                             # default aux ids + [N], vLLM's convention
    t.weight_names()                              # embed / final norm / lm_head names in the shards
    t.tokenizer(), t.chat_text(msgs), t.encode([...]), t.stop_ids()
    t.load_model(head=False)                      # transformers' own classes, no checkpoint code

Facts that cost someone a silent bug, written where they are used:

* **VLM wrappers.** Kimi-K2.5 (`KimiK25ForConditionalGeneration`, `model_type: kimi_k25`) keeps
  its text model in `text_config` next to a `vision_config`, with weights under
  `language_model.model.*` + `language_model.lm_head.weight` (some re-quantized copies use
  `language_model.layers.*`), beside `vision_tower.*` and `mm_projector.*`, which we never read.
  transformers >= 4.52 VLMs use `model.language_model.*` instead. The text model is DeepSeek-V3
  (MLA + MoE); its `model_type` may read `kimi_k2`, an alias of transformers' `deepseek_v3`, so
  it is built with transformers' own classes and never needs the checkpoint's modeling code.
* **Vocab rows are not the tokenizer's length.** The embedding (config `vocab_size`) is what
  d2t/t2d, the verifier and the exported head are sized by, as vLLM and speculators do. Qwen3-8B
  pads it: 151,936 rows for a 151,669-token tokenizer. Kimi's tiktoken tokenizer goes the other
  way: it names 258 special ids after its base vocabulary while the embedding holds only 256 of
  them, so the last two ids have no row (they never occur in rendered chats).
* **Layer ids** follow vLLM: aux id k < N is the residual stream *entering* decoder layer k (HF's
  `hidden_states[k]`), id N the last layer's output *before* the final norm. HF's last
  `hidden_states` entry has the norm applied, so it is not id N. vLLM captures the aux states
  inside its layer loop, so `fc`'s input is always in ascending layer order whatever order a
  config lists: ids must be strictly increasing, or training and serving see the 3 blocks of
  `fc`'s input in different orders.
* **Tokenizers** may be fast (Rust, `tokenizer.json`) or slow Python code. Kimi's is slow custom
  code (`tokenization_kimi.py` over `tiktoken.model`, named by `auto_map` in
  tokenizer_config.json): it runs only with `trust_remote_code`, needs the `tiktoken` package,
  and has no character offsets, so nothing here relies on offsets.
* **Stop ids**: generation_config.json's `eos_token_id` (int or list), config.json's (top level
  and text config) and the tokenizer's eos. Llama-3.1 stops on `<|eot_id|>`, `<|eom_id|>` and
  `<|end_of_text|>`; Kimi on `<|im_end|>` and `[EOS]`.
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from eagle3.storage.atomic import read_json_object
from eagle3.storage.hashing import sha256_bytes, sha256_file, sha256_file_cached

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

# Sub-configs that hold a wrapped text model, in the order wrappers use them.
_TEXT_KEYS = ("text_config", "language_config", "llm_config")
# text-model model_type -> transformers' model_type of the same architecture
_ALIASES = {"kimi_k2": "deepseek_v3"}
# (text-model prefix, lm_head prefix) pairs. A plain *ForCausalLM keeps `model.embed_tokens`;
# wrappers nest the language model (transformers >= 4.52 layout first, then Kimi's / older ones).
_CAUSAL_LM = [("model.", ""), ("model.model.", "model.")]
_WRAPPED = [
    ("model.language_model.", ""),
    ("language_model.model.", "language_model."),
    ("language_model.", "language_model."),
    ("model.language_model.model.", "model.language_model."),
]
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "chat_template.json", "tokenizer.model", "tiktoken.model", "vocab.json", "merges.txt", "added_tokens.json",
)
_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json")
# A Llama-style draft layer cannot use an MLA target's head layout (DeepSeek's `head_dim` field
# is its 64-wide RoPE part): it takes the common 128 instead, as public Kimi EAGLE-3 heads do.
MLA_DRAFT_HEAD_DIM = 128

_FP_MEMO: dict[tuple, str] = {}


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's part of a config.json dict: a VLM's `text_config` (or `language_config`,
    `llm_config`) when it holds the shape, else the whole dict."""
    for key in _TEXT_KEYS:
        sub = config.get(key)
        if isinstance(sub, dict) and "hidden_size" in sub:
            return sub
    return config


def rope_of(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from transformers-5 `rope_parameters` or legacy `rope_theta`/`rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    if params and not ("rope_theta" in params or "rope_type" in params):
        raise ValueError(f"per-layer-type rope_parameters are not supported: {sorted(params)}")
    legacy = dict(cfg.get("rope_scaling") or {})
    if "type" in legacy and "rope_type" not in legacy:
        legacy["rope_type"] = legacy.pop("type")
    params.pop("type", None)
    theta = params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
    scaling = params if params.get("rope_type", "default") != "default" else legacy
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    if not scaling or scaling.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), scaling


def is_mla(cfg: dict[str, Any]) -> bool:
    """DeepSeek-style multi-head latent attention (DeepSeek-V2/V3, Kimi-K2)."""
    return cfg.get("kv_lora_rank") is not None


def default_aux_ids(n: int) -> list[int]:
    """vLLM's default EAGLE-3 aux ids (low, middle, high): (2, N//2, N-3)."""
    return [2, n // 2, n - 3]


def check_aux_ids(aux: Sequence[int], n: int | None = None) -> list[int]:
    """3 strictly increasing ids (in [0, n) when n is given); ValueError otherwise."""
    aux = [int(a) for a in aux]
    if len(aux) != 3:
        raise ValueError(f"aux layer ids must be exactly 3 ids (got {aux}); the final layer N is added automatically")
    if any(b <= a for a, b in zip(aux, aux[1:], strict=False)):
        raise ValueError(
            f"aux layer ids {aux} must be strictly increasing: vLLM concatenates the aux states in layer "
            f"order whatever order a config lists, so {sorted(set(aux))} is what serving would feed `fc`"
        )
    if n is not None and not all(0 <= a < n for a in aux):
        raise ValueError(f"aux layer ids {aux} must lie in [0, {n}) for a {n}-layer target")
    return aux


def eos_list(value: Any) -> set[int]:
    """An `eos_token_id` as written in a config (int, list or null) -> a set of ids."""
    if value is None:
        return set()
    return {int(v) for v in (value if isinstance(value, (list, tuple)) else [value]) if v is not None}


def require_chat_template(tok, name: str = "tokenizer") -> None:
    if not getattr(tok, "chat_template", None):
        raise ValueError(
            f"{name} has no chat template (no `chat_template` in tokenizer_config.json and no chat_template.jinja): "
            "eagle3 renders conversations with the target's own template, so add the template the target is served with"
        )


def chat_text(tok, messages: list[dict[str, str]], generation_prompt: bool = False, name: str = "tokenizer") -> str:
    """`messages` rendered by the tokenizer's chat template, as text (a clear error without a template)."""
    require_chat_template(tok, name)
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def encode_texts(tok, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text as the served model sees a rendered chat: no special tokens added,
    special-token strings in the text read as special tokens. Batched for fast tokenizers; a slow
    one (Kimi's tiktoken code) goes text by text through its own `__call__`."""
    if hasattr(tok, "backend_tokenizer"):
        return [e.ids for e in tok.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False)]
    return [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]


def prompt_ids(tok, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` plus the generation prompt: what the served target is given."""
    return encode_texts(tok, [chat_text(tok, messages, generation_prompt=True)])[0]


def special_ids(tok) -> set[int]:
    """Ids of a tokenizer's special tokens (end-of-turn markers among them)."""
    ids = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    return ids | {i for i in tok.all_special_ids if i is not None}


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


@dataclass
class Target:
    """A target model dir: config.json, safetensors shards, tokenizer and chat template."""

    path: Path
    config: dict[str, Any]
    trust_remote_code: bool = False
    _tok: Any = field(default=None, repr=False)

    # ------------------------------------------------------------ config
    @classmethod
    def open(cls, path: str | Path, trust_remote_code: bool = False) -> "Target":
        """Read `path/config.json` (a clear error when the dir or the file is missing or not JSON)."""
        p = Path(path)
        if not p.is_dir():
            raise ValueError(f"model dir {p} does not exist")
        cpath = p / "config.json"
        if not cpath.is_file():
            raise ValueError(f"{p}: no config.json (expected an HF model dir)")
        config = read_json_object(cpath, "a model config (a JSON object)")
        t = cls(p, config, trust_remote_code)
        t._require("num_hidden_layers", "hidden_size", "vocab_size")
        return t

    def _require(self, *keys: str) -> None:
        missing = [k for k in keys if self.text.get(k) is None]
        if missing:
            where = "its text config" if self.wrapped else "config.json"
            raise ValueError(f"{self.path}: {where} has no {', '.join(missing)}")

    @functools.cached_property
    def text(self) -> dict[str, Any]:
        return text_config(self.config)

    @property
    def wrapped(self) -> bool:
        """True for a VLM (or other) wrapper whose text model sits in a sub-config."""
        return self.text is not self.config

    @property
    def architecture(self) -> str:
        return (self.config.get("architectures") or ["?"])[0]

    @property
    def model_type(self) -> str:
        """transformers' model_type of the text model (aliases resolved: kimi_k2 -> deepseek_v3)."""
        mt = self.text.get("model_type") or self.config.get("model_type") or ""
        return _ALIASES.get(mt, mt)

    @property
    def num_layers(self) -> int:
        return int(self.text["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.text["hidden_size"])

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding (config `vocab_size`): the size d2t/t2d, the verifier and exports use."""
        return int(self.text["vocab_size"])

    @property
    def tie_word_embeddings(self) -> bool | None:
        """Whether lm_head is the embedding; None when the config does not say."""
        v = self.text.get("tie_word_embeddings", self.config.get("tie_word_embeddings"))
        return None if v is None else bool(v)

    @property
    def is_mla(self) -> bool:
        return is_mla(self.text)

    @property
    def max_position_embeddings(self) -> int:
        return int(self.text.get("max_position_embeddings") or 8192)

    @property
    def multimodal(self) -> bool:
        """A wrapper that carries a vision tower beside its text model (Kimi-K2.5's `vision_config`)."""
        return self.wrapped and isinstance(self.config.get("vision_config"), dict)

    def vllm_args(self, dtype: str, cpu: bool) -> dict[str, Any]:
        """What every vLLM engine eagle3 builds for this target needs beyond the model path and dtype.

        - A multimodal wrapper runs text alone (`language_model_only`): eagle3 feeds token ids only, so the
          vision tower is neither built nor loaded, and the engine skips profiling it with a dummy image
          (3000 x 3000 for Kimi-K2.5). vLLM still reads the image processor's settings
          (preprocessor_config.json) when it builds the model's processing info.
        - An MLA target on a CPU engine in fp32 takes vLLM's reference CPU MLA backend: on hosts with AMX
          vLLM picks its AMX MLA backend, whose weight packing refuses fp32 ("expect weight to be bfloat16,
          float16, int8, fp8_e4m3 or uint8"). The CPU MLA decode kernel needs the real DeepSeek widths
          (kv_lora_rank 512 + qk_rope_head_dim 64).
        """
        out: dict[str, Any] = {}
        if self.multimodal:
            out["language_model_only"] = True
        if cpu and self.is_mla and dtype == "float32":
            out["attention_backend"] = "CPU_MLA"
        return out

    def parameter_counts(self) -> tuple[float, float]:
        """(total, active per token) parameters estimated from the shapes, for planning: attention
        (GQA, or MLA's low-rank projections) + MLP (dense, or routed + shared experts after
        `first_k_dense_replace` dense layers) per layer, the embedding, and lm_head unless tied."""
        c, H, N = self.text, self.hidden_size, self.num_layers
        heads = int(c["num_attention_heads"])
        if self.is_mla:
            qk = int(c["qk_nope_head_dim"]) + int(c["qk_rope_head_dim"])
            q = H * heads * qk if not c.get("q_lora_rank") else int(c["q_lora_rank"]) * (H + heads * qk)
            kv = H * (int(c["kv_lora_rank"]) + int(c["qk_rope_head_dim"]))
            kv += int(c["kv_lora_rank"]) * heads * (int(c["qk_nope_head_dim"]) + int(c["v_head_dim"]))
            attn = q + kv + heads * int(c["v_head_dim"]) * H
        else:
            hd = int(c.get("head_dim") or H // heads)
            attn = 2 * H * heads * hd + 2 * H * int(c.get("num_key_value_heads") or heads) * hd
        dense = 3 * H * int(c["intermediate_size"])
        experts = int(c.get("n_routed_experts") or c.get("num_experts") or 0)
        if experts:
            moe_i = int(c.get("moe_intermediate_size") or c["intermediate_size"])
            shared = int(c.get("n_shared_experts") or 0)
            k_dense = int(c.get("first_k_dense_replace") or 0)
            per_tok = int(c.get("num_experts_per_tok") or 1)
            moe_total, moe_active = (experts + shared) * 3 * H * moe_i, (per_tok + shared) * 3 * H * moe_i
            total = N * attn + k_dense * dense + (N - k_dense) * moe_total
            active = N * attn + k_dense * dense + (N - k_dense) * moe_active
        else:
            total = active = N * (attn + dense)
        emb = self.vocab_rows * H * (1 if self.tie_word_embeddings else 2)
        return float(total + emb), float(active + emb)

    def rope(self) -> tuple[float, dict[str, Any] | None]:
        return rope_of(self.text)

    def layer_ids(self, aux: Sequence[int] | None = None) -> list[int]:
        """Aux ids (checked; vLLM's default when None) followed by N: the order states are stored in."""
        n = self.num_layers
        return check_aux_ids(default_aux_ids(n) if aux is None else aux, n) + [n]

    # ------------------------------------------------------------ weights
    @functools.cached_property
    def weight_map(self) -> dict[str, str]:
        """Tensor name -> safetensors file, from the index or by listing a single file."""
        index = self.path / INDEX
        if index.is_file():
            try:
                wmap = dict(json.loads(index.read_text())["weight_map"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: not a safetensors index with a weight_map "
                                 f"({type(e).__name__}: {e})") from None
            missing = sorted({f for f in wmap.values() if not (self.path / f).is_file()})
            if missing:
                raise FileNotFoundError(f"{index} points at {len(missing)} missing file(s): {', '.join(missing[:3])}")
            return wmap
        single = self.path / SINGLE
        if single.is_file():
            from safetensors import safe_open

            with safe_open(str(single), "pt") as f:
                return {k: SINGLE for k in f.keys()}
        raise FileNotFoundError(f"{self.path}: neither {INDEX} nor {SINGLE} (expected an HF safetensors model dir)")

    def _prefix_candidates(self) -> list[tuple[str, str]]:
        if self.architecture.endswith("ForCausalLM") and not self.wrapped:
            return _CAUSAL_LM + _WRAPPED
        return _WRAPPED + _CAUSAL_LM

    @functools.cached_property
    def prefixes(self) -> tuple[str, str]:
        """(text-model prefix, lm_head prefix) in the shards, e.g. ('language_model.model.', 'language_model.')."""
        wmap = self.weight_map
        for text, head in self._prefix_candidates():
            if f"{text}embed_tokens.weight" in wmap:
                # a wrapper whose layers sit directly under `language_model.` keeps its head there too
                if f"{head}lm_head.weight" not in wmap and "lm_head.weight" in wmap:
                    head = ""
                return text, head
        tried = [f"{t}embed_tokens.weight" for t, _ in self._prefix_candidates()]
        files = sorted(set(wmap.values()))
        raise ValueError(f"{self.path}: embedding not found for architecture {self.architecture}: "
                         f"tried {tried} in {files}")

    def weight_names(self) -> dict[str, str | None]:
        """Source names of embed_tokens / norm / lm_head (lm_head None when tied). Errors name what was searched."""
        text, head = self.prefixes
        wmap = self.weight_map
        files = sorted(set(wmap.values()))
        names: dict[str, str | None] = {"embed_tokens": f"{text}embed_tokens.weight", "norm": f"{text}norm.weight"}
        if names["norm"] not in wmap:
            raise ValueError(f"{self.path}: final norm {names['norm']!r} not found in {files}")
        tie = self.tie_word_embeddings
        head_name = f"{head}lm_head.weight"
        if tie:
            names["lm_head"] = None
        elif head_name in wmap:
            names["lm_head"] = head_name
        elif tie is None:  # not said either way and no lm_head stored: the embedding is the head
            names["lm_head"] = None
        else:
            raise ValueError(f"{self.path}: lm_head {head_name!r} not found in {files} "
                             "(config says tie_word_embeddings=false)")
        return names

    def read(self, name: str):
        """One tensor by its name in the shards, read alone (never the whole file)."""
        from safetensors import safe_open

        with safe_open(str(self.path / self.weight_map[name]), "pt") as f:
            return f.get_tensor(name)

    def weight_files(self) -> list[Path]:
        files = sorted(p for p in self.path.iterdir() if p.suffix in (".safetensors", ".bin"))
        if not files:
            raise ValueError(f"{self.path}: no weight files (*.safetensors / *.bin)")
        return files

    def fingerprint(self) -> str:
        """Content hash of config.json and every weight file (sha256 of their bytes).

        Memoized per process, and each file's hash across processes (`sha256_file_cached`): hashing
        a large model's weights takes minutes and must not be paid on every run.
        """
        files = sorted([self.path / "config.json", *self.weight_files()])
        key = tuple((str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
        if key not in _FP_MEMO:
            _FP_MEMO[key] = sha256_bytes("".join(f"{p.name}:{sha256_file_cached(p)}\n" for p in files).encode())
        return _FP_MEMO[key]

    # ------------------------------------------------------------ tokenizer
    def _tokenizer_config(self) -> dict[str, Any]:
        p = self.path / "tokenizer_config.json"
        try:
            return json.loads(p.read_text()) if p.is_file() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{p}: not valid JSON: {e}") from None

    def custom_tokenizer(self) -> str | None:
        """The custom tokenizer class `auto_map` names ('tokenization_kimi.TikTokenTokenizer'), if any."""
        am = self._tokenizer_config().get("auto_map") or {}
        ref = am.get("AutoTokenizer")
        if isinstance(ref, (list, tuple)):
            ref = next((r for r in ref if r), None)
        return ref or None

    def tokenizer_files(self) -> list[Path]:
        """The files that decide tokenization and chat rendering (custom tokenizer code included)."""
        d = self.path
        names = {n for n in _TOKENIZER_FILES if (d / n).is_file()}
        if not names & set(_VOCAB_FILES):
            raise ValueError(
                f"{d}: no tokenizer files (tokenizer.json, tokenizer.model, tiktoken.model or vocab.json); "
                "is it an HF model dir?"
            )
        custom = self.custom_tokenizer()
        if custom:
            module = custom.split("--")[-1].rsplit(".", 1)[0] + ".py"
            if not (d / module).is_file():
                raise ValueError(f"{d}: tokenizer_config.json's auto_map names {custom}, but {module} is missing")
            names.add(module)
        names |= {p.name for p in d.glob("*.jinja")}
        return [d / n for n in sorted(names)]

    def tokenizer_fingerprint(self) -> str:
        """sha256 over the tokenizer and chat-template files."""
        h = hashlib.sha256()
        for p in self.tokenizer_files():
            h.update(f"{p.name}\0{sha256_file(p)}\n".encode())
        return h.hexdigest()

    def tokenizer(self):
        """The target's tokenizer (fast or slow), loaded once. Custom code runs only with trust_remote_code."""
        if self._tok is not None:
            return self._tok
        from transformers import AutoTokenizer

        self.tokenizer_files()  # a clear error for a dir without a tokenizer
        custom = self.custom_tokenizer()
        if custom and not self.trust_remote_code and not (self.path / "tokenizer.json").is_file():
            raise ValueError(
                f"{self.path}: its tokenizer is custom code ({custom}, named by auto_map in tokenizer_config.json); "
                "rerun with --trust-remote-code (or `trust_remote_code: true` in the pipeline config) to run it"
            )
        try:
            if custom and self.trust_remote_code:
                # Only the tokenizer's own module runs: AutoTokenizer would also run the checkpoint's
                # configuration code (Kimi's config.json names a custom AutoConfig), which we never need.
                from transformers.dynamic_module_utils import get_class_from_dynamic_module

                tok = get_class_from_dynamic_module(custom, str(self.path)).from_pretrained(str(self.path))
            else:
                tok = AutoTokenizer.from_pretrained(str(self.path), trust_remote_code=self.trust_remote_code)
        except ImportError as e:  # custom code whose packages are missing, e.g. tiktoken for Kimi
            hint = " (pip install 'eagle3[kimi]')" if "tiktoken" in str(e) else ""
            raise ValueError(f"{self.path}: cannot load its tokenizer: {_first_line(e)}{hint}") from None
        except Exception as e:
            msg = _first_line(e)
            if "trust_remote_code" in str(e) and not self.trust_remote_code:
                msg += " -- rerun with --trust-remote-code (or `trust_remote_code: true`)"
            raise ValueError(f"{self.path}: cannot load its tokenizer: {type(e).__name__}: {msg}") from None
        self._tok = tok
        return tok

    def chat_text(self, messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
        """The conversation rendered by the target's own chat template, as text."""
        return chat_text(self.tokenizer(), messages, generation_prompt, name=f"the tokenizer of {self.path}")

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return encode_texts(self.tokenizer(), texts)

    def stop_ids(self) -> set[int]:
        """Stop ids: generation_config.json's eos, config.json's (top level and text model), the tokenizer's eos."""
        ids = eos_list(self.config.get("eos_token_id")) | eos_list(self.text.get("eos_token_id"))
        gc = self.path / "generation_config.json"
        if gc.is_file():
            try:
                ids |= eos_list(json.loads(gc.read_text()).get("eos_token_id"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{gc}: not valid JSON: {e}") from None
        eos = self.tokenizer().eos_token_id
        if eos is not None:
            ids.add(int(eos))
        return ids

    def generation_fingerprint(self) -> str:
        """Everything that changes the target's answers: weights + config, tokenizer + template, stop ids."""
        from eagle3.storage.hashing import sha256_json

        gc = self.path / "generation_config.json"
        return sha256_json({"model": self.fingerprint(), "tokenizer": self.tokenizer_fingerprint(),
                            "generation_config": sha256_file(gc) if gc.is_file() else None})

    # ------------------------------------------------------------ models
    def hf_config(self):
        """transformers' config object of the text model, built from the text config alone."""
        from transformers import CONFIG_MAPPING

        mt = self.model_type
        if mt not in CONFIG_MAPPING:
            raise ValueError(
                f"{self.path}: transformers has no built-in model for model_type {mt!r}; eagle3 never runs a "
                "checkpoint's own modeling code, so this target needs --backend vllm"
            )
        skip = {"model_type", "architectures", "auto_map", "transformers_version", "quantization_config"}
        return CONFIG_MAPPING[mt](**{k: v for k, v in self.text.items() if k not in skip})

    def _key_mapping(self) -> dict[str, str] | None:
        text, head = self.prefixes
        if (text, head) == ("model.", ""):
            return None
        return {f"^{re.escape(text)}": "model.", f"^{re.escape(head)}lm_head\\.": "lm_head."}

    def load_model(self, head: bool = True, device=None, dtype=None):
        """The text model built by transformers' own classes from the text config, with its weights
        (prefix-stripped; vision tensors ignored). `head=False` gives the decoder stack without lm_head.
        Default dtype: fp32 on CPU (faster there than bf16, and exact for parity tests), bf16 on CUDA."""
        import torch
        from transformers import AutoModel, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        q = self.text.get("quantization_config") or self.config.get("quantization_config")
        if q:
            raise ValueError(
                f"{self.path}: a quantized checkpoint ({q.get('quant_method', '?')}); the hf backend reads bf16/fp32 "
                "weights only: use --backend vllm for it"
            )
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        cls = AutoModelForCausalLM if head else AutoModel
        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the load report lists every vision tensor; we check it below
        try:
            model, info = cls.from_pretrained(
                str(self.path), config=self.hf_config(), dtype=dtype, key_mapping=self._key_mapping(),
                output_loading_info=True,
            )
        finally:
            hf_logging.set_verbosity(level)
        missing = [k for k in info["missing_keys"] if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
        if missing:
            raise ValueError(f"{self.path}: weights missing for {len(missing)} tensors of the text model: "
                             f"{missing[:4]}")
        return model.to(device).eval()
