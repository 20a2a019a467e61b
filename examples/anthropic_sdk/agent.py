"""A tool-using agent on the official Anthropic SDK (the Messages API), unmodified. It knows nothing of lgt.

It calls ``POST {ANTHROPIC_BASE_URL}/v1/messages`` (a hosted API under a reserved name that never
resolves); under lgt-proxy the call is translated to the policy engine's chat/completions and answered
as an Anthropic message. The loop is the SDK's usual one: while the model stops for ``tool_use``, run
the calculator and send a ``tool_result`` back. The answer is graded here and printed as the last line:
{"answer": "...", "turns": 2, "reward": 1.0}.
"""

import json
import os

import anthropic

MAX_TURNS = 4
TOOLS = [{"name": "calculator", "description": "Evaluate an arithmetic expression.",
          "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}},
                           "required": ["expression"]}}]


def calculator(expression: str) -> str:
    allowed = set("0123456789+-*/(). ")
    text = "".join(ch for ch in expression if ch in allowed).strip()
    try:
        return str(eval(text, {"__builtins__": {}}))  # digits and operators only
    except Exception:
        return "error"


def main() -> None:
    question = os.environ.get("TASK_QUESTION", "What is 23*47?")
    answer = os.environ.get("TASK_ANSWER", "1081")
    client = anthropic.Anthropic()  # ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY from the environment
    messages = [{"role": "user", "content": question}]
    text, stop, turns = "", None, 0
    while turns < MAX_TURNS:
        turns += 1
        reply = client.messages.create(model="claude-sonnet-4-5", max_tokens=48, tools=TOOLS,
                                       messages=messages)
        stop = reply.stop_reason
        if stop != "tool_use":
            text = "".join(block.text for block in reply.content if block.type == "text")
            break
        messages.append({"role": "assistant", "content": [b.model_dump() for b in reply.content]})
        results = [{"type": "tool_result", "tool_use_id": b.id,
                    "content": calculator(str(b.input.get("expression", "")))}
                   for b in reply.content if b.type == "tool_use"]
        messages.append({"role": "user", "content": results})
    ok = stop == "end_turn" and text.strip() == f"The answer is {answer}."
    print(json.dumps({"answer": text, "turns": turns, "reward": 1.0 if ok else 0.0}))


if __name__ == "__main__":
    main()
