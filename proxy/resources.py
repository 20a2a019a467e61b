"""Resources delivered by the proxy: a rollout's prompt, substituted in every request it makes.

The trainer registers, before an attempt starts, what that attempt's requests should carry instead of
what the agent wrote (``POST /resources`` on the control API): a list of substitutions, each either

* ``{"text": T, "target": "system"}`` — the system message becomes T (the first ``system`` or
  ``developer`` message; one is put first when the agent sent none), or
* ``{"text": T, "span": [START, END]}`` — in every message (or a completions prompt) that holds both
  markers, the marked span, markers included, becomes T.

The agent is unchanged: it keeps sending its own prompt; the engine sees the candidate's. The record
keeps the agent's request as sent, and the prompt token ids of what the engine was asked. A span whose
markers no request holds is counted (``GET /state``'s ``resource_misses``), never guessed at.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

MAX_ROLLOUTS = 100_000  # registered attempts kept (the oldest forgotten first)
SYSTEM_ROLES = ("system", "developer")


def check(subs: Any) -> list[dict[str, Any]]:
    """A registered substitution list, checked; ValueError names what is wrong."""
    if not isinstance(subs, list):
        raise ValueError("'substitutions' must be a list")
    out = []
    for i, s in enumerate(subs):
        if not isinstance(s, dict) or not isinstance(s.get("text"), str):
            raise ValueError(f"substitutions[{i}] must be an object with a string 'text'")
        span = s.get("span")
        if span is not None:
            if not (isinstance(span, list) and len(span) == 2
                    and all(isinstance(m, str) and m for m in span)):
                raise ValueError(f"substitutions[{i}].span must be two non-empty marker strings")
            out.append({"text": s["text"], "span": span})
        elif s.get("target", "system") == "system":
            out.append({"text": s["text"], "target": "system"})
        else:
            raise ValueError(f"substitutions[{i}].target must be 'system' (or give a span)")
    return out


def _replace_span(text: str, span: list[str], new: str) -> str | None:
    start = text.find(span[0])
    if start < 0:
        return None
    end = text.find(span[1], start + len(span[0]))
    if end < 0:
        return None
    return text[:start] + new + text[end + len(span[1]):]


def _content_span(content: Any, span: list[str], new: str) -> tuple[Any, bool]:
    if isinstance(content, str):
        out = _replace_span(content, span, new)
        return (content, False) if out is None else (out, True)
    if isinstance(content, list):
        parts, hit = [], False
        for p in content:
            if isinstance(p, dict) and isinstance(p.get("text"), str) and not hit:
                out = _replace_span(p["text"], span, new)
                if out is not None:
                    p, hit = {**p, "text": out}, True
            parts.append(p)
        return parts, hit
    return content, False


def apply(req: dict[str, Any], subs: list[dict[str, Any]]) -> tuple[dict[str, Any], int]:
    """``req`` (a chat/completions or completions request) with ``subs`` applied — a new dict, the
    original untouched — and how many span substitutions found no markers."""
    out = dict(req)
    misses = 0
    msgs = [dict(m) if isinstance(m, dict) else m for m in req.get("messages") or ()] \
        if isinstance(req.get("messages"), list) else None
    for s in subs:
        if "span" in s:
            hit = False
            if msgs is not None:
                for m in msgs:
                    if isinstance(m, dict):
                        m["content"], found = _content_span(m.get("content"), s["span"], s["text"])
                        hit = hit or found
            elif isinstance(out.get("prompt"), str):
                new = _replace_span(out["prompt"], s["span"], s["text"])
                hit = new is not None
                out["prompt"] = new if hit else out["prompt"]
            misses += not hit
        elif msgs is not None:  # the system message
            first = next((m for m in msgs if isinstance(m, dict) and m.get("role") in SYSTEM_ROLES), None)
            if first is None:
                msgs.insert(0, {"role": "system", "content": s["text"]})
            else:
                first["content"] = s["text"]
    if msgs is not None:
        out["messages"] = msgs
    return out, misses


class Registry:
    """The substitutions registered per (rollout, attempt), the oldest forgotten past ``limit``."""

    def __init__(self, limit: int = MAX_ROLLOUTS) -> None:
        self.limit = limit
        self._by: OrderedDict[tuple[str, int], list[dict[str, Any]]] = OrderedDict()
        self.misses = 0

    def put(self, rollout_id: str, attempt: int, subs: list[dict[str, Any]]) -> None:
        self._by.pop((rollout_id, attempt), None)
        self._by[(rollout_id, attempt)] = subs
        while len(self._by) > self.limit:
            self._by.popitem(last=False)

    def get(self, rollout_id: str, attempt: int) -> list[dict[str, Any]] | None:
        return self._by.get((rollout_id, attempt))

    def __len__(self) -> int:
        return len(self._by)
