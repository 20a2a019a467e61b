"""``lgt-train run``: the training loop, sync or collocated async, read top to bottom.

setup → train → cleanup. One run = a local ``lgt-proxy`` (or a running one), a vLLM engine behind it, the
rollout controller launching the unmodified agent once per rollout, the store, and the torch backend.

Each training step:
  1. enough complete groups are ready (sync: the whole batch launched for this step; async: any
     ``batch_groups`` finished groups, oldest first, while other rollouts keep running);
  2. ``POST /pause`` to the proxy: new model calls are held, in-flight ones drain (seconds recorded);
  3. samples of the chosen groups are built from the store (merged per rollout, GRPO advantages per
     group, loss weights so each rollout counts once), calls older than ``max_staleness`` versions dropped;
  4. the backend trains on them; the engine gets the new weights without a restart;
  5. a checkpoint is written (model, optimizer, the trained sample ids) before ``POST /resume`` with
     the new policy version; held calls continue on the new weights.

Departures from the published method, on purpose:
- Admission control (async): a group is launched only while launched groups ≤ (version + 1 +
  max_staleness) × batch_groups, and a group whose calls are more than max_staleness versions old when
  its turn comes is dropped (counted in ``rollout/stale_dropped``), so no trained call is staler than that.
- Failed and timed-out rollouts are retried by the controller; exhausted ones leave their group (they are
  not trained as reward 0).
- The loss corrects the engine/trainer mismatch with truncated importance weights against the recorded
  behaviour logprobs (``algorithm.is_mode``).
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import dataclasses
import json
import math
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from lgt.store.query import connect
from lgt.store.samples import build_group_samples

from . import config as cfgmod
from .config import RunConfig
from .proxy_client import ProxyClient

FAIL_FAST_GROUPS = 2  # groups that all failed, with no rollout ever ok, end the run
TARGET_WINDOW = 10  # target_reward is reached when the mean reward of this many last steps reaches it


@dataclass
class Group:
    """``group_size`` rollouts of one task launched together; GRPO advantages are taken within it."""

    index: int
    task: dict[str, Any]
    version: int  # policy version when launched
    results: list[Any] = field(default_factory=list)
    pending: int = 0

    @property
    def group_id(self) -> str:
        return f"g{self.index:06d}"

    def rollout_id(self, k: int) -> str:
        return f"{self.group_id}-{k}"

    @property
    def done(self) -> bool:
        return self.pending == 0


@dataclass
class StepStats:
    """What the progress display shows."""

    step: int = 0
    version: int = 0
    running: int = 0
    done: int = 0
    failed: int = 0
    reward_mean: float = float("nan")
    staleness: float = 0.0
    drain_s: float = 0.0
    tokens_per_s: float = 0.0


class Run:
    """One training run (see the module docstring). ``run_dir`` holds everything it writes."""

    def __init__(self, cfg: RunConfig, run_dir: Path, *, resume: bool = False,
                 display: Callable[[StepStats, str], None] | None = None,
                 crash_at_step: int | None = None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.resume = resume
        self.display = display or (lambda stats, line: None)
        self.crash_at_step = crash_at_step  # fault injection for tests: die inside that step's update
        self.store = cfg.store_path(run_dir)
        self.stats = StepStats()
        self.groups: dict[str, Group] = {}
        self.ready: list[Group] = []
        self.recent_rewards: list[float] = []  # mean reward of the last steps (target_reward)
        self.ok_rollouts = 0  # rollouts that ended ok in this process
        self.failed_groups = 0  # groups whose every rollout failed, before any rollout was ok
        self.fatal: str | None = None  # set when the run cannot go on; train() raises it
        self.trained_groups: set[str] = set()
        self.trained_samples: int = 0
        self.next_group = 0
        self.version = 0
        self.step = 0
        self.t0 = time.monotonic()
        self.tasks: list[dict[str, Any]] = []
        self.proxy: ProxyClient | None = None
        self.engine: Any = None
        self.backend: Any = None
        self.controller: Any = None
        self.tokenizer: Any = None
        self.durations: list[float] = []
        self._wake = asyncio.Event()
        self._rollout_tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------------------------ setup
    def setup(self) -> None:
        from . import engine as enginemod
        from . import models, rollouts, torch_backend

        cfg = self.cfg
        _quiet_transformers()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        self.store.mkdir(parents=True, exist_ok=True)
        _write_json(self.run_dir / "config.json", cfg.to_json())
        self.tasks = cfgmod.load_tasks(cfg.tasks)

        model_dir = self.ensure_model()
        ckpt = torch_backend.latest_checkpoint(self.run_dir / "checkpoints") if self.resume else None
        extra: dict[str, Any] = {}
        if ckpt is not None:
            self.backend, extra = torch_backend.TorchBackend.resume(ckpt, self.backend_config())
            self.version = int(extra.get("version", 0))
            self.step = int(extra.get("step", 0))
            self.trained_groups = set(extra.get("trained_groups", []))
            self.trained_samples = int(extra.get("trained_samples", 0))
            rewards = [r.get("rollout/reward_mean") for r in metric_rows(self.run_dir)
                       if r.get("step", 0) <= self.step]
            self.recent_rewards = [x for x in rewards if isinstance(x, (int, float)) and math.isfinite(x)
                                   ][-TARGET_WINDOW:]
            serve_dir = ckpt
            self.log(f"resuming from {ckpt.name}: step {self.step}, policy version {self.version}")
        else:
            self.backend = torch_backend.TorchBackend.load(model_dir, self.backend_config())
            serve_dir = model_dir
        models.check_model_dir(serve_dir, need_chat_template=True)
        self.tokenizer = _decoder(model_dir)

        self.log(f"starting the vLLM engine on {serve_dir.name} ...")
        self.engine = enginemod.Engine.start(enginemod.EngineConfig(
            model=serve_dir, port=cfg.engine.port, max_model_len=cfg.engine.max_model_len,
            extra_args=tuple(cfg.engine.extra_args), ready_timeout=cfg.engine.ready_timeout,
            log_path=self.run_dir / "logs" / "engine.log"))
        if cfg.proxy.url:
            self.proxy = ProxyClient.connect(self.store, cfg.proxy.url, cfg.proxy.port, cfg.proxy.token)
            self.proxy.resume(self.version)
        else:
            self.proxy = ProxyClient.start(
                self.store, self.engine.url, log_path=self.run_dir / "logs" / "proxy.log",
                policy_version=self.version, port=cfg.proxy.port, control_port=cfg.proxy.control_port,
                command=list(cfg.proxy.command) if cfg.proxy.command else None)
        self.warm_up()
        self.next_group = self.first_free_group()
        if self.resume:
            self.recover_ready_groups()

        agent = rollouts.AgentSpec(
            command=tuple(cfg.agent.command),
            cwd=cfg.agent.cwd or (cfg.source.parent if cfg.source else None),
            env=dict(cfg.agent.env), proxy_mode=cfg.agent.proxy_mode, timeout_s=cfg.agent.timeout_s,
            retries=cfg.agent.retries, evaluator=cfg.agent.evaluator)
        host, _, control_port = self.proxy.control_url.removeprefix("http://").rpartition(":")
        endpoint = rollouts.ProxyEndpoint(store=self.store, port=self.proxy.port, host=host,
                                          control_port=int(control_port), control_token=self.proxy.token)
        self.controller = rollouts.RolloutController(
            agent, endpoint, self.store, self.run_dir, cfg.max_inflight, batch_records=True,
            python_preload=tuple(cfg.agent.python_preload) if cfg.agent.python_preload else None)

    def warm_up(self) -> None:
        """One request straight to the engine, so the first rollouts do not pay its first-call cost."""
        import httpx

        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"{self.engine.url}/completions", trust_env=False, timeout=120,
                       json={"model": "policy", "prompt": "hello", "max_tokens": 4})

    def ensure_model(self) -> Path:
        from . import models, tiny

        m = self.cfg.model
        if m.make is not None:  # reuses the model when it was made with the same settings
            made = tiny.is_made(m.path, preset=m.make.preset, warm_start_task=m.make.warm_start,
                                seconds=m.make.seconds, seed=m.make.seed)
            if not made:
                self.log(f"building the model {m.path} (preset {m.make.preset}, warm start "
                         f"{m.make.warm_start or 'none'}, ~{m.make.seconds:.0f} s) ...")
            tiny.make_model(m.path, preset=m.make.preset, warm_start_task=m.make.warm_start,
                            seconds=m.make.seconds, seed=m.make.seed, progress=not made)
        models.check_model_dir(m.path, need_chat_template=True).check_context(self.cfg.engine.max_model_len)
        return m.path

    def backend_config(self) -> Any:
        from . import rl, torch_backend

        a, b = self.cfg.algorithm, self.cfg.backend
        loss = rl.LossConfig(clip_low=a.clip_low, clip_high=a.clip_high, is_mode=a.is_mode, is_cap=a.is_cap,
                             kl_coef=a.kl_coef, agg=a.agg)
        return torch_backend.TorchConfig(lr=b.lr, weight_decay=b.weight_decay, grad_clip=b.grad_clip,
                                         micro_batch_tokens=b.micro_batch_tokens,
                                         max_seq_len=self.cfg.engine.max_model_len, loss=loss,
                                         seed=self.cfg.seed)

    def first_free_group(self) -> int:
        con = connect(self.store)
        try:
            row = con.execute("SELECT max(TRY_CAST(substr(group_id, 2) AS BIGINT)) FROM rollouts "
                              "WHERE group_id LIKE 'g%'").fetchall()
        finally:
            con.close()
        return int(row[0][0]) + 1 if row and row[0][0] is not None else 0

    def recover_ready_groups(self) -> None:
        """After a crash: groups whose rollouts all finished but that were not trained are trained now."""
        con = connect(self.store)
        try:
            rows = con.execute(
                "SELECT group_id, any_value(task_id), count(DISTINCT rollout_id), min(step) FROM rollouts "
                "WHERE group_id LIKE 'g%' GROUP BY group_id ORDER BY group_id").fetchall()
        finally:
            con.close()
        by_id = {t["task_id"]: t for t in self.tasks}
        for gid, task_id, n, step in rows:
            if gid in self.trained_groups or n < self.cfg.group_size or task_id not in by_id:
                continue
            g = Group(index=int(gid[1:]), task=by_id[task_id], version=int(step or 0))
            self.groups[gid] = g
            self.ready.append(g)
        if self.ready:
            self.log(f"{len(self.ready)} finished group(s) from before the restart will be trained")

    # ------------------------------------------------------------------------------------ train
    async def train(self) -> None:
        cfg = self.cfg
        deadline = self.t0 + cfg.max_minutes * 60 if cfg.max_minutes else math.inf
        while self.step < cfg.steps and time.monotonic() < deadline and \
                (cfg.max_samples is None or self.trained_samples < cfg.max_samples):
            self.launch()
            while len(self.ready) < cfg.batch_groups or (cfg.mode == "sync" and self.inflight_groups()):
                if self.fatal:
                    raise RuntimeError(self.fatal)
                self.engine.check_alive()
                self.proxy.check_alive()
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=1.0)
                self.launch()
                self.refresh()
            self.ready.sort(key=lambda g: g.index)
            batch, self.ready = self.ready[:cfg.batch_groups], self.ready[cfg.batch_groups:]
            await self.update(batch)
            mean = sum(self.recent_rewards) / TARGET_WINDOW  # recent_rewards holds at most that many
            if cfg.target_reward is not None and len(self.recent_rewards) == TARGET_WINDOW and \
                    mean >= cfg.target_reward:
                self.log(f"mean reward of the last {TARGET_WINDOW} steps {mean:.3f} "
                         f"reached the target {cfg.target_reward}")
                break

    def inflight_groups(self) -> int:
        return sum(1 for g in self.groups.values() if not g.done)

    def launch(self) -> None:
        """Start groups while the concurrency and staleness budgets allow (sync: one batch per step)."""
        cfg = self.cfg
        while True:
            running = sum(g.pending for g in self.groups.values())
            if running + cfg.group_size > cfg.max_inflight:
                return
            if cfg.mode == "sync":
                if self.inflight_groups() + len(self.ready) >= cfg.batch_groups:
                    return
            else:
                # groups launched so far must all be trainable within max_staleness versions
                launched = self.next_group - self.first_group_this_run
                if launched >= (self.version - self.version_at_start + 1 + cfg.max_staleness) * \
                        cfg.batch_groups:
                    return
            self.start_group()

    def start_group(self) -> None:
        g = Group(index=self.next_group, task=self.task_for(self.next_group), version=self.version,
                  pending=self.cfg.group_size)
        self.next_group += 1
        self.groups[g.group_id] = g
        for k in range(self.cfg.group_size):
            t = asyncio.get_running_loop().create_task(self.one_rollout(g, k))
            self._rollout_tasks.add(t)
            t.add_done_callback(self._rollout_tasks.discard)

    def task_for(self, n: int) -> dict[str, Any]:
        """The task of group ``n``: the tasks in a seeded shuffled order, reshuffled each epoch."""
        epoch, i = divmod(n, len(self.tasks))
        order = list(range(len(self.tasks)))
        random.Random(self.cfg.seed * 1_000_003 + epoch).shuffle(order)
        return self.tasks[order[i]]

    async def one_rollout(self, g: Group, k: int) -> None:
        try:
            res = await self.controller.run(g.task, g.rollout_id(k), g.group_id, g.version)
        except Exception as e:  # noqa: BLE001 - one rollout's crash must not end the run
            self.log(f"rollout {g.rollout_id(k)} could not run: {e}")
            res = None
        g.results.append(res)
        g.pending -= 1
        if res is not None:
            self.ok_rollouts += res.ok
            self.durations.append(res.seconds)
            with open(self.run_dir / "rollouts.jsonl", "a") as f:
                f.write(json.dumps(_result_row(res), default=str) + "\n")
        if g.done:
            if any(r is not None and r.status == "ok" for r in g.results):
                self.ready.append(g)
            else:
                self.log(f"group {g.group_id}: every rollout failed; see {self.run_dir / 'rollouts'}")
                self.failed_groups += 1
                if self.fatal is None and self.ok_rollouts == 0 and self.failed_groups >= FAIL_FAST_GROUPS:
                    self.fatal = agent_broken(self.failed_groups, [r for r in g.results if r is not None])
        self.refresh()
        self._wake.set()

    async def update(self, batch: list[Group]) -> None:
        cfg = self.cfg
        t_update = time.monotonic()
        perf: dict[str, float] = {}

        async def timed(name: str, fn: Callable[..., Any], *args: Any) -> Any:
            t = time.monotonic()
            out = await asyncio.to_thread(fn, *args)
            perf[f"perf/{name}_s"] = round(time.monotonic() - t, 4)
            return out

        pause = await timed("pause", self.proxy.pause)
        await timed("record", self.controller.flush_records)
        await timed("flush", self.proxy.flush)
        samples, info = await timed("samples", self.samples_for, batch)
        if self.crash_at_step is not None and self.step + 1 == self.crash_at_step:
            os.kill(os.getpid(), signal.SIGKILL)  # fault injection (tests): die mid-step
        metrics: dict[str, float] = {}
        perf["perf/train_s"] = perf["perf/sync_s"] = 0.0
        if samples.num_rows:
            metrics = await timed("train", self.train_on, samples)
            await timed("sync", self.engine.update_weights, self.backend.named_weights())
        self.version += 1
        self.step += 1
        for g in batch:
            self.trained_groups.add(g.group_id)
            self.groups.pop(g.group_id, None)
        self.trained_samples += samples.num_rows
        if self.step % cfg.checkpoint_every == 0 or self.step >= cfg.steps:
            await timed("checkpoint", self.save_checkpoint)
        await timed("resume", self.proxy.resume, self.version)
        train_s, sync_s = perf["perf/train_s"], perf["perf/sync_s"]
        row = {
            "step": self.step, "version": self.version, "time_s": round(time.monotonic() - self.t0, 3),
            "mode": cfg.mode, **info,
            "rollout/running": sum(g.pending for g in self.groups.values()),
            "perf/drain_s": pause.get("drain_seconds", 0.0),
            "perf/in_flight_at_pause": pause.get("in_flight_at_pause", 0),
            **perf, "perf/update_s": round(time.monotonic() - t_update, 4),
            **{k: v for k, v in metrics.items() if isinstance(v, (int, float))},
        }
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        s = self.stats
        s.step, s.version = self.step, self.version
        s.reward_mean = info.get("rollout/reward_mean", float("nan"))
        if not math.isnan(s.reward_mean):
            self.recent_rewards = [*self.recent_rewards[-TARGET_WINDOW + 1:], s.reward_mean]
        s.staleness = info.get("rollout/staleness_max", 0)
        s.drain_s = row["perf/drain_s"]
        s.tokens_per_s = metrics.get("perf/tokens_per_s", metrics.get("tokens_per_s", 0.0))
        self.refresh(f"step {self.step}/{cfg.steps}  reward {s.reward_mean:.3f}  "
                     f"samples {info.get('samples', 0)}  staleness≤{s.staleness}  "
                     f"drain {s.drain_s:.2f}s  train {train_s:.2f}s  sync {sync_s:.2f}s")

    def samples_for(self, batch: list[Group]) -> tuple[pa.Table, dict[str, Any]]:
        """The training samples of ``batch``'s groups, their loss weights renormalised to this batch."""
        cfg = self.cfg
        t = build_group_samples(self.store, [g.group_id for g in batch], mode=cfg.algorithm.sample_mode,
                                tokenizer=self.tokenizer, std_normalize=cfg.algorithm.std_normalize).samples
        info: dict[str, Any] = {}
        # staleness: versions between the policy that generated a token and the one trained now
        min_version = {}
        for gid, versions in zip(t["group_id"].to_pylist(), t["policy_versions"].to_pylist()):
            gen = [v for v in versions if v is not None and v >= 0]
            if gen:
                min_version[gid] = min(min_version.get(gid, gen[0]), min(gen))
        stale = {gid for gid, v in min_version.items() if self.version - v > cfg.max_staleness}
        if stale:
            t = t.filter(pc.invert(pc.is_in(t["group_id"], value_set=pa.array(sorted(stale)))))
        if cfg.algorithm.skip_zero_variance:
            t = t.filter(pc.invert(t["zero_variance"]))
        t, n_rollouts = per_rollout_weights(t)
        rewards = dict(zip(zip(t["rollout_id"].to_pylist(), t["attempt"].to_pylist()),
                           t["reward"].to_pylist()))
        results = [r for g in batch for r in g.results if r is not None]
        gen_versions = [self.version - v for g, v in min_version.items() if g not in stale] or [0]
        vals = list(rewards.values())
        info.update({
            "groups": len(batch), "rollouts": n_rollouts, "samples": t.num_rows,
            "rollout/reward_mean": round(sum(vals) / len(vals), 4) if vals else float("nan"),
            "rollout/failed": sum(1 for r in results if r.status == "failed"),
            "rollout/timeout": sum(1 for r in results if r.status == "timeout"),
            "rollout/retried": sum(1 for r in results if r.attempt > 0),
            "rollout/stale_dropped": len(stale),
            "rollout/staleness_max": max(gen_versions), "rollout/staleness_mean":
                round(sum(gen_versions) / len(gen_versions), 3),
            "rollout/duration_mean": round(sum(r.seconds for r in results) / max(len(results), 1), 3),
            "rollout/zero_variance_groups": len({g for g, z in zip(t["group_id"].to_pylist(),
                                                                    t["zero_variance"].to_pylist()) if z}),
            "sample_ids": t["sample_id"].to_pylist(),
        })
        return t, info

    def train_on(self, samples: pa.Table) -> dict[str, float]:
        """``backend.updates_per_step`` optimizer steps on disjoint shares of the batch's groups (each
        share weighted so its rollouts count once); metrics averaged over them."""
        k = self.cfg.backend.updates_per_step
        groups = sorted(set(samples["group_id"].to_pylist()))
        if k <= 1 or len(groups) < 2:
            return self.backend.train_step(samples)
        shares = [groups[i::k] for i in range(min(k, len(groups)))]
        runs = []
        for share in shares:
            part = samples.filter(pc.is_in(samples["group_id"], value_set=pa.array(share)))
            runs.append(self.backend.train_step(per_rollout_weights(part)[0]))
        keys = {key for m in runs for key in m if isinstance(m[key], (int, float))}
        return {key: sum(m.get(key, 0.0) for m in runs) / len(runs) for key in keys}

    def save_checkpoint(self) -> None:
        extra = {"version": self.version, "step": self.step, "trained_groups": sorted(self.trained_groups),
                 "trained_samples": self.trained_samples}
        self.backend.save_checkpoint(self.run_dir / "checkpoints", extra)

    def refresh(self, line: str = "") -> None:
        s = self.stats
        s.running = sum(g.pending for g in self.groups.values())
        if self.controller is not None:
            s.done = getattr(self.controller, "done", 0)
            s.failed = getattr(self.controller, "failed", 0)
        self.display(s, line)

    def log(self, line: str) -> None:
        self.display(self.stats, line)

    # ---------------------------------------------------------------------------------- cleanup
    async def aclose(self) -> None:
        for t in list(self._rollout_tasks):
            t.cancel()
        if self.controller is not None:
            with contextlib.suppress(Exception):
                await self.controller.aclose()

    def cleanup(self) -> None:
        for thing in (self.proxy, self.engine):
            if thing is not None:
                with contextlib.suppress(Exception):
                    thing.stop()

    # ------------------------------------------------------------------------------ entry point
    async def main(self) -> None:
        self.t0 = time.monotonic()  # metrics' time_s counts from here: set-up (engine start) excluded
        self.first_group_this_run = self.next_group
        self.version_at_start = self.version
        try:
            await self.train()
        finally:
            await self.aclose()


