"""The samples of a whole store of any size, a chunk of whole groups at a time (:func:`stream_samples`),
and the report of the whole build from its chunks' (:func:`merge_reports`).

Which groups make each chunk, and which files hold their rollouts, is planned once in DuckDB
(``sql/sample_stream.sql``: temporary tables, spilled to disk past :data:`SQL_MEMORY`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from .query import connect, named_queries
from .samples import SQL_MEMORY, SampleBuild, scoped_build, why_empty
from .schema import TABLES

SQL = named_queries("lgt.store", "sql/sample_stream.sql")

STREAM_ROLLOUTS = 4096  # rollout attempts per chunk of a streamed build (~300 MB of samples at 3-4k tokens)


def stream_samples(store: str | Path, *, mode: str = "exact", tokenizer: Any = None,
                   chunk_rollouts: int = STREAM_ROLLOUTS) -> Iterator[SampleBuild]:
    """:func:`~lgt.store.samples.build_samples` of the whole store, a chunk of whole groups at a time
    (about ``chunk_rollouts`` rollout attempts, more when one group is larger), so that memory holds
    one chunk's samples however large the store is. Each chunk is
    :func:`~lgt.store.samples.build_group_samples` of its groups; the chunks' samples together are the
    whole build's rows (groups in the order of the calls files that hold them, so that a chunk reads
    few files). Use :func:`~lgt.store.samples.trained_rollouts` for the loss weights' R, and
    :func:`merge_reports` for the report of the whole store.

    Which groups make each chunk, and which files hold their rollouts, is planned once in DuckDB
    (temporary tables under :data:`SQL_MEMORY`, spilled to disk beyond it), not in Python: what the
    build keeps between chunks does not grow with the store."""
    if chunk_rollouts < 1:
        raise ValueError(f"chunk_rollouts must be at least 1, not {chunk_rollouts}")
    root = Path(store).resolve()
    con = connect(root)
    try:
        con.execute(f"SET memory_limit = '{SQL_MEMORY}'")
        files = plan_chunks(con, root)
        for first, last in chunk_bounds(con, chunk_rollouts):
            chunk = {"first": first, "last": last}
            groups = [g for (g,) in con.execute(SQL["chunk_groups"], chunk).fetchall()]
            ids = [r for (r,) in con.execute(SQL["chunk_rollouts"], chunk).fetchall()]
            where: dict[str, list[str]] = {}
            for t, n in con.execute(SQL["chunk_files"], chunk).fetchall():
                where.setdefault(t, []).append(files[t][n])
            yield scoped_build(root, groups, ids, where, mode, tokenizer)
    finally:
        con.close()


def plan_chunks(con: duckdb.DuckDBPyConnection, root: Path) -> dict[str, list[str]]:
    """Three temporary tables on ``con`` (a whole-store connection): ``_lgt_plan_groups`` (i, g, n):
    every group numbered in the order of the first calls file holding its rollouts, with its number
    of rollout attempts; ``_lgt_plan_members`` (i, rollout_id); ``_lgt_plan_files`` (i, t, n): group i
    has rows in file n of table t. Returns each table's files (what ``n`` indexes)."""
    files = {t: sorted(str(p) for p in (root / t).glob("*.parquet")) for t in TABLES}
    names = pa.table({"t": [t for t, fs in files.items() for _ in fs],
                      "n": [n for fs in files.values() for n in range(len(fs))],
                      "filename": [f for fs in files.values() for f in fs]},
                     schema=pa.schema([("t", pa.string()), ("n", pa.int32()), ("filename", pa.string())]))
    con.register("_lgt_plan_names", names)
    try:
        con.execute(SQL["plan_held_table"])
        for t, fs in files.items():
            if fs:
                con.execute("SET VARIABLE lgt_plan_files = ?", [fs])
                con.execute(SQL["plan_held"], {"t": t})
        con.execute(SQL["plan"])
    finally:
        con.execute(SQL["plan_cleanup"])
        con.unregister("_lgt_plan_names")
    return files


def chunk_bounds(con: duckdb.DuckDBPyConnection, chunk_rollouts: int) -> list[tuple[int, int]]:
    """The planned groups (:func:`plan_chunks`) in chunks of about ``chunk_rollouts`` rollout
    attempts: ``(first, last)`` group numbers of each, whole groups, a group larger than that alone."""
    con.execute(SQL["plan_sizes"])
    bounds: list[tuple[int, int]] = []
    first, size, last = None, 0, 0
    while rows := con.fetchmany(65536):
        for i, n in rows:
            if first is not None and size + n > chunk_rollouts:
                bounds.append((first, last))
                first, size = None, 0
            if first is None:
                first = i
            size += n
            last = i
    if first is not None:
        bounds.append((first, last))
    return bounds



def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The report of a whole build from its chunks' (:func:`stream_samples`): counts added up."""
    def add(a: Any, b: Any) -> Any:
        if isinstance(a, dict) and isinstance(b, dict):
            return {k: add(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in a | b}
        return a + b if isinstance(a, int | float) and not isinstance(a, bool) else a

    out: dict[str, Any] = {}
    for r in reports:
        out = add(out, {k: v for k, v in r.items() if k != "why_empty"})
    if "samples_per_rollout" in out:
        out["samples_per_rollout"] = dict(sorted(out["samples_per_rollout"].items(),
                                                 key=lambda kv: int(kv[0])))
    if "merge_breaks" in out:
        out["merge_breaks"] = dict(sorted(out["merge_breaks"].items(), key=lambda kv: (-kv[1], kv[0])))
    if not out.get("rollouts", {}).get("trained"):
        excluded = Counter(out.get("rollouts", {}).get("excluded", {}))
        out["why_empty"] = why_empty(sum(excluded.values()), excluded,
                                     Counter(out.get("calls", {}).get("excluded", {})))
    return out
