# ruff: noqa: UP021, UP022
"""The evaluator of SWE-bench tasks (``lgt-train tasks swebench``): did the agent's change resolve the issue?

Run in the task's image, in the repository the agent left, by the image's own Python::

    python3 swebench_eval.py [--repo DIR] [--timeout SECONDS] TASK_JSON STDOUT_PATH

(lgt appends ``TASK_JSON STDOUT_PATH`` to ``agent.evaluator``; the agent's stdout is not read). A single
file of the standard library only, written for Python 3.6 and later, so it can be mounted read-only into
any image and needs nothing of lgt. SWE-bench's harness, step by step:

1. the task's private fields: ``test_patch``, ``FAIL_TO_PASS``, ``PASS_TO_PASS``, ``base_commit``, and
   optionally ``test_command`` / ``test_parser``; the repository is ``--repo`` or the task's ``workdir``;
2. every file the test patch touches is put back as it is at ``base_commit`` (removed where the patch
   creates it), so the agent's edits to the tests count for nothing;
3. the test patch is applied: ``git apply``, else ``patch -p1 --fuzz=5``;
4. the tests run: by default ``<this Python> -m pytest -rA -p no:cacheprovider`` on the files of the test
   ids; a task's ``test_command`` (a list of strings, ``{tests}`` standing for the test ids and ``{files}``
   for their files) replaces it, and ``test_parser: unittest`` reads ``name ... ok`` lines instead of
   pytest's summary; past ``--timeout`` seconds the run is killed;
5. each FAIL_TO_PASS and PASS_TO_PASS test's outcome is read from the output: PASSED and XFAIL pass,
   anything else (FAILED, ERROR, SKIPPED, XPASS, or not in the output: ``missing``) does not.

stdout: one JSON line with the report (:func:`report`), then the last line, the reward:
``{"reward": 1.0, "resolved": true}`` when every FAIL_TO_PASS and PASS_TO_PASS test passes, else
``{"reward": 0.0, "resolved": false, "reason": "..."}``. Whatever the agent left — no repository, a test
patch that no longer applies, tests that hang or are gone — ends in reward 0 and its reason; the test run's
output goes to stderr. A task without its private fields, or an image without git, is the run's mistake,
not the agent's: one sentence on stderr and exit code 2, no reward.
"""

import argparse
import codecs
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

PASSING = ("PASSED", "XFAIL")
PYTEST_STATUSES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
UNITTEST_STATUSES = {"ok": "PASSED", "FAIL": "FAILED", "ERROR": "ERROR", "skipped": "SKIPPED",
                     "expected failure": "XFAIL", "unexpected success": "XPASS"}
# git reads its hooks and fsmonitor from the repository the agent wrote: neither runs here
GIT = ("git", "-c", "safe.directory=*", "-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false")
GIT_TIMEOUT_S = 300
NAMED = 5  # tests named in the reason, the rest counted


class TaskError(Exception):
    """The task or the image is not what this evaluator needs (exit 2, no reward)."""


class Unresolved(Exception):
    """The agent's state cannot be scored: reward 0, with this reason."""


# --- reading the task and the patch ------------------------------------------------------------------------

