"""Training samples with a real tokenizer: what the sample builder makes of the six harnesses' model calls
and the framework examples' when the policy is SmolLM2-135M-Instruct (a 49,152-token BPE) with lgt's
ChatML template with tools.

    .venv/bin/lgt-train make-model /tmp/smollm2 --from smollm2-135m-instruct    # once (30-80 s)
    .venv/bin/python bench/real_tokenizer.py --model /tmp/smollm2
    .venv/bin/python bench/real_tokenizer.py                 # imports SmolLM2 into a temp dir first
    .venv/bin/python bench/real_tokenizer.py --model /tmp/smollm2 --examples none --harness pi,codex

One rollout per harness and per example, each model call as vLLM and lgt-proxy would have recorded it:

- **the requests** are the agent's own: the harnesses' recorded in tests/fixtures/harnesses/*.minimal
  (the main calls: the task's tool call, then the final text after the tool result); the framework
  examples' made here by running each example agent, unmodified, in its own environment against a
  loopback server that answers as lgt-proxy in front of vLLM would (below). Each request is translated
  to chat/completions by the proxy's own functions (``lgt.proxy.dialects``; Codex's WebSocket prewarm
  folded in and its ``previous_response_id`` resolved from the conversation the proxy keeps, as
  ``proxy/wsbridge.py`` and ``proxy/addons/translate.py`` do);
- **prompt ids** are vLLM 0.32's rendering of that chat request, by its own code: its message parser
  (``vllm.renderers.chat_utils.parse_chat_messages``: tool-call arguments parsed into objects, a tool
  result's text parts joined) and ``safe_apply_chat_template`` with the model's template and the
  request's tools, tokenized without added special tokens, as a chat request is;
- **generated ids** are the canned answer (the fixture's tool call or final text; the examples'
  calculator call, then "The answer is 1081.") as the model writes it: a tool call as the template's
  hermes block ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, then ``<|im_end|>``;
  one distinct logprob per token. The agent's answer is vLLM's hermes parser's reading of that text
  (``Hermes2ProToolParser``) in the agent's API (the proxy's ``dialects.translator``).

The model writes its answers three ways (``WRITERS``): as the template writes them (JSON spaced as
``tojson`` spaces it, the tokenizer's canonical tokens); the tool call one character a token (the same
text in other tokens: a spelling a model may sample); the tool call's JSON compact
(``{"name":"Bash","arguments":{...}}``). The agents' requests are the same for all three: the parser
reads the same call from each.

The calls are written as ``calls`` rows of a real store (Parquet) and built with
``lgt.store.samples.build_samples`` in both modes with the model's tokenizer; every generated token is
checked to be trained exactly once, in order, with its recorded logprob (``ok``). Below the tables,
where each split's next prompt first leaves what was generated. Nothing here is a test; the tests of
these drifts are tests/trainer/test_real_tokenizer.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from lgt.proxy import dialects, wire

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "harnesses"
HARNESSES = ("claude_code", "codex", "gemini", "opencode", "pi", "qwen")
MAIN_CALLS = ("main-tool-call", "main-final")
EXAMPLES = {  # name → (interpreter, environment); the agents' own folders under examples/
    "calc": (sys.executable, {"OPENAI_BASE_URL": "{url}/v1", "OPENAI_API_KEY": "sk-agent-own-key"}),
    "agents_sdk": (".venv/bin/python", {"OPENAI_BASE_URL": "{url}/v1", "OPENAI_API_KEY": "sk-agent-own-key",
                                        "OPENAI_AGENTS_DISABLE_TRACING": "1"}),
    "langgraph": (".venv/bin/python", {"OPENAI_BASE_URL": "{url}/v1", "OPENAI_API_KEY": "sk-agent-own-key"}),
    "anthropic_sdk": (".venv/bin/python", {"ANTHROPIC_BASE_URL": "{url}",
                                           "ANTHROPIC_API_KEY": "sk-ant-agent-own-key"}),
}
QUESTION, ANSWER = "What is 23*47?", "1081"


# --- the engine's side: vLLM's rendering, its tool parser, the model's canned answers ---------------

class Engine:
    """What vLLM does with a chat request for this model (rendering, tool-call parsing), no engine run."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer
        from vllm.renderers.chat_utils import parse_chat_messages
        from vllm.renderers.hf import _detect_content_format, safe_apply_chat_template
        from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.eos = self.tok.convert_tokens_to_ids("<|im_end|>")
        template = self.tok.chat_template
        self._config = SimpleNamespace(multimodal_config=None, enable_prompt_embeds=False)  # text only
        self._format = _detect_content_format(template, default="string")
        self._parse, self._apply = parse_chat_messages, safe_apply_chat_template
        self._hermes = Hermes2ProToolParser(self.tok)

    def prompt_ids(self, chat: dict[str, Any]) -> list[int]:
        messages = json.loads(json.dumps(chat["messages"]))  # vLLM parses its own copy
        conversation, _, _ = self._parse(messages, self._config, self._format)
        text = self._apply(self._config, self.tok, conversation, tools=chat.get("tools"), chat_template=None,
                           tokenize=False, add_generation_prompt=True)
        return self.tok.encode(text, add_special_tokens=False)

    def chat_answer(self, text: str, n_prompt: int, n_generated: int, model: str) -> dict[str, Any]:
        """vLLM's chat completion for a generated text: its hermes parser's reading of it."""
        info = self._hermes.extract_tool_calls(text, None)
        msg: dict[str, Any] = {"role": "assistant", "content": info.content}
        if info.tools_called:
            msg["tool_calls"] = [{"id": f"chatcmpl-tool-{i}", "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for i, c in enumerate(info.tool_calls)]
        return {"id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": model,
                "choices": [{"index": 0, "message": msg, "logprobs": None,
                             "finish_reason": "tool_calls" if info.tools_called else "stop"}],
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_generated,
                          "total_tokens": n_prompt + n_generated}}


@dataclass(frozen=True)
class Answer:
    """What the policy answers a call: a text, or a tool call (after any text)."""

    text: str = ""
    tool: str | None = None
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Writer:
    """How the model writes an answer: its tool call's JSON (``separators``), and its tokens — the
    tokenizer's canonical ones, or the tool call one character a token (``by_character``: a spelling the
    model may sample; the next prompt spells the same text the canonical way)."""

    name: str
    separators: tuple[str, str] = (", ", ": ")  # json.dumps's, and the template's tojson
    by_character: bool = False

    def text(self, answer: Answer) -> tuple[str, str]:
        """(the text before a tool call, the tool call as a hermes block, or "")."""
        if answer.tool is None:
            return answer.text, ""
        call = json.dumps({"name": answer.tool, "arguments": answer.args}, ensure_ascii=False,
                          separators=self.separators)
        return answer.text, f"<tool_call>\n{call}\n</tool_call>"

    def ids(self, engine: Engine, answer: Answer) -> tuple[str, list[int]]:
        """(the generated text, its token ids + the end token)."""
        before, call = self.text(answer)
        enc = lambda t: engine.tok.encode(t, add_special_tokens=False)  # noqa: E731
        ids = enc(before) + ([i for ch in call for i in enc(ch)] if self.by_character else enc(call))
        return before + call, ids + [engine.eos]


WRITERS = (Writer("as the template writes it"),
           Writer("tool call spelled one character a token", by_character=True),
           Writer("tool call's JSON compact", separators=(",", ":")))


# --- a rollout: the agent's requests → the calls vLLM and the proxy would record --------------------

@dataclass
class Request:
    api: str  # chat/completions, responses, messages, gemini
    path: str
    body: dict[str, Any]
    prewarm: bool = False  # Codex's generate: false (answered by the proxy, no call recorded)


@dataclass
class Rollout:
    """The calls of one rollout as recorded, and what the proxy keeps between them."""

    engine: Engine
    writer: Writer = WRITERS[0]
    api: str = ""  # the agent's API
    steps: list[tuple[Request, str, Answer]] = field(default_factory=list)  # what was asked and answered
    calls: list[dict[str, Any]] = field(default_factory=list)
    prewarms: dict[str, dict[str, Any]] = field(default_factory=dict)  # response id → body
    conversations: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # response id → items

    def chat_request(self, r: Request) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the agent's request as the proxy resolves it, the chat request it sends the engine)."""
        if r.api == wire.CHAT:
            return r.body, r.body
        req = dialects.agent_request(r.api, r.path, r.body)
        prev = req.get("previous_response_id") if r.api == dialects.RESPONSES else None
        if prev in self.prewarms:  # proxy/wsbridge.py fold_prewarm: the prewarm's input first
            req = {k: v for k, v in req.items() if k != "previous_response_id"}
            req["input"] = [*_items(self.prewarms[prev].get("input")), *_items(req.get("input"))]
        elif prev is not None:  # proxy/addons/translate.py: the conversation it names, before its own
            req = dialects.with_history({k: v for k, v in req.items() if k != "previous_response_id"},
                                        self.conversations[prev])
        return req, dialects.to_chat(r.api, req, None, [])

    def call(self, r: Request, response_id: str, answer: Answer) -> dict[str, Any]:
        """Record the call (prompt ids, the model's tokens for ``answer``) and answer the agent as the
        proxy would; returns the agent's answer (a body in its API). A prewarm records nothing."""
        self.steps.append((r, response_id, answer))
        if r.prewarm:
            self.prewarms[response_id] = r.body
            return {}
        self.api = r.api
        req, chat = self.chat_request(r)
        prompt = self.engine.prompt_ids(chat)
        text, gen = self.writer.ids(self.engine, answer)
        reply = self.engine.chat_answer(text, len(prompt), len(gen), str(req.get("model") or "policy"))
        seq = len(self.calls)
        self.calls.append({"seq": seq, "status": "ok", "policy_version": seq,
                           "finish_reason": reply["choices"][0]["finish_reason"],
                           "prompt_token_ids": prompt, "response_token_ids": gen,
                           "response_logprobs": [-(seq + (k % 61 + 1) / 64) for k in range(len(gen))]})
        if r.api == wire.CHAT:
            return reply
        tr = dialects.translator(r.api, req, model=req.get("model"))
        cap = wire.Capture(wire.CHAT)
        cap.add_body(reply)
        body = tr.body(reply, cap)
        if r.api == dialects.RESPONSES:  # proxy/addons/record.py: what a previous_response_id continues
            self.conversations[response_id] = dialects.carried_history(req) + tr.history()
            body["id"] = response_id
        return body


    def replay(self, writer: Writer) -> Rollout:
        """The same requests answered the same way, the answers written by ``writer``. The agents'
        requests do not depend on it: the hermes parser reads the same calls from every writing."""
        again = Rollout(self.engine, writer)
        for step in self.steps:
            again.call(*step)
        return again


def _items(v: Any) -> list[Any]:
    if isinstance(v, str):
        return [{"role": "user", "content": v}]
    return list(v) if isinstance(v, list) else []


# --- the harnesses' recorded requests ---------------------------------------------------------------

def fixture_rollout(engine: Engine, name: str) -> Rollout:
    """One harness's minimal-profile rollout: its recorded main calls (and Codex's prewarm) in order."""
    folder = FIXTURES / f"{name}.minimal"
    rollout = Rollout(engine)
    for entry in json.loads((folder / "manifest.json").read_text())["calls"]:
        if entry["kind"] not in (*MAIN_CALLS, "prewarm"):
            continue
        c = json.loads((folder / entry["file"]).read_text())
        body = {k: v for k, v in c["body"].items() if k not in ("type", "generate")}
        query = "&".join(f"{k}={v}" for k, v in (c.get("query") or {}).items())
        path = c["path"] + (f"?{query}" if query else "")
        api = dialects.api_of("POST", path) or wire.endpoint_of("POST", path)
        r = Request(api, path, body, prewarm=entry["kind"] == "prewarm")
        rollout.call(r, _response_id(c["response"]), canned_answer(c))
    return rollout


def _response_id(response: dict[str, Any]) -> str:
    """The id the fixture proxy gave its answer (what the next request's previous_response_id names)."""
    for e in _events(response):
        rid = (e.get("response") or {}).get("id") if isinstance(e.get("response"), dict) else None
        if rid:
            return rid
    return ""


def _events(response: dict[str, Any]) -> list[dict[str, Any]]:
    out = [m for m in response.get("ws_messages") or () if isinstance(m, dict)]
    out += [e["data"] for e in response.get("events") or () if isinstance(e.get("data"), dict)]
    if isinstance(response.get("body"), dict):
        out.append(response["body"])
    return out


def canned_answer(fixture: dict[str, Any]) -> Answer:
    """What the fixture proxy answered: its tool call, or the text of its events (any of the APIs)."""
    response = fixture["response"]
    call = fixture.get("tool_call") or response.get("tool_call")
    if call:
        args = call["args"] if call.get("kind") != "custom" else {"input": call["args"]}
        return Answer(tool=call["name"], args=args)
    text = []
    for e in _events(response):
        delta = e.get("delta")
        if e.get("type") == "content_block_delta" and isinstance(delta, dict):
            text.append(delta.get("text") or "")  # Messages
        elif e.get("type") == "response.output_text.delta":
            text.append(e.get("delta") or "")  # Responses
        for cand in e.get("candidates") or ():  # Gemini
            text += [p.get("text", "") for p in (cand.get("content") or {}).get("parts") or ()]
        for choice in e.get("choices") or ():  # chat/completions
            text.append((choice.get("delta") or choice.get("message") or {}).get("content") or "")
    return Answer(text="".join(text))


# --- the framework examples, run against a loopback server that answers like the proxy + vLLM ------

def example_rollout(engine: Engine, name: str, timeout: float = 120) -> Rollout:
    """Run ``examples/<name>/agent.py`` unmodified; its first call is answered with a calculator call,
    the next with the final text (as the policy would answer them)."""
    python, env_template = EXAMPLES[name]
    rollout = Rollout(engine)
    errors: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))
            api = dialects.api_of("POST", self.path) or wire.endpoint_of("POST", self.path)
            try:
                if body.get("stream") or api is None:
                    what = "streaming" if api else "not an LLM call"
                    raise ValueError(f"{self.path}: {what} is not answered here")
                answer = (Answer(text=f"The answer is {ANSWER}.") if rollout.calls else
                          Answer(tool="calculator", args={"expression": QUESTION[8:-1]}))
                out = rollout.call(Request(api, self.path, body), f"resp_{len(rollout.calls)}", answer)
                status = 200
            except Exception as e:  # shown with the example's name; the agent sees a 400
                errors.append(f"{type(e).__name__}: {e}")
                out, status = {"error": {"message": str(e)}}, 400
            data = json.dumps(out).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env |= {k: v.format(url=url) for k, v in env_template.items()}
    env |= {"TASK_QUESTION": QUESTION, "TASK_ANSWER": ANSWER, "NO_PROXY": "127.0.0.1"}
    try:
        folder = ROOT / "examples" / name
        done = subprocess.run([python, "agent.py"], cwd=folder, env=env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    finally:
        server.shutdown()
        server.server_close()
    last = (done.stdout.strip().splitlines() or [""])[-1]
    if errors or done.returncode != 0 or '"reward": 1.0' not in last:
        raise RuntimeError(f"examples/{name} did not finish its task (exit {done.returncode}, {last!r}): "
                           f"{'; '.join(errors)} {done.stderr[-800:]}")
    return rollout


# --- samples ------------------------------------------------------------------------------------------

def measure(engine: Engine, name: str, rollout: Rollout, store: Path) -> dict[str, Any]:
    """Build the rollout's samples in both modes and check every generated token is trained once, in
    order, with its recorded logprob."""
    from lgt.store.query import connect
    from lgt.store.samples import build_samples
    from lgt.testing.samples import reward, write_store
    from lgt.testing.samples import rollout as rollout_row

    calls = [{"rollout_id": name, "attempt": 0, **c} for c in rollout.calls]
    con = connect(write_store(store, calls, [rollout_row(name)], [reward(name, 1.0)]))
    out: dict[str, Any] = {"name": name, "api": rollout.api, "calls": len(calls),
                           "prompt_tokens": [len(c["prompt_token_ids"]) for c in calls],
                           "generated": sum(len(c["response_token_ids"]) for c in calls),
                           "drift": drift(engine, calls)}
    want = [(t, lp) for c in calls for t, lp in zip(c["response_token_ids"], c["response_logprobs"])]
    for mode in ("exact", "realign"):
        b = build_samples(con, mode=mode, tokenizer=engine.tok)
        samples = sorted(b.samples.to_pylist(), key=lambda s: s["sample_index"])
        trained = [(t, lp) for s in samples
                   for t, lp, m in zip(s["input_ids"], s["behaviour_logprobs"], s["loss_mask"]) if m]
        out[mode] = {"samples": len(samples), "trained": len(trained), "ok": trained == want,
                     "breaks": dict(Counter(r["reason"] for r in b.merge_breaks.to_pylist())),
                     "realigned": b.report.get("realigned_merges", 0)}
    con.close()
    return out


def drift(engine: Engine, calls: list[dict[str, Any]]) -> list[tuple[int, str, str]]:
    """Where each call's prompt first leaves the previous call's prompt + generated tokens: (seq, what,
    the two texts there)."""
    dec = lambda ids: engine.tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    out = []
    for held, c in zip(calls, calls[1:]):
        ids = held["prompt_token_ids"] + held["response_token_ids"]
        if c["prompt_token_ids"][:len(ids)] == ids:
            continue
        a, b = dec(ids), dec(c["prompt_token_ids"])
        if b.startswith(a):
            out.append((c["seq"], "the same text in other tokens", ""))
            continue
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        out.append((c["seq"], "the text differs",
                    f"generated `{a[max(0, i - 24):i + 16]!r}`, next prompt `{b[max(0, i - 24):i + 16]!r}`"))
    return out


# --- output ------------------------------------------------------------------------------------------

def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def breaks(r: dict[str, Any], mode: str) -> str:
    return ", ".join(f"{k} {n}" for k, n in r[mode]["breaks"].items()) or "none"


def checked(r: dict[str, Any]) -> str:
    return "ok" if r["exact"]["ok"] and r["realign"]["ok"] else "**NOT ONCE**"


def main_row(r: dict[str, Any]) -> list[str]:
    return [r["name"], r["api"], str(r["calls"]), ", ".join(f"{n:,}" for n in r["prompt_tokens"]),
            f"{r['exact']['samples']} / {r['realign']['samples']}",
            f"{r['generated']} / {r['exact']['trained']} / {r['realign']['trained']} ({checked(r)})",
            breaks(r, "exact"), breaks(r, "realign"), str(r["realign"]["realigned"])]


def variant_row(writer: Writer, r: dict[str, Any]) -> list[str]:
    return [r["name"], writer.name, f"{r['exact']['samples']} / {r['realign']['samples']}",
            f"{r['generated']} / {r['exact']['trained']} / {r['realign']['trained']} ({checked(r)})",
            breaks(r, "exact"), breaks(r, "realign"), str(r["realign"]["realigned"])]


def model_dir(arg: str | None, base: Path) -> Path:
    if arg:
        return Path(arg)
    from lgt.trainer.make_model import MakeModel, import_model

    print("importing SmolLM2-135M-Instruct (pass --model DIR to reuse one) ...", file=sys.stderr)
    return import_model(MakeModel(pretrained="smollm2-135m-instruct"), base / "smollm2",
                        log=lambda line: None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a folder made by lgt-train make-model --from smollm2-135m-instruct")
    ap.add_argument("--harness", default=",".join(HARNESSES), help="harnesses (their minimal fixtures)")
    ap.add_argument("--examples", default=",".join(EXAMPLES), help="framework examples to run, or 'none'")
    args = ap.parse_args()
    names = [n for n in args.harness.split(",") if n]
    examples = [] if args.examples == "none" else [n for n in args.examples.split(",") if n]
    rollouts: list[tuple[str, Rollout]] = []
    skipped = []
    with tempfile.TemporaryDirectory(prefix="lgt-bench-real-tokenizer-") as tmp:
        base = Path(tmp)
        t0 = time.monotonic()
        engine = Engine(model_dir(args.model, base))
        rollouts += [(name, fixture_rollout(engine, name)) for name in names]
        for name in examples:
            python = EXAMPLES[name][0]
            if not (Path(python).is_absolute() or (ROOT / "examples" / name / python).exists()):
                skipped.append(f"examples/{name}: its environment is not built (bash scripts/setup_agent.sh "
                               f"examples/{name})")
                continue
            rollouts.append((f"examples/{name}", example_rollout(engine, name)))
        results = [[measure(engine, name, r if w is WRITERS[0] else r.replay(w), base / str(k) / name)
                    for name, r in rollouts] for k, w in enumerate(WRITERS)]
        took = time.monotonic() - t0
    print(f"Samples of one rollout each, SmolLM2-135M-Instruct's tokenizer and lgt's ChatML template with "
          f"tools as vLLM 0.32 renders them; the model writes its answers {WRITERS[0].name} ({took:.0f} s)\n")
    print(table(["rollout", "API", "calls", "prompt tokens", "samples exact / realign",
                 "generated / trained exact / realign", "breaks exact", "breaks realign", "realigned merges"],
                [main_row(r) for r in results[0]]))
    print("\nThe same rollouts, the model writing its tool calls otherwise\n")
    print(table(["rollout", "the model's tool call", "samples exact / realign",
                 "generated / trained exact / realign", "breaks exact", "breaks realign", "realigned merges"],
                [variant_row(w, r) for w, rs in zip(WRITERS[1:], results[1:]) for r in rs]))
    print("\nWhere a next prompt leaves what was generated:")
    for w, rs in zip(WRITERS, results):
        seen: dict[tuple[int, str], list[tuple[str, str]]] = {}
        for r in rs:
            for seq, what, where in r["drift"]:
                seen.setdefault((seq, what), []).append((r["name"], where))
        for (seq, what), found in seen.items():
            where = f"; {found[0][0]}: {found[0][1]}" if found[0][1] else ""
            print(f"- {w.name}, call {seq} of {', '.join(n for n, _ in found)}: {what}{where}")
    for s in skipped:
        print(f"- skipped {s}")
    return 0 if all(checked(r) == "ok" for rs in results for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
