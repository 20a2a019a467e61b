"""``lgt-train run``: the training recipe, read top to bottom — setup, train, save_checkpoint, cleanup.

The run's config was checked before (:mod:`lgt.trainer.preflight`: everything, before anything starts);
the recipe takes the tasks that check read.

**setup** builds each component once, from its own config section: the model (made locally when asked),
the backend (:data:`lgt.trainer.backends.base.BACKENDS`: load, or resume from the run's last checkpoint),
the policy served (:class:`~lgt.trainer.policy.Policy`, as ``eval`` and ``apo`` serve it: the
:class:`~lgt.trainer.run.supervisor.Supervisor` — the vLLM engine and ``lgt-proxy`` in front of it, or
running ones; their restarts — and the rollout controller that launches the unmodified agent once per
rollout), the :class:`~lgt.trainer.run.scheduler.GroupScheduler` (which groups run; on a resume, what
was left), the :class:`~lgt.trainer.run.evaluation.Evaluator` (held-out tasks) and the
:class:`~lgt.trainer.run.runlog.RunLog` (metrics, the display, the report); with ``algorithm.estimator:
opd``, the teacher (:class:`~lgt.trainer.distill.onpolicy.Distillation`: a second engine, made and
started here, or one at a URL; without one, :class:`~lgt.trainer.distill.onpolicy.NoTeacher` leaves the
samples as they are). Nothing after setup reads the run config.

**train**, each step:
  1. enough complete groups are ready (sync: the whole batch launched for this step; async: the
     ``batch_groups`` oldest finished groups, while other rollouts keep running) — admission control
     and the batch are :mod:`lgt.trainer.run.admission`'s pure functions;
  2. the batch's samples from the store (merged per rollout), while the other rollouts still run
     (the batch's groups are finished: nothing of theirs changes); stale groups dropped; advantages
     and loss weights (:mod:`lgt.trainer.rl.algorithm`); with a teacher, its logprob of every token
     and the per-token advantages (:mod:`lgt.trainer.distill.opd`), still while the rollouts run;
  3. ``POST /pause`` to the proxy: new model calls are held, in-flight ones drain (seconds recorded);
  4. on a GPU the engine sleeps (its memory freed for the update); the backend trains; the engine
     wakes and gets the new weights without a restart (:mod:`lgt.trainer.serving.sync`: every weight,
     ``backend.named_weights``; or, training LoRA, the new adapter loaded under ``<served>-v<version>``
     and, once the pause drained, the older ones unloaded);
  5. a checkpoint (weights, optimizer, the trained groups) before ``POST /resume`` with the new policy
     version (and the adapter's name); held calls continue on the new weights; the step's metrics row.

**cleanup** stops the proxy and the engine it started, cancels unfinished rollouts, closes the backend;
the summary, metrics.csv, plots and report pages are written however the run ended.

**Several policies** (a ``policies`` section of two or more, docs/policies.md): one torch backend per
policy, each a LoRA adapter on the shared base model with its own optimizer (its settings the run's
``backend`` with the policy's own ``backend`` keys over them); each step splits the batch's samples by
policy (:func:`~lgt.trainer.run.admission.prepare_policies`: each policy's advantages within its own
table), trains each policy with samples on them alone (one with none does not update), loads every
policy's adapter as ``<policy>-v<version>`` (one run-wide version: the step) and resumes the proxy with
each policy's served model; checkpoints under ``checkpoints/policies/<policy>/step-N``, metrics as
``policy/<policy>/<name>`` beside the step's mean.

Departures from the published method, on purpose:
- Admission control (async) bounds staleness: a group is launched only while every group launched so
  far could be trained within ``max_staleness`` versions; staleness is then bounded per token (each
  token's own policy version): a token staler than that when its group's turn comes is trained with its
  truncated importance weight (``staleness: truncate``, the default: nothing generated is thrown away),
  or left out of the loss (``mask``, ``rollout/tokens_stale_masked``), or, as before per-token versions,
  its whole group dropped (``group``).
- Failed and timed-out rollouts are retried by the controller; exhausted ones leave their group (they
  are not trained as reward 0).
- The loss corrects the engine/trainer mismatch with truncated importance weights against the recorded
  behaviour logprobs (``algorithm.is_mode``); logprobs the proxy could not record are recomputed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from lgt.store.samples import build_group_samples
from lgt.trainer import config as cfgmod
from lgt.trainer.backends.base import entry
from lgt.trainer.backends.checkpoints import prune_checkpoints
from lgt.trainer.config import RunConfig
from lgt.trainer.distill.onpolicy import Distillation, NoTeacher
from lgt.trainer.policy import Policy
from lgt.trainer.preflight import Tasks
from lgt.trainer.run import admission, evaluation
from lgt.trainer.run.progress import Progress
from lgt.trainer.run.runlog import Display, finish, step_row, write_json
from lgt.trainer.run.scheduler import Group, GroupScheduler
from lgt.trainer.run.stopping import TARGET_WINDOW, StopRules
from lgt.trainer.run.supervisor import Supervisor, undrained


class Recipe:
    """One training run (see the module docstring). ``run_dir`` holds everything it writes."""

    def __init__(self, cfg: RunConfig, tasks: Tasks, run_dir: Path, *, resume: bool = False,
                 display: Display | None = None) -> None:
        self.cfg = cfg  # read by setup only
        self.run_dir = run_dir
        self.resume = resume
        self.policy = Policy(cfg, tasks, run_dir, resume=resume, display=display)
        self.store, self.remote, self.runlog = self.policy.store, self.policy.remote, self.policy.runlog
        self.progress = self.policy.progress
        self.stopped: str | None = None  # why training ended (the final summary says it)
        self.backend: Any = None  # the backend (with several policies: the first policy's)
        self.backends: dict[str, Any] = {}  # several policies: each policy's backend, in order
        self.supervisor: Supervisor | None = None
        self.controller: Any = None
        self.scheduler: GroupScheduler | None = None
        self.teacher: Distillation | NoTeacher = NoTeacher()  # on-policy distillation's teacher, or none

    # ------------------------------------------------------------------------------------ setup
    def setup(self) -> None:
        from lgt.trainer.backends import checkpoints

        cfg, policy = self.cfg, self.policy
        policy.prepare()
        model_dir = policy.ensure_model()
        ckpt = checkpoints.latest_checkpoint(self.run_dir / "checkpoints") if self.resume else None
        backend_cls = entry(cfg.backend.name).load_class()
        serve_dirs: dict[str, Path | None] = {}
        if cfgmod.several_policies(cfg):
            serve_dirs = self.load_policies(backend_cls, model_dir)
        elif ckpt is not None:
            self.backend, extra = backend_cls.resume(ckpt, cfg.backend)
            self.progress = policy.progress = Progress.from_checkpoint(extra)
            self.runlog.restore(self.progress.step)
            self.runlog.log(f"resuming from {ckpt.name}: step {self.progress.step}, "
                            f"policy version {self.progress.version}")
        else:
            self.backend = backend_cls.load(model_dir, cfg.backend)
        if getattr(self.backend, "summary", None):  # its device, what it computes in and why, what it trains
            self.runlog.log(self.backend.summary)
        if self.resume:  # the run's record of its config changes once the backend took the config
            write_json(self.run_dir / cfgmod.RUN_FILE, cfg.to_json())
        self.tokenizer = _decoder(model_dir)
        # a policy on an engine of its own whose tokenizer is not the base model's realigns with its own
        self.tokenizers = {name: _decoder(own.model.path) for name, own in cfgmod.own_engines(cfg).items()
                           if _tokenizer_text(own.model.path) != _tokenizer_text(model_dir)}
        self.teacher = policy.ensure_teacher(model_dir, self.backend)  # made, checked before any engine
        if self.backends:
            policy.serve_policies(self.backends, model_dir, serve_dirs)
        else:
            policy.serve_backend(self.backend, model_dir, ckpt)
        self.supervisor, self.controller = policy.supervisor, policy.controller
        self.teacher.start()  # the teacher's engine, once the student's runs
        self.scheduler = GroupScheduler(
            self.controller, self.store, policy.tasks,
            admission.Limits(cfg.mode, cfg.group_size, cfg.batch_groups, cfg.max_inflight, cfg.max_staleness),
            seed=cfg.seed, retries=cfg.agent.retries, progress=self.progress,
            rollouts_dir=self.run_dir / "rollouts", log=self.runlog.log, record=self.runlog.rollout,
            refresh=self.runlog.refresh, groups_left=self.groups_left)
        self.scheduler.recover(resume=self.resume)
        self.runlog.follow(self.scheduler.counts)
        self.evaluator = evaluation.Evaluator(cfg.eval, policy.eval_tasks, self.controller.run, self.run_dir,
                                              log=self.runlog.log, elapsed=self.runlog.elapsed,
                                              on_done=self.scheduler.wake, record=self.runlog.eval)
        # what the steps need from the config, and nothing more
        self.adopt_jobs = self.resume and cfg.agent.runner == "kubernetes"
        self.stop_rules = StopRules(cfg.steps, cfg.max_minutes, cfg.max_samples, cfg.target_reward)
        self.algorithm, self.max_staleness, self.staleness = cfg.algorithm, cfg.max_staleness, cfg.staleness
        self.updates_per_step, self.checkpoint_every = cfg.backend.updates_per_step, cfg.checkpoint_every
        self.keep_checkpoints = cfg.keep_checkpoints
        self.columns = {"mode": cfg.mode, "backend": cfg.backend.name}  # in every metrics row
        # last: nothing after it fails, so a tracker run that began is always ended (run's finally)
        self.runlog.start_trackers(cfg.to_json(), resume_step=self.progress.step if self.resume else None)

    def groups_left(self) -> int:
        """How many more groups this run trains by its step and sample limits (with a sample limit an
        estimate: the samples a trained group gave so far, ``group_size`` before any was trained;
        asked again at every launch, so a group that gave fewer only lets one more start later)."""
        p, limits = self.progress, self.scheduler.limits
        per_group = p.trained_samples / len(p.trained_groups) if p.trained_groups else limits.group_size
        return self.stop_rules.groups_left(step=p.step, samples=p.trained_samples,
                                           batch_groups=limits.batch_groups, samples_per_group=per_group)

    # ------------------------------------------------------------------------------------ train
    async def main(self) -> None:
        """Jobs adopted (a resumed run on Kubernetes), the first evaluation, training, the last one."""
        scheduler, evaluator, progress = self.scheduler, self.evaluator, self.progress
        self.runlog.restart_clock()
        scheduler.begin()
        progress.version_at_start = progress.version
        try:
            if self.adopt_jobs:
                await scheduler.adopt_jobs()
            evaluator.resume(progress.step)
            evaluator.start(progress.step, progress.version)  # before the first update, on its own
            await evaluator.wait()
            self.runlog.restart_clock()  # time_s counts training: the engine's start and that eval excluded
            await self.train()
            if evaluator.enabled:  # the unfinished rollouts stopped, the final policy evaluated
                await scheduler.stop_rollouts()
                await evaluator.final(progress.step, progress.version)
        finally:
            await scheduler.aclose()

    async def train(self) -> None:
        scheduler, runlog, progress = self.scheduler, self.runlog, self.progress
        while True:
            self.stopped = self.stop_rules.limit(step=progress.step, minutes=runlog.elapsed() / 60,
                                                 samples=progress.trained_samples)
            if self.stopped:
                return
            scheduler.launch()
            # no update while an evaluation runs: its calls are all at one policy version
            while not scheduler.batch_ready() or self.evaluator.running:
                if scheduler.fatal:
                    raise RuntimeError(scheduler.fatal)
                await self.supervisor.keep_alive()
                await scheduler.wait()
                scheduler.launch()
                runlog.refresh()
            await self.step(scheduler.take_batch())
            if self.evaluator.due(progress.step):
                self.evaluator.start(progress.step, progress.version)
            mean = self.stop_rules.target(runlog.recent_rewards)
            if mean is not None:
                runlog.log(f"mean reward of the last {TARGET_WINDOW} steps {mean:.3f} "
                           f"reached the target {self.stop_rules.target_reward}")
                self.stopped = "reached the target"
                return

    async def step(self, batch: list[Group]) -> None:
        """One training step on ``batch``: samples → pause → train → sync → checkpoint → resume → log."""
        sup, progress, perf = self.supervisor, self.progress, {}
        t_step = time.monotonic()

        async def timed(name: str, fn: Callable[..., Any], *args: Any, paused: bool | None = None) -> Any:
            t = time.monotonic()
            if paused is None:
                out = await asyncio.to_thread(fn, *args)
            else:  # the engine or proxy dying under it is restarted, then fn runs again
                out = await sup.alive(lambda: fn(*args), paused=paused)
            perf[f"perf/{name}_s"] = round(time.monotonic() - t, 4)
            return out

        await sup.keep_alive()  # an engine that died since the last look is back before the pause
        for engine in self.policy.policy_engines.values():
            await asyncio.to_thread(engine.keep_alive)
        # the batch's groups are finished: their samples are built while the other rollouts still run
        await timed("record", self.controller.flush_records)
        await timed("flush", sup.proxy.flush, paused=False)
        await self.remote.sync(timed)  # a store on S3: the rollouts just recorded up, other replicas' down
        prepared, per_policy = await timed("samples", self.samples_for, batch)
        prepared, distill = await self.teacher.apply(prepared, timed)  # OPD, while the rollouts still run
        t_paused, metrics = time.monotonic(), {}
        perf.update({f"perf/{name}_s": 0.0 for name in ("train", "sync", "sleep", "wake")})
        # new calls are held from here; the calls in flight finish on the current weights (training
        # beside the drain was measured slower on CPU: the backend's threads and the engine's contend)
        pause = await timed("pause", sup.proxy.pause, paused=True)
        if not pause.get("drained", True):
            self.runlog.log(undrained(pause, progress.version))
        if prepared.samples.num_rows:
            asleep = sup.engine.sleeps_on_update
            if asleep:
                await timed("sleep", sup.engine.sleep)
            if self.backends:
                metrics = await timed("train", self.train_policies, per_policy)
            else:
                metrics = await timed("train", self.train_on, prepared.samples)
            if asleep:
                await timed("wake", sup.engine.wake_up)
            drained = pause.get("drained", True)
            await timed("sync", lambda: sup.push(progress.version + 1, drained=drained),
                        paused=True)  # a new engine
            if self.policy.policy_engines:  # the policies on engines of their own that trained
                await timed("sync_policies", self.push_policy_engines, metrics)
        progress.trained([g.group_id for g in batch], prepared.samples.num_rows)
        self.scheduler.trained(batch)
        if progress.step % self.checkpoint_every == 0 or progress.step >= self.stop_rules.steps:
            await timed("checkpoint", self.save_checkpoint)
        await timed("resume", lambda: sup.proxy.resume(progress.version, sup.served_model, sup.served),
                    paused=True)
        self.runlog.trained(progress.step, progress.version, prepared.samples)
        self.runlog.step(step_row(
            step=progress.step, version=progress.version, time_s=self.runlog.elapsed(), columns=self.columns,
            groups=len(batch), prepared=prepared.metrics(),
            results=[r for g in batch for r in g.results if r is not None],
            groups_failed=self.scheduler.failed_since_last(),
            sample_ids=prepared.samples["sample_id"].to_pylist(), running=self.scheduler.running,
            pause=pause, perf=perf, update_s=time.monotonic() - t_step, paused_s=time.monotonic() - t_paused,
            metrics={**distill, **metrics}))

    def samples_for(self, batch: list[Group]) -> tuple[admission.Prepared, dict[str, admission.Prepared]]:
        """The batch's samples from the store, ready for the loss (:func:`~.run.admission.prepare`), and,
        with several policies, each policy's (:func:`~.run.admission.prepare_policies`; else empty)."""
        groups, mode = [g.group_id for g in batch], self.algorithm.sample_mode
        samples = build_group_samples(self.store, groups, mode=mode, tokenizer=self.tokenizer).samples
        if mode == "realign" and self.tokenizers:  # those policies' samples decoded by their own tokenizer
            theirs = pc.is_in(samples["policy"], value_set=pa.array(list(self.tokenizers), pa.string()))
            parts = [samples.filter(pc.invert(theirs))]
            for name, tokenizer in self.tokenizers.items():
                own = build_group_samples(self.store, groups, mode=mode, tokenizer=tokenizer).samples
                parts.append(own.filter(pc.equal(own["policy"], name)))
            samples = pa.concat_tables(parts)
        if self.backends:
            return admission.prepare_policies(samples, list(self.backends), self.progress.version,
                                              self.algorithm, self.max_staleness, self.staleness)
        return admission.prepare(samples, self.progress.version, self.algorithm, self.max_staleness,
                                 self.staleness), {}

    def train_on(self, samples: pa.Table, backend: Any = None) -> dict[str, float]:
        """``backend.updates_per_step`` optimizer steps on disjoint shares of the batch's groups (each
        share weighted so its rollouts count once); metrics averaged over them. ``backend``: the run's
        unless given (a policy's)."""
        backend = backend or self.backend
        runs = [backend.train_step(share)
                for share in admission.shares(samples, self.updates_per_step, self.algorithm)]
        return _mean(runs)

    def train_policies(self, batches: dict[str, admission.Prepared]) -> dict[str, float]:
        """Each policy's backend trained on its own samples (a policy with none is not updated): its
        metrics as ``policy/<name>/<metric>`` (with its ``samples`` and ``rollout/reward_mean``), and
        the mean over the policies trained under the plain names."""
        out: dict[str, float] = {}
        runs = []
        for name, prepared in batches.items():
            out[f"policy/{name}/samples"] = prepared.samples.num_rows
            if not prepared.samples.num_rows:
                continue
            m = self.train_on(prepared.samples, self.backends[name])
            runs.append(m)
            out[f"policy/{name}/rollout/reward_mean"] = prepared.metrics()["rollout/reward_mean"]
            out.update({f"policy/{name}/{k}": v for k, v in m.items() if isinstance(v, (int, float))})
        return {**_mean(runs), **out}

    def push_policy_engines(self, metrics: dict[str, Any]) -> None:
        """Each policy on an engine of its own that trained this step (``metrics``: the step's, with
        ``policy/<name>/samples``) gets its new weights."""
        for name, engine in self.policy.policy_engines.items():
            if metrics.get(f"policy/{name}/samples"):
                engine.push()

    def load_policies(self, backend_cls: Any, model_dir: Path) -> dict[str, Path | None]:
        """Several policies' backends (:attr:`backends`), each with its own settings
        (:func:`~lgt.trainer.config.policy_backends`) on the base model, or, for a policy on an engine of
        its own, on its model (made first when its ``make`` says so); resuming, each from its checkpoint
        of the newest step every policy finished (``checkpoints/policies/<name>/step-N``). Returns what
        each policy's engine serves first: its checkpoint (a resumed run) or None (its model)."""
        from lgt.trainer.backends import checkpoints

        configs = cfgmod.policy_backends(self.cfg)
        own = cfgmod.own_engines(self.cfg)
        root = self.run_dir / "checkpoints" / "policies"
        step = None
        if self.resume:
            step = checkpoints.common_step(root, list(configs))
        extra: dict[str, Any] = {}
        for name, bcfg in configs.items():
            if step is not None:
                self.backends[name], extra = backend_cls.resume(root / name / step, bcfg)
            elif name in own:
                if own[name].model.make is not None:
                    self.policy.make(own[name].model.make, own[name].model.path, own[name].key)
                self.backends[name] = backend_cls.load(own[name].model.path, bcfg)
            else:
                self.backends[name] = backend_cls.load(model_dir, bcfg)
        self.backend = next(iter(self.backends.values()))
        if step is None:
            return dict.fromkeys(configs)
        self.progress = self.policy.progress = Progress.from_checkpoint(extra)
        self.runlog.restore(self.progress.step)
        self.runlog.log(f"resuming {len(configs)} policies from {step}: step {self.progress.step}, "
                        f"policy version {self.progress.version}")
        return {name: root / name / step for name in configs}

    def save_checkpoint(self) -> None:
        # named by the run's step (backend.updates_per_step > 1 makes several updates in one)
        root = self.run_dir / "checkpoints"
        if self.backends:  # each policy's own: checkpoints/policies/<name>/step-N
            for name, backend in self.backends.items():
                backend.save_checkpoint(root / "policies" / name, self.progress.checkpoint(),
                                        name=self.progress.step)
                prune_checkpoints(root / "policies" / name, self.keep_checkpoints)
            return
        self.backend.save_checkpoint(root, self.progress.checkpoint(), name=self.progress.step)
        prune_checkpoints(root, self.keep_checkpoints)

    # ---------------------------------------------------------------------------------- cleanup
    def cleanup(self) -> None:
        self.teacher.stop()
        self.policy.stop()
        for backend in self.backends.values() or [self.backend]:
            if backend is not None:
                with contextlib.suppress(Exception):
                    backend.close()


def run(cfg: RunConfig, tasks: Tasks, *, run_dir: Path | None = None, resume: bool = False,
        display: Display | None = None) -> Path:
    """Run ``cfg`` to the end on ``tasks`` (what :func:`lgt.trainer.preflight.validate` checked and
    read); returns the run directory (metrics, checkpoints, plots, report)."""
    run_dir = (run_dir or cfg.run_dir or cfgmod.default_run_dir(cfg)).resolve()
    r = Recipe(cfg, tasks, run_dir, resume=resume, display=display)
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
        r.runlog.close(r.stopped)  # the trackers' runs end with the summary and plots (if they began)
    return run_dir


def _mean(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's metrics, or the mean of each numeric one over several."""
    if len(runs) == 1:
        return runs[0]
    keys = {key for m in runs for key in m if isinstance(m[key], (int, float))}
    return {key: sum(m.get(key, 0.0) for m in runs) / len(runs) for key in keys}


def _tokenizer_text(model_dir: Path) -> str | None:
    path = model_dir / "tokenizer.json"
    return path.read_text() if path.exists() else None


def _decoder(model_dir: Path) -> Any:
    """A tokenizer with ``decode`` for realigned samples (the tokenizers library, no transformers)."""
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.exists() else None
