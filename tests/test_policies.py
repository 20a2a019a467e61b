"""Several policies behind one proxy (``lgt.proxy.policies``, docs/policies.md): the rules read on the
requests the real harnesses sent (tests/fixtures/harnesses) in every dialect, the section refused in one
sentence, and through a real ``lgt-proxy`` in front of the fake engine: each call recorded under its
policy and sent upstream as that policy's served model, changed at run time through the control API."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from lgt.proxy import dialects, policies
from lgt.proxy.client import ControlError
from lgt.proxy.policies import Facts, PolicyError
from lgt.testing.fake_upstream import FakeUpstream
from lgt.testing.proxy import ProxyProc

FIXTURES = Path(__file__).parent / "fixtures" / "harnesses"
KIND_OF = {"main-tool-call": "main", "main-final": "main", "side": "side", "side-json": "side",
           "router": "side"}


def recorded() -> list[tuple[str, dict[str, Any]]]:
    """(the fixture's kind, its request) of every model call a harness sent."""
    out = []
    for f in sorted(FIXTURES.glob("*/[0-9]*.json")):
        kinds = sorted(KIND_OF, key=len, reverse=True)
        kind = next((k for k in kinds if f.name[3:].startswith(k + "-")), None)
        if kind is not None:
            out.append((KIND_OF[kind], {**json.loads(f.read_text()), "name": f"{f.parent.name}/{f.name}"}))
    return out


def facts_of(call: dict[str, Any]) -> Facts:
    """The facts the proxy reads from a call: the chat request it builds (and the agent's own)."""
    path, body = call["path"], call["body"]
    api = dialects.api_of("POST", path)
    if api is None:
        return policies.facts(body, None, body.get("model"))
    agent = dialects.agent_request(api, path, body)
    return policies.facts(dialects.to_chat(api, agent, None, []), agent, agent.get("model"))


CALLS = recorded()


def test_the_recordings_hold_main_and_side_calls_of_every_dialect() -> None:
    apis = {(kind, dialects.api_of("POST", c["path"])) for kind, c in CALLS}
    assert {("main", a) for a in (None, *dialects.APIS)} <= apis
    assert {("side", dialects.GEMINI), ("side", dialects.RESPONSES)} <= apis


@pytest.mark.parametrize(("kind", "call"), CALLS, ids=[c["name"] for _, c in CALLS])
def test_kind_of_every_recorded_call(kind: str, call: dict[str, Any]) -> None:
    assert facts_of(call).kind == kind


def test_system_and_model_are_read_in_every_dialect() -> None:
    by_name = {c["name"]: c for _, c in CALLS}
    cases = {  # fixture -> (the requested model, a phrase of its system prompt)
        "claude_code.minimal/03-main-tool-call-anthropic-messages.json": ("claude-opus-5-5", "Claude agent"),
        "gemini/01-router-googleapis-generatecontent.json": ("gemini-3.5-flash-lite", "Task Routing AI"),
        "opencode/02-side-openai-responses.json": ("gpt-5.4-nano", "title generator"),
        "qwen/01-main-tool-call-aliyuncs-completions.json": ("qwen3-coder-plus", "Qwen Code"),
    }
    for name, (model, phrase) in cases.items():
        f = facts_of(by_name[name])
        assert f.model == model and phrase in f.system, name


def section() -> list[dict[str, Any]]:
    return [{"name": "coder", "served": "coder-v0"},
            {"name": "planner", "match": {"model": "planner*"}, "served": "planner-v0"},
            {"name": "side", "match": [{"kind": "side"}, {"system": "(?i)title generator"}],
             "served": "side-v0"},
            {"name": "reviewer", "match": {"system": "(?i)you are a reviewer", "kind": "main"}}]


def test_the_first_policy_whose_rule_holds_takes_the_call() -> None:
    ps = policies.parse(section())
    assert ps.assign(Facts("planner-7b", "", "main")) == "planner"
    assert ps.assign(Facts("gpt-5", "You are a reviewer.", "main")) == "reviewer"
    assert ps.assign(Facts("gpt-5", "You are a reviewer.", "side")) == "side"  # reviewer's rule: main only
    assert ps.assign(Facts("gpt-5", "", "main")) == "coder"  # no rule: the first policy
    assert ps.assign(Facts(None, "", "main")) == "coder"
    assert ps.overlaps == {}
    assert ps.assign(Facts("planner", "", "side")) == "planner"  # planner's and side's: the first, counted
    assert ps.overlaps == {("planner", "side"): 1}
    assert ps.state()["calls"] == {"coder": 2, "planner": 2, "side": 1, "reviewer": 1}
    assert ps.served_as("reviewer", "policy") == "policy" and ps.served_as("side", "policy") == "side-v0"


def test_served_models_change_whole_or_not_at_all() -> None:
    ps = policies.parse(section())
    ps.set_served({"planner": "planner-v3", "reviewer": "reviewer-v1"})
    assert ps.served_as("planner", None) == "planner-v3" and ps.served_as("reviewer", None) == "reviewer-v1"
    with pytest.raises(PolicyError, match=r"'nobody' is not one of this proxy's policies \(coder, planner"):
        ps.set_served({"planner": "planner-v4", "nobody": "x"})
    with pytest.raises(PolicyError, match="must be a model name, not 3"):
        ps.set_served({"planner": 3})
    assert ps.served_as("planner", None) == "planner-v3"
    ps.set_served({"planner": None})
    assert ps.served_as("planner", "policy") == "policy"


BAD = [
    ([], "policies must be a list of at least one policy"),
    ({"name": "a"}, "policies must be a list of at least one policy"),
    ([{"name": "a"}, {"name": "a", "match": {"kind": "side"}}], "two policies are named 'a'"),
    ([{"name": "a b"}], r"policies\[0\].name must be a plain name"),
    ([{"name": "a", "rule": {}}],
     r"policies\[0\] has unknown key\(s\) rule \(known: name, match, served, upstream\)"),
    ([{"name": "a"}, {"name": "b", "match": {"modle": "x"}}],
     r"policy 'b''s rule has unknown condition\(s\) modle \(known: model, system, kind\), so it would match "
     "nothing it could"),
    ([{"name": "a"}, {"name": "b", "match": {"system": "(unclosed"}}],
     r"policy 'b''s rule: system '\(unclosed' is not a regular expression"),
    ([{"name": "a"}, {"name": "b", "match": {"kind": "title"}}], "kind must be main or side, not 'title'"),
    ([{"name": "a"}, {"name": "b"}], "policy 'b' has no match rule, so no call would reach it"),
    ([{"name": "a"}, {"name": "b", "match": []}],
     "match must be a rule or a list of rules, not an empty list"),
    ([{"name": "a"}, {"name": "b", "match": {"model": "planner"}},
      {"name": "c", "match": {"model": "planner"}}],
     r"policy 'c' and policy 'b' have the same rule \{model: 'planner'\}: a call cannot belong to both"),
    ([{"name": "a"}, {"name": "b", "match": {}}, {"name": "c", "match": {"kind": "side"}}],
     "policy 'c' comes after policy 'b', whose empty rule takes every call"),
    ([{"name": "a", "served": ""}], "served must be a model name"),
    ([{"name": "a", "upstream": "gpu2:8000"}],
     r"policy 'a': upstream must be an engine's http\(s\) base URL like http://127.0.0.1:8001/v1, "
     "not 'gpu2:8000'"),
]


@pytest.mark.parametrize(("spec", "message"), BAD, ids=[m[:40] for _, m in BAD])
def test_a_section_that_cannot_work_is_refused_in_one_sentence(spec: Any, message: str) -> None:
    with pytest.raises(PolicyError, match=message) as e:
        policies.parse(spec)
    assert "\n" not in str(e.value)


# --- through the proxy ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def judge_engine() -> Any:
    """A second engine: a policy of its own model there."""
    with FakeUpstream.in_thread(port=0, served_model="judge-7b") as up:
        yield up


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory, upstream: FakeUpstream, judge_engine: FakeUpstream):
    root = tmp_path_factory.mktemp("policies")
    judge = {"name": "judge", "match": {"model": "judge"}, "served": "judge-7b", "upstream": judge_engine.url}
    (root / "policies.json").write_text(json.dumps([*section(), judge]))
    p = ProxyProc(root / "store", upstream.url, "--policies", str(root / "policies.json")).start()
    yield p
    p.stop()


