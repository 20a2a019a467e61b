"""Tool calls read out of a reply's text the way the engine's tool parser reads them, for the calls the
proxy continues across a policy update (continuation.py).

A continued call's text comes from two engine requests (the chat request cut at the pause, then a
``/completions`` request that goes on from its token ids), and the engine's tool parser would only see
the second. So a continuable call that offers tools is sent to the engine with ``tool_choice: none``
(the prompt is the same: vLLM renders the tools whatever the choice) and the proxy parses the reply's
whole text itself, streamed or not, with the parser named by ``lgt-proxy --tool-parser`` — the one the
engine was started with (``--tool-call-parser``). Only ``hermes`` is known (``<tool_call>{json}
</tool_call>``: Hermes, Qwen2.5, SmolLM2 and lgt's demo models); a call offering tools to a proxy
without ``--tool-parser`` is drained at a pause as before.

:class:`Hermes` follows vLLM 0.32's ``Hermes2ProToolParser``: the same regular expressions, the same
text held back while it could be the start of a tag, the same argument text streamed (the raw JSON of
``arguments`` as the model wrote it) and, for a whole answer, the same ``json.dumps`` of the parsed
arguments and the same content (the text before the first tag, ``None`` when blank).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

START, END = "<tool_call>", "</tool_call>"
WHOLE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


def tool_call_id() -> str:
    """A tool call's id, as vLLM makes one."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def overlap(text: str, tag: str) -> int:
    """The length of the longest start of ``tag`` that ``text`` ends with (shorter than the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _complete(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


class Hermes:
    """One reply's parse: :meth:`stream` for each new piece of a streamed reply, :meth:`whole` for a
    reply answered whole."""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel  # False: the request's parallel_tool_calls false keeps only the first
        self.sent_content = 0  # characters of the text sent as content
        self.names: list[str | None] = []  # each tool call's name once sent
        self.args: list[str] = []  # each tool call's argument text sent so far
        self.called = False  # a tool call's name was streamed (the finish reason becomes tool_calls)

    # -- a streamed reply ---------------------------------------------------------------------------
    def stream(self, text: str, finished: bool = False) -> dict[str, Any] | None:
        """The delta to send now that the reply's text is ``text`` (all of it so far): content not yet
        sent, tool calls' names and argument text not yet sent; None when there is nothing new.
        ``finished``: the reply's last chunk (the engine then completes the last call's arguments)."""
        content = self._content(text)
        calls: list[dict[str, Any]] = []
        for i, (body, complete) in enumerate(self._bodies(text)):
            if i >= len(self.names):
                self.names.append(None)
                self.args.append("")
            if self.names[i] is None:
                m = NAME.search(body)
                if m is None:
                    break  # a later call cannot start before this one's name
                self.names[i] = m.group(1)
                calls.append({"id": tool_call_id(), "type": "function", "index": i,
                              "function": {"name": m.group(1)}})
            args = self._arguments(body, complete)
            if args is not None and len(args) > len(self.args[i]):
                calls.append({"index": i, "function": {"arguments": args[len(self.args[i]):]}})
                self.args[i] = args
        if finished and calls and "function" in calls[-1]:
            # vLLM completes the last call's arguments at the end: "{}" when none were ever sent
            fn = calls[-1]["function"]
            fn["arguments"] = fn.get("arguments", "") + ("" if self.args[-1] else "{}")
        if not self.parallel:
            calls = [c for c in calls if c["index"] == 0]
        if calls:
            self.called = True
        if not content and not calls:
            return None
        return {"content": content, "tool_calls": calls}

    def _content(self, text: str) -> str | None:
        at = text.find(START)
        end = len(text) - overlap(text, START) if at < 0 else at
        if end <= self.sent_content:
            return None
        out, self.sent_content = text[self.sent_content:end], end
        return out

    @staticmethod
    def _bodies(text: str) -> list[tuple[str, bool]]:
        """Each tool call's JSON text so far, and whether it is whole."""
        out: list[tuple[str, bool]] = []
        pos = 0
        while (start := text.find(START, pos)) >= 0:
            begin = start + len(START)
            end = text.find(END, begin)
            if end >= 0:
                out.append((text[begin:end].strip(), True))
                pos = end + len(END)
                continue
            raw = text[begin:]
            cut = overlap(raw, END)
            body = (raw[:-cut] if cut else raw).strip()
            out.append((body, _complete(body) if body else False))
            break
        return out

    @staticmethod
    def _arguments(body: str, complete: bool) -> str | None:
        m = ARGUMENTS.search(body)
        if m is None:
            return None
        raw = body[m.end():]
        if complete:
            raw = raw.rstrip()
            if raw.endswith("}"):
                raw = raw[:-1].rstrip()
        return raw

    # -- a whole reply ------------------------------------------------------------------------------
    def whole(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of a reply answered whole; text with a tool call that is not JSON is
        all content, as the engine answers it."""
        if START not in text:
            return text, []
        try:
            calls = []
            for a, b in WHOLE.findall(text):
                call = json.loads(a or b)
                calls.append({"id": tool_call_id(), "type": "function",
                              "function": {"name": call["name"],
                                           "arguments": json.dumps(call["arguments"], ensure_ascii=False)}})
        except (ValueError, KeyError, TypeError):
            return text, []
        content = text[: text.find(START)]
        if not self.parallel:
            calls = calls[:1]
        return (content if content.strip() else None), calls


PARSERS = {"hermes": Hermes}