def load_task(path):
    """The task's fields this evaluator uses, checked; TaskError (one sentence) otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            task = json.load(f)
    except (OSError, ValueError) as e:
        raise TaskError(f"cannot read the task file {path}: {e}") from None
    if not isinstance(task, dict):
        raise TaskError(f"the task file {path} does not hold a JSON object")
    missing = [k for k in ("test_patch", "FAIL_TO_PASS", "PASS_TO_PASS", "base_commit") if k not in task]
    if missing:
        raise TaskError("the task lacks {} (are they in agent.private? the evaluator is given every task "
                        "field)".format(", ".join(missing)))
    for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        value = task[key]
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                value = None
        if not isinstance(value, list) or not all(isinstance(x, str) and x for x in value):
            raise TaskError(f"the task's {key} is not a list of test ids")
        task[key] = value
    command = task.get("test_command")
    if command is not None and (not isinstance(command, list) or not command
                                or not all(isinstance(a, str) for a in command)):
        raise TaskError("the task's test_command is not a non-empty list of strings")
    if task.get("test_parser", "pytest") not in PARSERS:
        raise TaskError("the task's test_parser must be one of {}".format(", ".join(PARSERS)))
    if not isinstance(task["test_patch"], str) or not isinstance(task["base_commit"], str):
        raise TaskError("the task's test_patch and base_commit must be strings")
    return task


def _unquote(name):
    """A path as git writes it in a diff header: ``"a/t\\303\\251st"`` (C-quoted) or as it is."""
    if name.startswith('"') and name.endswith('"'):
        return codecs.escape_decode(name[1:-1].encode("utf-8"))[0].decode("utf-8", "replace")
    return name


def _strip(name, prefix):
    return name[len(prefix):] if name.startswith(prefix) else name


def patch_paths(patch):
    """The repository paths a diff touches (both sides of a rename), in order of appearance."""
    paths = []

    def add(p):
        if p and p != "/dev/null" and p not in paths:
            paths.append(p)

    lines = patch.splitlines()
    git_diff = any(line.startswith("diff --git ") for line in lines)
    for line in lines:
        if line.startswith("diff --git "):
            rest = line[len("diff --git "):]
            if rest.startswith('"'):
                m = re.match(r'("(?:[^"\\]|\\.)*")\s+(.*)$', rest)
                if m:
                    add(_strip(_unquote(m.group(1)), "a/"))
                    add(_strip(_unquote(m.group(2)), "b/"))
            elif rest.endswith('"'):
                m = re.match(r'(.*?)\s+("(?:[^"\\]|\\.)*")$', rest)
                if m:
                    add(_strip(m.group(1), "a/"))
                    add(_strip(_unquote(m.group(2)), "b/"))
            else:  # a/X b/X: one path twice (a rename names its two on the lines below)
                half = (len(rest) - 1) // 2
                if rest[half:half + 1] == " " and _strip(rest[:half], "a/") == _strip(rest[half + 1:], "b/"):
                    add(_strip(rest[:half], "a/"))
        elif line.startswith(("rename from ", "rename to ", "copy to ")):
            add(_unquote(line.split(" ", 2)[2]))
        elif not git_diff and line.startswith(("--- ", "+++ ")):  # a plain diff -u
            add(_strip(_unquote(line[4:].split("\t")[0].rstrip()), "a/" if line[0] == "-" else "b/"))
    return paths


# --- reading the test run's output -------------------------------------------------------------------------

def parse_pytest(log, ids):
    """``{test id: status}`` from pytest's ``-rA`` summary lines (``STATUS id`` or ``STATUS id - message``).
    The ids are matched whole, so ids holding spaces or `` - `` are read right; a test reported twice
    (passed, then an error in its teardown) keeps the outcome that does not pass."""
    wanted = set(ids)
    out = {}
    for line in log.splitlines():
        status, _, rest = line.strip().partition(" ")
        if status not in PYTEST_STATUSES or not rest:
            continue
        rest = rest.strip()
        found = rest if rest in wanted else None
        if found is None:  # the longest wanted id that the line starts with, followed by a space
            starts = [t for t in wanted if rest.startswith(t + " ")]
            found = max(starts, key=len) if starts else None
        if found is not None:
            _note(out, found, status)
    return out


_UNITTEST_LINE = re.compile(r"^(.+?) \.\.\. (ok|FAIL|ERROR|skipped|expected failure|unexpected success)\b")


def parse_unittest(log, ids):
    """``{test id: status}`` from unittest's verbose lines, ``test_name (module.Class) ... ok``."""
    wanted = set(ids)
    out = {}
    for line in log.splitlines():
        m = _UNITTEST_LINE.match(line.strip())
        if m and m.group(1) in wanted:
            _note(out, m.group(1), UNITTEST_STATUSES[m.group(2)])
    return out


def _note(out, test, status):
    if test not in out or out[test] in PASSING:
        out[test] = status


PARSERS = {"pytest": parse_pytest, "unittest": parse_unittest}


# --- the steps ---------------------------------------------------------------------------------------------

def _git(repo, *args):
    try:
        return subprocess.run(GIT + args, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, timeout=GIT_TIMEOUT_S)
    except FileNotFoundError:
        raise TaskError("git is not on PATH here: the image needs git to score SWE-bench tasks") from None
    except subprocess.TimeoutExpired:
        raise Unresolved(f"git {args[0]} ran past {GIT_TIMEOUT_S} s") from None


def _last(text):
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    return lines[-1] if lines else "no message"


def check_repo(repo, base):
    if not os.path.isdir(repo):
        raise Unresolved(f"the repository {repo} is gone")
    if not os.path.exists(os.path.join(repo, ".git")):
        raise Unresolved(f"{repo} is no longer a git repository (its .git is gone)")
    r = _git(repo, "rev-parse", "--show-toplevel")
    if r.returncode != 0 or os.path.realpath(r.stdout.strip()) != os.path.realpath(repo):
        raise Unresolved(f"{repo} is no longer a git repository ({_last(r.stderr)})")
    if _git(repo, "cat-file", "-e", base + "^{commit}").returncode != 0:
        raise Unresolved(f"the base commit {base} is not in the repository at {repo}")


def reset_tests(repo, base, paths):
    """Each path as it is at ``base``, or absent where ``base`` has none (the test patch creates it)."""
    for path in paths:
        if os.path.isabs(path) or ".." in path.split("/"):
            raise TaskError(f"the test patch names {path!r}, outside the repository")
        full = os.path.join(repo, path)
        try:  # whatever the agent put there: a file, a folder, a symlink (here or in a parent folder)
            parts = path.split("/")
            for i in range(1, len(parts)):
                parent = os.path.join(repo, *parts[:i])
                if os.path.islink(parent):
                    os.unlink(parent)
            if os.path.islink(full) or os.path.isfile(full):
                os.unlink(full)
            elif os.path.isdir(full):
                shutil.rmtree(full)
        except OSError as e:
            raise Unresolved(f"the test file {path} could not be reset ({e.strerror})") from None
        if _git(repo, "cat-file", "-e", f"{base}:{path}").returncode == 0:
            r = _git(repo, "checkout", base, "--", path)
            if r.returncode != 0:
                raise Unresolved(f"the test file {path} could not be reset to the base commit "
                                 f"({_last(r.stderr)})")


