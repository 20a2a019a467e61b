"""SWE-bench's instances as lgt tasks: each instance (a repository at a commit, an issue, hidden tests)
becomes one task line, and the run config that goes with them keeps the hidden tests from the agent.

An instance is a JSON object with ``instance_id``, ``repo``, ``base_commit``, ``problem_statement``,
``test_patch``, ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` (the last two lists of test ids, or such a list
JSON-encoded as the published dataset has them), optionally ``image_name`` / ``image``, ``version``,
``hints_text``, ``environment_setup_commit``, and for a test runner other than pytest ``test_command``
and ``test_parser``. A file of them is JSON lines, a JSON list, or Parquet (the dataset as published).

The task the agent sees holds ``task_id`` (the instance id), ``prompt``, ``problem_statement``,
``repo``, ``base_commit``, ``workdir`` (where the repository is inside the image: ``/testbed`` in
SWE-bench's images), ``image`` and ``version``; :data:`PRIVATE` fields ride along for the evaluator
(:mod:`lgt.trainer.rollout.swebench_eval`) and are listed in ``agent.private``, so the agent's
variables and ``$TASK_JSON`` never hold them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lgt.store.files import write_atomic

REQUIRED = ("instance_id", "repo", "base_commit", "problem_statement", "test_patch", "FAIL_TO_PASS",
            "PASS_TO_PASS")
# what only the evaluator gets: the hidden tests and how to run them
PRIVATE = ("test_patch", "FAIL_TO_PASS", "PASS_TO_PASS", "test_command", "test_parser")
TEST_PARSERS = ("pytest", "unittest")  # swebench_eval.PARSERS
EVALUATOR_FILE = Path(__file__).with_name("swebench_eval.py")
DEFAULT_WORKDIR = "/testbed"
PROMPT = ("The repository {repo} is checked out at {workdir}. Resolve the issue below by editing the "
          "repository's files there.\n\n{problem_statement}")


class InstanceError(ValueError):
    """An instance file lgt cannot turn into tasks; one sentence naming the instance and what is wrong."""


def read_instances(path: Path) -> list[tuple[str, Any]]:
    """``(where, instance)`` pairs from a JSON-lines, JSON-list or Parquet file, ``where`` naming the
    line or item for error sentences."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow's errors have no common base
            raise InstanceError(f"{path} is not a readable Parquet file ({e})") from None
        return [(f"{path} row {i + 1}", row) for i, row in enumerate(rows)]
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InstanceError(f"{path} is not UTF-8 text") from None
    except OSError as e:
        raise InstanceError(f"{path} cannot be read ({e.strerror})") from None
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except ValueError as e:
            raise InstanceError(f"{path} is not a JSON list ({e})") from None
        return [(f"{path} item {i + 1}", x) for i, x in enumerate(items)]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append((f"{path} line {n}", json.loads(line)))
            except ValueError as e:
                raise InstanceError(f"{path} line {n} is not JSON ({e})") from None
    return out


def test_ids(value: Any, field: str, where: str) -> list[str]:
    """A list of test ids, given as a list of strings or such a list JSON-encoded."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise InstanceError(f"{where}: {field} is a string that is not a JSON list of test ids") from None
    if not isinstance(value, list) or not all(isinstance(x, str) and x for x in value):
        raise InstanceError(f"{where}: {field} must be a list of test ids (strings), not {_short(value)}")
    return value


def image_for(instance: Mapping[str, Any], image_dir: Path | None, where: str) -> str:
    """The task's image: with ``image_dir``, the file or folder there named after the instance id (or its
    image name, ``/`` and ``:`` as ``_``), as an absolute path; else the instance's own image name."""
    name = instance.get("image_name") or instance.get("image")
    if name is not None and not isinstance(name, str):
        raise InstanceError(f"{where}: image_name must be a string, not {_short(name)}")
    if image_dir is None:
        if name is None:
            raise InstanceError(f"{where}: instance {instance['instance_id']} names no image (image_name); "
                                "give --image-dir, the folder holding each instance's image")
        return name
    stems = [str(instance["instance_id"])] + ([re.sub(r"[/:]", "_", name)] if name else [])
    candidates = [image_dir / f"{s}{ext}" for s in stems for ext in (".tar", "")]
    for c in candidates:
        if c.exists():
            return str(c.resolve())
    raise InstanceError(f"{where}: no image for instance {instance['instance_id']} in {image_dir} (looked "
                        f"for {', '.join(c.name for c in candidates)})")


