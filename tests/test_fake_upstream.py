"""The fake vLLM upstream, driven by real clients (openai SDK, httpx) over real sockets."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from lgt.testing.fake_upstream import (
    FakeUpstream,
    render_chat,
    render_tool_call,
    token_logprob,
    tokenize,
)

Json = dict[str, Any]
USER = [{"role": "user", "content": "What is 2+2?"}]
TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "evaluate", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def up() -> Iterator[FakeUpstream]:
    with FakeUpstream.in_thread(served_model="policy") as server:
        yield server


@pytest.fixture(scope="module")
def http(up: FakeUpstream) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=up.url, trust_env=False, timeout=10) as client:
        yield client


@pytest.fixture(scope="module")
def sdk(up: FakeUpstream) -> Iterator[openai.OpenAI]:
    with httpx.Client(trust_env=False, timeout=10) as client:
        yield openai.OpenAI(base_url=up.url, api_key="x", http_client=client, max_retries=0)


def chat(http: httpx.Client, **body: Any) -> Json:
    r = http.post("/chat/completions", json={"model": "policy", "messages": USER, **body})
    assert r.status_code == 200, r.text
    return r.json()


def sse(http: httpx.Client, path: str, body: Json) -> list[str]:
    """The `data:` payloads of a streamed response, in order."""
    with http.stream("POST", path, json={"model": "policy", "stream": True, **body}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_tokenizer_and_template() -> None:
    assert tokenize("Hi é") == [75, 108, 35, 0xC3 + 3, 0xA9 + 3]
    prompt = render_chat([{"role": "system", "content": "Be brief."}, *USER])
    assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                      "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}
    turn = render_chat([{"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "c1", "content": "4"}], TOOLS)
    assert turn.startswith('<|im_start|>tools\n{"description": "evaluate", "name": "calc"')
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "calc", "arguments": {}}\n' in turn
    assert "<|im_start|>tool\n4<|im_end|>\n" in turn


def test_chat_body_is_vllm_model_dump(http: httpx.Client) -> None:
    body = chat(http)
    assert list(body) == ["id", "object", "created", "model", "choices", "service_tier",
                          "system_fingerprint", "usage", "prompt_logprobs", "prompt_token_ids",
                          "prompt_text", "kv_transfer_params", "ec_transfer_params", "metrics"]
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["system_fingerprint"].startswith("vllm-0.32.0-")
    assert body["prompt_token_ids"] is None and body["kv_transfer_params"] is None
    (choice,) = body["choices"]
    assert choice == {"index": 0, "message": {
        "role": "assistant", "content": choice["message"]["content"], "refusal": None,
        "annotations": None, "audio": None, "function_call": None, "reasoning": None},
        "logprobs": None, "finish_reason": "stop", "stop_reason": None, "token_ids": None,
        "routed_experts": None}  # no "tool_calls": [] -- vLLM drops the empty list
    assert choice["message"]["content"].startswith("The answer is ")
    n_prompt = len(tokenize(render_chat(USER)))
    n_completion = len(tokenize(choice["message"]["content"]))
    assert body["usage"] == {"prompt_tokens": n_prompt, "total_tokens": n_prompt + n_completion,
                             "completion_tokens": n_completion, "prompt_tokens_details": None,
                             "completion_tokens_details": None}
    assert chat(http)["choices"][0]["message"] == choice["message"]  # deterministic


def test_return_token_ids_and_model_echo(http: httpx.Client) -> None:
    body = chat(http, model="some-agent-model", return_token_ids=True, return_prompt_text=True)
    assert body["model"] == "some-agent-model"
    assert body["prompt_token_ids"] == tokenize(render_chat(USER))
    assert body["prompt_text"] == render_chat(USER)
    choice = body["choices"][0]
    assert choice["token_ids"] == tokenize(choice["message"]["content"])


def test_stream_layout_matches_vllm(http: httpx.Client) -> None:
    events = sse(http, "/chat/completions", {"messages": USER, "max_tokens": 3})
    assert events[-1] == "[DONE]"
    first, *tokens = [json.loads(e) for e in events[:-1]]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}]
    assert "prompt_token_ids" in first and first["prompt_token_ids"] is None
    assert len(tokens) == 3 and all("usage" not in c for c in tokens)
    assert tokens[0]["choices"] == [{"index": 0, "delta": {"content": "T"}, "logprobs": None,
                                     "finish_reason": None, "token_ids": None}]
    assert "system_fingerprint" not in tokens[0]
    assert tokens[-1]["choices"][0] == {"index": 0, "delta": {"content": "e"}, "logprobs": None,
                                        "finish_reason": "length", "stop_reason": None,
                                        "token_ids": None}
    assert tokens[-1]["system_fingerprint"].startswith("vllm-")


def test_stream_usage_chunk(http: httpx.Client) -> None:
    events = sse(http, "/chat/completions", {"messages": USER, "n": 2, "max_tokens": 2,
                                             "stream_options": {"include_usage": True}})
    usage = json.loads(events[-2])
    n_prompt = len(tokenize(render_chat(USER)))
    assert usage["choices"] == [] and list(usage) == ["id", "object", "created", "model",
                                                      "choices", "usage", "system_fingerprint"]
    assert usage["usage"] == {"prompt_tokens": n_prompt, "total_tokens": n_prompt + 4,
                              "completion_tokens": 4}
    chunks = [json.loads(e) for e in events[:-2]]
    assert [c["choices"][0]["index"] for c in chunks] == [0, 1, 0, 1, 0, 1]  # interleaved
    assert all("system_fingerprint" not in c for c in chunks)


def test_streaming_token_ids_join_to_non_streaming(sdk: openai.OpenAI) -> None:
    extra = {"return_token_ids": True}
    full = sdk.chat.completions.create(model="policy", messages=USER, logprobs=True,
                                       top_logprobs=3, extra_body=extra)
    stream = sdk.chat.completions.create(model="policy", messages=USER, logprobs=True,
                                         top_logprobs=3, stream=True, extra_body=extra)
    chunks = list(stream)
    assert chunks[0].model_extra["prompt_token_ids"] == tokenize(render_chat(USER))
    ids = [i for c in chunks[1:] for i in c.choices[0].model_extra["token_ids"]]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    stream_lps = [e for c in chunks[1:] for e in c.choices[0].logprobs.content]
    choice = full.choices[0]
    assert ids == choice.model_extra["token_ids"] == tokenize(choice.message.content)
    assert text == choice.message.content
    assert [e.logprob for e in stream_lps] == [e.logprob for e in choice.logprobs.content]
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason == "stop"


def test_logprob_values(http: httpx.Client) -> None:
    choice = chat(http, logprobs=True, top_logprobs=3, return_token_ids=True)["choices"][0]
    entries = choice["logprobs"]["content"]
    assert len(entries) == len(choice["token_ids"])
    for pos, (tid, e) in enumerate(zip(choice["token_ids"], entries, strict=True)):
        assert e["logprob"] == token_logprob(tid, pos) < 0
        assert e["token"] == chr(tid - 3) and e["bytes"] == [tid - 3]
        assert len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["token"] == e["token"]
        lps = [t["logprob"] for t in e["top_logprobs"]]
        assert lps == sorted(lps, reverse=True)
        assert len({t["token"] for t in e["top_logprobs"]}) == 3
    none_requested = chat(http, logprobs=True)["choices"][0]["logprobs"]["content"][0]
    assert none_requested["top_logprobs"] == []


def test_max_tokens_and_stop(http: httpx.Client) -> None:
    for limit in ({"max_tokens": 4}, {"max_completion_tokens": 4}):
        choice = chat(http, return_token_ids=True, **limit)["choices"][0]
        assert choice["finish_reason"] == "length" and choice["message"]["content"] == "The "
        assert choice["token_ids"] == tokenize("The ")
    choice = chat(http, stop=["answer"], return_token_ids=True)["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "answer")
    assert choice["message"]["content"] == "The "
    assert choice["token_ids"] == tokenize("The answer")  # the stop string's tokens were sampled


def test_n_choices_differ_deterministically(http: httpx.Client) -> None:
    msgs = [{"role": "user", "content": "What is 3+5?"}]
    body = chat(http, messages=msgs, n=4)
    contents = [c["message"]["content"] for c in body["choices"]]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert len(set(contents)) > 1
    assert [c["message"]["content"] for c in chat(http, messages=msgs, n=4)["choices"]] == contents
    assert body["usage"]["completion_tokens"] == sum(len(c.encode()) for c in contents)


def test_tool_call_round_trip_extends_prompt(sdk: openai.OpenAI) -> None:
    extra = {"return_token_ids": True}
    first = sdk.chat.completions.create(model="policy", messages=USER, tools=TOOLS,
                                        extra_body=extra)
    choice = first.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert call.id.startswith("chatcmpl-tool-") and call.function.name == "calc"
    assert json.loads(call.function.arguments) == {"expression": "What is 2+2?"}
    generated = render_tool_call("calc", call.function.arguments)
    assert choice.model_extra["token_ids"] == tokenize(generated)
    history = [*USER, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "4"}]
    second = sdk.chat.completions.create(model="policy", messages=history, tools=TOOLS,
                                         extra_body=extra)
    assert second.choices[0].message.content == "The result is 4."
    assert second.choices[0].finish_reason == "stop"
    before = first.model_extra["prompt_token_ids"] + choice.model_extra["token_ids"]
    after = second.model_extra["prompt_token_ids"]
    assert after[:len(before)] == before  # the next turn's prompt extends prompt + completion


def test_tool_call_streams_like_hermes(sdk: openai.OpenAI) -> None:
    full = sdk.chat.completions.create(model="policy", messages=USER, tools=TOOLS,
                                       extra_body={"return_token_ids": True})
    chunks = list(sdk.chat.completions.create(model="policy", messages=USER, tools=TOOLS,
                                              stream=True, extra_body={"return_token_ids": True}))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id == full.choices[0].message.tool_calls[0].id
    assert deltas[0].function.name == "calc"
    args = "".join(d.function.arguments or "" for d in deltas)
    assert args == full.choices[0].message.tool_calls[0].function.arguments
    ids = [i for c in chunks[1:] for i in c.choices[0].model_extra["token_ids"]]
    assert ids == full.choices[0].model_extra["token_ids"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_named_tool_choice_finishes_with_stop(http: httpx.Client) -> None:
    tools = [*TOOLS, {"type": "function", "function": {"name": "other"}}]
    choice = chat(http, tools=tools, tool_choice={"type": "function",
                                                  "function": {"name": "other"}})["choices"][0]
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "other"
    assert choice["finish_reason"] == "stop"
    assert "tool_calls" not in chat(http, tools=TOOLS, tool_choice="none")["choices"][0]["message"]


def test_completions(http: httpx.Client, sdk: openai.OpenAI) -> None:
    r = http.post("/completions", json={"model": "policy", "prompt": "2+2=", "logprobs": 1,
                                        "max_tokens": 50, "return_token_ids": True})
    body = r.json()
    assert list(body) == ["id", "object", "created", "model", "choices", "service_tier",
                          "system_fingerprint", "usage", "kv_transfer_params",
                          "ec_transfer_params", "metrics"]
    (choice,) = body["choices"]
    assert list(choice) == ["index", "text", "logprobs", "finish_reason", "stop_reason",
                            "token_ids", "prompt_logprobs", "prompt_token_ids", "routed_experts"]
    assert choice["prompt_token_ids"] == tokenize("2+2=")
    assert choice["token_ids"] == tokenize(choice["text"]) and choice["finish_reason"] == "stop"
    lp = choice["logprobs"]
    assert lp["tokens"] == list(choice["text"]) and lp["text_offset"][:3] == [0, 1, 2]
    assert lp["top_logprobs"][0] == {lp["tokens"][0]: lp["token_logprobs"][0]}
    # vLLM's CompletionRequest defaults max_tokens to 16; a prompt may be token ids
    default = sdk.completions.create(model="policy", prompt=[10, 20, 30, 40, 50])
    assert default.choices[0].finish_reason == "length" and default.usage.completion_tokens == 16
    assert default.usage.prompt_tokens == 5
    events = sse(http, "/completions", {"prompt": "2+2=", "max_tokens": 50,
                                        "return_token_ids": True, "logprobs": 0})
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert chunks[0]["prompt_token_ids"] == tokenize("2+2=")
    assert chunks[1]["prompt_token_ids"] is None
    assert [i for c in chunks for i in c["token_ids"]] == choice["token_ids"]
    assert "".join(c["text"] for c in chunks) == choice["text"]
    assert [c["logprobs"]["text_offset"][0] for c in chunks] == list(range(len(chunks)))
    assert chunks[-1]["finish_reason"] == "stop" and chunks[0]["stop_reason"] is None


def test_status_and_sleep_faults(sdk: openai.OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.APIStatusError) as err:
        sdk.chat.completions.create(model="policy", messages=[
            {"role": "user", "content": "hi __status:503__"}])
    assert err.value.status_code == 503
    assert err.value.body == {"message": "Injected failure (HTTP 503).",
                              "type": "ServiceUnavailableError", "param": None, "code": 503}
    r = http.post("/completions", json={"model": "policy", "prompt": "x __status:429__"})
    assert r.status_code == 429 and r.json()["error"]["code"] == 429
    start = time.monotonic()
    chat(http, messages=[{"role": "user", "content": "wait __sleep:0.3__"}])
    assert time.monotonic() - start >= 0.3
    start = time.monotonic()
    events = sse(http, "/chat/completions", {"messages": [
        {"role": "user", "content": "wait __sleep:0.3__"}]})
    assert time.monotonic() - start >= 0.3 and events[-1] == "[DONE]"


def test_broken_sse_and_drop(http: httpx.Client) -> None:
    broken = sse(http, "/chat/completions", {"messages": [
        {"role": "user", "content": "__broken_sse__"}]})
    assert len(broken) == 2 and json.loads(broken[0])["choices"][0]["delta"]["role"] == "assistant"
    assert broken[1] == "{not json"  # and no [DONE]
    received: list[str] = []
    body = {"model": "policy", "stream": True,
            "messages": [{"role": "user", "content": "__drop__"}]}
    with pytest.raises(httpx.RemoteProtocolError), \
            http.stream("POST", "/chat/completions", json=body) as r:
        received.extend(line for line in r.iter_lines() if line)
    assert len(received) == 2 and "[DONE]" not in received[-1]
    with pytest.raises(httpx.RemoteProtocolError):
        http.post("/chat/completions", json={"model": "policy", "messages": [
            {"role": "user", "content": "__drop__"}]})


def test_long_generation(http: httpx.Client) -> None:
    msgs = [{"role": "user", "content": "go __long:300__"}]
    choice = chat(http, messages=msgs, return_token_ids=True)["choices"][0]
    assert len(choice["token_ids"]) == 300 and choice["finish_reason"] == "stop"
    events = sse(http, "/chat/completions", {"messages": msgs, "return_token_ids": True})
    ids = [i for e in events[1:-1] for i in json.loads(e)["choices"][0]["token_ids"]]
    assert ids == choice["token_ids"]
    assert len(chat(http, messages=msgs, max_tokens=100)["choices"][0]["message"]["content"]) == 100


def test_validation_errors(http: httpx.Client) -> None:
    r = http.post("/chat/completions", content=b'{"model": ', headers={
        "Content-Type": "application/json"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "Bad Request" and error["code"] == 400
    assert "JSON decode error" in error["message"] and error["param"] == "body.10"
    r = http.post("/chat/completions", json={"model": "policy"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.messages"
    r = http.post("/completions", json={"model": "policy"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = http.post("/chat/completions", content=json.dumps({"messages": USER}),
                  headers={"Content-Type": "text/plain"})
    assert r.status_code == 400 and "Unsupported Media Type" in r.json()["error"]["message"]
    for bad in ({"messages": ["not a message"]}, {"messages": USER, "max_tokens": 0}):
        r = http.post("/chat/completions", json=bad)
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    r = http.get("/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found"


def test_models_and_recorded_requests(http: httpx.Client, up: FakeUpstream) -> None:
    models = http.get("/models").json()
    assert [m["id"] for m in models["data"]] == ["policy"] and models["object"] == "list"
    http.post("/chat/completions?trace=1", json={"model": "m", "messages": USER},
              headers={"Authorization": "Bearer secret", "X-Extra": "1"})
    method, path, headers, body = up.requests[-1]
    assert (method, path) == ("POST", "/v1/chat/completions?trace=1")
    assert headers["authorization"] == "Bearer secret" and headers["x-extra"] == "1"
    assert body == {"model": "m", "messages": USER}


def test_api_key() -> None:
    with FakeUpstream.in_thread(api_key="k") as server, \
            httpx.Client(base_url=server.url, trust_env=False) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic k"}):
            r = client.post("/chat/completions", json={"messages": USER}, headers=headers)
            assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
        assert client.get("/models").status_code == 401
        ok = client.post("/chat/completions", json={"messages": USER},
                         headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200 and ok.json()["model"] == "policy"
        assert client.get(server.url.removesuffix("/v1") + "/health").status_code == 200
        assert len(server.requests) == 6


def test_strict_model() -> None:
    with FakeUpstream.in_thread(strict_model=True) as server, \
            httpx.Client(base_url=server.url, trust_env=False) as client:
        r = client.post("/chat/completions", json={"model": "gpt-4o", "messages": USER})
        assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


def test_async_server_chunk_delay_and_tls(tmp_path: Any) -> None:
    async def run(ssl_context: ssl.SSLContext | None, verify: Any) -> tuple[float, str]:
        async with FakeUpstream(chunk_delay_s=0.05, ssl_context=ssl_context) as server, \
                httpx.AsyncClient(base_url=server.url, trust_env=False, verify=verify) as client:
            start = time.monotonic()
            r = await client.post("/chat/completions", json={
                "messages": USER, "stream": True, "max_tokens": 4})
            assert r.text.endswith("data: [DONE]\n\n")
            return time.monotonic() - start, server.url

    elapsed, url = asyncio.run(run(None, True))
    assert elapsed >= 0.2 and url.startswith("http://127.0.0.1:")  # 5 chunks, 4 gaps
    cert, key = _self_signed(tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    _, url = asyncio.run(run(server_ctx, ssl.create_default_context(cafile=str(cert))))
    assert url.startswith("https://127.0.0.1:")


def _self_signed(tmp_path: Any) -> tuple[Any, Any]:
    x509 = pytest.importorskip("cryptography.x509")
    import ipaddress

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "fake-upstream")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(1)
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_cli_serves_until_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "lgt.testing.fake_upstream", "--port", "0", "--served-model", "p",
         "--api-key", "k"], stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("fake upstream listening on http://127.0.0.1:")
        url = line.split()[-1]
        r = httpx.get(url + "/models", headers={"Authorization": "Bearer k"}, trust_env=False)
        assert r.json()["data"][0]["id"] == "p"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_output_limits_past_the_context_as_vllm_answers_them() -> None:
    with FakeUpstream.in_thread(port=0, max_model_len=64) as up, \
            httpx.Client(base_url=up.url, trust_env=False, timeout=30) as c:
        ask = {"model": "policy", "messages": [{"role": "user", "content": "What is 6*7?"}]}
        r = c.post("/chat/completions", json={**ask, "max_tokens": 128000})
        assert r.status_code == 400  # vLLM 0.32: a limit past the context is refused ...
        assert r.json()["error"]["message"] == ("max_tokens=128000 cannot be greater than max_model_len=64. "
                                                "Please request fewer output tokens.")
        r = c.post("/chat/completions", json={**ask, "max_tokens": 64, "return_token_ids": True})
        assert r.status_code == 200  # ... one the prompt leaves no room for is clamped
        body = r.json()
        assert len(body["prompt_token_ids"]) + len(body["choices"][0]["token_ids"]) <= 64
        long = {"model": "policy", "messages": [{"role": "user", "content": "x" * 100}]}
        r = c.post("/chat/completions", json=long)
        assert r.status_code == 400
        assert "exceeds model's maximum context length (64)" in r.json()["error"]["message"]
