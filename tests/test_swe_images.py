"""examples/swe_images: its build script makes a task's image from Debian's packages (cached under
build/debs), and in that image — run under bubblewrap by lgt's own rollout/images.py — the SWE-bench
evaluator scores the untouched repository 0 and the fixed one 1. Skips only when Debian's packages cannot
be had here (no apt, no package lists, no network) or bubblewrap is missing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lgt.testing.images import bwrap_argv
from lgt.trainer.rollout import swebench
from lgt.trainer.rollout.images import fresh_workdir, open_image

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "swe_images" / "build_images.py"
DEBS = ROOT / "build" / "debs"  # the script's default: .debs downloaded once, shared with its users
TASK = "acme__ledger-1"  # python3-tabulate is its own; python3-yaml another task's
MOUNT = "/lgt/eval/swebench_eval.py"  # where this test binds the evaluator in the image

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap is not installed (apt-get install bubblewrap)")]


def build(out: Path, instances: Path) -> str:
    """The script's output; skips when it says Debian's packages cannot be had (exit code 3)."""
    argv = [sys.executable, str(SCRIPT), "--out", str(out), "--debs", str(DEBS), "--only", TASK, "--no-agent",
            "--instances", str(instances)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if done.returncode == 3:
        pytest.skip(f"Debian's packages cannot be had here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    return done.stdout


def evaluate(image, task: dict, work: Path, tmp: Path) -> tuple[dict, str]:
    """The evaluator's last line and stderr, run in the image on ``work`` as lgt's runner would."""
    (tmp / "eval").mkdir(exist_ok=True)
    shutil.copyfile(swebench.EVALUATOR_FILE, tmp / "eval" / "swebench_eval.py")
    (tmp / "task.json").write_text(json.dumps(task))
    argv = bwrap_argv(image, ["python3", MOUNT, "--timeout", "60", "/tmp/task.json",
                              "/dev/null"], work)
    cut = argv.index("--")
    argv[cut:cut] = ["--ro-bind", str(tmp / "eval"), str(Path(MOUNT).parent),
                     "--ro-bind", str(tmp / "task.json"), "/tmp/task.json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


def test_a_task_image_built_from_debian_packages_scores_the_bug_0_and_the_fix_1(tmp_path: Path) -> None:
    out = ROOT / "build" / "swe_images_test"  # kept: a rerun reuses its layers
    printed = build(out, tmp_path / "instances.jsonl")
    assert f"{TASK}: {out / TASK}" in printed and "python3-tabulate" in printed
    instances = [json.loads(line) for line in (tmp_path / "instances.jsonl").read_text().splitlines()]
    assert len(instances) == 4  # every task's, though only one image was built
    [instance] = [i for i in instances if i["instance_id"] == TASK]
    assert instance["FAIL_TO_PASS"] and instance["PASS_TO_PASS"] and instance["patch"]
    again = build(out, tmp_path / "again.jsonl")
    assert f"{TASK}: {out / TASK} (unchanged" in again and "(reused)" in again
    assert (tmp_path / "again.jsonl").read_text() == (tmp_path / "instances.jsonl").read_text()

    [task] = swebench.convert([("line 1", instance)], image_dir=out)
    assert task["image"] == str(out / TASK) and task["workdir"] == "/testbed"
    image = open_image(task["image"], cache=tmp_path / "cache")
    assert image.config.working_dir == "/testbed"

    work = fresh_workdir(image, tmp_path / "bug")
    checks = ("python3 --version; git rev-parse HEAD; git status --porcelain; python3 -m pytest -q -p "
              "no:cacheprovider >/dev/null && echo pytest-ok; python3 -c 'import tabulate' && echo own-dep; "
              "python3 -c 'import yaml' 2>/dev/null || echo no-yaml; id -u")
    done = subprocess.run(bwrap_argv(image, ["sh", "-c", checks], work), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [done.stdout.splitlines()[0], instance["base_commit"], "pytest-ok",
                                        "own-dep", "no-yaml", "1000"]
    assert done.stdout.startswith("Python 3.11.")

    result, _ = evaluate(image, task, work, tmp_path)
    assert result["reward"] == 0.0 and "FAIL_TO_PASS" in result["reason"]

    fixed = fresh_workdir(image, tmp_path / "fixed")
    subprocess.run(["git", "apply"], input=instance["patch"], text=True, cwd=fixed, check=True)
    result, _ = evaluate(image, task, fixed, tmp_path)
    assert result == {"reward": 1.0, "resolved": True}
