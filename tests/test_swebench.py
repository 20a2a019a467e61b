"""SWE-bench's instances as lgt tasks (``lgt-train tasks swebench``, rollout/swebench.py) and the evaluator
that scores them (rollout/swebench_eval.py), on instances built here: a git repository with a bug at its
base commit, a test patch whose tests fail on the bug, and the fix."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lgt.testing.swebench import BUGGY, F2P, FIXED, NEW_TESTS, P2P, git, make_repo
from lgt.trainer.cli import main
from lgt.trainer.rollout import swebench
from lgt.trainer.rollout import swebench_eval as ev
from lgt.trainer.rollout.agent import AgentSpec, task_env

TEST_PATCH = """\
diff --git a/tests/test_calc.py b/tests/test_calc.py
--- a/tests/test_calc.py
+++ b/tests/test_calc.py
@@ -1,4 +1,8 @@
 from calc import add
 
 def test_add_zero():
     assert add(0, 0) == 0
+
+
+def test_add():
+    assert add(2, 3) == 5
"""


def instance(iid: str = "acme__calc-1", **over) -> dict:
    base = {"instance_id": iid, "repo": "acme/calc", "base_commit": "0" * 40,
            "problem_statement": "add(2, 3) gives -1", "test_patch": TEST_PATCH,
            "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::test_add"]),
            "PASS_TO_PASS": json.dumps(["tests/test_calc.py::test_add_zero"]),
            "image_name": f"swebench/sweb.eval.x86_64.{iid}:latest", "version": 1.0,
            "hints_text": "look at the sign", "environment_setup_commit": "1" * 40}
    base.update(over)
    return {k: v for k, v in base.items() if v is not None}


def write_jsonl(path: Path, items: list) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in items))
    return path


def lgt_train(*args, code: int = 0):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result


# --- the converter -------------------------------------------------------------------------------------

def test_an_instance_becomes_a_task_whose_hidden_tests_the_agent_never_sees(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "instances.jsonl", [instance(), instance("acme__calc-2")])
    out = tmp_path / "tasks.jsonl"
    result = lgt_train("tasks", "swebench", src, "--out", out)
    tasks = [json.loads(line) for line in out.read_text().splitlines()]
    assert [t["task_id"] for t in tasks] == ["acme__calc-1", "acme__calc-2"]
    t = tasks[0]
    # the JSON-encoded lists of the published dataset become lists
    assert t["FAIL_TO_PASS"] == ["tests/test_calc.py::test_add"]
    assert t["PASS_TO_PASS"] == ["tests/test_calc.py::test_add_zero"]
    assert t["workdir"] == "/testbed" and t["image"] == "swebench/sweb.eval.x86_64.acme__calc-1:latest"
    assert t["version"] == "1.0" and t["repo"] == "acme/calc" and t["base_commit"] == "0" * 40
    assert "acme/calc" in t["prompt"] and "/testbed" in t["prompt"] and "add(2, 3) gives -1" in t["prompt"]
    assert "hints_text" not in t and "look at the sign" not in t["prompt"]  # hints only with --hints
    assert "environment_setup_commit" not in t
    # the config lines printed: the hidden fields private, the evaluator the only reward source
    config = yaml.safe_load(result.output.split("\n", 1)[1])
    assert config["tasks"] == str(out)
    assert config["agent"]["private"] == list(swebench.PRIVATE)
    assert config["agent"]["evaluator"] == ["python3", str(swebench.EVALUATOR_FILE), "--timeout", "1800"]
    assert config["agent"]["image_field"] == "image"
    assert config["agent"]["reward_sources"] == ["evaluator"]
    assert swebench.EVALUATOR_FILE.is_file()
    spec = AgentSpec(command=("true",), **{k: v for k, v in config["agent"].items()})
    # what the controller gives the agent (its variables; its $TASK_JSON is agent_view) holds no hidden test
    env = task_env(t, private=spec.private)
    view = json.dumps(swebench.agent_view(t))
    for secret in ("test_add()", "test_add_zero", "def test_add"):
        assert not any(secret in v for v in env.values()) and secret not in view
    assert {"TASK_PROMPT", "TASK_REPO", "TASK_WORKDIR", "TASK_IMAGE"} <= set(env)
    assert not {"TASK_TEST_PATCH", "TASK_FAIL_TO_PASS", "TASK_PASS_TO_PASS"} & set(env)


def test_json_lists_parquet_hints_workdir_and_the_image_folder(tmp_path: Path) -> None:
    images = tmp_path / "images"
    (images / "acme__calc-2").mkdir(parents=True)  # an OCI layout folder
    (images / "acme__calc-1.tar").write_bytes(b"")
    (images / "other_name_v1.tar").write_bytes(b"")
    items = [instance(FAIL_TO_PASS=["tests/test_calc.py::test_add"]), instance("acme__calc-2"),
             instance("acme__calc-3", image_name="other/name:v1")]
    src = tmp_path / "instances.json"
    src.write_text(json.dumps(items, indent=1))
    out = tmp_path / "tasks.jsonl"
    result = lgt_train("tasks", "swebench", src, "--out", out, "--image-dir", images,
                       "--workdir", "/src/calc", "--hints", "--test-timeout", "90.5",
                       "--python", "/opt/miniconda3/envs/testbed/bin/python")
    config = yaml.safe_load(result.output.split("\n", 1)[1])
    assert config["agent"]["evaluator"] == ["/opt/miniconda3/envs/testbed/bin/python",
                                            str(swebench.EVALUATOR_FILE), "--timeout", "90.5"]
    tasks = [json.loads(line) for line in out.read_text().splitlines()]
    assert [t["image"] for t in tasks] == [str((images / x).resolve()) for x in
                                           ("acme__calc-1.tar", "acme__calc-2", "other_name_v1.tar")]
    assert all(t["workdir"] == "/src/calc" and "/src/calc" in t["prompt"] for t in tasks)
    assert all("look at the sign" in t["prompt"] for t in tasks)
    items[0] = instance()  # one column type in Parquet: the JSON-encoded lists, as the dataset has them
    pq.write_table(pa.Table.from_pylist(items), tmp_path / "instances.parquet")
    lgt_train("tasks", "swebench", tmp_path / "instances.parquet", "--out", tmp_path / "p.jsonl",
              "--image-dir", images, "--workdir", "/src/calc", "--hints")
    assert [json.loads(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()] == tasks


@pytest.mark.parametrize("items, sentence", [
    ([instance(test_patch=None)], "instances.jsonl line 1: instance acme__calc-1 lacks test_patch"),
    ([instance(FAIL_TO_PASS=None, PASS_TO_PASS="")],
     "line 1: instance acme__calc-1 lacks FAIL_TO_PASS, PASS_TO_PASS"),
    ([instance(FAIL_TO_PASS="tests/test_calc.py::test_add")],
     "line 1: FAIL_TO_PASS is a string that is not a JSON list of test ids"),
    ([instance(FAIL_TO_PASS=[1, 2])],
     "line 1: FAIL_TO_PASS must be a list of test ids (strings), not [1, 2]"),
    ([instance(PASS_TO_PASS='{"a": 1}')],
     "PASS_TO_PASS must be a list of test ids (strings), not {\"a\": 1}"),
    ([instance(FAIL_TO_PASS="[]")], "instance acme__calc-1 has no FAIL_TO_PASS test"),
    ([instance(), instance("b"), instance()],
     "instances.jsonl line 3: instance acme__calc-1 was given already at "),
    ([instance(test_patch="fix it")], "the test_patch of instance acme__calc-1 is not a diff"),
    ([instance(image_name=None)], "instance acme__calc-1 names no image (image_name); give --image-dir"),
    ([instance(test_command="pytest")], "test_command must be a non-empty list of strings"),
    ([instance(test_parser="junit")], "test_parser must be one of pytest, unittest, not \"junit\""),
    ([instance(), "a"], "instances.jsonl line 2 is not a JSON object but str"),
    ([], "the instance file holds no instance"),
])
def test_bad_instances_are_refused_in_one_sentence_and_nothing_is_written(tmp_path: Path, items: list,
                                                                           sentence: str) -> None:
    out = tmp_path / "tasks.jsonl"
    out.write_text("old\n")
    result = lgt_train("tasks", "swebench", write_jsonl(tmp_path / "instances.jsonl", items), "--out", out,
                       code=1)
    assert sentence in result.output and result.output.count("\n") == 1, result.output
    assert out.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["instances.jsonl", "tasks.jsonl"]


def test_files_and_options_that_are_refused(tmp_path: Path) -> None:
    src = tmp_path / "instances.jsonl"
    src.write_text(json.dumps(instance()) + "\n{oops\n")
    assert "instances.jsonl line 2 is not JSON" in lgt_train("tasks", "swebench", src, "--out",
                                                              tmp_path / "t.jsonl", code=1).output
    src.write_text("[" + json.dumps(instance()))
    assert "instances.jsonl is not a JSON list" in lgt_train("tasks", "swebench", src, "--out",
                                                             tmp_path / "t.jsonl", code=1).output
    write_jsonl(src, [instance()])
    images = tmp_path / "images"
    images.mkdir()
    result = lgt_train("tasks", "swebench", src, "--out", tmp_path / "t.jsonl", "--image-dir", images, code=1)
    assert (f"no image for instance acme__calc-1 in {images} (looked for acme__calc-1.tar, acme__calc-1, "
            "swebench_sweb.eval.x86_64.acme__calc-1_latest.tar") in result.output
    result = lgt_train("tasks", "swebench", src, "--out", tmp_path / "t.jsonl", "--workdir", "testbed",
                       code=1)
    assert "--workdir must be an absolute path inside the image, not 'testbed'" in result.output
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    assert "bad.parquet is not a readable Parquet file" in lgt_train(
        "tasks", "swebench", tmp_path / "bad.parquet", "--out", tmp_path / "t.jsonl", code=1).output
    assert not (tmp_path / "t.jsonl").exists()


# --- the evaluator ---------------------------------------------------------------------------------------

@pytest.fixture
def repo(tmp_path: Path) -> tuple[Path, str, str]:
    return make_repo(tmp_path / "testbed")


def evaluate(repo: Path, base: str, patch: str, *extra: str, **fields) -> tuple[int, list, str]:
    """Run the evaluator as lgt does (``evaluator... TASK_JSON STDOUT_PATH``); (exit code, its stdout lines
    as JSON, its stderr)."""
    task = {"task_id": "acme__calc-1", "workdir": str(repo), "base_commit": base, "test_patch": patch,
            "FAIL_TO_PASS": F2P, "PASS_TO_PASS": P2P, **fields}
    task = {k: v for k, v in task.items() if v is not None}
    task_json = repo.parent / "task.json"
    task_json.write_text(json.dumps(task))
    r = subprocess.run([sys.executable, str(swebench.EVALUATOR_FILE), *extra, str(task_json),
                        str(repo.parent / "agent.out")], capture_output=True, text=True, timeout=120)
    return r.returncode, [json.loads(line) for line in r.stdout.splitlines()], r.stderr


def test_the_untouched_repository_scores_0_and_names_the_failing_tests(repo) -> None:
    path, base, patch = repo
    code, (report, reward), log = evaluate(path, base, patch)
    assert code == 0 and reward["reward"] == 0.0 and reward["resolved"] is False
    assert reward["reason"] == ("2 of 2 FAIL_TO_PASS tests did not pass: tests/test_calc.py::test_add "
                                "(FAILED), tests/test_new.py::test_add_pairs[2-3] (FAILED)")
    assert report["swebench"]["tests"] == {"FAIL_TO_PASS": dict.fromkeys(F2P, "FAILED"),
                                           "PASS_TO_PASS": dict.fromkeys(P2P, "PASSED")}
    assert report["swebench"]["instance_id"] == "acme__calc-1"
    assert report["swebench"]["test_patch"] == "git apply"
    assert "short test summary info" in log  # the test run's output, on stderr
    assert agent_line_reward(reward) == 0.0


def agent_line_reward(line: dict) -> float:
    """The reward lgt's controller reads from the evaluator's last stdout line."""
    from lgt.trainer.rollout.agent import parse_reward

    return parse_reward(json.dumps(line))


def test_the_fix_scores_1(repo) -> None:
    path, base, patch = repo
    (path / "calc.py").write_text(FIXED)  # the agent's change
    code, (report, reward), _ = evaluate(path, base, patch)
    assert code == 0 and reward == {"reward": 1.0, "resolved": True}
    assert agent_line_reward(reward) == 1.0
    assert report["swebench"]["tests"] == {"FAIL_TO_PASS": dict.fromkeys(F2P, "PASSED"),
                                           "PASS_TO_PASS": dict.fromkeys(P2P, "PASSED")}
    assert report["swebench"]["reason"] is None


@pytest.mark.parametrize("fixed", [False, True])
def test_the_agents_edits_to_the_tests_are_undone_before_the_test_patch(repo, fixed: bool) -> None:
    path, base, patch = repo
    if fixed:
        (path / "calc.py").write_text(FIXED)
    # tests that would pass on the bug, in the files the test patch touches: one edited, one created
    tests = path / "tests"
    (tests / "test_calc.py").write_text("def test_add_zero():\n    pass\n\n\ndef test_add():\n    pass\n")
    (tests / "test_new.py").write_text("import pytest\n\n@pytest.mark.parametrize('a, b', [(2, 3)])\n"
                                       "def test_add_pairs(a, b):\n    pass\n")
    code, (report, reward), _ = evaluate(path, base, patch)
    assert code == 0 and reward["reward"] == (1.0 if fixed else 0.0), reward
    assert set(report["swebench"]["tests"]["FAIL_TO_PASS"].values()) == {"PASSED" if fixed else "FAILED"}
    assert (path / "tests" / "test_calc.py").read_text() == NEW_TESTS  # the base's file, then the patch


def test_a_test_file_turned_into_a_folder_or_a_symlink_is_put_back(repo, tmp_path: Path) -> None:
    path, base, patch = repo
    (path / "calc.py").write_text(FIXED)
    (path / "tests" / "test_calc.py").unlink()
    (path / "tests" / "test_calc.py").mkdir()
    outside = tmp_path / "outside.py"
    outside.write_text("kept\n")
    (path / "tests" / "test_new.py").symlink_to(outside)
    code, (_, reward), _ = evaluate(path, base, patch)
    assert reward == {"reward": 1.0, "resolved": True}
    assert outside.read_text() == "kept\n"  # the symlink was replaced, not written through
    # the tests' folder a symlink to one outside: nothing there is touched
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "test_calc.py").write_text("kept\n")
    shutil.rmtree(path / "tests")
    (path / "tests").symlink_to(tmp_path / "elsewhere")
    code, (_, reward), _ = evaluate(path, base, patch)
    assert reward == {"reward": 1.0, "resolved": True}
    assert (tmp_path / "elsewhere" / "test_calc.py").read_text() == "kept\n"
    assert not (path / "tests").is_symlink() and (path / "tests" / "test_calc.py").read_text() == NEW_TESTS


@pytest.mark.parametrize("wreck, reason", [
    (lambda p: shutil.rmtree(p), "the repository {repo} is gone"),
    (lambda p: shutil.rmtree(p / ".git"), "{repo} is no longer a git repository (its .git is gone)"),
    (lambda p: (shutil.rmtree(p / ".git"), git(p, "init", "-q")),
     "the base commit {base} is not in the repository at {repo}"),
    (lambda p: (p / "tests").chmod(0o500),
     "the test file tests/test_calc.py could not be reset (Permission denied)"),
])
def test_an_agent_that_wrecked_the_repository_scores_0_with_the_reason(repo, wreck, reason: str) -> None:
    path, base, patch = repo
    if "Permission" in reason and os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    wreck(path)
    try:
        code, lines, err = evaluate(path, base, patch)
    finally:
        if (path / "tests").exists():
            (path / "tests").chmod(0o700)
    assert code == 0, err
    assert lines[-1] == {"reward": 0.0, "resolved": False, "reason": reason.format(repo=path, base=base)}
    assert lines[0]["swebench"]["tests"] is None


def test_a_test_patch_that_does_not_apply_scores_0_and_patch_takes_a_fuzzy_one(repo) -> None:
    path, base, patch = repo
    # a hunk that deletes a line the file does not have
    header = next(x for x in patch.splitlines() if x.startswith("@@"))
    old = header.split()[1].split(",")
    broken = patch.replace(header + "\n", f"{header.replace(','.join(old), f'{old[0]},{int(old[1]) + 1}')}\n"
                                          "-not in the file\n", 1)
    code, lines, _ = evaluate(path, base, broken)
    assert code == 0 and lines[-1]["reward"] == 0.0
    assert lines[-1]["reason"].startswith("the test patch does not apply (")
    # a context line off: git apply refuses it, patch --fuzz takes it (SWE-bench's fallback)
    (path / "calc.py").write_text(FIXED)
    fuzzy = patch.replace(" def test_add_zero():", " def test_add_zero(): # was")
    code, lines, _ = evaluate(path, base, fuzzy)
    assert lines[-1] == {"reward": 1.0, "resolved": True} and lines[0]["swebench"]["test_patch"] == "patch"


def test_tests_that_hang_are_killed_and_score_0(repo) -> None:
    path, base, patch = repo
    (path / "calc.py").write_text("import time\n\n\ndef add(a, b):\n    time.sleep(600)\n")
    t0 = time.monotonic()
    code, lines, _ = evaluate(path, base, patch, "--timeout", "3")
    assert time.monotonic() - t0 < 60
    assert code == 0 and lines[-1] == {"reward": 0.0, "resolved": False,
                                       "reason": "the tests ran past 3 s and were killed"}


def test_a_test_id_missing_from_the_run_is_not_a_pass(repo) -> None:
    path, base, patch = repo
    (path / "calc.py").write_text(FIXED)
    code, lines, _ = evaluate(path, base, patch, PASS_TO_PASS=P2P + ["tests/test_calc.py::test_gone"])
    assert lines[-1] == {"reward": 0.0, "resolved": False, "reason":
                         "1 of 2 PASS_TO_PASS tests did not pass: tests/test_calc.py::test_gone (missing)"}
    assert lines[0]["swebench"]["tests"]["PASS_TO_PASS"]["tests/test_calc.py::test_gone"] == "missing"


def test_another_test_runner_through_the_tasks_test_command(repo) -> None:
    path, base, patch = repo
    (path / "calc.py").write_text(FIXED)
    (path / "tests" / "__init__.py").write_text("")
    git(path, "add", "tests/__init__.py")
    # unittest's verbose names: "test_add (tests.test_calc.T.test_add)" from Python 3.11 on
    ut = ("import unittest\n\nfrom calc import add\n\n\nclass T(unittest.TestCase):\n"
          "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n")
    ut_patch = patch + ("diff --git a/tests/test_ut.py b/tests/test_ut.py\nnew file mode 100644\n"
                        "--- /dev/null\n+++ b/tests/test_ut.py\n@@ -0,0 +1,8 @@\n"
                        + "".join("+" + x + "\n" for x in ut.splitlines()))
    name = "test_add (tests.test_ut.T" + (".test_add)" if sys.version_info >= (3, 11) else ")")
    code, lines, err = evaluate(path, base, ut_patch, FAIL_TO_PASS=[name], PASS_TO_PASS=[],
                                test_command=[sys.executable, "-m", "unittest", "-v", "tests.test_ut"],
                                test_parser="unittest")
    assert lines[-1] == {"reward": 1.0, "resolved": True}, err
    (path / "calc.py").write_text(BUGGY)
    code, lines, err = evaluate(path, base, ut_patch, FAIL_TO_PASS=[name], PASS_TO_PASS=[],
                                test_command=[sys.executable, "-m", "unittest", "-v", "tests.test_ut"],
                                test_parser="unittest")
    assert lines[-1]["reward"] == 0.0 and f"{name} (FAILED)" in lines[-1]["reason"]


@pytest.mark.parametrize("fields, sentence", [
    ({"test_patch": None}, "the task lacks test_patch (are they in agent.private?"),
    ({"FAIL_TO_PASS": "tests/x.py::t"}, "the task's FAIL_TO_PASS is not a list of test ids"),
    ({"test_parser": "junit"}, "the task's test_parser must be one of pytest, unittest"),
    ({"workdir": None}, "no repository: give --repo, or a workdir field in the task"),
])
def test_a_task_without_what_the_evaluator_needs_is_the_runs_mistake_not_a_reward(repo, fields,
                                                                                   sentence: str) -> None:
    path, base, patch = repo
    code, lines, err = evaluate(path, base, patch, **fields)
    assert code == 2 and lines == [] and err == f"swebench_eval: {sentence}" + err.split(sentence, 1)[1]
    assert err.count("\n") == 1


def test_an_image_without_git_is_the_runs_mistake(repo, tmp_path: Path) -> None:
    path, base, patch = repo
    task_json = tmp_path / "task.json"
    task_json.write_text(json.dumps({"workdir": str(path), "base_commit": base, "test_patch": patch,
                                     "FAIL_TO_PASS": F2P, "PASS_TO_PASS": P2P}))
    r = subprocess.run([sys.executable, str(swebench.EVALUATOR_FILE), str(task_json), "agent.out"],
                       capture_output=True, text=True, env={"PATH": str(tmp_path / "no-bin")}, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == ("swebench_eval: git is not on PATH here: the image needs git to score SWE-bench "
                        "tasks\n")


def test_the_repositorys_git_hooks_do_not_run(repo) -> None:
    path, base, patch = repo
    (path / "calc.py").write_text(FIXED)
    marker = path.parent / "hooked"
    for hook in ("post-checkout", "pre-applypatch", "post-index-change"):
        (path / ".git" / "hooks" / hook).write_text(f"#!/bin/sh\ntouch {marker}\n")
        (path / ".git" / "hooks" / hook).chmod(0o755)
    (path / "tests" / "test_calc.py").write_text("")  # so that a checkout is needed
    code, lines, _ = evaluate(path, base, patch)
    assert lines[-1] == {"reward": 1.0, "resolved": True} and not marker.exists()


def test_the_reason_names_five_tests_and_counts_the_rest() -> None:
    task = {"FAIL_TO_PASS": [f"t.py::f{i}" for i in range(8)], "PASS_TO_PASS": ["t.py::p"]}
    out = ev.report(task, {"t.py::f0": "PASSED", "t.py::f1": "XFAIL", "t.py::p": "SKIPPED"})
    assert out["reason"] == ("6 of 8 FAIL_TO_PASS tests did not pass: t.py::f2 (missing), "
                             "t.py::f3 (missing), t.py::f4 (missing), t.py::f5 (missing), "
                             "t.py::f6 (missing) and 1 more; "
                             "1 of 1 PASS_TO_PASS tests did not pass: t.py::p (SKIPPED)")
    assert out["resolved"] is False and out["tests"]["FAIL_TO_PASS"]["t.py::f1"] == "XFAIL"
    assert ev.report(task, dict.fromkeys(task["FAIL_TO_PASS"] + task["PASS_TO_PASS"], "PASSED")) == {
        "resolved": True, "reason": None, "tests": {k: dict.fromkeys(v, "PASSED") for k, v in task.items()}}


def test_the_repository_may_be_given_by_repo(repo) -> None:
    path, base, patch = repo
    (path / "calc.py").write_text(FIXED)
    code, lines, _ = evaluate(path, base, patch, "--repo", str(path), workdir="/testbed")
    assert lines[-1] == {"reward": 1.0, "resolved": True}


def test_the_evaluator_is_one_file_of_the_standard_library_for_python_3_6() -> None:
    source = swebench.EVALUATOR_FILE.read_text()
    tree = ast.parse(source, feature_version=(3, 6))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)
    assert "__future__" not in source and "capture_output" not in source.replace("noqa", "")


# --- the patch and the summary parsers -------------------------------------------------------------------

def test_the_paths_a_patch_touches(repo) -> None:
    _, _, patch = repo
    assert ev.patch_paths(patch) == ["tests/test_calc.py", "tests/test_new.py"]
    renamed = ("diff --git a/t/old name.py b/t/new name.py\nsimilarity index 90%\nrename from t/old name.py\n"
               "rename to t/new name.py\n")
    assert ev.patch_paths(renamed) == ["t/old name.py", "t/new name.py"]
    quoted = 'diff --git "a/t/\\303\\251.py" "b/t/\\303\\251.py"\n--- "a/t/\\303\\251.py"\n'
    assert ev.patch_paths(quoted) == ["t/é.py"]
    plain = "--- a/x.py\t2020-01-01\n+++ b/x.py\t2020-01-02\n@@ -1 +1 @@\n--- a/not a header\n"
    assert ev.patch_paths(plain)[0] == "x.py"
    # a removed line "-- x" inside a git diff's hunk is not a header
    assert ev.patch_paths("diff --git a/q.sql b/q.sql\n@@ -1 +0,0 @@\n--- comment\n") == ["q.sql"]


_ids = st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), min_size=1, max_size=30).map(
    lambda s: "tests/t.py::" + s.strip()).filter(lambda s: not s.endswith("::"))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_ids, st.sampled_from(ev.PYTEST_STATUSES), st.text(max_size=20)), max_size=8,
                unique_by=lambda x: x[0]),
       st.lists(st.text(max_size=40), max_size=5))
def test_the_pytest_summary_parser_reads_every_line_it_should(rows, noise) -> None:
    ids = [r[0] for r in rows]
    assume(not any(a != b and b.startswith(a + " ") for a in ids for b in ids))  # one id no prefix of another
    lines = ["=========================== short test summary info ============================"]
    for (test, status, message), junk in zip(rows, noise + [""] * len(rows)):
        tail = f" - {message}" if status in ("FAILED", "ERROR") and message else ""
        lines.append(f"{status} {test}{tail}")
        lines.append(junk.replace("\n", " "))
    assert ev.parse_pytest("\n".join(lines), ids) == {t: s for t, s, _ in rows}


@given(st.text(), st.lists(st.text(), max_size=4))
def test_the_parsers_never_raise(text, ids) -> None:
    for parse in ev.PARSERS.values():
        out = parse(text, ids)
        assert set(out) <= set(ids) and set(out.values()) <= set(ev.PYTEST_STATUSES)


def test_a_test_reported_twice_keeps_the_outcome_that_does_not_pass() -> None:
    log = "PASSED t.py::a\nERROR t.py::a - teardown failed\nXFAIL t.py::b - known\nPASSED t.py::c\n"
    assert ev.parse_pytest(log, ["t.py::a", "t.py::b", "t.py::c"]) == {"t.py::a": "ERROR", "t.py::b": "XFAIL",
                                                                       "t.py::c": "PASSED"}


def test_a_skipped_test_reads_as_missing() -> None:
    # pytest -rA names a skip by its location ("SKIPPED [1] t.py:4: reason"), not by its id
    assert ev.parse_pytest("SKIPPED [1] t.py:4: no\n", ["t.py::test_s"]) == {}
    assert ev.report({"FAIL_TO_PASS": ["t.py::test_s"], "PASS_TO_PASS": []}, {})["tests"]["FAIL_TO_PASS"] == {
        "t.py::test_s": "missing"}
