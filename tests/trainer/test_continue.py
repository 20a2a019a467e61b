"""Calls that live through a policy update (``lgt-proxy --on-update continue``), on a real vLLM serving a
real pretrained model (SmolLM2-135M: real text, a real BPE tokenizer, ~20 tokens a second, so a pause
lands mid-answer).

A call paused mid-answer is stopped where it is and continued by the proxy after the resume: the agent
gets what vLLM gives without a pause (greedy: the same text, token ids and logprobs), the record says
which tokens each policy version generated, and a call that cannot go on (the agent left, the engine
refused the continuation, the proxy was killed) is on the record as failed, or not at all — never as
a half-written success.

Runs in the trainer's environment; lgt-proxy runs in its own (``lgt.testing.proxy.proxy_python``).
"""

from __future__ import annotations

import contextlib
import json
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lgt.testing.proxy import ProxyProc, sse_objects

pytestmark = pytest.mark.slow

ASK = {"model": "gpt-4o", "messages": [{"role": "user", "content": "Tell me about the sea in three "
                                                                     "sentences."}],
       "max_tokens": 96, "temperature": 0, "ignore_eos": True}
HOST = "https://api.openai.invalid/v1"


@pytest.fixture(scope="module")
def vllm_url(smollm2_dir: Path, engines: Callable[[Path], Any]) -> str:
    return engines(smollm2_dir).url


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory, vllm_url: str) -> Iterator[ProxyProc]:
    p = ProxyProc(tmp_path_factory.mktemp("cont") / "store", vllm_url, "--on-update", "continue",
                  "--tool-parser", "hermes").start()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def reference(vllm_url: str) -> dict[str, Any]:
    """vLLM's own greedy answer, without a pause."""
    return greedy(vllm_url, ASK)


def greedy(vllm_url: str, ask: dict[str, Any]) -> dict[str, Any]:
    body = {**ask, "model": "policy", "return_token_ids": True, "logprobs": True}
    out = httpx.post(f"{vllm_url}/chat/completions", json=body, trust_env=False, timeout=120).json()
    choice = out["choices"][0]
    if ask.get("ignore_eos"):
        assert len(choice["token_ids"]) == ask["max_tokens"]
    return {"content": choice["message"]["content"], "ids": choice["token_ids"],
            "logprobs": [e["logprob"] for e in choice["logprobs"]["content"]],
            "prompt_ids": out["prompt_token_ids"]}


def agent(proxy: ProxyProc, rollout: str) -> httpx.Client:
    ctx = ssl.create_default_context(cafile=proxy.ca_bundle)
    return httpx.Client(proxy=proxy.proxy_url(rollout), verify=ctx, trust_env=False, timeout=120)


