"""The stand-in hosted model of the distillation examples (``python -m lgt.testing.hosted_teacher``): the
official Anthropic and OpenAI SDKs, streamed and not, read its answers as a hosted API's, and it answers as
an expert doing the write-a-word task (Messages) and the calc task (chat completions)."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest

from lgt.testing import hosted_teacher
from lgt.testing.threaded import serve_app

BASH = {"name": "Bash", "description": "Run a command.", "input_schema": {
    "type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
    "required": ["command"]}}
TASK = "Create fruit.txt in the current directory containing just the word GUAVA."


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serve_app(hosted_teacher.app()) as port:
        yield f"http://127.0.0.1:{port}"


def client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="sk-ant-any", max_retries=0)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_task_gets_the_tool_call_then_a_final_text(url: str, stream: bool) -> None:
    c = client(url)
    first = [{"role": "user", "content": [{"type": "text", "text": TASK}]}]
    kwargs = {"model": "claude-sonnet-4-5", "max_tokens": 256, "tools": [BASH],
              "system": "You are a coding agent."}
    if stream:
        with c.messages.stream(messages=first, **kwargs) as s:
            msg = s.get_final_message()
    else:
        msg = c.messages.create(messages=first, **kwargs)
    assert msg.stop_reason == "tool_use" and msg.model == "claude-sonnet-4-5"
    (use,) = msg.content
    assert (use.type, use.name, use.input) == ("tool_use", "Bash", {"command": "echo GUAVA > fruit.txt"})
    result = {"type": "tool_result", "tool_use_id": use.id, "content": ""}
    second = first + [{"role": "assistant", "content": [use.model_dump()]},
                      {"role": "user", "content": [result]}]
    done = c.messages.create(messages=second, **kwargs)
    assert (done.stop_reason, done.content[0].text) == ("end_turn", "done")
    assert done.usage.input_tokens > msg.usage.input_tokens > 0  # a longer request counts more


def test_side_calls_count_tokens_and_bad_bodies(url: str) -> None:
    c = client(url)
    side = c.messages.create(model="claude-haiku-4-5", max_tokens=32,
                             messages=[{"role": "user", "content": "Generate a title."}])
    assert (side.stop_reason, side.content[0].text) == ("end_turn", "OK.")
    counted = c.messages.count_tokens(model="claude-sonnet-4-5", messages=[{"role": "user", "content": TASK}])
    assert counted.input_tokens > 0
    with pytest.raises(anthropic.BadRequestError, match="messages: Field required"):
        c.post("/v1/messages", body={"model": "x", "max_tokens": 1}, cast_to=object)


CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="sk-any", max_retries=0)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_calc_question_gets_the_calculator_then_its_result(url: str, stream: bool) -> None:
    c = openai_client(url)
    first = [{"role": "user", "content": "What is 43 * 75?"}]
    kwargs = {"model": "gpt-4o-mini", "tools": [CALCULATOR], "max_tokens": 48}
    if stream:
        with c.chat.completions.stream(messages=first, stream_options={"include_usage": True}, **kwargs) as s:
            reply = s.get_final_completion()
    else:
        reply = c.chat.completions.create(messages=first, **kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and reply.model == "gpt-4o-mini"
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("calculator", '{"expression": "43*75"}')
    second = first + [choice.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "3225"}]
    done = c.chat.completions.create(messages=second, **kwargs)
    assert (done.choices[0].finish_reason, done.choices[0].message.content) == ("stop", "The answer is 3225.")
    assert done.usage.prompt_tokens > reply.usage.prompt_tokens > 0


def test_chat_without_the_task_or_its_tool_and_bad_bodies(url: str) -> None:
    c = openai_client(url)
    for messages, tools in (([{"role": "user", "content": "Hello"}], [CALCULATOR]),
                            ([{"role": "user", "content": "What is 2+2?"}], [])):
        reply = c.chat.completions.create(model="gpt-4o-mini", messages=messages, tools=tools or openai.omit)
        assert (reply.choices[0].finish_reason, reply.choices[0].message.content) == ("stop", "OK.")
    with pytest.raises(openai.BadRequestError, match="messages: Field required"):
        c.post("/chat/completions", body={"model": "gpt-4o-mini"}, cast_to=object)
