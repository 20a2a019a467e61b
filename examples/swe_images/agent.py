"""mini-swe-agent on one SWE-bench task, inside the task's image: ``python3 /opt/mini-swe-agent/agent.py``.
Knows nothing of lgt.

The image holds the repository at the task's ``workdir`` (/testbed) at its base commit, and this file
beside mini-swe-agent's libraries (``lib/``, put there by build_images.py for the image's Python).
mini-swe-agent — unmodified, its own text-based config, litellm as its model client — works on the issue
with bash in the repository until it submits or hits its limits; its exit status is the last line:
``{"exit_status": "..."}``. The reward is the evaluator's, run in the same image on the tree it left.

The task is $TASK_JSON (the agent's view: the hidden tests are not in it); the issue is its ``prompt``.
The model is litellm's ``openai/gpt-4o-mini`` at OPENAI_BASE_URL (under lgt-proxy, the policy being
trained). SWE_STEP_LIMIT bounds the steps (6), SWE_MAX_TOKENS each answer (256).
"""

import json
import os
import sys
from pathlib import Path

# the agent's libraries are on its own path only: the repository's tests, run by the agent's bash, see
# the image's packages and nothing of these
sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))

import yaml  # noqa: E402
from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.config import builtin_config_dir  # noqa: E402
from minisweagent.environments.local import LocalEnvironment  # noqa: E402
from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel  # noqa: E402

STEP_LIMIT = int(os.environ.get("SWE_STEP_LIMIT", "6"))
MAX_TOKENS = int(os.environ.get("SWE_MAX_TOKENS", "256"))


def main() -> None:
    task = json.loads(Path(os.environ["TASK_JSON"]).read_text())
    workdir = task.get("workdir") or "/testbed"
    config = yaml.safe_load((builtin_config_dir / "mini_textbased.yaml").read_text())
    model = LitellmTextbasedModel(model_name="openai/gpt-4o-mini", cost_tracking="ignore_errors",
                                  model_kwargs={"temperature": 1.0, "max_tokens": MAX_TOKENS})
    env = LocalEnvironment(cwd=workdir, timeout=60, env={"PAGER": "cat", "GIT_PAGER": "cat"})
    agent = DefaultAgent(model, env, **{**config["agent"], "step_limit": STEP_LIMIT})
    try:
        status = agent.run(task.get("prompt") or task["problem_statement"]).get("exit_status", "")
    except Exception as e:  # the agent's own crash: a failed attempt, not a wrong answer
        print(f"mini-swe-agent failed: {type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    print(json.dumps({"exit_status": status}))


if __name__ == "__main__":
    main()
