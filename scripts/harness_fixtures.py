#!/usr/bin/env python3
"""Record what real coding-agent harnesses send, as they ship, into tests/fixtures/harnesses/.

Each harness installed by ``npm ci`` in ``tests/harnesses`` (Claude Code, Codex CLI, Gemini CLI,
qwen-code, opencode, pi) is run unmodified, with only its own flags, environment variables and config
files (``lgt.testing.harnesses``: the one description the tests through lgt-proxy use too), on one task:
"write the word PINEAPPLE into the file answer.txt in the current directory",
aimed at its default hosted API through ``HTTPS_PROXY``. The proxy is a mitmproxy run in this
process that never forwards anything: it answers every request itself — provider-format canned
answers (Anthropic Messages SSE, OpenAI Responses SSE and WebSocket, Gemini ``streamGenerateContent``
SSE, chat/completions SSE): first a call of the harness's own write/shell tool (picked and filled by
``lgt.testing.harness_policy``, as the scripted engine behind lgt-proxy does), then, once the tool's
result comes back, a short final text; model lists, update checks and telemetry get plausible answers.
Everything the harness sent (method, URL, redacted headers, body as JSON, WebSocket messages) and what
it was answered is written to ``tests/fixtures/harnesses/<harness>[.<profile>]/NN-<kind>.json`` with
a ``manifest.json``; the task's effect (answer.txt holds PINEAPPLE) and the exit code are checked
and a table printed.

Profiles: ``default`` (the harness with the settings that keep it from asking, updating and sending
telemetry), ``minimal`` (the smallest prompt found without modifying the harness), ``http`` (Codex
with its WebSocket refused) and ``stock`` (only a key; not recorded unless asked for).

By default the whole run happens in a fresh network namespace with only loopback (``unshare -n``),
so nothing a harness does can reach a real host; each harness gets its own temporary work dir, HOME
and config dirs.

    .venv-proxy/bin/python scripts/harness_fixtures.py                  # all harnesses and profiles
    .venv-proxy/bin/python scripts/harness_fixtures.py --harness codex,gemini --profile minimal
    .venv-proxy/bin/python scripts/harness_fixtures.py --harness claude_code --out /tmp/x \
        --arg=--tools --arg=Write --env ENABLE_TOOL_SEARCH=false     # try a setting, see the sizes
    .venv-proxy/bin/python scripts/harness_fixtures.py --update-lock   # pin the newest versions, npm ci
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import copy
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from lgt.testing.harness_policy import (
    Task,
    ToolCall,
    choose_call,
    fill_schema,
    has_tool_result,
    offered_tools,
    task_text,
)
from lgt.testing.harnesses import (
    HARNESSES,
    INSTALL_DIRS,
    PACKAGES,
    Harness,
    Place,
    command,
    environment,
    installed_version,
    prepare,
)
from lgt.testing.hosted_teacher import anthropic_answer, anthropic_whole, sse
from lgt.testing.hosted_teacher import new_id as _id
from lgt.trainer.serving.children import signal_group

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "harnesses"
WORD = "PINEAPPLE"
TASK = task_text(WORD, "answer.txt")  # "Write the word PINEAPPLE into the file answer.txt in the current …"
FINAL_TEXT = Task(WORD, "answer.txt").final_text
SIDE_TEXT = f"Write {WORD} to answer.txt"  # strings in the JSON side calls get (titles, routing reasons)
NETNS_MARK = "LGT_HARNESS_NETNS"
PROXY_USER, PROXY_PASS = "harness-fixtures", "tok"

SECRET_HEADERS = {"authorization", "x-api-key", "x-goog-api-key", "api-key", "proxy-authorization",
                  "cookie", "set-cookie", "chatgpt-account-id", "x-openai-api-key"}
SECRET_QUERY = {"key", "api_key", "apikey", "token", "access_token"}


# --------------------------------------------------------------------------------------------------
# canned answers, one small builder per API
# --------------------------------------------------------------------------------------------------

def parse_sse(raw: bytes) -> list[dict[str, Any]]:
    events = []
    for block in raw.decode(errors="replace").split("\n\n"):
        ev: dict[str, Any] = {}
        for line in block.splitlines():
            if line.startswith("event:"):
                ev["event"] = line[6:].strip()
            elif line.startswith("data:"):
                d = line[5:].strip()
                try:
                    ev["data"] = json.loads(d)
                except ValueError:
                    ev["data"] = d
        if ev:
            events.append(ev)
    return events


# ---- Anthropic Messages --------------------------------------------------------------------------

# ---- OpenAI Responses ----------------------------------------------------------------------------

def responses_events(body: dict[str, Any], call: ToolCall | None, text: str | None) -> list[dict[str, Any]]:
    """The event objects of one streamed Responses answer (SSE data, or WebSocket text messages)."""
    model = body.get("model", "gpt")
    rid = _id("resp_")
    base = {"id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "model": model, "output": [], "error": None, "incomplete_details": None,
            "instructions": None, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "usage": None, "metadata": {}}
    seq = iter(range(1000))
    ev = [{"type": "response.created", "response": copy.deepcopy(base)},
          {"type": "response.in_progress", "response": copy.deepcopy(base)}]
    if call is None and text is None:  # Codex's prewarm (generate: false): a response with no output
        ev.append({"type": "response.completed", "response": dict(base, status="completed", usage={
            "input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 10})})
        for e in ev:
            e["sequence_number"] = next(seq)
        return ev
    if call is None:
        item_id = _id("msg_")
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item = {"id": item_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        ev += [{"type": "response.output_item.added", "output_index": 0, "item": copy.deepcopy(item)},
               {"type": "response.content_part.added", "item_id": item_id, "output_index": 0,
                "content_index": 0, "part": part},
               {"type": "response.output_text.delta", "item_id": item_id, "output_index": 0,
                "content_index": 0, "delta": text, "logprobs": []},
               {"type": "response.output_text.done", "item_id": item_id, "output_index": 0,
                "content_index": 0, "text": text, "logprobs": []},
               {"type": "response.content_part.done", "item_id": item_id, "output_index": 0,
                "content_index": 0, "part": dict(part, text=text)}]
        done = dict(item, status="completed", content=[dict(part, text=text)])
    elif call.kind == "custom":
        item_id = _id("ctc_")
        cid = _id("call_")
        item = {"id": item_id, "type": "custom_tool_call", "status": "in_progress", "call_id": cid,
                "name": call.name, "input": ""}
        if call.namespace:
            item["namespace"] = call.namespace
        ev += [{"type": "response.output_item.added", "output_index": 0, "item": copy.deepcopy(item)},
               {"type": "response.custom_tool_call_input.delta", "item_id": item_id, "output_index": 0,
                "delta": call.args},
               {"type": "response.custom_tool_call_input.done", "item_id": item_id, "output_index": 0,
                "input": call.args}]
        done = dict(item, status="completed", input=call.args)
    else:
        item_id = _id("fc_")
        cid = _id("call_")
        args = json.dumps(call.args)
        item = {"id": item_id, "type": "function_call", "status": "in_progress", "call_id": cid,
                "name": call.name, "arguments": ""}
        if call.namespace:
            item["namespace"] = call.namespace
        ev += [{"type": "response.output_item.added", "output_index": 0, "item": copy.deepcopy(item)},
               {"type": "response.function_call_arguments.delta", "item_id": item_id, "output_index": 0,
                "delta": args},
               {"type": "response.function_call_arguments.done", "item_id": item_id, "output_index": 0,
                "arguments": args}]
        done = dict(item, status="completed", arguments=args)
    ev.append({"type": "response.output_item.done", "output_index": 0, "item": done})
    ev.append({"type": "response.completed", "response": dict(
        base, status="completed", output=[done],
        usage={"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 12,
               "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 22})})
    for e in ev:
        e["sequence_number"] = next(seq)
    return ev


def responses_whole(events: list[dict[str, Any]]) -> dict[str, Any]:
    return events[-1]["response"]


# ---- chat/completions ----------------------------------------------------------------------------

def chat_chunks(body: dict[str, Any], call: ToolCall | None, text: str) -> list[dict[str, Any]]:
    cid, model, now = _id("chatcmpl-"), body.get("model", "gpt"), int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None, usage: dict[str, Any] | None = None):
        c = {"id": cid, "object": "chat.completion.chunk", "created": now, "model": model,
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        if usage is not None:
            c["usage"] = usage
        return c

    out = [chunk({"role": "assistant", "content": ""})]
    if call is None:
        out.append(chunk({"content": text}))
        finish = "stop"
    else:
        out.append(chunk({"tool_calls": [{"index": 0, "id": _id("call_"), "type": "function",
                                          "function": {"name": call.name, "arguments": ""}}]}))
        out.append(chunk({"tool_calls": [{"index": 0, "function": {"arguments": json.dumps(call.args)}}]}))
        finish = "tool_calls"
    out.append(chunk({}, finish))
    if (body.get("stream_options") or {}).get("include_usage"):
        last = chunk({}, None, {"prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22})
        last["choices"] = []
        out.append(last)
    return out


def chat_whole(body: dict[str, Any], call: ToolCall | None, text: str) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": text if call is None else None}
    if call is not None:
        msg["tool_calls"] = [{"id": _id("call_"), "type": "function",
                              "function": {"name": call.name, "arguments": json.dumps(call.args)}}]
    return {"id": _id("chatcmpl-"), "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model", "gpt"),
            "choices": [{"index": 0, "message": msg, "logprobs": None,
                         "finish_reason": "stop" if call is None else "tool_calls"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22}}


# ---- Gemini --------------------------------------------------------------------------------------

def gemini_chunks(body: dict[str, Any], call: ToolCall | None, text: str, model: str) -> list[dict[str, Any]]:
    usage = {"promptTokenCount": 10, "candidatesTokenCount": 12, "totalTokenCount": 22}
    part = {"text": text} if call is None else {"functionCall": {"name": call.name, "args": call.args}}
    return [{"candidates": [{"content": {"role": "model", "parts": [part]}, "finishReason": "STOP",
                             "index": 0}],
             "usageMetadata": usage, "modelVersion": model, "responseId": _id("")}]


# ---- lean answers: the fewest events a stream can have, to find what a harness insists on ----------

def lean_anthropic(events: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """message_start, each block whole in its content_block_start (no deltas), message_delta, message_stop."""
    whole = anthropic_whole(events)
    out = [("message_start", {"type": "message_start", "message": dict(whole, content=[], stop_reason=None)})]
    for i, blk in enumerate(whole["content"]):
        out += [("content_block_start", {"type": "content_block_start", "index": i, "content_block": blk}),
                ("content_block_stop", {"type": "content_block_stop", "index": i})]
    return out + [e for e in events if e[0] in ("message_delta", "message_stop")]


def lean_responses(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """response.output_item.done and response.completed (and each item's output_item.added, --lean added)."""
    keep = ("response.output_item.done", "response.completed") + (
        ("response.output_item.added",) if LEAN == "added" else ())
    return [e for e in events if e["type"] in keep]


def lean_chat(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One chunk: role, the whole content or tool call, and finish_reason (then usage if asked)."""
    first = copy.deepcopy(chunks[0])
    delta = first["choices"][0]["delta"]
    for c in chunks[1:]:
        if not c["choices"]:
            continue
        d = c["choices"][0]["delta"]
        if "content" in d:
            delta["content"] = (delta.get("content") or "") + d["content"]
        for tc in d.get("tool_calls") or []:
            tcs = delta.setdefault("tool_calls", [])
            if tc.get("id"):
                tcs.append(copy.deepcopy(tc))
            else:
                tcs[-1]["function"]["arguments"] += tc["function"]["arguments"]
        if c["choices"][0].get("finish_reason"):
            first["choices"][0]["finish_reason"] = c["choices"][0]["finish_reason"]
    if "tool_calls" in delta:
        delta["content"] = None
    return [first] + [c for c in chunks if not c["choices"]]


LEAN: str | None = None  # --lean: None, "added" or "done"


# --------------------------------------------------------------------------------------------------
# one run of a harness (how each is run: lgt.testing.harnesses; which tool it is answered with:
# lgt.testing.harness_policy)
# --------------------------------------------------------------------------------------------------

@dataclass
class Run:
    """One harness run: where it runs and what it was answered."""
    harness: str
    profile: str
    place: Place
    tool_prefs: list[str]
    ws: str = "refuse"  # accept | refuse: what a WebSocket upgrade gets
    calls: list[dict[str, Any]] = field(default_factory=list)
    connects: dict[str, int] = field(default_factory=dict)
    proxy_auth_seen: set[str] = field(default_factory=set)
    tool_used: list[str] = field(default_factory=list)
    extra_env: dict[str, str | None] = field(default_factory=dict)

    @property
    def workdir(self) -> Path:
        return self.place.workdir

    @property
    def task(self) -> Task:
        return Task(WORD, "answer.txt", str(self.place.workdir))


# --------------------------------------------------------------------------------------------------
# the capturing, answering mitmproxy addon
# --------------------------------------------------------------------------------------------------

def redact_headers(headers) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in headers.items(multi=True) if hasattr(headers, "items") else headers:
        lk = k.lower()
        val = "<redacted>" if lk in SECRET_HEADERS or "api-key" in lk or "token" in lk else v
        out[k] = val if k not in out else out[k] + ", " + val
    return out


def redact_url(url: str) -> str:
    u = urlsplit(url)
    if not u.query:
        return url
    q = "&".join(f"{k}={'<redacted>' if k.lower() in SECRET_QUERY else v}"
                 for k, v in parse_qsl(u.query, True))
    return u._replace(query=q).geturl()


def body_of(raw: bytes | None, ctype: str) -> tuple[Any, int]:
    if not raw:
        return None, 0
    try:
        return json.loads(raw), len(raw)
    except ValueError:
        return raw.decode("utf-8", errors="replace"), len(raw)


TELEMETRY = [
    (r"^play\.googleapis\.com$", r"^/log"),  # Gemini CLI, qwen-code: Clearcut
    (r"(^|\.)chatgpt\.com$", r"/otlp/|/ces/|/analytics"),  # Codex: OpenTelemetry metrics
    (r"rum\.aliyuncs\.com$", r""),  # qwen-code: Alibaba RUM
    (r"^api\.anthropic\.com$", r"^/api/event_logging|^/api/eval/|metrics_enabled"),
    (r"statsig|sentry|datadoghq|segment\.io|posthog|honeycomb|mixpanel|amplitude", r""),
]


def _models_dev_model(mid: str, name: str, context: int, output: int) -> dict[str, Any]:
    return {"id": mid, "name": name, "family": mid.rsplit("-", 1)[0], "attachment": True, "reasoning": True,
            "tool_call": True, "structured_output": True, "temperature": False, "knowledge": "2025-09",
            "release_date": "2025-08-07", "last_updated": "2025-08-07",
            "modalities": {"input": ["text", "image"], "output": ["text"]}, "open_weights": False,
            "cost": {"input": 1.25, "output": 10, "cache_read": 0.125},
            "limit": {"context": context, "output": output}}


# what opencode reads from models.opencode.ai/api.json (the models.dev catalogue), cut to one provider
MODELS_DEV = {"openai": {
    "id": "openai", "name": "OpenAI", "env": ["OPENAI_API_KEY"], "npm": "@ai-sdk/openai",
    "doc": "https://platform.openai.com/docs/models",
    "models": {m["id"]: m for m in (_models_dev_model("gpt-5", "GPT-5", 400000, 128000),
                                    _models_dev_model("gpt-5.4-nano", "GPT-5.4 nano", 400000, 128000))}}}


def classify_other(host: str, path: str) -> str:
    for h, p in TELEMETRY:
        if re.search(h, host) and re.search(p, path):
            return "telemetry"
    if host == "api.anthropic.com" and path.startswith("/api/"):
        return "settings"
    if "plugins" in path or host == "api.github.com":
        return "plugin-sync"
    if host == "models.opencode.ai" or host == "models.dev":
        return "model-list"
    return "other"


class Answerer:
    """mitmproxy addon: records every request and WebSocket message of the current run, answers all."""

    def __init__(self) -> None:
        self.run: Run | None = None

    # -- helpers --
    def _record(self, entry: dict[str, Any]) -> dict[str, Any]:
        assert self.run is not None
        entry["seq"] = len(self.run.calls) + 1
        entry["t"] = round(time.time(), 3)
        self.run.calls.append(entry)
        return entry

    def http_connect(self, flow) -> None:
        if self.run is None:
            return
        host = f"{flow.request.host}:{flow.request.port}"
        self.run.connects[host] = self.run.connects.get(host, 0) + 1
        if "proxy-authorization" in flow.request.headers:
            self.run.proxy_auth_seen.add("connect")

    def requestheaders(self, flow) -> None:
        if self.run and "proxy-authorization" in flow.request.headers:
            self.run.proxy_auth_seen.add("http")

    def request(self, flow) -> None:
        from mitmproxy import http
        run = self.run
        req = flow.request
        raw = req.get_content(strict=False) or b""
        body, size = body_of(raw, req.headers.get("content-type", ""))
        entry = {"transport": "http", "method": req.method, "url": redact_url(req.pretty_url),
                 "host": req.pretty_host, "path": req.path.split("?", 1)[0],
                 "query": {k: ("<redacted>" if k.lower() in SECRET_QUERY else v)
                           for k, v in parse_qsl(urlsplit(req.path).query, True)},
                 "http_version": req.http_version,
                 "headers": redact_headers(req.headers),
                 "body_bytes": size, "body": body}
        if req.headers.get("content-encoding"):
            entry["wire_body_bytes"] = len(req.raw_content or b"")
        is_ws = req.headers.get("upgrade", "").lower() == "websocket"
        try:
            kind, status, headers, content, answer_note = self.answer(run, flow, body, is_ws)
        except Exception as e:  # a bug here must not hang the harness
            import traceback
            traceback.print_exc()
            kind, status, headers, answer_note = "error", 500, {"content-type": "application/json"}, {}
            content = json.dumps({"error": {"message": f"fixture proxy: {e}"}}).encode()
        entry["kind"] = kind
        if kind == "telemetry" and size > 4096:  # kept out of the fixtures: big and of no use to the proxy
            entry["body"] = {"omitted_bytes": size, "preview": raw[:300].decode(errors="replace")}
        if is_ws:
            entry["transport"] = "ws-upgrade"
        resp: dict[str, Any] = {"status": status, "headers": headers}
        ctype = headers.get("content-type", "")
        if "event-stream" in ctype:
            resp["events"] = parse_sse(content)
        elif content:
            resp["body"] = body_of(content, ctype)[0]
        resp.update(answer_note)
        entry["response"] = resp
        if run is not None:
            self._record(entry)
        flow.response = http.Response.make(status, content, headers)
        if is_ws and status == 101:
            flow.metadata["fixture_ws"] = entry

    def websocket_message(self, flow) -> None:
        from mitmproxy import ctx
        msg = flow.websocket.messages[-1]
        if not msg.from_client or msg.injected:
            return
        msg.drop()
        run = self.run
        text = msg.content.decode(errors="replace") if msg.is_text else None
        try:
            body = json.loads(text) if text is not None else None
        except ValueError:
            body = text
        entry = {"transport": "ws", "method": "WS", "url": redact_url(flow.request.pretty_url),
                 "host": flow.request.pretty_host, "path": flow.request.path.split("?", 1)[0],
                 "body_bytes": len(msg.content), "body": body}
        events: list[dict[str, Any]] = []
        kind = "ws-other"
        if isinstance(body, dict) and body.get("type") == "response.create":
            req = {k: v for k, v in body.items() if k != "type"}
            kind, events, note = self.responses_answer(run, req)
            entry.update(note)
        entry["kind"] = kind
        entry["response"] = {"ws_messages": events}
        if run is not None:
            self._record(entry)
        for e in events:
            ctx.master.commands.call("inject.websocket", flow, True, json.dumps(e).encode(), True)

    # -- routing --
    def answer(self, run: Run | None, flow, body: Any, is_ws: bool):
        req = flow.request
        host, path, method = req.pretty_host, req.path.split("?", 1)[0], req.method
        J = {"content-type": "application/json"}
        if is_ws:
            if run is not None and run.ws == "accept" and path.rstrip("/").endswith("/responses"):
                key = req.headers.get("sec-websocket-key", "")
                accept = base64.b64encode(hashlib.sha1(
                    (key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()).decode()
                return "ws-upgrade", 101, {"upgrade": "websocket", "connection": "Upgrade",
                                           "sec-websocket-accept": accept}, b"", {}
            status = int(run.ws.partition("=")[2] or 426) if run is not None else 426
            err = {"error": {"message": "websocket not offered here"}}
            return "ws-refused", status, J, json.dumps(err).encode(), {}
        if method == "POST" and isinstance(body, dict):
            if path.endswith("/v1/messages") or path.endswith("/messages") and "anthropic" in host:
                return self.messages(run, body)
            if path.endswith("/messages/count_tokens"):
                return "count-tokens", 200, J, json.dumps({"input_tokens": 1000}).encode(), {}
            if path.endswith("/responses"):
                kind, events, note = self.responses_answer(run, body)
                if body.get("stream"):
                    return kind, 200, {"content-type": "text/event-stream"}, \
                        sse([(e["type"], e) for e in events]), note
                return kind, 200, J, json.dumps(responses_whole(events)).encode(), note
            if path.endswith("/chat/completions"):
                return self.chat(run, body)
            m = re.search(r"/models/([^/:]+):(streamGenerateContent|generateContent|countTokens)$", path)
            if m:
                return self.gemini(run, body, m.group(1), m.group(2))
        if (method == "GET" and re.search(r"/(v1|v1beta|v1alpha)/models/?$", path)
                or path.endswith("/codex/models")):
            return "model-list", 200, J, json.dumps(self.model_list(host, path)).encode(), {}
        if method == "GET" and re.search(r"/(v1|v1beta)/models/[^/]+$", path):
            mid = path.rsplit("/", 1)[1]
            return "model-get", 200, J, json.dumps(self.model_one(host, mid)).encode(), {}
        if host == "registry.npmjs.org" and method == "GET":
            return self.npm(path)  # update checks; opencode also fetches @opencode-ai/plugin (answered 404)
        kind = classify_other(host, path)
        if host == "models.opencode.ai" and path.endswith("/api.json"):
            return kind, 200, J, json.dumps(MODELS_DEV).encode(), {}
        if kind == "settings" and path.endswith("/policy_limits"):
            return kind, 200, J, json.dumps({"restrictions": {}}).encode(), {}
        if kind == "settings" and path.endswith("/claude_code/settings"):
            return kind, 204, {}, b"", {}  # no managed settings
        if kind == "telemetry":
            return kind, 200, J, b"{}", {}
        return kind, 200, J, b"{}", {}

    # -- model lists --
    def model_list(self, host: str, path: str) -> dict[str, Any]:
        if path.endswith("/codex/models"):
            return {"models": []}
        if "anthropic" in host:
            ids = ["claude-sonnet-4-5", "claude-opus-4-1", "claude-haiku-4-5"]
            data = [{"type": "model", "id": i, "display_name": i, "created_at": "2026-01-01T00:00:00Z"}
                    for i in ids]
            return {"data": data, "has_more": False, "first_id": ids[0], "last_id": ids[-1]}
        if "googleapis" in host:
            ids = ["gemini-2.5-pro", "gemini-2.5-flash"]
            return {"models": [{"name": f"models/{i}", "displayName": i,
                                "supportedGenerationMethods": ["generateContent", "countTokens"]}
                               for i in ids]}
        ids = ["gpt-5", "gpt-4.1", "gpt-5-codex"]
        return {"object": "list", "data": [{"id": i, "object": "model", "created": 0, "owned_by": "openai"}
                                           for i in ids]}

    def model_one(self, host: str, mid: str) -> dict[str, Any]:
        if "anthropic" in host:
            return {"type": "model", "id": mid, "display_name": mid, "created_at": "2026-01-01T00:00:00Z"}
        return {"id": mid, "object": "model", "created": 0, "owned_by": "openai"}

    def npm(self, path: str):
        J = {"content-type": "application/json"}
        name = path.strip("/").split("/latest")[0].replace("%2f", "/").replace("%2F", "/")
        for pkg in PACKAGES.values():
            if name.startswith(pkg):
                ver = installed_version(pkg)
                one = {"name": pkg, "version": ver}
                doc = one if path.endswith("/latest") else {
                    "name": pkg, "dist-tags": {"latest": ver}, "versions": {ver: one}}
                return "update-check", 200, J, json.dumps(doc).encode(), {}
        return "package-fetch", 404, J, b'{"error":"Not found"}', {}

    # -- choosing the tool call --
    def choose(self, run: Run | None, api: str,
               body: dict[str, Any]) -> tuple[ToolCall | None, dict[str, Any]]:
        tools = offered_tools(api, body)
        note = {"tools_offered": [t["name"] if not t["namespace"] else f"{t['namespace']}.{t['name']}"
                                  for t in tools]}
        if run is None or not tools or has_tool_result(api, body):
            return None, note
        call = choose_call(tools, run.task, run.tool_prefs)
        if call is not None:
            run.tool_used.append(call.name)
            note["tool_call"] = {"name": call.name, "kind": call.kind, "args": call.args}
        return call, note

    def kind_of(self, api: str, body: dict[str, Any], call: ToolCall | None) -> str:
        if call is not None:
            return "main-tool-call"
        if has_tool_result(api, body):
            return "main-final"
        if offered_tools(api, body):
            return "main-text"
        return "side"

    # -- APIs --
    def messages(self, run: Run | None, body: dict[str, Any]):
        call, note = self.choose(run, "messages", body)
        kind = self.kind_of("messages", body, call)
        fmt = (body.get("output_config") or {}).get("format") or {}
        text = FINAL_TEXT
        if fmt.get("type") == "json_schema":
            text = json.dumps(fill_schema(fmt.get("schema"), SIDE_TEXT))
            kind = "title" if "title" in text else "side-json"
        events = anthropic_answer(body, call, text)
        if LEAN:
            events = lean_anthropic(events)
        if body.get("stream"):
            return kind, 200, {"content-type": "text/event-stream"}, sse(events), note
        return kind, 200, {"content-type": "application/json"}, \
            json.dumps(anthropic_whole(events)).encode(), note

    def responses_answer(self, run: Run | None, body: dict[str, Any]):
        if body.get("generate") is False:  # Codex warms the connection up: answered with no output
            note = {"tools_offered": [t["name"] for t in offered_tools("responses", body)]}
            return "prewarm", responses_events(body, None, None), note
        call, note = self.choose(run, "responses", body)
        kind = self.kind_of("responses", body, call)
        text = FINAL_TEXT
        fmt = (body.get("text") or {}).get("format") or {}
        if fmt.get("type") == "json_schema":
            text = json.dumps(fill_schema(fmt.get("schema"), SIDE_TEXT))
            kind = "side-json"
        events = responses_events(body, call, text)
        return kind, lean_responses(events) if LEAN else events, note

    def chat(self, run: Run | None, body: dict[str, Any]):
        call, note = self.choose(run, "chat", body)
        kind = self.kind_of("chat", body, call)
        if body.get("stream"):
            chunks = chat_chunks(body, call, FINAL_TEXT)
            if LEAN:
                chunks = lean_chat(chunks)
            return kind, 200, {"content-type": "text/event-stream"}, \
                sse([(None, c) for c in chunks] + [(None, "[DONE]")]), note
        return kind, 200, {"content-type": "application/json"}, \
            json.dumps(chat_whole(body, call, FINAL_TEXT)).encode(), note

    def gemini(self, run: Run | None, body: dict[str, Any], model: str, method: str):
        J = {"content-type": "application/json"}
        if method == "countTokens":
            return "count-tokens", 200, J, json.dumps({"totalTokens": 1000}).encode(), {}
        call, note = self.choose(run, "gemini", body)
        kind = self.kind_of("gemini", body, call)
        text = FINAL_TEXT
        gc = body.get("generationConfig") or {}
        if gc.get("responseMimeType") == "application/json":
            schema = gc.get("responseJsonSchema") or gc.get("responseSchema")
            text = json.dumps(fill_schema(schema, SIDE_TEXT))
            kind = "router" if "complexity_score" in json.dumps(schema) else "side-json"  # model routing
        chunks = gemini_chunks(body, call, text, model)
        if method == "streamGenerateContent":
            return kind, 200, {"content-type": "text/event-stream"}, sse([(None, c) for c in chunks]), note
        return kind, 200, J, json.dumps(chunks[0]).encode(), note


# --------------------------------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------------------------------

async def start_proxy(confdir: Path, addon: Answerer):
    from mitmproxy import options
    from mitmproxy.addons import core, disable_h2c, next_layer, proxyserver, tlsconfig
    from mitmproxy.master import Master

    opts = options.Options()
    master = Master(opts, with_termlog=False)
    master.addons.add(core.Core(), disable_h2c.DisableH2C(), proxyserver.Proxyserver(),
                      next_layer.NextLayer(), tlsconfig.TlsConfig())
    master.addons.add(addon)
    opts.update(mode=["regular@127.0.0.1:0"], confdir=str(confdir), connection_strategy="lazy",
                ssl_insecure=True)
    task = asyncio.create_task(master.run())
    ps = master.addons.get("proxyserver")
    for _ in range(500):
        if ps.servers and all(s.is_running for s in ps.servers):
            break
        await asyncio.sleep(0.01)
    port = next(iter(ps.servers)).listen_addrs[0][1]
    return master, task, port


def harness_env(run: Run, port: int, ca: Path, h: Harness) -> dict[str, str]:
    """The harness's environment (lgt.testing.harnesses.environment) with this script's proxy and CA."""
    proxy = f"http://{PROXY_USER}:{PROXY_PASS}@127.0.0.1:{port}"
    env = environment(h, run.place, {
        "HTTPS_PROXY": proxy, "HTTP_PROXY": proxy, "https_proxy": proxy, "http_proxy": proxy,
        "NO_PROXY": "", "no_proxy": "", "NODE_EXTRA_CA_CERTS": str(ca), "SSL_CERT_FILE": str(ca)})
    for k, v in run.extra_env.items():  # an experiment's extra variables; None unsets one
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v.replace("$CA", str(ca))
    return env


async def run_one(addon: Answerer, port: int, ca: Path, h: Harness, profile: str, base: Path,
                  timeout: float, extra_env: dict[str, str | None] | None = None,
                  extra_args: list[str] | None = None, ws: str | None = None) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"{h.name}-{profile}-", dir=base))
    run = Run(h.name, profile, Place(TASK, root / "work", root / "home"), list(h.tool_prefs), ws=ws or h.ws,
              extra_env=dict(extra_env or {}))
    prepare(h, run.place)
    env = harness_env(run, port, ca, h)
    argv = [*command(h, run.place), *(extra_args or [])]
    addon.run = run
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(*argv, cwd=run.workdir, env=env, stdin=subprocess.DEVNULL,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                start_new_session=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
        rc: int | None = proc.returncode
    except TimeoutError:
        signal_group(proc.pid, signal.SIGKILL)
        out, err = await proc.communicate()
        rc = None
    wall = time.monotonic() - t0
    await asyncio.sleep(0.2)
    addon.run = None
    answer = run.workdir / "answer.txt"
    content = answer.read_text(errors="replace") if answer.exists() else None
    return {"run": run, "harness": h, "argv": argv, "env": env, "rc": rc, "wall_s": round(wall, 2),
            "stdout": out.decode(errors="replace"), "stderr": err.decode(errors="replace"),
            "answer": content, "ok": rc == 0 and content is not None and WORD in content, "root": root}


SHORT = re.compile(r"[^a-z0-9]+")


def short_name(c: dict[str, Any]) -> str:
    host = c.get("host", "")
    tail = c.get("path", "").rstrip("/").rsplit("/", 1)[-1].split(":")[-1] or "root"
    parts = [c["kind"], c["transport"] if c["transport"] != "http" else "",
             host.split(".")[-2] if "." in host else host, tail]
    return SHORT.sub("-", "-".join(p for p in parts if p).lower()).strip("-")[:60]


def write_fixtures(res: dict[str, Any], out: Path) -> Path:
    run: Run = res["run"]
    h: Harness = res["harness"]
    d = out / (h.name if run.profile == "default" else f"{h.name}.{run.profile}")
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    files = []
    root = str(res["root"])

    def scrub(text: str) -> str:
        """The run's temporary root as $ROOT: as a path, without its leading slash, and as the slug
        Claude Code and qwen-code make of a project path (every non-alphanumeric character a dash)."""
        text = text.replace(root, "$ROOT").replace(root[1:], "$ROOT")
        for slug in {re.sub(r"[^A-Za-z0-9]", "-", root), re.sub(r"[^A-Za-z0-9_]", "-", root)}:
            text = text.replace(slug, "-$ROOT")
        return text

    for c in run.calls:
        note = c if c["transport"] == "ws" else (c.get("response") or {})  # where the answer's notes are
        name = f"{c['seq']:02d}-{short_name(c)}.json"
        text = scrub(json.dumps(c, indent=1, ensure_ascii=False))
        (d / name).write_text(text + "\n")
        files.append({"file": name, "seq": c["seq"], "kind": c["kind"], "transport": c["transport"],
                      "method": c["method"], "host": c.get("host"), "path": c.get("path"),
                      "query": c.get("query"), "body_bytes": c["body_bytes"],
                      "tools": len(note.get("tools_offered") or []),
                      "tool_call": (note.get("tool_call") or {}).get("name")})
    pkg = h.package
    manifest = {
        "harness": h.name, "profile": run.profile, "package": pkg, "version": installed_version(pkg),
        "command": [Path(res["argv"][0]).name, *res["argv"][1:]],
        "env_names": sorted(res["env"]),
        "env_values_harness": {k: ("<fake key>" if "KEY" in k else v.replace(root, "$ROOT"))
                               for k, v in h.env(run.place).items()},
        "config_files": {k.replace(root, "$ROOT"): v for k, v in h.files(run.place).items()},
        "notes": h.notes, "websocket": run.ws,
        "task": TASK, "exit_code": res["rc"], "wall_s": res["wall_s"],
        "answer_txt": res["answer"], "ok": res["ok"],
        "proxy_credentials_sent": sorted(run.proxy_auth_seen), "connects": run.connects,
        "calls": files,
        "stdout_tail": res["stdout"][-1500:].replace(root, "$ROOT"),
        "stderr_tail": res["stderr"][-1500:].replace(root, "$ROOT"),
        "recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (d / "manifest.json").write_text(scrub(json.dumps(manifest, indent=1, ensure_ascii=False)) + "\n")
    return d


def table(results: list[dict[str, Any]]) -> str:
    rows = [("harness", "profile", "version", "exit", "answer.txt", "calls", "main bytes (first)", "tool",
             "wall s")]
    for r in results:
        run = r["run"]
        mains = [c for c in run.calls if c["kind"].startswith("main")]
        rows.append((run.harness, run.profile, installed_version(PACKAGES[run.harness]), str(r["rc"]),
                     "PINEAPPLE" if r["ok"] or (r["answer"] and WORD in r["answer"]) else repr(r["answer"]),
                     str(len(run.calls)), str(mains[0]["body_bytes"]) if mains else "-",
                     ",".join(dict.fromkeys(run.tool_used)) or "-", str(r["wall_s"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)


def _quiet_cancelled(loop, context) -> None:
    """Connections still open when the proxy shuts down end in CancelledError: not worth a traceback."""
    if not isinstance(context.get("exception"), asyncio.CancelledError):
        loop.default_exception_handler(context)


async def main_async(args) -> int:
    asyncio.get_running_loop().set_exception_handler(_quiet_cancelled)
    base = Path(tempfile.mkdtemp(prefix="lgt-harness-"))
    confdir = base / "mitmproxy"
    addon = Answerer()
    master, task, port = await start_proxy(confdir, addon)
    ca = confdir / "mitmproxy-ca-cert.pem"
    results = []
    try:
        for name in args.harness:
            for profile in args.profile:
                h = HARNESSES[name].get(profile)
                if h is None:
                    continue
                print(f"-- {name} [{profile}] …", flush=True)
                res = await run_one(addon, port, ca, h, profile, base, args.timeout,
                                    {e.split("=", 1)[0]: (e.split("=", 1)[1] if "=" in e else None)
                                     for e in args.env}, args.arg, args.ws)
                results.append(res)
                if not args.no_write:
                    d = write_fixtures(res, Path(args.out))
                    where = d.relative_to(ROOT) if d.is_relative_to(ROOT) else d
                    print(f"   {len(res['run'].calls)} calls → {where}")
                if not res["ok"] or args.verbose:
                    print("   rc", res["rc"], "stdout:", res["stdout"][-800:],
                          "\n   stderr:", res["stderr"][-1500:])
    finally:
        master.shutdown()
        await asyncio.gather(task, return_exceptions=True)
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
        else:
            print("kept", base)
    print()
    print(table(results))
    return 0 if all(r["ok"] for r in results) else 1


# --------------------------------------------------------------------------------------------------
# refreshing the pinned versions
# --------------------------------------------------------------------------------------------------

def _platform_of(name: str) -> tuple[str | None, str | None, str | None]:
    n = name.rsplit("/", 1)[-1]
    os_ = "darwin" if "darwin" in n else "win32" if ("win32" in n or "windows" in n) else \
        "linux" if "linux" in n else None
    cpu = "arm64" if "arm64" in n else "x64" if "x64" in n else None
    libc = "musl" if "musl" in n else "glibc" if (os_ == "linux" and "gnu" in n) else None
    return os_, cpu, libc


def complete_lock(lock_path: Path) -> list[str]:
    """Add lock entries for platform packages the registry mirror here does not serve.

    A registry that lacks e.g. ``opencode-darwin-arm64`` makes npm leave it out of the lock, and then
    ``npm ci`` refuses the lock as out of sync. The entry npm would have written (version, os, cpu,
    optional) is added by hand; npm skips it on this platform and fetches it where it applies.
    """
    lock = json.loads(lock_path.read_text())
    pk = lock["packages"]
    added = []
    for path, e in list(pk.items()):
        for dep, ver in (e.get("optionalDependencies") or {}).items():
            p, found = path, False
            while True:
                if ((p + "/node_modules/") if p else "node_modules/") + dep in pk:
                    found = True
                    break
                if not p:
                    break
                i = p.rfind("/node_modules/")
                p = p[:i] if i >= 0 else ""
            if found:
                continue
            os_, cpu, libc = _platform_of(dep)
            if not (os_ and cpu):
                print(f"warning: {dep}@{ver} (optional dependency of {path}) is missing from the lock")
                continue
            ent: dict[str, Any] = {"version": ver, "optional": True, "os": [os_], "cpu": [cpu]}
            if libc:
                ent["libc"] = [libc]
            pk["node_modules/" + dep] = ent
            added.append(f"{dep}@{ver}")
    lock["packages"] = dict(sorted(pk.items(), key=lambda kv: (kv[0] != "", kv[0])))
    lock_path.write_text(json.dumps(lock, indent=2) + "\n")
    return added


def update_lock() -> int:
    """Pin each harness's newest version in the package.json that installs it (INSTALL_DIRS), rewrite
    those locks and install them."""
    for folder in sorted(set(INSTALL_DIRS.values())):
        pj = folder / "package.json"
        doc = json.loads(pj.read_text())
        for pkg in [PACKAGES[n] for n, d in INSTALL_DIRS.items() if d == folder]:
            v = subprocess.run(["npm", "view", pkg, "version"], capture_output=True, text=True,
                               check=True).stdout.strip()
            print(f"{pkg}: {doc['dependencies'].get(pkg)} → {v}")
            doc["dependencies"][pkg] = v
        doc["dependencies"] = dict(sorted(doc["dependencies"].items()))
        pj.write_text(json.dumps(doc, indent=2) + "\n")
        (folder / "package-lock.json").unlink(missing_ok=True)
        subprocess.run(["npm", "install", "--package-lock-only", "--no-audit", "--no-fund"], cwd=folder,
                       check=True)
        added = complete_lock(folder / "package-lock.json")
        if added:
            print("lock entries added for packages this registry does not serve:", ", ".join(added))
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=folder, check=True)
    return 0


def reexec_in_netns() -> None:
    """Run this script again in a network namespace of its own where only loopback is up."""
    if os.environ.get(NETNS_MARK) or not shutil.which("unshare"):
        return
    cmd = ["unshare", "-n"] + ([] if os.geteuid() == 0 else ["-r"]) + [
        "sh", "-c", 'ip link set lo up 2>/dev/null || true; exec "$@"', "sh", sys.executable, *sys.argv]
    env = dict(os.environ, **{NETNS_MARK: "1"})
    probe = subprocess.run(["unshare", "-n"] + ([] if os.geteuid() == 0 else ["-r"]) + ["true"],
                           capture_output=True)
    if probe.returncode != 0:
        print("warning: cannot make a network namespace (unshare -n); running in this one", file=sys.stderr)
        return
    os.execvpe(cmd[0], cmd, env)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--harness", default=",".join(HARNESSES), help="comma-separated: " + ", ".join(HARNESSES))
    ap.add_argument("--profile", default="default,minimal,http",
                    help="comma-separated profiles (default, minimal); fixtures of a non-default profile go "
                         "to <harness>.<profile>/")
    ap.add_argument("--out", default=str(FIXTURES))
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--no-write", action="store_true", help="run and check, write no fixtures")
    ap.add_argument("--keep", action="store_true", help="keep the work dirs and homes")
    ap.add_argument("--no-netns", action="store_true", help="do not isolate the run in a network namespace")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--env", action="append", default=[], metavar="K=V",
                    help="one more environment variable for the harness, K alone unsets one, $CA in V is the "
                         "proxy's CA file (experiments; repeatable)")
    ap.add_argument("--ws", help="accept: answer WebSocket upgrades; refuse[=STATUS]: refuse them (426 "
                    "unless STATUS is given), whatever the profile says")
    ap.add_argument("--arg", action="append", default=[],
                    help="one more argument for the harness (repeatable)")
    ap.add_argument("--lean", choices=("added", "done"),
                    help="answer streams with fewer events, to see what a harness insists on: no deltas "
                         "(Anthropic blocks whole in content_block_start, one chat chunk, Responses items "
                         "by output_item.added/.done only); 'done' drops Responses' output_item.added too")
    ap.add_argument("--update-lock", action="store_true",
                    help="pin the newest versions (in tests/harnesses and the examples that train "
                         "Claude Code, Codex and Gemini CLI), rewrite the locks, npm ci")
    args = ap.parse_args()
    if args.update_lock:
        return update_lock()
    global LEAN
    LEAN = args.lean
    args.harness = [h.strip() for h in args.harness.split(",") if h.strip()]
    args.profile = [p.strip() for p in args.profile.split(",") if p.strip()]
    bad = [h for h in args.harness if h not in HARNESSES]
    if bad:
        ap.error(f"unknown harness {', '.join(bad)} (known: {', '.join(HARNESSES)})")
    missing = sorted({str(INSTALL_DIRS[h]) for h in args.harness
                      if not (INSTALL_DIRS[h] / "node_modules" / ".bin").is_dir()})
    if missing:
        ap.error(f"harnesses not installed: run `bash scripts/setup_agent.sh {' '.join(missing)}`")
    if not args.no_netns:
        reexec_in_netns()
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
