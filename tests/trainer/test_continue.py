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
    p = ProxyProc(tmp_path_factory.mktemp("cont") / "store", vllm_url, "--on-update", "continue").start()
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


@pytest.mark.parametrize("stream", [True, False])
def test_a_continuation_the_engine_refuses_is_a_failed_call_with_its_reason(
        proxy: ProxyProc, rollout: str, stream: bool) -> None:
    version = proxy.client.state()["policy_version"]
    update = Update(proxy, version + 1, served_model="no-such-model")  # vLLM answers 404
    got: dict[str, Any] = {}

    def call() -> None:
        with agent(proxy, rollout) as c:
            got["resp"] = c.post(f"{HOST}/chat/completions", json={**ASK, "stream": stream})

    t = threading.Thread(target=call)
    t.start()
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
