"""SWE-bench tasks through the rollout controller: the tasks ``lgt-train tasks swebench`` writes, the run
config lines it prints, and its evaluator run by the controller as any evaluator is (``evaluator...
TASK_JSON STDOUT_PATH``) after an agent that fixes the bug and one that tries to fake its reward."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import yaml

from lgt.testing.rollouts import endpoint, run_all
from lgt.testing.swebench import FIXED, instance, make_repo
from lgt.trainer.rollout import swebench
from lgt.trainer.rollout.agent import AgentSpec
from lgt.trainer.rollout.controller import RolloutController

AGENT = f"""#!/bin/sh
cp "$TASK_JSON" "$TASK_WORKDIR.seen.json"
env > "$TASK_WORKDIR.env"
if [ "$TASK_ID" = good ]; then
  printf '{FIXED}' > "$TASK_WORKDIR/calc.py"
else  # leave the bug, make the tests pass, and claim the reward everywhere an agent can
  printf 'def test_add():\\n    pass\\n' > "$TASK_WORKDIR/tests/test_calc.py"
  echo 1.0 > "$REWARD_FILE"
fi
echo 1.0
"""


def test_the_controller_scores_swebench_tasks_with_the_evaluator_only(tmp_path: Path, proxy) -> None:
    tasks = []
    for iid in ("good", "cheat"):
        repo, base, patch = make_repo(tmp_path / iid / "testbed")
        [task] = swebench.convert([(iid, instance(base, patch, iid))], workdir=str(repo))
        tasks.append(task)
    config = yaml.safe_load(swebench.run_config(tmp_path / "tasks.jsonl", test_timeout_s=60))["agent"]
    script = tmp_path / "agent.sh"
    script.write_text(AGENT)
    script.chmod(0o755)
    # the config's lines on this machine rather than in each task's image: this Python runs the evaluator
    assert config.pop("image_field") == "image"
    evaluator = [sys.executable, *config["evaluator"][1:]]
    spec = AgentSpec(command=(str(script),), timeout_s=90, retries=0, sandbox="none",
                     **{**config, "evaluator": evaluator})
    ctl = RolloutController(spec, endpoint(proxy), proxy.store, tmp_path / "run", 2)
    results = {r.task_id: r for r in asyncio.run(run_all(ctl, [(t, f"swe-{t['task_id']}") for t in tasks]))}
    assert (results["good"].status, results["good"].reward, results["good"].reward_source) == \
        ("ok", 1.0, "evaluator")
    # the cheat's printed 1.0 and reward file are not believed; its test edits are undone
    assert (results["cheat"].status, results["cheat"].reward, results["cheat"].reward_source) == \
        ("ok", 0.0, "evaluator")
    out = (tmp_path / "run" / "rollouts" / "swe-cheat~0.eval.out").read_text().splitlines()
    report = json.loads(out[0])["swebench"]
    assert report["tests"]["FAIL_TO_PASS"] == {"tests/test_calc.py::test_add": "FAILED",
                                               "tests/test_new.py::test_add_pairs[2-3]": "FAILED"}
    for iid in ("good", "cheat"):  # the agent saw neither the hidden tests nor their ids
        seen = "".join((tmp_path / iid / f"testbed.{x}").read_text() for x in ("seen.json", "env"))
        assert "test_add_pairs" not in seen and "FAIL_TO_PASS" not in seen and "def test_add" not in seen
        assert "add(2, 3) gives -1" in seen