def posting(proxy: ProxyProc, rollout: str, body: dict[str, Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """The agent posting ``body`` to chat/completions through the proxy, in a thread under way:
    (the thread, ``got``, whose ``resp`` is the response once the thread is done)."""
    got: dict[str, Any] = {}

    def call() -> None:
        with agent(proxy, rollout) as c:
            got["resp"] = c.post(f"{HOST}/chat/completions", json=body)

    t = threading.Thread(target=call)
    t.start()
    return t, got


class Update:
    """Pause the proxy once a call is under way (after ``after`` s), then resume it with ``version``."""

    def __init__(self, proxy: ProxyProc, version: int, served_model: str | None = None) -> None:
        self.proxy, self.version, self.served_model = proxy, version, served_model
        self.paused: dict[str, Any] | None = None

    def pause_when_under_way(self, after: float = 0.3) -> dict[str, Any]:
        ctl = self.proxy.client
        deadline = time.monotonic() + 30
        while ctl.state()["in_flight"] < 1:
            assert time.monotonic() < deadline, "the call never got under way"
            time.sleep(0.005)
        time.sleep(after)
        self.paused = ctl.pause(timeout=30)
        return self.paused

    def resume(self) -> dict[str, Any]:
        return self.proxy.client.resume(self.version, served_model=self.served_model)


def versions_split(row: dict[str, Any], before: int, after: int) -> int:
    """The number of tokens generated before the update; checks every token's version."""
    versions = row["response_policy_versions"]
    assert versions is not None and len(versions) == len(row["response_token_ids"])
    k = versions.count(before)
    assert versions == [before] * k + [after] * (len(versions) - k)
    return k


@pytest.mark.parametrize("stream", [True, False])
def test_a_call_paused_mid_answer_is_continued_and_the_agent_gets_vllms_answer(
        proxy: ProxyProc, reference: dict[str, Any], rollout: str, stream: bool) -> None:
    version = proxy.client.state()["policy_version"]
    update = Update(proxy, version + 1)
    got: dict[str, Any] = {}

    def call() -> None:
        with agent(proxy, rollout) as c:
            if not stream:
                got["resp"] = c.post(f"{HOST}/chat/completions", json=ASK)
                return
            with c.stream("POST", f"{HOST}/chat/completions", json={**ASK, "stream": True}) as r:
                got["status"] = r.status_code
                got["text"] = "".join(r.iter_text())

    t = threading.Thread(target=call)
    t.start()
    try:
        paused = update.pause_when_under_way()
        assert paused["drained"] is True and paused["parked"] == 1  # stopped, not waited for
        time.sleep(0.3)  # the weights would be updated here
        assert proxy.client.state()["parked"] == 1
    finally:
        update.resume()
    t.join(120)
    if stream:
        assert got["status"] == 200
        events = sse_objects(got["text"])
        assert got["text"].rstrip().endswith("data: [DONE]")
        chunks = [e for e in events if isinstance(e, dict)]
        text = "".join((c["choices"][0]["delta"].get("content") or "") for c in chunks if c["choices"])
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]
                  and c["choices"][0].get("finish_reason")]
        assert {c["id"] for c in chunks} == {chunks[0]["id"]} and {c["model"] for c in chunks} == {"gpt-4o"}
        assert all("token_ids" not in c["choices"][0] or c["choices"][0]["token_ids"] is None
                   for c in chunks if c["choices"])  # what the proxy asked for is stripped
    else:
        resp = got["resp"]
        assert resp.status_code == 200, resp.text
        body = resp.json()
        text, finish = body["choices"][0]["message"]["content"], [body["choices"][0]["finish_reason"]]
        assert body["model"] == "gpt-4o" and body["choices"][0]["logprobs"] is None
        assert body["usage"]["completion_tokens"] == ASK["max_tokens"]
    assert text == reference["content"] and finish == ["length"]
    [row] = proxy.calls("rollout_id = ?", [rollout])
    assert row["status"] == "ok" and row["streamed"] is stream and row["capture"] == "full"
    assert row["prompt_token_ids"] == reference["prompt_ids"]
    assert row["response_token_ids"] == reference["ids"]
    assert row["response_logprobs"] == pytest.approx(reference["logprobs"], abs=1e-4)
    assert row["policy_version"] == version
    k = versions_split(row, version, version + 1)
    assert 0 < k < ASK["max_tokens"], k  # it was cut mid-answer


# A call that offers a tool, and a conversation in which the model has called it before (SmolLM2-135M
# calls it then: <tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>, 36 tokens).
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}