def apply_patch(repo, patch):
    """How the test patch went in (``git apply`` or ``patch``); Unresolved when neither takes it."""
    fd, name = tempfile.mkstemp(prefix="lgt-test-patch-", suffix=".diff")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(patch if patch.endswith("\n") else patch + "\n")
        r = _git(repo, "apply", "-v", name)
        if r.returncode == 0:
            return "git apply"
        reason = _last(r.stderr)
        try:
            p = subprocess.run(["patch", "--batch", "--fuzz=5", "-p1", "-i", name], cwd=repo,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True,
                               timeout=GIT_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            p = None
        if p is not None and p.returncode == 0:
            return "patch"
        raise Unresolved(f"the test patch does not apply ({reason})")
    finally:
        os.unlink(name)


def test_files(ids):
    files = []
    for t in ids:
        f = t.split("::")[0]
        if f not in files:
            files.append(f)
    return files


def test_argv(task, ids):
    command = task.get("test_command") or [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider",
                                           "{files}"]
    argv = []
    for a in command:
        argv.extend(ids if a == "{tests}" else test_files(ids) if a == "{files}" else [a])
    return argv


def run_tests(repo, argv, timeout):
    """The test run's output (stdout and stderr as one); it is echoed to stderr. Unresolved past
    ``timeout`` (the run and its children killed) or when the command cannot start."""
    with tempfile.TemporaryFile() as log:
        try:
            proc = subprocess.Popen(argv, cwd=repo, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            raise Unresolved(f"the test command {argv[0]} could not start ({e.strerror})") from None
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()
            raise Unresolved(f"the tests ran past {timeout:g} s and were killed") from None
        finally:
            try:  # what the run's leftovers still hold open
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
        log.seek(0)
        text = log.read().decode("utf-8", "replace")
    sys.stderr.write(text)
    sys.stderr.flush()
    return text


def report(task, statuses):
    """The per-test outcome of every FAIL_TO_PASS and PASS_TO_PASS test, and whether all of them pass."""
    tests = {key: {t: statuses.get(t, "missing") for t in task[key]}
             for key in ("FAIL_TO_PASS", "PASS_TO_PASS")}
    failing = {key: [t for t, s in tests[key].items() if s not in PASSING] for key in tests}
    reasons = []
    for key, bad in failing.items():
        if bad:
            named = ", ".join(f"{t} ({tests[key][t]})" for t in bad[:NAMED])
            more = f" and {len(bad) - NAMED} more" if len(bad) > NAMED else ""
            reasons.append(f"{len(bad)} of {len(tests[key])} {key} tests did not pass: {named}{more}")
    return {"resolved": not reasons, "reason": "; ".join(reasons) or None, "tests": tests}


def evaluate(task, repo, timeout):
    """The report of the agent's state at ``repo`` (Unresolved: it cannot be scored, and why)."""
    ids = task["FAIL_TO_PASS"] + [t for t in task["PASS_TO_PASS"] if t not in task["FAIL_TO_PASS"]]
    check_repo(repo, task["base_commit"])
    reset_tests(repo, task["base_commit"], patch_paths(task["test_patch"]))
    how = apply_patch(repo, task["test_patch"])
    parser = PARSERS[task.get("test_parser", "pytest")]
    out = report(task, parser(run_tests(repo, test_argv(task, ids), timeout), ids))
    out["test_patch"] = how
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description="Score a SWE-bench task in the repository the agent left.")
    ap.add_argument("--repo", help="the repository (default: the task's workdir)")
    ap.add_argument("--timeout", type=float, default=1800.0,
                    help="seconds the tests may run (keep it below agent.timeout_s)")
    ap.add_argument("task_json")
    ap.add_argument("stdout_path", nargs="?", help="the agent's stdout (not read)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        task = load_task(args.task_json)
        repo = args.repo or task.get("workdir")
        if not isinstance(repo, str) or not repo:
            raise TaskError("no repository: give --repo, or a workdir field in the task")
        try:
            out = evaluate(task, repo, args.timeout)
        except Unresolved as e:
            out = {"resolved": False, "reason": str(e), "tests": None}
    except TaskError as e:
        sys.stderr.write(f"swebench_eval: {e}\n")
        return 2
    out = dict({"instance_id": task.get("task_id", task.get("instance_id"))}, **out)
    out["seconds"] = round(time.monotonic() - t0, 3)
    reward = {"reward": 1.0 if out["resolved"] else 0.0, "resolved": out["resolved"]}
    if out["reason"]:
        reward["reason"] = out["reason"]
    sys.stdout.write(json.dumps({"swebench": out}) + "\n" + json.dumps(reward) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
