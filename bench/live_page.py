"""Benchmark: the live run page (``lgt-train serve``) on a big store, against reading the store straight.

    .venv/bin/python bench/live_page.py                      # 100k rollouts x 8 calls (~1.6 GB, built once)
    .venv/bin/python bench/live_page.py --rollouts 2000      # a small store, to try it out
    .venv/bin/python bench/live_page.py --store DIR          # reuse the store in DIR (or build it there)
    .venv/bin/python bench/live_page.py --tokenizer PATH     # decode with a real tokenizer.json

The store is bench/samples.py's synthetic one (``samples.write_store``: groups of 8 rollouts, 8 calls
each, ~3-4k-token contexts; token ids and scalar columns, no request/response JSON), written once to
/tmp/lgt-bench-live-store-<rollouts> (or --store) and reused by later runs; free disk space is checked
first. The run folder beside it (a temporary one) holds a config.json naming a tokenizer (by default a
synthetic 50k-word WordLevel tokenizer.json, so every generated token is decoded as the page decodes
it) and a trained.jsonl with a row for 49 rollouts in 50, as a run that trained on them writes.

What is timed, ours (``lgt.trainer.report.run_view``) against a baseline, each in one run, side by side:

1. Listing: ``RunView.rollouts(query)``. Cold: a fresh RunView's first page (it connects and builds
   its in-memory listing table; median of 3 fresh views). Warm: the first page, a task-substring
   filter, sort by reward, a page half-way down (medians of --repeats). Baseline: the same listing SQL
   (the SELECT of the listing query in report/sql/live.sql) run on the store's views each time, with
   the filter, sort, limit and offset in SQL and the total as a window count, on a ``connect(store)``
   opened once (cold: a fresh one, connect included); it has no trained columns, so it does a little
   less than ours. Also: the rebuild of the listing table a page pays once the store's files changed
   (a run writing).
2. Opening a trajectory: ``RunView.trajectory(rid)`` for the first, middle and last rollout, cold
   (a fresh RunView each: connect, listing table, tokenizer, then the trajectory) and warm (the view
   has listed; median of --repeats). Baseline: ``lgt.store.show.load_trajectory`` on a fresh
   ``connect(store)`` (what ``lgt-train show`` does per run: it reads, it neither decodes nor makes
   JSON), and ``lgt-train show RID --store STORE --tokenizer TOK`` as a user runs it (a subprocess,
   wall time, output to /dev/null).
3. Over HTTP: ``lgt-train serve RUN_DIR --store STORE --port 0`` in a child process, and GET
   /api/rollouts?... and /api/rollouts/{rid} from httpx (one keep-alive client, as a browser), so the
   figure is what the page waits for: the first request to a fresh server, then warm ones. The
   baseline column repeats the direct-store figure of the same operation from 1. and 2.

Ours and the baseline take turns (each repeat), so they share whatever else the machine is doing.
Every page and trajectory of ours is checked against the baseline's (same rollouts in the same order,
same totals; same calls). The last lines say whether listing and opening are each under 1 s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lgt.trainer.serving import children

BENCH = Path(__file__).resolve().parent
BYTES_PER_ROLLOUT = 16_000  # samples.write_store's Parquet, measured (2000 rollouts: 31 MB)
GROUP_SIZE = 8  # samples.GROUP_SIZE
VOCAB = 50_000  # samples.VOCAB


# --- the store and the run folder ----------------------------------------------------------------

def ensure_store(store: Path | None, rollouts: int, max_gb: float) -> Path:
    """The synthetic store: ``store`` or the cache folder, written (in a child process) when absent."""
    root = store or Path(tempfile.gettempdir()) / f"lgt-bench-live-store-{rollouts}"
    if (root / "calls").is_dir():
        print(f"store: reusing {root}")
        return root
    need = rollouts * BYTES_PER_ROLLOUT
    parent = root.parent if root.parent.is_dir() else Path(tempfile.gettempdir())
    free = shutil.disk_usage(parent).free
    if need > max_gb * 1e9:
        sys.exit(f"a {rollouts}-rollout store is ~{need / 1e9:.1f} GB, over --max-gb {max_gb:g}")
    if free < need + 5e9:
        sys.exit(f"not enough free disk for a {rollouts}-rollout store under {parent}: "
                 f"~{need / 1e9:.1f} GB needed plus 5 GB spare, {free / 1e9:.1f} GB free")
    partial = root.with_name(root.name + f".partial-{os.getpid()}")
    print(f"store: writing {rollouts} rollouts (~{need / 1e9:.1f} GB, {free / 1e9:.0f} GB free) to {root} "
          "(once; later runs reuse it) ...", flush=True)
    t0 = time.perf_counter()
    try:  # a child: DuckDB's progress bar goes to its stdout, not ours
        subprocess.run([sys.executable, __file__, "--write-store", str(partial), "--rollouts", str(rollouts)],
                       check=True, stdout=subprocess.DEVNULL)
        partial.rename(root)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    size = sum(p.stat().st_size for p in root.rglob("*.parquet"))
    print(f"store: wrote {size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", flush=True)
    return root


def write_store(root: Path, rollouts: int) -> None:
    sys.path.insert(0, str(BENCH))
    import samples

    samples.write_store(root, rollouts)


def make_run_dir(run_dir: Path, rollouts: int, tokenizer: Path | None) -> Path:
    """config.json naming the tokenizer, and trained.jsonl (what a run that trained writes)."""
    if tokenizer is None:
        from tokenizers import Tokenizer
        from tokenizers.models import WordLevel

        tokenizer = run_dir / "tokenizer.json"
        vocab = {f"w{i}": i for i in range(VOCAB)} | {"[UNK]": VOCAB}
        Tokenizer(WordLevel(vocab, unk_token="[UNK]")).save(str(tokenizer))
    (run_dir / "config.json").write_text(json.dumps({"name": "bench-live", "model": {"path": str(tokenizer)},
                                                     "group_size": GROUP_SIZE}))
    with open(run_dir / "trained.jsonl", "w") as f:
        for i in range(rollouts):
            if i % 50:
                f.write(json.dumps({"step": i // (GROUP_SIZE * 64), "version": i // (GROUP_SIZE * 64),
                                    "sample_id": f"r{i:07d}~0~0", "rollout_id": f"r{i:07d}", "attempt": 0,
                                    "group_id": f"g{i // GROUP_SIZE}", "reward": 1.0,
                                    "advantage": (i % 7 - 3) / 3, "loss_weight": 1e-6}) + "\n")
    return tokenizer


# --- the baseline: the listing SQL straight on the store's views -----------------------------------

def listing_select() -> str:
    from lgt.trainer.report.run_view import SQL

    sql = SQL["listing"]
    head = "CREATE OR REPLACE TEMP TABLE listing AS"
    assert sql.startswith(head), "report/sql/live.sql's listing changed shape: update listing_select()"
    return sql[len(head):]


def baseline_rollouts(con: Any, select: str, query: dict[str, str]) -> dict[str, Any]:
    """The page's answer from the views each time: filter, sort and page in SQL, no listing table."""
    where, params = [], []
    for key, sql in (("status", "status = ?"), ("split", "split = ?")):
        if query.get(key):
            where.append(sql)
            params.append(query[key])
    for key, col in (("task", "task_id"), ("rollout", "rollout_id")):
        if query.get(key):
            where.append(f"{col} ILIKE ?")
            params.append(f"%{query[key]}%")
    sort = query.get("sort") or "started_at"
    desc = "DESC" if query.get("desc", "1") != "0" else "ASC"
    limit, offset = int(query.get("limit") or 50), int(query.get("offset") or 0)
    sql_where = f"WHERE {' AND '.join(where)}" if where else ""
    cur = con.execute(f"SELECT *, count(*) OVER () AS total FROM ({select}) listing {sql_where} "
                      f"ORDER BY {sort} {desc} NULLS LAST, rollout_id, attempt LIMIT {limit} OFFSET {offset}",
                      params)
    cols = [d[0] for d in cur.description]
    rows = [dict(zip(cols, r)) for r in cur.fetchall()]
    total = rows[0]["total"] if rows else con.execute(
        f"SELECT count(*) FROM ({select}) listing {sql_where}", params).fetchone()[0]
    counts = dict(con.execute("SELECT status, count(*) FROM rollouts GROUP BY 1").fetchall())
    return {"total": total, "rows": rows, "statuses": counts}


