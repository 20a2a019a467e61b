"""Real HTTP clients, through a real ``lgt-proxy`` process, against the real fake vLLM upstream.

Every test makes real calls over loopback and checks both sides:

* what the agent sees: the same content the upstream answers directly for the same request, the
  ``model`` the agent asked for, and no ``token_ids`` / ``prompt_token_ids`` / ``logprobs`` values
  unless the agent asked for them (the keys stay, set to null, as vLLM sends them);
* what the store holds: exactly the expected record(s) for the test's rollout, with the token ids
  and logprobs the upstream produced, the streamed flag, and the host the agent aimed at.

Agents that look as if they call a hosted API aim at ``api.openai.invalid`` (HTTPS, intercepted with
the proxy's CA). The module's proxy runs with ``--egress deny``, so nothing that is not an LLM call
can leave loopback through it even if a client library tried.

The Node.js test needs ``undici`` in ``tests/clients/node/node_modules`` (``scripts/setup.sh`` runs
``npm ci`` there when npm is present); it is skipped otherwise.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import ipaddress
import json
import os
import shutil
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lgt.proxy import auth
from lgt.testing.clients import CHAT, SERVED, post_direct, ref_tokens
from lgt.testing.fake_upstream import FakeUpstream
from lgt.testing.proxy import ProxyProc
from lgt.trainer.serving.children import free_port

COMPLETIONS = "completions"
INVALID_BASE = "https://api.openai.invalid/v1"
INVALID_HOST = "api.openai.invalid"
MODEL = "gpt-4o"
CLIENTS_DIR = Path(__file__).parent / "clients"
NODE_DIR = CLIENTS_DIR / "node"

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}]


# --- fixtures -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory, upstream: FakeUpstream) -> Iterator[ProxyProc]:
    """This module's proxy (overrides conftest's): the same, with --egress deny as a safety net."""
    p = ProxyProc(tmp_path_factory.mktemp("clients") / "store", upstream.url,
                  "--egress", "deny").start()
    yield p
    p.stop()


class LazyProxy:
    """A proxy started on first use, inside the test, so that a proxy that cannot start fails the
    tests that need it rather than erroring in setup."""

    def __init__(self, make: Any) -> None:
        self.make, self.proc, self.error = make, None, None

    def get(self) -> ProxyProc:
        if self.error is None and self.proc is None:
            try:
                self.proc = self.make().start()
            except RuntimeError as e:
                self.error = e
        if self.error is not None:
            raise RuntimeError(f"lgt-proxy did not start: {self.error}")
        return self.proc


@pytest.fixture(scope="module")
def reverse_proxy(tmp_path_factory: pytest.TempPathFactory,
                  upstream: FakeUpstream) -> Iterator[tuple[LazyProxy, int]]:
    """A proxy that also runs mitmproxy's own reverse mode on another port (started lazily)."""
    port = free_port()
    lazy = LazyProxy(lambda: ProxyProc(tmp_path_factory.mktemp("reverse") / "store", upstream.url,
                                       "--reverse-port", str(port), "--egress", "deny"))
    yield lazy, port
    if lazy.proc is not None:
        lazy.proc.stop()


@pytest.fixture(scope="module")
def tls_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (SAN IP) and its key, made with `cryptography`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lgt test upstream")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    d = tmp_path_factory.mktemp("tls")
    cert_path, key_path = d / "upstream-cert.pem", d / "upstream-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture(scope="module")
def tls_upstream(tls_cert: tuple[Path, Path]) -> Iterator[FakeUpstream]:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(*map(str, tls_cert))
    with FakeUpstream.in_thread(port=0, ssl_context=ctx) as up:
        yield up


@pytest.fixture(scope="module")
def tls_proxy(tmp_path_factory: pytest.TempPathFactory, tls_upstream: FakeUpstream,
              tls_cert: tuple[Path, Path]) -> Iterator[ProxyProc]:
    """Routes to the HTTPS upstream, trusting its certificate through --upstream-ca."""
    p = ProxyProc(tmp_path_factory.mktemp("tls-ca") / "store", tls_upstream.url,
                  "--upstream-ca", str(tls_cert[0]), "--egress", "deny").start()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def tls_proxy_untrusted(tmp_path_factory: pytest.TempPathFactory,
                        tls_upstream: FakeUpstream) -> Iterator[ProxyProc]:
    """Routes to the HTTPS upstream without being told to trust its self-signed certificate."""
    p = ProxyProc(tmp_path_factory.mktemp("tls-no-ca") / "store", tls_upstream.url,
                  "--egress", "deny").start()
    yield p
    p.stop()


