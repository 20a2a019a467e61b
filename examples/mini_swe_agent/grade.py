"""The reward of one SWE task: its hidden tests, run on the repository the agent left. Knows nothing of lgt.

    python grade.py TASK_JSON AGENT_STDOUT     (the agent's repository: $LGT_WORK_DIR/repo)

Runs outside the agent's sandbox, after it exited, as the run's evaluator: the task here holds the
``tests`` the agent never saw. They run on a copy of the repository (the agent's folder stays as it
was), with the task's test files put back as the task has them. Prints {"tests_passed", "reward"}.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

task = json.loads(Path(sys.argv[1]).read_text())
left = Path(os.environ["LGT_WORK_DIR"]) / "repo"
with tempfile.TemporaryDirectory(prefix="swe-grade-") as tmp:
    repo = Path(tmp) / "repo"
    shutil.copytree(left, repo, symlinks=True, ignore=shutil.ignore_patterns(".git"))
    passed = True
    for name, text in task["tests"].items():
        (repo / name).unlink(missing_ok=True)  # whatever the agent put there: the task's own test
        (repo / name).write_text(text)
        check = subprocess.run([sys.executable, name], cwd=repo, capture_output=True, timeout=30)
        passed = passed and check.returncode == 0
print(json.dumps({"tests_passed": passed, "reward": 1.0 if passed else 0.0}))
