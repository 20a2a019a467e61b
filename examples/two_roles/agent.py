"""A two-role agent on the official OpenAI SDK: a planner, then a coder. It knows nothing of lgt.

Each rollout makes two calls under two model names: the *planner* (model ``planner``) is asked how to
work the task out, the *coder* (model ``coder``) is asked the task with the planner's note as its
system message and answers. The coder's answer is graded as examples/arith grades one: only the exact
form "The answer is N." that ended on its own (finish_reason "stop") counts. The result is the last
line of the output: {"plan": "...", "answer": "...", "reward": 1.0}.

Under lgt-train run (run.yaml's ``policies``) each model name is a policy of its own, each call is
trained into its own LoRA adapter with the rollout's reward. TASK_ROLES (a task field ``roles``, e.g.
"coder") leaves the planner out of a task.
"""

import json
import os

from openai import OpenAI


def main() -> None:
    question = os.environ.get("TASK_QUESTION", "What is 3+4?")
    answer = os.environ.get("TASK_ANSWER", "7")
    roles = os.environ.get("TASK_ROLES", "planner,coder").split(",")
    client = OpenAI(base_url=os.environ.get("OPENAI_BASE_URL", "https://api.openai.invalid/v1"),
                    api_key=os.environ.get("OPENAI_API_KEY", "sk-agent-own-key"))
    plan = ""
    if "planner" in roles:
        reply = client.chat.completions.create(
            model="planner", messages=[{"role": "user", "content": question}], temperature=1.0, max_tokens=16)
        plan = reply.choices[0].message.content or ""
    messages = [{"role": "system", "content": plan}] if plan.strip() else []
    reply = client.chat.completions.create(
        model="coder", messages=[*messages, {"role": "user", "content": question}], temperature=1.0,
        max_tokens=24)
    choice = reply.choices[0]
    text = choice.message.content or ""
    ok = choice.finish_reason == "stop" and text.strip() == f"The answer is {answer}."
    print(json.dumps({"plan": plan, "answer": text, "reward": 1.0 if ok else 0.0}))


if __name__ == "__main__":
    main()
