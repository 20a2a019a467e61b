"""One SWE task for mini-swe-agent, the shape of a SWE-bench run at toy scale. Knows nothing of lgt.

The task (the file $TASK_JSON names: an issue and the files of a tiny repository) is checked out into
a git repository in the rollout's work folder ($LGT_WORK_DIR/repo, or a throw-away folder);
mini-swe-agent — unmodified, its own text-based config, litellm as its model client — works on the
issue with bash in that repository until it submits or hits its limits, and its exit status is printed
as the last line: {"exit_status": "..."}. The reward is grade.py's, which runs the task's hidden tests
on the repository it left, after it exits — the tests are never where the agent (and its bash) could
read or edit them, as in SWE-bench.

The model is litellm's ``openai/gpt-4o-mini`` at OPENAI_BASE_URL (a hosted API under a reserved name
that never resolves; under lgt-proxy, the policy being trained).
"""

import json
import os
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

import yaml
from minisweagent.agents.default import DefaultAgent
from minisweagent.environments.local import LocalEnvironment
from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

STEP_LIMIT = int(os.environ.get("SWE_STEP_LIMIT", "6"))


def checkout(files: dict[str, str], where: Path) -> None:
    for name, text in files.items():
        (where / name).write_text(text)
    git = ["git", "-c", "user.name=task", "-c", "user.email=task@swe.invalid"]
    subprocess.run(["git", "init", "-q"], cwd=where, check=True)
    subprocess.run([*git, "add", "-A"], cwd=where, check=True)
    subprocess.run([*git, "commit", "-qm", "task"], cwd=where, check=True)


def main() -> None:
    task = json.loads(Path(os.environ["TASK_JSON"]).read_text())  # the whole task, as a file
    config = yaml.safe_load(resources.files("minisweagent.config").joinpath("mini_textbased.yaml")
                            .read_text())
    work = os.environ.get("LGT_WORK_DIR")
    with tempfile.TemporaryDirectory(prefix="swe-task-") as tmp:
        repo = Path(work or tmp) / "repo"
        repo.mkdir()
        checkout(task["files"], repo)
        model = LitellmTextbasedModel(model_name="openai/gpt-4o-mini", cost_tracking="ignore_errors",
                                      model_kwargs={"temperature": 1.0, "max_tokens": 64})
        agent = DefaultAgent(model, LocalEnvironment(cwd=str(repo), timeout=10),
                             **{**config["agent"], "step_limit": STEP_LIMIT})
        try:
            status = agent.run(task["issue"]).get("exit_status", "")
        except Exception as e:  # the agent's own crash: a failed attempt, not a wrong answer
            print(f"mini-swe-agent failed: {type(e).__name__}: {e}", file=sys.stderr)
            raise SystemExit(1) from None
    print(json.dumps({"exit_status": status}))


if __name__ == "__main__":
    main()