def run(cfg: RunConfig, *, run_dir: Path | None = None, resume: bool = False,
        display: Callable[[StepStats, str], None] | None = None,
        crash_at_step: int | None = None) -> Path:
    """Run ``cfg`` to the end; returns the run directory (metrics, checkpoints, plots, report)."""
    run_dir = (run_dir or cfg.run_dir or cfgmod.default_run_dir(cfg)).resolve()
    if crash_at_step is None and os.environ.get("LGT_FAULT_CRASH_AT_STEP"):  # fault injection (tests)
        crash_at_step = int(os.environ["LGT_FAULT_CRASH_AT_STEP"])
    r = Run(cfg, run_dir, resume=resume, display=display, crash_at_step=crash_at_step)
    try:
        r.setup()
        asyncio.run(r.main())
    finally:
        r.cleanup()
        with contextlib.suppress(Exception):
            finish(run_dir, r.store)
    return run_dir


def metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics.jsonl rows (a last line cut off by a crash is left out)."""
    path = run_dir / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows


def agent_broken(n_groups: int, results: list[Any]) -> str:
    """The sentence that ends a run whose agent has not once finished: its last attempt's error (the
    controller's, which names the last line the agent wrote to stderr)."""
    last = results[-1] if results else None
    said = "" if last is None else \
        f"; its last attempt: {last.error or f'status {last.status}'} ({last.stderr_path})"
    return f"the agent failed in every rollout of the first {n_groups} groups, so it does not run here{said}"


