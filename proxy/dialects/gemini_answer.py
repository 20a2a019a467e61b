"""The engine's chat answer, whole or streamed, as the Gemini API's ``GenerateContentResponse`` (the
request side: :mod:`.gemini`)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..wire import Capture, dumps
from .common import tool_input
from .gemini import error_body, get_field

FINISH = {"stop": "STOP", "tool_calls": "STOP", "length": "MAX_TOKENS", "content_filter": "SAFETY"}


@dataclass
class _Candidate:
    index: int
    text: str = ""
    thought: str = ""
    calls: dict[int, list[str]] = field(default_factory=dict)  # tool index -> [id, name, arguments]
    sent: int = 0  # function calls already streamed (in index order)
    finish: str | None = None
    chosen: list[dict[str, Any]] = field(default_factory=list)  # logprobsResult, all tokens so far
    top: list[dict[str, Any]] = field(default_factory=list)
    unsent: int = 0  # logprob entries not yet streamed


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


def _tokens(v: Any) -> list[dict[str, Any]]:
    """The entries of a chat logprobs list that name their token."""
    return [e for e in _list(v) if isinstance(e, dict) and isinstance(e.get("token"), str)]


def _call_part(call: list[str]) -> dict[str, Any]:
    return {"functionCall": {"id": call[0], "name": call[1], "args": tool_input(call[2])}}


@dataclass
class GeminiTranslator:
    """One call's answer as a ``GenerateContentResponse``: ``body`` for a whole answer; for a stream,
    ``chunk`` per chat chunk (one ``data: {json}\\r\\n\\r\\n`` event per text delta, each function call
    whole once its arguments are complete, the last event with ``finishReason`` and ``usageMetadata``;
    with ``alt`` other than sse one JSON array instead), then ``finish`` or ``failure``. ``final`` is
    what a stream adds up to, for the record."""

    request: dict[str, Any]
    model: str | None
    response_id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    candidates: dict[int, _Candidate] = field(default_factory=dict)
    frames: int = 0
    noted: bool = False
    notes: list[str] = field(default_factory=list)  # what the answer's translation approximated

    def __post_init__(self) -> None:
        gc = get_field(self.request, "generationConfig")
        gc = gc if isinstance(gc, dict) else {}
        tc = get_field(gc, "thinkingConfig")
        self.thoughts = isinstance(tc, dict) and get_field(tc, "includeThoughts") is True
        self.logprobs = get_field(gc, "responseLogprobs") is True
        self.array = self.request.get("stream") == "json"
        self.content_type = "application/json; charset=UTF-8" if self.array else None

    # -- framing ----------------------------------------------------------------------------------------
    def _frame(self, obj: dict[str, Any]) -> bytes:
        data = dumps(obj)
        self.frames += 1
        if self.array:
            return (b"[" if self.frames == 1 else b",\r\n") + data
        return b"data: " + data + b"\r\n\r\n"

    def _envelope(self, candidates: list[dict[str, Any]], usage: dict[str, int] | None = None
                  ) -> dict[str, Any]:
        out: dict[str, Any] = {"candidates": candidates}
        if usage is not None:
            out["usageMetadata"] = usage
        out["modelVersion"] = self.model or ""
        out["responseId"] = self.response_id
        return out

    def _cand(self, index: int) -> _Candidate:
        if index not in self.candidates:
            self.candidates[index] = _Candidate(index)
        return self.candidates[index]

    # -- reading the chat answer ---------------------------------------------------------------------
    def _absorb(self, ch: dict[str, Any], delta: dict[str, Any]) -> tuple[_Candidate, list[dict[str, Any]]]:
        """Take one choice's delta (or whole message); the parts a stream sends for it now."""
        c = self._cand(ch["index"] if isinstance(ch.get("index"), int) else 0)
        parts: list[dict[str, Any]] = []
        for key in ("reasoning_content", "reasoning"):
            if isinstance(delta.get(key), str) and delta[key]:
                c.thought += delta[key]
                if self.thoughts:
                    parts.append({"text": delta[key], "thought": True})
                break
        if isinstance(delta.get("content"), str) and delta["content"]:
            c.text += delta["content"]
            parts.append({"text": delta["content"]})
        for i, tc in enumerate(_list(delta.get("tool_calls"))):
            if not isinstance(tc, dict):
                continue
            index = tc["index"] if isinstance(tc.get("index"), int) else i
            fn = tc.get("function") if isinstance(tc.get("function"), dict) else {}
            call = c.calls.setdefault(index, ["", "", ""])
            if isinstance(tc.get("id"), str) and tc["id"] and not call[0]:
                call[0] = tc["id"]
            call[1] += fn.get("name") if isinstance(fn.get("name"), str) else ""
            call[2] += fn.get("arguments") if isinstance(fn.get("arguments"), str) else ""
            parts += self._complete_calls(c, below=index)  # a later call began: the earlier are whole
        if isinstance(ch.get("finish_reason"), str):
            c.finish = ch["finish_reason"]
        if self.logprobs:
            self._take_logprobs(c, ch)
        return c, parts

    def _complete_calls(self, c: _Candidate, below: int | None = None) -> list[dict[str, Any]]:
        order = sorted(c.calls)
        ready = [i for i in order[c.sent:] if below is None or i < below]
        c.sent += len(ready)
        for i in ready:
            if not c.calls[i][0]:
                c.calls[i][0] = f"call_{uuid.uuid4().hex[:24]}"
        return [_call_part(c.calls[i]) for i in ready]

    def _take_logprobs(self, c: _Candidate, ch: dict[str, Any]) -> None:
        lp = ch.get("logprobs") if isinstance(ch.get("logprobs"), dict) else {}
        entries = _tokens(lp.get("content"))
        ids = ch.get("token_ids") if isinstance(ch.get("token_ids"), list) else None
        for k, e in enumerate(entries):
            chosen = {"token": e["token"], "logProbability": e.get("logprob")}
            if ids is not None and len(ids) == len(entries) and isinstance(ids[k], int):
                chosen["tokenId"] = ids[k]
            c.chosen.append(chosen)
            c.top.append({"candidates": [{"token": t["token"], "logProbability": t.get("logprob")}
                                         for t in _tokens(e.get("top_logprobs"))]})
        c.unsent += len(entries)

    def _logprob_fields(self, c: _Candidate, streamed: bool) -> dict[str, Any]:
        if not self.logprobs:
            return {}
        start = len(c.chosen) - c.unsent if streamed else 0
        c.unsent = 0 if streamed else c.unsent
        chosen, top = c.chosen[start:], c.top[start:]
        out: dict[str, Any] = {"logprobsResult": {"topCandidates": top, "chosenCandidates": chosen}}
        values = [x["logProbability"] for x in chosen if isinstance(x.get("logProbability"), (int, float))]
        if values and not streamed:
            out["avgLogprobs"] = sum(values) / len(values)
        return out

    @staticmethod
    def _finish_reason(c: _Candidate) -> str:
        return FINISH.get(c.finish or "", "OTHER")

    def _usage(self, capture: Capture) -> dict[str, int]:
        usage = capture.usage_dict() or {}
        p, c = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
        return {"promptTokenCount": p, "candidatesTokenCount": c, "totalTokenCount": p + c}

    def _note_answer(self) -> None:
        """What the answer approximated, noted once (by ``final``, which runs before a call is recorded)."""
        if self.noted:
            return
        self.noted = True
        bad = [f"candidates[{c.index}]" for c in sorted(self.candidates.values(), key=lambda c: c.index)
               for call in c.calls.values() if "_unparsed_arguments" in tool_input(call[2])]
        if bad:
            self.notes.append(f"function call arguments that are not a JSON object sent as "
                              f"{{\"_unparsed_arguments\": …}} ({', '.join(bad[:3])})")

    # -- the interface of stream.Translator ----------------------------------------------------------
    def chunk(self, obj: dict[str, Any]) -> bytes:
        """The agent's events for one chat stream chunk (b"" when it says nothing in the API)."""
        out = []
        for ch in obj.get("choices") if isinstance(obj.get("choices"), list) else ():
            if not isinstance(ch, dict):
                continue
            delta = ch.get("delta") if isinstance(ch.get("delta"), dict) else {}
            c, parts = self._absorb(ch, delta)
            if parts:
                cand = {"content": {"role": "model", "parts": parts}, "index": c.index,
                        **self._logprob_fields(c, streamed=True)}
                out.append(self._frame(self._envelope([cand])))
        return b"".join(out)

    def _closing(self, c: _Candidate) -> dict[str, Any]:
        parts = self._complete_calls(c)
        cand: dict[str, Any] = {"content": {"role": "model", "parts": parts}} if parts else {}
        return {**cand, "finishReason": self._finish_reason(c), "index": c.index,
                **self._logprob_fields(c, streamed=True)}

    def finish(self, capture: Capture) -> bytes:
        """The last event (remaining function calls, finishReason, usageMetadata) once the chat stream
        ended and the call was recorded."""
        self._cand(0)
        last = self._frame(self._envelope([self._closing(c) for _, c in sorted(self.candidates.items())],
                                          self._usage(capture)))
        return last + (b"]" if self.array else b"")

    def failure(self, message: str, capture: Capture) -> bytes:
        """A stream the engine did not finish ends with Google's error object (the SDKs raise it)."""
        return self._frame(error_body(500, message)) + (b"]" if self.array else b"")

    def _whole(self, c: _Candidate) -> dict[str, Any]:
        parts: list[dict[str, Any]] = []
        if c.thought and self.thoughts:
            parts.append({"text": c.thought, "thought": True})
        if c.text:
            parts.append({"text": c.text})
        for i in sorted(c.calls):
            if not c.calls[i][0]:
                c.calls[i][0] = f"call_{uuid.uuid4().hex[:24]}"
            parts.append(_call_part(c.calls[i]))
        cand: dict[str, Any] = {"content": {"role": "model", "parts": parts}} if parts else {}
        return {**cand, "finishReason": self._finish_reason(c), "index": c.index,
                **self._logprob_fields(c, streamed=False)}

    def final(self, capture: Capture) -> dict[str, Any]:
        """The whole answer as a GenerateContentResponse (what a stream's events add up to)."""
        self._cand(0)
        self._note_answer()
        return self._envelope([self._whole(c) for _, c in sorted(self.candidates.items())],
                              self._usage(capture))

    def body(self, chat: dict[str, Any], capture: Capture) -> dict[str, Any]:
        """A whole (non-streamed) chat answer as a GenerateContentResponse."""
        for ch in chat.get("choices") if isinstance(chat.get("choices"), list) else ():
            if isinstance(ch, dict):
                msg = ch.get("message") if isinstance(ch.get("message"), dict) else {}
                self._absorb(ch, msg)
        return self.final(capture)

    def history(self) -> list[dict[str, Any]]:
        """The answer (candidate 0) as a chat assistant message."""
        c = self._cand(0)
        msg: dict[str, Any] = {"role": "assistant", "content": c.text or None}
        if c.calls:
            msg["tool_calls"] = [{"id": c.calls[i][0], "type": "function",
                                  "function": {"name": c.calls[i][1], "arguments": c.calls[i][2]}}
                                 for i in sorted(c.calls)]
        return [msg]


def answer_as_chat(response: Any) -> dict[str, Any] | None:
    """A recorded GenerateContentResponse as the chat/completions response it stands for (display)."""
    if not isinstance(response, dict) or not isinstance(response.get("candidates"), list):
        return None
    choices = []
    for k, cand in enumerate(response["candidates"]):
        cand = cand if isinstance(cand, dict) else {}
        content = cand.get("content") if isinstance(cand.get("content"), dict) else {}
        text, reasoning, calls = [], [], []
        for p in content.get("parts") if isinstance(content.get("parts"), list) else ():
            if not isinstance(p, dict):
                continue
            if isinstance(p.get("text"), str):
                (reasoning if p.get("thought") is True else text).append(p["text"])
            fc = get_field(p, "functionCall")
            if isinstance(fc, dict):
                args = json.dumps(fc.get("args") or {}, ensure_ascii=False)
                calls.append({"id": fc.get("id"), "type": "function",
                              "function": {"name": fc.get("name"), "arguments": args}})
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
        if reasoning:
            msg["reasoning"] = "".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        choices.append({"index": cand.get("index", k), "message": msg,
                        "finish_reason": cand.get("finishReason")})
    return {"choices": choices}
