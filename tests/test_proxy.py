"""lgt-proxy end to end: a real proxy process, a real fake-vLLM upstream, real HTTP clients."""

from __future__ import annotations

import json
import os
import re
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lgt.proxy.client import ControlClient, ControlError
from lgt.testing.fake_upstream import FakeUpstream, render_chat, token_logprob, tokenize
from lgt.testing.proxy import CHAT, HOSTED, ProxyProc, client, sse_objects, stable


def direct(upstream: FakeUpstream) -> httpx.Client:
    return httpx.Client(base_url=upstream.url, trust_env=False, timeout=30)


def no_token_ids(obj: Any) -> bool:
    if isinstance(obj, dict):
        return all((k not in ("token_ids", "prompt_token_ids") or v is None) and no_token_ids(v)
                   for k, v in obj.items())
    return all(no_token_ids(v) for v in obj) if isinstance(obj, list) else True


TOOLS_CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "17*23"}], "tools": [
    {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]}
COMPLETION = {"model": "gpt-4o", "prompt": "The answer to 6*7 is", "max_tokens": 8}


# -- what the agent sees ----------------------------------------------------------------------------


@pytest.mark.parametrize("path,body", [("chat/completions", CHAT), ("completions", COMPLETION),
                                       ("chat/completions", TOOLS_CHAT)])
@pytest.mark.parametrize("stream", [False, True])
def test_agent_sees_exactly_what_the_upstream_would_have_sent(
    proxy: ProxyProc, upstream: FakeUpstream, rollout: str, path: str, body: dict, stream: bool
) -> None:
    req = {**body, "stream": stream}
    with direct(upstream) as d:
        want = d.post(f"/{path}", json=req)
    with client(proxy, rollout) as c:
        got = c.post(f"{HOSTED}/{path}", json=req, headers={"Authorization": "Bearer sk-agent"})
    assert got.status_code == want.status_code == 200
    if stream:
        assert got.headers["content-type"].startswith("text/event-stream")
        w, g = sse_objects(want.text), sse_objects(got.text)
        assert g[-1] == "[DONE]" and len(g) == len(w) > 3
        assert stable(g) == stable(w)
        assert all(no_token_ids(o) for o in g[:-1])
    else:
        assert stable(got.json()) == stable(want.json())
        assert no_token_ids(got.json())
    # ... while the upstream was asked for token ids and logprobs under the served model name
    sent = upstream.requests[-1].body
    assert sent["model"] == "policy" and sent["return_token_ids"] is True
    assert sent["logprobs"] in (True, 0)


@pytest.mark.parametrize("stream", [False, True])
def test_record_holds_the_tokens_and_logprobs_vllm_produced(
    proxy: ProxyProc, rollout: str, stream: bool
) -> None:
    with client(proxy, rollout) as c:
        r = c.post(f"{HOSTED}/chat/completions", json={**CHAT, "stream": stream})
        assert r.status_code == 200
    [row] = proxy.calls("rollout_id = ?", [rollout])
    prompt = tokenize(render_chat(CHAT["messages"]))
    assert row["prompt_token_ids"] == prompt
    text = (r.json()["choices"][0]["message"]["content"] if not stream else
            "".join(o["choices"][0]["delta"].get("content") or ""
                    for o in sse_objects(r.text)[:-1] if o["choices"]))
    assert row["response_token_ids"] == tokenize(text)
    want_lp = [token_logprob(t, i) for i, t in enumerate(row["response_token_ids"])]
    assert row["response_logprobs"] == pytest.approx(want_lp, abs=1e-6)
    assert row["status"] == "ok" and row["http_status"] == 200 and row["streamed"] is stream
    assert row["original_host"] == "api.openai.invalid"
    assert (row["requested_model"], row["served_model"]) == ("gpt-4o", "policy")
    assert row["upstream"] == proxy.upstream and row["policy_version"] == 0
    assert row["usage_prompt_tokens"] == len(prompt)
    assert row["usage_total_tokens"] == len(prompt) + len(tokenize(text))
    assert row["finish_reason"] == "stop"
    assert json.loads(row["request_json"]) == {**CHAT, "stream": stream}
    assert json.loads(row["response_json"])["choices"][0]["message"]["content"] == text
    assert row["ended_at"] >= row["first_byte_at"] >= row["started_at"]