def finish(run_dir: Path, store: Path | None = None) -> None:
    """metrics.csv, plots and the report page from what the run wrote."""
    from lgt.store.report import write_report

    from . import plots

    if store is not None and store.exists():
        con = connect(store)
        try:
            write_report(con, run_dir / "store-report.html", title=f"{run_dir.name}: store")
        finally:
            con.close()

    rows = metric_rows(run_dir)
    if rows:
        cols = sorted({k for r in rows for k in r if k != "sample_ids"},
                      key=lambda k: (k not in ("step", "version", "time_s"), k))
        with open(run_dir / "metrics.csv.tmp", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
        os.replace(run_dir / "metrics.csv.tmp", run_dir / "metrics.csv")
    plots.write_run_report(run_dir, rows)


def per_rollout_weights(t: pa.Table) -> tuple[pa.Table, int]:
    """``t`` with ``loss_weight = 1 / (R · masked tokens of its rollout)`` for the R rollouts in ``t``
    (each rollout counts once in this optimizer step however many samples it became); and R."""
    if not t.num_rows:
        return t, 0
    keys = pc.binary_join_element_wise(t["rollout_id"], pc.cast(t["attempt"], pa.string()), "~")
    n = len(pc.unique(keys))
    w = pc.divide(1.0, pc.multiply(pc.cast(t["rollout_tokens"], pa.float64()), float(n)))
    return t.set_column(t.schema.get_field_index("loss_weight"), "loss_weight", w), n


def _result_row(res: Any) -> dict[str, Any]:
    return dataclasses.asdict(res) if dataclasses.is_dataclass(res) else dict(vars(res))


def _quiet_transformers() -> None:
    """No per-call progress bars from transformers (loading / writing shards at every checkpoint)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    with contextlib.suppress(Exception):
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


def _decoder(model_dir: Path) -> Any:
    """A tokenizer with ``decode`` for realigned samples (the tokenizers library, no transformers)."""
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.exists() else None


def default_display(stream: Any = None) -> Callable[[StepStats, str], None]:
    """One line per event on a non-terminal; a live status line on a terminal (rich)."""
    stream = stream or sys.stderr
    if not stream.isatty():
        def show(stats: StepStats, line: str) -> None:
            if line:
                print(line, file=stream, flush=True)
        return show
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    console = Console(file=stream)
    live = Live(console=console, refresh_per_second=4, transient=True)
    live.start()

    def show(stats: StepStats, line: str) -> None:
        if line:
            live.console.print(line)
        live.update(Text(
            f"step {stats.step}  v{stats.version}  rollouts running {stats.running}  done {stats.done}  "
            f"failed {stats.failed}  reward {stats.reward_mean:.3f}  staleness {stats.staleness}  "
            f"drain {stats.drain_s:.2f}s  {stats.tokens_per_s:.0f} tok/s"))
    show.live = live  # type: ignore[attr-defined]
    return show
