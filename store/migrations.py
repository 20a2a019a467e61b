"""Ordered store migrations, recorded in the store itself.

A store records the schema version it was brought to in ``_meta/migrations.json`` (written whole:
temp file + rename), with one entry per migration applied. :func:`migrate` applies the ones a store
lacks, in order, under a lock, and refuses a store recorded by a newer lgt. A store that predates the
record (written by a proxy alone) is dated by its Parquet files' ``lgt.schema_version`` metadata; a
directory holding none of the store's folders is left untouched (``--store`` pointed at the wrong
place must not litter it).

Writers call :func:`migrate` before writing; readers call it on open too, and read on when the store
cannot be written (a read-only copy): every migration so far leaves old files readable as they are.
To add one: bump ``schema.SCHEMA_VERSION`` and append ``Migration(version, name, function)``. After
any migration each table's schema file (``<table>/_schema/<table>.parquet``: no rows, the table's
current columns) is written again, so a plain DuckDB client reading ``<table>/**/*.parquet`` finds every
column, and a table with no files yet reads as empty rather than failing.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from .files import atomic_path, write_atomic
from .schema import SCHEMA_VERSION, SCHEMA_VERSION_KEY, TABLES, schema_file

log = logging.getLogger("lgt.store")

META_DIR = "_meta"
RECORD = "migrations.json"
STORE_MARKERS = (*TABLES, "_wal", "_proxy", META_DIR)  # any one of these: the directory is a store


class StoreVersionError(RuntimeError):
    """The store was written by a newer lgt than this one."""


@dataclass(frozen=True)
class Migration:
    version: int  # the schema version the store has once this ran
    name: str
    apply: Callable[[Path], None]


def _add_rollouts_and_rewards(root: Path) -> None:
    # Schema 2 adds two tables; the calls files stay as they are. Their folders may stay empty: the
    # views read a table without files as an empty one.
    for table in ("rollouts", "rewards"):
        (root / table).mkdir(exist_ok=True)


def _add_capture_and_egress(root: Path) -> None:
    # Schema 3 adds the calls columns capture and capture_reason (older files read them as null: the
    # views use union_by_name) and the egress table.
    (root / "egress").mkdir(exist_ok=True)


def _add_sampling_and_split(root: Path) -> None:
    # Schema 4 adds calls.sampling and rollouts.split, both nullable: older files read them as null
    # (the views use union_by_name; the rollouts view reads a null split as 'train'). Nothing to move.
    pass


def _add_api(root: Path) -> None:
    # Schema 5 adds calls.api (the API the agent called), nullable: older files read it as null (every
    # call before it was a chat/completions or completions call, as calls.endpoint says). Nothing to move.
    pass


def write_schema_files(root: Path) -> None:
    """Each table's empty schema file, at the current schema (whole: temp file + rename)."""
    for table, schema in TABLES.items():
        path = root / schema_file(table)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            pq.write_table(pa.Table.from_pylist([], schema=schema), tmp)


def _add_translation_and_schema_files(root: Path) -> None:
    # Schema 6 adds calls.translation, nullable (older files read it as null), and each table's schema
    # file, which migrate() writes whenever it brings a store up to date: DuckDB clients given only
    # views.sql then read a table without files as an empty one. Nothing to move.
    pass


def _add_policy(root: Path) -> None:
    # Schema 7 adds calls.policy, nullable: older files read it as null, which the calls view reads as
    # schema.DEFAULT_POLICY (every call before it belonged to a run's one policy). Nothing to move.
    pass


def _add_response_policy_versions(root: Path) -> None:
    # Schema 8 adds calls.response_policy_versions, nullable: older files read it as null, which means
    # every generated token was policy_version's (no call lived through an update). Nothing to move.
    pass


MIGRATIONS: tuple[Migration, ...] = (
    Migration(2, "add the rollouts and rewards tables", _add_rollouts_and_rewards),
    Migration(3, "add calls.capture, calls.capture_reason and the egress table", _add_capture_and_egress),
    Migration(4, "add calls.sampling and rollouts.split", _add_sampling_and_split),
    Migration(5, "add calls.api", _add_api),
    Migration(6, "add calls.translation and each table's schema file", _add_translation_and_schema_files),
    Migration(7, "add calls.policy", _add_policy),
    Migration(8, "add calls.response_policy_versions", _add_response_policy_versions),
)
assert [m.version for m in MIGRATIONS] == list(range(2, SCHEMA_VERSION + 1)), "one migration a version"


