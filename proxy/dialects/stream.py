"""The engine's chat answer, whole or streamed, in the agent's API: Responses or Messages."""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass, field
from typing import Any

from ..wire import Capture, dumps
from .common import MESSAGES, RESPONSES, new_id, tool_input
from .responses import custom_input, text_logprobs, tool_routes, wants_encrypted_reasoning, wants_logprobs


def _usage(capture: Capture) -> tuple[int, int]:
    """(prompt tokens, completion tokens) of a call, as the engine counted them."""
    usage = capture.usage_dict() or {}
    p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (p if isinstance(p, int) else 0), (c if isinstance(c, int) else 0)


@dataclass
class _Tool:
    index: int  # position in the API's output / content list
    item_id: str
    call_id: str
    name: str = ""
    arguments: str = ""
    opened: bool = False
    custom: str | None = None  # Responses: a custom tool call's input, read once from its arguments
    checked: bool = False  # Messages: its arguments were read as the tool's input (and noted if not JSON)


@dataclass
class Translator:
    """One call's answer in the agent's API, from the engine's chat answer (whole or streamed).

    ``request`` is the agent's own request (echoed where the API echoes it); ``model`` the name the
    agent asked for. A stream is translated event by event: ``chunk`` for each chat chunk (its JSON),
    ``finish`` when the chat stream ended (after the call was recorded), ``body`` for a whole answer.
    """

    api: str
    request: dict[str, Any]
    model: str | None
    response_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    seq: int = 0
    started: bool = False
    text_open: bool = False
    text_index: int = -1
    text_id: str = ""
    text: str = ""
    reasoning: str = ""
    reasoning_index: int = -1
    reasoning_id: str = ""
    reasoning_closed: bool = False
    items: int = 0  # output items / content blocks opened so far
    tools: dict[int, _Tool] = field(default_factory=dict)
    text_logprobs: list[dict[str, Any]] = field(default_factory=list)  # when the agent asked for them
    finish_reason: str | None = None
    stop_reason: Any = None
    notes: list[str] = field(default_factory=list)  # what the answer's translation approximated
    routes: dict[str, Any] = field(default_factory=dict)  # Responses: chat function → the agent's tool

    def __post_init__(self) -> None:
        if not self.response_id:
            self.response_id = new_id("resp" if self.api == RESPONSES else "msg")
        if self.api == RESPONSES and not self.routes:
            self.routes = tool_routes(self.request)

    # -- SSE ------------------------------------------------------------------------------------------
    def _event(self, kind: str, data: dict[str, Any]) -> bytes:
        if self.api == RESPONSES:
            data = {"type": kind, "sequence_number": self.seq, **data}
            self.seq += 1
        else:
            data = {"type": kind, **data}
        return b"event: " + kind.encode() + b"\ndata: " + dumps(data) + b"\n\n"

    # -- Responses objects ----------------------------------------------------------------------------
    def _envelope(self, status: str, output: list[dict[str, Any]], usage: tuple[int, int] | None,
                  incomplete: str | None = None) -> dict[str, Any]:
        r = self.request
        text = r.get("text") if isinstance(r.get("text"), dict) else {"format": {"type": "text"}}
        return {
            "id": self.response_id, "object": "response", "created_at": self.created, "status": status,
            "background": bool(r.get("background")), "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": r.get("instructions"), "max_output_tokens": r.get("max_output_tokens"),
            "metadata": r.get("metadata") or {}, "model": self.model or r.get("model") or "",
            "output": output, "parallel_tool_calls": r.get("parallel_tool_calls", True),
            "previous_response_id": r.get("previous_response_id"), "reasoning": r.get("reasoning"),
            "store": r.get("store", True), "temperature": r.get("temperature", 1.0), "text": text,
            "tool_choice": r.get("tool_choice", "auto"), "tools": r.get("tools") or [],
            "top_p": r.get("top_p", 1.0), "truncation": r.get("truncation", "disabled"),
            "user": r.get("user"),
            "usage": None if usage is None else {
                "input_tokens": usage[0],
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": usage[1], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage[0] + usage[1]},
        }

    def _message_item(self, status: str) -> dict[str, Any]:
        return {"id": self.text_id, "type": "message", "status": status, "role": "assistant",
                "content": [] if status == "in_progress" else [self._text_part()]}

    def _text_part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": self.text_logprobs}

    def _reasoning_item(self) -> dict[str, Any]:
        item = {"id": self.reasoning_id, "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": self.reasoning}]}
        if wants_encrypted_reasoning(self.request):  # an opaque token: passed-back reasoning is dropped
            item["encrypted_content"] = f"lgt-proxy:{self.reasoning_id}"
        return item

    def _call_item(self, t: _Tool, status: str) -> dict[str, Any]:
        """A ``function_call`` item — or a ``custom_tool_call`` for a custom tool — under the agent's
        own tool name and namespace (the policy called the flattened chat function)."""
        route = self.routes.get(t.name)
        done = status != "in_progress"
        if route is not None and route.kind == "custom":
            item = {"id": t.item_id, "type": "custom_tool_call", "status": status, "call_id": t.call_id,
                    "name": route.name, "input": self._custom_input(t) if done else ""}
        else:
            item = {"id": t.item_id, "type": "function_call", "status": status, "call_id": t.call_id,
                    "name": route.name if route else t.name, "arguments": t.arguments if done else ""}
        if route is not None and route.namespace is not None:
            item["namespace"] = route.namespace
        return item

    def _is_custom(self, t: _Tool) -> bool:
        route = self.routes.get(t.name)
        return route is not None and route.kind == "custom"

    def _custom_input(self, t: _Tool) -> str:
        if t.custom is None:
            t.custom, note = custom_input(t.arguments)
            if note:
                self.notes.append(f"custom tool call {t.name!r}: {note}")
        return t.custom

    def _output(self) -> list[tuple[int, dict[str, Any]]]:
        out: list[tuple[int, dict[str, Any]]] = []
        if self.reasoning_index >= 0:
            out.append((self.reasoning_index, self._reasoning_item() if self.api == RESPONSES else
                        {"type": "thinking", "thinking": self.reasoning if self._thinking_shown() else "",
                         "signature": self._signature()}))
        if self.text_index >= 0:
            out.append((self.text_index, self._message_item("completed") if self.api == RESPONSES else
                        {"type": "text", "text": self.text}))
        for t in self.tools.values():
            if self.api == RESPONSES:
                out.append((t.index, self._call_item(t, "completed")))
            else:
                out.append((t.index, {"type": "tool_use", "id": t.call_id, "name": t.name,
                                      "input": self._input(t)}))
        return sorted(out, key=lambda x: x[0])

    # -- Anthropic objects ----------------------------------------------------------------------------
    def _signature(self) -> str:
        """A thinking block's ``signature``: the SDKs and Claude Code expect one and pass it back; the
        proxy drops passed-back thinking, so it only names where the block came from."""
        return base64.b64encode(f"lgt-proxy:{self.response_id}".encode()).decode()

    def _thinking_shown(self) -> bool:
        """False when the agent asked ``thinking.display: "omitted"`` (the block comes with its signature
        and no text, as the hosted API sends it); the reasoning stays on the record as tokens."""
        thinking = self.request.get("thinking")
        return not (isinstance(thinking, dict) and thinking.get("display") == "omitted")

    def _input(self, t: _Tool) -> dict[str, Any]:
        """A tool call's ``input``: its arguments as a JSON object (what else the policy wrote is wrapped,
        and noted, so the agent always gets an object)."""
        value = tool_input(t.arguments)
        if not t.checked:
            t.checked = True
            try:
                ok = isinstance(json.loads(t.arguments or "{}"), dict)
            except ValueError:
                ok = False
            if not ok:
                self.notes.append(f"tool call {t.name!r}: the policy's arguments are not a JSON object; sent "
                                  f"to the agent under {next(iter(value), 'an object')!r}")
        return value

    def _empty_text(self) -> list[bytes]:
        """An answer without a content block gets one empty text block, as the hosted API gives it
        (clients read ``content[0]``)."""
        if self.items:
            return []
        self.text_index, self.items = 0, 1
        empty = {"type": "text", "text": ""}
        return [self._event("content_block_start", {"index": 0, "content_block": empty}),
                self._event("content_block_stop", {"index": 0})]

    def _stop_reason(self) -> str:
        if self.finish_reason == "length":
            return "max_tokens"
        if self.tools or self.finish_reason == "tool_calls":
            return "tool_use"
        stops = self.request.get("stop_sequences") or ()
        if isinstance(self.stop_reason, str) and isinstance(stops, list) and self.stop_reason in stops:
            return "stop_sequence"
        return "end_turn"

    def _message(self, content: list[dict[str, Any]], stop: str | None,
                 usage: tuple[int, int]) -> dict[str, Any]:
        return {"id": self.response_id, "type": "message", "role": "assistant",
                "model": self.model or self.request.get("model") or "", "content": content,
                "stop_reason": stop,
                "stop_sequence": self.stop_reason if stop == "stop_sequence" else None,
                "usage": {"input_tokens": usage[0], "output_tokens": usage[1],
                          "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}

    # -- the answer, piece by piece --------------------------------------------------------------------
    def _start(self, prompt_tokens: int) -> list[bytes]:
        self.started = True
        if self.api == RESPONSES:
            head = self._envelope("in_progress", [], None)
            return [self._event("response.created", {"response": head}),
                    self._event("response.in_progress", {"response": head})]
        return [self._event("message_start", {"message": self._message([], None, (prompt_tokens, 0))})]

    def _close_text(self) -> list[bytes]:
        if not self.text_open:
            return []
        self.text_open = False
        if self.api == RESPONSES:
            at = {"item_id": self.text_id, "output_index": self.text_index}
            return [self._event("response.output_text.done", {**at, "content_index": 0, "text": self.text,
                                                              "logprobs": self.text_logprobs}),
                    self._event("response.content_part.done", {**at, "content_index": 0,
                                                               "part": self._text_part()}),
                    self._event("response.output_item.done", {"output_index": self.text_index,
                                                              "item": self._message_item("completed")})]
        return [self._event("content_block_stop", {"index": self.text_index})]

    def _reasoning_delta(self, delta: str) -> list[bytes]:
        out = []
        if self.reasoning_index < 0:
            self.reasoning_index, self.reasoning_id = self.items, new_id("rs")
            self.items += 1
            if self.api == RESPONSES:
                out.append(self._event("response.output_item.added", {
                    "output_index": self.reasoning_index,
                    "item": {**self._reasoning_item(), "content": []}}))
            else:
                out.append(self._event("content_block_start", {
                    "index": self.reasoning_index, "content_block": {"type": "thinking", "thinking": "",
                                                                     "signature": ""}}))
        self.reasoning += delta
        if self.api == RESPONSES:
            out.append(self._event("response.reasoning_text.delta", {
                "item_id": self.reasoning_id, "output_index": self.reasoning_index, "content_index": 0,
                "delta": delta}))
        elif self._thinking_shown() and not self.reasoning_closed:  # later reasoning: final message only
            out.append(self._event("content_block_delta", {
                "index": self.reasoning_index, "delta": {"type": "thinking_delta", "thinking": delta}}))
        return out

    def _close_reasoning(self) -> list[bytes]:
        if self.reasoning_index < 0 or self.reasoning_closed:
            return []
        self.reasoning_closed = True
        if self.api == RESPONSES:
            return [self._event("response.reasoning_text.done", {
                        "item_id": self.reasoning_id, "output_index": self.reasoning_index,
                        "content_index": 0, "text": self.reasoning}),
                    self._event("response.output_item.done", {"output_index": self.reasoning_index,
                                                              "item": self._reasoning_item()})]
        return [self._event("content_block_delta", {"index": self.reasoning_index, "delta": {
                    "type": "signature_delta", "signature": self._signature()}}),
                self._event("content_block_stop", {"index": self.reasoning_index})]

    def _text_delta(self, delta: str, logprobs: list[dict[str, Any]] = ()) -> list[bytes]:
        out = self._close_reasoning()
        if self.text_index < 0:
            self.text_index, self.text_id, self.text_open = self.items, new_id("msg"), True
            self.items += 1
            if self.api == RESPONSES:
                out.append(self._event("response.output_item.added", {
                    "output_index": self.text_index, "item": self._message_item("in_progress")}))
                out.append(self._event("response.content_part.added", {
                    "item_id": self.text_id, "output_index": self.text_index, "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}))
            else:
                out.append(self._event("content_block_start", {
                    "index": self.text_index, "content_block": {"type": "text", "text": ""}}))
        elif not self.text_open:  # text after a tool call began (a parser's leftovers): kept in the
            self.text += delta      # final answer, not streamed into a closed item
            self.text_logprobs += logprobs
            return out
        self.text += delta
        self.text_logprobs += logprobs
        if self.api == RESPONSES:
            out.append(self._event("response.output_text.delta", {
                "item_id": self.text_id, "output_index": self.text_index, "content_index": 0,
                "delta": delta, "logprobs": [
                    {"token": lp["token"], "logprob": lp["logprob"],
                     "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]}
                                      for t in lp["top_logprobs"]]} for lp in logprobs]}))
        else:
            out.append(self._event("content_block_delta", {
                "index": self.text_index, "delta": {"type": "text_delta", "text": delta}}))
        return out

    def _tool_delta(self, tc: dict[str, Any]) -> list[bytes]:
        index = tc.get("index", 0) if isinstance(tc.get("index"), int) else 0
        fn = tc.get("function") if isinstance(tc.get("function"), dict) else {}
        out: list[bytes] = []
        t = self.tools.get(index)
        if t is None:
            out += self._close_reasoning() + self._close_text()
            for other in self.tools.values():
                out += self._close_tool(other)
            call_id = tc.get("id") if isinstance(tc.get("id"), str) and tc.get("id") else new_id("call")
            if self.api == MESSAGES and not call_id.startswith("toolu_"):
                call_id = "toolu_" + call_id.removeprefix("call_").removeprefix("chatcmpl-tool-")
            t = self.tools[index] = _Tool(self.items, new_id("fc"), call_id)
            self.items += 1
        if isinstance(fn.get("name"), str):
            t.name += fn["name"]
        args = fn.get("arguments") if isinstance(fn.get("arguments"), str) else ""
        if not t.opened:
            t.opened = True
            if self.api == RESPONSES:
                out.append(self._event("response.output_item.added", {
                    "output_index": t.index, "item": self._call_item(t, "in_progress")}))
            else:
                out.append(self._event("content_block_start", {
                    "index": t.index, "content_block": {"type": "tool_use", "id": t.call_id, "name": t.name,
                                                        "input": {}}}))
        if args:
            t.arguments += args
            if self.api == RESPONSES and not self._is_custom(t):  # a custom call's input: whole, at its end
                out.append(self._event("response.function_call_arguments.delta", {
                    "item_id": t.item_id, "output_index": t.index, "delta": args}))
        return out  # Messages: the input is sent whole when the block closes (_close_tool)

    def _close_tool(self, t: _Tool) -> list[bytes]:
        if not t.opened:
            return []
        t.opened = False
        index = t.index
        if self.api == RESPONSES and self._is_custom(t):
            at = {"item_id": t.item_id, "output_index": index}
            text = self._custom_input(t)
            delta = [self._event("response.custom_tool_call_input.delta", {**at, "delta": text})
                     ] if text else []
            return [*delta, self._event("response.custom_tool_call_input.done", {**at, "input": text}),
                    self._event("response.output_item.done", {"output_index": index,
                                                              "item": self._call_item(t, "completed")})]
        if self.api == RESPONSES:
            return [self._event("response.function_call_arguments.done", {
                        "item_id": t.item_id, "output_index": index,
                        "name": self._call_item(t, "completed")["name"], "arguments": t.arguments}),
                    self._event("response.output_item.done", {"output_index": index,
                                                              "item": self._call_item(t, "completed")})]
        if not t.arguments.strip():  # no arguments: the input stays the {} the block started with
            return [self._event("content_block_stop", {"index": index})]
        whole = dumps(self._input(t)).decode()
        return [self._event("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": whole}}),
                self._event("content_block_stop", {"index": index})]

    def chunk(self, obj: dict[str, Any]) -> bytes:
        """The agent's events for one chat stream chunk (b"" when it says nothing in the API)."""
        out: list[bytes] = []
        if not self.started:
            ids = obj.get("prompt_token_ids")
            out += self._start(len(ids) if isinstance(ids, list) else 0)
        choices = obj.get("choices") if isinstance(obj.get("choices"), list) else []
        for ch in choices:
            if not isinstance(ch, dict) or ch.get("index", 0) != 0:
                continue  # n > 1 has no counterpart in either API: choice 0 is the answer
            delta = ch.get("delta") if isinstance(ch.get("delta"), dict) else {}
            for key in ("reasoning_content", "reasoning"):
                if isinstance(delta.get(key), str) and delta[key]:
                    out += self._reasoning_delta(delta[key])
                    break
            if isinstance(delta.get("content"), str) and delta["content"]:
                lps = ()
                if self.api == RESPONSES and wants_logprobs(self.request):
                    lp = ch.get("logprobs") if isinstance(ch.get("logprobs"), dict) else {}
                    lps = text_logprobs(lp.get("content"), delta["content"])
                out += self._text_delta(delta["content"], lps)
            for tc in delta.get("tool_calls") or ():
                if isinstance(tc, dict):
                    out += self._tool_delta(tc)
            if ch.get("finish_reason") is not None:
                self.finish_reason = ch["finish_reason"]
                self.stop_reason = ch.get("stop_reason")
        return b"".join(out)

    def finish(self, capture: Capture) -> bytes:
        """The closing events, once the chat stream ended and the call was recorded."""
        out: list[bytes] = [] if self.started else self._start(len(capture.prompt_token_ids or ()))
        out += self._close_reasoning() + self._close_text()
        for t in self.tools.values():
            out += self._close_tool(t)
        usage = _usage(capture)
        if self.api == RESPONSES:
            incomplete = "max_output_tokens" if self.finish_reason == "length" else None
            final = self._envelope("incomplete" if incomplete else "completed",
                                   [item for _, item in self._output()], usage, incomplete)
            out.append(self._event("response.incomplete" if incomplete else "response.completed",
                                   {"response": final}))
        else:
            out += self._empty_text()
            stop = self._stop_reason()
            out.append(self._event("message_delta", {
                "delta": {"stop_reason": stop,
                          "stop_sequence": self.stop_reason if stop == "stop_sequence" else None},
                "usage": {"output_tokens": usage[1]}}))
            out.append(self._event("message_stop", {}))
        return b"".join(out)

    def failure(self, message: str, capture: Capture) -> bytes:
        """The closing event of a stream the engine did not finish: the API's own failure event
        (``response.failed``; Anthropic's ``error`` event), which the SDKs raise or report."""
        out = [] if self.started else self._start(len(capture.prompt_token_ids or ()))
        if self.api == RESPONSES:
            failed = self._envelope("failed", [item for _, item in self._output()], _usage(capture))
            failed["error"] = {"code": "server_error", "message": message}
            return b"".join([*out, self._event("response.failed", {"response": failed})])
        return b"".join([*out, self._event("error", {"error": {"type": "api_error", "message": message}})])

    def final(self, capture: Capture) -> dict[str, Any]:
        """The whole answer as the API's response object (what a stream's events add up to)."""
        usage = _usage(capture)
        if self.api == RESPONSES:
            incomplete = "max_output_tokens" if self.finish_reason == "length" else None
            return self._envelope("incomplete" if incomplete else "completed",
                                  [item for _, item in self._output()], usage, incomplete)
        self._empty_text()
        return self._message([item for _, item in self._output()], self._stop_reason(), usage)

    def body(self, chat: dict[str, Any], capture: Capture) -> dict[str, Any]:
        """A whole (non-streamed) chat answer as the API's response object."""
        choices = chat.get("choices") if isinstance(chat.get("choices"), list) else []
        first = next((c for c in choices if isinstance(c, dict) and c.get("index", 0) == 0), None)
        if first is not None:
            msg = first.get("message") if isinstance(first.get("message"), dict) else {}
            delta = {k: msg.get(k) for k in ("reasoning_content", "reasoning", "content")}
            calls = msg.get("tool_calls") if isinstance(msg.get("tool_calls"), list) else []
            delta["tool_calls"] = [{**tc, "index": i} for i, tc in enumerate(calls) if isinstance(tc, dict)]
            self.started = True  # no events: only the state they would build
            self.chunk({"choices": [{"index": 0, "delta": delta, "finish_reason": first.get("finish_reason"),
                                     "stop_reason": first.get("stop_reason"),
                                     "logprobs": first.get("logprobs")}]})
        return self.final(capture)

    def history(self) -> list[dict[str, Any]]:
        """Responses: the answer's output items (a later ``previous_response_id`` continues with them);
        otherwise the assistant's turn as chat messages."""
        if self.api == RESPONSES:
            return [item for _, item in self._output()]
        msg: dict[str, Any] = {"role": "assistant", "content": self.text or None}
        if self.tools:
            msg["tool_calls"] = [{"id": t.call_id, "type": "function",
                                  "function": {"name": t.name, "arguments": t.arguments}}
                                 for t in sorted(self.tools.values(), key=lambda t: t.index)]
        return [msg]
