"""A scripted policy that answers real coding-agent harnesses like a model doing one small task.

The task is one sentence a person would type, and the policy reads its target from it:
"Write the word PINEAPPLE into the file answer.txt in the current directory." (or a path). Given a
chat/completions request — messages and tools as ``lgt-proxy`` sends them to the engine — it answers:

- the first call of the task → one call of the harness's own write or shell tool, picked from the tools
  offered by name and JSON schema (``Write``/``Bash``, ``write_file``/``run_shell_command``,
  ``write``/``bash``/``apply_patch``, ``exec_command``/``shell``, Codex's freeform ``exec`` whose input
  is JavaScript calling ``tools.exec_command``), its arguments filled from the tool's schema (an absolute
  path where the harness says where it runs: "Primary working directory: …", ``<cwd>…</cwd>``);
- after a tool result → a short final text;
- a side call (a title, Gemini's model router) → valid JSON for the schema asked in
  ``response_format``, or a short text.

``ScriptedPolicy(command=...)`` plays a model that runs one exact shell command instead, whatever the
task says (a fix, for a task that names no word and no file): its first answer a call of the harness's
shell tool with that command, then the same short final text.

``ScriptedPolicy`` is the fake engine's reply hook (``FakeUpstream(reply=ScriptedPolicy())``, or
``python -m lgt.testing.fake_upstream --script lgt.testing.harness_policy:reply``) and remembers what it
answered. The tool-picking functions also read the providers' own request shapes (Anthropic Messages,
Responses, Gemini), for ``scripts/harness_fixtures.py``, which answers the harnesses itself.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

Json = dict[str, Any]

_WORD, _FILE = r"(?P<word>[^\s\"'`<>]*[^\s\"'`<>.,;:!?])", r"(?P<file>[\w./~+@-]*\w)"
# the task's sentence, in task_text's words and the other ways examples/write_a_word says it
TASK_WORDS = tuple(re.compile(p, re.IGNORECASE) for p in (
    rf"write the word {_WORD} into the file {_FILE}",
    rf"create {_FILE} in the current directory containing just the word {_WORD}",
    rf"put the word {_WORD} in a file named {_FILE}"))
# where a harness's prompt says it runs (Claude Code, Codex, qwen-code, Gemini CLI, opencode, pi)
WORKDIR = re.compile(r"(?:Primary working directory:|<cwd>|currently working in the directory:"
                     r"|Workspace Directories:\**\s*-|Working directory:|Current working directory:)"
                     r"\s*(/[^\s<\"'`*]*)")
# every harness's write and shell tools, by name; a tool not named here is still used when its schema
# says it writes a file (a path and a content) or runs a command
DEFAULT_PREFS = ("Write", "write_file", "write", "Bash", "run_shell_command", "bash", "exec_command",
                 "shell", "shell_command", "apply_patch", "exec")
SHELL_TOOLS = ("Bash", "run_shell_command", "bash", "exec_command", "shell", "shell_command", "exec")
FREEFORM = ("exec", "apply_patch")  # Codex's grammar tools: their input is a raw string, not JSON
TOOL_RESULTS = {"messages": ("tool_result",),
                "responses": ("function_call_output", "custom_tool_call_output", "local_shell_call_output",
                              "tool_search_output")}


def task_text(word: str, file: str) -> str:
    """The task as a person would type it: a bare name means the harness's current directory."""
    where = "" if file.startswith("/") else " in the current directory"
    return f"Write the word {word} into the file {file}{where}."


