"""Render conversations with the target's own chat template and build the loss mask.

The mask must be right for any template, so nothing here knows ChatML or Llama-3 markup:
1. Render the whole conversation to text F with `apply_chat_template`.
2. Locate each assistant message's content in F as a character span. The anchor is the
   template's own generation prompt: rendering messages[:i] with add_generation_prompt=True
   gives the text that precedes assistant turn i, so its content starts right after it.
   (Templates that rewrite history, e.g. drop earlier reasoning, fall back to an ordered
   search from the previous turn.) Templates that trim content are handled by also
   searching for the stripped text.
3. Tokenize F once with the fast tokenizer (offsets on). A token is trainable when its
   character span overlaps an assistant span; the first token after a span is trainable
   too when it is a special token (the end-of-turn token: `<|im_end|>`, `<|eot_id|>`, `</s>`),
   because the draft must learn to propose the end of a turn.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eagle3.data.normalize import Skip

# Above this many characters per allowed token we cut the text before tokenizing: a
# 10 MB single turn must not cost a 10 MB tokenization to keep 2048 tokens.
_CHARS_PER_TOKEN_CAP = 64


@dataclass
class Rendered:
    text: str
    spans: list[tuple[int, int]]  # [start, end) char spans of assistant content


class ChatRenderer:
    def __init__(self, tokenizer, name: str = "tokenizer"):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"{name} has no chat template (no `chat_template` in tokenizer_config.json and no "
                "chat_template.jinja): eagle3 renders conversations with the target's own template, "
                "so add the template the target is served with"
            )
        if not hasattr(tokenizer, "backend_tokenizer"):
            raise ValueError(f"{name} is not a fast (Rust `tokenizers`) tokenizer; character offsets are required")
        self.tok = tokenizer
        self.backend = tokenizer.backend_tokenizer
        special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        special |= {i for i in tokenizer.all_special_ids if i is not None}
        self.eot_ids = np.array(sorted(special), dtype=np.int64)

    # -- text ---------------------------------------------------------------------------
    def _apply(self, msgs, gen: bool) -> str:
        try:
            return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        except Exception as e:  # jinja raise_exception(), e.g. a template that wants strict alternation
            raise Skip("template_error", f"{type(e).__name__}: {e}") from None

    def render(self, msgs: list[dict[str, str]]) -> Rendered:
        full = self._apply(msgs, gen=False)
        spans: list[tuple[int, int]] = []
        cursor = 0
        for i, m in enumerate(msgs):
            c = m["content"]
            start = cursor
            if m["role"] == "assistant":
                prefix = self._apply(msgs[:i], gen=True)
                if full.startswith(prefix):
                    start = max(start, len(prefix))
            at, txt = full.find(c, start), c
            if at < 0:
                txt = c.strip()
                at = full.find(txt, start)
            if at < 0:
                if m["role"] == "assistant":
                    raise Skip("template_mismatch", f"turn {i}: assistant content not found verbatim in the rendered text")
                continue  # templates may rewrite user/system text; it only moves the cursor
            if m["role"] == "assistant":
                spans.append((at, at + len(txt)))
            cursor = at + len(txt)
        return Rendered(full, spans)

    # -- tokens -------------------------------------------------------------------------
    def encode(self, items: list[Rendered], max_len: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """ids int32 [T], mask int8 [T] for each rendered item, T <= max_len."""
        cap = max_len * _CHARS_PER_TOKEN_CAP
        texts = [r.text if len(r.text) <= cap else r.text[:cap] for r in items]
        encs = self.backend.encode_batch(texts, add_special_tokens=False)
        out = []
        for r, t, e in zip(items, texts, encs):
            if len(t) < len(r.text) and len(e.ids) <= max_len:  # the cut was too short: exact path
                e = self.backend.encode(r.text, add_special_tokens=False)
            out.append(self._mask(r, e, max_len))
        return out

    def _mask(self, r: Rendered, enc, max_len: int) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(enc.ids, dtype=np.int64)
        off = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)  # [T, 2] char [start, end)
        mask = np.zeros(len(ids), dtype=np.int8)
        for s, e in r.spans:
            inside = (off[:, 0] < e) & (off[:, 1] > s)
            mask[inside] = 1
            after = np.nonzero(off[:, 0] >= e)[0]
            if len(after) and np.isin(ids[after[0]], self.eot_ids):
                mask[after[0]] = 1
        return ids[:max_len].astype(np.int32), mask[:max_len]

    def template_overhead(self) -> int:
        """Tokens before the first trainable token of a one-word exchange."""
        msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
        ids, mask = self.encode([self.render(msgs)], max_len=1 << 30)[0]
        nz = np.nonzero(mask)[0]
        if not len(nz):
            raise ValueError("the chat template puts no assistant token in a one-word exchange")
        return int(nz[0])


def show(tokenizer, ids, mask, color: bool = True) -> str:
    """The sample as text, trainable runs highlighted (green, or «…» without a terminal)."""
    ids, mask = np.asarray(ids), np.asarray(mask)
    out, i = [], 0
    while i < len(ids):
        j = i
        while j < len(ids) and mask[j] == mask[i]:
            j += 1
        text = tokenizer.decode(ids[i:j].tolist(), skip_special_tokens=False)
        if mask[i]:
            text = f"\x1b[42;30m{text}\x1b[0m" if color else f"«{text}»"
        out.append(text)
        i = j
    return "".join(out)
