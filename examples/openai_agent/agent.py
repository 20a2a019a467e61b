"""An ordinary tool-using agent on the official OpenAI SDK. It knows nothing of lgt.

It aims at a hosted API (OPENAI_BASE_URL, default https://api.openai.invalid/v1 — a reserved name
that never resolves) and still works under lgt-proxy, because the proxy routes its model calls to
the policy being trained. Usage: python agent.py "What is 17*23?"
"""

import json
import os
import sys

from openai import OpenAI

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}]


def calculator(expression: str) -> str:
    allowed = set("0123456789+-*/(). ")
    digits = "".join(ch for ch in expression if ch in allowed).strip()
    try:
        return str(eval(digits, {"__builtins__": {}}))  # digits and operators only
    except Exception:
        return "error"


def main() -> None:
    question = sys.argv[1] if len(sys.argv) > 1 else "What is 17*23?"
    client = OpenAI(base_url=os.environ.get("OPENAI_BASE_URL", "https://api.openai.invalid/v1"),
                    api_key=os.environ.get("OPENAI_API_KEY", "sk-agent-own-key"))
    messages = [{"role": "system", "content": "Use the calculator, then answer."},
                {"role": "user", "content": question}]
    reply = client.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS)
    msg = reply.choices[0].message
    answer = msg.content or ""
    if msg.tool_calls:
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculator(args.get("expression", ""))})
        # the final answer is streamed, as chat UIs do
        stream = client.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS,
                                                stream=True)
        answer = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    print(json.dumps({"question": question, "answer": answer}))


if __name__ == "__main__":
    main()
