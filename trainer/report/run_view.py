"""The live run page's data: what ``lgt-train serve RUN_DIR`` (and ``lgt-train run --serve PORT``) shows.

:class:`RunView` answers the page's questions from what the run writes as it goes — ``metrics.jsonl``,
``eval.jsonl``, ``trained.jsonl`` (each read from where it was last read to: :mod:`.tails`), and the
store through DuckDB (its queries in ``sql/live.sql``); :mod:`lgt.trainer.report.live` serves it.

The rollout table is one in-memory DuckDB table rebuilt when the store's files changed (at most every
:data:`REFRESH_S`), from scalar columns only (token counts come from the calls' usage), so listing,
filtering and paging a store of 100k rollouts touches no token list; a trajectory reads one rollout's
rows (:mod:`.trajectory` draws it). Nothing shown is a secret: the store holds no credentials (the
proxy redacts them), and the page shows no config values but a few named settings.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lgt.store import show
from lgt.store.query import connect, named_queries
from lgt.trainer.report.summary import read_json
from lgt.trainer.report.tails import Durations, FileShrank, Tail, TrainedTail
from lgt.trainer.report.trajectory import finite, jsonable, trajectory_json

SQL = named_queries("lgt.trainer.report", "sql/live.sql")

REFRESH_S = 1.0  # the store's file list is looked at no more often than this
PAGE_MAX = 500  # rollouts per page of the table at most
SORTS = ("started_at", "ended_at", "reward", "calls", "generated", "seconds", "step", "advantage",
         "task_id", "status", "rollout_id")
FILTERS = ("status", "split", "task", "rollout", "step", "reward_min", "reward_max", "trained")


@dataclass
class RunView:
    """One run's files and store, read as they grow. Thread-safe: one lock around the DuckDB work."""

    run_dir: Path
    store: Path | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir).resolve()
        self._config: dict[str, Any] = {}
        self._store_given = self.store is not None
        self.metrics = Tail(self.run_dir / "metrics.jsonl")
        self.evals = Tail(self.run_dir / "eval.jsonl")
        self.trained = TrainedTail(self.run_dir / "trained.jsonl")
        self.durations = Durations(self.run_dir / "rollouts.jsonl")
        self._con: Any = None
        self._files: tuple[tuple[int, ...], int] | None = None  # _file_state when last listed
        self._unseen: set[int] = set()  # tables without files when connected: their views are empty
        self._looked = 0.0
        self._seen: tuple[tuple[int, ...], int] | None = None  # _file_state at the last look
        self._tokenizer: Any = None
        self._tokenizer_tried = False

    @property
    def config(self) -> dict[str, Any]:
        """The run's config.json (read until the run has written it)."""
        if not self._config:
            self._config = read_json(self.run_dir / "config.json")
            if not self._store_given:
                named = self._config.get("store")
                self.store = Path(named) if isinstance(named, str) and "://" not in named else \
                    self.run_dir / "store"
        return self._config

    # -- what changed (the events stream)

    def state(self) -> dict[str, Any]:
        """Counters that change when the run writes: the page fetches what a changed one names."""
        self._listing()
        return {"steps": len(self.metrics.read()), "evals": len(self.evals.read()),
                "store": [sum(self._files[0]), self._files[1]] if self._files else [0, 0],
                "finished": (self.run_dir / "summary.json").exists()}

    def locked_state(self) -> dict[str, Any]:
        """:meth:`state` under the lock (for the events stream, asking from a thread of its own)."""
        with self._lock:
            return self.state()

    # -- run-level

    def overview(self) -> dict[str, Any]:
        cfg = self.config
        summary = read_json(self.run_dir / "summary.json")
        rows = self.metrics.read()
        last = rows[-1] if rows else {}
        agent = cfg.get("agent") or {}
        sandbox = agent.get("sandbox") if isinstance(agent, dict) else None
        settings = {
            "mode": cfg.get("mode"), "backend": (cfg.get("backend") or {}).get("name"),
            "model": Path(str((cfg.get("model") or {}).get("path") or "")).name or None,
            "group size": cfg.get("group_size"), "groups per step": cfg.get("batch_groups"),
            "step limit": cfg.get("steps"), "target reward": cfg.get("target_reward"),
            "estimator": (cfg.get("algorithm") or {}).get("estimator"),
            "sandbox": sandbox.get("kind") if isinstance(sandbox, dict) else None,
            "egress": (cfg.get("proxy") or {}).get("egress"),
        }
        return {"name": cfg.get("name") or self.run_dir.name, "run_dir": str(self.run_dir),
                "settings": {k: v for k, v in settings.items() if v is not None},
                "finished": bool(summary), "summary": summary or None,
                "summary_text": _summary_text(summary) if summary else None,
                "step": last.get("step", 0), "version": last.get("version", 0),
                "reward": finite(last.get("rollout/reward_mean")), "time_s": last.get("time_s")}

    def metric_rows(self, since: int = 0) -> dict[str, Any]:
        rows = self.metrics.read()
        return {"total": len(rows),
                "rows": [{k: finite(v) for k, v in r.items() if k != "sample_ids"} for r in rows[since:]]}

    def eval_rows(self) -> list[dict[str, Any]]:
        return [{k: finite(v) for k, v in r.items()} for r in self.evals.read()]

    def charts(self) -> dict[str, Any]:
        """report.html's charts as of now: {name: [caption, svg]}."""
        from lgt.trainer.report import plots

        target = self.config.get("target_reward")
        durations = self.durations.read()
        made = plots.charts(self.metrics.read(), durations, self.evals.read(),
                            target if isinstance(target, (int, float)) else None)
        return {name: [caption, svg] for name, (caption, svg) in made.items()}

    # -- the rollout table

    def rollouts(self, query: dict[str, str]) -> dict[str, Any]:
        """A page of the rollout table, filtered and sorted by ``query`` (the page's URL parameters);
        ValueError (one sentence) for a parameter that cannot be read."""
        for key in query:
            if key not in (*FILTERS, "sort", "desc", "limit", "offset"):
                raise ValueError(f"unknown parameter {key!r}: filters are {', '.join(FILTERS)}")
        kept = {  # listing_kept's arguments: None where the filter is not given
            "status": query.get("status") or None,
            "split": query.get("split") or None,
            "task": f"%{query['task']}%" if query.get("task") else None,
            "rollout": f"%{query['rollout']}%" if query.get("rollout") else None,
            "step": query_int(query, "step") if query.get("step") else None,
            "reward_min": _float(query, "reward_min") if query.get("reward_min") else None,
            "reward_max": _float(query, "reward_max") if query.get("reward_max") else None,
            "trained": {"yes": True, "no": False}.get(query.get("trained")),
        }
        sort = query.get("sort") or "started_at"
        if sort not in SORTS:
            raise ValueError(f"cannot sort by {sort!r}: one of {', '.join(SORTS)}")
        desc = query.get("desc", "1") != "0"
        limit = min(max(query_int(query, "limit", 50), 1), PAGE_MAX)
        offset = max(query_int(query, "offset", 0), 0)
        page = SQL["listing_page"].format(sort=sort, direction="DESC" if desc else "ASC")
        with self._lock:
            con = self._listing()
            # every result read to its end: DuckDB 2 refuses register() (the next trained.jsonl chunk)
            # on a connection holding a half-read result
            total = con.execute(SQL["listing_count"], kept).fetchall()[0][0]
            cur = con.execute(page, {**kept, "limit": limit, "offset": offset})
            cols = [d[0] for d in cur.description]
            rows = [jsonable(dict(zip(cols, r))) for r in cur.fetchall()]
            counts = dict(con.execute(SQL["statuses"]).fetchall())
        return {"total": total, "offset": offset, "limit": limit, "rows": rows, "statuses": counts}

    def _connection(self) -> Any:
        """The DuckDB connection, its views made anew when the store (or a table's first file) appeared
        since, and its ``trained`` table current; at most every :data:`REFRESH_S` it looks again."""
        now = time.monotonic()
        if self._con is not None and now - self._looked < REFRESH_S:
            return self._con
        self._looked = now
        self.config  # noqa: B018 - names the store once the run has written its config
        present = bool(self.store) and Path(self.store).is_dir()
        self._seen = _file_state(Path(self.store)) if present else None
        if self._con is not None and present and (
                self._files is None or any(self._seen[0][i] for i in self._unseen)):
            self._con.close()
            self._con = None
        if self._con is None:
            if present:
                self._con = connect(self.store)
                self._unseen = {i for i, n in enumerate(self._seen[0]) if not n}
            else:  # a run that has not written its store yet: an empty table
                import duckdb

                self._con = duckdb.connect()
            self._con.execute(SQL["empty_listing"])
            self._files = None
            self._con.execute(SQL["trained_tables"])
            self._con.execute(SQL["listing_kept"])
            self.trained.reset()
        try:
            chunk = self.trained.read_new()
        except FileShrank:
            self._con.execute(SQL["trained_tables"])
            self.trained.reset()
            chunk = self.trained.read_new()
        if chunk is not None:
            self._con.register("trained_chunk", chunk)
            self._con.execute(SQL["trained_append"])
            self._con.unregister("trained_chunk")
            self._con.execute(SQL["trained_last"])
        return self._con

    def _listing(self) -> Any:
        """The connection with ``listing`` (and ``listing_view``: with what training made of each
        rollout) current as of the store's files and trained.jsonl."""
        con = self._connection()
        if self._seen is not None and self._seen != self._files:
            con.execute(SQL["listing"])
            self._files = self._seen
        return con

    # -- one trajectory

    def trajectory(self, rollout_id: str, attempt: int | None = None) -> dict[str, Any]:
        """One rollout attempt turn by turn, with what training made of each token (ValueError: not
        in the store)."""
        with self._lock:
            con = self._connection()
            if self._seen is None:  # no store yet
                raise ValueError(f"rollout {rollout_id!r} is not in the store")
            traj = show.load_trajectory(con, rollout_id, attempt)
            trained = next(iter(con.execute(SQL["trained_rollout"], {
                "rollout_id": rollout_id, "attempt": traj.rollout["attempt"]}).fetchall()), None)
        return trajectory_json(traj, self.tokenizer(), trained, as_chat=_as_chat())

    def tokenizer(self) -> Any:
        """The run's model's tokenizer (decodes tokens one by one), or None when it cannot be read."""
        if not self._tokenizer_tried and self.config:  # the run may not have written its config yet
            self._tokenizer_tried = True
            path = (self.config.get("model") or {}).get("path")
            if path:
                try:
                    self._tokenizer = show.load_tokenizer(path)
                except ValueError:
                    self._tokenizer = None
        return self._tokenizer

    def close(self) -> None:
        with self._lock:
            if self._con is not None:
                self._con.close()
                self._con = None