def _shot(i: int, a: int, b: int) -> list[dict[str, Any]]:
    call = {"id": f"call_{i}", "type": "function",
            "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}
    return [{"role": "user", "content": f"What is {a} + {b}? Use the add tool."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": str(a + b)}]


TOOL_ASK = {"model": "gpt-4o", "tools": [ADD], "max_tokens": 96, "temperature": 0,
            "messages": [*_shot(1, 2, 3), *_shot(2, 7, 5), *_shot(3, 8, 1), *_shot(4, 6, 6),
                         {"role": "user", "content": "What is 12 + 30? Use the add tool."}]}


def assembled(text: str) -> dict[str, Any]:
    """A streamed chat answer put together as an SDK does: content, tool calls, finish reason."""
    content, calls, finish = "", {}, None
    for c in sse_objects(text):
        if not isinstance(c, dict) or not c.get("choices"):
            continue
        ch = c["choices"][0]
        content += ch["delta"].get("content") or ""
        for tc in ch["delta"].get("tool_calls") or ():
            slot = calls.setdefault(tc["index"], {"name": "", "arguments": "", "ids": []})
            slot["ids"] += [tc["id"]] if tc.get("id") else []
            slot["name"] += tc.get("function", {}).get("name") or ""
            slot["arguments"] += tc.get("function", {}).get("arguments") or ""
        finish = ch.get("finish_reason") or finish
    return {"content": content, "finish": finish,
            "calls": [(v["name"], v["arguments"], len(v["ids"])) for _, v in sorted(calls.items())]}


def mid_answer(vllm_url: str, body: dict[str, Any]) -> float:
    """Seconds from a call's start to about 40% of its answer's generation (after the prompt's
    prefill), measured on vLLM directly with the logprobs the proxy asks for, the second time (the first
    request with logprobs warms vLLM's CPU build up for seconds; the prompt is then cached, as it is
    next)."""
    for _ in range(2):
        t0, first = time.monotonic(), None
        with httpx.stream("POST", f"{vllm_url}/chat/completions",
                          json={**body, "stream": True, "logprobs": True}, trust_env=False, timeout=120) as r:
            for line in r.iter_lines():
                if first is None and '"token_ids":[' in line:
                    first = time.monotonic() - t0
        total = time.monotonic() - t0
    assert first is not None
    return first + 0.4 * (total - first)


@pytest.mark.parametrize("stream", [True, False])
def test_a_call_offering_tools_is_continued_and_its_tool_call_read_as_vllm_reads_it(
        proxy: ProxyProc, vllm_url: str, rollout: str, stream: bool) -> None:
    body = {**TOOL_ASK, "model": "policy", "stream": stream, "return_token_ids": True}
    after = mid_answer(vllm_url, body)
    if stream:  # vLLM's own answer, its tool call parsed by its hermes parser
        with httpx.stream("POST", f"{vllm_url}/chat/completions", json=body, trust_env=False,
                          timeout=120) as r:
            want = assembled("".join(r.iter_text()))
        ids = None
    else:
        direct = httpx.post(f"{vllm_url}/chat/completions", json=body, trust_env=False, timeout=120).json()
        want = direct["choices"][0]
        ids = want["token_ids"]
    version = proxy.client.state()["policy_version"]
    update = Update(proxy, version + 1)
    t, got = posting(proxy, rollout, {**TOOL_ASK, "stream": stream})
    try:
        assert update.pause_when_under_way(after=after)["parked"] == 1
        time.sleep(0.3)
    finally:
        update.resume()
    t.join(120)
    resp = got["resp"]
    assert resp.status_code == 200, resp.text
    [row] = proxy.calls("rollout_id = ?", [rollout])
    assert row["status"] == "ok", row["error"]
    k = versions_split(row, version, version + 1)
    assert 0 < k < len(row["response_token_ids"]), (k, after)  # cut mid-answer
    if stream:
        have = assembled(resp.text)
        assert have == want and have["finish"] == "tool_calls"
        assert have["calls"][0][:2] == ("add", '{"a": 12, "b": 30}')
    else:
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == want["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == want["message"]["content"]
        strip = [{**tc, "id": None} for tc in want["message"]["tool_calls"]]
        assert [{**tc, "id": None} for tc in choice["message"]["tool_calls"]] == strip
        assert choice["message"]["tool_calls"][0]["id"].startswith("chatcmpl-tool-")
        assert row["response_token_ids"] == ids


def test_a_call_cut_in_its_prompts_prefill_is_asked_again_on_the_new_weights(
        proxy: ProxyProc, vllm_url: str, rollout: str) -> None:
    # a prompt of ~6,000 tokens, new to the engine's prefix cache: seconds of prefill on CPU
    filler = " ".join(f"Note {i}: the tide was {'high' if i % 3 else 'low'} at dawn." for i in range(400))
    ask = {**ASK, "messages": [{"role": "user", "content": f"{filler}\nTell me about the sea."}],
           "max_tokens": 8, "stream": True}
    version = proxy.client.state()["policy_version"]
    update = Update(proxy, version + 1)
    t, got = posting(proxy, rollout, ask)
    try:
        assert update.pause_when_under_way(after=0.5)["parked"] == 1
    finally:
        update.resume()
    t.join(180)
    reference = greedy(vllm_url, {k: v for k, v in ask.items() if k != "stream"})
    assert got["resp"].status_code == 200
    events = [e for e in sse_objects(got["resp"].text) if isinstance(e, dict) and e.get("choices")]
    assert [e["choices"][0]["delta"].get("role") for e in events].count("assistant") == 1
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == reference["content"]
    [row] = proxy.calls("rollout_id = ?", [rollout])
    assert row["status"] == "ok" and row["response_token_ids"] == reference["ids"]
    assert row["prompt_token_ids"] == reference["prompt_ids"]
    assert versions_split(row, version, version + 1) == 0  # every token generated after the update


def test_an_anthropic_messages_call_is_continued_too(proxy: ProxyProc, vllm_url: str, rollout: str) -> None:
    reference = greedy(vllm_url, {k: v for k, v in ASK.items() if k != "ignore_eos"})  # not Anthropic's
    version = proxy.client.state()["policy_version"]
    update = Update(proxy, version + 1)
    ask = {"model": "claude-x", "max_tokens": ASK["max_tokens"], "temperature": 0, "stream": True,
           "messages": ASK["messages"]}
    got: dict[str, Any] = {}

    def call() -> None:
        with agent(proxy, rollout) as c, c.stream("POST", "https://api.anthropic.invalid/v1/messages",
                                                  json=ask, headers={"anthropic-version": "2023-06-01"}) as r:
            got["status"], got["text"] = r.status_code, "".join(r.iter_text())

    t = threading.Thread(target=call)
    t.start()
    try:
        assert update.pause_when_under_way()["parked"] == 1
    finally:
        update.resume()
    t.join(120)
    assert got["status"] == 200
    events = [e for e in sse_objects(got["text"]) if isinstance(e, dict)]
    text = "".join(e["delta"].get("text", "") for e in events if e.get("type") == "content_block_delta")
    assert text == reference["content"]
    assert events[-1]["type"] == "message_stop"
    [row] = proxy.calls("rollout_id = ?", [rollout])
    assert row["status"] == "ok" and row["api"] == "messages"
    assert row["response_token_ids"] == reference["ids"]
    assert 0 < versions_split(row, version, version + 1) < len(reference["ids"])


def test_an_agent_that_leaves_mid_continuation_is_recorded_as_gone(proxy: ProxyProc, rollout: str) -> None:
    version = proxy.client.state()["policy_version"]
    update = Update(proxy, version + 1)
    closed = threading.Event()

    def call() -> None:  # an SDK's read timeout: it leaves once its parked call stays silent for 1 s
        ctx = ssl.create_default_context(cafile=proxy.ca_bundle)
        with httpx.Client(proxy=proxy.proxy_url(rollout), verify=ctx, trust_env=False,
                          timeout=httpx.Timeout(60, read=1.0)) as c:
            with contextlib.suppress(httpx.ReadTimeout), c.stream(
                    "POST", f"{HOST}/chat/completions", json={**ASK, "stream": True}) as r:
                for _ in r.iter_raw():
                    pass
        closed.set()

    t = threading.Thread(target=call)
    t.start()
    try:
        assert update.pause_when_under_way()["parked"] == 1
        assert closed.wait(30)
        time.sleep(0.5)
    finally:
        update.resume()
    t.join(60)
    deadline = time.monotonic() + 30
    while proxy.client.state()["in_flight"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    rows = proxy.calls("rollout_id = ?", [rollout])
    assert [r["status"] for r in rows] == ["client_disconnect"]
    assert rows[0]["error"]


def test_an_agent_that_leaves_while_its_call_is_continued_is_recorded_as_gone(
        proxy: ProxyProc, rollout: str) -> None:
    version = proxy.client.state()["policy_version"]
    update = Update(proxy, version + 1)
    resumed, left = threading.Event(), threading.Event()

    def call() -> None:  # reads on after the resume, then hangs up mid-answer
        with agent(proxy, rollout) as c, c.stream(
                "POST", f"{HOST}/chat/completions", json={**ASK, "stream": True}) as r:
            after = 0
            for chunk in r.iter_raw():
                if resumed.is_set() and b"content" in chunk:
                    after += 1
                    if after == 3:
                        break
        left.set()

    t = threading.Thread(target=call)
    t.start()
    try:
        assert update.pause_when_under_way()["parked"] == 1
    finally:
        update.resume()
        resumed.set()
    assert left.wait(60)
    t.join(60)
    deadline = time.monotonic() + 30
    while proxy.client.state()["in_flight"]:
        assert time.monotonic() < deadline, "the continued call stayed in flight after its agent left"
        time.sleep(0.05)
    rows = proxy.calls("rollout_id = ?", [rollout])
    assert [r["status"] for r in rows] == ["client_disconnect"]


@pytest.mark.parametrize("stream", [True, False])
def test_a_continuation_the_engine_refuses_is_a_failed_call_with_its_reason(
        proxy: ProxyProc, rollout: str, stream: bool) -> None:
    version = proxy.client.state()["policy_version"]
    update = Update(proxy, version + 1, served_model="no-such-model")  # vLLM answers 404
    t, got = posting(proxy, rollout, {**ASK, "stream": stream})
    try:
        assert update.pause_when_under_way()["parked"] == 1
        update.resume()
        t.join(60)
    finally:
        proxy.client.resume(served_model="policy")
    resp = got["resp"]
    if stream:
        assert resp.status_code == 200 and "[DONE]" not in resp.text
        assert "refused to continue" in json.dumps(sse_objects(resp.text)[-1])
    else:
        assert resp.status_code == 502 and "refused to continue" in resp.json()["error"]["message"]
    [row] = proxy.calls("rollout_id = ?", [rollout])
    assert row["status"] == ("stream_error" if stream else "http_error")
    assert "refused to continue this call after the policy update (404" in row["error"]


def test_a_killed_proxy_mid_continuation_loses_no_answered_call(tmp_path: Path, vllm_url: str,
                                                                 rollout: str) -> None:
    p = ProxyProc(tmp_path / "store", vllm_url, "--on-update", "continue").start()
    try:
        with agent(p, rollout) as c:  # answered before the update: the agent has it
            assert c.post(f"{HOST}/chat/completions", json={**ASK, "max_tokens": 8}).status_code == 200
        update = Update(p, 1)
        errors: list[Exception] = []

        def call() -> None:
            try:
                with agent(p, rollout) as c:
                    c.post(f"{HOST}/chat/completions", json={**ASK, "stream": True})
            except httpx.HTTPError as e:
                errors.append(e)

        t = threading.Thread(target=call)
        t.start()
        assert update.pause_when_under_way()["parked"] == 1
        p.kill9()  # mid-continuation: stopped, parked, not yet continued
        t.join(60)
    finally:
        p.stop()
    again = ProxyProc(tmp_path / "store", vllm_url, "--on-update", "continue").start()
    try:
        rows = again.calls("rollout_id = ?", [rollout])
    finally:
        again.stop()
    assert [(r["seq"], r["status"]) for r in rows] == [(0, "ok")]
    assert len(rows[0]["response_token_ids"]) == 8
