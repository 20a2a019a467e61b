"""Real coding-agent harnesses, unmodified, doing a tool-using task through the real ``lgt-proxy``.

Claude Code, Codex CLI, Gemini CLI, qwen-code, opencode and pi (the versions pinned in
tests/harnesses, ``npm ci`` there) each get one task — "Write the word W into the file F" — with only
their own flags, environment and config files (``lgt.testing.harnesses``, the description the fixture
script uses too) plus the rollout's environment from ``lgt.proxy.auth.rollout_env`` (``HTTPS_PROXY``
with its credentials, the CA variables). They aim at their default hosted APIs; one ``lgt-proxy``
(``--egress deny``: nothing else leaves) routes their model calls to one scripted engine — the fake
vLLM answering with ``lgt.testing.harness_policy``: a call of the harness's own write or shell tool, then a
short final text. Each run must exit 0 with the file holding the word, and every call that reached the
engine must be a row: ``ok``, ``capture = full``, the prompt and response token ids (and logprobs)
the engine produced, ``api`` the harness's API; no ``rejected`` row; the egress table lists what the
proxy blocked.

The default profile uses a bare file name (the harness's prompt says where it runs); the minimal one,
which leaves that context out, names the file by its absolute path.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from lgt.testing import harnesses
from lgt.testing.clients import post_direct
from lgt.testing.fake_upstream import (
    FakeUpstream,
    generate,
    load_script,
    render_chat,
    render_tool_call,
    token_logprob,
    tokenize,
)
from lgt.testing.harness_policy import (
    Answer,
    ScriptedPolicy,
    Task,
    choose_call,
    find_task,
    offered_tools,
    task_text,
)
from lgt.testing.proxy import ProxyProc

TIMEOUT_S = 180
CASES = [(name, profile) for name in harnesses.HARNESSES for profile in ("default", "minimal")]
ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "harnesses"
WRITE = {"type": "function", "function": {"name": "Write", "description": "Write a file.", "parameters": {
    "type": "object", "properties": {"file_path": {"type": "string"}, "content": {"type": "string"}},
    "required": ["file_path", "content"]}}}


# --- the scripted policy alone -------------------------------------------------------------------------

def test_task_and_workdir_from_the_prompt() -> None:
    system = "Here is useful information about the environment:\n - Primary working directory: /w/x\n"
    task = find_task([system, "<system-reminder>…</system-reminder>", task_text("MANGO", "a.txt")])
    assert task == Task("MANGO", "a.txt", "/w/x") and task.path == "/w/x/a.txt"
    assert find_task([task_text("MANGO", "/abs/b.txt")]).path == "/abs/b.txt"
    assert find_task(["Generate a title for this conversation."]) is None


def test_every_phrasing_of_the_write_a_word_tasks() -> None:
    lines = (ROOT / "examples/write_a_word/tasks.jsonl").read_text().splitlines()
    tasks = [json.loads(line) for line in lines]
    assert len({t["prompt"].split(t["word"])[0] for t in tasks}) > 3  # the three phrasings, several files
    for t in tasks:
        assert find_task(["You are a coding agent.", t["prompt"]]) == Task(t["word"], t["file"]), t["prompt"]
    shouted = find_task(["Create out.txt in the current directory containing just the word KIWI!"])
    assert shouted == Task("KIWI", "out.txt")


def test_the_fake_engine_loads_the_policy_by_name() -> None:  # python -m lgt.testing.fake_upstream --script
    assert isinstance(load_script("lgt.testing.harness_policy:reply"), ScriptedPolicy)


@pytest.mark.parametrize("d", sorted(p.parent for p in FIXTURES.glob("*/manifest.json")),
                         ids=lambda d: d.name)
def test_policy_picks_the_tool_the_fixture_called(d: Path) -> None:
    """On the tools each real harness offered (recorded in its own API), the policy's choice is the call
    that did the task when the fixtures were recorded."""
    m = json.loads((d / "manifest.json").read_text())
    entry = next(c for c in m["calls"] if c["kind"] == "main-tool-call")
    call = json.loads((d / entry["file"]).read_text())
    api = {"messages": "messages", "responses": "responses"}.get(call["path"].rsplit("/", 1)[-1],
                                                                  "gemini" if ":" in call["path"] else "chat")
    got = choose_call(offered_tools(api, call["body"]), Task("PINEAPPLE", "answer.txt", "/w"))
    assert got is not None and got.name == entry["tool_call"]


def test_scripted_engine_answers_like_a_model(engine: FakeUpstream, policy: ScriptedPolicy) -> None:
    """Through the fake engine's reply hook: a tool call (vLLM's wire format, token ids of its hermes
    rendering), then a final text after the tool's result; JSON for a schema asked."""
    messages = [{"role": "system", "content": "Primary working directory: /w"},
                {"role": "user", "content": task_text("MANGO", "a.txt")}]
    body = {"model": "policy", "messages": messages, "tools": [WRITE], "return_token_ids": True}
    first = post_direct(f"{engine.url}/chat/completions", body)["choices"][0]
    call = first["message"]["tool_calls"][0]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == (
        "Write", {"file_path": "/w/a.txt", "content": "MANGO\n"})
    assert first["token_ids"] == tokenize(render_tool_call("Write", call["function"]["arguments"]))
    messages += [first["message"], {"role": "tool", "tool_call_id": call["id"], "content": "ok"}]
    final = post_direct(f"{engine.url}/chat/completions", {**body, "messages": messages})
    assert final["choices"][0]["message"]["content"] == "Done: a.txt now holds MANGO."
    schema = {"type": "object", "properties": {"title": {"type": "string"}, "n": {"type": "integer"}}}
    side = post_direct(f"{engine.url}/chat/completions", {"messages": messages[:2], "response_format": {
        "type": "json_schema", "json_schema": {"name": "t", "schema": schema}}})
    assert json.loads(side["choices"][0]["message"]["content"]) == {"title": "Write MANGO into a.txt",
                                                                    "n": 1}
    assert [a.kind for a in policy.answers[-3:]] == ["tool-call", "final", "json"]