def set_env(mp: pytest.MonkeyPatch, env: dict[str, str]) -> dict[str, str]:
    for k, v in env.items():
        mp.setenv(k, v)
    return env


# --- the reference: what the upstream answers directly --------------------------------------------

def reference(up: FakeUpstream, endpoint: str, body: dict[str, Any],
              context: ssl.SSLContext | None = None) -> dict[str, Any]:
    """The upstream's direct, non-streamed answer to `body` as the proxy forwards it: served model,
    token ids and logprobs requested (so the record's expected values can be read from it)."""
    b = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    b["model"] = SERVED
    b["return_token_ids"] = True
    if endpoint == CHAT:
        b["logprobs"] = b.get("logprobs") or True
    elif b.get("logprobs") is None:
        b["logprobs"] = 0
    return post_direct(f"{up.url}/{endpoint}", b, context)


def agent_view(ref: dict[str, Any], model: str = MODEL, *, logprobs: bool = False,
               token_ids: bool = False) -> dict[str, Any]:
    """What the agent must receive for `ref`: its own model name, injected fields back to null."""
    exp = copy.deepcopy(ref)
    exp["model"] = model
    if not token_ids and "prompt_token_ids" in exp:
        exp["prompt_token_ids"] = None
    for ch in exp["choices"]:
        if not token_ids:
            ch["token_ids"] = None
            if "prompt_token_ids" in ch:
                ch["prompt_token_ids"] = None
        if not logprobs:
            ch["logprobs"] = None
    return exp


def without_ids(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("id", "created")}


def assert_same_body(got: dict[str, Any], ref: dict[str, Any], model: str = MODEL,
                     **kw: bool) -> None:
    """Byte-for-byte the upstream's answer, apart from the random id / created time."""
    assert isinstance(got.get("id"), str) and got["id"]
    assert without_ids(got) == without_ids(agent_view(ref, model, **kw))


def content_of(endpoint: str, obj: dict[str, Any]) -> list[tuple]:
    """(text, tool calls, finish_reason) per choice of a whole response."""
    out = []
    for ch in sorted(obj["choices"], key=lambda c: c["index"]):
        if endpoint == CHAT:
            msg = ch["message"]
            calls = [(c["id"], c["function"]["name"], c["function"]["arguments"])
                     for c in msg.get("tool_calls") or ()]
            out.append((msg.get("content") or "", calls, ch["finish_reason"]))
        else:
            out.append((ch["text"], [], ch["finish_reason"]))
    return out


def assert_clean(obj: dict[str, Any], model: str = MODEL, *, logprobs: bool = False,
                 token_ids: bool = False) -> None:
    """No injected values reach the agent (a whole body or one stream chunk)."""
    assert obj.get("model") == model, obj
    if not token_ids:
        assert obj.get("prompt_token_ids") is None, obj
    for ch in obj.get("choices") or ():
        if not token_ids:
            assert ch.get("token_ids") is None, ch
            assert ch.get("prompt_token_ids") is None, ch
        if not logprobs:
            assert ch.get("logprobs") is None, ch


def assemble(endpoint: str, chunks: list[dict[str, Any]]) -> list[tuple]:
    """A stream's chunks (plain dicts) as content_of() would see the equivalent whole response."""
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for ch in chunk.get("choices") or ():
            c = choices.setdefault(ch["index"], {"text": "", "calls": {}, "finish": None})
            if ch.get("finish_reason") is not None:
                c["finish"] = ch["finish_reason"]
            if endpoint == COMPLETIONS:
                c["text"] += ch.get("text") or ""
                continue
            delta = ch.get("delta") or {}
            c["text"] += delta.get("content") or ""
            for tc in delta.get("tool_calls") or ():
                slot = c["calls"].setdefault(tc.get("index", 0), ["", "", ""])
                slot[0] = tc.get("id") or slot[0]
                fn = tc.get("function") or {}
                slot[1] += fn.get("name") or ""
                slot[2] += fn.get("arguments") or ""
    return [(c["text"], [tuple(v) for _, v in sorted(c["calls"].items())], c["finish"])
            for _, c in sorted(choices.items())]


def parse_sse(lines: Iterable[str | bytes]) -> tuple[list[dict[str, Any]], bool]:
    """JSON payloads of `data:` lines, and whether `[DONE]` ended the stream (nothing after it)."""
    chunks, done = [], False
    for line in lines:
        if isinstance(line, bytes):
            line = line.decode()
        line = line.strip()
        if not line.startswith("data:"):
            assert not line or line.startswith(":"), f"unexpected SSE line {line!r}"
            continue
        data = line[5:].strip()
        assert not done, f"data after [DONE]: {data!r}"
        if data == "[DONE]":
            done = True
        else:
            chunks.append(json.loads(data))
    return chunks, done


