"""``lgt-train run``: the training recipe, read top to bottom — validate, setup, train, cleanup.

**validate** checks everything a run needs before anything starts, in well under two seconds: the
config (each section checked itself when loaded), the tasks file, the agent command on PATH, the model
directory (or that it can be made), the backend's environment, the engine's interpreter, the proxy.
One sentence names what is wrong; nothing has been built, started or written.

**setup** builds each component once, from its own config section: the model (made locally when asked),
the backend (:data:`lgt.trainer.backends.base.BACKENDS`: load, or resume from the run's last checkpoint), the
vLLM engine serving it, ``lgt-proxy`` in front of the engine (or a running one), and the rollout
controller that launches the unmodified agent once per rollout.

**train**, each step:
  1. enough complete groups are ready (sync: the whole batch launched for this step; async: the
     ``batch_groups`` oldest finished groups, while other rollouts keep running) — admission control
     and the batch are :mod:`lgt.trainer.run.admission`'s pure functions;
  2. the batch's samples from the store (merged per rollout), while the other rollouts still run
     (the batch's groups are finished: nothing of theirs changes); stale groups dropped; advantages
     and loss weights (:mod:`lgt.trainer.rl.algorithm`);
  3. ``POST /pause`` to the proxy: new model calls are held, in-flight ones drain (seconds recorded);
  4. on a GPU the engine sleeps (its memory freed for the update); the backend trains; the engine
     wakes and gets the new weights without a restart (``backend.push_weights``);
  5. a checkpoint (weights, optimizer, the trained groups) before ``POST /resume`` with the new policy
     version; held calls continue on the new weights.

**cleanup** stops the proxy and the engine it started, cancels unfinished rollouts, closes the backend.

Departures from the published method, on purpose:
- Admission control (async) bounds staleness: a group is launched only while every group launched so
  far could be trained within ``max_staleness`` versions; a group whose calls are staler than that when
  its turn comes is dropped (``rollout/stale_dropped``), so no trained call is staler.
- Failed and timed-out rollouts are retried by the controller; exhausted ones leave their group (they
  are not trained as reward 0).
- The loss corrects the engine/trainer mismatch with truncated importance weights against the recorded
  behaviour logprobs (``algorithm.is_mode``); logprobs the proxy could not record are recomputed.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import dataclasses
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from lgt.store.query import connect
from lgt.store.samples import build_group_samples
from lgt.trainer import config as cfgmod
from lgt.trainer.backends.base import BackendError, entry
from lgt.trainer.config import ConfigError, RunConfig
from lgt.trainer.report.summary import WINDOW, read_jsonl
from lgt.trainer.run import admission as batchmod
from lgt.trainer.run import evaluation
from lgt.trainer.serving.proxy import ProxyClient, ProxyError, ProxyGroup

FAIL_FAST_GROUPS = 2  # groups that all failed, with no rollout ever ok, end the run
TARGET_WINDOW = WINDOW  # target_reward is reached when the mean reward of this many last steps reaches it


@dataclass
class Group:
    """``group_size`` rollouts of one task launched together; advantages are taken within it."""

    index: int
    task: dict[str, Any]
    version: int  # policy version when launched
    results: list[Any] = field(default_factory=list)
    pending: int = 0
    recovered_ok: int = 0  # rollouts that finished ok before a restart (their rows are in the store)

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


def validate(cfg: RunConfig, *, resume_dir: Path | None = None, run_dir: Path | None = None
             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Everything the run needs, checked before anything is built or started; returns the training
    tasks and the held-out ones (``eval``: a file, or a share split off the tasks; none without eval).

    ConfigError (or another ValueError: one sentence) names what is wrong. Fast: reads the tasks file and
    a few small JSON files, looks commands up on PATH; imports no torch, verl or vLLM.
    """
    from lgt.trainer import models
    from lgt.trainer.demo import tiny
    from lgt.trainer.rollout import controller as rollouts
    from lgt.trainer.serving.engine import EngineError, engine_python
    from lgt.trainer.serving.proxy import ProxyError, find_proxy_command

    tasks = cfgmod.load_tasks(cfg.tasks)
    held = cfgmod.load_tasks(cfg.eval.tasks) if cfg.eval is not None and cfg.eval.tasks else None
    try:
        tasks, held = evaluation.split_tasks(tasks, cfg.eval, held)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        rollouts.check_agent(cfg.agent)
    except rollouts.RolloutError as e:
        raise ConfigError(str(e)) from None
    m = cfg.model
    if m.make is not None:
        if m.make.preset not in tiny.PRESETS:
            raise ConfigError(f"model.make.preset must be one of {', '.join(tiny.PRESETS)}, not "
                              f"{m.make.preset!r}")
        if m.make.steps is not None and m.make.steps < 1:
            raise ConfigError(f"model.make.steps must be 1 or more, not {m.make.steps}")
        if m.make.warm_start is not None and m.make.warm_start not in tiny.TASKS:
            raise ConfigError(f"model.make.warm_start must be one of {', '.join(tiny.TASKS)} or null, not "
                              f"{m.make.warm_start!r}")
        if m.path.exists() and tiny.read_marker(m.path) is None and any(m.path.iterdir()):
            raise ConfigError(f"model.path {m.path} holds something that is not a model made by lgt: "
                              "choose another path for model.make")
    else:
        models.check_model_dir(m.path, need_chat_template=True).check_context(cfg.engine.max_model_len)
    if resume_dir is not None and not (resume_dir / "config.json").exists():
        raise ConfigError(f"{resume_dir} is not a run directory (it has no config.json)")
    target = run_dir or cfg.run_dir
    if resume_dir is None and target is not None and (target / "config.json").exists():
        raise ConfigError(f"{target} already holds a run (it has a config.json): continue it with --resume "
                          f"{target}, or give a new --run-dir")
    try:
        backend_python(cfg)
        engine_python(cfg.engine)
        if cfg.resources:
            from lgt.trainer.rollout.resources import Resources
            Resources(cfg.resources)  # every template readable
        if cfg.proxy.url is None and not cfg.proxy.command:
            find_proxy_command()
    except (BackendError, EngineError, ProxyError, ValueError) as e:
        raise ConfigError(str(e)) from None
    return tasks, held


