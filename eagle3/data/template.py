"""Render conversations with the target's own chat template and build the loss mask.

The mask must be right for any template and any tokenizer, fast (Rust) or slow (Kimi's tiktoken
code, which has no character offsets), so nothing here knows ChatML or Llama-3 markup and
nothing relies on offsets:
1. Render the whole conversation to text F with `apply_chat_template`.
2. Locate each assistant message's content in F as a character span. The anchor is the
   template's own generation prompt: rendering messages[:i] with add_generation_prompt=True
   gives the text that precedes assistant turn i, so its content starts right after it.
   (Templates that rewrite history, e.g. drop earlier reasoning, fall back to an ordered
   search from the previous turn.) Templates that trim content are handled by also
   searching for the stripped text.
3. Tokenize F whole (the ids the served model sees), and F cut at the span boundaries piece
   by piece. Where the pieces' ids concatenate to F's ids -- the usual case, since templates put
   special tokens or newlines around a turn -- each boundary's token index is a running count.
   Where they differ (a token straddles a boundary, or a pre-tokenizer joins differently at a
   piece's end, e.g. "\n\n" before an answer), the boundary is found by decoding F's ids: the
   largest prefix of them that decodes to at most the boundary's chars. A straddling token
   counts as content.
4. Tokens inside a span are trainable; so is the first token after a span when it is a special
   token (the end-of-turn token: `<|im_end|>`, `<|eot_id|>`, `</s>`), because the draft must
   learn to propose the end of a turn.

What is trained is the assistant message's content as given, plus its end-of-turn token.
Markup a template inserts around it is not: Kimi-K2.5 writes `<think></think>` before every
earlier answer and Qwen3 `<think>\n\n</think>\n\n` before the last one. In serving those tags are
either part of the prompt (a non-thinking request) or followed by real reasoning the target
writes itself, so an empty think block is never what the draft should learn to propose. Reasoning
that is part of the content (e.g. answers regenerated with `reasoning: keep`) is trained.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eagle3.data.normalize import Skip
from eagle3.model.target import chat_text, encode_texts, require_chat_template, special_ids

# Above this many characters per allowed token we cut the text before tokenizing: a
# 10 MB single turn must not cost a 10 MB tokenization to keep 2048 tokens.
_CHARS_PER_TOKEN_CAP = 64


@dataclass
class Rendered:
    text: str
    spans: list[tuple[int, int]]  # [start, end) char spans of assistant content


class ChatRenderer:
    def __init__(self, tokenizer, name: str = "tokenizer"):
        require_chat_template(tokenizer, name)
        self.tok = tokenizer
        self.eot_ids = np.array(sorted(special_ids(tokenizer)), dtype=np.int64)

    # -- text ---------------------------------------------------------------------------
    def _apply(self, msgs, gen: bool) -> str:
        try:
            return chat_text(self.tok, msgs, gen)
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
                    raise Skip("template_mismatch",
                               f"turn {i}: assistant content not found verbatim in the rendered text")
                continue  # templates may rewrite user/system text; it only moves the cursor
            if m["role"] == "assistant":
                spans.append((at, at + len(txt)))
            cursor = at + len(txt)
        return Rendered(full, spans)

    # -- tokens -------------------------------------------------------------------------
    def encode(self, items: list[Rendered], max_len: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """ids int32 [T], mask int8 [T] for each rendered item, T <= max_len."""
        cap = max_len * _CHARS_PER_TOKEN_CAP
        out = self._encode([r.text if len(r.text) <= cap else r.text[:cap] for r in items], items, max_len)
        redo = [i for i, (r, (ids, _)) in enumerate(zip(items, out, strict=True))
                if len(r.text) > cap and len(ids) < max_len]
        if redo:  # the cut was too short to fill max_len: the exact path on the whole text
            for i, res in zip(redo, self._encode([items[i].text for i in redo], [items[i] for i in redo], max_len),
                              strict=True):
                out[i] = res
        return out

    def _encode(self, texts: list[str], items: list[Rendered], max_len: int) -> list[tuple[np.ndarray, np.ndarray]]:
        # every boundary inside each (possibly cut) text: span starts and ends, in order
        bounds = [sorted({b for s in r.spans for b in s if 0 < b < len(t)}) for t, r in zip(texts, items, strict=True)]
        pieces = [[t[a:b] for a, b in zip([0, *bs], [*bs, len(t)], strict=True)]
                  for t, bs in zip(texts, bounds, strict=True)]
        full = encode_texts(self.tok, texts)
        flat = encode_texts(self.tok, [p for ps in pieces for p in ps])
        out, k = [], 0
        for t, r, bs, ids, ps in zip(texts, items, bounds, full, pieces, strict=True):
            seg, k = flat[k : k + len(ps)], k + len(ps)
            if [i for s in seg for i in s] == ids:
                at = dict(zip(bs, np.cumsum([len(s) for s in seg])[:-1].tolist(), strict=True))  # char -> token index
            else:
                ends = {e for _, e in r.spans}
                at = {b: self._boundary(ids, t, b, b in ends) for b in bs}
            out.append(self._mask(np.asarray(ids, dtype=np.int64), r, at, len(t), max_len))
        return out

    def _boundary(self, ids: list[int], text: str, b: int, end: bool) -> int:
        """Token index of char boundary b where the pieces' ids disagreed with the whole text's.

        The largest n whose ids decode to at most b chars (binary search; decoding is exact for
        byte-level BPE, fast or slow). If they decode to exactly text[:b], n is the boundary.
        Otherwise token n straddles it and counts as content: a span starting at b starts at n, a
        span ending at b ends after n.
        """
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(self._decode(ids[:mid])) <= b:
                lo = mid
            else:
                hi = mid - 1
        exact = self._decode(ids[:lo]) == text[:b]
        return lo + 1 if end and not exact else lo

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _mask(self, ids: np.ndarray, r: Rendered, at: dict[int, int], n_chars: int, max_len: int):
        mask = np.zeros(len(ids), dtype=np.int8)
        for s, e in r.spans:
            if s >= n_chars:
                break  # cut off
            a, b = at.get(s, 0), at.get(e, len(ids))
            mask[a:b] = 1
            if e < n_chars and b < len(ids) and np.isin(ids[b], self.eot_ids):
                mask[b] = 1
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