def check_stream(endpoint: str, chunks: list[dict[str, Any]], done: bool, ref: dict[str, Any],
                 model: str = MODEL) -> None:
    assert done, "the agent did not receive [DONE]"
    assert len(chunks) > 2, "not a real stream"
    for chunk in chunks:
        assert_clean(chunk, model)
    assert assemble(endpoint, chunks) == content_of(endpoint, ref)


# --- the store ------------------------------------------------------------------------------------

@dataclass
class Expect:
    ref: dict[str, Any]
    endpoint: str = CHAT
    streamed: bool = False
    host: str = INVALID_HOST
    model: str = MODEL


def check_records(p: ProxyProc, rollout: str, expects: list[Expect],
                  upstream_url: str | None = None) -> list[dict[str, Any]]:
    rows = p.calls("rollout_id = ?", [rollout])
    assert len(rows) == len(expects), [(r["seq"], r["status"], r["error"]) for r in rows]
    for seq, (row, e) in enumerate(zip(rows, expects)):
        assert (row["status"], row["error"], row["http_status"]) == ("ok", None, 200), row
        assert (row["attempt"], row["seq"]) == (0, seq)
        assert row["endpoint"] == e.endpoint
        assert row["streamed"] is e.streamed
        assert row["original_host"] == e.host
        assert row["requested_model"] == e.model
        assert row["served_model"] == SERVED
        assert row["upstream"] == (upstream_url or p.upstream).rstrip("/")
        prompt_ids, ids, logprobs = ref_tokens(e.endpoint, e.ref)
        assert row["prompt_token_ids"] and row["prompt_token_ids"] == prompt_ids
        assert row["response_token_ids"] and row["response_token_ids"] == ids
        assert len(row["response_logprobs"]) == len(row["response_token_ids"])
        assert row["response_logprobs"] == pytest.approx(logprobs, abs=1e-6)
        assert row["finish_reason"] == e.ref["choices"][0]["finish_reason"]
        assert row["usage_prompt_tokens"] == len(prompt_ids)
        stored = json.loads(row["response_json"])  # what the agent received (streams re-assembled)
        assert stored["model"] == e.model
        assert content_of(e.endpoint, stored) == content_of(e.endpoint, e.ref)
    return rows


def chat_body(text: str, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **kw}


# --- 1. the official openai SDK -------------------------------------------------------------------

def openai_client(base_url: str = INVALID_BASE, api_key: str = "sk-test", **kw: Any):
    from openai import OpenAI

    return OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=20, **kw)


def async_openai_client(base_url: str = INVALID_BASE, api_key: str = "sk-test"):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=20)


def test_openai_sync_chat(proxy, upstream, agent_env, rollout):
    body = chat_body("What is 6 times 7?", max_tokens=64)
    with openai_client() as client:
        r = client.chat.completions.create(**body)
    ref = reference(upstream, CHAT, body)
    got = r.model_dump()
    assert r.model == MODEL
    assert_clean(got)
    assert r.choices[0].message.content == ref["choices"][0]["message"]["content"]
    assert content_of(CHAT, got) == content_of(CHAT, ref)
    assert r.usage.prompt_tokens == ref["usage"]["prompt_tokens"]
    check_records(proxy, rollout, [Expect(ref)])


def test_openai_async_chat(proxy, upstream, agent_env, rollout):
    body = chat_body("Async hello", temperature=0.0)

    async def main():
        async with async_openai_client() as client:
            return await client.chat.completions.create(**body)

    r = asyncio.run(main())
    ref = reference(upstream, CHAT, body)
    assert r.model == MODEL
    assert_clean(r.model_dump())
    assert content_of(CHAT, r.model_dump()) == content_of(CHAT, ref)
    check_records(proxy, rollout, [Expect(ref)])


@pytest.mark.parametrize("include_usage", [False, True])
def test_openai_stream_sync(proxy, upstream, agent_env, rollout, include_usage):
    body = chat_body("Stream to me", stream_options={"include_usage": include_usage})
    with openai_client() as client:
        chunks = [c.model_dump() for c in client.chat.completions.create(**body, stream=True)]
    ref = reference(upstream, CHAT, body)
    check_stream(CHAT, chunks, True, ref)
    if include_usage:
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"]
    check_records(proxy, rollout, [Expect(ref, streamed=True)])


