"""Capture never breaks a call, and every host an agent reaches is on the record.

A real proxy process in front of the fake vLLM, whose fault strings make it behave as vLLM's CPU build
does when a logprob is NaN (``__nan_logprob__``: a whole body cannot be written, 400; a stream sends
``null``) or as an upstream that refuses ``return_token_ids`` (``__reject_token_ids__``). The agent must
get what it would get without the proxy; the record says how much could be captured.
"""

from __future__ import annotations

import json
import re
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from lgt.testing.fake_upstream import FakeUpstream
from lgt.testing.proxy import ProxyProc, sse_objects, stable
from lgt.trainer.cli import main as lgt_train

HOSTED = "https://api.openai.invalid/v1"


def client(proxy: ProxyProc, rollout: str, **kw: Any) -> httpx.Client:
    ctx = ssl.create_default_context(cafile=proxy.ca_bundle)
    return httpx.Client(proxy=proxy.proxy_url(rollout), verify=ctx, trust_env=False, timeout=30, **kw)


def chat(text: str, **kw: Any) -> dict[str, Any]:
    return {"model": "gpt-4o", "messages": [{"role": "user", "content": text}], **kw}


def through_both(proxy: ProxyProc, upstream: FakeUpstream, rollout: str, path: str,
                 req: dict[str, Any]) -> tuple[httpx.Response, httpx.Response, list]:
    """The same request straight to the upstream and through the proxy; and what the upstream got
    from the proxy."""
    with httpx.Client(base_url=upstream.url, trust_env=False, timeout=30) as d:
        want = d.post(f"/{path}", json=req)
    before = len(upstream.requests)
    with client(proxy, rollout) as c:
        got = c.post(f"{HOSTED}/{path}", json=req)
    return want, got, [r.body for r in upstream.requests[before:] if r.method == "POST"]  # not model cards


def same_answer(want: httpx.Response, got: httpx.Response) -> None:
    assert got.status_code == want.status_code
    if want.headers["content-type"].startswith("text/event-stream"):
        assert stable(sse_objects(got.text)) == stable(sse_objects(want.text))
    else:
        assert stable(got.json()) == stable(want.json())


def degraded(proxy: ProxyProc) -> dict[str, int]:
    text = proxy.client.metrics()
    return {m[1]: int(m[2]) for m in
            re.finditer(r'^lgt_proxy_degraded_captures_total\{reason="(\w+)"\} (\d+)$', text, re.M)}


# -- an injected field the upstream refuses --------------------------------------------------------


@pytest.mark.parametrize("path,req", [
    ("chat/completions", chat("What is 6*7? __nan_logprob__")),
    ("completions", {"model": "gpt-4o", "prompt": "6*7 is __nan_logprob__", "max_tokens": 8}),
])
def test_a_call_refused_because_of_injected_logprobs_is_asked_again_without_them(
    proxy: ProxyProc, upstream: FakeUpstream, rollout: str, path: str, req: dict
) -> None:
    before = degraded(proxy).get("upstream_rejected_logprobs", 0)
    want, got, sent = through_both(proxy, upstream, rollout, path, req)
    assert want.status_code == 200  # without the proxy the agent's call succeeds ...
    same_answer(want, got)  # ... and through it too, with the same content
    assert len(sent) == 2  # asked with logprobs, refused, asked again without them
    assert sent[0]["logprobs"] in (True, 0) and sent[0]["return_token_ids"] is True
    assert "logprobs" not in sent[1] and sent[1]["return_token_ids"] is True
    [row] = proxy.calls("rollout_id = ?", [rollout])
    assert (row["status"], row["capture"], row["capture_reason"]) == \
        ("ok", "no_logprobs", "upstream_rejected_logprobs")
    assert row["prompt_token_ids"] and row["response_token_ids"] and row["response_logprobs"] is None
    assert degraded(proxy)["upstream_rejected_logprobs"] == before + 1


def test_then_without_token_ids_and_a_stream_comes_back_whole(
    proxy: ProxyProc, upstream: FakeUpstream, rollout: str
) -> None:
    req = chat("What is 6*7? __nan_logprob__ __reject_token_ids__", stream=True)
    want, got, sent = through_both(proxy, upstream, rollout, "chat/completions", req)
    assert want.status_code == 200 and got.headers["content-type"].startswith("text/event-stream")
    same_answer(want, got)
    # streamed: the NaN logprob does not fail the stream; the token ids are refused before it starts
    assert [("logprobs" in s, "return_token_ids" in s) for s in sent] == [(True, True), (False, True),
                                                                          (False, False)]
    [row] = proxy.calls("rollout_id = ?", [rollout])
    assert (row["status"], row["capture"], row["capture_reason"]) == \
        ("ok", "no_tokens", "upstream_rejected_token_ids")
    assert row["streamed"] and json.loads(row["response_json"])["choices"][0]["message"]["content"]


