"""Query the store with DuckDB: the views in ``sql/views.sql`` over the store's Parquet files, and the
named queries of a package's ``.sql`` files (:func:`named_queries`)."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from .migrations import check_not_newer, migrate
from .schema import SCHEMA_VERSION_KEY, TABLE_KEY, TABLES, schema_file


class StoreFileError(ValueError):
    """A file in a table's folder that is not a whole lgt Parquet file of that table."""


def views_sql() -> str:
    return resources.files("lgt.store").joinpath("sql/views.sql").read_text()


@functools.cache
def named_queries(package: str, path: str) -> dict[str, str]:
    """The named queries of the ``.sql`` file ``path`` in ``package``, as aiosql lays them out: each
    starts at a ``-- name: <name>`` line, the comments under it say what it does, and its text runs
    to the next one (comment lines and a trailing ``;`` left out). A query may hold several
    statements."""
    text = resources.files(package).joinpath(path).read_text()
    parts = re.split(r"^-- name: *(\w+) *\n", text, flags=re.MULTILINE)
    queries = {}
    for name, body in zip(parts[1::2], parts[2::2]):
        lines = [line for line in body.splitlines() if not line.lstrip().startswith("--")]
        queries[name] = "\n".join(lines).strip().removesuffix(";").rstrip()
    return queries


def _open(root: Path, database: str = ":memory:") -> duckdb.DuckDBPyConnection:
    """A DuckDB connection whose relative paths are the store's, and that draws no progress bar: DuckDB
    draws one on the process's stdout during a query past 2 s, even into a file or a pipe (it would land
    inside `lgt-train sql --format csv > out.csv`)."""
    con = duckdb.connect(database)
    con.execute("SET enable_progress_bar = false")
    con.execute("SET file_search_path = ?", [str(root)])
    return con


