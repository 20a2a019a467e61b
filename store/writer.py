"""Durable, append-only writer for one store table: a write-ahead log turned into Parquet segments.

``append(row)`` writes one JSON line to the current WAL segment with a single ``os.write`` before it
returns, so a row whose ``append`` returned is in the kernel's page cache and survives ``kill -9`` of
the process (``fsync=True`` also survives a machine crash, at a cost per row). A background thread
rotates the segment every ``flush_rows`` rows or ``flush_seconds`` seconds and converts the closed
segment into one Parquet file: written to ``NAME.parquet.tmp``, flushed, then renamed to
``NAME.parquet``; only then is the WAL segment deleted. The Parquet name is derived from the
segment's name, so a crash at any point is repaired by :func:`recover` at the next start without
duplicating or losing rows. Readers glob ``<table>/*.parquet`` and so only ever see whole files.

Layout under the store root::

    <table>/part-<UTC time>-<session>-<n>.parquet   finished segments
    _wal/<table>/part-<UTC time>-<session>-<n>.jsonl     open or not yet converted segments
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from .files import atomic_path
from .schema import TABLES, TIMESTAMP_FIELDS

log = logging.getLogger("lgt.store")

WAL_DIR = "_wal"


_ERRNO = re.compile(r"\[errno (\d+)\]", re.I)


def os_reason(e: OSError) -> str:
    """Why a write failed, as the system says it ("No space left on device"): Python's OSError has it in
    ``strerror``; pyarrow's ("Error writing bytes to file. Detail: [errno 28] …") in its text."""
    m = _ERRNO.search(str(e))
    return os.strerror(int(m[1])) if m else (e.strerror or str(e))

def _encode(obj: Any) -> Any:
    raise TypeError(f"cannot store a value of type {type(obj).__name__}")


def rows_from_wal(path: Path) -> list[dict[str, Any]]:
    """Rows of one WAL segment; a torn last line (the writer died mid-write) is dropped."""
    rows = []
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    for i, line in enumerate(lines):
        if not line:
            continue
        try:
            rows.append(orjson.loads(line))
        except ValueError:
            if i == len(lines) - 1:  # unterminated tail: never acknowledged to anyone
                log.warning("dropping a torn last line in %s", path.name)
                continue
            raise ValueError(f"{path} line {i + 1} is not valid JSON") from None
    return rows


def write_parquet_atomic(table: pa.Table, dest: Path) -> None:
    """Write ``table`` to ``dest`` whole: temp file, fsync, rename, fsync of the directory. The temp
    file is ``NAME.parquet.tmp``: :func:`recover` finds a dead conversion's by that name."""
    with atomic_path(dest, fsync=True, tmp=dest.with_name(dest.name + ".tmp")) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def to_arrow(rows: list[dict[str, Any]], table: str) -> pa.Table:
    schema = TABLES[table]
    return pa.Table.from_pylist(rows, schema=schema)


def convert_segment(root: Path, table: str, wal_path: Path) -> Path | None:
    """Turn one closed WAL segment into its Parquet file, then delete the segment."""
    dest = root / table / (wal_path.stem + ".parquet")
    if not dest.exists():
        rows = rows_from_wal(wal_path)
        if rows:
            dest.parent.mkdir(parents=True, exist_ok=True)
            write_parquet_atomic(to_arrow(rows, table), dest)
        else:
            dest = None
    wal_path.unlink()
    return dest


def recover(root: Path, table: str, on_file: Callable[[Path], None] | None = None) -> int:
    """Convert every WAL segment left behind by a process that died; returns how many.

    A live writer holds an exclusive ``flock`` on each of its segments until that segment is
    converted (the kernel drops it when the process dies, ``kill -9`` included), so segments of
    another running process sharing the store are skipped, never converted under its feet.
    """
    wal_dir = Path(root) / WAL_DIR / table
    n = 0
    for seg in sorted(wal_dir.glob("*.jsonl")):
        try:
            fd = os.open(seg, os.O_RDONLY)
        except FileNotFoundError:  # converted by its writer meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # a live writer's segment
        try:
            if seg.exists():
                dest = convert_segment(Path(root), table, seg)
                n += 1
                if dest is not None and on_file is not None:
                    on_file(dest)
        finally:
            os.close(fd)
    for tmp in (Path(root) / table).glob("*.parquet.tmp"):
        if not (wal_dir / tmp.name.replace(".parquet.tmp", ".jsonl")).exists():
            tmp.unlink()  # a conversion that died before its rename; its segment was redone above
    return n


