"""An evaluator for the rollout controller's tests: ``evaluator.py TASK_JSON STDOUT_PATH``.

Prints ``task["eval_reward"]`` when the agent's stdout holds the model's answer, else 0; exits 4 when
the task says ``eval_fail``. Checks that the task variables reached it as well as the file."""

import json
import os
import sys

task = json.loads(open(sys.argv[1]).read())
stdout = open(sys.argv[2]).read()
assert os.environ["TASK_ID"] and os.environ["TASK_JSON"] == sys.argv[1]
assert "LGT_PROXY_SECRET" not in os.environ
if task.get("eval_fail"):
    print("evaluator failing on purpose", file=sys.stderr)
    sys.exit(4)
print("evaluating", os.environ["LGT_ROLLOUT_ID"])
print(task["eval_reward"] if "model said: The answer is" in stdout else 0)