def connect(store: str | Path, database: str = ":memory:", *, rollout_ids: Iterable[str] | None = None,
            files: dict[str, list[str]] | None = None) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the store's views; a table with no files yet is an empty view.

    The store is migrated first (see ``migrations``); a corrupt or foreign Parquet file in a table's
    folder raises :class:`StoreFileError` naming it.

    ``rollout_ids``: the connection sees only these rollouts — every table's rows of them, read from
    only the files that hold them (:func:`file_index`) — so work on a few rollouts of a large store
    costs what those rollouts cost (the trainer builds each step's samples this way). ``files``: with
    ``rollout_ids``, the files of each table that hold them, where the caller knows (a table left out
    has none); the per-process index is then neither read nor grown.
    """
    root = Path(store).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"store directory {root} does not exist")
    migrate(root, readonly_ok=True)
    con = _open(root, database)
    con.execute("SET parquet_metadata_cache = true")  # files are immutable once renamed in
    scope: dict[str, list[str]] | None = None
    if rollout_ids is None:
        check_files(con, root)
    else:
        want = set(rollout_ids)
        if files is not None:
            scope = {t: sorted(files.get(t, ())) for t in TABLES}
        else:
            scope = {t: [f for f, entry in file_index(root, t, con).items() if not want.isdisjoint(entry[0])]
                     for t in TABLES}
        con.execute("SET VARIABLE lgt_rollout_ids = ?", [sorted(want)])
        for table, paths in scope.items():
            con.execute(f"SET VARIABLE lgt_files_{table} = ?", [paths])
    for stmt in views_sql().split(";"):
        body = "\n".join(l for l in stmt.splitlines() if not l.strip().startswith("--")).strip()
        if not body:
            continue
        m = re.search(r"read_parquet\('(\w+)/\*\*/\*\.parquet'", body)
        if m and scope is not None:  # only the rollouts asked for, from the files that hold them
            body = body.replace(f"'{m[1]}/**/*.parquet'", f"getvariable('lgt_files_{m[1]}')")
            body += "\nWHERE rollout_id IN (SELECT unnest(getvariable('lgt_rollout_ids')))"
        if m and not (scope[m[1]] if scope is not None else any((root / m[1]).glob("*.parquet"))
                      or (root / schema_file(m[1])).is_file()):  # no files (yet), a read-only old store
            table, view = m[1], re.search(r"VIEW (\w+)", body)[1]
            con.register(f"_empty_{table}", pa.Table.from_pylist([], schema=TABLES[table]))
            con.execute(f"CREATE OR REPLACE VIEW {view} AS SELECT * FROM _empty_{table}")
        else:
            con.execute(body)
    return con


# What each finished file holds, per process: files never change once renamed in, so each is checked
# and read once (keyed by path, size and mtime). path -> (rollout ids, {group id: rollout ids}).
FileEntry = tuple[frozenset[str], dict[str, frozenset[str]]]
_SEEN: dict[tuple[str, int, int], FileEntry] = {}


def file_index(root: Path, table: str, con: duckdb.DuckDBPyConnection | None = None) -> dict[str, FileEntry]:
    """Every Parquet file of ``table`` -> the rollout ids in it (and, for ``rollouts``, its groups'
    rollout ids). Files new to this process are checked (:func:`check_files`) and their id columns
    read; the others come from memory, so a trainer pays for each file once."""
    out: dict[str, FileEntry] = {}
    new: list[tuple[Path, tuple[str, int, int]]] = []
    for path in sorted((root / table).glob("*.parquet")):
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns)
        if key in _SEEN:
            out[key[0]] = _SEEN[key]
        else:
            new.append((path, key))
    if not new:
        return out
    own = con is None
    if own:
        con = _open(root)
    try:
        check_files(con, root, {table: [p for p, _ in new]})
    finally:
        if own:
            con.close()
    cols = ["rollout_id", "group_id"] if table == "rollouts" else ["rollout_id"]
    for path, key in new:
        t = pq.read_table(path, columns=cols)
        ids = t.column("rollout_id").to_pylist()
        groups: dict[str, set[str]] = {}
        if table == "rollouts":
            for g, r in zip(t.column("group_id").to_pylist(), ids):
                if g is not None:
                    groups.setdefault(g, set()).add(r)
        _SEEN[key] = out[key[0]] = (frozenset(ids), {g: frozenset(r) for g, r in groups.items()})
    return out


def group_rollouts(store: str | Path, group_ids: Iterable[str]) -> set[str]:
    """The rollout ids of these groups, as the ``rollouts`` table's files give them."""
    root = Path(store).resolve()
    want = set(group_ids)
    return {r for _, groups in file_index(root, "rollouts").values()
            for g in want.intersection(groups) for r in groups[g]}


def check_files(con: duckdb.DuckDBPyConnection, root: Path,
                only: dict[str, list[Path]] | None = None) -> None:
    """Refuse a store whose table folders hold a file that is not one of that table's (``only``:
    just these tables' listed files).

    lgt's writers tag each file with its table and schema version; those tags are read for all files
    at once (DuckDB reads the footers in parallel). An untagged file is checked column by column; a
    file DuckDB cannot read is looked at alone to name it and the problem.
    """
    for table in (only if only is not None else TABLES):
        paths = list(only[table]) if only is not None else sorted((root / table).glob("*.parquet"))
        if not paths:
            continue
        try:
            rows = con.execute(
                "SELECT file_name, decode(key), decode(value) FROM parquet_kv_metadata(?) "
                "WHERE key IN ('lgt.table'::BLOB, 'lgt.schema_version'::BLOB)",
                [[str(p) for p in paths] if only is not None else f"{table}/*.parquet"]).fetchall()
        except duckdb.Error:
            for path in paths:  # find the unreadable one (DuckDB stops at the first)
                check_file(path, table, root)
            raise  # not a file's fault after all: DuckDB's own message
        tags: dict[str, dict[str, str]] = {}
        for name, key, value in rows:
            tags.setdefault(Path(name).name, {})[key] = value
        for path in paths:
            tag = tags.get(path.name, {})
            if tag.get(TABLE_KEY.decode()) == table and tag.get(SCHEMA_VERSION_KEY.decode(), "").isdigit():
                check_not_newer(root, int(tag[SCHEMA_VERSION_KEY.decode()]), _rel(path, root))
            else:
                check_file(path, table, root)


def check_file(path: Path, table: str, root: Path) -> None:
    """One file on its own: readable, this table's, a version this lgt knows, the table's columns."""
    rel = _rel(path, root)
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as e:
        raise StoreFileError(f"{rel} is not a readable Parquet file ({_first_sentence(e)}); "
                             f"move it out of {table}/") from None
    meta = schema.metadata or {}
    tagged = meta.get(TABLE_KEY)
    if tagged is not None and tagged.decode(errors="replace") != table:
        other = tagged.decode(errors="replace")
        raise StoreFileError(f"{rel} holds rows of the {other} table, not {table}; move it to {other}/")
    version = meta.get(SCHEMA_VERSION_KEY)
    if version is not None and version.isdigit():
        check_not_newer(root, int(version), rel)
    expected = TABLES[table]
    missing = [f.name for f in expected if not f.nullable and f.name not in schema.names]
    if missing:
        raise StoreFileError(f"{rel} is not an lgt {table} file: it lacks the column(s) "
                             f"{', '.join(missing)}; move it out of {table}/")
    for f in expected:
        if f.name in schema.names:
            got = schema.field(f.name).type
            if _kind(got) != _kind(f.type):
                raise StoreFileError(f"{rel} is not an lgt {table} file: its column {f.name} is {got}, "
                                     f"where the {table} schema has {f.type}; move it out of {table}/")


def _kind(t: pa.DataType) -> str:
    """Types DuckDB reads into one column without surprise (int32 next to int64, say)."""
    if pa.types.is_integer(t):
        return "integer"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_timestamp(t):
        return "timestamp"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"list<{_kind(t.value_type)}>"
    if pa.types.is_struct(t):
        return "struct"
    return str(t)


def _rel(path: Path, root: Path) -> str:
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def _first_sentence(e: Exception) -> str:
    text = str(e).strip().split("\n")[0]
    return text.split(". ")[0].rstrip(".")