def query_int(query: dict[str, str], key: str, default: int | None = 0) -> int | None:
    value = query.get(key)
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{key} must be a whole number, not {value!r}") from None


def _float(query: dict[str, str], key: str) -> float:
    try:
        return float(query[key])
    except ValueError:
        raise ValueError(f"{key} must be a number, not {query[key]!r}") from None


TABLES = ("calls", "rollouts", "rewards", "egress")


def _file_state(store: Path) -> tuple[tuple[int, ...], int]:
    """(files per table of :data:`TABLES`, newest mtime in ns): a new file or a rewritten one changes it."""
    counts, newest = [], 0
    for table in TABLES:
        n = 0
        stack = [store / table]
        while stack:
            try:
                entries = list(os.scandir(stack.pop()))
            except FileNotFoundError:
                continue
            for e in entries:
                if e.is_dir(follow_symlinks=False):
                    if not e.name.startswith("_"):
                        stack.append(Path(e.path))
                elif e.name.endswith(".parquet"):
                    n += 1
                    newest = max(newest, e.stat().st_mtime_ns)
        counts.append(n)
    return tuple(counts), newest


def _summary_text(summary: dict[str, Any]) -> str | None:
    from lgt.trainer.report.summary import render

    try:
        return render(summary)
    except Exception:  # a summary of an older layout: the page shows its values instead
        return None


def _as_chat() -> Callable[[str, Any, Any], tuple[Any, Any]] | None:
    try:
        from lgt.proxy.dialects import as_chat
    except ImportError:
        return None
    return as_chat

