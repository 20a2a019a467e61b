"""The store writer: WAL + atomic Parquet segments, recovery after a crash, the calls view."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from lgt.store import schema
from lgt.store.query import connect
from lgt.store.writer import WAL_DIR, TableWriter, recover

NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)


def row(i: int, rollout: str = "r") -> dict:
    return {
        "call_id": f"c{i}", "rollout_id": rollout, "attempt": 0, "seq": i, "started_at": NOW,
        "endpoint": "chat/completions", "policy_version": 0, "streamed": False, "status": "ok",
        "prompt_token_ids": list(range(i + 1)), "response_logprobs": [-0.5] * 2,
    }


def test_rows_become_parquet_with_the_versioned_schema(tmp_path: Path) -> None:
    with TableWriter(tmp_path, flush_rows=3, flush_seconds=60) as w:
        for i in range(7):
            w.append(row(i))
    files = sorted((tmp_path / "calls").glob("*.parquet"))
    assert len(files) == 3  # 3 + 3 + 1 rows
    meta = pq.read_schema(files[0]).metadata
    assert meta[schema.SCHEMA_VERSION_KEY] == str(schema.SCHEMA_VERSION).encode()
    assert pq.read_schema(files[0]).equals(schema.CALLS, check_metadata=False)
    con = connect(tmp_path)
    assert con.execute("SELECT count(*), sum(len(prompt_token_ids)) FROM calls").fetchone() == (7, 28)
    assert con.execute("SELECT started_at FROM calls LIMIT 1").fetchone()[0] == NOW
    assert not list((tmp_path / WAL_DIR / "calls").iterdir())


def test_empty_store_has_an_empty_calls_view(tmp_path: Path) -> None:
    assert connect(tmp_path).execute("SELECT count(*) FROM calls").fetchone() == (0,)


def test_missing_store_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        connect(tmp_path / "nope")


def test_a_row_that_does_not_fit_the_schema_is_refused(tmp_path: Path) -> None:
    with TableWriter(tmp_path) as w:
        with pytest.raises(TypeError, match="cannot store a value of type"):
            w.append({**row(0), "error": object()})


def test_kill_after_append_loses_nothing(tmp_path: Path) -> None:
    """A process that appended rows and was SIGKILLed before any Parquet was written."""
    code = textwrap.dedent(f"""
        import os, signal, datetime as dt
        from lgt.store.writer import TableWriter
        w = TableWriter({str(tmp_path)!r}, flush_rows=10**9, flush_seconds=3600).open()
        now = dt.datetime.now(dt.timezone.utc)
        for i in range(500):
            w.append(dict(call_id=str(i), rollout_id="r", attempt=0, seq=i, started_at=now,
                          endpoint="completions", policy_version=1, streamed=False, status="ok"))
        print("appended", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == -9 and "appended" in p.stdout
    assert not list((tmp_path / "calls").glob("*.parquet"))
    assert recover(tmp_path, "calls") == 1
    assert connect(tmp_path).execute("SELECT count(DISTINCT call_id) FROM calls").fetchone() == (500,)


def test_recovery_is_idempotent_after_a_crash_between_rename_and_unlink(tmp_path: Path) -> None:
    w = TableWriter(tmp_path, flush_rows=10**9, flush_seconds=3600).open()
    for i in range(5):
        w.append(row(i))
    seg = w._seg
    assert seg is not None
    wal_copy = seg.read_bytes()
    w.close()  # converts and deletes the segment
    seg.write_bytes(wal_copy)  # as if the process died right after the rename
    (tmp_path / "calls" / "junk.parquet.tmp").write_bytes(b"half")
    TableWriter(tmp_path).open().close()
    assert connect(tmp_path).execute("SELECT count(*) FROM calls").fetchone() == (5,)
    assert not list((tmp_path / "calls").glob("*.tmp"))


def test_a_torn_last_line_is_dropped_and_the_rest_kept(tmp_path: Path) -> None:
    w = TableWriter(tmp_path, flush_rows=10**9, flush_seconds=3600).open()
    for i in range(3):
        w.append(row(i))
    seg = w._seg
    assert seg is not None
    with open(seg, "ab") as f:
        f.write(b'{"call_id": "torn", "rollo')
    os.close(w._fd)  # simulate death: no close(), no conversion
    w._fd = None
    w._stop = True
    recover(tmp_path, "calls")
    ids = [r[0] for r in connect(tmp_path).execute("SELECT call_id FROM calls ORDER BY seq").fetchall()]
    assert ids == ["c0", "c1", "c2"]


def test_background_flush_makes_rows_visible_without_close(tmp_path: Path) -> None:
    import time

    w = TableWriter(tmp_path, flush_seconds=0.05).open()
    w.append(row(0))
    deadline = time.monotonic() + 5
    while not list((tmp_path / "calls").glob("*.parquet")) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert connect(tmp_path).execute("SELECT count(*) FROM calls").fetchone() == (1,)
    w.close()


def test_flush_waits_for_a_conversion_already_under_way(tmp_path: Path, monkeypatch) -> None:
    """flush() must not return while the background thread is still converting a segment."""
    import threading
    import time

    from lgt.store import writer as writer_mod

    started, release = threading.Event(), threading.Event()
    real = writer_mod.convert_segment

    def slow_convert(root, table, seg):
        if threading.current_thread().name.startswith("lgt-"):
            started.set()
            release.wait(5)
        return real(root, table, seg)

    monkeypatch.setattr(writer_mod, "convert_segment", slow_convert)
    w = TableWriter(tmp_path, flush_seconds=0.01).open()
    w.append(row(0))
    assert started.wait(5)  # the background thread is converting segment 1
    w.append(row(1))
    done = threading.Event()
    threading.Thread(target=lambda: (w.flush(), done.set()), daemon=True).start()
    time.sleep(0.2)
    assert not done.is_set()
    release.set()
    assert done.wait(5)
    assert connect(tmp_path).execute("SELECT count(*) FROM calls").fetchone() == (2,)
    w.close()


def test_a_second_writer_never_takes_a_live_writers_segment(tmp_path: Path) -> None:
    """Another process opening the same table (a restarted tool, the CLI) recovers only the
    segments of dead writers: the live one's stay its own."""
    live = TableWriter(tmp_path, flush_rows=10**9, flush_seconds=3600, session="live").open()
    live.append(row(0))
    other = TableWriter(tmp_path, session="other").open()  # runs recover() on open
    other.append(row(1, rollout="o"))
    other.close()
    live.append(row(2))
    live.close()
    ids = sorted(r[0] for r in connect(tmp_path).execute("SELECT call_id FROM calls").fetchall())
    assert ids == ["c0", "c1", "c2"]


# -- a state machine: append, flush, crash at any point, recover -------------------------------------

from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule  # noqa: E402


class WalMachine(RuleBasedStateMachine):
    """Whatever happens — appends, flushes, a process dying with an open segment, mid-append (a torn
    line), between a Parquet file's rename and its segment's deletion, or with a half-written temp
    file — the store holds after recovery exactly the rows whose ``append`` returned, each once.
    (Checked by a rule, not an invariant: checking flushes, and a flush after every step would hide
    every crash.)"""

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.root = Path(tempfile.mkdtemp(prefix="lgt-wal-"))
        self.acked: set[str] = set()
        self.n = 0
        self.w = self._open()

    def _open(self) -> TableWriter:
        return TableWriter(self.root, flush_rows=10**9, flush_seconds=3600).open()

    def _die(self) -> None:
        """The writer's process dies: its descriptors (and so its locks) go, nothing is converted."""
        w = self.w
        with w._lock:
            for fd in [w._fd, *(fd for _, fd in w._closed_segments)]:
                if fd is not None:
                    os.close(fd)
            w._fd, w._seg, w._seg_rows, w._closed_segments = None, None, 0, []

    @rule(k=st.integers(1, 5))
    def append(self, k: int) -> None:
        for _ in range(k):
            self.w.append(row(self.n, rollout=f"r{self.n % 3}") | {"call_id": f"c{self.n}"})
            self.acked.add(f"c{self.n}")
            self.n += 1

    @rule()
    def flush(self) -> None:
        self.w.flush()

    @rule(torn=st.booleans(), tmp_junk=st.booleans())
    def crash(self, torn: bool, tmp_junk: bool) -> None:
        if torn and self.w._seg is not None:  # died inside a write: never acknowledged
            with open(self.w._seg, "ab") as f:
                f.write(b'{"call_id": "torn", "rollout_id": "r')
        if tmp_junk:  # died while writing a Parquet file
            (self.root / "calls").mkdir(parents=True, exist_ok=True)
            (self.root / "calls" / "part-dead-000001.parquet.tmp").write_bytes(b"PAR1 half")
        self._die()
        self.w = self._open()  # the restart recovers

    @precondition(lambda self: self.w._seg is not None)
    @rule()
    def crash_between_rename_and_unlink(self) -> None:
        seg = self.w._seg
        assert seg is not None
        copy = seg.read_bytes()
        self.w.flush()  # converted, renamed in, segment deleted ...
        seg.write_bytes(copy)  # ... as if the process died before the deletion
        self._die()
        self.w = self._open()

    @rule()
    def crash_then_check_the_store_holds_exactly_the_acknowledged_rows(self) -> None:
        self.crash(torn=False, tmp_junk=False)
        self.w.flush()
        ids = [r[0] for r in connect(self.root).execute("SELECT call_id FROM calls").fetchall()]
        assert len(ids) == len(set(ids)), "a row recovered twice"
        assert set(ids) == self.acked

    def teardown(self) -> None:
        import shutil

        try:
            self.crash_then_check_the_store_holds_exactly_the_acknowledged_rows()
        finally:
            self.w.close()
            shutil.rmtree(self.root, ignore_errors=True)


TestWalMachine = WalMachine.TestCase
TestWalMachine.settings = settings(max_examples=25, stateful_step_count=12, deadline=None)