def same_page(ours: dict[str, Any], base: dict[str, Any], what: str) -> None:
    a = [(r["rollout_id"], r["attempt"]) for r in ours["rows"]]
    b = [(r["rollout_id"], r["attempt"]) for r in base["rows"]]
    if a != b or ours["total"] != base["total"] or ours["statuses"] != base["statuses"]:
        raise SystemExit(f"{what}: the page and the baseline differ (totals {ours['total']} vs "
                         f"{base['total']}, first rows {a[:3]} vs {b[:3]})")


# --- timing ---------------------------------------------------------------------------------------

def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def median_of(n: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    return interleaved(n, fn)[0]


def interleaved(n: int, *fns: Callable[[], Any]) -> list[tuple[float, Any]]:
    """Each of ``fns`` run ``n`` times, taking turns (the first to go rotates), so that the sides share
    whatever else the machine is doing: [(median seconds, last result)] in the order given."""
    times: list[list[float]] = [[] for _ in fns]
    outs: list[Any] = [None] * len(fns)
    for i in range(n):
        for k in range(len(fns)):
            j = (i + k) % len(fns)
            t, outs[j] = timed(fns[j])
            times[j].append(t)
    return [(statistics.median(ts), out) for ts, out in zip(times, outs)]


ROWS: list[tuple[str, float | None, float | None, str]] = []


def row(op: str, ours: float | None, base: float | None, base_is: str = "") -> None:
    ROWS.append((op, ours, base, base_is))
    ratio = f"{base / ours:.1f}x" if ours and base else ""
    o = f"{ours:.3f}" if ours is not None else "-"
    b = f"{base:.3f}" if base is not None else "-"
    print(f"  {op:44} {o:>8} {b:>9} {ratio:>7}  {base_is}", flush=True)


def header(title: str) -> None:
    print(f"\n{title} (ratio: baseline / ours)", flush=True)
    print(f"  {'operation':44} {'ours (s)':>8} {'base (s)':>9} {'ratio':>7}  baseline", flush=True)


# --- the three parts ------------------------------------------------------------------------------

def queries(rollouts: int) -> dict[str, dict[str, str]]:
    tasks = rollouts // GROUP_SIZE
    sub = f"task{tasks // 2:06d}"[:-1]  # ten tasks' worth (or fewer at the end)
    return {"first page": {},
            f"task filter '{sub}'": {"task": sub},
            "sort by reward": {"sort": "reward", "desc": "1"},
            f"page at offset {rollouts // 2}": {"offset": str(rollouts // 2), "limit": "50"}}


def listing_part(run_dir: Path, store: Path, rollouts: int, repeats: int) -> dict[str, float]:
    from lgt.store.query import connect
    from lgt.trainer.report.run_view import RunView

    select = listing_select()
    found: dict[str, float] = {}
    header("1. listing: RunView.rollouts(query), in this process")

    def cold_ours() -> Any:
        view = RunView(run_dir, store)
        try:
            return view.rollouts({})
        finally:
            view.close()

    def cold_base() -> Any:
        con = connect(store)
        try:
            return baseline_rollouts(con, select, {})
        finally:
            con.close()

    (ours_t, ours), (base_t, base) = interleaved(3, cold_ours, cold_base)
    same_page(ours, base, "first page, cold")
    row("first page, cold (fresh view: builds table)", ours_t, base_t, "fresh connect + listing SQL")
    found["list cold"], found["base list cold"] = ours_t, base_t
    bare = run_dir / "no-trained"  # the same run before it trained: no trained.jsonl to read
    bare.mkdir(exist_ok=True)
    shutil.copy(run_dir / "config.json", bare / "config.json")
    def cold_bare() -> Any:
        view = RunView(bare, store)
        try:
            return view.rollouts({})
        finally:
            view.close()

    (o_t, _), (b_t, _) = interleaved(3, cold_bare, cold_base)
    row("  the same without trained.jsonl", o_t, b_t, "fresh connect + listing SQL")

    view = RunView(run_dir, store)
    con = connect(store)
    view.rollouts({})
    baseline_rollouts(con, select, {})
    for name, q in queries(rollouts).items():
        (o_t, ours), (b_t, base) = interleaved(repeats, lambda q=q: view.rollouts(q),
                                               lambda q=q: baseline_rollouts(con, select, q))
        same_page(ours, base, name)
        row(f"{name}, warm", o_t, b_t, "listing SQL on the views")
        found[f"list {name}"] = o_t
        found[f"base list {name}"] = b_t

    def rebuild() -> Any:  # as when the run wrote a file: the next request rebuilds the table
        view._files, view._looked = (-1, -1), 0.0
        return view.rollouts({})

    (o_t, _), (b_t, _) = interleaved(3, rebuild, lambda: baseline_rollouts(con, select, {}))
    row("first page after the store changed (rebuild)", o_t, b_t, "listing SQL on the views")
    found["list rebuild"] = o_t
    view.close()
    con.close()
    return found


def trajectory_part(run_dir: Path, store: Path, tokenizer: Path, ids: list[str], repeats: int,
                    cli: bool) -> dict[str, float]:
    from lgt.store.query import connect
    from lgt.store.show import load_trajectory
    from lgt.trainer.report.run_view import RunView

    found: dict[str, float] = {}
    header("2. opening a trajectory: RunView.trajectory(rid), in this process")

    def fresh_load(rid: str) -> Any:
        con = connect(store)
        try:
            return load_trajectory(con, rid)
        finally:
            con.close()

    def fresh_open(rid: str) -> Any:
        view = RunView(run_dir, store)
        try:
            return view.trajectory(rid)
        finally:
            view.close()

    lgt_train = Path(sys.executable).with_name("lgt-train")

    def show_cli(rid: str) -> None:
        subprocess.run([str(lgt_train), "show", rid, "--store", str(store), "--tokenizer", str(tokenizer)],
                       check=True, stdout=subprocess.DEVNULL)

    for rid in ids:
        (o_t, page), (b_t, traj) = interleaved(1, lambda rid=rid: fresh_open(rid),
                                               lambda rid=rid: fresh_load(rid))
        if [c["call_id"] for c in page["calls"]] != [c["call_id"] for c in traj.calls]:
            raise SystemExit(f"{rid}: the page's calls differ from load_trajectory's")
        row(f"{rid}, cold (fresh view: connect + table)", o_t, b_t, "fresh connect + load_trajectory")
        found[f"open cold {rid}"] = o_t

    view = RunView(run_dir, store)
    view.rollouts({})
    for rid in ids:
        view.trajectory(rid)
        sides = [lambda rid=rid: view.trajectory(rid), lambda rid=rid: fresh_load(rid)]
        if cli:
            sides.append(lambda rid=rid: show_cli(rid))
        (o_t, _), (b_t, _), *c = interleaved(repeats, *sides)
        row(f"{rid}, warm (view has listed)", o_t, b_t, "fresh connect + load_trajectory")
        found[f"open warm {rid}"] = o_t
        found[f"base open {rid}"] = b_t
        if c:
            c_t = c[0][0]
            row(f"{rid}, warm, vs lgt-train show", o_t, c_t, "`lgt-train show` subprocess")
            found[f"cli open {rid}"] = c_t
    view.close()
    return found


def http_part(run_dir: Path, store: Path, rollouts: int, ids: list[str], repeats: int,
              direct: dict[str, float]) -> dict[str, float]:
    import httpx

    found: dict[str, float] = {}
    lgt_train = Path(sys.executable).with_name("lgt-train")
    t0 = time.perf_counter()
    server = subprocess.Popen([str(lgt_train), "serve", str(run_dir), "--store", str(store), "--port", "0"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line = server.stderr.readline()
        m = re.search(r"on (http://\S+/)", line)
        if not m:
            raise SystemExit(f"lgt-train serve did not start: {line}{server.stderr.read()}")
        url = m[1]
        header(f"3. over HTTP: lgt-train serve (ready in {time.perf_counter() - t0:.1f} s), "
               "GET from httpx")
        with httpx.Client(base_url=url, timeout=120) as client:
            def get(path: str, params: dict[str, str] | None = None) -> tuple[int, int]:
                r = client.get(path, params=params)
                r.raise_for_status()
                return len(r.content), r.json().get("total", 0)

            t, (size, _) = timed(lambda: get("/api/rollouts"))
            row(f"GET /api/rollouts, fresh server ({size // 1024} KiB)", t,
                direct.get("base list cold"), "fresh connect + listing SQL")
            found["http list cold"] = t
            for name, q in queries(rollouts).items():
                t, _ = median_of(repeats, lambda q=q: get("/api/rollouts", q))
                row(f"GET /api/rollouts {name}", t, direct.get(f"base list {name}"),
                    "listing SQL on the views")
                found[f"http list {name}"] = t
            for rid in ids:
                t_first, (size, _) = timed(lambda rid=rid: get(f"/api/rollouts/{rid}"))
                t, _ = median_of(repeats, lambda rid=rid: get(f"/api/rollouts/{rid}"))
                base = direct.get(f"base open {rid}")
                row(f"GET /api/rollouts/{rid}, first ({size // 1024} KiB)", t_first, base,
                    "fresh connect + load_trajectory")
                row(f"GET /api/rollouts/{rid}, again", t, base, "fresh connect + load_trajectory")
                found[f"http open first {rid}"] = t_first
                found[f"http open {rid}"] = t
    finally:
        children.stop(server, 10, group=False)
    return found


# --- the report -----------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rollouts", type=int, default=100_000, help="rollouts in the synthetic store")
    ap.add_argument("--store", type=Path, help="the store folder: reused if it holds one, else written there")
    ap.add_argument("--tokenizer", type=Path, help="a tokenizer.json (default: a synthetic 50k-word one)")
    ap.add_argument("--repeats", type=int, default=5, help="repeats of each warm operation (the median)")
    ap.add_argument("--no-cli", action="store_true", help="skip the `lgt-train show` subprocess baseline")
    ap.add_argument("--max-gb", type=float, default=10.0, help="refuse to write a store larger than this")
    ap.add_argument("--write-store", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.write_store:
        return write_store(args.write_store, args.rollouts)
    if args.rollouts < GROUP_SIZE or args.rollouts % GROUP_SIZE:
        ap.error(f"--rollouts must be a multiple of the group size {GROUP_SIZE}")

    store = ensure_store(args.store, args.rollouts, args.max_gb)
    import duckdb

    n, n_calls = duckdb.connect().execute(
        f"SELECT (SELECT count(*) FROM read_parquet('{store}/rollouts/*.parquet')), "
        f"(SELECT count(*) FROM read_parquet('{store}/calls/*.parquet'))").fetchone()
    data = list(store.glob("*/*.parquet"))  # the tables' files (not _schema/)
    size, files = sum(p.stat().st_size for p in data), len(data)
    print(f"store: {n} rollouts, {n_calls} calls, {files} Parquet files, {size / 1e9:.2f} GB")
    ids = [f"r{i:07d}" for i in sorted({0, n // 2, n - 1})]
    with tempfile.TemporaryDirectory(prefix="lgt-bench-live-run-") as tmp:
        run_dir = Path(tmp)
        tokenizer = make_run_dir(run_dir, n, args.tokenizer)
        print(f"run folder: config.json, tokenizer {'(synthetic) ' if args.tokenizer is None else ''}"
              f"{tokenizer}, trained.jsonl of {n - (n + 49) // 50} rollouts")
        found = listing_part(run_dir, store, n, args.repeats)
        found |= trajectory_part(run_dir, store, tokenizer, ids, args.repeats, not args.no_cli)
        found |= http_part(run_dir, store, n, ids, args.repeats, found)

    list_cold = found["http list cold"]
    list_warm = max(v for k, v in found.items() if k.startswith("http list ") and k != "http list cold")
    open_first = max(v for k, v in found.items() if k.startswith("http open first "))
    open_warm = max(v for k, v in found.items() if k.startswith("http open r"))
    rebuild = found["list rebuild"]
    print(f"\non this store ({n} rollouts), over HTTP (ratio above: baseline / ours, > 1: ours faster):")
    print(f"  listing: {'UNDER' if max(list_cold, list_warm) < 1 else 'OVER'} 1 s: first page of a fresh "
          f"server {list_cold:.2f} s, warm requests at most {list_warm:.3f} s")
    print(f"    (the rebuild after the store's files changed: {rebuild:.2f} s in process)")
    print(f"  opening a trajectory: {'UNDER' if max(open_first, open_warm) < 1 else 'OVER'} 1 s: first "
          f"open of each at most {open_first:.3f} s, again at most {open_warm:.3f} s")

if __name__ == "__main__":
    main()
