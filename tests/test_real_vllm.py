"""lgt-proxy in front of a real vLLM server (the CPU build, a tiny model made locally).

The fake upstream mirrors vLLM's wire format as read from its source; this test pins the proxy's
capture and stripping to the real thing: what an agent gets through the proxy equals what it gets
from vLLM directly, and the recorded token ids and logprobs equal vLLM's own.

Needs the engine environment (``.venv``, built by ``scripts/setup.sh``; or
``$LGT_ENGINE_PYTHON``): skipped where it is absent.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lgt.testing.proxy import ProxyProc, sse_objects, stable
from lgt.testing.vllm_server import vllm_server

ROOT = Path(__file__).resolve().parents[1]
ENGINE_PY = os.environ.get("LGT_ENGINE_PYTHON") or str(ROOT / ".venv" / "bin" / "python")

pytestmark = pytest.mark.slow


def _engine_ok() -> bool:
    if not Path(ENGINE_PY).exists():
        return False
    probe = subprocess.run([ENGINE_PY, "-c", "import vllm, transformers, tokenizers"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from serve_tiny_model(tmp_path_factory.mktemp("vllm"))


def serve_tiny_model(work: Path, *model_args: str) -> Iterator[str]:
    """vLLM's CPU build serving the tests' tiny model (lgt.testing.random_model); its /v1 URL."""
    if not _engine_ok():
        pytest.skip(f"no vLLM engine environment at {ENGINE_PY} (run scripts/setup.sh)")
    model = work / "tiny"
    subprocess.run([ENGINE_PY, "-m", "lgt.testing.random_model", str(model), *model_args],
                   check=True, capture_output=True)
    try:
        with vllm_server(model, work / "vllm.log", python=ENGINE_PY) as engine:
            yield engine.url
    finally:
        shutil.rmtree(model, ignore_errors=True)


@pytest.fixture(scope="module")
def real_proxy(tmp_path_factory: pytest.TempPathFactory, vllm_url: str) -> Iterator[ProxyProc]:
    p = ProxyProc(tmp_path_factory.mktemp("real") / "store", vllm_url).start()
    yield p
    p.stop()


def sse(text: str) -> list[Any]:
    """The stream's events; with n > 1, grouped by choice (vLLM interleaves choices in whatever
    order their tokens are ready, which differs between any two runs), each choice in order."""
    events = sse_objects(text)

    def choice(e: Any) -> int:
        return e["choices"][0]["index"] if isinstance(e, dict) and e["choices"] else 1 << 30

    return sorted(events, key=choice)


def folded(events: list[Any]) -> dict[str, Any]:
    """A stream's events as what they add up to: per choice, the text (or content) and each other
    field's last value; the events' other fields (model, object, usage, …) by their last value."""
    out: dict[str, Any] = {"choices": {}}
    for e in events:
        if not isinstance(e, dict):
            out["end"] = e
            continue
        out.update({k: v for k, v in e.items() if k != "choices"})
        for c in e.get("choices") or []:
            mine = out["choices"].setdefault(str(c.get("index", 0)), {})
            delta = c.get("delta") if isinstance(c.get("delta"), dict) else c
            for k, v in delta.items():
                if k in ("text", "content", "reasoning_content") and isinstance(v, str):
                    mine[k] = mine.get(k, "") + v
                elif k == "logprobs" and isinstance(v, dict):
                    for lk, lv in v.items():
                        mine.setdefault("logprobs", {}).setdefault(lk, [])
                        mine["logprobs"][lk] += lv if isinstance(lv, list) else [lv]
                elif v is not None:
                    mine[k] = v
            for k, v in c.items():
                if k not in ("delta", "text", "logprobs", "index") and v is not None:
                    mine[k] = v
    return out


ASK = {"model": "policy", "messages": [{"role": "user", "content": "What is 2+3?"}],
       "max_tokens": 12, "temperature": 0}
CASES = {
    "chat": ("chat/completions", ASK),
    "chat-n2": ("chat/completions", {**ASK, "n": 2, "temperature": 1.0, "seed": 7}),
    "chat-own-logprobs": ("chat/completions", {**ASK, "logprobs": True, "top_logprobs": 2}),
    "chat-usage": ("chat/completions", {**ASK, "stream_options": {"include_usage": True}}),
    # a limit the prompt leaves no room for: vLLM clamps it (as the fake upstream does)
    "chat-limit-clamped": ("chat/completions", {**ASK, "max_tokens": 512}),
    "completions": ("completions", {"model": "policy", "prompt": "What is 2+3?",
                                    "max_tokens": 12, "temperature": 0}),
}


@pytest.mark.parametrize("case,stream", [(c, s) for c in sorted(CASES) for s in (False, True)
                                         if s or "stream_options" not in CASES[c][1]])
def test_agent_sees_what_vllm_sends(real_proxy: ProxyProc, vllm_url: str, rollout: str,
                                    case: str, stream: bool) -> None:
    path, body = CASES[case]
    body = {**body, "stream": stream}
    ctx = ssl.create_default_context(cafile=real_proxy.ca_bundle)
    with httpx.Client(trust_env=False, timeout=60) as d, \
            httpx.Client(proxy=real_proxy.proxy_url(rollout), verify=ctx, trust_env=False,
                         timeout=60) as c:
        want = d.post(f"{vllm_url}/{path}", json=body)
        got = c.post(f"https://api.openai.invalid/v1/{path}", json={**body, "model": "gpt-4o"})
    assert got.status_code == want.status_code == 200
    w = sse(want.text) if stream else want.json()
    g = sse(got.text) if stream else got.json()
    # vLLM echoes the served name; through the proxy the agent sees the name it asked for
    assert '"model": "policy"' not in json.dumps(g) and '"model": "gpt-4o"' in json.dumps(g)
    assert json.dumps(w).count('"model": "policy"') > 0
    if stream:  # how vLLM cuts a stream into events depends on its load: compare what the events say
        w, g = folded(w), folded(g)
    assert stable(g) == json.loads(json.dumps(stable(w)).replace('"model": "policy"',
                                                                 '"model": "gpt-4o"'))
    [row] = real_proxy.calls("rollout_id = ?", [rollout])
    assert row["status"] == "ok" and row["streamed"] is stream
    assert row["prompt_token_ids"] and row["response_token_ids"]
    assert len(row["response_logprobs"]) == len(row["response_token_ids"])


def test_recorded_tokens_and_logprobs_are_vllms_own(real_proxy: ProxyProc, vllm_url: str,
                                                    rollout: str) -> None:
    ask = {**ASK, "messages": [{"role": "user", "content": "What is 4+4?"}]}
    ref = httpx.post(f"{vllm_url}/chat/completions", trust_env=False, timeout=60,
                     json={**ask, "return_token_ids": True, "logprobs": True}).json()
    ctx = ssl.create_default_context(cafile=real_proxy.ca_bundle)
    with httpx.Client(proxy=real_proxy.proxy_url(rollout), verify=ctx, trust_env=False,
                      timeout=60) as c:
        for stream in (False, True):
            assert c.post("https://api.openai.invalid/v1/chat/completions",
                          json={**ask, "stream": stream}).status_code == 200
    want_lp = [e["logprob"] for e in ref["choices"][0]["logprobs"]["content"]]
    rows = real_proxy.calls("rollout_id = ?", [rollout])
    assert [r["streamed"] for r in rows] == [False, True]
    for row in rows:
        assert row["prompt_token_ids"] == ref["prompt_token_ids"]
        assert row["response_token_ids"] == ref["choices"][0]["token_ids"]
        assert row["response_logprobs"] == pytest.approx(want_lp, abs=1e-5)
        assert row["usage_total_tokens"] == ref["usage"]["total_tokens"]


# -- a real vLLM that refuses the injected logprobs --------------------------------------------------


@pytest.fixture(scope="module")
def nan_vllm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """vLLM serving a model whose logits are NaN: every request for logprobs gets 400."""
    yield from serve_tiny_model(tmp_path_factory.mktemp("vllm-nan"), "--nan-logits")


def test_a_call_vllm_refuses_for_the_injected_logprobs_still_reaches_the_agent(
    tmp_path: Path, nan_vllm_url: str, rollout: str
) -> None:
    ask = {**ASK, "max_tokens": 4}
    with httpx.Client(trust_env=False, timeout=60) as d:
        refused = d.post(f"{nan_vllm_url}/chat/completions", json={**ask, "logprobs": True})
        want = d.post(f"{nan_vllm_url}/chat/completions", json=ask)
    assert refused.status_code == 400 and "Out of range float values" in refused.text  # the issue's
    assert want.status_code == 200
    p = ProxyProc(tmp_path / "store", nan_vllm_url).start()
    try:
        ctx = ssl.create_default_context(cafile=p.ca_bundle)
        with httpx.Client(proxy=p.proxy_url(rollout), verify=ctx, trust_env=False, timeout=60) as c:
            got = c.post("https://api.openai.invalid/v1/chat/completions", json={**ask, "model": "gpt-4o"})
            streamed = c.post("https://api.openai.invalid/v1/chat/completions",
                              json={**ask, "model": "gpt-4o", "stream": True})
        assert got.status_code == 200 and streamed.status_code == 200
        assert stable(got.json()) == json.loads(json.dumps(stable(want.json())).replace(
            '"model": "policy"', '"model": "gpt-4o"'))
        whole, stream = p.calls("rollout_id = ?", [rollout])
        assert (whole["status"], whole["capture"], whole["capture_reason"]) == \
            ("ok", "no_logprobs", "upstream_rejected_logprobs")
        assert (stream["status"], stream["capture"], stream["capture_reason"]) == \
            ("ok", "no_logprobs", "nonfinite_logprobs")
        for row in (whole, stream):
            assert row["prompt_token_ids"] and row["response_token_ids"] and row["response_logprobs"] is None
    finally:
        p.stop()


# -- the Responses and Messages APIs, translated, next to vLLM's own endpoints for them ----------------

def test_responses_and_messages_sdks_get_what_vllm_serves(real_proxy: ProxyProc, vllm_url: str,
                                                           rollout: str, clean_env) -> None:
    """The official SDKs, greedy: through the proxy (translated to chat/completions) the text equals
    what the same SDK gets from vLLM's own /v1/responses and /v1/messages, and the recorded tokens are
    those vLLM's chat/completions gives for the same conversation."""
    anthropic = pytest.importorskip("anthropic")
    openai = pytest.importorskip("openai")
    question = "What is 2+3?"
    ask_r = {"input": question, "max_output_tokens": 12, "temperature": 0,
             "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    ask_m = {"max_tokens": 12, "extra_body": {"temperature": 0},  # this SDK has no temperature argument
             "messages": [{"role": "user", "content": question}]}
    oai, ant = dict(api_key="sk-x", max_retries=0), dict(api_key="sk-ant-x", max_retries=0)
    want_r = openai.OpenAI(base_url=vllm_url, **oai).responses.create(model="policy", **ask_r)
    want_m = anthropic.Anthropic(base_url=vllm_url.removesuffix("/v1"), **ant).messages.create(
        model="policy", **ask_m)
    ref = httpx.post(f"{vllm_url}/chat/completions", trust_env=False, timeout=60, json={
        "model": "policy", "messages": ask_m["messages"], "max_tokens": 12, "temperature": 0,
        "return_token_ids": True, "logprobs": True}).json()
    for k, v in real_proxy.env(rollout).items():  # the agent's environment, as the trainer sets it
        clean_env.setenv(k, v)
    got_r = openai.OpenAI(base_url="https://api.openai.invalid/v1", **oai).responses.create(
        model="gpt-5-mini", **ask_r)
    got_m = anthropic.Anthropic(base_url="https://api.anthropic.invalid", **ant).messages.create(
        model="claude-x", **ask_m)
    assert got_r.output_text == want_r.output_text and got_r.model == "gpt-5-mini"
    got_lp, want_lp = got_r.output[0].content[0].logprobs, want_r.output[0].content[0].logprobs
    assert [lp.token for lp in got_lp] == [lp.token for lp in want_lp] and got_lp  # the agent's own ask
    assert [lp.logprob for lp in got_lp] == pytest.approx([lp.logprob for lp in want_lp], abs=1e-3)
    assert all(len(lp.top_logprobs) == 2 for lp in got_lp)
    assert got_m.content[0].text == want_m.content[0].text and got_m.model == "claude-x"
    assert got_m.usage.input_tokens == want_m.usage.input_tokens
    rows = real_proxy.calls("rollout_id = ?", [rollout])
    assert [r["api"] for r in rows] == ["responses", "messages"]
    for row in rows:
        assert row["prompt_token_ids"] == ref["prompt_token_ids"]
        assert row["response_token_ids"] == ref["choices"][0]["token_ids"]
        assert row["capture"] == "full"


def test_a_limit_past_the_engines_context_is_refused_by_vllm_and_left_out_by_the_proxy(
        real_proxy: ProxyProc, vllm_url: str, rollout: str) -> None:
    """What the fake upstream copies: vLLM 0.32 answers 400 to a max_tokens greater than max_model_len;
    through the proxy, which read the context from vLLM's model card, the call is answered."""
    body = {**ASK, "max_tokens": 128000}
    ctx = ssl.create_default_context(cafile=real_proxy.ca_bundle)
    with httpx.Client(trust_env=False, timeout=60) as d, \
            httpx.Client(proxy=real_proxy.proxy_url(rollout), verify=ctx, trust_env=False, timeout=60) as c:
        want = d.post(f"{vllm_url}/chat/completions", json=body)
        got = c.post("https://api.openai.invalid/v1/chat/completions", json=body)
    assert want.status_code == 400
    assert "max_tokens=128000 cannot be greater than max_model_len=512" in want.text
    assert got.status_code == 200
    [row] = real_proxy.calls("rollout_id = ?", [rollout])
    assert row["translation"] == ["max_tokens 128000 is more than the engine's context of 512 tokens: left "
                                  "out, so the engine stops at the context's end"]