@dataclass(frozen=True)
class Task:
    """What the task asks: ``word`` into ``file`` (as the task names it), ``workdir`` where the harness
    runs when its prompt says so; or, given ``command``, that shell command run as it is."""

    word: str
    file: str
    workdir: str | None = None
    command: str | None = None

    @property
    def path(self) -> str:
        """The file's absolute path when it can be known, else the name the task gave."""
        if self.file.startswith("/") or not self.workdir:
            return self.file
        return str(PurePosixPath(self.workdir) / self.file)

    @property
    def shell(self) -> str:
        return self.command or f"echo {shlex.quote(self.word)} > {shlex.quote(self.file)}"

    @property
    def title(self) -> str:
        return f"Run {self.command.split()[0]}" if self.command else f"Write {self.word} into {self.file}"

    @property
    def patch(self) -> str:
        return f"*** Begin Patch\n*** Add File: {self.file}\n+{self.word}\n*** End Patch\n"

    @property
    def javascript(self) -> str:
        """Codex's freeform ``exec`` tool takes JavaScript that calls its nested tools."""
        return (f"const r = await tools.exec_command({{cmd: {json.dumps(self.shell)}}});\n"
                "text(JSON.stringify(r));\n")

    @property
    def final_text(self) -> str:
        return "Done: the command ran." if self.command else f"Done: {self.file} now holds {self.word}."


def find_task(texts: Iterable[str]) -> Task | None:
    """The task named in ``texts`` (the last one that names one), with the work dir if one is named."""
    texts = list(texts)
    found = None
    for t in texts:
        last = max((m for pattern in TASK_WORDS for m in pattern.finditer(t)), key=lambda m: m.start(),
                   default=None)
        found = last or found
    if found is None:
        return None
    workdir = next((m.group(1).rstrip(".,;:") for t in texts for m in WORKDIR.finditer(t)), None)
    return Task(found.group("word"), found.group("file"), workdir)


# --------------------------------------------------------------------------------------------------
# reading requests: the tools offered, whether a tool's result came back (chat and providers' shapes)
# --------------------------------------------------------------------------------------------------

@dataclass
class ToolCall:
    name: str
    args: dict[str, Any] | str  # str: a freeform (custom) tool's raw input
    kind: str = "function"  # function | custom
    namespace: str | None = None


def _props(schema: Any) -> dict[str, Any]:
    return (schema.get("properties") or {}) if isinstance(schema, dict) else {}


def has_tool_result(api: str, body: Json) -> bool:
    """Whether the conversation already holds a tool's result (``api``: chat, messages, responses,
    gemini)."""
    if api == "messages":
        return any(isinstance(b, dict) and b.get("type") == "tool_result"
                   for m in body.get("messages") or [] if isinstance(m.get("content"), list)
                   for b in m["content"])
    if api == "responses":
        inp = body.get("input")
        return isinstance(inp, list) and any(isinstance(i, dict) and i.get("type") in TOOL_RESULTS[api]
                                             for i in inp)
    if api == "gemini":
        return any(isinstance(p, dict) and "functionResponse" in p
                   for c in body.get("contents") or [] for p in c.get("parts") or [])
    return any(isinstance(m, dict) and m.get("role") == "tool" for m in body.get("messages") or [])


def offered_tools(api: str, body: Json) -> list[Json]:
    """[{name, kind, schema, namespace, description}] of every tool the request offers (namespaces
    flattened; Codex's ``additional_tools`` input items included)."""
    out: list[Json] = []

    def add_openai(t: Json, ns: str | None = None) -> None:
        typ = t.get("type")
        if typ == "namespace":
            for sub in t.get("tools") or []:
                add_openai(sub, t.get("name"))
        elif typ == "function":
            f = t.get("function") if isinstance(t.get("function"), dict) else t
            out.append({"name": f.get("name"), "kind": "function", "schema": f.get("parameters") or {},
                        "namespace": ns, "description": f.get("description") or ""})
        elif typ == "custom":
            out.append({"name": t.get("name"), "kind": "custom", "schema": t.get("format"), "namespace": ns,
                        "description": t.get("description") or ""})
        else:
            out.append({"name": t.get("name") or typ, "kind": typ, "schema": {}, "namespace": ns,
                        "description": ""})

    if api == "messages":
        for t in body.get("tools") or []:
            typ = t.get("type") or "custom"  # Anthropic's "custom" is a plain JSON-schema tool
            out.append({"name": t.get("name"), "kind": "function" if typ == "custom" else typ,
                        "schema": t.get("input_schema") or {}, "namespace": None,
                        "description": t.get("description") or ""})
    elif api == "gemini":
        for t in body.get("tools") or []:
            for f in t.get("functionDeclarations") or t.get("function_declarations") or []:
                out.append({"name": f.get("name"), "kind": "function",
                            "schema": f.get("parameters") or f.get("parametersJsonSchema") or {},
                            "namespace": None, "description": f.get("description") or ""})
    else:
        for t in body.get("tools") or []:
            add_openai(t)
        inp = body.get("input") if api == "responses" else None
        for item in inp if isinstance(inp, list) else []:  # Codex: tools as an input item
            if isinstance(item, dict) and item.get("type") == "additional_tools":
                for t in item.get("tools") or []:
                    add_openai(t)
    return out


