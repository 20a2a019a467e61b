"""A full disk under the store (a small tmpfs this test mounts): the proxy never answers a call it could
not record — 503 with the reason, the engine not even asked — takes calls again by itself when space
returns, and its write-ahead log stays whole."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lgt.testing.proxy import CHAT, HOSTED, ProxyProc, client


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "disk"
    mnt.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(disk: Path) -> Path:
    """A file that takes every free byte of ``disk``."""
    filler = disk / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (64 << 10))
                f.flush()
        except OSError:
            pass
    return filler


def test_a_full_store_refuses_calls_it_cannot_record_and_recovers(small_disk, upstream, rollout) -> None:
    p = ProxyProc(small_disk / "store", upstream.url, "--flush-seconds", "600").start()
    try:
        with client(p, rollout) as c:
            assert c.post(f"{HOSTED}/chat/completions", json=CHAT).status_code == 200
            filler = fill(small_disk)
            first = c.post(f"{HOSTED}/chat/completions", json=CHAT)  # answered upstream, not recordable
            assert first.status_code == 503 and "could not be recorded" in first.text
            asked = len(upstream.requests)
            refused = c.post(f"{HOSTED}/chat/completions", json=CHAT)
            assert refused.status_code == 503 and refused.headers.get("retry-after")
            assert "the store cannot be written (No space left on device); no LLM call is taken until it " \
                   "can be" in refused.json()["error"]["message"]
            assert len(upstream.requests) == asked  # the engine was not even asked
            assert p.client.state()["store_error"]
            os.unlink(filler)
            time.sleep(1.1)  # the next probe finds space
            assert c.post(f"{HOSTED}/chat/completions", json=CHAT).status_code == 200
        assert p.client.state()["store_error"] is None
        rows = p.calls("rollout_id = ?", [rollout])  # the flush reads the whole log: no torn line in it
        assert [r["status"] for r in rows] == ["ok", "ok"]  # exactly the calls the agent got answers to
    finally:
        p.stop()
