"""Tiny random targets laid out like the real checkpoints of each family eagle3 supports, built offline.

Each `build(family, out)` writes an HF model dir the way the hub's checkpoint is laid out --
config.json as published (legacy `rope_scaling` / `rope_theta` keys, `torch_dtype`), bf16 weights
in several `model-0000k-of-0000n.safetensors` shards with an index, the tokenizer files, the chat
template and generation_config.json -- at a size a 2-core CPU runs end to end in seconds:

- `llama-3.1`: `LlamaForCausalLM` (head_dim = H / heads = 32, GQA; 32 is the smallest head size vLLM's CPU
  attention runs), rope_scaling `llama3`, untied head, a fast BPE tokenizer whose
  256 special ids follow the base vocabulary as Llama-3's do (`<|begin_of_text|>`, `<|eot_id|>`,
  `<|eom_id|>`, ...), so the embedding rows equal the tokenizer's length; the 3.1 chat template
  (knowledge-cutoff system header, content trimmed, `<|eot_id|>` after each turn).
- `qwen3`: `Qwen3ForCausalLM` with q/k norms and an explicit head_dim (not H / heads), its
  embedding padded past the tokenizer to a multiple of 128 rows (Qwen3-8B: 151,936 rows for
  151,669 tokens), ChatML with Qwen3's thinking template (`<think>\\n\\n</think>\\n\\n` before the
  last answer, earlier reasoning dropped) and the `<think>`/`</think>` added as non-special tokens.
- `kimi-k2.5`: `KimiK25ForConditionalGeneration` (`model_type: kimi_k25`, auto_map to custom code)
  wrapping a DeepSeek-V3 text model in `text_config` (`model_type: kimi_k2`; MLA at Kimi's real widths --
  kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim and v_head_dim 128, the only latent vLLM's CPU MLA
  kernel runs -- with a small q_lora_rank, hidden size and head count, YaRN RoPE, `first_k_dense_replace`
  dense layers then routed + shared experts with Kimi's routing settings), weights under
  `language_model.model.*` and `language_model.lm_head.weight` beside a tiny MoonViT tower and
  `mm_projector` under the checkpoint's own names (`vision_config` in its `vt_*` schema), the image
  processor's settings (`preprocessor_config.json`); the slow custom tiktoken tokenizer of
  `tests/helpers/kimi/tokenization_kimi.py` through `auto_map` (its 258 special ids run 2 past the embedding's rows,
  as the real one's do), Kimi's chat template (`<|im_system|>`, `<|im_user|>`, `<|im_assistant|>`,
  `<|im_middle|>`, `<|im_end|>`, a default system prompt, `<think></think>` before each earlier answer). Its
  modeling, configuration and processor modules raise when imported: eagle3 must never run them (vLLM
  reads the config with transformers' own class). `build_kimi_int4` writes a copy with the release's INT4
  routed experts (compressed-tensors pack-quantized, symmetric groups of 32).

Tokenizers are trained on the first ShareGPT conversations of the bundled dataset (deterministic).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

FAMILIES = ("llama-3.1", "qwen3", "kimi-k2.5")
HERE = Path(__file__).resolve().parent
BASE_VOCAB = 1024  # BPE tokens before the special ones
LAYERS = 8  # vLLM's default aux ids (2, N//2, N-3) = (2, 4, 5) are then strictly increasing

# Pre-tokenizer regex of Llama-3 / Qwen2-style tokenizers (letters with contractions, 1-3 digits,
# punctuation runs, newline runs, other spaces).
PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
       r"|\s*[\r\n]+|\s+(?!\S)|\s+")

LLAMA31_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message + '<|eot_id|>' }}"
    "{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + (m['content'] | trim) + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

QWEN3_TEMPLATE = (
    "{%- if messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query=messages | length - 1) %}"
    "{%- for m in messages[::-1] %}"
    "{%- if m.role == 'user' and ns.last_query == messages | length - 1 %}"
    "{%- set ns.last_query = messages | length - 1 - loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set content = m.content %}{%- set reasoning = '' %}"
    "{%- if m.reasoning_content is string %}{%- set reasoning = m.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

KIMI_TEMPLATE = (
    "{%- macro tag(role) -%}"
    "{%- if role == 'user' -%}<|im_user|>{%- elif role == 'assistant' -%}<|im_assistant|>"
    "{%- else -%}<|im_system|>{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if not messages or messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    "{%- endif -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{{- tag(m['role']) }}{{- m['name'] if m['name'] is defined else m['role'] }}<|im_middle|>"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- if loop.index0 > ns.last_user and m['reasoning_content'] is defined -%}"
    "<think>{{ m['reasoning_content'] }}</think>"
    "{%- else -%}<think></think>{%- endif -%}"
    "{%- endif -%}"
    "{{- m['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)

# Kimi's named special ids, as offsets past the base vocabulary (the rest are reserved tokens).
KIMI_SPECIAL = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
                6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
                17: "<|im_middle|>", 18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>",
                21: "<|media_pad|>", 22: "<think>", 23: "</think>"}
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_ADDED = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
              "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def llama3_specials() -> list[str]:
    named = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 4: "<|finetune_right_pad_id|>", 6: "<|start_header_id|>",
             7: "<|end_header_id|>", 8: "<|eom_id|>", 9: "<|eot_id|>", 10: "<|python_tag|>"}
    out, r = [], 0
    for i in range(256):
        if i in named:
            out.append(named[i])
        else:
            out.append(f"<|reserved_special_token_{r}|>")
            r += 1
    return out


# ---------------------------------------------------------------- corpus and BPE
def corpus(n: int = 400) -> list[str]:
    """Text of the first n ShareGPT records (every turn), for training the tiny tokenizers."""
    from eagle3.data.readers import Bad, ReadStats, iter_source, resolve_source

    texts = []
    for rec in iter_source(resolve_source("sharegpt"), ReadStats()):
        if isinstance(rec, Bad):
            continue
        texts += [t.get("value") or "" for t in rec.obj.get("conversations", []) if isinstance(t, dict)]
        if len(texts) >= n:
            break
    return texts


def train_bpe(texts: list[str], vocab: int = BASE_VOCAB):
    """A byte-level BPE of exactly `vocab` tokens (256 bytes + merges), no special tokens yet."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PAT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=[])
    tok.train_from_iterator(texts, trainer)
    assert tok.get_vocab_size() == vocab, tok.get_vocab_size()
    return tok


