"""Resources delivered by the proxy (proxy/resources.py): the rollout's prompt substituted in every
request it makes, the agent unchanged."""

from __future__ import annotations

import json

import pytest

from lgt.proxy import resources
from lgt.proxy.client import ControlError
from lgt.testing.fake_upstream import render_chat, tokenize
from lgt.testing.proxy import CHAT, HOSTED, client

PROMPT = "You are a careful calculator. Answer as 'The answer is N.'"


def test_the_system_message_is_replaced_or_put_first() -> None:
    req = {"model": "m", "messages": [{"role": "system", "content": "old"}, {"role": "user", "content": "q"}]}
    out, misses = resources.apply(req, [{"text": PROMPT, "target": "system"}])
    assert out["messages"] == [{"role": "system", "content": PROMPT}, {"role": "user", "content": "q"}]
    assert req["messages"][0]["content"] == "old" and misses == 0  # the agent's request untouched
    bare = {"messages": [{"role": "user", "content": "q"}]}
    assert resources.apply(bare, [{"text": PROMPT, "target": "system"}])[0]["messages"][0] == \
        {"role": "system", "content": PROMPT}
    dev = {"messages": [{"role": "developer", "content": [{"type": "text", "text": "old"}]}]}
    assert resources.apply(dev, [{"text": PROMPT, "target": "system"}])[0]["messages"] == \
        [{"role": "developer", "content": PROMPT}]


def test_a_marked_span_is_replaced_wherever_it_is() -> None:
    span = ["<<P>>", "<</P>>"]
    req = {"messages": [{"role": "system", "content": "Tools: calc. <<P>>Be brief.<</P>> Done."},
                        {"role": "user", "content": [{"type": "text", "text": "x <<P>>y<</P>>"}]}]}
    out, misses = resources.apply(req, [{"text": "Think step by step.", "span": span}])
    assert out["messages"][0]["content"] == "Tools: calc. Think step by step. Done."
    assert out["messages"][1]["content"][0]["text"] == "x Think step by step."
    assert misses == 0
    prompt = resources.apply({"prompt": "a <<P>>b<</P>> c"}, [{"text": "Z", "span": span}])[0]["prompt"]
    assert prompt == "a Z c"
    assert resources.apply({"messages": [{"role": "user", "content": "no markers"}]},
                           [{"text": "Z", "span": span}])[1] == 1  # counted, never guessed at


@pytest.mark.parametrize("subs,message", [
    ({"text": "x"}, "'substitutions' must be a list"),
    ([{"text": 3}], "substitutions[0] must be an object with a string 'text'"),
    ([{"text": "x", "span": ["a"]}], "substitutions[0].span must be two non-empty marker strings"),
    ([{"text": "x", "target": "user"}], "substitutions[0].target must be 'system' (or give a span)"),
])
def test_bad_substitutions_are_one_sentence(subs, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        resources.check(subs)


def test_the_engine_sees_the_delivered_prompt_and_the_agent_its_own(proxy, upstream, rollout) -> None:
    ctl = proxy.client
    assert ctl.deliver(rollout, 0, [{"text": PROMPT, "target": "system"}])["substitutions"] == 1
    with client(proxy, rollout) as c:
        got = c.post(f"{HOSTED}/chat/completions", json=CHAT)
    assert got.status_code == 200 and got.json()["choices"][0]["message"]["content"]
    sent = upstream.requests[-1].body["messages"]
    assert sent[0] == {"role": "system", "content": PROMPT} and sent[1:] == CHAT["messages"][1:]
    [row] = proxy.calls("rollout_id = ?", [rollout])
    assert json.loads(row["request_json"])["messages"] == CHAT["messages"]  # what the agent sent
    want = [{"role": "system", "content": PROMPT}, *CHAT["messages"][1:]]
    assert row["prompt_token_ids"] == tokenize(render_chat(want))  # what the engine was asked
    with client(proxy, rollout + "-other") as c:  # another rollout: its own prompt
        c.post(f"{HOSTED}/chat/completions", json=CHAT)
    assert upstream.requests[-1].body["messages"] == CHAT["messages"]
    with pytest.raises(ControlError, match="substitutions\\[0\\] must be an object"):
        ctl.deliver(rollout, 0, [{"nope": 1}])


def test_a_responses_agents_instructions_are_replaced_too(proxy, upstream, rollout) -> None:
    proxy.client.deliver(rollout, 0, [{"text": PROMPT, "target": "system"}])
    with client(proxy, rollout) as c:
        got = c.post(f"{HOSTED}/responses", json={"model": "m", "instructions": "Be terse.", "input": "2+2?"})
    assert got.status_code == 200 and got.json()["output"][0]["type"] == "message"
    assert upstream.requests[-1].body["messages"][0] == {"role": "system", "content": PROMPT}
