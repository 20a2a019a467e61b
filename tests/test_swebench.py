"""SWE-bench's instances as lgt tasks (``lgt-train tasks swebench``, rollout/swebench.py) and the evaluator
that scores them (rollout/swebench_eval.py), on instances built here: a git repository with a bug at its
base commit, a test patch whose tests fail on the bug, and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from lgt.trainer.cli import main
from lgt.trainer.rollout import swebench
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
    assert config["agent"]["evaluator"] == ["python3", "/lgt/eval/swebench_eval.py"]
    assert config["agent"]["reward_sources"] == ["evaluator"]
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
    lgt_train("tasks", "swebench", src, "--out", out, "--image-dir", images, "--workdir", "/src/calc",
              "--hints", "--python", "/opt/miniconda3/envs/testbed/bin/python")
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