def agent(proxy: ProxyProc, rollout: str) -> httpx.Client:
    """What an agent with HTTPS_PROXY holds: any hosted host, through the proxy."""
    ctx = ssl.create_default_context(cafile=proxy.ca_bundle)
    return httpx.Client(proxy=proxy.proxy_url(rollout), verify=ctx, trust_env=False, timeout=30,
                        headers={"authorization": "Bearer sk-agent", "x-api-key": "sk-ant-agent"})


def send(client: httpx.Client, call: dict[str, Any]) -> httpx.Response:
    """The call sent where the harness sent it (the proxy routes every LLM call to the engine)."""
    r = client.post(call["url"], json=call["body"])
    r.read()
    return r


def posts(upstream: FakeUpstream) -> list[Any]:
    return [r for r in upstream.requests if r.method == "POST"]


def fixture(name: str) -> dict[str, Any]:
    return {**json.loads((FIXTURES / name).read_text()), "name": name}


def test_each_call_is_recorded_under_its_policy_and_served_as_its_model(proxy, upstream, rollout) -> None:
    chat_tools = [{"type": "function", "function": {"name": "Write", "parameters": {"type": "object"}}}]
    sends = [  # (what the agent sends, the policy it belongs to, the model the engine is asked for)
        (fixture("claude_code.minimal/03-main-tool-call-anthropic-messages.json"), "coder", "coder-v0"),
        (fixture("opencode/02-side-openai-responses.json"), "side", "side-v0"),
        (fixture("gemini/01-router-googleapis-generatecontent.json"), "side", "side-v0"),
        (fixture("gemini.minimal/01-main-tool-call-googleapis-streamgeneratecontent.json"), "coder",
         "coder-v0"),
        (fixture("qwen.minimal/01-main-tool-call-openai-completions.json"), "coder", "coder-v0"),
        ({"name": "planner-openai-chat", "url": "https://api.openai.invalid/v1/chat/completions",
          "body": {"model": "planner-large", "messages": [{"role": "user", "content": "Plan it."}]}},
         "planner", "planner-v0"),  # a side call too by its shape: the first policy's rule wins
        ({"name": "reviewer-openai-chat", "url": "https://api.openai.invalid/v1/chat/completions",
          "body": {"model": "gpt-5", "tools": chat_tools, "messages": [
              {"role": "system", "content": "You are a reviewer."}, {"role": "user", "content": "Review."}]}},
         "reviewer", "policy"),  # no served model of its own: the proxy's --served-model
    ]
    with agent(proxy, rollout) as client:
        for call, _, served in sends:
            before = len(posts(upstream))
            r = send(client, call)
            assert r.status_code == 200, (call["name"], r.text[:300])
            assert posts(upstream)[-1].body["model"] == served and len(posts(upstream)) == before + 1
    rows = proxy.calls("rollout_id = ?", [rollout])
    assert [(r["policy"], r["served_model"], r["status"]) for r in rows] == [
        (p, s, "ok") for _, p, s in sends]
    state = proxy.client.state()["policies"]
    assert state["overlaps"] == {"planner > side": 1} and state["default"] == "coder"
    metrics = proxy.client.metrics()
    assert 'lgt_proxy_policy_calls_total{policy="side"} 2' in metrics
    assert "lgt_proxy_policy_overlaps_total 1" in metrics


