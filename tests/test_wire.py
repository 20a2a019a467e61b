"""The wire module: recognising calls, request rewriting, response stripping, the SSE re-framer."""

from __future__ import annotations

import copy
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lgt.proxy import wire

# -- recognising LLM calls ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method,path,expected",
    [
        ("POST", "/v1/chat/completions", wire.CHAT),
        ("POST", "/openai/deployments/x/chat/completions?api-version=1", wire.CHAT),
        ("POST", "/v1/completions", wire.COMPLETIONS),
        ("POST", "/v1/completions/", wire.COMPLETIONS),
        ("GET", "/v1/chat/completions", None),
        ("POST", "/v1/embeddings", None),
        ("POST", "/v1/chat/completions2", None),
        ("POST", "/v1/models", None),
    ],
)
def test_endpoint_of(method: str, path: str, expected: str | None) -> None:
    assert wire.endpoint_of(method, path) == expected


@pytest.mark.parametrize(
    "endpoint,body,message",
    [
        (wire.CHAT, b"{not json", "not valid JSON"),
        (wire.CHAT, b"[1, 2]", "not a JSON object"),
        (wire.CHAT, b'{"model": "m"}', "no 'messages' field"),
        (wire.COMPLETIONS, b'{"model": "m", "messages": []}', "no 'prompt' field"),
        (wire.CHAT, b'{"model": 3, "messages": []}', "'model' must be a string"),
        (wire.CHAT, b"\xff\xfe", "not valid JSON"),
    ],
)
def test_parse_request_rejects_with_one_sentence(endpoint: str, body: bytes, message: str) -> None:
    with pytest.raises(wire.BadRequest, match=message):
        wire.parse_request(endpoint, body)


# -- request rewriting ----------------------------------------------------------------------------


def test_prepare_request_injects_and_reports_what_it_injected() -> None:
    req = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    original = copy.deepcopy(req)
    out, inj = wire.prepare_request(wire.CHAT, req, served_model="policy", capture_tokens=True)
    assert req == original  # the agent's request object is not modified
    assert out["model"] == "policy" and out["return_token_ids"] is True and out["logprobs"] is True
    assert inj == wire.Injected(token_ids=True, logprobs=True, model="gpt-4o")


def test_prepare_request_keeps_what_the_agent_asked_for() -> None:
    req = {"model": "policy", "messages": [], "logprobs": True, "top_logprobs": 3,
           "return_token_ids": True}
    out, inj = wire.prepare_request(wire.CHAT, req, served_model="policy", capture_tokens=True)
    assert out == req
    assert inj == wire.Injected()


def test_prepare_request_completions_uses_integer_logprobs() -> None:
    out, inj = wire.prepare_request(wire.COMPLETIONS, {"model": "m", "prompt": "x"},
                                    served_model=None, capture_tokens=True)
    assert out["logprobs"] == 0 and inj.logprobs and inj.model is None
    out, inj = wire.prepare_request(wire.COMPLETIONS, {"model": "m", "prompt": "x", "logprobs": 2},
                                    served_model=None, capture_tokens=True)
    assert out["logprobs"] == 2 and not inj.logprobs


def test_prepare_request_again_without_the_logprobs_keeps_the_token_ids() -> None:
    req = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    out, inj = wire.prepare_request(wire.CHAT, req, served_model="policy", capture_tokens=True,
                                    capture_logprobs=False)
    assert "logprobs" not in out and out["return_token_ids"] is True
    assert inj == wire.Injected(token_ids=True, logprobs=False, model="gpt-4o") and inj.captures
    out, inj = wire.prepare_request(wire.CHAT, req, served_model="policy", capture_tokens=False,
                                    capture_logprobs=False)
    assert out == {**req, "model": "policy"} and not inj.captures


def test_non_finite_logprobs_are_not_captured_and_are_counted() -> None:
    cap = wire.Capture(wire.CHAT)
    for i, lp in enumerate([-0.5, None, float("nan"), float("-inf"), -9999.0, -1.25]):
        cap.add_chunk({"choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [i],
                                    "logprobs": {"content": [{"logprob": lp}]}}]})
    c = cap.choices[0]
    assert c.logprobs == [-0.5, None, None, None, None, -1.25] and c.nonfinite == 4
    assert wire.capture_level([1], c.token_ids, c.logprobs) == wire.CAPTURE_NO_LOGPROBS
    assert wire.capture_level([1], [5, 6], [-0.1, -0.2]) == wire.CAPTURE_FULL
    assert wire.capture_level([1], [5, 6], [-0.1]) == wire.CAPTURE_NO_LOGPROBS
    assert wire.capture_level([1], [5], None) == wire.CAPTURE_NO_LOGPROBS
    assert wire.capture_level(None, [5], [-0.1]) == wire.CAPTURE_NO_TOKENS


