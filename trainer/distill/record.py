"""``lgt-train record CONFIG``: an unmodified agent's traces on a hosted model, with rewards, in a store.

The agent runs as it already does against a hosted model (Claude, GPT, Gemini): its own key and base
URL come from ``agent.env`` in the run config, and nothing of the student is built — no model, no
engine, no backend. Between the agent and its provider sits ``lgt-proxy`` started **observe-only** (no
``--upstream``): every call goes where the agent sent it, unchanged, and is recorded (request,
answer, usage, which model answered); the agent's ``Authorization`` / ``api-key`` / ``x-api-key``
headers are forwarded to the provider and never written. The rollout controller runs the agent as
``lgt-train run`` does (sandbox, timeouts, retries, the reward from the agent or its evaluator):

* each training task (never a held-out one: :func:`~lgt.trainer.run.evaluation.split_tasks`)
  ``--per-task K`` times (default ``group_size``), one group per task (``g000042``), split ``train``;
* with ``--eval``, the held-out tasks ``eval.samples`` times each (at least once), split ``eval``: the
  teacher's held-out score, to set beside the student's ``eval/reward_sampled``. No greedy rollouts:
  the proxy does not change a hosted model's call, so it cannot make one decode greedily.

A store that holds calls already is appended to: group numbers (and evaluation steps) go on from the
highest ones recorded, so recording more traces later, or with another teacher, adds to the same
store. The summary (printed, and ``<run_dir>/summary.json``) counts this recording's rollouts and
calls only, from the store itself, and gives the store's totals beside them.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lgt.trainer import config as cfgmod
from lgt.trainer.config import ConfigError, RunConfig
from lgt.trainer.run import evaluation

SUMMARY_FILE = "summary.json"

# This recording's rollouts (their latest attempt), their split and reward; $ids: the rollout ids.
ROLLOUTS_SQL = """
WITH mine AS (SELECT unnest($ids::VARCHAR[]) AS rollout_id),
last AS (
    SELECT r.rollout_id, r.attempt, r.split, r.status, r.task_id
    FROM rollouts r JOIN mine USING (rollout_id)
    QUALIFY row_number() OVER (PARTITION BY r.rollout_id ORDER BY r.attempt DESC) = 1)
SELECT l.split, l.status, l.task_id, w.value AS reward
FROM last l LEFT JOIN rewards w ON w.rollout_id = l.rollout_id AND w.attempt = l.attempt
                                AND w.call_id IS NULL
"""
# This recording's calls (every attempt's) by API and by the model that answered: the proxy's
# served_model, else the answer's own ``model`` field, else the model the agent asked for.
CALLS_SQL = """
SELECT coalesce(api, endpoint) AS api,
       coalesce(served_model, json_extract_string(response_json, '$.model'), requested_model) AS model,
       count(*) AS calls, count(*) FILTER (WHERE status = 'ok') AS ok,
       coalesce(sum(usage_prompt_tokens), 0) AS prompt_tokens,
       coalesce(sum(usage_completion_tokens), 0) AS completion_tokens
FROM calls WHERE rollout_id IN (SELECT unnest($ids::VARCHAR[]))
GROUP BY ALL ORDER BY calls DESC, api, model
"""
NEXT_SQL = """
SELECT coalesce(max(TRY_CAST(substr(group_id, 2) AS BIGINT)) FILTER (WHERE group_id LIKE 'g%') + 1, 0),
       coalesce(max(TRY_CAST(substr(group_id, 2, 6) AS BIGINT)) FILTER (WHERE group_id LIKE 'e%') + 1, 0),
       (SELECT count(*) FROM calls)