# --------------------------------------------------------------------------------------------------
# answering: a tool's arguments, JSON for a schema, the tool call itself
# --------------------------------------------------------------------------------------------------

def base_name(name: str) -> str:
    """A tool's own name without a namespace a translation may have put in front (``functions.exec``,
    ``functions__exec``)."""
    return re.split(r"\.|__|:|/", name)[-1] if name else name


def tool_args(name: str, schema: Any, task: Task) -> dict[str, Any]:
    """Arguments for a write or shell tool, from its JSON schema's property names."""
    props = _props(schema)
    low = {k.lower(): k for k in props}
    if "patch" in name.lower():  # apply_patch: one string property takes the whole patch
        key = next((k for k in props if "patch" in k.lower() or k.lower() == "input"),
                   next(iter(props), "input"))
        return {key: task.patch}
    args: dict[str, Any] = {}
    path_key = next((low[k] for k in ("file_path", "filepath", "absolute_path", "path", "file", "filename")
                     if k in low), None)
    content_key = next((low[k] for k in ("content", "contents", "text", "file_text", "data") if k in low),
                       None)
    cmd_key = next((low[k] for k in ("command", "cmd", "commands", "script") if k in low), None)
    if path_key and content_key and not task.command:
        args[path_key] = task.path
        args[content_key] = task.word + "\n"
    elif cmd_key:
        typ = (props[cmd_key] or {}).get("type")
        args[cmd_key] = ["bash", "-lc", task.shell] if typ == "array" else task.shell
    else:
        args["command"] = task.shell
    required = schema.get("required") if isinstance(schema, dict) else None
    for req in required if isinstance(required, list) else []:
        if req in args:
            continue
        p = props.get(req) or {}
        if req.lower() == "description":
            args[req] = task.title
        elif req.lower() in ("workdir", "cwd", "directory", "dir_path", "directory_path"):
            args[req] = task.workdir or "."
        elif p.get("type") == "boolean":
            args[req] = False
        elif p.get("type") in ("integer", "number"):
            args[req] = 10000 if "timeout" in req.lower() else 1
        elif p.get("type") == "array":
            args[req] = []
        else:
            args[req] = ""
    return args


def fill_schema(schema: Any, text: str = "ok") -> Any:
    """A value that satisfies a (simple) JSON schema: for side calls asked for structured output."""
    if not isinstance(schema, dict):
        return text
    t = schema.get("type")
    t = (t[0] if isinstance(t, list) and t else t or "").lower()  # Gemini writes OBJECT, STRING, INTEGER
    if "enum" in schema:
        return schema["enum"][0]
    if t == "object" or "properties" in schema:
        return {k: fill_schema(v, text) for k, v in _props(schema).items()}
    if t == "array":
        return []
    if t == "boolean":
        return False
    if t in ("integer", "number"):
        return schema.get("minimum", 1)
    return text


def freeform_input(name: str, task: Task) -> str:
    """The raw input of a freeform tool: a patch for ``apply_patch``, JavaScript for Codex's ``exec``."""
    return task.patch if "patch" in name.lower() else task.javascript


def _is_write_or_shell(tool: Json) -> bool:
    props = {k.lower() for k in _props(tool["schema"])}
    writes = props & {"file_path", "filepath", "absolute_path", "path"} and props & {"content", "contents",
                                                                                      "file_text"}
    return bool(writes or props & {"command", "cmd"})


