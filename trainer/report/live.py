"""The live run page: what ``lgt-train serve RUN_DIR`` (and ``lgt-train run --serve PORT``) shows.

:class:`RunView` answers the page's questions from what the run writes as it goes — ``metrics.jsonl``,
``eval.jsonl``, ``trained.jsonl`` (each read from where it was last read to), and the store through
DuckDB — and :func:`make_app` serves it read-only over HTTP: ``live.html``, JSON under ``/api/``, and
``/api/events``, a server-sent event each time the run wrote something new.

The rollout table is one in-memory DuckDB table rebuilt when the store's files changed (at most every
:data:`REFRESH_S`), from scalar columns only (token counts come from the calls' usage), so listing,
filtering and paging a store of 100k rollouts touches no token list; a trajectory reads one rollout's
rows. Nothing shown is a secret: the store holds no credentials (the proxy redacts them), the page
shows no config values but a few named settings, and requests whose Host is not the address served are
refused (a web page elsewhere cannot read it through DNS rebinding).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from lgt.store import show
from lgt.store.query import connect
from lgt.trainer.report.summary import jsonl_rows, read_json

log = logging.getLogger("lgt.live")

REFRESH_S = 1.0  # the store's file list is looked at no more often than this
PAGE_MAX = 500  # rollouts per page of the table at most
TOKENS_MAX = 4000  # generated tokens of one call sent one by one; past it, the rest as text
TEXT_MAX = 20000  # characters of one message or context shown before eliding its middle
SORTS = ("started_at", "ended_at", "reward", "calls", "generated", "seconds", "step", "advantage",
         "task_id", "status", "rollout_id")
FILTERS = ("status", "split", "task", "rollout", "step", "reward_min", "reward_max", "trained")


class FileShrank(Exception):
    """A file read as it grows was rewritten shorter: read it again from the start."""


def new_lines(path: Path, offset: int) -> tuple[bytes, int]:
    """The whole lines ``path`` holds past ``offset``, and the offset after them (a line a crash cut off
    is read once it is whole); FileShrank when it is shorter than ``offset``."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return b"", offset
    if size < offset:
        raise FileShrank(str(path))
    if size == offset:
        return b"", offset
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(size - offset)
    end = data.rfind(b"\n") + 1
    return data[:end], offset + end


def bulk_rows(data: bytes, columns: tuple[tuple[str, str], ...]) -> Any:
    """JSON lines as an Arrow table of ``columns`` ((name, type alias) pairs; other fields ignored),
    parsed in bulk; a line that is not JSON is skipped."""
    import io

    import pyarrow as pa
    import pyarrow.json as pj

    schema = pa.schema([(name, pa.type_for_alias(kind)) for name, kind in columns])
    try:
        return pj.read_json(io.BytesIO(data), parse_options=pj.ParseOptions(
            explicit_schema=schema, unexpected_field_behavior="ignore")).select(schema.names)
    except pa.ArrowInvalid:  # a torn or hand-written line: line by line, skipping it
        return pa.Table.from_pylist([{k: _typed(row.get(k), kind) for k, kind in columns}
                                     for row in jsonl_rows(data)], schema=schema)


def _typed(v: Any, kind: str) -> Any:
    try:
        if v is None:
            return None
        return float(v) if kind.startswith("float") else int(v) if kind.startswith("int") else str(v)
    except (TypeError, ValueError):
        return None


class Tail:
    """The rows of a growing JSON-lines file (metrics.jsonl, eval.jsonl: a line per step or evaluation),
    read from where the last read stopped; a file rewritten shorter is read again from the start."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self._offset = 0

    def read(self) -> list[dict[str, Any]]:
        """Every row so far (new ones appended)."""
        try:
            data, self._offset = new_lines(self.path, self._offset)
        except FileShrank:
            self.rows, self._offset = [], 0
            data, self._offset = new_lines(self.path, 0)
        self.rows += jsonl_rows(data)
        return self.rows


class Durations:
    """rollouts.jsonl's ``seconds``, a float per rollout (the file holds one line per rollout: parsed
    in bulk, nothing else kept)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: list[float | None] = []
        self._offset = 0

    def read(self) -> list[float | None]:
        try:
            data, self._offset = new_lines(self.path, self._offset)
        except FileShrank:
            self.seconds, self._offset = [], 0
            data, self._offset = new_lines(self.path, 0)
        if data:
            self.seconds += bulk_rows(data, (("seconds", "float64"),)).column("seconds").to_pylist()
        return self.seconds