def test_observe_only_changes_nothing() -> None:
    req = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    out, inj = wire.prepare_request(wire.CHAT, req, served_model=None, capture_tokens=False)
    assert out == req and inj == wire.Injected()


# -- response stripping ---------------------------------------------------------------------------


def _vllm_chat_body(with_ids: bool, with_logprobs: bool, model: str) -> dict:
    """A vLLM 0.32 chat body: every field present, unset ones null."""
    return {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": "ok", "tool_calls": None},
            "logprobs": {"content": [{"token": "o", "logprob": -0.5}]} if with_logprobs else None,
            "finish_reason": "stop", "stop_reason": None,
            "token_ids": [5, 6] if with_ids else None,
        }],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        "prompt_logprobs": None,
        "prompt_token_ids": [1, 2, 3] if with_ids else None,
        "kv_transfer_params": None,
    }


def test_strip_restores_the_body_the_agent_would_have_got() -> None:
    injected = _vllm_chat_body(True, True, "policy")
    inj = wire.Injected(token_ids=True, logprobs=True, model="gpt-4o")
    assert wire.strip_response(wire.CHAT, injected, inj) == _vllm_chat_body(False, False, "gpt-4o")


def test_strip_keeps_fields_the_agent_asked_for() -> None:
    body = _vllm_chat_body(True, True, "policy")
    assert wire.strip_response(wire.CHAT, copy.deepcopy(body), wire.Injected()) == body


def test_strip_never_adds_keys_to_chunks() -> None:
    chunk = {"id": "c", "model": "policy", "choices": [{"index": 0, "delta": {"content": "a"}}]}
    out = wire.strip_response(wire.CHAT, copy.deepcopy(chunk), wire.Injected(True, True, "m"))
    assert out == {**chunk, "model": "m"}


@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.sampled_from(["choices", "model", "token_ids", "prompt_token_ids",
                                       "logprobs", "x"]), children, max_size=4),
    max_leaves=12,
))
def test_strip_never_raises_on_any_json(obj: object) -> None:
    wire.strip_response(wire.CHAT, obj, wire.Injected(True, True, "m"))


# -- capture ---------------------------------------------------------------------------------------


def test_capture_from_body_and_chunks_agree() -> None:
    body = _vllm_chat_body(True, True, "policy")
    body["choices"][0]["logprobs"] = {"content": [{"logprob": -0.5}, {"logprob": -0.25}]}
    whole = wire.Capture(wire.CHAT)
    whole.add_body(body)
    chunks = wire.Capture(wire.CHAT)
    chunks.add_chunk({"prompt_token_ids": [1, 2, 3], "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": None}]})
    chunks.add_chunk({"choices": [{"index": 0, "delta": {"content": "o"}, "token_ids": [5],
                                   "logprobs": {"content": [{"logprob": -0.5}]}}]})
    chunks.add_chunk({"choices": [{"index": 0, "delta": {"content": "k"}, "token_ids": [6],
                                   "logprobs": {"content": [{"logprob": -0.25}]},
                                   "finish_reason": "stop"}]})
    for cap in (whole, chunks):
        assert cap.prompt_token_ids == [1, 2, 3]
        assert cap.choices[0].token_ids == [5, 6]
        assert cap.choices[0].logprobs == [-0.5, -0.25]
        assert cap.choices[0].finish_reason == "stop"
    assembled = chunks.assembled(wire.Injected(model="gpt-4o"))
    assert assembled["model"] == "gpt-4o"
    assert assembled["choices"][0]["message"]["content"] == "ok"
    assert assembled["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_capture_reassembles_streamed_tool_calls() -> None:
    cap = wire.Capture(wire.CHAT)
    cap.add_chunk({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function",
         "function": {"name": "calc", "arguments": '{"expr'}}]}}]})
    cap.add_chunk({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": 'ession": "1+1"}'}}]},
        "finish_reason": "tool_calls"}]})
    msg = cap.assembled(wire.Injected())["choices"][0]["message"]
    assert msg["tool_calls"] == [{"id": "call_1", "type": "function",
                                  "function": {"name": "calc", "arguments": '{"expression": "1+1"}'}}]


# -- SSE re-framing ---------------------------------------------------------------------------------

_event = st.builds(
    lambda data, sep: b"data: " + data.encode() + sep,
    st.text(alphabet=st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)),
            max_size=30),
    st.sampled_from([b"\n\n", b"\r\n\r\n"]),
)