def choose_call(tools: list[Json], task: Task, prefs: Iterable[str] = DEFAULT_PREFS,
                custom_input: Callable[[Json, Task], str] | None = None) -> ToolCall | None:
    """The call of the first tool in ``prefs`` that is offered (by its own name), else of the first
    tool whose schema writes a file or runs a command; None if there is none."""
    by_name: dict[str, Json] = {}
    for t in tools:
        by_name.setdefault(t["name"], t)
        by_name.setdefault(base_name(t["name"] or ""), t)
    tool = next((by_name[p] for p in prefs if p in by_name), None)
    if tool is None:
        tool = next((t for t in tools if t["kind"] == "function" and _is_write_or_shell(t)), None)
    if tool is None:
        return None
    name = tool["name"]
    if tool["kind"] == "custom":
        raw = custom_input(tool, task) if custom_input else freeform_input(name, task)
        return ToolCall(name, raw, "custom", tool["namespace"])
    props = _props(tool["schema"])
    if base_name(name) in FREEFORM and not ({k.lower() for k in props} & {"cmd", "command", "patch"}):
        # a freeform tool offered to the engine as a function: its raw input in the one string it takes
        key = next(iter(props), "input")
        return ToolCall(name, {key: freeform_input(base_name(name), task)}, "function", tool["namespace"])
    return ToolCall(name, tool_args(name, tool["schema"], task), "function", tool["namespace"])


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and
                         isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


def response_schema(body: Json) -> Any:
    """The JSON schema a chat request asks its answer to follow (``response_format``), or None."""
    fmt = body.get("response_format")
    if not isinstance(fmt, dict):
        return None
    if fmt.get("type") == "json_schema":
        return (fmt.get("json_schema") or {}).get("schema") or {}
    if fmt.get("type") == "json_object":
        return {}
    return None


@dataclass
class Answer:
    """One answer of the scripted policy: ``kind`` (tool-call, final, json, text), what it answered
    (text, or a (name, arguments JSON) tool call) and the request it answered."""

    kind: str
    reply: str | tuple[str, str]
    request: Json


class ScriptedPolicy:
    """The fake engine's reply hook: answers a chat request as a model doing the task it names.

    ``answers`` lists what it answered, in order; ``prefs`` orders the tools it prefers by name;
    ``command`` (None: the task's own), when set, is the shell command it runs for any task a user gives,
    by the first of ``prefs`` that is a shell tool (it may be changed between conversations)."""

    def __init__(self, prefs: Iterable[str] = DEFAULT_PREFS, command: str | None = None) -> None:
        self.prefs = tuple(prefs)
        self.command = command
        self.answers: list[Answer] = []

    def __call__(self, body: Json) -> str | tuple[str, str]:
        answer = self.answer(body)
        self.answers.append(answer)
        return answer.reply

    def answer(self, body: Json) -> Answer:
        messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
        task = find_task(_text(m.get("content")) for m in messages if m.get("role") in ("system", "user",
                                                                                         "developer"))
        prefs = self.prefs
        if self.command is not None and any(m.get("role") == "user" for m in messages):
            task = Task("", "", None, self.command)
            prefs = tuple(p for p in self.prefs if p in SHELL_TOOLS)
        schema = response_schema(body)
        if schema is not None:
            return Answer("json", json.dumps(fill_schema(schema, task.title if task else "ok")), body)
        if task is None:
            return Answer("text", "OK.", body)
        if has_tool_result("chat", body):
            return Answer("final", task.final_text, body)
        tools = offered_tools("chat", body) if body.get("tool_choice") != "none" else []
        call = choose_call(tools, task, prefs)
        if call is None:
            return Answer("text", task.title, body)
        args = call.args if isinstance(call.args, str) else json.dumps(call.args)
        return Answer("tool-call", (call.name, args), body)


# for `python -m lgt.testing.fake_upstream --script lgt.testing.harness_policy:reply`
reply = ScriptedPolicy()