def is_store(root: Path) -> bool:
    return any((root / name).exists() for name in STORE_MARKERS)


def read_record(root: Path) -> dict | None:
    path = root / META_DIR / RECORD
    try:
        data = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except ValueError:
        raise ValueError(f"{path} is not valid JSON; restore it or delete it to re-date the store "
                         "from its files") from None
    if not isinstance(data, dict) or not isinstance(data.get("schema_version"), int):
        raise ValueError(f"{path} has no integer schema_version; restore it or delete it to re-date "
                         "the store from its files")
    return data


def file_version(path: Path) -> int | None:
    """The ``lgt.schema_version`` a Parquet file was written under (None: not recorded)."""
    meta = pq.read_schema(path).metadata or {}
    raw = meta.get(SCHEMA_VERSION_KEY)
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def version_from_files(root: Path) -> int:
    """The newest schema version among the store's Parquet files; 1 (calls only) when none says."""
    versions = [1]
    for table in TABLES:
        for path in (root / table).glob("*.parquet"):
            try:
                v = file_version(path)
            except Exception:  # a broken file is connect()'s to report, with its name
                continue
            if v is not None:
                versions.append(v)
    return max(versions)


def store_version(root: str | os.PathLike) -> int:
    """The version a store is at: recorded, else dated from its files (a non-store is current)."""
    root = Path(root)
    record = read_record(root)
    if record is not None:
        return record["schema_version"]
    return version_from_files(root) if is_store(root) else SCHEMA_VERSION


def check_not_newer(root: Path, version: int, what: str) -> None:
    if version > SCHEMA_VERSION:
        raise StoreVersionError(
            f"{what} was written by a newer lgt (schema version {version}; this lgt knows up to "
            f"{SCHEMA_VERSION}); upgrade lgt to use this store")


@contextmanager
def _locked(root: Path) -> Iterator[None]:
    (root / META_DIR).mkdir(exist_ok=True)
    with open(root / META_DIR / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write_record(root: Path, record: dict) -> None:
    write_atomic(root / META_DIR / RECORD, orjson.dumps(record, option=orjson.OPT_INDENT_2) + b"\n",
                 fsync=True)


def migrate(root: str | os.PathLike, *, readonly_ok: bool = False) -> int:
    """Bring the store to ``SCHEMA_VERSION``; returns the version it is at afterwards.

    Raises :class:`StoreVersionError` for a store from a newer lgt. With ``readonly_ok`` (readers) a
    store that cannot be written is read at the version it has, with a warning.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"store directory {root} does not exist")
    version = store_version(root)
    check_not_newer(root, version, f"store {root}")
    if not is_store(root) or (version == SCHEMA_VERSION and read_record(root) is not None):
        return version
    try:
        with _locked(root):
            record = read_record(root)  # another process may have migrated while we waited
            if record is None:
                record = {"schema_version": version_from_files(root), "applied": []}
            check_not_newer(root, record["schema_version"], f"store {root}")
            write_schema_files(root)  # the columns of the version about to be reached, first
            for m in MIGRATIONS:
                if m.version <= record["schema_version"]:
                    continue
                m.apply(root)
                record["applied"].append({"version": m.version, "name": m.name,
                                          "applied_at": dt.datetime.now(dt.UTC).isoformat()})
                record["schema_version"] = m.version
                _write_record(root, record)  # after each step: a crash resumes at the next one
                log.info("store %s migrated to schema version %d (%s)", root, m.version, m.name)
            if not (root / META_DIR / RECORD).exists():
                _write_record(root, record)  # dated from its files, now recorded
            return record["schema_version"]
    except OSError as e:
        if not readonly_ok:
            raise
        log.warning("store %s is at schema version %d and cannot be migrated here (%s); reading it "
                    "as it is", root, version, e.strerror or e)
        return version
