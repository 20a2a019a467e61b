"""The test's two-role agent (tests/trainer/test_policies_run.py), on the official OpenAI SDK: a
``planner`` call (unless the task's ``roles`` leave it out), then a ``coder`` call, under those model
names. Its reward varies with what the coder sampled (the length of its reply), so every group has
advantages to train on whatever the tiny model answers."""

import json
import os

from openai import OpenAI


def main() -> None:
    question = os.environ.get("TASK_QUESTION", "What is 3+4?")
    roles = os.environ.get("TASK_ROLES", "planner,coder").split(",")
    client = OpenAI(base_url=os.environ.get("OPENAI_BASE_URL", "https://api.openai.invalid/v1"),
                    api_key="sk-x")
    if "planner" in roles:
        client.chat.completions.create(model="planner", messages=[{"role": "user", "content": question}],
                                       temperature=1.0, max_tokens=8)
    reply = client.chat.completions.create(model="coder", messages=[{"role": "user", "content": question}],
                                           temperature=1.0, max_tokens=8)
    text = reply.choices[0].message.content or ""
    print(json.dumps({"answer": text, "reward": (len(text) % 4) / 3}))


if __name__ == "__main__":
    main()
