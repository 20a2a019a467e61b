"""Query the store with DuckDB: the views in ``sql/views.sql`` over the store's Parquet files."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import duckdb
import pyarrow as pa

from .schema import TABLES


def views_sql() -> str:
    return resources.files("lgt.store").joinpath("sql/views.sql").read_text()


def connect(store: str | Path, database: str = ":memory:") -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the store's views; a table with no files yet is an empty view."""
    root = Path(store).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"store directory {root} does not exist")
    con = duckdb.connect(database)
    con.execute("SET file_search_path = ?", [str(root)])
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