# --- the harnesses through lgt-proxy -------------------------------------------------------------------


@pytest.fixture(scope="module")
def policy() -> ScriptedPolicy:
    return ScriptedPolicy()


@pytest.fixture(scope="module")
def engine(policy: ScriptedPolicy):
    # harness prompts run to ~85 KB, one fake token a byte: a context that holds them
    with FakeUpstream.in_thread(reply=policy, max_model_len=1 << 20) as up:
        yield up


@pytest.fixture(scope="module")
def lgt_proxy(tmp_path_factory: pytest.TempPathFactory, engine: FakeUpstream):
    p = ProxyProc(tmp_path_factory.mktemp("harnesses") / "store", engine.url, "--egress", "deny").start()
    yield p
    p.stop()


def expected_tokens(answer: Answer) -> tuple[list[int], list[int]]:
    """The prompt and response token ids the fake engine produced for one scripted answer."""
    body = answer.request
    text = answer.reply if isinstance(answer.reply, str) else render_tool_call(*answer.reply)
    stop = body.get("stop") or []
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    seq = generate(text, 0, limit, [stop] if isinstance(stop, str) else list(stop))
    return tokenize(render_chat(body["messages"], body.get("tools"))), seq.token_ids


def egress_rows(proxy: ProxyProc, rollout: str) -> list[dict[str, Any]]:
    from lgt.store.query import connect

    cur = connect(proxy.store).execute(
        "SELECT kind, method, host, path, allowed, policy, status FROM egress WHERE rollout_id = ? "
        "ORDER BY started_at", [rollout])
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, row)) for row in cur.fetchall()]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "profile"), CASES, ids=[f"{n}-{p}" for n, p in CASES])
def test_harness_through_lgt_proxy(name: str, profile: str, lgt_proxy: ProxyProc, policy: ScriptedPolicy,
                                   tmp_path: Path, record_property) -> None:
    h = harnesses.HARNESSES[name][profile]
    if not harnesses.installed(h):
        pytest.skip(f"{h.bin} is not installed (npm ci in tests/harnesses installs {h.package})")
    word = re.sub(r"[^A-Z]", "", f"{name}{profile}".upper())
    workdir = tmp_path / "work"
    file = "answer.txt" if profile == "default" else str(workdir / "result.txt")
    place = harnesses.Place(task_text(word, file), workdir, tmp_path / "home")
    harnesses.prepare(h, place)
    rollout = f"h-{name}-{profile}"
    env = harnesses.environment(h, place, lgt_proxy.env(rollout))

    first = len(policy.answers)
    t0 = time.monotonic()
    r = harnesses.run(h, place, env, TIMEOUT_S)
    wall = time.monotonic() - t0
    settle = time.monotonic() + 10  # a call still in flight when the harness exited ends before counting
    while lgt_proxy.client.state()["in_flight"] and time.monotonic() < settle:
        time.sleep(0.05)
    answers = policy.answers[first:]
    rows = lgt_proxy.calls("rollout_id = ?", [rollout])
    blocked = egress_rows(lgt_proxy, rollout)
    record_property("wall_s", round(wall, 2))
    record_property("egress", [(e["method"], e["host"], e["path"], e["status"]) for e in blocked])
    summary = [(c["api"], c["status"], c["http_status"], c["error"]) for c in rows]
    why = (f"{name} [{profile}] rc={r.returncode} in {wall:.1f}s\nstdout: {r.stdout[-1500:]}\n"
           f"stderr: {r.stderr[-2500:]}\nrows: {summary}\nanswers: {[a.kind for a in answers]}\n"
           f"egress: {blocked}")

    assert r.returncode == 0, why
    target = Path(file) if file.startswith("/") else workdir / file
    assert target.exists() and word in target.read_text(), why
    assert [a.kind for a in answers].count("tool-call") >= 1 and "final" in [a.kind for a in answers], why

    assert not [c for c in rows if c["status"] == "rejected"], why
    assert all(c["status"] == "ok" and c["capture"] == "full" and c["api"] == h.api for c in rows), why
    assert len(rows) == len(answers), why  # every call that reached the engine is a row
    got = Counter((tuple(c["prompt_token_ids"]), tuple(c["response_token_ids"])) for c in rows)
    want = Counter(tuple(map(tuple, expected_tokens(a))) for a in answers)
    assert got == want, why
    for c in rows:
        ids = c["response_token_ids"]
        assert c["response_logprobs"] == pytest.approx([token_logprob(t, i) for i, t in enumerate(ids)])

    # nothing but model calls left the machine: whatever else the harness asked for was refused
    assert all(not e["allowed"] and e["policy"] == "deny" for e in blocked), why
