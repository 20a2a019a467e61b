"""The recorded requests of real harnesses (tests/fixtures/harnesses, made by scripts/harness_fixtures.py).

Cheap checks that the fixtures stay usable as seeds for the dialects' tests — every manifest names
files that exist, each recorded main call is a request of the API its path says, no secret was kept —
and, where the harnesses are installed (``npm ci`` in tests/harnesses), a slow test that records one
harness again through the script's own answering proxy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "harnesses"
HARNESSES = ROOT / "tests" / "harnesses"
SCRIPT = ROOT / "scripts" / "harness_fixtures.py"
DIRS = sorted(p.parent for p in FIXTURES.glob("*/manifest.json"))


def api_of(call: dict) -> str | None:
    path = call.get("path") or ""
    if path.endswith("/messages"):
        return "messages"
    if path.endswith("/responses"):
        return "responses"
    if path.endswith("/chat/completions"):
        return "chat"
    if ":streamGenerateContent" in path or ":generateContent" in path:
        return "gemini"
    return None


def test_fixtures_exist():
    names = {d.name.split(".")[0] for d in DIRS}
    assert {"claude_code", "codex", "gemini", "qwen", "opencode", "pi"} <= names


@pytest.mark.parametrize("d", DIRS, ids=[d.name for d in DIRS])
def test_manifest_and_calls(d: Path):
    m = json.loads((d / "manifest.json").read_text())
    assert m["ok"] and m["exit_code"] == 0 and "PINEAPPLE" in m["answer_txt"]
    kinds = [c["kind"] for c in m["calls"]]
    assert "main-tool-call" in kinds and "main-final" in kinds
    assert kinds.index("main-tool-call") < kinds.index("main-final")
    for entry in m["calls"]:
        call = json.loads((d / entry["file"]).read_text())
        assert call["seq"] == entry["seq"] and call["kind"] == entry["kind"]
        if not call["kind"].startswith("main"):
            continue
        body, api = call["body"], api_of(call)
        assert isinstance(body, dict) and api is not None, entry["file"]
        if api == "messages":
            assert body["model"] and isinstance(body["messages"], list) and body["max_tokens"] > 0
        elif api == "responses":
            assert body["model"] and isinstance(body["input"], list)
            if call["transport"] == "ws":
                assert body["type"] == "response.create"
        elif api == "chat":
            assert body["model"] and isinstance(body["messages"], list)
        else:
            assert isinstance(body["contents"], list)


@pytest.mark.parametrize("d", DIRS, ids=[d.name for d in DIRS])
def test_no_secrets_kept(d: Path):
    for f in d.glob("*.json"):
        text = f.read_text()
        assert "sk-test-harness-fixtures" not in text and "harness-fixtures:tok" not in text, f.name
        if f.name == "manifest.json":
            continue
        headers = json.loads(text).get("headers") or {}
        for k, v in headers.items():
            if k.lower() in ("authorization", "x-api-key", "x-goog-api-key", "proxy-authorization"):
                assert v == "<redacted>", (f.name, k)


def test_versions_pinned_exactly():
    pkg = json.loads((HARNESSES / "package.json").read_text())
    lock = json.loads((HARNESSES / "package-lock.json").read_text())
    for name, version in pkg["dependencies"].items():
        assert version[0].isdigit(), f"{name} is not pinned to one version: {version}"
        assert lock["packages"][f"node_modules/{name}"]["version"] == version


def _can_isolate() -> bool:
    if not shutil.which("unshare"):
        return False
    cmd = ["unshare", "-n"] + ([] if os.geteuid() == 0 else ["-r"]) + ["true"]
    return subprocess.run(cmd, capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not (HARNESSES / "node_modules" / ".bin" / "pi").exists(),
                    reason="harnesses not installed (npm ci in tests/harnesses)")
@pytest.mark.skipif(not _can_isolate(), reason="no network namespace here (unshare -n)")
def test_record_again(tmp_path: Path):
    """pi, the quickest harness, completes the task against the script's canned answers."""
    r = subprocess.run([sys.executable, str(SCRIPT), "--harness", "pi", "--profile", "minimal",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    m = json.loads((tmp_path / "pi.minimal" / "manifest.json").read_text())
    assert m["ok"] and [c["kind"] for c in m["calls"]] == ["main-tool-call", "main-final"]