class TableWriter:
    """Append rows of one table; see the module docstring for the durability contract."""

    def __init__(
        self,
        root: str | os.PathLike,
        table: str = "calls",
        *,
        flush_rows: int = 1000,
        flush_seconds: float = 2.0,
        fsync: bool = False,
        session: str | None = None,
        on_file: Callable[[Path], None] | None = None,
    ) -> None:
        if table not in TABLES:
            raise ValueError(f"unknown table {table!r}; the store has {sorted(TABLES)}")
        self.root = Path(root)
        self.table = table
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self.fsync = fsync
        self.session = session or uuid.uuid4().hex[:8]
        self.on_file = on_file  # each finished Parquet file, once renamed in (a remote store uploads it)
        self._ts_fields = TIMESTAMP_FIELDS[table]
        self._lock = threading.Lock()
        self._converting = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._fd: int | None = None
        self._seg: Path | None = None
        self._seg_rows = 0
        self._seg_no = 0
        self._closed_segments: list[tuple[Path, int]] = []  # with their still-locked fds
        self._thread: threading.Thread | None = None
        self.rows_written = 0
        self.files_written = 0

    # -- lifecycle ---------------------------------------------------------------------------
    def open(self) -> TableWriter:
        (self.root / self.table).mkdir(parents=True, exist_ok=True)
        (self.root / WAL_DIR / self.table).mkdir(parents=True, exist_ok=True)
        recovered = recover(self.root, self.table, self._finished)
        if recovered:
            log.info("recovered %d unconverted %s segment(s)", recovered, self.table)
        self._thread = threading.Thread(target=self._run, name=f"lgt-{self.table}-writer", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Convert everything written so far; safe to call twice."""
        with self._lock:
            self._stop = True
            self._rotate_locked()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._convert_closed()

    def __enter__(self) -> TableWriter:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing -----------------------------------------------------------------------------
    def append(self, row: dict[str, Any]) -> None:
        """Durably append one row (see module docstring); raises if the row cannot be encoded."""
        row = dict(row)
        for name in self._ts_fields:  # datetimes travel through the WAL as epoch microseconds
            v = row.get(name)
            if v is not None and not isinstance(v, int):
                row[name] = int(v.timestamp() * 1_000_000)
        try:
            line = orjson.dumps(row, default=_encode) + b"\n"
        except TypeError as e:  # orjson wraps what _encode raised
            raise TypeError(str(e.__cause__ or e)) from None
        with self._lock:
            if self._stop:
                raise RuntimeError("the store writer is closed")
            if self._fd is None:
                self._open_segment_locked()
            assert self._fd is not None
            start = os.lseek(self._fd, 0, os.SEEK_END)
            view = memoryview(line)
            try:
                while view:
                    written = os.write(self._fd, view)
                    view = view[written:]
                if self.fsync:
                    os.fsync(self._fd)
            except OSError:  # a full or failing disk: no half line stays behind this row's place
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, start)
                raise
            self._seg_rows += 1
            self.rows_written += 1
            if self._seg_rows >= self.flush_rows:
                self._rotate_locked()
                self._wake.set()

    def flush(self) -> None:
        """Make every row appended so far visible as Parquet (blocks until converted)."""
        with self._lock:
            self._rotate_locked()
        self._convert_closed()

    # -- internals ---------------------------------------------------------------------------
    def _open_segment_locked(self) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        self._seg_no += 1
        name = f"part-{stamp}-{self.session}-{self._seg_no:06d}.jsonl"
        self._seg = self.root / WAL_DIR / self.table / name
        self._fd = os.open(self._seg, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours until converted (see recover)
        self._seg_rows = 0

    def _rotate_locked(self) -> None:
        if self._fd is None:
            return
        assert self._seg is not None
        self._closed_segments.append((self._seg, self._fd))  # the fd keeps the segment's lock
        self._fd = None
        self._seg = None

    def _convert_closed(self) -> None:
        # One converter at a time: flush() returns only after a conversion the background thread
        # had already started is finished too, so "flushed" means every row is in Parquet.
        with self._converting:
            while True:
                with self._lock:
                    if not self._closed_segments:
                        return
                    seg, fd = self._closed_segments.pop(0)
                try:
                    dest = convert_segment(self.root, self.table, seg)
                    if dest is not None:
                        self.files_written += 1
                        self._finished(dest)
                except Exception:  # keep the WAL segment: the next start recovers it
                    log.exception("could not convert %s; it stays in the WAL for the next start",
                                  seg.name)
                finally:
                    os.close(fd)  # releases the lock

    def _finished(self, dest: Path) -> None:
        if self.on_file is None:
            return
        try:
            self.on_file(dest)
        except Exception as e:  # the file is whole on disk; a later flush of the store retries it
            log.warning("could not upload %s: %s", dest.name, e)

    def _run(self) -> None:
        while True:
            self._wake.wait(self.flush_seconds)
            self._wake.clear()
            with self._lock:
                stopping = self._stop
                if self._seg_rows > 0:
                    self._rotate_locked()
            self._convert_closed()
            if stopping:
                return