def fast_tokenizer_dir(out: Path, bpe, special: list[str], added: list[str], config: dict, template: str) -> None:
    """tokenizer.json (BPE + added tokens with ids after the base vocab) and tokenizer_config.json."""
    from tokenizers import AddedToken

    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    bpe.save(str(out / "tokenizer.json"))
    n = BASE_VOCAB
    dec = {str(n + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                        "special": i < len(special)} for i, t in enumerate(special + added)}
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": dec, "chat_template": template, "clean_up_tokenization_spaces": False,
         "model_max_length": 131072, **config}, indent=1))


# ---------------------------------------------------------------- weights
def write_shards(out: Path, tensors: dict[str, torch.Tensor], n: int) -> None:
    """bf16 tensors in n shards named as the hub names them, with model.safetensors.index.json (a MoE router's
    `e_score_correction_bias` stays fp32, as DeepSeek-V3's and Kimi-K2.5's checkpoints keep it; integer tensors,
    INT4-packed weights, keep their dtype)."""
    from safetensors.torch import save_file

    names = sorted(tensors)
    per = -(-len(names) // n)
    wmap, total = {}, 0
    for k in range(n):
        fname = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        part = {name: (tensors[name] if not tensors[name].is_floating_point() else tensors[name].to(
                    torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16)).contiguous()
                for name in names[k * per:(k + 1) * per]}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        wmap.update({name: fname for name in part})
        total += sum(t.numel() * t.element_size() for t in part.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": wmap}, indent=1))


def checkpoint_tensors(model, tmp: Path) -> dict[str, torch.Tensor]:
    """The model's tensors under the names its checkpoints use (transformers writes MoE experts one
    by one, as the hub files hold them)."""
    from safetensors.torch import load_file

    model.save_pretrained(tmp, safe_serialization=True)
    out = {}
    for f in sorted(tmp.glob("*.safetensors")):
        out.update(load_file(str(f)))
    shutil.rmtree(tmp)
    return out


def _init(model, seed: int):
    """Random weights a bit larger than HF's default std 0.02, so a greedy answer is not one token repeated."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)
            elif name.endswith("bias"):
                p.zero_()
    return model.eval()


# ---------------------------------------------------------------- families
def build_llama31(out: Path, texts: list[str]) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    n, specials = BASE_VOCAB, llama3_specials()
    fast_tokenizer_dir(out, train_bpe(texts), specials, [], {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
    }, LLAMA31_TEMPLATE)
    rope = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
            "rope_type": "llama3"}
    cfg = {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": n, "eos_token_id": [n + 1, n + 8, n + 9], "head_dim": 32, "hidden_act": "silu",
        "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 131072,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": 2, "num_hidden_layers": LAYERS,
        "num_key_value_heads": 1, "pretraining_tp": 1, "rms_norm_eps": 1e-5, "rope_scaling": rope,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.42.3", "use_cache": True, "vocab_size": n + 256,
    }
    # seed 5: with 2 heads of 32 (vLLM CPU attention has no head size 16) seed 1 answers with a stop id at once
    model = _init(LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})), 5)
    write_shards(out, checkpoint_tensors(model, out / ".tmp"), 2)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": n, "do_sample": True, "eos_token_id": [n + 1, n + 8, n + 9], "temperature": 0.6,
         "top_p": 0.9}))


def build_qwen3(out: Path, texts: list[str]) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    n = BASE_VOCAB
    fast_tokenizer_dir(out, train_bpe(texts), QWEN_SPECIAL, QWEN_ADDED, {
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "errors": "replace", "split_special_tokens": False,
    }, QWEN3_TEMPLATE)
    n_tok = n + len(QWEN_SPECIAL) + len(QWEN_ADDED)
    rows = -(-n_tok // 128) * 128  # padded embedding, as Qwen3 pads 151,669 tokens to 151,936 rows
    assert rows > n_tok
    cfg = {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": n, "eos_token_id": n + 2, "head_dim": 32, "hidden_act": "silu", "hidden_size": 64,
        "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 40960,
        "max_window_layers": LAYERS, "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": LAYERS,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": rows,
    }
    model = _init(Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in cfg.items() if k != "architectures"})), 2)
    write_shards(out, checkpoint_tensors(model, out / ".tmp"), 2)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": n, "do_sample": True, "eos_token_id": [n + 2, n], "pad_token_id": n, "temperature": 0.6}))


def kimi_ranks(bpe) -> dict[bytes, int]:
    """tiktoken ranks of a byte-level BPE: token bytes -> rank, merges after the 256 bytes in merge order."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    dec = {v: k for k, v in bytes_to_unicode().items()}
    return {bytes(dec[c] for c in s): i for s, i in bpe.get_vocab().items()}


def kimi_vision_tensors(vt: int, inter: int, layers: int, text_hidden: int, seed: int) -> dict[str, torch.Tensor]:
    """MoonViT + mm_projector tensors under the real checkpoint's names, at width `vt` (1152 in Kimi-K2.5):
    a 14x14 patch conv, a 64 x 64 position table, `layers` blocks (norm0, wqkv, wo, norm1, mlp.fc0/fc1, all
    with biases), the final layernorm, and the projector (pre_norm, proj.0 over 2x2 merged patches, proj.2)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    t = {"vision_tower.patch_embed.proj.weight": r(vt, 3, 14, 14), "vision_tower.patch_embed.proj.bias": r(vt),
         "vision_tower.patch_embed.pos_emb.weight": r(64, 64, vt),
         "vision_tower.encoder.final_layernorm.weight": torch.ones(vt),
         "vision_tower.encoder.final_layernorm.bias": torch.zeros(vt),
         "mm_projector.pre_norm.weight": torch.ones(vt), "mm_projector.pre_norm.bias": torch.zeros(vt),
         "mm_projector.proj.0.weight": r(4 * vt, 4 * vt), "mm_projector.proj.0.bias": r(4 * vt),
         "mm_projector.proj.2.weight": r(text_hidden, 4 * vt), "mm_projector.proj.2.bias": r(text_hidden)}
    for i in range(layers):
        b = f"vision_tower.encoder.blocks.{i}."
        t.update({b + "norm0.weight": torch.ones(vt), b + "norm0.bias": torch.zeros(vt),
                  b + "norm1.weight": torch.ones(vt), b + "norm1.bias": torch.zeros(vt),
                  b + "wqkv.weight": r(3 * vt, vt), b + "wqkv.bias": r(3 * vt), b + "wo.weight": r(vt, vt),
                  b + "wo.bias": r(vt), b + "mlp.fc0.weight": r(inter, vt), b + "mlp.fc0.bias": r(inter),
                  b + "mlp.fc1.weight": r(vt, inter), b + "mlp.fc1.bias": r(vt)})
    return t


# Kimi-K2.5's MLA widths, kept exactly: vLLM's CPU MLA decode kernel runs only a 576-wide latent
# (kv_lora_rank 512 + qk_rope_head_dim 64) with a 512-wide latent v.
KIMI_MLA = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}


def build_kimi_k25(out: Path, texts: list[str]) -> None:
    import base64

    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    n = BASE_VOCAB
    ranks = kimi_ranks(train_bpe(texts))
    (out / "tiktoken.model").write_text("".join(f"{base64.b64encode(b).decode()} {r}\n"
                                                for b, r in sorted(ranks.items(), key=lambda x: x[1])))
    shutil.copy(HERE / "kimi" / "tokenization_kimi.py", out / "tokenization_kimi.py")
    dec = {str(n + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                        "special": True} for i, t in KIMI_SPECIAL.items()}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": dec, "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": f"<|reserved_token_{n + 250}|>",
        "unk_token": f"<|reserved_token_{n + 249}|>", "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576, "tokenizer_class": "TikTokenTokenizer",
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                                      "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"],
    }, indent=1))
    (out / "chat_template.jinja").write_text(KIMI_TEMPLATE)
    # The image processor's settings as Kimi-K2.5 publishes them (custom code through auto_map, no
    # image_processor_type); vLLM reads them when it builds the model's processing info, text-only or not.
    (out / "preprocessor_config.json").write_text(json.dumps({
        "auto_map": {"AutoImageProcessor": "kimi_k25_vision_processing.KimiK25VisionProcessor",
                     "AutoProcessor": "kimi_k25_processor.KimiK25Processor"},
        "media_proc_cfg": {"in_patch_limit": 16384, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5],
                           "image_std": [0.5, 0.5, 0.5], "merge_kernel_size": 2, "fixed_output_tokens": None,
                           "patch_limit_on_one_side": 512, "in_patch_limit_each_frame": 4096,
                           "in_patch_limit_video": None, "sample_fps": 2.0, "max_num_frames_each_video": None,
                           "temporal_merge_kernel_size": 4, "timestamp_mode": "hh:mm:ss.fff"},
    }, indent=1))
    for mod in ("modeling_kimi_k25.py", "configuration_kimi_k25.py", "kimi_k25_vision_processing.py",
                "kimi_k25_processor.py"):
        (out / mod).write_text('raise RuntimeError("eagle3 must never run the checkpoint\'s own modeling code")\n')

    text = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": n, "eos_token_id": n + 1, "first_k_dense_replace": 1,
        "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
        "max_position_embeddings": 1024, "moe_intermediate_size": 32, "moe_layer_freq": 1,
        "n_group": 1, "n_routed_experts": 8, "n_shared_experts": 1, "norm_topk_prob": True,
        "num_attention_heads": 2, "num_experts_per_tok": 2, "num_hidden_layers": LAYERS, "num_key_value_heads": 2,
        "num_nextn_predict_layers": 0, "q_lora_rank": 32, **KIMI_MLA,
        "rms_norm_eps": 1e-5, "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 4.0, "mscale": 1.0,
                                               "mscale_all_dim": 1.0, "original_max_position_embeddings": 256,
                                               "type": "yarn"},
        "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "tie_word_embeddings": False,
        "topk_group": 1, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": n + 256,
    }
    keep = {k: v for k, v in text.items() if k not in ("architectures", "model_type")}
    model = _init(DeepseekV3ForCausalLM(DeepseekV3Config(**keep)), 3)
    tensors = {f"language_model.{k}": v for k, v in checkpoint_tensors(model, out / ".tmp").items()}
    vision = {"vt_hidden_size": 32, "vt_intermediate_size": 64, "vt_num_attention_heads": 2, "vt_num_hidden_layers": 1}
    tensors.update(kimi_vision_tensors(32, 64, 1, text["hidden_size"], seed=4))
    write_shards(out, tensors, 3)
    (out / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                     "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
                     "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
        "bos_token_id": n, "eos_token_id": n + 1, "ignore_index": -100,
        "model_type": "kimi_k25", "media_placeholder_token_id": n + 21, "pad_token_id": n + 250,
        "text_config": text, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_unified_vision_chunk": True, "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "vision_config": {"init_pos_emb_height": 64, "init_pos_emb_time": 4, "init_pos_emb_width": 64,
                          "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mm_hidden_size": 32,
                          "mm_projector_type": "patchmerger", "model_type": "", "patch_size": 14,
                          "pos_emb_type": "divided_fixed", "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05,
                          "text_hidden_size": text["hidden_size"], "video_attn_type": "spatial_temporal", **vision},
    }, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": n + 2, "max_length": 262144}))


# Kimi-K2.5's released quantization: INT4 routed experts (compressed-tensors, symmetric groups of 32, packed 8 to
# an int32), everything else bf16; the same config at the top level and in text_config.
KIMI_INT4 = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                    "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                    "type": "int"}}},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}


def int4_pack(w: torch.Tensor, group: int = 32) -> dict[str, torch.Tensor]:
    """w [out, in] -> compressed-tensors' pack-quantized tensors: weight_packed int32 [out, in / 8] (value + 8 in
    nibble i of word j for column 8j + i), weight_scale bf16 [out, in / group], weight_shape int32 [2]. Each group's
    scale is a power of two, so the dequantized weights (q * scale) are exact in bf16: `int4_dequant` gives them."""
    out, n = w.shape
    g = w.float().view(out, n // group, group)
    scale = torch.exp2(torch.ceil(torch.log2(g.abs().amax(-1).clamp_min(1e-8) / 7)))  # [out, n / group]
    q = torch.clamp(torch.round(g / scale[..., None]), -8, 7).to(torch.int32).view(out, n) + 8
    words = (q.view(out, n // 8, 8) << (torch.arange(8, dtype=torch.int32) * 4)).sum(-1, dtype=torch.int32)
    return {"weight_packed": words, "weight_scale": scale.to(torch.bfloat16),
            "weight_shape": torch.tensor([out, n], dtype=torch.int32)}


def int4_dequant(t: dict[str, torch.Tensor], group: int = 32) -> torch.Tensor:
    out, n = t["weight_shape"].tolist()
    q = ((t["weight_packed"][..., None] >> (torch.arange(8, dtype=torch.int32) * 4)) & 15).view(out, n) - 8
    return (q.view(out, n // group, group) * t["weight_scale"].float()[..., None]).view(out, n)


def build_kimi_int4(src: Path, out: Path, dequantized: Path | None = None) -> Path:
    """The Kimi-K2.5 layout `src` with its routed experts in INT4 as the released checkpoint holds them
    (`mlp.experts.E.{gate,up,down}_proj.weight_packed / weight_scale / weight_shape`, the quantization_config above).
    `dequantized`: also write the same model with those weights dequantized (bf16, exact), for a reference."""
    import re

    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    expert = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
    packed, plain = {}, {}
    for name, t in tensors.items():
        if expert.search(name):
            p = int4_pack(t)
            base = name[: -len("weight")]
            packed.update({base + k: v for k, v in p.items()})
            plain[name] = int4_dequant(p)
        else:
            packed[name] = plain[name] = t
    for d, ts, quant in ((out, packed, True), (dequantized, plain, False)):
        if d is None:
            continue
        if d.exists():
            shutil.rmtree(d)
        shutil.copytree(src, d, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json"))
        write_shards(d, ts, 3)
        if quant:
            cfg = json.loads((d / "config.json").read_text())
            cfg["quantization_config"] = cfg["text_config"]["quantization_config"] = KIMI_INT4
            (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


BUILDERS = {"llama-3.1": build_llama31, "qwen3": build_qwen3, "kimi-k2.5": build_kimi_k25}


def build(family: str, out: str | Path, texts: list[str] | None = None) -> Path:
    """Write the tiny `family` dir at `out` (replacing it) and return its path."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    BUILDERS[family](out, texts if texts is not None else corpus())
    return out


def reference_lm(model_dir: str | Path):
    """The family's causal LM loaded with transformers alone, independently of eagle3.model.target: the text
    config mapped by hand to transformers' class, the wrapper's prefix mapped by a regex. fp32, eval mode."""
    from transformers import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
               "kimi_k2": (DeepseekV3Config, DeepseekV3ForCausalLM)}
    ccls, mcls = classes[text["model_type"]]
    c = ccls(**{k: v for k, v in text.items() if k not in ("architectures", "model_type")})
    km = {r"^language_model\.": ""} if "text_config" in cfg else None
    return mcls.from_pretrained(str(model_dir), config=c, dtype=torch.float32, key_mapping=km).eval()


if __name__ == "__main__":  # python tests/helpers/families.py OUT_ROOT: build all three for a manual run
    import sys

    texts = corpus()
    for fam in FAMILIES:
        print(build(fam, Path(sys.argv[1]) / fam, texts))