class TrainedTail:
    """trained.jsonl's new lines as an Arrow table of :data:`TRAINED_COLUMNS` (a step writes a line per
    sample: a long run's file holds one per trained sample, so it is parsed in bulk)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def reset(self) -> None:
        self._offset = 0

    def read_new(self) -> Any:
        """The lines written since the last read, or None when there are none; FileShrank when the
        file was rewritten shorter."""
        data, self._offset = new_lines(self.path, self._offset)
        return bulk_rows(data, TRAINED_COLUMNS) if data else None


TRAINED_COLUMNS = (("rollout_id", "string"), ("attempt", "int32"), ("step", "int64"),
                   ("advantage", "float64"), ("loss_weight", "float64"))
TRAINED_SQL = """
CREATE OR REPLACE TEMP TABLE trained_log (rollout_id VARCHAR, attempt INTEGER, step BIGINT, advantage DOUBLE,
    loss_weight DOUBLE);
CREATE OR REPLACE TEMP TABLE trained (rollout_id VARCHAR, attempt INTEGER, trained_step BIGINT,
    advantage DOUBLE, loss_weight DOUBLE);
CREATE OR REPLACE TEMP VIEW listing_view AS
SELECT listing.*, trained.trained_step, trained.advantage, trained.loss_weight
FROM listing LEFT JOIN trained USING (rollout_id, attempt)
"""
# a resumed step trains a rollout again: its last step counts
TRAINED_LAST_SQL = """
CREATE OR REPLACE TEMP TABLE trained AS
SELECT rollout_id, attempt, max(step) AS trained_step, arg_max(advantage, step) AS advantage,
       arg_max(loss_weight, step) AS loss_weight
FROM trained_log GROUP BY ALL
"""

LISTING_SQL = """
CREATE OR REPLACE TEMP TABLE listing AS
WITH c AS (
    SELECT rollout_id, attempt, count(*) AS calls, count(*) FILTER (WHERE status = 'ok') AS calls_ok,
           sum(usage_completion_tokens) AS generated, max(usage_prompt_tokens) AS context,
           min(policy_version) AS version_min, max(policy_version) AS version_max,
           count(*) FILTER (WHERE status = 'ok' AND coalesce(capture, 'full') <> 'full') AS capture_partial
    FROM calls GROUP BY ALL
), w AS (
    SELECT rollout_id, attempt, value AS reward, source AS reward_source FROM rewards WHERE call_id IS NULL
)
SELECT r.rollout_id, r.attempt, r.task_id, r.group_id, r.step, r.split, r.status, r.exit_code,
       r.started_at, r.ended_at, epoch(r.ended_at) - epoch(r.started_at) AS seconds,
       w.reward, w.reward_source, coalesce(c.calls, 0) AS calls, coalesce(c.calls_ok, 0) AS calls_ok,
       c.generated, c.context, c.version_min, c.version_max, coalesce(c.capture_partial, 0) AS capture_partial
FROM rollouts r LEFT JOIN c USING (rollout_id, attempt) LEFT JOIN w USING (rollout_id, attempt)
"""

EMPTY_LISTING_SQL = """
CREATE OR REPLACE TEMP TABLE listing (rollout_id VARCHAR, attempt INTEGER, task_id VARCHAR, group_id VARCHAR,
    step BIGINT, split VARCHAR, status VARCHAR, exit_code INTEGER, started_at TIMESTAMPTZ,
    ended_at TIMESTAMPTZ,
    seconds DOUBLE, reward DOUBLE, reward_source VARCHAR, calls BIGINT, calls_ok BIGINT, generated HUGEINT,
    context BIGINT, version_min BIGINT, version_max BIGINT, capture_partial BIGINT)