def test_a_non_finite_logprob_in_a_stream_drops_the_logprobs_not_the_call(
    proxy: ProxyProc, upstream: FakeUpstream, rollout: str
) -> None:
    want, got, sent = through_both(proxy, upstream, rollout, "chat/completions",
                                   chat("What is 6*7? __nan_logprob__", stream=True))
    same_answer(want, got)
    assert len(sent) == 1
    [row] = proxy.calls("rollout_id = ?", [rollout])
    assert (row["status"], row["capture"], row["capture_reason"]) == \
        ("ok", "no_logprobs", "nonfinite_logprobs")
    assert len(row["response_token_ids"]) > 2 and row["response_logprobs"] is None


def test_what_the_agent_asked_for_itself_is_never_dropped(
    proxy: ProxyProc, upstream: FakeUpstream, rollout: str
) -> None:
    want, got, sent = through_both(proxy, upstream, rollout, "chat/completions",
                                   chat("What is 6*7? __nan_logprob__", logprobs=True))
    assert want.status_code == got.status_code == 400  # the agent's own request fails without the proxy
    assert got.json() == want.json()
    assert [s.get("logprobs") for s in sent] == [True, True]  # only the injected token ids were retried
    assert "return_token_ids" not in sent[1]
    [row] = proxy.calls("rollout_id = ?", [rollout])
    assert (row["status"], row["http_status"], row["capture_reason"]) == ("http_error", 400, None)


def test_a_full_capture_says_so(proxy: ProxyProc, upstream: FakeUpstream, rollout: str) -> None:
    want, got, sent = through_both(proxy, upstream, rollout, "chat/completions", chat("What is 6*7?"))
    same_answer(want, got)
    [row] = proxy.calls("rollout_id = ?", [rollout])
    assert (row["capture"], row["capture_reason"]) == ("full", None) and len(sent) == 1


def test_errors_that_injection_cannot_cause_are_not_retried(
    proxy: ProxyProc, upstream: FakeUpstream, rollout: str
) -> None:
    want, got, sent = through_both(proxy, upstream, rollout, "chat/completions", chat("__status:429__"))
    assert got.status_code == want.status_code == 429 and len(sent) == 1


def test_observe_only_calls_are_not_degraded(tmp_path: Path, upstream: FakeUpstream, rollout: str) -> None:
    p = ProxyProc(tmp_path / "store", None).start()
    try:
        with client(p, rollout) as c:
            assert c.post(f"{upstream.url}/chat/completions", json=chat("hi")).status_code == 200
        [row] = p.calls()
        assert (row["capture"], row["capture_reason"]) == ("no_tokens", "hosted")  # the answer is the model's
        assert degraded(p) == {}
    finally:
        p.stop()


# -- egress on the record ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def internet() -> Iterator[FakeUpstream]:
    """A second local server standing in for a host on the internet."""
    with FakeUpstream.in_thread(port=0) as s:
        yield s


def test_every_host_an_agent_reaches_is_on_the_record(
    tmp_path: Path, upstream: FakeUpstream, internet: FakeUpstream, rollout: str
) -> None:
    p = ProxyProc(tmp_path / "store", upstream.url, "--egress", "allowlist",
                  "--allow-host", "localhost").start()
    try:
        with client(p, rollout) as c:
            ok = c.get(f"http://localhost:{internet.port}/health?api_key=sk-SECRET-9&page=2")
            blocked = c.post(f"http://127.0.0.2:{internet.port}/telemetry", content=b"x" * 10)
            llm = c.post(f"{HOSTED}/chat/completions", json=chat("hi"))
        assert (ok.status_code, blocked.status_code, llm.status_code) == (200, 403, 200)
        with httpx.Client(proxy=p.proxy_url(rollout), trust_env=False) as pinned:  # distrusts the CA
            with pytest.raises(httpx.ConnectError):
                pinned.get("https://pinned.invalid/")
        rows = sorted(_rows(p, "SELECT * FROM egress"), key=lambda r: r["started_at"])
        assert [(r["kind"], r["method"], r["host"], r["allowed"], r["status"]) for r in rows] == [
            ("http", "GET", "localhost", True, 200), ("http", "POST", "127.0.0.2", False, 403),
            ("tls_failed", None, "pinned.invalid", False, None)]
        first, second, third = rows
        assert third["port"] == 443 and "does not trust" in third["error"]
        assert first["path"] == "/health?api_key=***&page=2"  # redacted like calls
        assert first["port"] == internet.port and first["response_bytes"] == len(ok.content)
        assert second["request_bytes"] == 10 and second["policy"] == "allowlist"
        assert {r["rollout_id"] for r in rows} == {rollout}
        assert p.client.state()["blocked_egress"] == 1
    finally:
        p.stop()
    log = p.log_text()
    assert f"INFO egress blocked for rollout {rollout}: POST http://127.0.0.2/telemetry " \
           "(egress policy allowlist)" in log, log
    assert "sk-SECRET-9" not in log
    shown = CliRunner().invoke(lgt_train, ["show", "--store", str(p.store), rollout], color=False)
    assert shown.exit_code == 0, shown.output
    assert "egress · 3 requests besides LLM calls · 1 blocked" in shown.output
    assert "POST http://127.0.0.2/telemetry · blocked (allowlist)" in shown.output


def _rows(p: ProxyProc, sql: str) -> list[dict[str, Any]]:
    from lgt.store.query import connect

    p.flush()
    cur = connect(p.store).execute(sql)
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]

