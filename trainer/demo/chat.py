"""The demo models' chat format: ChatML with tools, rendered and parsed the way vLLM's ``hermes`` tool
parser reads it (a tool call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``)."""

from __future__ import annotations

import json
import re
from typing import Any

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)


# ChatML. With tools: a system block listing each tool's name/description/parameters (fields picked one by
# one, so extra keys a server adds, such as "strict": null, render the same), assistant tool calls as
# <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> (arguments as a JSON string or an object),
# and "tool" messages as their own turn. The generation prompt ends exactly where the reply begins.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}"
    "{%- set f = tool.function if tool.function is defined else tool %}"
    "{{- '\\n{\"name\": ' + (f.name | tojson) + ', \"description\": ' + (f.description | tojson)"
    " + ', \"parameters\": ' + (f.parameters | tojson) + '}' }}"
    "{%- endfor %}"
    "{{- '\\n</tools>\\nTo call a tool, reply <tool_call>\\n{\"name\": <name>, \"arguments\": <object>}"
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for call in (message.tool_calls or []) %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' }}"
    "{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """How the template renders one tool call (and so what the model is taught to emit)."""
    return f'{TOOL_CALL_START}\n{{"name": {json.dumps(name)}, "arguments": {json.dumps(arguments)}}}\n' \
           f'{TOOL_CALL_END}'


def parse_tool_call(text: str) -> dict[str, Any] | None:
    """The first ``<tool_call>{json}</tool_call>`` in ``text`` as ``{"name", "arguments"}``, or None.

    Parsed the way vLLM's hermes parser reads it (JSON between the tags, closing tag optional at the end).
    """
    m = re.search(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", text, re.DOTALL)
    if m is None:
        return None
    try:
        call = json.loads(m[1] if m[1] is not None else m[2])
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) \
            or not isinstance(call.get("arguments"), dict):
        return None
    return call