def backend_python(cfg: RunConfig) -> str:
    """The interpreter that can run ``cfg``'s backend: this one, or (verl) the one named by
    ``backend.python``, ``$LGT_VERL_PYTHON`` or this checkout's ``.venv-verl``. BackendError (one
    sentence) when there is none. verl 0.9.1 and vLLM's CPU build need different transformers, so on
    CPU machines they live in two environments: the trainer runs in verl's, the engine in vLLM's."""
    backend = entry(cfg.backend.name)
    if backend.available():
        return sys.executable
    repo = Path(__file__).resolve().parent.parent
    for candidate in (getattr(cfg.backend, "python", None), os.environ.get("LGT_VERL_PYTHON"),
                      str(repo / ".venv-verl" / "bin" / "python")):
        if candidate and Path(candidate).exists():
            return candidate
    raise BackendError(f"the {cfg.backend.name} backend needs the {backend.needs} package, which is not "
                       f"installed for {sys.executable}: run scripts/setup.sh (it builds .venv-verl) or set "
                       "backend.python to an interpreter that has it")


class Recipe:
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
        self.remote = cfg.store_remote()  # the store on S3: self.store is its local mirror
        self.limits = batchmod.Limits(cfg.mode, cfg.group_size, cfg.batch_groups, cfg.max_inflight,
                                      cfg.max_staleness)
        self.stats = StepStats()
        self.tasks: list[dict[str, Any]] = []
        self.eval_tasks: list[dict[str, Any]] = []  # held out: evaluated, never trained
        self.eval_task: asyncio.Task | None = None  # the evaluation running now
        self.last_eval_step: int | None = None
        self.stopped: str | None = None  # why training ended (the final summary says it)
        self.groups: dict[str, Group] = {}
        self.ready: list[Group] = []
        self.recent_rewards: list[float] = []  # mean reward of the last steps (target_reward)
        self.ok_rollouts = 0  # rollouts that ended ok in this process
        self.failed_groups = 0  # groups whose every rollout failed, in this process (never trained)
        self.failed_groups_reported = 0  # of them, counted in a step's metrics already
        self.fatal: str | None = None  # set when the run cannot go on; train() raises it
        self.restarts = 0  # engine and proxy restarts in this process (cfg.restarts bounds them)
        self.trained_groups: set[str] = set()
        self.trained_samples = 0
        self.next_group = self.first_group_this_run = 0
        self.version = self.version_at_start = 0
        self.step = 0
        self.t0 = time.monotonic()
        self.proxy: ProxyGroup | None = None
        self.engine: Any = None
        self.backend: Any = None
        self.controller: Any = None
        self.tokenizer: Any = None
        self._wake = asyncio.Event()
        self._rollout_tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------------------------ setup
    def setup(self) -> None:
        from lgt.trainer.backends import checkpoints

        cfg = self.cfg
        self.prepare(new_run=not self.resume)
        model_dir = self.ensure_model()
        ckpt = checkpoints.latest_checkpoint(self.run_dir / "checkpoints") if self.resume else None
        backend_cls = entry(cfg.backend.name).load_class()
        if ckpt is not None:
            self.backend, extra = backend_cls.resume(ckpt, cfg.backend)
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
            self.backend = backend_cls.load(model_dir, cfg.backend)
            serve_dir = model_dir
        if self.resume:  # the run's record of its config changes once the backend took the config
            _write_json(self.run_dir / cfgmod.RUN_FILE, self.cfg.to_json())
        self.tokenizer = _decoder(model_dir)
        self.serve(serve_dir)

    def prepare(self, *, new_run: bool = False) -> None:
        """The tasks (training and held-out), the run directory, its store and (a new run's)
        config.json; a new run refuses a directory that holds one already. A resumed run's config.json
        is rewritten only once its checkpoint was loaded (:meth:`setup`): a resume that fails leaves
        the record as it was."""
        self.tasks, self.eval_tasks = validate(self.cfg, run_dir=self.run_dir if new_run else None)
        _quiet_transformers()
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.store.mkdir(parents=True, exist_ok=True)
        if self.remote is not None:
            self.remote.pull()  # what the bucket holds already (a resumed run, other replicas)
        if not self.resume:
            _write_json(self.run_dir / cfgmod.RUN_FILE, self.cfg.to_json())

    def serve(self, serve_dir: Path) -> None:
        """The vLLM engine on ``serve_dir``, lgt-proxy in front of it (or a running one), the rollout
        controller."""
        from lgt.trainer.rollout import controller as rollouts
        from lgt.trainer.serving import engine as enginemod

        cfg = self.cfg
        if cfg.engine.url:  # a running engine: it serves this run's weights from now on
            self.log(f"using the vLLM engine at {cfg.engine.url} (engine.url): loading {serve_dir.name} ...")
            self.engine = enginemod.Engine.attach(dataclasses.replace(cfg.engine, model=serve_dir))
            if self.backend is not None:
                self.backend.push_weights(self.engine)
            else:
                self.engine.update_weights(enginemod.checkpoint_tensors(serve_dir))
        else:
            self.log(f"starting the vLLM engine on {serve_dir.name} ...")
            self.engine = enginemod.Engine.start(dataclasses.replace(
                cfg.engine, model=serve_dir, log_path=self.run_dir / "logs" / "engine.log", seed=cfg.seed))
        if cfg.proxy.url:  # running replicas, one or several, on the run's store
            self.proxy = ProxyGroup([ProxyClient.connect(self.store, url, cfg.proxy.port, cfg.proxy.token)
                                     for url in cfg.proxy.url])
            self.proxy.resume(self.version)
        else:
            started = ProxyClient.start(
                self.remote.url if self.remote is not None else self.store, self.engine.url,
                log_path=self.run_dir / "logs" / "proxy.log",
                policy_version=self.version, port=cfg.proxy.port, control_port=cfg.proxy.control_port,
                command=list(cfg.proxy.command) if cfg.proxy.command else None,
                upstream_timeout=cfg.proxy.upstream_timeout_s, listen_host=cfg.proxy.listen_host)
            self.proxy = ProxyGroup([started])
        self.warm_up()
        self.next_group = self.first_free_group()
        if self.resume:
            self.recover_ready_groups()

        endpoints = [rollouts.ProxyEndpoint(store=self.store, port=p.port, host=p.host,
                                            control_port=int(p.control_url.rsplit(":", 1)[1]),
                                            control_token=p.token) for p in self.proxy.replicas]
        resources = None
        if cfg.resources:
            from lgt.trainer.rollout.resources import Resources
            resources = Resources(cfg.resources)
            resources.save(self.run_dir)
        self.controller = rollouts.RolloutController(cfg.agent, endpoints, self.store, self.run_dir,
                                                     cfg.max_inflight, batch_records=True,
                                                     resources=resources)

    def setup_eval(self, checkpoint: Path | None) -> None:
        """``lgt-train eval``: the engine serves ``checkpoint`` (or the config's model), no backend."""
        from lgt.trainer.backends import checkpoints

        self.prepare()
        if checkpoint is not None:
            self.step, extra, _ = checkpoints.read_state(checkpoint)
            self.version = int(extra.get("version", self.step))
            serve_dir = checkpoint
        else:
            serve_dir = self.ensure_model()
        self.serve(serve_dir)

    async def eval_once(self) -> evaluation.EvalResult:
        assert self.cfg.eval is not None
        self.t0 = time.monotonic()
        try:
            res = await evaluation.evaluate(self.cfg.eval, self.eval_tasks, self.controller.run,
                                            step=self.step, version=self.version)
            evaluation.append_row(self.run_dir, res.row(max(0.0, time.monotonic() - self.t0)))
            return res
        finally:
            await self.aclose()

    def ensure_model(self) -> Path:
        from lgt.trainer import models
        from lgt.trainer.demo import tiny

        m = self.cfg.model
        if m.make is not None:  # reuses the model when it was made with the same settings
            # the held-out tasks are never shown in the warm start either: eval measures the unseen
            exclude = sorted({str(t["question"]) for t in self.eval_tasks if "question" in t})
            budget = dict(seconds=m.make.seconds, steps=m.make.steps, seed=m.make.seed, exclude=exclude)
            made = tiny.is_made(m.path, preset=m.make.preset, warm_start_task=m.make.warm_start, **budget)
            if not made:
                size = f"{m.make.steps} steps" if m.make.steps else f"~{m.make.seconds:.0f} s"
                self.log(f"building the model {m.path} (preset {m.make.preset}, warm start "
                         f"{m.make.warm_start or 'none'}, {size}) ...")
            tiny.make_model(m.path, preset=m.make.preset, warm_start_task=m.make.warm_start,
                            progress=not made, **budget)
            info = models.check_model_dir(m.path, need_chat_template=True)
            info.check_context(self.cfg.engine.max_model_len)
        return m.path

    def warm_up(self) -> None:
        """One request straight to the engine, so the first rollouts do not pay its first-call cost."""
        import httpx

        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"{self.engine.url}/completions", trust_env=False, timeout=120,
                       json={"model": "policy", "prompt": "hello", "max_tokens": 4})

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
        while True:
            if self.step >= cfg.steps:
                self.stopped = f"step limit ({cfg.steps} steps)"
                break
            if time.monotonic() >= deadline:
                self.stopped = f"time limit ({cfg.max_minutes:g} min)"
                break
            if cfg.max_samples is not None and self.trained_samples >= cfg.max_samples:
                self.stopped = f"sample limit ({cfg.max_samples} samples)"
                break
            self.launch()
            while len(self.ready) < cfg.batch_groups or (cfg.mode == "sync" and self.unfinished_groups()) \
                    or self.evaluating:  # no update while an evaluation runs: one policy version
                if self.fatal:
                    raise RuntimeError(self.fatal)
                await self.keep_alive()
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=1.0)
                self.launch()
                self.refresh()
            batch, self.ready = batchmod.take_batch(self.ready, cfg.batch_groups)
            await self.update(batch)
            if cfg.eval is not None and cfg.eval.due(self.step):
                self.start_eval()
            mean = sum(self.recent_rewards) / TARGET_WINDOW  # recent_rewards holds at most that many
            if cfg.target_reward is not None and len(self.recent_rewards) == TARGET_WINDOW and \
                    mean >= cfg.target_reward:
                self.log(f"mean reward of the last {TARGET_WINDOW} steps {mean:.3f} "
                         f"reached the target {cfg.target_reward}")
                self.stopped = "reached the target"
                break

    # ------------------------------------------------------------------------------- restarts
    async def keep_alive(self, *, paused: bool = False) -> None:
        """Start again a vLLM engine that died, or a proxy this run started that died (at most
        ``cfg.restarts`` times in all; one more death ends the run with its error). The engine comes
        back on its port with the current policy's weights; the proxy on its ports and store (its
        write-ahead log recovered). Calls that were in flight failed: their agents' SDKs retry them,
        or the attempt fails and is retried; new calls are held while the engine starts."""
        from lgt.trainer.serving.engine import EngineError

        try:
            await asyncio.to_thread(self.engine.check_alive)  # a dead one's group is stopped: seconds
        except EngineError as e:
            if not self.engine.died:
                raise
            await self._restart("the vLLM engine", e, self._restart_engine, paused)
        try:
            self.proxy.check_alive()
        except ProxyError as e:
            await self._restart("lgt-proxy", e, self._restart_proxy, paused)

    async def _restart(self, what: str, err: Exception, restart: Callable[[bool], Any], paused: bool) -> None:
        first = str(err).splitlines()[0].split("; its log")[0]  # "… exited with code -9"
        if self.restarts >= self.cfg.restarts:
            raise RuntimeError(f"{first} — and the run has restarted its engine or proxy {self.restarts} "
                               f"times already (restarts: {self.cfg.restarts}); resume it with --resume "
                               "once the cause is fixed") from None
        self.restarts += 1
        self.log(f"{first}; starting it again at policy version {self.version} "
                 f"(restart {self.restarts} of {self.cfg.restarts})")
        t = time.monotonic()
        await restart(paused)
        self.log(f"{what} is back after {time.monotonic() - t:.1f} s")

    async def _restart_engine(self, paused: bool) -> None:
        from lgt.trainer.serving import engine as enginemod

        old = self.engine
        if old.attached:
            raise RuntimeError(f"{old.base_url} (engine.url) no longer answers, and this run did not start "
                               "it: start it again, then continue with --resume")
        if not paused:  # hold new calls while the engine starts (in-flight ones have failed)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.proxy.pause, 10)
        await asyncio.to_thread(old.stop, 5)  # what is left of its process group, and its temporary folder
        self.engine = await asyncio.to_thread(enginemod.Engine.start,
                                              dataclasses.replace(old.cfg, port=old.port))
        if self.version != self.version_at_start:  # it serves the weights the run started from
            await asyncio.to_thread(self.backend.push_weights, self.engine)
        if not paused:
            await asyncio.to_thread(self.proxy.resume, self.version)

    async def _restart_proxy(self, paused: bool) -> None:
        restarted = await asyncio.to_thread(self.proxy.restart_dead, self.version)
        if not restarted:  # the error was not a replica this run started dying: nothing to restart
            raise RuntimeError("lgt-proxy stopped answering and it was not started by this run")
        if paused:
            await asyncio.to_thread(self.proxy.pause, 10)

    async def _alive(self, fn: Callable[[], Any], *, paused: bool) -> Any:
        """``fn()`` in a thread; when it fails because the engine or proxy died, both are checked (and
        restarted) and it runs once more."""
        from lgt.trainer.serving.engine import EngineError

        try:
            return await asyncio.to_thread(fn)
        except (EngineError, ProxyError):
            if not (self.engine.died or any(r.died for r in self.proxy.replicas)):
                raise
        await self.keep_alive(paused=paused)
        return await asyncio.to_thread(fn)

    # ------------------------------------------------------------------------------------- eval
    @property
    def evaluating(self) -> bool:
        return self.eval_task is not None and not self.eval_task.done()

    def start_eval(self) -> None:
        """Evaluate the current policy on the held-out tasks, beside the training rollouts (the next
        update waits for it)."""
        if self.evaluating or self.last_eval_step == self.step:
            return
        self.last_eval_step = self.step
        self.eval_task = asyncio.get_running_loop().create_task(self.run_eval(self.step, self.version))

    async def run_eval(self, step: int, version: int) -> None:
        assert self.cfg.eval is not None
        try:
            res = await evaluation.evaluate(self.cfg.eval, self.eval_tasks, self.controller.run,
                                            step=step, version=version)
            evaluation.append_row(self.run_dir, res.row(max(0.0, time.monotonic() - self.t0)))
            self.log(res.line())
        except Exception as e:  # noqa: BLE001 - an evaluation that cannot run must not end training
            self.log(f"the evaluation at step {step} could not run: {e}")
        finally:
            self._wake.set()

    async def final_eval(self) -> None:
        """Training is over: its unfinished rollouts are stopped and the final policy evaluated (unless
        it just was)."""
        if self.cfg.eval is None:
            return
        running = list(self._rollout_tasks)
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        if self.eval_task is not None:
            await self.eval_task
        self.start_eval()
        if self.eval_task is not None:
            await self.eval_task

    def unfinished_groups(self) -> int:
        return sum(1 for g in self.groups.values() if not g.done)

    def launch(self) -> None:
        """Start groups while admission control allows (:func:`lgt.trainer.run.admission.may_launch`)."""
        while batchmod.may_launch(
                self.limits, running_rollouts=sum(g.pending for g in self.groups.values()),
                unfinished_groups=self.unfinished_groups(), ready_groups=len(self.ready),
                # a group whose every rollout failed is never trained: it leaves the staleness
                # window, or a burst of failures (an engine or proxy restart) would stop all launches
                launched_this_run=self.next_group - self.first_group_this_run - self.failed_groups,
                updates_this_run=self.version - self.version_at_start):
            self.start_group()

    def start_group(self) -> None:
        task = self.tasks[batchmod.task_index(self.cfg.seed, len(self.tasks), self.next_group)]
        g = Group(index=self.next_group, task=task, version=self.version, pending=self.cfg.group_size)
        self.next_group += 1
        self.groups[g.group_id] = g
        for k in range(self.cfg.group_size):
            t = asyncio.get_running_loop().create_task(self.one_rollout(g, k))
            self._rollout_tasks.add(t)
            t.add_done_callback(self._rollout_tasks.discard)

    async def adopt_jobs(self) -> None:
        """runner: kubernetes, on --resume: the groups whose Jobs outlived the old controller are
        finished — each rollout from the attempt its Job runs (adopted: waited for, or collected if it
        ended meanwhile, never made twice), or the next attempt, or not at all when it had ended."""
        jobs = await self.controller.existing_jobs()
        by_group: dict[str, list[dict[str, str]]] = {}
        for j in jobs:
            if j.get("role", "agent") != "agent":
                continue  # an evaluator Job: its rollout's attempt is run (or adopted) again with it
            if j.get("group", "").startswith("g") and j["group"][1:].isdigit():
                by_group.setdefault(j["group"], []).append(j)
        if not by_group:
            return
        con = connect(self.store)
        try:
            recorded: dict[str, dict[int, str]] = {}
            for rid, attempt, status in con.execute(
                    "SELECT rollout_id, attempt, status FROM rollouts_log WHERE group_id IN "
                    f"({', '.join('?' * len(by_group))})", list(by_group)).fetchall():
                recorded.setdefault(rid, {})[attempt] = status
        finally:
            con.close()
        by_id = {t["task_id"]: t for t in self.tasks}
        adopted = 0
        for gid, group_jobs in sorted(by_group.items()):
            task = by_id.get(group_jobs[0].get("task", ""))
            if gid in self.trained_groups or gid in self.groups or task is None:
                continue
            g = Group(index=int(gid[1:]), task=task, version=int(group_jobs[0].get("step") or 0))
            self.next_group = max(self.next_group, g.index + 1)
            todo = []
            for k in range(self.cfg.group_size):
                rid = g.rollout_id(k)
                rec = recorded.get(rid, {})
                job_attempts = [int(j["attempt"]) for j in group_jobs if j.get("rollout") == rid]
                last = max(rec, default=-1)
                if job_attempts and max(job_attempts) > last:
                    todo.append((k, max(job_attempts)))  # its Job: adopted
                    adopted += 1
                elif rec and (rec[last] == "ok" or last >= self.cfg.agent.retries):
                    g.recovered_ok += rec[last] == "ok"
                else:
                    todo.append((k, last + 1))
            self.groups[gid] = g
            g.pending = len(todo)
            if not todo:
                self.groups.pop(gid)
                if g.recovered_ok:
                    self.ready.append(g)
                continue
            for k, first in todo:
                t = asyncio.get_running_loop().create_task(self.one_rollout(g, k, first))
                self._rollout_tasks.add(t)
                t.add_done_callback(self._rollout_tasks.discard)
        self.log(f"resumed {len(by_group)} group(s) whose Jobs outlived the last run: "
                 f"{adopted} Job(s) adopted")

    async def one_rollout(self, g: Group, k: int, first_attempt: int = 0) -> None:
        try:
            res = await self.controller.run(g.task, g.rollout_id(k), g.group_id, g.version,
                                            first_attempt=first_attempt)
        except Exception as e:  # noqa: BLE001 - one rollout's crash must not end the run
            self.log(f"rollout {g.rollout_id(k)} could not run: {e}")
            res = None
        g.results.append(res)
        g.pending -= 1
        if res is not None:
            self.ok_rollouts += res.ok
            with open(self.run_dir / "rollouts.jsonl", "a") as f:
                f.write(json.dumps(_result_row(res), default=str) + "\n")
        if g.done:
            if g.recovered_ok or any(r is not None and r.status == "ok" for r in g.results):
                self.ready.append(g)
            else:
                self.log(f"group {g.group_id}: every rollout failed; see {self.run_dir / 'rollouts'}")
                self.groups.pop(g.group_id, None)
                self.failed_groups += 1
                if self.fatal is None and self.ok_rollouts == 0 and self.failed_groups >= FAIL_FAST_GROUPS:
                    self.fatal = agent_broken(self.failed_groups, [r for r in g.results if r is not None])
        self.refresh()
        self._wake.set()

    async def update(self, batch: list[Group]) -> None:
        """One training step on ``batch`` (the module docstring's steps 2-5)."""
        cfg = self.cfg
        t_update = time.monotonic()
        perf: dict[str, float] = {}

        async def timed(name: str, fn: Callable[..., Any], *args: Any, paused: bool | None = None) -> Any:
            t = time.monotonic()
            if paused is None:
                out = await asyncio.to_thread(fn, *args)
            else:  # the engine or proxy dying under it is restarted (keep_alive), then fn runs again
                out = await self._alive(lambda: fn(*args), paused=paused)
            perf[f"perf/{name}_s"] = round(time.monotonic() - t, 4)
            return out

        await self.keep_alive()  # an engine that died since the last look is back before the pause
        # the batch's groups are finished: their samples are built while the other rollouts still run
        await timed("record", self.controller.flush_records)
        await timed("flush", self.proxy.flush, paused=False)
        if self.remote is not None:  # the rollouts just recorded up; other replicas' calls down
            await timed("store_sync", lambda: (self.remote.push_all(), self.remote.pull()))
        prepared = await timed("samples", self.samples_for, batch)
        t_paused = time.monotonic()
        metrics: dict[str, float] = {}
        for name in ("train", "sync", "sleep", "wake"):
            perf[f"perf/{name}_s"] = 0.0
        # new calls are held from here; the calls in flight finish on the current weights (training
        # beside the drain was measured slower on CPU: the backend's threads and the engine's contend)
        pause = await timed("pause", self.proxy.pause, paused=True)
        if not pause.get("drained", True):
            self.log(undrained(pause, self.version))
        if self.crash_at_step is not None and self.step + 1 == self.crash_at_step:
            os.kill(os.getpid(), signal.SIGKILL)  # fault injection (tests): die mid-step
        if prepared.samples.num_rows:
            asleep = self.engine.sleeps_on_update
            if asleep:
                await timed("sleep", self.engine.sleep)
            metrics = await timed("train", self.train_on, prepared.samples)
            if asleep:
                await timed("wake", self.engine.wake_up)
            await timed("sync", lambda: self.backend.push_weights(self.engine), paused=True)  # a new engine
        self.version += 1
        self.step += 1
        for g in batch:
            self.trained_groups.add(g.group_id)
            self.groups.pop(g.group_id, None)
        self.trained_samples += prepared.samples.num_rows
        if self.step % cfg.checkpoint_every == 0 or self.step >= cfg.steps:
            await timed("checkpoint", self.save_checkpoint)
        await timed("resume", self.proxy.resume, self.version, paused=True)
        results = [r for g in batch for r in g.results if r is not None]
        groups_failed, self.failed_groups_reported = self.failed_groups - self.failed_groups_reported, \
            self.failed_groups
        info = {"groups": len(batch), **prepared.metrics(),
                "rollout/failed": sum(1 for r in results if r.status == "failed"),
                "rollout/timeout": sum(1 for r in results if r.status == "timeout"),
                "rollout/retried": sum(1 for r in results if r.attempt > 0),
                "rollout/groups_failed": groups_failed,  # since the last step: none of its rollouts ok
                "rollout/duration_mean": round(sum(r.seconds for r in results) / max(len(results), 1), 3),
                "sample_ids": prepared.samples["sample_id"].to_pylist()}
        row = {
            "step": self.step, "version": self.version, "time_s": round(time.monotonic() - self.t0, 3),
            "mode": cfg.mode, "backend": cfg.backend.name, **info,
            "rollout/running": sum(g.pending for g in self.groups.values()),
            "perf/drain_s": pause.get("drain_seconds", 0.0),
            "perf/in_flight_at_pause": pause.get("in_flight_at_pause", 0),
            "perf/undrained_calls": 0 if pause.get("drained", True) else pause.get("in_flight", 0),
            **perf, "perf/update_s": round(time.monotonic() - t_update, 4),
            "perf/paused_s": round(time.monotonic() - t_paused, 4),
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
                     f"samples {info['samples']}  staleness≤{s.staleness}  drain {s.drain_s:.2f}s  "
                     f"train {perf['perf/train_s']:.2f}s  sync {perf['perf/sync_s']:.2f}s")

    def samples_for(self, batch: list[Group]) -> batchmod.Prepared:
        """The batch's samples from the store, ready for the loss (:func:`~.run.admission.prepare`)."""
        cfg = self.cfg
        samples = build_group_samples(self.store, [g.group_id for g in batch], mode=cfg.algorithm.sample_mode,
                                      tokenizer=self.tokenizer).samples
        return batchmod.prepare(samples, self.version, cfg.algorithm, cfg.max_staleness)

    def train_on(self, samples: pa.Table) -> dict[str, float]:
        """``backend.updates_per_step`` optimizer steps on disjoint shares of the batch's groups (each
        share weighted so its rollouts count once); metrics averaged over them."""
        runs = [self.backend.train_step(share)
                for share in batchmod.shares(samples, self.cfg.backend.updates_per_step, self.cfg.algorithm)]
        if len(runs) == 1:
            return runs[0]
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
        if self.backend is not None:
            with contextlib.suppress(Exception):
                self.backend.close()

    # ------------------------------------------------------------------------------ entry point
    async def main(self) -> None:
        self.t0 = time.monotonic()
        self.first_group_this_run = self.next_group
        self.version_at_start = self.version
        try:
            if self.resume and self.cfg.agent.runner == "kubernetes":
                await self.adopt_jobs()
            if self.cfg.eval is not None:
                done = {r.get("step") for r in read_jsonl(self.run_dir / evaluation.EVAL_FILE)}
                self.last_eval_step = self.step if self.step in done else None
                self.start_eval()  # before the first update (or the first since a resume), on its own
                if self.eval_task is not None:
                    await self.eval_task
            self.t0 = time.monotonic()  # time_s counts training: the engine's start and that eval excluded
            await self.train()
            await self.final_eval()
        finally:
            await self.aclose()


