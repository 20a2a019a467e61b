"""SWE-bench-shaped instances built here, for the tests of ``lgt-train tasks swebench`` and its evaluator:
a git repository whose base commit has a bug (``add`` subtracts), a test patch adding tests that fail on it
(``F2P``) beside one that passes (``P2P``), and the fix (``FIXED``, what a good agent writes to
``calc.py``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

BUGGY = "def add(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n"
OLD_TESTS = "from calc import add\n\n\ndef test_add_zero():\n    assert add(0, 0) == 0\n"
NEW_TESTS = OLD_TESTS + "\n\ndef test_add():\n    assert add(2, 3) == 5\n"
NEW_FILE = ("import pytest\n\nfrom calc import add\n\n\n@pytest.mark.parametrize('a, b', [(2, 3)])\n"
            "def test_add_pairs(a, b):\n    assert add(a, b) == a + b\n")
F2P = ["tests/test_calc.py::test_add", "tests/test_new.py::test_add_pairs[2-3]"]
P2P = ["tests/test_calc.py::test_add_zero"]


def git(repo: Path, *args: str) -> str:
    """git's stdout; CalledProcessError when it fails."""
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def make_repo(path: Path) -> tuple[Path, str, str]:
    """A repository with the bug at its base commit; (repo, base commit, test patch)."""
    (path / "tests").mkdir(parents=True)
    (path / "calc.py").write_text(BUGGY)
    (path / "tests" / "test_calc.py").write_text(OLD_TESTS)
    (path / "pytest.ini").write_text("[pytest]\npythonpath = .\n")
    git(path, "init", "-q")
    git(path, "add", "-A")
    git(path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "base")
    base = git(path, "rev-parse", "HEAD").strip()
    (path / "tests" / "test_calc.py").write_text(NEW_TESTS)
    (path / "tests" / "test_new.py").write_text(NEW_FILE)
    git(path, "add", "-A")
    patch = git(path, "diff", "--cached")
    git(path, "reset", "-q", "--hard", base)
    return path, base, patch


def instance(base: str, patch: str, iid: str = "acme__calc-1") -> dict:
    """The instance of :func:`make_repo`'s repository, as SWE-bench publishes one (test ids JSON-encoded)."""
    return {"instance_id": iid, "repo": "acme/calc", "base_commit": base, "problem_statement":
            "add(2, 3) gives -1; it should give 5.", "test_patch": patch, "FAIL_TO_PASS": json.dumps(F2P),
            "PASS_TO_PASS": json.dumps(P2P), "image_name": f"acme/calc:{iid}"}