"""


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
                "reward": _finite(last.get("rollout/reward_mean")), "time_s": last.get("time_s")}

    def metric_rows(self, since: int = 0) -> dict[str, Any]:
        rows = self.metrics.read()
        return {"total": len(rows),
                "rows": [{k: _finite(v) for k, v in r.items() if k != "sample_ids"} for r in rows[since:]]}

    def eval_rows(self) -> list[dict[str, Any]]:
        return [{k: _finite(v) for k, v in r.items()} for r in self.evals.read()]

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
        where, params = [], []
        for key in query:
            if key not in (*FILTERS, "sort", "desc", "limit", "offset"):
                raise ValueError(f"unknown parameter {key!r}: filters are {', '.join(FILTERS)}")
        if query.get("status"):
            where.append("status = ?")
            params.append(query["status"])
        if query.get("split"):
            where.append("split = ?")
            params.append(query["split"])
        if query.get("task"):
            where.append("task_id ILIKE ?")
            params.append(f"%{query['task']}%")
        if query.get("rollout"):
            where.append("rollout_id ILIKE ?")
            params.append(f"%{query['rollout']}%")
        if query.get("step"):
            where.append("step = ?")
            params.append(_int(query, "step"))
        for key, op in (("reward_min", ">="), ("reward_max", "<=")):
            if query.get(key):
                where.append(f"reward {op} ?")
                params.append(_float(query, key))
        if query.get("trained") in ("yes", "no"):
            where.append("trained_step IS " + ("NOT NULL" if query["trained"] == "yes" else "NULL"))
        sort = query.get("sort") or "started_at"
        if sort not in SORTS:
            raise ValueError(f"cannot sort by {sort!r}: one of {', '.join(SORTS)}")
        desc = query.get("desc", "1") != "0"
        limit = min(max(_int(query, "limit", 50), 1), PAGE_MAX)
        offset = max(_int(query, "offset", 0), 0)
        sql_where = f"WHERE {' AND '.join(where)}" if where else ""
        with self._lock:
            con = self._listing()
            # every result read to its end: DuckDB 2 refuses register() (the next trained.jsonl chunk)
            # on a connection holding a half-read result
            total = con.execute(f"SELECT count(*) FROM listing_view {sql_where}", params).fetchall()[0][0]
            cur = con.execute(
                f"SELECT * FROM listing_view {sql_where} ORDER BY {sort} {'DESC' if desc else 'ASC'} "
                f"NULLS LAST, rollout_id, attempt LIMIT {limit} OFFSET {offset}", params)
            cols = [d[0] for d in cur.description]
            rows = [_jsonable(dict(zip(cols, r))) for r in cur.fetchall()]
            counts = dict(con.execute("SELECT status, count(*) FROM listing GROUP BY 1").fetchall())
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
            self._con.execute(EMPTY_LISTING_SQL)
            self._files = None
            self._con.execute(TRAINED_SQL)
            self.trained.reset()
        try:
            chunk = self.trained.read_new()
        except FileShrank:
            self._con.execute(TRAINED_SQL)
            self.trained.reset()
            chunk = self.trained.read_new()
        if chunk is not None:
            self._con.register("trained_chunk", chunk)
            self._con.execute("INSERT INTO trained_log SELECT * FROM trained_chunk")
            self._con.unregister("trained_chunk")
            self._con.execute(TRAINED_LAST_SQL)
        return self._con

    def _listing(self) -> Any:
        """The connection with ``listing`` (and ``listing_view``: with what training made of each
        rollout) current as of the store's files and trained.jsonl."""
        con = self._connection()
        if self._seen is not None and self._seen != self._files:
            con.execute(LISTING_SQL)
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
            trained = next(iter(con.execute("SELECT trained_step, advantage, loss_weight FROM trained "
                                            "WHERE rollout_id = ? AND attempt = ?",
                                            [rollout_id, traj.rollout["attempt"]]).fetchall()), None)
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


