"""The reward of one write-a-word task: 1.0 when the file holds the word (and nothing else), else 0.0.

    python check.py WORKDIR      (the task from $TASK_JSON; prints {"reward": …} as its last line)

Knows nothing of lgt; the harness examples' task scripts run it after the harness exits.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

task = json.loads(Path(os.environ["TASK_JSON"]).read_text())
target = Path(sys.argv[1]) / task["file"]
got = target.read_text(errors="replace").strip() if target.is_file() else None
print(json.dumps({"file": task["file"], "found": got is not None, "reward": float(got == task["word"])}))