@given(st.lists(_event, max_size=12), st.data())
@settings(max_examples=200)
def test_framer_yields_each_event_whole_however_the_bytes_are_cut(events, data) -> None:
    stream = b"".join(events)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
    framer = wire.SSEFramer()
    out = [e for p in pieces for e in framer.feed(p)]
    assert out == events
    assert framer.rest() == b""


@given(st.binary(max_size=300), st.data())
@settings(max_examples=200)
def test_framer_loses_no_byte_of_any_input(blob: bytes, data) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(blob)), max_size=8)))
    pieces = [blob[a:b] for a, b in zip([0, *cuts], [*cuts, len(blob)])]
    framer = wire.SSEFramer()
    out = b"".join(e for p in pieces for e in framer.feed(p))
    assert out + framer.rest() == blob


@given(st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=4),
       st.sampled_from([b"", b"event: x\n", b"id: 7\n"]))
def test_rebuild_event_round_trips_json(obj: dict, prefix: bytes) -> None:
    event = prefix + b"data: " + json.dumps(obj).encode() + b"\n\n"
    rebuilt = wire.rebuild_event(event, json.dumps(obj, separators=(",", ":")).encode())
    assert json.loads(wire.event_data(rebuilt)) == obj
    assert rebuilt.startswith(prefix) and rebuilt.endswith(b"\n\n")


def test_event_data_joins_multiline_data() -> None:
    assert wire.event_data(b"data: a\ndata: b\n\n") == b"a\nb"
    assert wire.event_data(b": comment\n\n") is None
    assert wire.event_data(b"data:[DONE]\r\n\r\n") == b"[DONE]"
    assert wire.event_data(b"data: {}\n\n") == b"{}"


def test_framer_refuses_an_endless_event() -> None:
    framer = wire.SSEFramer(max_event_bytes=100)
    with pytest.raises(ValueError, match="exceeds 100 bytes"):
        list(framer.feed(b"data: " + b"x" * 200))


# -- rewriting round trip (Hypothesis) ---------------------------------------------------------------

_agent_asks = st.fixed_dictionaries({}, optional={
    "logprobs": st.sampled_from([None, False, True]),
    "top_logprobs": st.integers(0, 5),
    "return_token_ids": st.sampled_from([None, False, True]),
    "stream": st.booleans(),
    "temperature": st.floats(0, 2),
})


def _vllm_answer(req: dict, n_tokens: int, chunk: bool) -> dict:
    """What vLLM answers to ``req``: token fields filled when asked, null otherwise."""
    ids = req.get("return_token_ids") is True
    lp = bool(req.get("logprobs"))
    choice = {"index": 0, "logprobs": {"content": [{"logprob": -1.0}] * n_tokens} if lp else None,
              "finish_reason": "stop", "token_ids": list(range(n_tokens)) if ids else None}
    choice["delta" if chunk else "message"] = {"role": "assistant", "content": "x" * n_tokens}
    return {"id": "x", "model": req["model"], "choices": [choice],
            "prompt_token_ids": [1, 2] if ids else None}


@given(_agent_asks, st.sampled_from(["gpt-4o", "policy"]), st.integers(0, 4), st.booleans(),
       st.booleans())
def test_injected_then_stripped_equals_what_the_agent_asked_for(
    extra: dict, model: str, n: int, chunk: bool, capture: bool
) -> None:
    req = {"model": model, "messages": [{"role": "user", "content": "q"}], **extra}
    sent, inj = wire.prepare_request(wire.CHAT, req, served_model="policy", capture_tokens=capture)
    assert sent["model"] == "policy"
    if capture:  # the upstream is always asked for what training needs
        assert sent["return_token_ids"] is True and sent["logprobs"]
    got = wire.strip_response(wire.CHAT, _vllm_answer(sent, n, chunk), inj)
    assert got == _vllm_answer(req, n, chunk)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(
        st.sampled_from(["choices", "index", "delta", "content", "tool_calls", "function",
                         "arguments", "name", "id", "token_ids", "prompt_token_ids", "logprobs",
                         "logprob", "token_logprobs", "usage", "prompt_tokens", "text",
                         "finish_reason", "role", "message"]), children, max_size=5),
    max_leaves=20,
)


@given(st.lists(st.dictionaries(st.sampled_from(["choices", "usage", "prompt_token_ids", "model"]),
                                _json, max_size=4), max_size=4),
       st.sampled_from([wire.CHAT, wire.COMPLETIONS]))