def run(cfg: RunConfig, *, run_dir: Path | None = None, resume: bool = False,
        display: Callable[[StepStats, str], None] | None = None,
        crash_at_step: int | None = None) -> Path:
    """Run ``cfg`` to the end; returns the run directory (metrics, checkpoints, plots, report)."""
    run_dir = (run_dir or cfg.run_dir or cfgmod.default_run_dir(cfg)).resolve()
    if crash_at_step is None and os.environ.get("LGT_FAULT_CRASH_AT_STEP"):  # fault injection (tests)
        crash_at_step = int(os.environ["LGT_FAULT_CRASH_AT_STEP"])
    r = Recipe(cfg, run_dir, resume=resume, display=display, crash_at_step=crash_at_step)
    set_up = False
    try:
        r.setup()
        set_up = True
        asyncio.run(r.main())
    except BaseException:
        r.stopped = r.stopped or "interrupted"
        raise
    finally:
        r.cleanup()
        if set_up or not resume:  # a resume that failed to set up leaves the run's record as it was
            with contextlib.suppress(Exception):
                finish(run_dir, r.store, stopped=r.stopped)
    return run_dir


def evaluate(cfg: RunConfig, *, checkpoint: Path | None = None, run_dir: Path | None = None,
             display: Callable[[StepStats, str], None] | None = None) -> tuple[Path, evaluation.EvalResult]:
    """``lgt-train eval``: one held-out evaluation of ``checkpoint`` (a run's ``checkpoints/step-N``)
    or, without one, of the config's model; eval.jsonl and the store's eval rollouts in ``run_dir``."""
    if cfg.eval is None:
        raise ConfigError("the run config has no eval section to say which tasks are held out: add e.g. "
                          "eval: {split: 0.2} or eval: {tasks: heldout.jsonl}")
    if checkpoint is not None:
        from lgt.trainer.backends.checkpoints import read_state
        read_state(checkpoint)  # not a finished, readable checkpoint: one sentence, before anything starts
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = (run_dir or Path.cwd() / "runs" / f"{cfg.name}-eval-{stamp}").resolve()
    r = Recipe(cfg, run_dir, display=display)
    try:
        r.setup_eval(checkpoint)
        return run_dir, asyncio.run(r.eval_once())
    finally:
        r.cleanup()