FROM rollouts
"""


@dataclass(frozen=True)
class Plan:
    """What one recording runs: the tasks, ``per_task`` rollouts each, and the held-out ones."""

    tasks: list[dict[str, Any]]
    per_task: int
    eval_tasks: list[dict[str, Any]]  # empty: no --eval
    eval: evaluation.EvalConfig | None


def plan(cfg: RunConfig, *, per_task: int | None = None, n_tasks: int | None = None,
         with_eval: bool = False) -> Plan:
    """The recording ``cfg`` asks for, checked before anything starts: ConfigError (one sentence) for
    no tasks, an agent that cannot start, ``--eval`` without an eval section, no lgt-proxy, an S3
    store. Reads the tasks files; starts nothing."""
    from lgt.trainer.rollout.agent import RolloutError
    from lgt.trainer.rollout.runners import check_agent
    from lgt.trainer.serving.proxy import ProxyError, find_proxy_command

    tasks, held = cfgmod.split_tasks(cfg)
    if with_eval and cfg.eval is None:
        raise ConfigError("--eval records the held-out tasks, but the run config has no eval section to "
                          "say which they are: add e.g. eval: {split: 0.2}")
    per_task = cfg.group_size if per_task is None else per_task
    if per_task < 1:
        raise ConfigError(f"--per-task must be 1 or more rollouts per task, not {per_task}")
    if n_tasks is not None:
        if n_tasks < 1:
            raise ConfigError(f"--tasks must be 1 or more, not {n_tasks}")
        tasks = tasks[:n_tasks]
    if cfg.store_remote() is not None:
        raise ConfigError(f"record writes a local store, not {cfg.store}: record into a folder, then copy "
                          "it to the bucket")
    try:
        check_agent(cfg.agent)
        if not cfg.proxy.command:
            find_proxy_command()
    except (RolloutError, ProxyError) as e:
        raise ConfigError(str(e)) from None
    # a hosted model's call is sent as the agent made it: no greedy decoding, the agent's own sampling only
    held_eval = replace(cfg.eval, greedy=False, samples=cfg.eval.samples or 1) if with_eval else None
    return Plan(tasks, per_task, held if with_eval else [], held_eval)


def start_observer(cfg: RunConfig, store: Path, log_path: Path) -> Any:
    """Start the observe-only proxy for ``cfg`` (its ``proxy`` section: command, ports, egress; a
    ``proxy.url`` is not used: a running proxy may route calls to a policy). Returns a
    :class:`~lgt.trainer.serving.proxy.ProxyClient` whose control API answers."""
    from lgt.trainer.serving.proxy import ProxyClient

    p = cfg.proxy
    return ProxyClient.start(store, None, log_path=log_path, port=p.port, control_port=p.control_port,
                             command=list(p.command) if p.command else None, listen_host=p.listen_host,
                             egress=p.egress_args())


def next_numbers(store: Path) -> tuple[int, int, int]:
    """(the next training group's index, the next evaluation step, the calls the store holds)."""
    from lgt.store.query import connect

    con = connect(store)
    try:
        g, e, calls = con.execute(NEXT_SQL).fetchone()
    finally:
        con.close()
    return int(g), int(e), int(calls)


async def record_rollouts(run: Callable[..., Any], p: Plan, *, first_group: int, eval_step: int,
                          flush: Callable[[], Any] = lambda: None,
                          log: Callable[[str], None] = lambda line: None) -> list[str]:
    """Run every group of ``p`` (and its evaluation) through ``run`` (the controller's ``run``), all at
    once (the controller bounds how many run); ``flush`` after each group. The rollout ids run."""
    ids: list[str] = []

    async def group(i: int, task: dict[str, Any]) -> None:
        gid = f"g{first_group + i:06d}"
        rids = [f"{gid}-{k}" for k in range(p.per_task)]
        ids.extend(rids)
        results = await asyncio.gather(*(run(task, rid, gid, 0) for rid in rids), return_exceptions=True)
        for rid, res in zip(rids, results):
            if isinstance(res, BaseException):
                log(f"rollout {rid} could not run: {res}")
        await asyncio.to_thread(flush)
        rewards = [r.reward for r in results if not isinstance(r, BaseException) and r.ok]
        mean = f", mean reward {sum(rewards) / len(rewards):.3f}" if rewards else ""
        log(f"{gid} (task {task.get('task_id')}): {len(rewards)} of {len(rids)} ok{mean}")

    jobs = [group(i, t) for i, t in enumerate(p.tasks)]
    if p.eval is not None and p.eval_tasks:
        async def run_eval(task: dict[str, Any], rid: str, gid: str, step: int, **kw: Any) -> Any:
            ids.append(rid)
            return await run(task, rid, gid, step, **kw)

        jobs.append(evaluation.evaluate(p.eval, p.eval_tasks, run_eval, step=eval_step, version=0))
    await asyncio.gather(*jobs)
    await asyncio.to_thread(flush)
    return ids


def summarize(store: Path, ids: Sequence[str], *, threshold: float, seconds: float) -> dict[str, Any]:
    """This recording's numbers, read back from the store: rollouts by split (ok, failed, mean reward,
    the share of ok rollouts at or above ``threshold``), calls by API and by answering model, tokens."""
    from lgt.store.query import connect

    con = connect(store)
    try:
        rows = con.execute(ROLLOUTS_SQL, {"ids": list(ids)}).fetchall()
        calls = con.execute(CALLS_SQL, {"ids": list(ids)}).fetchall()
        totals = con.execute("SELECT (SELECT count(*) FROM calls), (SELECT count(*) FROM rollouts)")
        totals = totals.fetchone()
    finally:
        con.close()
    splits = {}
    for split in sorted({r[0] for r in rows}, key=lambda s: s != "train"):
        mine = [r for r in rows if r[0] == split]
        rewards = [float(r[3]) for r in mine if r[1] == "ok" and r[3] is not None]
        splits[split] = {
            "tasks": len({r[2] for r in mine}), "rollouts": len(mine), "ok": len(rewards),
            "failed": len(mine) - len(rewards),
            "reward_mean": round(sum(rewards) / len(rewards), 6) if rewards else None,
            "reward_at_least_threshold": round(sum(v >= threshold for v in rewards) / len(rewards), 6)
            if rewards else None,
        }
    by_api: dict[str, int] = {}
    by_model: dict[str, int] = {}
    for api, model, n, _ok, _p, _c in calls:
        by_api[api] = by_api.get(api, 0) + n
        by_model[str(model)] = by_model.get(str(model), 0) + n
    return {
        "store": str(store), "threshold": threshold, "seconds": round(seconds, 3), "splits": splits,
        "rollouts_not_recorded": len(set(ids)) - len(rows),  # could not start (the log says why)
        "calls": sum(c[2] for c in calls), "calls_ok": sum(c[3] for c in calls),
        "calls_by_api": by_api, "calls_by_model": by_model,
        "prompt_tokens": int(sum(c[4] for c in calls)), "completion_tokens": int(sum(c[5] for c in calls)),
        "store_calls": int(totals[0]), "store_rollouts": int(totals[1]),
    }


def render(s: dict[str, Any], config: Path | None) -> list[str]:
    """The summary as lines for a person."""
    lines = []
    for split, n in s["splits"].items():
        line = (f"{split}: {n['tasks']} tasks, {n['rollouts']} rollouts ({n['ok']} ok, {n['failed']} failed)")
        if n["reward_mean"] is not None:
            share = n["reward_at_least_threshold"]
            line += f", mean reward {n['reward_mean']:.3f}, {share:.0%} at or above {s['threshold']:g}"
        lines.append(line)
    apis = ", ".join(f"{api} {n}" for api, n in s["calls_by_api"].items()) or "none"
    models = ", ".join(f"{m} {n}" for m, n in s["calls_by_model"].items()) or "none"
    lines += [f"calls recorded: {s['calls']} ({s['calls_ok']} ok) — by API: {apis}; answered by: {models}",
              f"tokens: {s['prompt_tokens']} prompt, {s['completion_tokens']} completion",
              f"{s['seconds']:.1f} s; store {s['store']} ({s['store_calls']} calls, {s['store_rollouts']} "
              "rollout attempts in all)",
              f"next: lgt-train sft {config or 'CONFIG'} --traces {s['store']}"]
    return lines


def record(cfg: RunConfig, *, per_task: int | None = None, n_tasks: int | None = None,
           with_eval: bool = False, threshold: float = 1.0, run_dir: Path | None = None,
           log: Callable[[str], None] = print) -> dict[str, Any]:
    """Record ``cfg``'s agent on its own (hosted) model: the store's calls, rollouts and rewards, and
    ``<run_dir>/summary.json``; returns the summary."""
    from lgt.trainer.policy import hidden_from_agents
    from lgt.trainer.rollout.controller import RolloutController

    p = plan(cfg, per_task=per_task, n_tasks=n_tasks, with_eval=with_eval)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = (run_dir or cfg.run_dir or Path.cwd() / "runs" / f"{cfg.name}-record-{stamp}").resolve()
    store = cfg.store_path(run_dir).resolve()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    store.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    proxy = start_observer(cfg, store, run_dir / "logs" / "proxy.log")
    try:
        first_group, eval_step, held = next_numbers(store)
        if held:
            log(f"the store {store} holds {held} calls already: this recording adds to them "
                f"(groups from g{first_group:06d})")
        n = len(p.tasks) * p.per_task
        log(f"recording {n} rollouts ({len(p.tasks)} tasks × {p.per_task})"
            + (f" and the held-out evaluation of {len(p.eval_tasks)} tasks" if p.eval_tasks else "")
            + f" through lgt-proxy, observe-only, on port {proxy.port}")
        controller = RolloutController(cfg.agent, proxy, store, run_dir, cfg.max_inflight,
                                       batch_records=True, hide=hidden_from_agents(cfg))

        async def go() -> list[str]:
            try:
                return await record_rollouts(controller.run, p, first_group=first_group, eval_step=eval_step,
                                             flush=controller.flush_records, log=log)
            finally:
                await controller.aclose()

        ids = asyncio.run(go())
        proxy.flush()
    finally:
        proxy.stop()
    summary = summarize(store, ids, threshold=threshold, seconds=time.monotonic() - t0)
    summary["config"] = str(cfg.source) if cfg.source else None
    tmp = run_dir / f".{SUMMARY_FILE}.tmp"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(run_dir / SUMMARY_FILE)
    return summary