def test_a_policy_on_another_engine_is_sent_there(proxy, upstream, judge_engine, rollout) -> None:
    tools = [{"type": "function", "function": {"name": "verdict", "parameters": {"type": "object"}}}]
    body = {"model": "judge", "tools": tools, "messages": [{"role": "user", "content": "Is 6*7 42?"}]}
    before = len(posts(upstream))
    with agent(proxy, rollout) as client:
        r = client.post("https://api.openai.invalid/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["model"] == "judge"  # the agent's name, put back
    assert len(posts(upstream)) == before  # the shared engine was not asked
    sent = posts(judge_engine)[-1]
    assert sent.path == "/v1/chat/completions" and sent.body["model"] == "judge-7b"
    assert "authorization" not in sent.headers  # the agent's key never leaves for an engine
    (row,) = proxy.calls("rollout_id = ?", [rollout])
    assert (row["policy"], row["upstream"], row["served_model"], row["capture"]) == (
        "judge", judge_engine.url, "judge-7b", "full")
    assert row["response_token_ids"] and proxy.client.state()["policies"]["upstreams"] == {
        "judge": judge_engine.url}


def test_the_control_api_changes_a_policys_served_model(proxy, upstream, rollout) -> None:
    body = {"model": "planner", "messages": [{"role": "user", "content": "Plan it."}]}
    ctl = proxy.client
    with agent(proxy, rollout) as client:
        assert ctl.set_served({"planner": "planner-v1"})["served"]["planner"] == "planner-v1"
        assert client.post("https://api.openai.invalid/v1/chat/completions", json=body).status_code == 200
        assert upstream.requests[-1].body["model"] == "planner-v1"
        ctl.pause(10)  # as the trainer does after an update: the new adapter named as the proxy resumes
        assert ctl.call("POST", "/resume", {"policy_version": 4, "served": {"planner": "planner-v2"}}
                        )["policies"]["served"]["planner"] == "planner-v2"
        assert client.post("https://api.openai.invalid/v1/chat/completions", json=body).status_code == 200
        assert upstream.requests[-1].body["model"] == "planner-v2"
    with pytest.raises(ControlError, match="'writer' is not one of this proxy's policies"):
        ctl.set_served({"writer": "w"})
    with pytest.raises(ControlError, match="served must be a JSON object"):
        ctl.call("POST", "/resume", {"served": ["planner"]})
    assert ctl.state()["policies"]["served"]["planner"] == "planner-v2"  # a refused change changed nothing
    rows = proxy.calls("rollout_id = ?", [rollout])
    assert [(r["policy"], r["served_model"], r["policy_version"]) for r in rows] == [
        ("planner", "planner-v1", 0), ("planner", "planner-v2", 4)]


def test_without_policies_every_call_is_the_default_policys(tmp_path: Path, upstream, rollout) -> None:
    p = ProxyProc(tmp_path / "store", upstream.url).start()
    try:
        with agent(p, rollout) as client:
            r = client.post("https://api.openai.invalid/v1/chat/completions",
                            json={"model": "planner", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and upstream.requests[-1].body["model"] == "policy"
        assert [row["policy"] for row in p.calls()] == ["default"]
        assert p.client.state()["policies"]["served"] == {"default": None}
    finally:
        p.stop()


def test_a_bad_policies_file_stops_the_proxy_before_it_starts(tmp_path: Path) -> None:
    bad = tmp_path / "policies.json"
    bad.write_text(json.dumps([{"name": "a"}, {"name": "b", "match": {"system": "(x"}}]))
    store = tmp_path / "store"

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "lgt.proxy.cli", "--store", str(store), "--policies",
                               str(bad), "--listen-port", "0", *args], capture_output=True, text=True,
                              timeout=60)

    out = run("--upstream", "http://127.0.0.1:9/v1")
    assert out.returncode == 2
    assert f"--policies {bad}: policy 'b''s rule: system '(x' is not a regular expression" in out.stderr
    bad.write_text(json.dumps([{"name": "a", "upstream": "http://127.0.0.1:9/v1"}]))
    out = run()
    assert out.returncode == 2 and "--policies: a policy's upstream needs --upstream" in out.stderr
    bad.write_text("[{")
    assert f"--policies {bad} is not valid JSON" in run("--upstream", "http://127.0.0.1:9/v1").stderr
    assert not store.exists()  # nothing written
