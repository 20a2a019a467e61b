"""--upstream-timeout: a silent upstream ends the call (504 before the answer, an error event the
agent's SDK raises once a stream has begun), the call is recorded as upstream_timeout, a pause is not
held up by it, and a slow stream that keeps moving is never cut. The official SDKs are the agents."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from lgt.testing.fake_upstream import FakeUpstream
from lgt.testing.proxy import ProxyProc

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

TIMEOUT = 1.0
OPENAI_BASE = "https://api.openai.invalid/v1"
ANTHROPIC_BASE = "https://api.anthropic.invalid"


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory, upstream: FakeUpstream) -> Iterator[ProxyProc]:
    """This module's proxy (overrides conftest's): with --upstream-timeout."""
    p = ProxyProc(tmp_path_factory.mktemp("timeout") / "store", upstream.url,
                  "--upstream-timeout", str(TIMEOUT)).start()
    yield p
    p.stop()


def openai_client():
    return openai.OpenAI(base_url=OPENAI_BASE, api_key="sk-test", max_retries=0, timeout=20)


def anthropic_client():
    return anthropic.Anthropic(base_url=ANTHROPIC_BASE, api_key="sk-ant-test", max_retries=0, timeout=20)


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def rows_of(proxy: ProxyProc, rollout: str) -> list[tuple[str, str, int | None]]:
    return [(r["api"], r["status"], r["http_status"]) for r in proxy.calls("rollout_id = ?", [rollout])]


def test_an_upstream_silent_before_answering_is_answered_504_and_recorded(proxy, agent_env, rollout):
    with openai_client() as client:
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model="gpt-5-mini", messages=ask("hi __sleep:5__"))
        waited = time.monotonic() - t0
        assert err.value.status_code == 504 and "--upstream-timeout" in err.value.message
        assert TIMEOUT <= waited < TIMEOUT + 2.5
        with pytest.raises(openai.APIStatusError) as err:  # the Responses API: the same, in its shape
            client.responses.create(model="gpt-5-mini", input="hi __sleep:5__")
        assert err.value.status_code == 504
        # the connection the late answer would have come on is closed: the next call is answered normally
        assert client.chat.completions.create(model="gpt-5-mini", messages=ask("2+2")).choices[0].message
    with anthropic_client() as client:
        with pytest.raises(anthropic.APIStatusError) as aerr:
            client.messages.create(model="claude-sonnet-4-5", max_tokens=16, messages=ask("hi __sleep:5__"))
        assert aerr.value.status_code == 504 and aerr.value.body["type"] == "error"  # Anthropic's shape
        assert "--upstream-timeout" in aerr.value.body["error"]["message"]
    assert rows_of(proxy, rollout) == [("chat/completions", "upstream_timeout", 504),
                                       ("responses", "upstream_timeout", 504),
                                       ("chat/completions", "ok", 200),
                                       ("messages", "upstream_timeout", 504)]
    rows = proxy.calls("rollout_id = ? AND status = 'upstream_timeout'", [rollout])
    assert all("nothing for 1 s (--upstream-timeout)" in r["error"] for r in rows)


def test_a_stream_that_stops_ends_with_an_error_the_sdk_raises(proxy, agent_env, rollout):
    with openai_client() as client:
        got = []
        with pytest.raises(openai.APIError) as err:
            for chunk in client.chat.completions.create(model="gpt-5-mini", stream=True,
                                                        messages=ask("count __stall:5__")):
                got.append(chunk)
        assert got and "--upstream-timeout" in err.value.message  # it had begun, then stopped
        kinds = []
        with pytest.raises(RuntimeError, match="response.completed"):  # never came
            with client.responses.stream(model="gpt-5-mini", input="count __stall:5__") as stream:
                kinds += [event.type for event in stream]
                stream.get_final_response()
        assert kinds[0] == "response.created" and kinds[-1] == "response.failed"
    with anthropic_client() as client:
        with pytest.raises(anthropic.APIStatusError) as aerr:
            with client.messages.stream(model="claude-sonnet-4-5", max_tokens=32,
                                        messages=ask("count __stall:5__")) as stream:
                stream.get_final_message()
        assert "--upstream-timeout" in str(aerr.value)
    rows = proxy.calls("rollout_id = ?", [rollout])
    assert [(r["api"], r["status"], r["streamed"]) for r in rows] == [
        ("chat/completions", "upstream_timeout", True), ("responses", "upstream_timeout", True),
        ("messages", "upstream_timeout", True)]


def test_a_slow_stream_that_keeps_moving_is_not_cut(proxy, agent_env, rollout):
    with openai_client() as client:
        t0 = time.monotonic()
        chunks = list(client.chat.completions.create(model="gpt-5-mini", stream=True,
                                                     messages=ask("count slowly __drip:0.3__")))
        assert time.monotonic() - t0 > 2 * TIMEOUT  # longer than the timeout in all, never silent for it
    assert len(chunks) > 7 and rows_of(proxy, rollout) == [("chat/completions", "ok", 200)]


def test_a_pause_waits_for_a_silent_upstream_no_longer_than_the_timeout(proxy, agent_env, rollout):
    errors: list[Exception] = []

    def stuck() -> None:
        try:
            with openai_client() as client:
                client.chat.completions.create(model="gpt-5-mini", messages=ask("hi __sleep:30__"))
        except Exception as e:
            errors.append(e)

    t = threading.Thread(target=stuck)
    t.start()
    try:
        deadline = time.monotonic() + 5
        while proxy.client.state()["in_flight"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        state = proxy.client.pause(timeout=20)
        assert state["drained"] and state["drain_seconds"] < TIMEOUT + 1.5
    finally:
        proxy.client.resume()
        t.join(10)
    assert len(errors) == 1 and getattr(errors[0], "status_code", None) == 504
    assert rows_of(proxy, rollout) == [("chat/completions", "upstream_timeout", 504)]