def test_calls_of_one_rollout_are_numbered_in_order(proxy: ProxyProc, rollout: str) -> None:
    with client(proxy, rollout) as c:
        for i in range(4):
            c.post(f"{HOSTED}/chat/completions",
                   json={"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]})
    rows = proxy.calls("rollout_id = ?", [rollout])
    assert [r["seq"] for r in rows] == [0, 1, 2, 3]
    assert [json.loads(r["request_json"])["messages"][0]["content"] for r in rows] == \
        ["q0", "q1", "q2", "q3"]


def test_attempts_are_kept_apart(proxy: ProxyProc, rollout: str) -> None:
    for attempt in (0, 1):
        ctx = ssl.create_default_context(cafile=proxy.ca_bundle)
        with httpx.Client(proxy=proxy.proxy_url(rollout, attempt), verify=ctx,
                          trust_env=False) as c:
            assert c.post(f"{HOSTED}/completions", json=COMPLETION).status_code == 200
    rows = proxy.calls("rollout_id = ?", [rollout])
    assert [(r["attempt"], r["seq"]) for r in rows] == [(0, 0), (1, 0)]


@pytest.mark.parametrize("mode", ["https_proxy", "base_url"])
def test_a_greedy_identity_decodes_greedily_whatever_the_agent_asks(
    proxy: ProxyProc, upstream: FakeUpstream, rollout: str, mode: str
) -> None:
    body = {**CHAT, "temperature": 1.3, "top_p": 0.5, "seed": 7}
    ctx = ssl.create_default_context(cafile=proxy.ca_bundle)
    if mode == "https_proxy":
        with httpx.Client(proxy=proxy.proxy_url(rollout, 1, greedy=True), verify=ctx, trust_env=False) as c:
            r = c.post(f"{HOSTED}/chat/completions", json=body)
    else:
        with httpx.Client(trust_env=False) as c:
            r = c.post(f"{proxy.base_url(rollout, 1, greedy=True)}/chat/completions", json=body)
    assert r.status_code == 200 and no_token_ids(r.json())
    sent = upstream.requests[-1].body
    assert sent["temperature"] == 0.0 and not {"top_p", "seed"} & set(sent)
    [row] = proxy.calls("rollout_id = ?", [rollout])
    assert (row["attempt"], row["sampling"]) == (1, "greedy")
    assert json.loads(row["request_json"]) == body  # the record keeps what the agent asked
    # an ordinary identity of the same rollout is left as the agent asked
    with httpx.Client(proxy=proxy.proxy_url(rollout, 2), verify=ctx, trust_env=False) as c:
        assert c.post(f"{HOSTED}/chat/completions", json=body).status_code == 200
    assert upstream.requests[-1].body["temperature"] == 1.3
    assert proxy.calls("rollout_id = ? AND attempt = 2", [rollout])[0]["sampling"] is None


def test_streamed_chunks_reach_the_agent_as_they_arrive(
    tmp_path: Path, rollout: str, clean_env: pytest.MonkeyPatch
) -> None:
    with FakeUpstream.in_thread(port=0, chunk_delay_s=0.05) as slow:
        p = ProxyProc(tmp_path / "store", slow.url).start()
        try:
            req = {**CHAT, "stream": True, "messages": [{"role": "user", "content": "__long:30__"}]}
            with client(p, rollout) as c, c.stream("POST", f"{HOSTED}/chat/completions",
                                                   json=req) as r:
                t0 = time.monotonic()
                lines = []
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        lines.append((time.monotonic() - t0, line))
            arrivals = [t for t, _ in lines]
            text = "".join(o["choices"][0]["delta"].get("content") or ""
                           for o in sse_objects("\n".join(l for _, l in lines))[:-1] if o["choices"])
            # 30 tokens at 50 ms: the stream lasts ~1.5 s; buffering would deliver all at the end
            assert arrivals[-1] > 1.0
            assert arrivals[1] < arrivals[-1] / 3
            [row] = p.calls()
            assert row["response_token_ids"] == tokenize(text) and len(text) == 30, row
            assert row["ttfb_ms"] < row["latency_ms"] / 3
        finally:
            p.stop()


# -- identity ---------------------------------------------------------------------------------------


def test_missing_or_wrong_credentials_get_407_and_nothing_is_forwarded(
    proxy: ProxyProc, upstream: FakeUpstream, rollout: str
) -> None:
    before = len(upstream.requests)
    good = proxy.proxy_url(rollout)
    wrong = re.sub(r":([0-9a-f]{32})@", ":" + "0" * 32 + "@", good)
    bare = re.sub(r"//[^@]+@", "//", good)
    for url in (wrong, bare):
        with httpx.Client(proxy=url, trust_env=False) as c:  # plain HTTP: the 407 is visible
            r = c.post(f"{upstream.url}/chat/completions", json=CHAT)
        assert r.status_code == 407
        assert r.headers["proxy-authenticate"].startswith("Basic")
        ctx = ssl.create_default_context(cafile=proxy.ca_bundle)
        with httpx.Client(proxy=url, verify=ctx, trust_env=False) as c:  # HTTPS: CONNECT refused
            with pytest.raises(httpx.ProxyError, match="407"):
                c.post(f"{HOSTED}/chat/completions", json=CHAT)
    assert len(upstream.requests) == before
    assert proxy.calls("rollout_id = ?", [rollout]) == []
    assert proxy.client.state()["auth_failures"] >= 4


def test_another_rollouts_token_is_refused(proxy: ProxyProc, rollout: str) -> None:
    mine = proxy.proxy_url(rollout)
    theirs_token = re.search(r":([0-9a-f]{32})@", proxy.proxy_url(rollout + "-other"))[1]
    forged = re.sub(r":([0-9a-f]{32})@", f":{theirs_token}@", mine)
    with httpx.Client(proxy=forged, trust_env=False) as c:
        assert c.post(f"{proxy.upstream}/completions", json=COMPLETION).status_code == 407


# -- errors are recorded and passed through ----------------------------------------------------------


def test_upstream_error_reaches_the_agent_unchanged_and_is_recorded(
    proxy: ProxyProc, upstream: FakeUpstream, rollout: str
) -> None:
    req = {"model": "m", "messages": [{"role": "user", "content": "__status:503__"}]}
    with direct(upstream) as d:
        want = d.post("/chat/completions", json=req)
    with client(proxy, rollout) as c:
        got = c.post(f"{HOSTED}/chat/completions", json=req)
    assert got.status_code == want.status_code == 503
    assert got.json() == want.json()
    [row] = proxy.calls("rollout_id = ?", [rollout])
    assert (row["status"], row["http_status"]) == ("http_error", 503)
    assert row["error"] == want.json()["error"]["message"]


def test_broken_sse_is_passed_through_recorded_and_survived(
    proxy: ProxyProc, upstream: FakeUpstream, rollout: str
) -> None:
    req = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "__broken_sse__"}]}
    with client(proxy, rollout) as c:
        got = c.post(f"{HOSTED}/chat/completions", json=req)
        assert got.status_code == 200 and "data: {not json" in got.text
        assert c.post(f"{HOSTED}/chat/completions", json=CHAT).status_code == 200  # still alive
    rows = proxy.calls("rollout_id = ?", [rollout])
    assert [r["status"] for r in rows] == ["stream_error", "ok"]
    assert "without [DONE]" in rows[0]["error"]