def optimize_prompt(cfg: RunConfig, *, run_dir: Path | None = None, resume: bool = False,
                    checkpoint: Path | None = None,
                    display: Callable[[StepStats, str], None] | None = None) -> tuple[Path, dict[str, Any]]:
    """``lgt-train apo``: the run's ``apo.resource`` optimised with real rollouts (:mod:`~.apo.optimize`)
    on the config's model or ``checkpoint`` (an RL run's checkpoints/step-N); the best candidate, and the
    run directory (``apo/`` in it)."""
    from lgt.trainer.apo import optimize as apo

    if cfg.apo is None:
        raise ConfigError("the run config has no apo section: add e.g. apo: {resource: system_prompt}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = (run_dir or Path.cwd() / "runs" / f"{cfg.name}-apo-{stamp}").resolve()
    r = Recipe(cfg, run_dir, resume=resume, display=display)
    try:
        r.setup_eval(checkpoint)
        train = list(r.tasks)
        val = list(r.eval_tasks)[:cfg.apo.val_size] or train[-cfg.apo.val_size:]
        if not r.eval_tasks:  # no held-out split: the last val_size tasks validate, the rest train
            train = train[:-cfg.apo.val_size] or train
        critic = apo.Critic(cfg.apo.critic, f"{r.engine.url}")
        run = apo.make_runner(r.controller, r.store, cfg.apo.samples)

        async def go() -> dict[str, Any]:
            try:
                return await apo.optimize(cfg.apo, r.controller.resources, run, train, val, critic, run_dir,
                                          log=r.log)
            finally:
                await r.aclose()

        best = asyncio.run(go())
        apo.plot(run_dir)
        apo.write_report(run_dir)
        return run_dir, {**best, "critic_calls": critic.calls, "critic_failures": critic.failures}
    finally:
        r.cleanup()


def metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics.jsonl rows (a last line cut off by a crash is left out)."""
    return read_jsonl(run_dir / "metrics.jsonl")


def undrained(pause: Mapping[str, Any], version: int) -> str:
    """What a pause that timed out says: the update goes on without the calls still running."""
    n = pause.get("in_flight", 0)
    line = (f"{n} LLM call{'s' if n != 1 else ''} still running after {pause.get('drain_seconds', 0):.0f} s "
            f"of the pause: updating without waiting for {'them' if n != 1 else 'it'} (recorded at policy "
            f"version {version}, though tokens made after the weight sync come from the next)")
    oldest = pause.get("oldest_in_flight")
    if oldest:
        doing = "reading its answer" if oldest.get("answer_begun") else "with no answer yet"
        line += (f"; the oldest, of rollout {oldest['rollout_id']} attempt {oldest['attempt']}, has run "
                 f"{oldest['seconds']:.0f} s {doing}")
    return line


def agent_broken(n_groups: int, results: list[Any]) -> str:
    """The sentence that ends a run whose agent has not once finished: its last attempt's error (the
    controller's, which names the last line the agent wrote to stderr)."""
    last = results[-1] if results else None
    said = "" if last is None else \
        f"; its last attempt: {last.error or f'status {last.status}'} ({last.stderr_path})"
    return f"the agent failed in every rollout of the first {n_groups} groups, so it does not run here{said}"


def finish(run_dir: Path, store: Path | None = None, stopped: str | None = None) -> None:
    """summary.json, metrics.csv, plots and the report page from what the run wrote."""
    from lgt.store.report import write_report
    from lgt.trainer.report import plots, summary

    summary.write(run_dir, stopped=stopped)
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
