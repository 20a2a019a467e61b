"""OpenAI / vLLM wire format: recognising LLM calls, rewriting requests, stripping responses, and
re-framing server-sent events. Pure functions and small state machines, no mitmproxy: the addons in
``addons/`` call these, and the Hypothesis tests drive them directly.

What the proxy injects into a request routed to a vLLM-compatible upstream, and so what it strips
from every response (whole bodies and each SSE event) before the agent sees it:

- ``return_token_ids: true`` → vLLM fills ``prompt_token_ids`` (chat: response root, first stream chunk;
  completions: each choice) and ``token_ids`` (each choice / each chunk's choice).
- sampled-token logprobs (chat ``logprobs: true``; completions ``logprobs: 0``) → ``logprobs`` of each
  choice.

vLLM 0.32 sends all three as ``null`` when they were not asked for (see ``fake_upstream.py``'s notes),
so stripping sets a present key back to ``null``; it never deletes or adds a key.
- ``model`` rewritten to the served model → every response's ``model`` is set back to the name the
  agent asked for.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

CHAT = "chat/completions"
COMPLETIONS = "completions"


def loads(data: bytes | str) -> Any:
    """JSON from the wire (orjson; the stdlib for the NaN/Infinity literals orjson refuses)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON, as vLLM writes it."""
    try:
        return orjson.dumps(obj)
    except TypeError:  # e.g. integers beyond 64 bits, which only the stdlib writes
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


class BadRequest(ValueError):
    """The request looks like an LLM call (by path) but is not one the proxy can handle."""


def endpoint_of(method: str, path: str) -> str | None:
    """``chat/completions`` or ``completions`` for an OpenAI-style LLM call path, else None."""
    if method.upper() != "POST":
        return None
    p = path.split("?", 1)[0].rstrip("/")
    if p.endswith("/chat/completions") or p == "chat/completions":
        return CHAT
    if p.endswith("/completions") or p == "completions":
        return COMPLETIONS
    return None


def parse_request(endpoint: str, body: bytes | None) -> dict[str, Any]:
    """The JSON request object; BadRequest (one sentence) when it is not an OpenAI request."""
    try:
        req = loads(body or b"")
    except (ValueError, UnicodeDecodeError):
        raise BadRequest(f"the body of this /{endpoint} request is not valid JSON") from None
    if not isinstance(req, dict):
        raise BadRequest(f"the body of this /{endpoint} request is not a JSON object")
    need = "messages" if endpoint == CHAT else "prompt"
    if need not in req:
        raise BadRequest(f"this /{endpoint} request has no {need!r} field")
    if endpoint == CHAT and not isinstance(req["messages"], list):
        raise BadRequest("'messages' must be a list")
    if "model" in req and not isinstance(req["model"], str):
        raise BadRequest("'model' must be a string")
    return req


@dataclass(frozen=True)
class Injected:
    """What the proxy added to one request; decides what is stripped from its responses."""

    token_ids: bool = False
    logprobs: bool = False
    model: str | None = None  # the agent's model name, when the proxy rewrote it
    sampling: str | None = None  # "greedy": the proxy overrode the agent's sampling (evaluation)

    @property
    def captures(self) -> bool:
        """The proxy asked for token ids or logprobs the agent did not ask for."""
        return self.token_ids or self.logprobs


GREEDY_DROPS = ("top_p", "top_k", "min_p", "seed")  # sampling knobs a greedy override removes


def prepare_request(
    endpoint: str, req: dict[str, Any], *, served_model: str | None, capture_tokens: bool,
    capture_logprobs: bool | None = None, greedy: bool = False,
) -> tuple[dict[str, Any], Injected]:
    """The request to send upstream and what was injected into it (``req`` is not modified).

    ``capture_tokens`` asks for token ids, ``capture_logprobs`` (default: the same) for the sampled
    tokens' logprobs; a retry without one of them prepares the agent's request again with it off.
    ``greedy`` decodes greedily whatever the agent asked: temperature 0, and the sampling knobs that
    would otherwise still apply (top_p, top_k, min_p, seed) removed.
    """
    out = dict(req)
    model = None
    if served_model is not None and req.get("model") != served_model:
        model = req.get("model")
        out["model"] = served_model
    token_ids = logprobs = False
    if capture_logprobs is None:
        capture_logprobs = capture_tokens
    if capture_tokens and not req.get("return_token_ids"):
        out["return_token_ids"] = True
        token_ids = True
    if capture_logprobs:
        if endpoint == CHAT:
            if not req.get("logprobs"):
                out["logprobs"] = True
                logprobs = True
        elif req.get("logprobs") is None:
            out["logprobs"] = 0
            logprobs = True
    sampling = None
    if greedy:
        for knob in GREEDY_DROPS:
            out.pop(knob, None)
        out["temperature"] = 0.0
        sampling = "greedy"
    return out, Injected(token_ids=token_ids, logprobs=logprobs, model=model, sampling=sampling)


OUTPUT_LIMITS = {CHAT: ("max_tokens", "max_completion_tokens"), COMPLETIONS: ("max_tokens",)}


def fit_output(endpoint: str, req: dict[str, Any], context: int | None, notes: list[str]) -> dict[str, Any]:
    """``req`` without an output limit greater than the engine's context (``max_model_len``): harnesses
    ask for 32k–128k tokens, which a hosted model takes and vLLM 0.32 refuses (400 "max_tokens=N
    cannot be greater than max_model_len=M"; a smaller limit that the prompt leaves no room for it
    clamps by itself). Left out, the engine stops at the context's end, as the hosted API would have
    stopped at the limit; a note says so."""
    if not context:
        return req
    over = [k for k in OUTPUT_LIMITS.get(endpoint, ()) if isinstance(req.get(k), int)
            and not isinstance(req.get(k), bool) and req[k] > context]
    if not over:
        return req
    for k in over:
        notes.append(f"{k} {req[k]} is more than the engine's context of {context} tokens: left out, so "
                     "the engine stops at the context's end")
    return {k: v for k, v in req.items() if k not in over}


def cap_output(endpoint: str, req: dict[str, Any], cap: int | None, notes: list[str]) -> dict[str, Any]:
    """``req`` with its output limit at most ``cap`` tokens (``lgt-proxy --max-output-tokens``): a
    harness asks for 32k–64k tokens, which an untrained policy spends to its timeout on a CPU. A limit
    above the cap is lowered to it, a request without one gets it (``max_tokens``); a note says which,
    so the call's record shows the reply was bounded by the run, not by the agent."""
    keys = OUTPUT_LIMITS.get(endpoint, ())
    if not cap or not keys:
        return req
    asked = {k: req[k] for k in keys if isinstance(req.get(k), int) and not isinstance(req.get(k), bool)}
    if asked and all(v <= cap for v in asked.values()):
        return req
    out = dict(req)
    if asked:
        for k, v in asked.items():
            if v > cap:
                out[k] = cap
                notes.append(f"{k} {v} lowered to {cap} by the proxy's output cap (--max-output-tokens)")
    else:
        out["max_tokens"] = cap
        notes.append(f"no output limit asked: max_tokens {cap} set by the proxy's output cap "
                     "(--max-output-tokens)")
    return out


