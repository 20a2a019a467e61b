"""An ordinary multi-turn tool-using agent on the official OpenAI SDK. It knows nothing of lgt.

The model gets a `calculator` tool; the agent (the environment) executes each tool call, answers with a
`tool` message, and asks again until the model answers in text (at most MAX_TURNS turns). The result is
graded by the agent and printed as the last line: {"answer": "...", "turns": 2, "reward": 1.0}.

Real environments take their time: CALC_TOOL_LATENCY="pareto:SCALE:SHAPE" makes each tool call sleep a
heavy-tailed time (seconds = SCALE · Pareto(SHAPE), capped at 60 · SCALE), as real tools do. With
AGENT_LATENCY_SEED set, the times are drawn from that seed and the rollout's id (LGT_ROLLOUT_ID, which
lgt's runner sets), so that two runs of the same tasks meet the same tool times.
"""

import json
import os
import random
import time

from openai import OpenAI

MAX_TURNS = 4
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
    text = "".join(ch for ch in expression if ch in allowed).strip()
    try:
        return str(eval(text, {"__builtins__": {}}))  # digits and operators only
    except Exception:
        return "error"


SEED = os.environ.get("AGENT_LATENCY_SEED")
RNG = random.Random(f"{SEED}:{os.environ.get('LGT_ROLLOUT_ID')}") if SEED is not None else random


def tool_latency() -> float:
    spec = os.environ.get("CALC_TOOL_LATENCY", "")
    if not spec.startswith("pareto:"):
        return 0.0
    _, scale, shape = spec.split(":")
    return min(float(scale) * RNG.paretovariate(float(shape)), 60 * float(scale))


def main() -> None:
    question = os.environ.get("TASK_QUESTION", "What is 23*47?")
    answer = os.environ.get("TASK_ANSWER", "1081")
    client = OpenAI(base_url=os.environ.get("OPENAI_BASE_URL", "https://api.openai.invalid/v1"),
                    api_key=os.environ.get("OPENAI_API_KEY", "sk-agent-own-key"))
    messages = [{"role": "user", "content": question}]
    text, finish, turns = "", None, 0
    while turns < MAX_TURNS:
        turns += 1
        reply = client.chat.completions.create(model="gpt-4o-mini", messages=messages, tools=TOOLS,
                                               temperature=1.0, max_tokens=48)
        choice = reply.choices[0]
        msg = choice.message
        if not msg.tool_calls:
            text, finish = msg.content or "", choice.finish_reason
            break
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            time.sleep(tool_latency())
            try:
                args = json.loads(call.function.arguments)
            except ValueError:
                args = {}
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculator(str(args.get("expression", "")))})
    ok = finish == "stop" and text.strip() == f"The answer is {answer}."
    print(json.dumps({"answer": text, "turns": turns, "reward": 1.0 if ok else 0.0}))


if __name__ == "__main__":
    main()
