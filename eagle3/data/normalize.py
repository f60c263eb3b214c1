"""Turn a raw record into a clean `[{"role", "content"}]` conversation, or say why not.

Rules (documented in docs/prepare.md, and each skip is counted by its reason):
- Roles: human/user -> user; gpt/chatgpt/bing/bard/assistant/model -> assistant; system -> system.
  Any other role skips the conversation (`unknown_role`).
- A turn with no text (missing key, null, non-text) skips it (`missing_content`); a turn whose
  text is empty or whitespace skips it (`empty_turn`). Dropping just the turn would silently
  pair an answer with the wrong question.
- A system turn is kept only as the first turn; elsewhere it skips (`system_not_first`).
- Leading non-user turns (after an optional system turn) are dropped: ShareGPT has thousands
  of records that open with the assistant's half of an earlier exchange.
- Consecutive turns of one role are merged, joined by a blank line (`same_role="merge"`), or
  skip the conversation (`same_role="drop"`, reason `same_role`).
- Trailing user turns are dropped (nothing to learn from). A conversation left with no
  assistant turn skips (`no_assistant_turn`); one with no turns at all skips (`empty_conversation`).
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "assistant": "assistant", "model": "assistant",
    "system": "system",
}


class Skip(Exception):
    """A conversation that cannot be used; `reason` is the counter key."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def _text(content: Any) -> str | None:
    """Plain text of a turn: a string, or the text parts of an OpenAI content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, str):
                parts.append(p)
            elif isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                return None  # images/audio: not a text conversation
        return "".join(parts)
    return None


def raw_turns(obj: dict[str, Any]) -> list[tuple[Any, Any]]:
    """(role, content) pairs from ShareGPT (`conversations`/`from`/`value`) or OpenAI (`messages`/`role`/`content`)."""
    if isinstance(obj.get("conversations"), list):
        turns, rk, ck = obj["conversations"], "from", "value"
    elif isinstance(obj.get("messages"), list):
        turns, rk, ck = obj["messages"], "role", "content"
    elif "conversations" in obj or "messages" in obj:
        raise Skip("bad_schema", "`conversations`/`messages` is not a list")
    else:
        raise Skip("bad_schema", f"no `conversations` or `messages` field (keys: {sorted(obj)[:6]})")
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise Skip("bad_schema", f"turn {i} is a {type(t).__name__}, not an object")
        out.append((t.get(rk, t.get("role", t.get("from"))), t.get(ck, t.get("content", t.get("value")))))
    return out


def normalize(obj: dict[str, Any], same_role: str = "merge") -> list[dict[str, str]]:
    turns = raw_turns(obj)
    if not turns:
        raise Skip("empty_conversation")
    msgs: list[dict[str, str]] = []
    for i, (role, content) in enumerate(turns):
        r = ROLE_MAP.get(str(role).strip().lower()) if isinstance(role, str) else None
        if r is None:
            raise Skip("unknown_role", f"turn {i} has role {role!r}")
        text = _text(content)
        if text is None:
            raise Skip("missing_content", f"turn {i} ({role}) has no text content")
        if not text.strip():
            raise Skip("empty_turn", f"turn {i} ({role}) is empty")
        if r == "system" and i != 0:
            raise Skip("system_not_first", f"turn {i} is a system turn")
        msgs.append({"role": r, "content": text})
    system = [msgs.pop(0)] if msgs[0]["role"] == "system" else []
    while msgs and msgs[0]["role"] != "user":  # leading non-user turns
        msgs.pop(0)
    merged: list[dict[str, str]] = []
    for m in msgs:
        if merged and merged[-1]["role"] == m["role"]:
            if same_role == "drop":
                raise Skip("same_role", f"two consecutive {m['role']} turns")
            merged[-1] = {"role": m["role"], "content": merged[-1]["content"] + "\n\n" + m["content"]}
        else:
            merged.append(dict(m))
    while merged and merged[-1]["role"] == "user":
        merged.pop()
    if not any(m["role"] == "assistant" for m in merged):
        raise Skip("no_assistant_turn")
    return system + merged


def conversations(records: Iterable) -> Iterator[tuple[str, list[dict[str, str]] | None]]:
    """(record id, normalized messages) per record of a reader; None where it is unreadable or skipped."""
    from eagle3.data.readers import Raw

    for rec in records:
        if not isinstance(rec, Raw):
            yield rec.record_id, None
            continue
        try:
            yield rec.record_id, normalize(rec.obj)
        except Skip:
            yield rec.record_id, None
