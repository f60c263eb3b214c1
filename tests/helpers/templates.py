"""Chat templates for golden-mask tests, written here in the style of well-known families.

Each is applied to the real SmolLM2 tokenizer after adding the family's special tokens, so
the test exercises real BPE offsets with foreign markup.
"""

# Llama-3 style: header tokens around the role, content trimmed, <|eot_id|> ends a turn.
LLAMA3 = (
    "{{- bos_token }}"
    "{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + (m['content'] | trim) + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# Mistral/Llama-2 style: no role names, [INST] markup, </s> after each answer, and the
# template raises on non-alternating roles (exercises the template_error path).
INST = (
    "{{- bos_token }}"
    "{%- for m in messages %}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('roles must alternate user/assistant') }}"
    "{%- endif %}"
    "{%- if m['role'] == 'user' %}{{- '[INST] ' + m['content'] + ' [/INST]' }}"
    "{%- else %}{{- ' ' + m['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}"
)
INST_SPECIAL = ["<s>", "</s>"]


def with_template(tok, template: str, special: list[str], bos: str, eos: str):
    """A copy of `tok` with extra special tokens, bos/eos and a chat template."""
    import copy

    t = copy.deepcopy(tok)
    t.add_special_tokens({"additional_special_tokens": special})
    t.bos_token, t.eos_token = bos, eos
    t.chat_template = template
    return t