def test_a_stream_cut_by_the_upstream_is_recorded(proxy: ProxyProc, rollout: str) -> None:
    req = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "__drop__"}]}
    with client(proxy, rollout) as c:
        with pytest.raises(httpx.HTTPError):
            with c.stream("POST", f"{HOSTED}/chat/completions", json=req) as r:
                for _ in r.iter_lines():
                    pass
    [row] = proxy.calls("rollout_id = ?", [rollout])
    assert row["status"] in ("stream_error", "upstream_error") and row["error"]


def test_client_disconnect_is_recorded(proxy: ProxyProc, rollout: str) -> None:
    req = {"model": "m", "messages": [{"role": "user", "content": "__sleep:1.5__"}]}
    with client(proxy, rollout, timeout=0.3) as c:
        with pytest.raises(httpx.TimeoutException):
            c.post(f"{HOSTED}/chat/completions", json=req)
    deadline = time.monotonic() + 10
    rows: list = []
    while not rows and time.monotonic() < deadline:
        rows = proxy.calls("rollout_id = ?", [rollout])
        time.sleep(0.1)
    assert [r["status"] for r in rows] == ["client_disconnect"]


@pytest.mark.parametrize("body,message", [
    (b"{not json", "not valid JSON"),
    (b'{"model": "m", "input": "x"}', "no 'messages' field"),
    (b'["a"]', "not a JSON object"),
])
def test_bad_llm_requests_get_a_clear_400_and_are_not_forwarded(
    proxy: ProxyProc, upstream: FakeUpstream, rollout: str, body: bytes, message: str
) -> None:
    before = len(upstream.requests)
    with client(proxy, rollout) as c:
        r = c.post(f"{HOSTED}/chat/completions", content=body,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert message in r.json()["error"]["message"]
    assert r.json()["error"]["message"].startswith("lgt-proxy:")
    assert len(upstream.requests) == before
    # refused, and on the record: a row with its status, HTTP status and reason (no tokens)
    (row,) = proxy.calls("rollout_id = ?", [rollout])
    assert (row["status"], row["http_status"], row["capture"]) == ("rejected", 400, "no_tokens")
    assert message in row["error"] and row["request_json"] == body.decode("utf-8", "replace")
    assert row["response_json"] == r.text and row["prompt_token_ids"] is None


def test_huge_bodies_are_refused_before_forwarding(
    tmp_path: Path, upstream: FakeUpstream, rollout: str
) -> None:
    p = ProxyProc(tmp_path / "store", upstream.url, "--max-body-mb", "0.01").start()
    posts = lambda: sum(r.method == "POST" for r in upstream.requests)  # noqa: E731 (not the model cards)
    try:
        before = posts()
        big = {"model": "m", "messages": [{"role": "user", "content": "x" * 20_000}]}
        with client(p, rollout) as c:
            r = c.post(f"{HOSTED}/chat/completions", json=big)
            assert r.status_code == 413 and "exceeds the proxy's limit" in r.json()["error"]["message"]
            assert c.post(f"{HOSTED}/chat/completions", json=CHAT).status_code == 200
        assert posts() == before + 1
        rows = p.calls("rollout_id = ?", [rollout])
        assert [(r["seq"], r["status"], r["http_status"]) for r in rows] == [(0, "rejected", 413),
                                                                             (1, "ok", 200)]
    finally:
        p.stop()


def test_non_llm_traffic_passes_through_untouched(
    proxy: ProxyProc, upstream: FakeUpstream, rollout: str
) -> None:
    with client(proxy, rollout) as c:
        r = c.get(f"{upstream.url.removesuffix('/v1')}/health", headers={"Authorization": "Bearer sk-kept"})
    assert r.status_code == 200
    assert upstream.requests[-1].headers.get("authorization") == "Bearer sk-kept"
    assert proxy.calls("rollout_id = ?", [rollout]) == []


# -- pause / resume and the control API --------------------------------------------------------------


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except Exception as e:  # surfaced by the test's asserts
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _hold_seconds(proxy: ProxyProc) -> float:
    """lgt_proxy_hold_seconds_sum: seconds held calls have waited for a resume, all told."""
    found = re.search(r"^lgt_proxy_hold_seconds_sum ([0-9.]+)$", proxy.client.metrics(), re.M)
    assert found, "no hold-seconds histogram in /metrics"
    return float(found[1])


def test_pause_drains_in_flight_holds_new_calls_and_resume_sets_the_version(
    proxy: ProxyProc, rollout: str
) -> None:
    slow = {"model": "m", "messages": [{"role": "user", "content": "__sleep:0.8__ slow"}]}
    with client(proxy, rollout) as c:
        t1, r1 = _in_thread(lambda: c.post(f"{HOSTED}/chat/completions", json=slow))
        time.sleep(0.3)
        paused = proxy.client.pause(timeout=10)
        assert paused["drained"] is True
        assert paused["in_flight_at_pause"] == 1 and paused["drain_seconds"] > 0.2
        t1.join(5)
        assert r1["result"].status_code == 200  # the in-flight call finished normally
        t2, r2 = _in_thread(lambda: c.post(f"{HOSTED}/chat/completions", json=CHAT))
        time.sleep(0.5)
        assert t2.is_alive() and not r2  # held open, not failed
        state = proxy.client.state()
        assert state["paused"] is True and state["held"] == 1 and state["in_flight"] == 0
        held_before, waited_before = state["held_total"], _hold_seconds(proxy)
        resumed = proxy.client.resume(policy_version=7)
        assert resumed["paused"] is False and resumed["policy_version"] == 7
        t2.join(5)
        assert r2["result"].status_code == 200
    assert proxy.client.state()["held_total"] == held_before + 1  # counted when it was let through
    assert _hold_seconds(proxy) - waited_before >= 0.4  # it waited at least the 0.5 s the pause held it
    rows = proxy.calls("rollout_id = ?", [rollout])
    assert [r["policy_version"] for r in rows] == [0, 7]
    proxy.client.resume(policy_version=0)


def test_pause_times_out_with_504_while_a_call_is_still_running(
    proxy: ProxyProc, rollout: str
) -> None:
    slow = {"model": "m", "messages": [{"role": "user", "content": "__sleep:1.5__"}]}
    with client(proxy, rollout) as c:
        t, r = _in_thread(lambda: c.post(f"{HOSTED}/chat/completions", json=slow))
        time.sleep(0.3)
        with pytest.raises(ControlError, match="answered POST /pause with 504") as e:
            proxy.client.pause(timeout=0.2)
        assert e.value.status == 504 and e.value.body["drained"] is False and e.value.body["in_flight"] == 1
        oldest = e.value.body["oldest_in_flight"]  # what the pause waited for
        assert oldest["rollout_id"] == rollout and oldest["seconds"] >= 0.4
        assert oldest["answer_begun"] is False
        proxy.client.resume()
        t.join(5)
        assert r["result"].status_code == 200
    assert proxy.client.state()["oldest_in_flight"] is None


def test_a_pause_does_not_wait_for_a_call_whose_agent_has_gone(proxy: ProxyProc, rollout: str) -> None:
    """A call the proxy is still working on (here: asked again without its injected token ids, and
    the upstream slow to answer that) whose agent has closed its connection: nobody waits for its
    answer, so a pause drains without it; it is recorded when it ends."""
    stuck = {"model": "m", "messages": [{"role": "user", "content": "__reject_token_ids__ __sleep:4__ hi"}]}
    c = client(proxy, rollout, timeout=1.0)
    with pytest.raises(httpx.ReadTimeout):  # the agent gives up and closes its connection
        c.post(f"{HOSTED}/chat/completions", json=stuck)
    c.close()
    state = proxy.client.state()
    assert state["in_flight"] == 1
    t0 = time.monotonic()
    paused = proxy.client.pause(timeout=10)
    proxy.client.resume()
    assert paused["drained"] is True and paused["in_flight_at_pause"] == 1
    assert paused["orphaned"] == 1 and paused["oldest_in_flight"]["agent_gone"] is True
    assert time.monotonic() - t0 < 2.5  # not the ~3 s left of the upstream's answer
    deadline = time.monotonic() + 10
    while proxy.client.state()["in_flight"]:  # recorded when it ends
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert [r["status"] for r in proxy.calls("rollout_id = ?", [rollout])] == ["client_disconnect"]


def test_reject_mode_answers_429_with_retry_after(
    tmp_path: Path, upstream: FakeUpstream, rollout: str
) -> None:
    p = ProxyProc(tmp_path / "store", upstream.url, "--pause-mode", "reject",
                  "--retry-after", "3").start()
    try:
        assert p.client.pause()["drained"] is True
        with client(p, rollout) as c:
            r = c.post(f"{HOSTED}/chat/completions", json=CHAT)
            assert r.status_code == 429 and r.headers["retry-after"] == "3"
            p.client.resume(policy_version=1)
            assert c.post(f"{HOSTED}/chat/completions", json=CHAT).status_code == 200
        # the refused call is on the record, at the version it was refused under, then the retry
        assert [(r["status"], r["http_status"], r["policy_version"]) for r in p.calls()] == [
            ("rejected", 429, 0), ("ok", 200, 1)]
        assert p.client.state()["rejected"] == 1
    finally:
        p.stop()


def test_control_api_needs_the_bearer_token(proxy: ProxyProc) -> None:
    assert proxy.client.request("GET", "/state", auth=False)[0] == 401
    assert ControlClient(proxy.control_url, "wrong").request("GET", "/state")[0] == 401
    assert proxy.client.request("GET", "/healthz", auth=False)[0] == 200
    status, body = proxy.client.request("POST", "/resume", {"policy_version": "seven"})
    assert status == 400 and "non-negative integer" in body["error"]


def test_metrics_are_prometheus_text(proxy: ProxyProc, rollout: str) -> None:
    with client(proxy, rollout) as c:
        c.post(f"{HOSTED}/chat/completions", json=CHAT)
    text = proxy.client.metrics()
    ok = re.search(r'^lgt_proxy_calls_total\{status="ok"\} (\d+)$', text, re.M)
    assert ok and int(ok[1]) >= 1
    count = re.search(r"^lgt_proxy_latency_seconds_count (\d+)$", text, re.M)
    inf = re.search(r'^lgt_proxy_latency_seconds_bucket\{le="\+Inf"\} (\d+)$', text, re.M)
    assert count and inf and count[1] == inf[1] and int(count[1]) >= int(ok[1])
    assert re.search(r"^lgt_proxy_drain_seconds_count \d+$", text, re.M)
    assert re.search(r"^# TYPE lgt_proxy_in_flight gauge$", text, re.M)


# -- egress -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_server() -> Iterator[FakeUpstream]:
    """A second local server standing in for 'the internet'."""
    with FakeUpstream.in_thread(port=0) as s:
        yield s


@pytest.mark.parametrize("mode,args,allowed", [
    ("deny", [], False),
    ("allowlist", ["--allow-host", "localhost"], True),
    ("allowlist", ["--allow-host", "example.invalid"], False),
])
def test_egress_policy(tmp_path: Path, upstream: FakeUpstream, other_server: FakeUpstream,
                       rollout: str, mode: str, args: list[str], allowed: bool) -> None:
    p = ProxyProc(tmp_path / "store", upstream.url, "--egress", mode, *args).start()
    try:
        with client(p, rollout) as c:
            r = c.get(f"http://localhost:{other_server.port}/health")
            assert (r.status_code == 200) is allowed
            if not allowed:
                assert r.status_code == 403 and "egress policy" in r.text
            # LLM calls and the upstream itself are always reachable
            assert c.post(f"{HOSTED}/chat/completions", json=CHAT).status_code == 200
            assert c.get(f"{upstream.url.removesuffix('/v1')}/health").status_code == 200
    finally:
        p.stop()


# -- observe-only ---------------------------------------------------------------------------------------


def test_observe_only_records_calls_where_the_agent_sent_them(
    tmp_path: Path, upstream: FakeUpstream, rollout: str
) -> None:
    p = ProxyProc(tmp_path / "store", None).start()
    try:
        with client(p, rollout) as c:
            r = c.post(f"{upstream.url}/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.json()["model"] == "gpt-4o"
        sent = upstream.requests[-1].body
        assert "return_token_ids" not in sent and sent["model"] == "gpt-4o"
        [row] = p.calls()
        # the store says which model answered, and where: the agent's own host
        assert row["status"] == "ok" and row["upstream"] == upstream.url.removesuffix("/v1")
        assert row["served_model"] == "gpt-4o" and row["capture_reason"] == "hosted"
        assert row["prompt_token_ids"] is None
        assert json.loads(row["response_json"])["choices"][0]["message"]["content"]
    finally:
        p.stop()


# -- secrets -------------------------------------------------------------------------------------------


def test_secrets_never_reach_the_store_or_the_logs(
    tmp_path: Path, upstream: FakeUpstream, rollout: str
) -> None:
    p = ProxyProc(tmp_path / "store", upstream.url, "--upstream-api-key", "up-key-SECRET-42",
                  "--log-level", "DEBUG").start()
    try:
        token = re.search(r":([0-9a-f]{32})@", p.proxy_url(rollout))[1]
        agent_key = "sk-agent-SECRET-1234567890"
        with client(p, rollout) as c:
            for stream in (False, True):
                c.post(f"{HOSTED}/chat/completions", json={**CHAT, "stream": stream},
                       headers={"Authorization": f"Bearer {agent_key}", "api-key": agent_key})
            c.post(f"{HOSTED}/chat/completions", content=b"{bad", headers={"api-key": agent_key})
        with httpx.Client(trust_env=False) as c:  # reverse mode carries the token in the path
            assert c.post(f"{p.base_url(rollout)}/chat/completions", json=CHAT).status_code == 200
            assert c.post(p.base_url(rollout).replace(token, "f" * 32) + "/chat/completions",
                          json=CHAT).status_code == 401
        assert upstream.requests[-1].headers["authorization"] == "Bearer up-key-SECRET-42"
        assert [r["status"] for r in p.calls()] == ["ok", "ok", "rejected", "ok"]  # the bad one too
        p.stop()
        secret = p.secret.decode()
        from lgt.proxy.auth import control_token

        needles = [agent_key, token, secret, control_token(p.secret), "up-key-SECRET-42"]
        files = [f for f in p.store.rglob("*") if f.is_file() and f.parent.name != "_proxy"]
        files.append(p.log_path)
        assert any(f.suffix == ".parquet" for f in files)
        for f in files:
            data = f.read_bytes()
            for needle in needles:
                assert needle.encode() not in data, f"{needle[:6]}… found in {f}"
    finally:
        p.stop()


# -- rewards -------------------------------------------------------------------------------------------


def rewards_of(p: ProxyProc, rollout: str) -> list[tuple]:
    from lgt.store.query import connect

    p.flush()
    return connect(p.store).execute(
        "SELECT attempt, call_id, value, source FROM rewards_log WHERE rollout_id = ? "
        "ORDER BY recorded_at", [rollout]).fetchall()


def test_an_agent_reports_its_reward_through_the_proxy(
    proxy: ProxyProc, upstream: FakeUpstream, rollout: str
) -> None:
    before = len(upstream.requests)
    with client(proxy, rollout) as c:
        url = proxy.env(rollout)["LGT_REWARD_URL"]
        r = c.post(url, json={"value": 0.75})
        assert r.status_code == 200 and r.json()["value"] == 0.75 and r.json()["attempt"] == 0
        for bad, message in (({"value": "high"}, "finite number"), ({"value": float("nan")}, None),
                             ([1], "JSON object")):
            r = c.post(url, content=json.dumps(bad), headers={"content-type": "application/json"})
            assert r.status_code == 400
            assert message is None or message in r.json()["error"]["message"]
        assert c.get(url).status_code == 404
        assert c.post("https://lgt.invalid/reward", json={"value": 1}).status_code == 200  # HTTPS
    with httpx.Client(trust_env=False) as c:  # reverse mode, attempt 2
        base = proxy.base_url(rollout, attempt=2)
        assert c.post(base.removesuffix("/v1") + "/reward", json={"value": 0.5}).status_code == 200
    assert len(upstream.requests) == before  # nothing was forwarded
    assert rewards_of(proxy, rollout) == [(0, None, 0.75, "proxy"), (0, None, 1.0, "proxy"),
                                          (2, None, 0.5, "proxy")]
    # the latest reward per attempt, from memory (what a rollout controller asks after each rollout)
    for attempt, value in ((0, 1.0), (2, 0.5), (1, None)):
        assert proxy.client.reward(rollout, attempt) == value
    assert proxy.client.request("GET", "/rewards?rollout_id=a%20b&attempt=x")[0] == 400


def test_an_evaluator_posts_rewards_to_the_control_api(proxy: ProxyProc, rollout: str) -> None:
    with client(proxy, rollout) as c:
        assert c.post(f"{HOSTED}/completions", json=COMPLETION).status_code == 200
    assert proxy.client.add_reward(rollout, 1)["attempt"] == 0
    status, body = proxy.client.request("POST", "/rewards", {"rollout_id": rollout + "-never", "value": 1})
    assert status == 404 and "has made no call" in body["error"]
    status, body = proxy.client.request("POST", "/rewards", {"rollout_id": rollout, "value": None})
    assert status == 400 and "finite number" in body["error"]
    assert rewards_of(proxy, rollout) == [(0, None, 1.0, "proxy")]


# -- listening for pods ---------------------------------------------------------------------------------


def listening(port: int) -> set[str]:
    """The local addresses a TCP socket listens on for ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, _, hexport = local.partition(":")
            if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                found.add(addr)
    return found


def test_listen_host_opens_the_proxy_to_pods_but_not_the_control_api(tmp_path, upstream) -> None:
    """--listen-host 0.0.0.0 (agents in pods): the proxy listens on every interface, credentials
    still required; the control API stays on loopback."""
    p = ProxyProc(tmp_path / "store", upstream.url, "--listen-host", "0.0.0.0").start()
    try:
        assert listening(p.port) == {"00000000"}  # 0.0.0.0
        assert listening(p.control_port) == {"0100007F"}  # 127.0.0.1
        with httpx.Client(proxy=p.url, trust_env=False) as c:
            assert c.post(f"{upstream.url}/completions", json=COMPLETION).status_code == 407
        with client(p, "pod-rollout") as c:
            assert c.post(f"{HOSTED}/completions", json=COMPLETION).status_code == 200
    finally:
        p.stop()


def test_a_control_api_beyond_loopback_needs_its_own_token(tmp_path, upstream) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "lgt.proxy.cli", "--store", str(tmp_path / "s"),
                          "--control-host", "0.0.0.0"], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "LGT_CONTROL_TOKEN"})
    assert out.returncode == 2
    assert "--control-host 0.0.0.0 opens the control API beyond this machine: give it its own token in " \
           "$LGT_CONTROL_TOKEN" in out.stderr
    token = "its-own-token-" + "x" * 20
    p = ProxyProc(tmp_path / "store", upstream.url, "--control-host", "0.0.0.0",
                  env={"LGT_CONTROL_TOKEN": token})
    try:
        p.start()
        assert listening(p.control_port) == {"00000000"}
        assert ControlClient(p.control_url, token).state()["paused"] is False
        with pytest.raises(ControlError):
            ControlClient(p.control_url, "derived-or-wrong").state()
    finally:
        p.stop()


@pytest.mark.parametrize("form", ["relative", "dotdot", "symlink", "home"])
def test_creds_hand_an_agent_absolute_paths_that_work_from_any_directory(
        proxy: ProxyProc, rollout: str, tmp_path: Path, form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``lgt-proxy creds --store ./runs/x/store``: the CA variables name the bundle by an absolute path,
    so an agent that starts in its own project (another directory) still trusts the proxy."""
    import subprocess
    import sys

    from click.testing import CliRunner

    from lgt.proxy.cli import main as proxy_cli

    store = proxy.store.resolve()
    here = tmp_path / "launch" / "from"
    here.mkdir(parents=True)
    monkeypatch.chdir(here)
    monkeypatch.setenv("HOME", str(store.parent.parent))
    arg = {"relative": os.path.relpath(store, here),
           "dotdot": os.path.relpath(store, here) + "/../" + store.name,
           "home": "~/" + str(store.relative_to(store.parent.parent)),
           "symlink": "link"}[form]
    if form == "symlink":
        (here / "link").symlink_to(os.path.relpath(store, here))
    out = CliRunner().invoke(proxy_cli, ["creds", rollout, "--store", arg, "--listen-port", str(proxy.port),
                                         "--format", "json"])
    assert out.exit_code == 0, out.output
    env = json.loads(out.output)
    for var in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS"):
        assert Path(env[var]).is_absolute() and Path(env[var]).is_file(), (var, env[var])
    elsewhere = tmp_path / "the" / "agents" / "project"
    elsewhere.mkdir(parents=True)
    agent = ("import httpx\n"  # an agent that trusts what SSL_CERT_FILE names and uses HTTPS_PROXY
             "r = httpx.post('https://api.openai.invalid/v1/chat/completions', json={'model': 'gpt-4o', "
             "'messages': [{'role': 'user', 'content': 'What is 6*7?'}]}, timeout=30)\n"
             "print(r.status_code, r.json()['choices'][0]['message']['content'])\n")
    clean = {k: v for k, v in os.environ.items() if k not in ("SSL_CERT_DIR", "ALL_PROXY", "all_proxy")}
    done = subprocess.run([sys.executable, "-c", agent], cwd=elsewhere, env={**clean, **env},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("200 The answer is")
    assert len(proxy.calls("rollout_id = ?", [rollout])) == 1


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
def test_an_output_limit_past_the_engines_context_is_left_to_the_engine(
        tmp_path: Path, rollout: str, key: str) -> None:
    """Harnesses ask for 32k-128k output tokens; vLLM 0.32 refuses a limit greater than its
    max_model_len (the fake does too: tests/test_real_vllm.py holds it to vLLM). The proxy reads the
    context from the model card and leaves such a limit out, with a note; a limit that fits is sent
    as asked."""
    with FakeUpstream.in_thread(port=0, max_model_len=32768) as upstream:
        proxy = ProxyProc(tmp_path / "store", upstream.url).start()
        try:
            check_output_limit(proxy, upstream, rollout, key)
        finally:
            proxy.stop()


def test_the_output_cap_bounds_every_routed_reply_and_is_recorded(tmp_path: Path, rollout: str) -> None:
    """``--max-output-tokens``: a call asking for more, or for no limit, is sent with the cap; one
    asking for less as it asked; the record of a capped call says so."""
    with FakeUpstream.in_thread(port=0, max_model_len=32768) as upstream:
        proxy = ProxyProc(tmp_path / "store", upstream.url, "--max-output-tokens", "16").start()
        try:
            with client(proxy, rollout) as c:
                for asked in (64000, None, 8):
                    body = {**CHAT, **({"max_tokens": asked} if asked else {})}
                    assert c.post(f"{HOSTED}/chat/completions", json=body).status_code == 200
                    assert upstream.requests[-1].body["max_tokens"] == (8 if asked == 8 else 16)
            rows = proxy.calls("rollout_id = ?", [rollout])
        finally:
            proxy.stop()
    assert [r["translation"] for r in rows] == [
        ["max_tokens 64000 lowered to 16 by the proxy's output cap (--max-output-tokens)"],
        ["no output limit asked: max_tokens 16 set by the proxy's output cap (--max-output-tokens)"], None]
    assert json.loads(rows[0]["request_json"])["max_tokens"] == 64000  # the agent's request, as sent


def check_output_limit(proxy: ProxyProc, upstream: FakeUpstream, rollout: str, key: str) -> None:
    with client(proxy, rollout) as c:
        r = c.post(f"{HOSTED}/chat/completions", json={**CHAT, key: 128000})
        assert r.status_code == 200, r.text
        assert key not in upstream.requests[-1].body
        assert c.post(f"{HOSTED}/chat/completions", json={**CHAT, key: 64}).status_code == 200
        assert upstream.requests[-1].body[key] == 64
    first, second = proxy.calls("rollout_id = ?", [rollout])
    assert first["translation"] == [f"{key} 128000 is more than the engine's context of 32768 tokens: "
                                    "left out, so the engine stops at the context's end"]
    assert second["translation"] is None and json.loads(first["request_json"])[key] == 128000
    with direct(upstream) as d:  # what the engine itself answers to it
        assert d.post("/chat/completions", json={**CHAT, key: 128000}).status_code == 400
