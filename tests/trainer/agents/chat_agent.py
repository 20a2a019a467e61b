"""A small agent for the rollout controller's tests: behaves as its task (``$TASK_JSON``) says.

Task fields it reads (all optional):
  call_model (default true)  ask the model one question with the OpenAI SDK: through ``HTTPS_PROXY`` at
                             https://api.openai.invalid/v1, or at ``$OPENAI_BASE_URL`` when that is set
  question                   the question (default "What is 2+3?")
  report_dir                 write ``<report_dir>/<rollout>~<attempt>.json``: the environment it saw,
                             the task file's contents, wall-clock start/end (for the concurrency test)
  sleep                      seconds to sleep before finishing
  fail_attempts              exit 3 on attempts below this number (after calling the model)
  rewards                    {"proxy": x, "file": y, "stdout": z}: report each of these
  reward_file_text           raw text to write to $REWARD_FILE
"""

import json
import os
import sys
import time
import urllib.request

start = time.time()
preloaded = "openai" in sys.modules  # true only when forked from a warm interpreter
task = json.loads(open(os.environ["TASK_JSON"]).read())
attempt = int(os.environ["LGT_ATTEMPT"])
print("agent starting", file=sys.stderr)

if task.get("call_model", True):
    from openai import OpenAI

    client = OpenAI(api_key="sk-agent", max_retries=0, timeout=20,
                    base_url=os.environ.get("OPENAI_BASE_URL") or "https://api.openai.invalid/v1")
    r = client.chat.completions.create(model="agent-model", max_tokens=32, messages=[
        {"role": "user", "content": task.get("question", "What is 2+3?")}])
    print("model said:", r.choices[0].message.content)

time.sleep(float(task.get("sleep", 0)))

if task.get("report_dir"):
    seen = {k: v for k, v in os.environ.items()
            if k.startswith(("TASK_", "LGT_", "OPENAI_")) or k in ("REWARD_FILE", "HTTPS_PROXY", "HTTP_PROXY",
                                                                   "https_proxy", "SSL_CERT_FILE",
                                                                   "LGT_PROXY_SECRET", "EXTRA")}
    report = {"env": seen, "task": task, "cwd": os.getcwd(), "start": start, "end": time.time(),
              "preloaded": preloaded, "pid": os.getpid(), "pgid": os.getpgid(0)}
    path = os.path.join(task["report_dir"], f"{os.environ['LGT_ROLLOUT_ID']}~{attempt}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)

if attempt < int(task.get("fail_attempts", 0)):
    print("failing on purpose", file=sys.stderr)
    sys.exit(3)

rewards = task.get("rewards", {})
if "proxy" in rewards:
    req = urllib.request.Request(os.environ["LGT_REWARD_URL"], method="POST",
                                 data=json.dumps({"value": rewards["proxy"]}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=20) as resp:  # HTTP_PROXY from the environment
        assert resp.status == 200, resp.read()
if "file" in rewards:
    with open(os.environ["REWARD_FILE"], "w") as f:
        json.dump({"reward": rewards["file"]}, f)
if "reward_file_text" in task:
    with open(os.environ["REWARD_FILE"], "w") as f:
        f.write(task["reward_file_text"])
if "stdout" in rewards:
    print(rewards["stdout"])
