"""The control API's client (lgt.proxy.client) against a real lgt-proxy, and the callers built on it:
``lgt-proxy ctl`` and the trainer's ProxyClient."""

from __future__ import annotations

import socket
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from lgt.proxy import auth
from lgt.proxy.cli import main as lgt_proxy
from lgt.proxy.client import ControlClient, ControlError, resolve_token
from lgt.store.query import connect
from lgt.testing.fake_upstream import FakeUpstream
from lgt.testing.proxy import ProxyProc
from lgt.trainer.serving.proxy import ProxyClient, ProxyError, ProxyGroup

CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "What is 6*7?"}]}


def dead_port() -> int:
    with socket.socket() as s:  # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_call(proxy: ProxyProc, rollout: str) -> None:
    ctx = ssl.create_default_context(cafile=proxy.ca_bundle)
    with httpx.Client(proxy=proxy.proxy_url(rollout), verify=ctx, trust_env=False, timeout=30) as c:
        assert c.post("https://api.openai.invalid/v1/chat/completions", json=CHAT).status_code == 200


# -- the token ------------------------------------------------------------------------------------
def test_the_token_is_the_given_one_then_the_environment_then_the_secret(tmp_path: Path, clean_env) -> None:
    store = tmp_path / "store"
    derived = auth.control_token(auth.load_secret(store))
    assert resolve_token(store=store) == derived
    other = tmp_path / "other-secret"
    other.write_text("another secret\n")
    assert resolve_token(store=store, secret_file=other) == auth.control_token(b"another secret") != derived
    clean_env.setenv("LGT_CONTROL_TOKEN", "from-env")
    assert resolve_token(store=store) == "from-env"
    assert resolve_token(None, store) == "from-env"
    assert resolve_token("given", store) == "given"
    assert resolve_token("given") == "given"  # no store needed when the token is given
    clean_env.delenv("LGT_CONTROL_TOKEN")
    clean_env.setenv("LGT_PROXY_SECRET", "env secret")
    assert resolve_token(store=store) == auth.control_token(b"env secret")
    clean_env.delenv("LGT_PROXY_SECRET")
    with pytest.raises(ValueError, match="no secret"):
        resolve_token()


def test_the_resolved_token_opens_the_running_proxy(proxy: ProxyProc, clean_env) -> None:
    assert ControlClient(proxy.control_url, resolve_token(store=proxy.store)).state()["paused"] is False


# -- errors ---------------------------------------------------------------------------------------
def test_a_wrong_token_is_one_sentence_with_method_path_status_and_body(proxy: ProxyProc) -> None:
    api = ControlClient(proxy.control_url, "wrong")
    with pytest.raises(ControlError) as e:
        api.state()
    assert e.value.status == 401 and (e.value.method, e.value.path) == ("GET", "/state")
    assert str(e.value) == (f"lgt-proxy at {proxy.control_url} answered GET /state with 401: "
                            "control API: missing or wrong bearer token")
    assert api.request("GET", "/state") == (401, {"error": "control API: missing or wrong bearer token"})
    assert api.request("GET", "/healthz", auth=False) == (200, "ok\n")  # healthz wants no token
    assert api.healthz()
    assert "wrong" not in repr(api)  # the token stays out of reprs and tracebacks


def test_nothing_listening_is_a_control_error_without_a_status() -> None:
    api = ControlClient(f"http://127.0.0.1:{dead_port()}/", "t")
    assert not api.url.endswith("/")
    with pytest.raises(ControlError, match=r"^no lgt-proxy control API answers at http://127\.0\.0\.1:\d+ "
                                           r"\(POST /flush: .*refused.*\)$") as e:
        api.flush()
    assert e.value.status is None
    assert api.healthz(timeout=1) is False


def test_a_bad_request_names_the_servers_message(proxy: ProxyProc) -> None:
    with pytest.raises(ControlError, match=r"answered POST /resume with 400: policy_version must be a "
                                           r"non-negative integer, not -1$"):
        proxy.client.resume(policy_version=-1)


# -- round trips ----------------------------------------------------------------------------------
def test_pause_state_resume_flush_metrics(proxy: ProxyProc, rollout: str) -> None:
    api = proxy.client
    one_call(proxy, rollout)
    paused = api.pause(timeout=10)
    assert paused["paused"] is True and paused["drained"] is True and paused["in_flight_at_pause"] == 0
    assert api.state()["paused"] is True
    resumed = api.resume(policy_version=3)
    assert resumed["paused"] is False and resumed["policy_version"] == 3
    assert api.resume()["policy_version"] == 3  # no version: unchanged
    assert api.state()["policy_version"] == 3
    assert api.flush()["rows_written"] >= 1
    assert 'lgt_proxy_calls_total{status="ok"}' in api.metrics()
    api.resume(policy_version=0)


def test_rewards_round_trip(proxy: ProxyProc, rollout: str) -> None:
    api = proxy.client
    assert api.reward(rollout, 0) is None
    one_call(proxy, rollout)
    added = api.add_reward(rollout, 0.5)
    assert (added["rollout_id"], added["attempt"], added["value"]) == (rollout, 0, 0.5)
    api.add_reward(rollout, 0.25, attempt=0, call_id="c-1")  # a per-call reward: not the rollout's
    assert api.reward(rollout, 0) == 0.5 and api.reward(rollout, 1) is None
    with pytest.raises(ControlError, match="answered POST /rewards with 404: rollout .* has made no call"):
        api.add_reward(rollout, 1.0, attempt=4)
    api.flush()
    rows = connect(proxy.store).execute(
        "SELECT attempt, call_id, value FROM rewards_log WHERE rollout_id = ? ORDER BY value",
        [rollout]).fetchall()
    assert rows == [(0, "c-1", 0.25), (0, None, 0.5)]