def strip_response(endpoint: str, obj: Any, inj: Injected) -> Any:
    """Remove what ``inj`` says was injected from a response body or one stream chunk (in place)."""
    if not isinstance(obj, dict):
        return obj
    if inj.model is not None and "model" in obj:
        obj["model"] = inj.model
    if inj.token_ids:
        _null(obj, "prompt_token_ids")
    for choice in _choices(obj):
        if inj.token_ids:
            _null(choice, "token_ids")
            _null(choice, "prompt_token_ids")
        if inj.logprobs:
            _null(choice, "logprobs")
    return obj


def is_silent_chunk(obj: Any) -> bool:
    """A stream chunk that says nothing once stripped: vLLM sends these (``"delta": {}``) for tokens
    that produce no text only because token ids or logprobs were asked for, so an agent that asked
    for neither would not have seen them."""
    if not isinstance(obj, dict) or obj.get("usage") or obj.get("prompt_token_ids"):
        return False
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    return all(
        isinstance(c, dict) and c.get("delta") == {} and c.get("finish_reason") is None
        and c.get("logprobs") is None and c.get("token_ids") is None
        for c in choices
    )


def _choices(obj: dict[str, Any]) -> list[dict[str, Any]]:
    choices = obj.get("choices")
    return [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []


def _index(choice: dict[str, Any]) -> int:
    i = choice.get("index", 0)
    return i if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1024 else 0


def _null(obj: dict[str, Any], key: str) -> None:
    # vLLM sends these fields as null when not asked for (whole bodies are dumped with every
    # field, stream chunks with the fields it set): restore null, never delete or add the key.
    if key in obj:
        obj[key] = None


def _ids(v: Any) -> list[int] | None:
    if isinstance(v, list) and all(type(i) is int and 0 <= i < 2**31 for i in v):
        return v
    return None


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


# -- capture ------------------------------------------------------------------------------------
LOGPROB_FLOOR = -9999.0  # vLLM clamps a sampled token's logprob to this; reaching it means -inf


def _nonfinite(v: Any) -> bool:
    """A logprob value that says nothing true: NaN, infinite, or vLLM's floor for -inf (a JSON
    ``null`` is how pydantic writes NaN/inf in a stream chunk)."""
    if v is None:
        return True
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and not (math.isfinite(v) and v > LOGPROB_FLOOR))


