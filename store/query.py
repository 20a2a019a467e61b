"""Query the store with DuckDB: the views in ``sql/views.sql`` over the store's Parquet files."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from .migrations import check_not_newer, migrate
from .schema import SCHEMA_VERSION_KEY, TABLE_KEY, TABLES


class StoreFileError(ValueError):
    """A file in a table's folder that is not a whole lgt Parquet file of that table."""


def views_sql() -> str:
    return resources.files("lgt.store").joinpath("sql/views.sql").read_text()


def connect(store: str | Path, database: str = ":memory:") -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the store's views; a table with no files yet is an empty view.

    The store is migrated first (see ``migrations``); a corrupt or foreign Parquet file in a table's
    folder raises :class:`StoreFileError` naming it.
    """
    root = Path(store).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"store directory {root} does not exist")
    migrate(root, readonly_ok=True)
    con = duckdb.connect(database)
    con.execute("SET file_search_path = ?", [str(root)])
    con.execute("SET parquet_metadata_cache = true")  # files are immutable once renamed in
    check_files(con, root)
    for stmt in views_sql().split(";"):
        body = "\n".join(l for l in stmt.splitlines() if not l.strip().startswith("--")).strip()
        if not body:
            continue
        m = re.search(r"read_parquet\('(\w+)/\*\.parquet'", body)
        if m and not any((root / m[1]).glob("*.parquet")):  # no files yet: an empty table
            table, view = m[1], re.search(r"VIEW (\w+)", body)[1]
            con.register(f"_empty_{table}", pa.Table.from_pylist([], schema=TABLES[table]))
            con.execute(f"CREATE OR REPLACE VIEW {view} AS SELECT * FROM _empty_{table}")
        else:
            con.execute(body)
    return con


def check_files(con: duckdb.DuckDBPyConnection, root: Path) -> None:
    """Refuse a store whose table folders hold a file that is not one of that table's.

    lgt's writers tag each file with its table and schema version; those tags are read for all files
    at once (DuckDB reads the footers in parallel). An untagged file is checked column by column; a
    file DuckDB cannot read is looked at alone to name it and the problem.
    """
    for table in TABLES:
        paths = sorted((root / table).glob("*.parquet"))
        if not paths:
            continue
        try:
            rows = con.execute(
                "SELECT file_name, decode(key), decode(value) FROM parquet_kv_metadata(?) "
                "WHERE key IN ('lgt.table'::BLOB, 'lgt.schema_version'::BLOB)",
                [f"{table}/*.parquet"]).fetchall()
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
