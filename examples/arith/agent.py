"""An ordinary single-turn agent on the official OpenAI SDK. It knows nothing of lgt.

It reads its task from the environment (TASK_QUESTION, TASK_ANSWER), asks the model once, grades the
answer itself and prints the result as one JSON line, the last line of its output:
{"answer": "...", "reward": 1.0}. A reply counts only in the exact form "The answer is N." that ended
on its own (finish_reason "stop"); a lenient grader lets a small model drift into rambling.

AGENT_LATENCY="pareto:SCALE:SHAPE" makes the agent's environment take a heavy-tailed time before the
answer is graded (seconds = SCALE · Pareto(SHAPE), capped at 60 · SCALE), as real environments do;
the benchmarks use it. With AGENT_LATENCY_SEED set, the time is drawn from that seed and the rollout's
id (LGT_ROLLOUT_ID, which lgt's runner sets), so that two runs of the same tasks — sync and async in
bench/async_vs_sync.py — meet the same environment times.

The model is whatever OPENAI_BASE_URL serves (default a hosted API under a reserved name that never
resolves — under lgt-proxy the call is routed to the policy being trained).
"""

import json
import os
import random
import time

from openai import OpenAI


def environment_latency() -> float:
    spec = os.environ.get("AGENT_LATENCY", "")
    if not spec.startswith("pareto:"):
        return 0.0
    _, scale, shape = spec.split(":")
    seed = os.environ.get("AGENT_LATENCY_SEED")
    rng = random.Random(f"{seed}:{os.environ.get('LGT_ROLLOUT_ID')}") if seed is not None else random
    return min(float(scale) * rng.paretovariate(float(shape)), 60 * float(scale))


def main() -> None:
    question = os.environ.get("TASK_QUESTION", "What is 3+4?")
    answer = os.environ.get("TASK_ANSWER", "7")
    client = OpenAI(base_url=os.environ.get("OPENAI_BASE_URL", "https://api.openai.invalid/v1"),
                    api_key=os.environ.get("OPENAI_API_KEY", "sk-agent-own-key"))
    reply = client.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": question}],
        temperature=1.0, max_tokens=24)
    choice = reply.choices[0]
    text = choice.message.content or ""
    time.sleep(environment_latency())  # the environment checks the answer
    ok = choice.finish_reason == "stop" and text.strip() == f"The answer is {answer}."
    print(json.dumps({"answer": text, "reward": 1.0 if ok else 0.0}))


if __name__ == "__main__":
    main()
