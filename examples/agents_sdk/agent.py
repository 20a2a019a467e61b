"""An OpenAI Agents SDK agent, unmodified: its default model (the Responses API) and one function tool.

It knows nothing of lgt. The SDK calls ``POST {OPENAI_BASE_URL}/responses`` (a hosted API under a
reserved name that never resolves); under lgt-proxy the call is translated to the policy engine's
chat/completions and answered as a Responses response, so the SDK runs its loop as usual: the model
calls ``calculator``, the SDK runs it and sends the output back, the model answers. The answer is graded
here and printed as the last line: {"answer": "...", "turns": 2, "reward": 1.0}.

The tool is declared with the calc example's JSON schema (not ``@function_tool``'s strict one, which
adds titles and ``additionalProperties``): the demo model is a 10M-parameter model whose warm start saw
that one prompt, and it answers the strict schema's prompt with noise after the first tool call.
"""

import json
import os
import sys

from agents import Agent, FunctionTool, ModelSettings, Runner
from agents.exceptions import AgentsException

MAX_TURNS = 4
# The tool as the calc example declares it (the schema the demo model's warm start saw), not strict
PARAMETERS = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}


def evaluate(expression: str) -> str:
    allowed = set("0123456789+-*/(). ")
    text = "".join(ch for ch in expression if ch in allowed).strip()
    try:
        return str(eval(text, {"__builtins__": {}}))  # digits and operators only
    except Exception:
        return "error"


async def run_calculator(ctx, arguments: str) -> str:
    try:
        return evaluate(str(json.loads(arguments).get("expression", "")))
    except (ValueError, AttributeError):
        return "error"


calculator = FunctionTool(name="calculator", description="Evaluate an arithmetic expression.",
                          params_json_schema=PARAMETERS, on_invoke_tool=run_calculator,
                          strict_json_schema=False)


def main() -> None:
    question = os.environ.get("TASK_QUESTION", "What is 23*47?")
    answer = os.environ.get("TASK_ANSWER", "1081")
    agent = Agent(name="calculator agent", model="gpt-4o-mini", tools=[calculator],
                  model_settings=ModelSettings(temperature=1.0, max_tokens=48))
    text, turns = "", 0
    try:
        result = Runner.run_sync(agent, question, max_turns=MAX_TURNS)
        text, turns = str(result.final_output or ""), len(result.raw_responses)
    except AgentsException as e:  # e.g. more turns than MAX_TURNS: a wrong answer, not a crash
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        text, turns = f"({type(e).__name__})", MAX_TURNS
    ok = text.strip() == f"The answer is {answer}."
    print(json.dumps({"answer": text, "turns": turns, "reward": 1.0 if ok else 0.0}))


if __name__ == "__main__":
    main()