def trajectory_json(traj: show.Trajectory, tokenizer: Any, trained: tuple | None, *,
                    as_chat: Callable[[str, Any, Any], tuple[Any, Any]] | None = None) -> dict[str, Any]:
    """``traj`` as the page draws it: per call the messages new since the previous call, the reply,
    the verdict of the sample builder (trained or why not, the sample it is in, where the merge
    broke and why) and each generated token with its behaviour logprob; the rollout's advantage and
    loss weight when a step trained it."""
    r = traj.rollout
    whole = next((w for w in traj.rewards if w["call_id"] is None), None)
    per_call = {w["call_id"]: w for w in traj.rewards if w["call_id"] is not None}
    why_not = show.rollout_excluded(r, whole is not None)
    marks = show.verdicts(traj.calls, why_not)
    advantage = _finite(trained[1]) if trained else None
    calls, prev_msgs = [], None
    for c, v in zip(traj.calls, marks):
        req, resp = show._json(c.get("request_json")), show._json(c.get("response_json"))
        if as_chat is not None and c.get("api") not in (None, c["endpoint"]):
            try:
                req, resp = as_chat(c["api"], req, resp)
            except Exception:  # a call the reader cannot translate is shown as the agent sent it
                pass
        msgs = req.get("messages") if isinstance(req, dict) else None
        shown, skipped = [], 0
        if isinstance(msgs, list):
            new, skipped = show._new_messages(msgs, prev_msgs)
            shown = [_message(m) for m in new]
            reply = show._reply_message(resp)
            prev_msgs = msgs + [reply] if reply else msgs
        elif isinstance(req, dict) and "prompt" in req:
            shown = [{"role": "prompt", "text": _elide(str(req["prompt"]))}]
        prompt = c.get("prompt_token_ids") or []
        gen = list(c.get("response_token_ids") or [])
        lps = c.get("response_logprobs")
        lps = list(lps) if lps is not None and len(lps) == len(gen) else None
        is_trained = v.excluded is None
        if v.link and v.link != "first":
            link_text = show.LINKS[v.link].format(new=len(prompt) - v.context_from)
        else:
            link_text = ""
        excluded_text = None
        if v.excluded is not None:
            excluded_text = (v.excluded if v.link is not None
                             else show.CALL_EXCLUDED.get(v.excluded, f"call status {v.excluded}"))
        call = {
            "seq": c["seq"], "call_id": c["call_id"], "policy_version": c["policy_version"],
            "status": c["status"], "http_status": c.get("http_status"), "error": c.get("error"),
            "latency_ms": _finite(c.get("latency_ms")), "ttfb_ms": _finite(c.get("ttfb_ms")),
            "streamed": c.get("streamed"), "api": c.get("api") or c["endpoint"], "endpoint": c["endpoint"],
            "model": c.get("requested_model"), "served_model": c.get("served_model"),
            "capture": c.get("capture"), "capture_reason": c.get("capture_reason"),
            "translation": list(c.get("translation") or ()), "finish_reason": c.get("finish_reason"),
            "link": v.link, "link_text": link_text, "sample": v.sample, "trained": is_trained,
            "excluded": excluded_text, "messages": shown, "skipped": skipped, "reply": _reply(resp),
            "prompt_tokens": len(prompt), "context_from": v.context_from,
            "context_text": _elide(_decode(tokenizer, prompt[v.context_from:])) if tokenizer else None,
            "generated": len(gen), "logprobs_recorded": lps is not None,
            "tokens": _tokens(tokenizer, gen, lps),
            "reward": _reward(per_call.get(c["call_id"])),
        }
        calls.append(call)
    return {
        "rollout": _jsonable(dict(r)), "attempts": traj.attempts, "reward": _reward(whole),
        "excluded": why_not, "samples": len({v.sample for v in marks if v.sample is not None}),
        "trained": ({"step": trained[0], "advantage": advantage, "loss_weight": _finite(trained[2])}
                    if trained else None),
        "decoded": tokenizer is not None, "calls": calls,
        "egress": [_egress(e) for e in traj.egress],
    }