def _logprob(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or _nonfinite(v):
        return None
    return float(v)


# How complete a call's capture is (the calls table's ``capture``), and why not full.
CAPTURE_FULL = "full"  # prompt and generated token ids, one finite logprob per generated token
CAPTURE_NO_LOGPROBS = "no_logprobs"  # token ids without (usable) logprobs
CAPTURE_NO_TOKENS = "no_tokens"  # no token ids
CAPTURES = (CAPTURE_FULL, CAPTURE_NO_LOGPROBS, CAPTURE_NO_TOKENS)


def capture_level(prompt_ids: list[int] | None, token_ids: list[int] | None,
                  logprobs: list[float | None] | None) -> str:
    if prompt_ids is None or token_ids is None:
        return CAPTURE_NO_TOKENS
    if logprobs is None or len(logprobs) != len(token_ids) or None in logprobs:
        return CAPTURE_NO_LOGPROBS
    return CAPTURE_FULL


@dataclass
class ChoiceCapture:
    index: int
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    text: str = ""
    role: str | None = None
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # other message fields, e.g. reasoning
    nonfinite: int = 0  # logprobs that were NaN, infinite, or vLLM's -9999 floor (kept as None)

    def add_ids(self, ids: Any) -> None:
        ids = _ids(ids)
        if ids is not None:
            self.token_ids = (self.token_ids or []) + ids

    def add_logprobs(self, endpoint: str, lp: Any) -> None:
        if not isinstance(lp, dict):
            return
        entries = lp.get("content") if endpoint == CHAT else lp.get("token_logprobs")
        if not isinstance(entries, list):
            return
        if endpoint == CHAT:
            values = [e.get("logprob") if isinstance(e, dict) else None for e in entries]
        else:
            values = entries
        self.logprobs = (self.logprobs or []) + [_logprob(v) for v in values]
        self.nonfinite += sum(_nonfinite(v) for v in values)


@dataclass
class Capture:
    """Token ids, logprobs and the agent-visible response of one call, from a body or from chunks."""

    endpoint: str
    prompt_token_ids: list[int] | None = None
    choices: dict[int, ChoiceCapture] = field(default_factory=dict)
    usage: dict[str, Any] | None = None
    head: dict[str, Any] = field(default_factory=dict)  # id, created, model, object of the response
    chunks: int = 0

    def _choice(self, index: int) -> ChoiceCapture:
        if index not in self.choices:
            self.choices[index] = ChoiceCapture(index)
        return self.choices[index]

    def _take_ids(self, obj: dict[str, Any]) -> None:
        if self.prompt_token_ids is None:
            self.prompt_token_ids = _ids(obj.get("prompt_token_ids"))
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        for k in ("id", "created", "model", "system_fingerprint"):
            if k in obj and k not in self.head:
                self.head[k] = obj[k]

    def add_body(self, obj: dict[str, Any]) -> None:
        """A whole (non-streamed) response, before stripping."""
        self._take_ids(obj)
        for ch in _choices(obj):
            c = self._choice(_index(ch))
            if self.prompt_token_ids is None:
                self.prompt_token_ids = _ids(ch.get("prompt_token_ids"))
            c.add_ids(ch.get("token_ids"))
            c.add_logprobs(self.endpoint, ch.get("logprobs"))
            c.finish_reason = _str(ch.get("finish_reason"))

    def add_chunk(self, obj: dict[str, Any]) -> None:
        """One stream event's JSON, before stripping."""
        self.chunks += 1
        self._take_ids(obj)
        for ch in _choices(obj):
            c = self._choice(_index(ch))
            if self.prompt_token_ids is None:
                self.prompt_token_ids = _ids(ch.get("prompt_token_ids"))
            c.add_ids(ch.get("token_ids"))
            c.add_logprobs(self.endpoint, ch.get("logprobs"))
            if ch.get("finish_reason") is not None:
                c.finish_reason = _str(ch["finish_reason"])
            if self.endpoint == COMPLETIONS:
                c.text += _str(ch.get("text")) or ""
                continue
            delta = ch.get("delta")
            if not isinstance(delta, dict):
                continue
            c.role = _str(delta.get("role")) or c.role
            c.text += _str(delta.get("content")) or ""
            for k, v in delta.items():
                if k not in ("role", "content", "tool_calls") and isinstance(v, str):
                    c.extra[k] = c.extra.get(k, "") + v
            calls = delta.get("tool_calls")
            for tc in calls if isinstance(calls, list) else ():
                if not isinstance(tc, dict):
                    continue
                slot = c.tool_calls.setdefault(
                    _index(tc), {"id": None, "type": "function",
                                 "function": {"name": "", "arguments": ""}}
                )
                if tc.get("id"):
                    slot["id"] = _str(tc["id"])
                fn = tc.get("function") if isinstance(tc.get("function"), dict) else {}
                slot["function"]["name"] += _str(fn.get("name")) or ""
                slot["function"]["arguments"] += _str(fn.get("arguments")) or ""

    def assembled(self, inj: Injected) -> dict[str, Any]:
        """A streamed response re-assembled as the equivalent non-streamed body (agent-visible)."""
        choices = []
        for c in sorted(self.choices.values(), key=lambda c: c.index):
            if self.endpoint == CHAT:
                msg: dict[str, Any] = {"role": c.role or "assistant", "content": c.text or None}
                msg.update(c.extra)
                if c.tool_calls:
                    msg["tool_calls"] = [c.tool_calls[i] for i in sorted(c.tool_calls)]
                choices.append({"index": c.index, "message": msg, "finish_reason": c.finish_reason})
            else:
                choices.append({"index": c.index, "text": c.text, "finish_reason": c.finish_reason})
        head = dict(self.head)
        if inj.model is not None:
            head["model"] = inj.model
        obj = "chat.completion" if self.endpoint == CHAT else "text_completion"
        return {**head, "object": obj, "choices": choices, "usage": self.usage_dict()}

    def usage_dict(self) -> dict[str, int] | None:
        if isinstance(self.usage, dict):
            ints = {k: v for k, v in self.usage.items()
                    if k in ("prompt_tokens", "completion_tokens", "total_tokens")
                    and isinstance(v, int) and not isinstance(v, bool)}
            if ints:
                return ints
        first = self.choices.get(0)
        if self.prompt_token_ids is None or first is None or first.token_ids is None:
            return None
        p = len(self.prompt_token_ids)
        c = sum(len(ch.token_ids or ()) for ch in self.choices.values())
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


# -- server-sent events -------------------------------------------------------------------------
def _split_event(buf: bytes) -> tuple[bytes, bytes] | None:
    """(event including its terminator, rest) for the first complete event in ``buf``."""
    best = None
    for sep in (b"\r\n\r\n", b"\n\n", b"\r\r"):
        i = buf.find(sep)
        if i != -1 and (best is None or i < best[0]):
            best = (i, len(sep))
    if best is None:
        return None
    end = best[0] + best[1]
    return buf[:end], buf[end:]


def event_data(event: bytes) -> bytes | None:
    """The joined ``data:`` field of one SSE event, or None when it has none."""
    if event.startswith(b"data: ") and event.count(b"\n") <= 2 and b"\r" not in event:
        return event[6:].rstrip(b"\n")  # the usual one-line event
    lines = event.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    data = [l[5:].removeprefix(b" ") for l in lines if l.startswith(b"data:")]
    if not data:
        return None
    return b"\n".join(data)


def error_event(message: str, kind: str = "upstream_timeout") -> bytes:
    """An SSE event in the shape OpenAI's API sends a mid-stream error in (its SDKs raise it)."""
    error = {"message": message, "type": kind, "param": None, "code": None}
    return b"data: " + dumps({"error": error}) + b"\n\n"


def rebuild_event(event: bytes, data: bytes) -> bytes:
    """``event`` with its data field replaced by ``data``; other fields (event:, id:) kept."""
    if event.startswith(b"data:") and event.count(b"\n") <= 2 and b"\r" not in event:
        return b"data: " + data + b"\n\n"  # the usual one-line event
    lines = event.replace(b"\r\n", b"\n").replace(b"\r", b"\n").rstrip(b"\n").split(b"\n")
    out, done = [], False
    for l in lines:
        if l.startswith(b"data:"):
            if not done:
                out.extend(b"data: " + d for d in data.split(b"\n"))
                done = True
        else:
            out.append(l)
    return b"\n".join(out) + b"\n\n"


class SSEFramer:
    """Splits an arbitrarily chunked byte stream into whole SSE events."""

    def __init__(self, max_event_bytes: int = 16 << 20) -> None:
        self.buf = b""
        self.max_event_bytes = max_event_bytes

    def feed(self, data: bytes) -> Iterator[bytes]:
        self.buf += data
        while True:
            split = _split_event(self.buf)
            if split is None:
                break
            event, self.buf = split
            yield event
        if len(self.buf) > self.max_event_bytes:
            raise ValueError(f"an SSE event exceeds {self.max_event_bytes} bytes")

    def rest(self) -> bytes:
        rest, self.buf = self.buf, b""
        return rest