def test_the_machines_proxy_settings_are_bypassed(proxy: ProxyProc, clean_env) -> None:
    dead = f"http://127.0.0.1:{dead_port()}"
    for var in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy"):
        clean_env.setenv(var, dead)
    with pytest.raises(urllib.error.URLError):  # an ordinary client obeys them and fails
        urllib.request.urlopen(proxy.control_url + "/healthz", timeout=5)
    api = proxy.client
    assert api.healthz() and api.state()["paused"] is False and "rows_written" in api.flush()


# -- callers --------------------------------------------------------------------------------------
def test_lgt_proxy_ctl(proxy: ProxyProc, clean_env) -> None:
    args = ["--store", str(proxy.store), "--control-port", str(proxy.control_port)]
    out = CliRunner().invoke(lgt_proxy, ["ctl", "state", *args])
    assert out.exit_code == 0, out.output
    assert '"paused": false' in out.output
    out = CliRunner().invoke(lgt_proxy, ["ctl", "metrics", *args])
    assert out.exit_code == 0 and "# TYPE lgt_proxy_in_flight gauge" in out.output
    out = CliRunner().invoke(lgt_proxy, ["ctl", "state", *args], env={"LGT_CONTROL_TOKEN": "wrong"})
    assert out.exit_code == 1
    assert "answered GET /state with 401: control API: missing or wrong bearer token" in out.output
    out = CliRunner().invoke(lgt_proxy, ["ctl", "state", "--store", str(proxy.store),
                                         "--control-port", str(dead_port())])
    assert out.exit_code == 1 and "no lgt-proxy control API answers at" in out.output


def test_the_trainers_proxy_client_delegates(proxy: ProxyProc, tmp_path: Path, clean_env) -> None:
    pc = ProxyClient.connect(proxy.store, proxy.control_url + "/", proxy.port)
    assert (pc.control_url, pc.token, pc.port) == (proxy.control_url, proxy.client.token, proxy.port)
    assert pc.pause(timeout=10)["drained"] is True
    assert pc.resume(2)["policy_version"] == 2 and pc.state()["policy_version"] == 2
    assert "rows_written" in pc.flush()
    pc.resume(0)
    with pytest.raises(ControlError, match="answered GET /state with 401"):
        ProxyClient.connect(proxy.store, proxy.control_url, proxy.port, token="wrong")


def test_the_trainers_proxy_client_starts_a_proxy(tmp_path: Path, upstream: FakeUpstream, clean_env) -> None:
    store = tmp_path / "store"
    pc = ProxyClient.start(store, upstream.url, log_path=tmp_path / "proxy.log", policy_version=5,
                           served_model="qwen-named", max_output_tokens=64)
    try:
        assert pc.token == auth.control_token(auth.load_secret(store))
        state = pc.state()
        assert state["policy_version"] == 5 and state["served_model"] == "qwen-named"
        assert pc.argv[pc.argv.index("--max-output-tokens") + 1] == "64"
        ProxyGroup([pc]).check_served("qwen-named")
        with pytest.raises(ProxyError, match=r"sends calls to model 'qwen-named', but the engine serves "
                                             r"'policy' \(engine.served_model_name\)"):
            ProxyGroup([pc]).check_served("policy")
    finally:
        pc.stop()
    assert pc.proc is not None and pc.proc.returncode is not None


def test_resume_names_the_served_model_the_next_calls_go_to(tmp_path: Path, upstream: FakeUpstream,
                                                            clean_env) -> None:
    """A LoRA run's resume names the new version's adapter: calls released after it are sent to that
    model and recorded at that version; a resume without one keeps it; a restart keeps it too."""
    store = tmp_path / "store"
    pc = ProxyClient.start(store, upstream.url, log_path=tmp_path / "proxy.log", served_model="policy")
    proxy = ProxyProc(store, upstream.url)
    proxy.port, proxy.control_port = pc.port, int(pc.control_url.rsplit(":", 1)[1])
    try:
        one_call(proxy, "r-served")  # version 0, the engine's own name
        pc.pause(timeout=10)
        assert pc.resume(1, served_model="policy-v1")["served_model"] == "policy-v1"
        one_call(proxy, "r-served")
        pc.pause(timeout=10)
        assert pc.resume(2)["served_model"] == "policy-v1"  # none named: unchanged
        one_call(proxy, "r-served")
        with pytest.raises(ControlError, match="answered POST /resume with 400: served_model must be the "
                                               "name of a model the upstream serves, not ''"):
            pc.api.resume(3, served_model="")
        assert pc.argv[pc.argv.index("--served-model") + 1] == "policy-v1"  # a restart starts with it
        ProxyGroup([pc]).check_served("policy")  # an adapter of the engine's model is its own
        pc.flush()
        rows = connect(store).execute("SELECT policy_version, served_model FROM calls WHERE rollout_id = "
                                      "'r-served' ORDER BY started_at").fetchall()
        assert rows == [(0, "policy"), (1, "policy-v1"), (2, "policy-v1")]
        # the model the upstream was asked for is the adapter's: the fake echoes it in its answer
        asked = [r.body["model"] for r in upstream.requests if r.path.endswith("/chat/completions")]
        assert asked[-3:] == ["policy", "policy-v1", "policy-v1"]
    finally:
        pc.stop()
