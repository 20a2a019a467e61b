"""An agent for the prompt optimiser's tests: it reads its prompt ($LGT_RESOURCE_SYSTEM_PROMPT, a
``deliver: env`` resource), asks the model with it, and its reward says whether the prompt holds the
one instruction that matters here ("Answer in one word.") and kept the task's question."""

import json
import os

from openai import OpenAI

prompt = os.environ["LGT_RESOURCE_SYSTEM_PROMPT"]
task = json.loads(open(os.environ["TASK_JSON"]).read())
client = OpenAI(api_key="sk-agent", max_retries=0, timeout=20, base_url="https://api.openai.invalid/v1")
r = client.chat.completions.create(model="agent-model", max_tokens=16, messages=[
    {"role": "system", "content": prompt}, {"role": "user", "content": task["question"]}])
print("model said:", r.choices[0].message.content)
print(1.0 if "Answer in one word." in prompt and task["question"] in prompt else 0.0)