@settings(max_examples=300)
def test_capture_never_raises_and_always_yields_storable_values(chunks: list, endpoint: str) -> None:
    """Whatever an upstream sends, capture gives JSON-able output and well-typed token columns."""
    cap = wire.Capture(endpoint)
    for c in chunks:
        cap.add_chunk(copy.deepcopy(c))
        cap.add_body(copy.deepcopy(c))
    json.dumps(cap.assembled(wire.Injected(model="m")))
    for ch in cap.choices.values():
        assert ch.token_ids is None or all(type(i) is int for i in ch.token_ids)
        assert ch.logprobs is None or all(v is None or (type(v) is float and math.isfinite(v)
                                                        and v > wire.LOGPROB_FLOOR) for v in ch.logprobs)
    assert cap.prompt_token_ids is None or all(type(i) is int for i in cap.prompt_token_ids)
    usage = cap.usage_dict()
    assert usage is None or all(type(v) is int for v in usage.values())


def test_silent_chunks_are_recognised() -> None:
    silent = {"choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": None,
                           "token_ids": None}]}
    assert wire.is_silent_chunk(silent)
    assert not wire.is_silent_chunk({"choices": [{**silent["choices"][0], "finish_reason": "stop"}]})
    assert not wire.is_silent_chunk({"choices": [{**silent["choices"][0], "delta": {"content": ""}}]})
    assert not wire.is_silent_chunk({"choices": [], "usage": {"total_tokens": 1}})


def test_prepare_request_greedy_overrides_the_agents_sampling() -> None:
    req = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 1.0,
           "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 3, "max_tokens": 8}
    out, inj = wire.prepare_request(wire.CHAT, req, served_model=None, capture_tokens=True, greedy=True)
    assert out["temperature"] == 0.0 and out["max_tokens"] == 8
    assert not {"top_p", "top_k", "min_p", "seed"} & set(out)
    assert inj.sampling == "greedy" and req["temperature"] == 1.0  # the agent's request is untouched
    _, plain = wire.prepare_request(wire.CHAT, req, served_model=None, capture_tokens=True)
    assert plain.sampling is None


def test_cap_output_lowers_a_larger_limit_and_gives_one_to_a_call_without() -> None:
    notes: list[str] = []
    req = {"messages": [], "max_tokens": 64000, "max_completion_tokens": 100}
    assert wire.cap_output(wire.CHAT, req, 256, notes) == {"messages": [], "max_tokens": 256,
                                                            "max_completion_tokens": 100}
    assert notes == ["max_tokens 64000 lowered to 256 by the proxy's output cap (--max-output-tokens)"]
    assert req["max_tokens"] == 64000  # the agent's request is not changed in place
    notes.clear()
    assert wire.cap_output(wire.COMPLETIONS, {"prompt": "x"}, 32, notes) == {"prompt": "x", "max_tokens": 32}
    assert notes == ["no output limit asked: max_tokens 32 set by the proxy's output cap "
                     "(--max-output-tokens)"]
    notes.clear()
    within = {"messages": [], "max_completion_tokens": 256}
    assert wire.cap_output(wire.CHAT, within, 256, notes) is within and not notes  # asked for no more
    assert wire.cap_output(wire.CHAT, req, None, notes) is req and not notes  # no cap
    assert wire.cap_output("embeddings", req, 8, notes) is req  # not a generating endpoint


@given(st.dictionaries(st.sampled_from(["max_tokens", "max_completion_tokens", "n"]),
                       st.integers(0, 10**6) | st.booleans() | st.none(), max_size=3),
       st.integers(1, 4096))
def test_cap_output_never_lets_a_reply_past_the_cap(req: dict, cap: int) -> None:
    notes: list[str] = []
    out = wire.cap_output(wire.CHAT, req, cap, notes)
    limits = [out[k] for k in ("max_tokens", "max_completion_tokens")
              if isinstance(out.get(k), int) and not isinstance(out.get(k), bool)]
    assert limits and min(limits) <= cap  # vLLM stops at the smaller of the two
    assert (out is req) == (not notes)  # every change says so


def test_fit_output_leaves_out_only_limits_the_context_cannot_hold() -> None:
    notes: list[str] = []
    req = {"messages": [], "max_tokens": 8193, "max_completion_tokens": 8192, "n": 1}
    assert wire.fit_output(wire.CHAT, req, 8192, notes) == {"messages": [], "max_completion_tokens": 8192,
                                                             "n": 1}  # equal to the context: vLLM takes it
    assert notes == ["max_tokens 8193 is more than the engine's context of 8192 tokens: left out, so the "
                     "engine stops at the context's end"]
    same = {"prompt": "x", "max_tokens": True}  # not a number: vLLM's own validation answers it
    assert wire.fit_output(wire.COMPLETIONS, same, 4, notes) is same
    assert wire.fit_output(wire.CHAT, req, None, notes) is req  # context unknown: sent as asked