def test_openai_stream_async(proxy, upstream, agent_env, rollout):
    body = chat_body("Async stream please", max_tokens=50)

    async def main():
        async with async_openai_client() as client:
            stream = await client.chat.completions.create(**body, stream=True)
            return [c.model_dump() async for c in stream]

    chunks = asyncio.run(main())
    ref = reference(upstream, CHAT, body)
    check_stream(CHAT, chunks, True, ref)
    check_records(proxy, rollout, [Expect(ref, streamed=True)])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_openai_tool_round_trip(proxy, upstream, agent_env, rollout, stream):
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 17 * 23?"}]
    first_body = {"model": MODEL, "messages": list(messages), "tools": TOOLS}
    with openai_client() as client:
        if stream:
            chunks = [c.model_dump() for c in
                      client.chat.completions.create(**first_body, stream=True)]
            (text, calls, finish), = assemble(CHAT, chunks)
            for c in chunks:
                assert_clean(c)
        else:
            r1 = client.chat.completions.create(**first_body)
            assert_clean(r1.model_dump())
            (text, calls, finish), = content_of(CHAT, r1.model_dump())
        ref1 = reference(upstream, CHAT, first_body)
        assert (text, calls, finish) == content_of(CHAT, ref1)[0]
        assert finish == "tool_calls" and len(calls) == 1
        call_id, name, arguments = calls[0]
        assert name == "calculator" and json.loads(arguments) == {"expression": "What is 17 * 23?"}
        # The agent runs the tool and sends its result back.
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": arguments}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": "391"})
        second_body = {"model": MODEL, "messages": messages, "tools": TOOLS}
        r2 = client.chat.completions.create(**second_body)
    ref2 = reference(upstream, CHAT, second_body)
    assert r2.model == MODEL
    assert_clean(r2.model_dump())
    assert r2.choices[0].message.content == "The result is 391."
    assert content_of(CHAT, r2.model_dump()) == content_of(CHAT, ref2)
    rows = check_records(proxy, rollout, [Expect(ref1, streamed=stream), Expect(ref2)])
    # The second prompt extends the first: prompt + generated tool call + the tool turn.
    first_prompt = rows[0]["prompt_token_ids"]
    assert rows[1]["prompt_token_ids"][:len(first_prompt)] == first_prompt
    stored = json.loads(rows[0]["response_json"])
    assert stored["choices"][0]["message"]["tool_calls"][0]["id"] == call_id


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_openai_completions(proxy, upstream, agent_env, rollout, stream):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40}
    with openai_client() as client:
        if stream:
            chunks = [c.model_dump() for c in client.completions.create(**body, stream=True)]
        else:
            r = client.completions.create(**body)
    ref = reference(upstream, COMPLETIONS, body)
    if stream:
        check_stream(COMPLETIONS, chunks, True, ref)
    else:
        assert r.model == MODEL
        assert_clean(r.model_dump())
        assert r.choices[0].text == ref["choices"][0]["text"] != ""
        assert content_of(COMPLETIONS, r.model_dump()) == content_of(COMPLETIONS, ref)
    check_records(proxy, rollout, [Expect(ref, endpoint=COMPLETIONS, streamed=stream)])


