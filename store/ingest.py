"""Add rewards and rollout rows to a store from outside the proxy (``lgt-train reward`` / ``rollout``).

Every input is checked before anything is written, and each add is one Parquet file written whole
(temp file + rename, as the writer converts its segments), so a bad input or a crash leaves the store
as it was. A one-shot add does not go through a :class:`~lgt.store.writer.TableWriter`: opening one
recovers *every* WAL segment of the table, including those a running proxy is still appending to.

Errors a user can cause are ``ValueError`` with one sentence naming the bad input.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any

import duckdb
import orjson

from .migrations import migrate
from .query import connect
from .schema import ROLLOUT_SPLITS, ROLLOUT_STATUSES
from .writer import WAL_DIR, rows_from_wal, to_arrow, write_parquet_atomic


def add_reward(store: str | os.PathLike, rollout_id: str, value: Any, *, attempt: int | None = None,
               call_id: str | None = None, source: str = "cli") -> dict[str, Any]:
    """Record a reward for a rollout (its latest attempt unless ``attempt``), or for one of its calls.

    ``value`` may be a number or its text (from a command line). Returns the row written.
    """
    root = _store_root(store)
    value = reward_value(value)
    _check_id("rollout id", rollout_id)
    if attempt is not None:
        _check_int("attempt", attempt)
    if not isinstance(source, str) or not source:
        raise ValueError("a reward's source must be a non-empty string like 'cli'")
    migrate(root)
    con = connect(root)
    attempts = known_attempts(con, root, rollout_id)
    if not attempts:
        raise ValueError(f"rollout {rollout_id!r} is not in the store (no calls and no rollouts row "
                         "have that id)")
    if attempt is not None and attempt not in attempts:
        raise ValueError(f"rollout {rollout_id!r} has no attempt {attempt} (it has "
                         f"{', '.join(map(str, sorted(attempts)))})")
    if call_id is not None:
        _check_id("call id", call_id)
        where = find_call(con, root, call_id)
        if where is None:
            raise ValueError(f"call {call_id!r} is not in the store")
        if where[0] != rollout_id:
            raise ValueError(f"call {call_id!r} belongs to rollout {where[0]!r}, not {rollout_id!r}")
        if attempt is not None and where[1] != attempt:
            raise ValueError(f"call {call_id!r} is from attempt {where[1]}, not {attempt}")
        attempt = where[1]
    row = {"reward_id": uuid.uuid4().hex, "rollout_id": rollout_id, "attempt": attempt,
           "call_id": call_id, "value": value, "source": source, "recorded_at": _now()}
    _write_rows(root, "rewards", [row])
    return row


def add_rollout(store: str | os.PathLike, rollout_id: str, *, attempt: int = 0,
                task_id: str | None = None, group_id: str | None = None, step: int | None = None,
                status: str = "ok", exit_code: int | None = None,
                started_at: dt.datetime | None = None, ended_at: dt.datetime | None = None,
                resource_version: str | None = None, split: str | None = None,
                metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """Record (or re-record: the latest row per rollout attempt wins) one rollout attempt.

    Every field is written as given: a later row replaces the whole earlier one. Returns the row.
    """
    root = _store_root(store)
    row = rollout_row(rollout_id, attempt=attempt, task_id=task_id, group_id=group_id, step=step,
                      status=status, exit_code=exit_code, started_at=started_at, ended_at=ended_at,
                      resource_version=resource_version, split=split, metadata=metadata)
    migrate(root)
    _write_rows(root, "rollouts", [row])
    return row


def add_rows(store: str | os.PathLike, rollouts: list[dict[str, Any]],
             rewards: list[dict[str, Any]]) -> None:
    """Many rows made by :func:`rollout_row` / :func:`attempt_reward_row` in one file per table.

    For a rollout controller recording a batch of attempts it ran itself: no store query, two files
    however many rows (one file per row would leave the views reading thousands of tiny files).
    """
    root = _store_root(store)
    migrate(root)
    if rollouts:
        _write_rows(root, "rollouts", rollouts)
    if rewards:
        _write_rows(root, "rewards", rewards)


def rollout_row(rollout_id: str, *, attempt: int = 0, task_id: str | None = None,
                group_id: str | None = None, step: int | None = None, status: str = "ok",
                exit_code: int | None = None, started_at: dt.datetime | None = None,
                ended_at: dt.datetime | None = None, resource_version: str | None = None,
                split: str | None = None, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """A validated ``rollouts`` row (ValueError, one sentence, for bad input)."""
    _check_id("rollout id", rollout_id)
    _check_int("attempt", attempt)
    if status not in ROLLOUT_STATUSES:
        raise ValueError(f"rollout status {status!r} is not one of {', '.join(ROLLOUT_STATUSES)}")
    for what, v in (("task id", task_id), ("group id", group_id),
                    ("resource version", resource_version)):
        if v is not None:
            _check_id(what, v)
    if step is not None:
        _check_int("step", step)
    if split is not None and split not in ROLLOUT_SPLITS:
        raise ValueError(f"rollout split {split!r} is not one of {', '.join(ROLLOUT_SPLITS)}")
    if exit_code is not None and (isinstance(exit_code, bool) or not isinstance(exit_code, int)):
        raise ValueError(f"exit code must be an integer, not {exit_code!r}")
    for what, t in (("started_at", started_at), ("ended_at", ended_at)):
        if t is not None and (not isinstance(t, dt.datetime) or t.tzinfo is None):
            raise ValueError(f"{what} must be a datetime with a time zone, not {t!r}")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise ValueError("rollout metadata must be a JSON object (a dict)")
        try:
            metadata_json = orjson.dumps(metadata).decode()
        except TypeError as e:
            raise ValueError(f"rollout metadata is not JSON: {e}") from None
    else:
        metadata_json = None
    return {"rollout_id": rollout_id, "attempt": attempt, "task_id": task_id, "group_id": group_id,
            "step": step, "status": status, "exit_code": exit_code, "started_at": started_at,
            "ended_at": ended_at, "resource_version": resource_version, "split": split,
            "metadata_json": metadata_json, "recorded_at": _now()}


def attempt_reward_row(rollout_id: str, value: Any, *, attempt: int, source: str) -> dict[str, Any]:
    """A validated whole-rollout ``rewards`` row for an attempt the caller knows exists."""
    _check_id("rollout id", rollout_id)
    _check_int("attempt", attempt)
    if not isinstance(source, str) or not source:
        raise ValueError("a reward's source must be a non-empty string like 'cli'")
    return {"reward_id": uuid.uuid4().hex, "rollout_id": rollout_id, "attempt": attempt,
            "call_id": None, "value": reward_value(value), "source": source, "recorded_at": _now()}


def reward_value(value: Any) -> float:
    """A finite float from a number or its text; ValueError naming the value otherwise."""
    if isinstance(value, str):
        try:
            v = float(value.strip())
        except ValueError:
            raise ValueError(f"reward value {value!r} is not a number") from None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        v = float(value)
    else:
        raise ValueError(f"reward value {value!r} is not a number")
    if not math.isfinite(v):
        raise ValueError(f"reward value must be a finite number, not {value!r}")
    return v


def known_attempts(con: duckdb.DuckDBPyConnection, root: Path, rollout_id: str) -> set[int]:
    """Attempts of a rollout seen in calls or rollouts, Parquet and not yet converted WAL alike."""
    found = {a for (a,) in con.execute(
        "SELECT attempt FROM calls WHERE rollout_id = $r UNION "
        "SELECT attempt FROM rollouts_log WHERE rollout_id = $r", {"r": rollout_id}).fetchall()}
    for table in ("calls", "rollouts"):
        found |= {r.get("attempt", 0) for r in _wal_rows(root, table, rollout_id)
                  if r.get("rollout_id") == rollout_id}
    return found


def find_call(con: duckdb.DuckDBPyConnection, root: Path, call_id: str) -> tuple[str, int] | None:
    """(rollout_id, attempt) of a recorded call, or None."""
    # read to its end: a half-read result blocks the connection's relation API (DuckDB 2)
    row = next(iter(con.execute("SELECT rollout_id, attempt FROM calls WHERE call_id = ? LIMIT 1",
                                [call_id]).fetchall()), None)
    if row is not None:
        return row[0], row[1]
    for r in _wal_rows(root, "calls", call_id):
        if r.get("call_id") == call_id:
            return r["rollout_id"], r.get("attempt", 0)
    return None


def _wal_rows(root: Path, table: str, needle: str) -> list[dict[str, Any]]:
    """Rows of the table's WAL segments that mention ``needle`` (a running proxy's latest rows)."""
    key = orjson.dumps(needle)
    rows = []
    for seg in sorted((root / WAL_DIR / table).glob("*.jsonl")):
        try:
            if key in seg.read_bytes():
                rows += rows_from_wal(seg)
        except (FileNotFoundError, ValueError):  # converted meanwhile, or not ours to judge
            continue
    return rows


def _write_rows(root: Path, table: str, rows: list[dict[str, Any]]) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    dest = root / table / f"part-{stamp}-{uuid.uuid4().hex[:8]}-000001.parquet"
    dest.parent.mkdir(exist_ok=True)
    write_parquet_atomic(to_arrow(rows, table), dest)
    return dest


def _store_root(store: str | os.PathLike) -> Path:
    root = Path(store).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"store directory {root} does not exist")
    return root


def _check_id(what: str, v: Any) -> None:
    if not isinstance(v, str) or not v.strip():
        raise ValueError(f"{what} must be a non-empty string, not {v!r}")


def _check_int(what: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{what} must be a whole number ≥ 0, not {v!r}")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)