def _tokens(tokenizer: Any, ids: list[int], lps: list[float] | None) -> list[list[Any]]:
    """[text, logprob] per generated token (the id as text without a tokenizer); past
    :data:`TOKENS_MAX`, the rest as one piece without a logprob."""
    out: list[list[Any]] = []
    head = ids[:TOKENS_MAX]
    texts = [_decode(tokenizer, [t]) for t in head] if tokenizer else [f"‹{t}›" for t in head]
    for i, text in enumerate(texts):
        out.append([text, _finite(lps[i]) if lps is not None else None])
    if len(ids) > TOKENS_MAX:
        rest = _decode(tokenizer, ids[TOKENS_MAX:]) if tokenizer else f"… {len(ids) - TOKENS_MAX} more"
        out.append([rest, None])
    return out


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return show._decode(tokenizer, ids) if ids else ""


def _message(m: Any) -> dict[str, Any]:
    if not isinstance(m, dict):
        return {"role": "?", "text": _elide(str(m))}
    out: dict[str, Any] = {"role": str(m.get("role", "?")), "text": _elide(show._content(m.get("content")))}
    if m.get("tool_call_id"):
        out["tool_call_id"] = str(m["tool_call_id"])
    if m.get("tool_calls"):
        out["tool_calls"] = [show._tool_call(tc) for tc in m["tool_calls"]]
    return out


def _reply(resp: Any) -> dict[str, Any] | None:
    if not isinstance(resp, dict) or not resp.get("choices"):
        return None
    choice = resp["choices"][0]
    if "message" in choice:
        m = choice["message"] or {}
        return {"text": _elide(show._content(m.get("content"))),
                "reasoning": _elide(str(m.get("reasoning_content") or m.get("reasoning") or "")) or None,
                "tool_calls": [show._tool_call(tc) for tc in m.get("tool_calls") or []]}
    return {"text": _elide(str(choice.get("text", ""))), "reasoning": None, "tool_calls": []}


def _egress(e: dict[str, Any]) -> dict[str, Any]:
    return {"where": show.egress_target(e), "allowed": bool(e["allowed"]), "policy": e["policy"],
            "status": e.get("status"), "bytes": e.get("response_bytes"), "error": e.get("error"),
            "kind": e["kind"]}


def _reward(w: dict[str, Any] | None) -> dict[str, Any] | None:
    if not w:
        return None
    return {"value": _finite(w["value"]), "source": w["source"],
            "recorded_at": w["recorded_at"].isoformat() if w.get("recorded_at") else None}


def _elide(text: str, limit: int = TEXT_MAX) -> str:
    return show._elide(text, limit)