def test_openai_agent_asks_for_logprobs_and_token_ids(proxy, upstream, agent_env, rollout):
    """What the agent asked for itself is passed through, not stripped."""
    body = chat_body("Show me logprobs", logprobs=True, top_logprobs=2)
    with openai_client() as client:
        raw = client.chat.completions.with_raw_response.create(**body)
        raw2 = client.chat.completions.with_raw_response.create(
            **chat_body("And token ids"), extra_body={"return_token_ids": True})
    r, got, got2 = raw.parse(), raw.http_response.json(), raw2.http_response.json()
    ref = reference(upstream, CHAT, body)
    ref2 = reference(upstream, CHAT, chat_body("And token ids"))
    assert r.model == MODEL
    assert r.choices[0].logprobs is not None and len(r.choices[0].logprobs.content) > 0
    assert len(got["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    assert_same_body(got, ref, logprobs=True)  # the agent's logprobs, token ids still stripped
    assert got2["prompt_token_ids"] and got2["choices"][0]["token_ids"]
    assert_same_body(got2, ref2, token_ids=True)  # the agent's token ids, logprobs still stripped
    check_records(proxy, rollout, [Expect(ref), Expect(ref2)])


def test_openai_loopback_model_server_is_intercepted(proxy, upstream, agent_env, rollout):
    """An agent aimed at a model server on 127.0.0.1 still goes through the proxy (NO_PROXY="")."""
    assert os.environ["NO_PROXY"] == "" and os.environ["no_proxy"] == ""
    body = chat_body("Loopback please")
    with openai_client(base_url=upstream.url, api_key="sk-agent-secret") as client:
        r = client.chat.completions.create(**body)
    seen = upstream.requests[-1]
    assert seen.body["model"] == SERVED and seen.body["return_token_ids"] is True
    assert "authorization" not in seen.headers
    ref = reference(upstream, CHAT, body)
    assert r.model == MODEL
    assert_clean(r.model_dump())
    assert content_of(CHAT, r.model_dump()) == content_of(CHAT, ref)
    check_records(proxy, rollout, [Expect(ref, host="127.0.0.1")])


def test_no_proxy_loopback_bypasses_the_proxy(proxy, upstream, agent_env, rollout, clean_env):
    """Why creds empties NO_PROXY: with 127.0.0.1 listed, the call goes straight to the model
    server — unrecorded, with the agent's model name and its API key."""
    clean_env.setenv("NO_PROXY", "127.0.0.1")
    clean_env.setenv("no_proxy", "127.0.0.1")
    before = len(upstream.requests)
    with openai_client(base_url=upstream.url, api_key="sk-agent-secret") as client:
        r = client.chat.completions.create(**chat_body("Bypass"))
    assert len(upstream.requests) == before + 1
    seen = upstream.requests[-1]
    assert seen.body["model"] == MODEL and "return_token_ids" not in seen.body
    assert seen.headers["authorization"] == "Bearer sk-agent-secret"
    assert r.model == MODEL
    assert proxy.calls("rollout_id = ?", [rollout]) == []


# --- 2. other Python HTTP clients -----------------------------------------------------------------

CHAT_URL = f"{INVALID_BASE}/chat/completions"
AUTH = {"Authorization": "Bearer sk-test"}


def check_chat(proxy: ProxyProc, upstream: FakeUpstream, rollout: str, body: dict[str, Any],
               got: Any) -> None:
    """What a raw client got for ``body`` — a whole JSON body, or (chunks, done) from a stream —
    equals the upstream's direct answer, and the store holds the one matching record."""
    ref = reference(upstream, CHAT, body)
    stream = isinstance(got, tuple)
    if stream:
        check_stream(CHAT, *got, ref)
    else:
        assert_same_body(got, ref)
    check_records(proxy, rollout, [Expect(ref, streamed=stream)])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_httpx(proxy, upstream, agent_env, rollout, stream):
    import httpx

    body = chat_body("httpx here", stream=stream)
    with httpx.Client(timeout=20) as client:  # trust_env defaults to True
        if stream:
            with client.stream("POST", CHAT_URL, json=body, headers=AUTH) as r:
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                chunks, done = parse_sse(r.iter_lines())
        else:
            r = client.post(CHAT_URL, json=body, headers=AUTH)
            assert r.status_code == 200, r.text
    check_chat(proxy, upstream, rollout, body, (chunks, done) if stream else r.json())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_requests(proxy, upstream, agent_env, rollout, stream):
    import requests

    body = chat_body("requests here", stream=stream)
    with requests.Session() as s:
        r = s.post(CHAT_URL, json=body, headers=AUTH, stream=stream, timeout=20)
        assert r.status_code == 200, r.text
        if stream:
            chunks, done = parse_sse(r.iter_lines())
    check_chat(proxy, upstream, rollout, body, (chunks, done) if stream else r.json())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_aiohttp(proxy, upstream, agent_env, rollout, stream):
    """aiohttp (trust_env=True) in an agent process started with the rollout's environment.

    Not in-process: aiohttp builds its default SSL context when imported (this process imported it
    long before, for the fake upstream), so SSL_CERT_FILE only counts if set before the import."""
    pytest.importorskip("aiohttp")
    body = chat_body("aiohttp here", stream=stream)
    out = subprocess.run([sys.executable, str(CLIENTS_DIR / "aiohttp_agent.py"), CHAT_URL,
                          json.dumps(body)], capture_output=True, text=True, timeout=30,
                         env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["status"] == 200, got
    if stream:
        assert got["content_type"].startswith("text/event-stream")
    check_chat(proxy, upstream, rollout, body,
               parse_sse(got["body"].splitlines()) if stream else json.loads(got["body"]))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_urllib(proxy, upstream, agent_env, rollout, stream, monkeypatch):
    # urlopen() caches its opener (and the proxies it read from the environment) on first use.
    monkeypatch.setattr(urllib.request, "_opener", None)
    body = chat_body("urllib here", stream=stream)
    req = urllib.request.Request(CHAT_URL, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **AUTH})
    with urllib.request.urlopen(req, timeout=20) as r:
        assert r.status == 200
        if stream:
            chunks, done = parse_sse(r)
        else:
            got = json.loads(r.read())
    check_chat(proxy, upstream, rollout, body, (chunks, done) if stream else got)


def test_wrong_proxy_token_is_refused(proxy, upstream, rollout, clean_env):
    """Proxy credentials with a wrong token: the CONNECT gets 407; nothing forwarded or recorded."""
    import httpx

    env = proxy.env(rollout)
    bad = env["HTTPS_PROXY"].replace(env["HTTPS_PROXY"].split(":")[2].split("@")[0], "0" * 32)
    assert bad != env["HTTPS_PROXY"]
    set_env(clean_env, {**env, "HTTPS_PROXY": bad, "https_proxy": bad})
    before = len(upstream.requests)
    with httpx.Client(timeout=20) as client:
        with pytest.raises(httpx.ProxyError, match="407"):
            client.post(CHAT_URL, json=chat_body("let me in"), headers=AUTH)
    assert len(upstream.requests) == before
    assert proxy.calls("rollout_id = ?", [rollout]) == []


# --- 3. curl --------------------------------------------------------------------------------------

def run_curl(url: str, body: dict[str, Any], *extra: str) -> tuple[int, str]:
    out = subprocess.run(
        ["curl", "-sS", "--max-time", "20", "-X", "POST", url,
         "-H", "Content-Type: application/json", "-H", "Authorization: Bearer sk-curl",
         "--data-binary", "@-", "-w", "\n%{http_code}", *extra],
        input=json.dumps(body), capture_output=True, text=True, timeout=30, env=dict(os.environ),
    )
    assert out.returncode == 0, out.stderr
    text, _, status = out.stdout.rpartition("\n")
    return int(status), text


@pytest.mark.parametrize("target", ["https-invalid", "http-loopback"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_curl(proxy, upstream, agent_env, rollout, stream, target):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    # curl reads https_proxy/HTTPS_PROXY, only lowercase http_proxy, and CURL_CA_BUNDLE.
    assert os.environ["http_proxy"] and os.environ["CURL_CA_BUNDLE"] == proxy.ca_bundle
    base, host = ((INVALID_BASE, INVALID_HOST) if target == "https-invalid"
                  else (upstream.url, "127.0.0.1"))
    body = chat_body(f"curl {target}", stream=stream)
    status, text = run_curl(f"{base}/chat/completions", body, *(["-N"] if stream else []))
    assert status == 200, text
    ref = reference(upstream, CHAT, body)
    if stream:
        check_stream(CHAT, *parse_sse(text.splitlines()), ref)
    else:
        assert_same_body(json.loads(text), ref)
    check_records(proxy, rollout, [Expect(ref, streamed=stream, host=host)])


# --- 4. litellm -----------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:.*ReadOnly.*:UserWarning")  # pydantic, on importing litellm
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_litellm(proxy, upstream, agent_env, rollout, stream, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # read at import: no download
    monkeypatch.setenv("LITELLM_TELEMETRY", "False")
    monkeypatch.setenv("LITELLM_LOG", "ERROR")
    litellm = pytest.importorskip("litellm")
    monkeypatch.setattr(litellm, "telemetry", False, raising=False)
    # litellm caches its OpenAI/httpx clients per process (keyed by api_key, api_base, ...), and a
    # client keeps the proxy settings it read from the environment when it was built: without this,
    # a second rollout in the same process is sent with the first rollout's proxy credentials.
    litellm.in_memory_llm_clients_cache.flush_cache()
    messages = [{"role": "user", "content": f"litellm {'stream' if stream else 'whole'}"}]
    before = len(upstream.requests)
    r = litellm.completion(model=f"openai/{MODEL}", api_base=INVALID_BASE, api_key="sk-litellm",
                           messages=messages, stream=stream, max_retries=0, timeout=20)
    if stream:
        chunks = [c.model_dump() for c in r]
    assert len(upstream.requests) == before + 1
    sent = upstream.requests[-1].body  # what litellm sent, as the proxy forwarded it
    assert sent["model"] == SERVED and sent["messages"] == messages
    ref = reference(upstream, CHAT, sent)
    if stream:
        text = "".join((c["choices"][0]["delta"].get("content") or "")
                       for c in chunks if c.get("choices"))
        assert text == ref["choices"][0]["message"]["content"]
        for c in chunks:
            assert c.get("model") == MODEL, c.get("model")
            for ch in c.get("choices") or ():
                assert ch.get("logprobs") is None and ch.get("token_ids") is None
    else:
        got = r.model_dump()
        assert r.model == MODEL
        assert r.choices[0].message.content == ref["choices"][0]["message"]["content"]
        assert got.get("prompt_token_ids") is None
        assert got["choices"][0].get("logprobs") is None
        assert got["choices"][0].get("token_ids") is None
    check_records(proxy, rollout, [Expect(ref, streamed=stream)])


# --- 5. Node.js built-in fetch --------------------------------------------------------------------

def run_node(url: str, body: dict[str, Any], preload: bool) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("NODE_OPTIONS", None)
    if preload:
        env["NODE_OPTIONS"] = f"--import {(NODE_DIR / 'preload.mjs').as_uri()}"
    out = subprocess.run(["node", str(NODE_DIR / "client.mjs"), url, json.dumps(body)],
                         capture_output=True, text=True, timeout=30, env=env, cwd=NODE_DIR)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture
def node() -> None:
    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    if not (NODE_DIR / "node_modules" / "undici" / "package.json").exists():
        pytest.skip("run `npm install` in tests/clients/node "
                    "(it installs undici, for EnvHttpProxyAgent)")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_node_fetch_with_env_proxy_agent(proxy, upstream, agent_env, rollout, stream, node):
    body = chat_body(f"node {stream}", stream=stream)
    got = run_node(CHAT_URL, body, preload=True)
    assert got["status"] == 200, got
    ref = reference(upstream, CHAT, body)
    if stream:
        assert got["contentType"].startswith("text/event-stream")
        check_stream(CHAT, *parse_sse(got["body"].splitlines()), ref)
    else:
        assert_same_body(json.loads(got["body"]), ref)
    check_records(proxy, rollout, [Expect(ref, streamed=stream)])


def test_node_fetch_without_preload_bypasses_the_proxy(proxy, upstream, agent_env, rollout, node):
    """Node's fetch ignores HTTP(S)_PROXY: without the preload a loopback call is not recorded."""
    before = len(upstream.requests)
    got = run_node(f"{upstream.url}/chat/completions", chat_body("node direct"), preload=False)
    assert got["status"] == 200, got
    assert json.loads(got["body"])["model"] == MODEL
    assert len(upstream.requests) == before + 1
    assert upstream.requests[-1].body["model"] == MODEL  # not rewritten: it never met the proxy
    assert proxy.calls("rollout_id = ?", [rollout]) == []


# --- 6. reverse mode (base_url=, no proxy environment) --------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_reverse_path_on_proxy_port(proxy, upstream, rollout, clean_env, stream):
    base = proxy.base_url(rollout)
    assert base.startswith(f"{proxy.url}/r/{rollout}/")
    body = chat_body(f"reverse {stream}")
    with openai_client(base_url=base) as client:
        check_reverse_chat(proxy, upstream, rollout, client, body, stream)
        # The model listing names the served model and the names agents asked for
        listed = [m.id for m in client.models.list()]
        assert listed[0] == SERVED and MODEL in listed


def check_reverse_chat(p: ProxyProc, upstream: FakeUpstream, rollout: str, client: Any,
                       body: dict[str, Any], stream: bool) -> None:
    """One chat call through a reverse-mode base URL: the agent's view and the record."""
    if stream:
        chunks = [c.model_dump() for c in client.chat.completions.create(**body, stream=True)]
    else:
        r = client.chat.completions.create(**body)
    ref = reference(upstream, CHAT, body)
    if stream:
        check_stream(CHAT, chunks, True, ref)
    else:
        assert r.model == MODEL
        assert_clean(r.model_dump())
        assert content_of(CHAT, r.model_dump()) == content_of(CHAT, ref)
    check_records(p, rollout, [Expect(ref, streamed=stream, host="127.0.0.1")])


def reverse_port_base(p: ProxyProc, port: int, rollout: str, token: str | None = None) -> str:
    token = token or auth.rollout_token(p.secret, rollout)
    return f"http://127.0.0.1:{port}/r/{rollout}/{token}/v1"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_reverse_port(reverse_proxy, upstream, rollout, clean_env, stream):
    lazy, port = reverse_proxy
    p = lazy.get()
    body = chat_body(f"reverse port {stream}")
    with openai_client(base_url=reverse_port_base(p, port, rollout)) as client:
        check_reverse_chat(p, upstream, rollout, client, body, stream)


@pytest.mark.parametrize("bad", ["zeros", "other-rollout"])
@pytest.mark.parametrize("where", ["proxy-port",
                                   "reverse-port"])
def test_reverse_wrong_token_is_refused(proxy, reverse_proxy, upstream, rollout, clean_env, where,
                                        bad):
    import openai

    if where == "proxy-port":
        p, base = proxy, proxy.url
    else:
        p, base = reverse_proxy[0].get(), f"http://127.0.0.1:{reverse_proxy[1]}"
    token = "0" * 32 if bad == "zeros" else auth.rollout_token(p.secret, rollout + "-other")
    assert token != auth.rollout_token(p.secret, rollout)
    before = len(upstream.requests)
    with openai_client(base_url=f"{base}/r/{rollout}/{token}/v1") as client:
        with pytest.raises(openai.AuthenticationError) as exc:
            client.chat.completions.create(**chat_body("let me in"))
    assert exc.value.status_code == 401
    assert exc.value.body["type"] == "authentication_error"
    assert token not in json.dumps(exc.value.body)
    assert len(upstream.requests) == before  # nothing forwarded
    assert p.calls("rollout_id = ?", [rollout]) == []  # nothing recorded


# --- 7. an HTTPS upstream -------------------------------------------------------------------------

def test_https_upstream_with_upstream_ca(tls_proxy, tls_upstream, tls_cert, rollout, clean_env):
    set_env(clean_env, tls_proxy.env(rollout))
    body = chat_body("over TLS", max_tokens=30)
    with openai_client() as client:
        r = client.chat.completions.create(**body)
        chunks = [c.model_dump() for c in client.chat.completions.create(**body, stream=True)]
    ctx = ssl.create_default_context(cafile=str(tls_cert[0]))
    ref = reference(tls_upstream, CHAT, body, context=ctx)
    assert r.model == MODEL
    assert_clean(r.model_dump())
    assert content_of(CHAT, r.model_dump()) == content_of(CHAT, ref)
    check_stream(CHAT, chunks, True, ref)
    assert tls_upstream.requests[-1].body["model"] == SERVED
    check_records(tls_proxy, rollout, [Expect(ref), Expect(ref, streamed=True)],
                  upstream_url=tls_upstream.url)


def test_https_upstream_untrusted_is_a_502(tls_proxy_untrusted, tls_upstream, rollout, clean_env):
    import httpx

    p = tls_proxy_untrusted
    set_env(clean_env, p.env(rollout))
    before = len(tls_upstream.requests)
    with httpx.Client(timeout=20) as client:
        r = client.post(CHAT_URL, json=chat_body("untrusted TLS"), headers=AUTH)
    assert r.status_code == 502, r.text
    assert len(tls_upstream.requests) == before  # the TLS handshake failed: no request got there
    rows = p.calls("rollout_id = ?", [rollout])
    assert len(rows) == 1, rows
    row = rows[0]
    assert row["status"] == "upstream_error", row
    assert row["error"]
    assert row["original_host"] == INVALID_HOST
    assert row["upstream"] == tls_upstream.url
    assert row["response_token_ids"] is None and row["response_logprobs"] is None


# --- 8. the agent's own credentials never reach the upstream --------------------------------------

@pytest.mark.parametrize("mode", ["https-proxy", "reverse-path"])
def test_agent_api_key_not_forwarded(proxy, upstream, rollout, clean_env, mode):
    secret = "sk-agent-secret"
    if mode == "https-proxy":
        set_env(clean_env, proxy.env(rollout))
        base = INVALID_BASE
    else:
        base = proxy.base_url(rollout)
    headers = {"x-api-key": secret, "api-key": secret}
    with openai_client(base_url=base, api_key=secret, default_headers=headers) as client:
        r = client.chat.completions.create(**chat_body("keep my key"))
    seen = upstream.requests[-1]
    assert seen.path == "/v1/chat/completions"
    assert seen.body["model"] == SERVED
    assert seen.body["messages"] == [{"role": "user", "content": "keep my key"}]
    for h in ("authorization", "x-api-key", "api-key", "proxy-authorization"):
        assert h not in seen.headers, (h, seen.headers)
    assert not any(secret in v for v in seen.headers.values())
    assert not any(auth.rollout_token(proxy.secret, rollout) in v for v in seen.headers.values())
    assert r.model == MODEL
    rows = proxy.calls("rollout_id = ?", [rollout])
    assert [row["status"] for row in rows] == ["ok"]
    assert secret not in rows[0]["request_json"]