def to_task(instance: Any, where: str, *, workdir: str = DEFAULT_WORKDIR, image_dir: Path | None = None,
            hints: bool = False) -> dict[str, Any]:
    """One lgt task of one instance (see the module's docstring for its fields)."""
    if not isinstance(instance, dict):
        raise InstanceError(f"{where} is not a JSON object but {type(instance).__name__}")
    missing = [f for f in REQUIRED if instance.get(f) in (None, "")]
    if missing:
        raise InstanceError(f"{where}: instance {instance.get('instance_id', '(no instance_id)')} lacks "
                            f"{', '.join(missing)}")
    for f in ("instance_id", "repo", "base_commit", "problem_statement", "test_patch"):
        if not isinstance(instance[f], str):
            raise InstanceError(f"{where}: {f} must be a string, not {_short(instance[f])}")
    iid = instance["instance_id"]
    f2p = test_ids(instance["FAIL_TO_PASS"], "FAIL_TO_PASS", where)
    p2p = test_ids(instance["PASS_TO_PASS"], "PASS_TO_PASS", where)
    if not f2p:
        raise InstanceError(f"{where}: instance {iid} has no FAIL_TO_PASS test, so nothing would tell a fix "
                            "from no change")
    if "diff --git" not in instance["test_patch"] and "\n+++ " not in instance["test_patch"]:
        raise InstanceError(f"{where}: the test_patch of instance {iid} is not a diff")
    problem = instance["problem_statement"]
    if hints and isinstance(instance.get("hints_text"), str) and instance["hints_text"].strip():
        problem += "\n\nHints:\n" + instance["hints_text"]
    prompt = PROMPT.format(repo=instance["repo"], workdir=workdir, problem_statement=problem)
    task: dict[str, Any] = {
        "task_id": iid, "prompt": prompt, "problem_statement": problem, "repo": instance["repo"],
        "base_commit": instance["base_commit"],
        "workdir": workdir, "image": image_for(instance, image_dir, where),
    }
    if instance.get("version") not in (None, ""):
        task["version"] = str(instance["version"])
    task.update(test_patch=instance["test_patch"], FAIL_TO_PASS=f2p, PASS_TO_PASS=p2p)
    command = instance.get("test_command")
    if command is not None:
        if not isinstance(command, list) or not command or not all(isinstance(a, str) for a in command):
            raise InstanceError(f"{where}: test_command must be a non-empty list of strings, not "
                                f"{_short(command)}")
        task["test_command"] = command
    parser = instance.get("test_parser")
    if parser is not None:
        if parser not in TEST_PARSERS:
            raise InstanceError(f"{where}: test_parser must be one of {', '.join(TEST_PARSERS)}, not "
                                f"{_short(parser)}")
        task["test_parser"] = parser
    return task


def convert(instances: Iterable[tuple[str, Any]], **options: Any) -> list[dict[str, Any]]:
    """The tasks of ``(where, instance)`` pairs (:func:`to_task`); an instance id given twice is refused."""
    tasks: list[dict[str, Any]] = []
    seen: dict[str, str] = {}
    for where, instance in instances:
        task = to_task(instance, where, **options)
        iid = task["task_id"]
        if iid in seen:
            raise InstanceError(f"{where}: instance {iid} was given already at {seen[iid]}")
        seen[iid] = where
        tasks.append(task)
    if not tasks:
        raise InstanceError("the instance file holds no instance")
    return tasks


def agent_view(task: Mapping[str, Any]) -> dict[str, Any]:
    """What the agent of a run configured by :func:`run_config` sees of ``task``."""
    return {k: v for k, v in task.items() if k not in PRIVATE}


def write_tasks(tasks: Sequence[Mapping[str, Any]], out: Path) -> None:
    """The tasks as JSON lines, written whole (``out`` is the old file or the new one, never a part)."""
    write_atomic(out, "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in tasks))


def run_config(tasks_file: Path, *, python: str = "python3", evaluator: Path = EVALUATOR_FILE,
               test_timeout_s: float = 1800.0) -> str:
    """The run config's lines that go with the tasks (YAML): each task in the image its ``image`` field
    names, the hidden fields private, the evaluator the only reward source (an agent printing ``1.0`` or
    writing the reward file is not believed)."""
    return (f"tasks: {json.dumps(str(tasks_file))}\n"
            "agent:\n"
            "  image_field: image                 # each task runs in the image its image field names\n"
            f"  private: [{', '.join(PRIVATE)}]\n"
            f"  # lgt's {EVALUATOR_FILE.name}: bound read-only into the grader's sandbox, run by the\n"
            "  # image's Python on the tree the agent left; like the agent it is killed at\n"
            "  # agent.timeout_s: keep --timeout (the tests' limit) below it\n"
            f"  evaluator: [{json.dumps(python)}, {json.dumps(str(evaluator))}, "
            f"--timeout, '{test_timeout_s:g}']\n"
            "  reward_sources: [evaluator]\n")


def _short(value: Any, n: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= n else text[:n] + "…"