def _finite(v: Any) -> Any:
    """JSON has no NaN or infinity: those become null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in row.items():
        if hasattr(v, "isoformat"):
            v = v.isoformat()
        out[k] = _finite(v)
    return out


def _int(query: dict[str, str], key: str, default: int | None = 0) -> int | None:
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


# --- the server ----------------------------------------------------------------------------------

PAGE = "live.html"


def page_html() -> str:
    return resources.files("lgt.trainer.report").joinpath(PAGE).read_text()


def make_app(view: RunView, *, allowed_hosts: tuple[str, ...] = ()) -> Any:
    """The aiohttp application serving ``view``: GET only. ``allowed_hosts``: Host header values
    accepted besides loopback names (the address served)."""
    from aiohttp import web

    loopback = {"127.0.0.1", "localhost", "[::1]", "::1"}

    @web.middleware
    async def guard(request: web.Request, handler: Callable) -> web.StreamResponse:
        host = (request.host or "").rsplit(":", 1)[0] if not (request.host or "").startswith("[") else \
            (request.host or "").split("]")[0] + "]"
        if host not in loopback and host not in allowed_hosts:
            return web.Response(status=403, text=f"this page answers on {', '.join(sorted(loopback))} only")
        if request.method not in ("GET", "HEAD"):
            return web.Response(status=405, text="the run page is read-only")
        resp = await handler(request)
        resp.headers["X-Content-Type-Options"] = "nosniff"
        resp.headers["Cache-Control"] = "no-store"
        return resp

    async def call(fn: Callable[..., Any], *args: Any) -> web.Response:
        try:
            out = await asyncio.to_thread(fn, *args)
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response(out, dumps=_dumps)

    async def index(request: web.Request) -> web.Response:
        return web.Response(text=page_html(), content_type="text/html",
                            headers={"Content-Security-Policy": "default-src 'self'; "
                                     "script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:"})

    async def overview(request: web.Request) -> web.Response:
        return await call(view.overview)

    async def metrics(request: web.Request) -> web.Response:
        try:
            since = _int(dict(request.query), "since", 0)
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        return await call(view.metric_rows, since)

    async def evals(request: web.Request) -> web.Response:
        return await call(view.eval_rows)

    async def charts(request: web.Request) -> web.Response:
        return await call(view.charts)

    async def rollouts(request: web.Request) -> web.Response:
        return await call(view.rollouts, dict(request.query))

    async def trajectory(request: web.Request) -> web.Response:
        try:
            n = _int(dict(request.query), "attempt", None)
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        try:
            out = await asyncio.to_thread(view.trajectory, request.match_info["rollout_id"], n)
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=404)
        return web.json_response(out, dumps=_dumps)

    async def events(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store"})
        await resp.prepare(request)
        last = None
        try:
            while True:
                try:
                    state = await asyncio.to_thread(_locked_state, view)
                except Exception:  # a read that failed (a file mid-write, the store moved): say, go on
                    log.exception("the run page could not read %s", view.run_dir)
                    state = last
                if state != last:
                    await resp.write(f"data: {json.dumps(state)}\n\n".encode())
                    last = state
                else:
                    await resp.write(b": idle\n\n")  # a comment: notices a closed page
                await asyncio.sleep(REFRESH_S)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return resp

    app = web.Application(middlewares=[guard])
    app.router.add_get("/", index)
    app.router.add_get("/api/overview", overview)
    app.router.add_get("/api/metrics", metrics)
    app.router.add_get("/api/evals", evals)
    app.router.add_get("/api/charts", charts)
    app.router.add_get("/api/rollouts", rollouts)
    app.router.add_get("/api/rollouts/{rollout_id}", trajectory)
    app.router.add_get("/api/events", events)
    app.on_cleanup.append(lambda app: asyncio.to_thread(view.close))
    return app


def _locked_state(view: RunView) -> dict[str, Any]:
    with view._lock:
        return view.state()


def _dumps(obj: Any) -> str:
    return json.dumps(obj, default=str, allow_nan=False)


def check_port(host: str, port: int) -> None:
    """ValueError (one sentence) when ``host:port`` cannot be listened on."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot serve the run page on {host}:{port}: {e.strerror or e}") from None


def serve(view: RunView, host: str = "127.0.0.1", port: int = 8765, *,
          ready: Callable[[str], None] | None = None) -> None:
    """Serve ``view`` until interrupted (the ``lgt-train serve`` command)."""
    asyncio.run(_serve(view, host, port, ready=ready))


async def _serve(view: RunView, host: str, port: int, *, ready: Callable[[str], None] | None = None,
                 stop: asyncio.Event | None = None) -> None:
    from aiohttp import web

    runner = web.AppRunner(make_app(view, allowed_hosts=(host,)), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    if ready is not None:
        ready(f"http://{host if ':' not in host else f'[{host}]'}:{bound}/")
    try:
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        await runner.cleanup()


class Background:
    """The page served from a thread beside a run (``lgt-train run --serve PORT``)."""

    def __init__(self, run_dir: Path, host: str, port: int, store: Path | None = None) -> None:
        self.view = RunView(run_dir, store)
        self.url: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(host, port), name="lgt-live-page",
                                        daemon=True)

    def start(self) -> str:
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise ValueError(f"the run page could not start: {self._error}")
        return self.url or ""

    def _main(self, host: str, port: int) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()

            def ready(url: str) -> None:
                self.url = url
                self._ready.set()

            await _serve(self.view, host, port, ready=ready, stop=self._stop)

        try:
            asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e
            self._ready.set()

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
