"""``lgt-train run``: the training recipe, read top to bottom — validate, setup, train, cleanup.

**validate** checks everything a run needs before anything starts, in well under two seconds: the
config (each section checked itself when loaded), the tasks file, the agent command on PATH, the model
directory (or that it can be made), the backend's environment, the engine's interpreter, the proxy.
One sentence names what is wrong; nothing has been built, started or written.

**setup** builds each component once, from its own config section: the model (made locally when asked),
the backend (:data:`lgt.trainer.backends.base.BACKENDS`: load, or resume from the run's last checkpoint),
the :class:`~lgt.trainer.run.supervisor.Supervisor` (the vLLM engine serving the policy and
``lgt-proxy`` in front of it, or running ones; their restarts), the rollout controller that launches the
unmodified agent once per rollout, the :class:`~lgt.trainer.run.scheduler.GroupScheduler` (which groups
run; on a resume, what was left), the :class:`~lgt.trainer.run.evaluation.Evaluator` (held-out tasks) and
the :class:`~lgt.trainer.run.runlog.RunLog` (metrics, the display, the report); with
``algorithm.estimator: opd``, the teacher (:class:`~lgt.trainer.distill.opd.Teacher`: a second engine,
made and started here, or one at a URL). Nothing after setup reads the run config.

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
     wakes and gets the new weights without a restart (``backend.named_weights``);
  5. a checkpoint (weights, optimizer, the trained groups) before ``POST /resume`` with the new policy
     version; held calls continue on the new weights; the step's metrics row.

**cleanup** stops the proxy and the engine it started, cancels unfinished rollouts, closes the backend;
the summary, metrics.csv, plots and report pages are written however the run ended.

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
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa

from lgt.store.samples import build_group_samples
from lgt.trainer import config as cfgmod
from lgt.trainer.backends.base import BackendError, entry
from lgt.trainer.backends.checkpoints import prune_checkpoints
from lgt.trainer.config import ConfigError, RunConfig
from lgt.trainer.run import admission, evaluation
from lgt.trainer.run.progress import Progress
from lgt.trainer.run.runlog import TARGET_WINDOW, Display, RunLog, StopRules, finish, step_row, write_json
from lgt.trainer.run.scheduler import Group, GroupScheduler
from lgt.trainer.run.supervisor import Supervisor, undrained


def validate(cfg: RunConfig, *, resume_dir: Path | None = None, run_dir: Path | None = None
             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Everything the run needs, checked before anything is built or started; returns the training
    tasks and the held-out ones (``eval``: a file, or a share split off the tasks; none without eval).

    ConfigError (or another ValueError: one sentence) names what is wrong. Fast: reads the tasks file and
    a few small JSON files, looks commands up on PATH; imports no torch, verl or vLLM.
    """
    from lgt.trainer import model_dir
    from lgt.trainer.rollout import controller as rollouts
    from lgt.trainer.serving.engine import EngineError, engine_python
    from lgt.trainer.serving.proxy import ProxyError, find_proxy_command

    tasks, held = cfgmod.split_tasks(cfg)
    try:
        rollouts.check_agent(cfg.agent)
    except rollouts.RolloutError as e:
        raise ConfigError(str(e)) from None
    m = cfg.model
    chat_template(cfg)
    if m.make is not None:
        _check_make(m.make, m.path, "model")
    else:
        model_dir.check_model_dir(m.path, need_chat_template=m.chat_template is None).check_context(
            cfg.engine.max_model_len)
    t = cfg.teacher
    if t is not None and t.make is not None and t.path is not None:
        _check_make(t.make, t.path, "teacher")
    elif t is not None and t.path is not None:
        model_dir.check_model_dir(t.path)
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


def chat_template(cfg: RunConfig) -> str | None:
    """The text of ``model.chat_template``, checked (:func:`lgt.trainer.model_dir.check_chat_template`:
    tools, tool calls and results render, later prompts extend earlier ones) with the model's special
    tokens when the model exists already; None without one. ConfigError (one sentence) otherwise; the
    engine's own ``--chat-template`` is refused (vLLM would render with a template the trainer does not
    use)."""
    from lgt.trainer import model_dir

    flag = next((a for a in cfg.engine.extra_args if a.split("=")[0] == "--chat-template"), None)
    if flag is not None:
        raise ConfigError("engine.extra_args gives vLLM --chat-template, which the trainer would not render "
                          "with (SFT, realigned samples): give the template as model.chat_template instead")
    path = cfg.model.chat_template
    if path is None:
        return None
    try:
        text = model_dir.read_chat_template(path)
        special = model_dir.special_tokens(cfg.model.path) if cfg.model.path.is_dir() else {}
        model_dir.check_chat_template(text, name=f"model.chat_template {path}", special_tokens=special)
    except model_dir.ModelError as e:
        raise ConfigError(f"model.chat_template: {e}" if str(e).startswith("chat template") else str(e)) \
            from None
    return text


def with_chat_template(cfg: RunConfig, model_dir: Path, run_dir: Path, name: str = "model") -> Path:
    """``model_dir`` as the run serves, trains and renders it: with ``model.chat_template``, the folder
    ``<run_dir>/<name>`` that holds ``model_dir``'s files (linked) and that template
    (:func:`lgt.trainer.model_dir.with_chat_template`: vLLM, transformers and the checkpoints all read it
    from there); without one, ``model_dir`` itself. ``name``: ``model`` for the config's model (the
    checkpoints name it as their starting model), another for a checkpoint served."""
    from lgt.trainer import model_dir as dirs

    text = chat_template(cfg)
    return model_dir if text is None else dirs.with_chat_template(model_dir, text, run_dir / name)


def _check_make(make: Any, path: Path, key: str) -> None:
    """``model.make`` or ``teacher.make``: settings tiny can build or a GGUF file transformers can import
    (unless that import is made already), a path it may build at."""
    from lgt.trainer import gguf, make_model, model_dir
    from lgt.trainer.demo import tiny

    if path.exists() and tiny.read_marker(path) is None and any(path.iterdir()):
        raise ConfigError(f"{key}.path {path} holds something that is not a model made by lgt: "
                          f"choose another path for {key}.make")
    if make.imported:
        try:
            source, template = make_model.import_source(make)
            if not gguf.import_is_made(path, source, pretrained=make.pretrained, dtype=make.dtype,
                                         chat_template=template):
                gguf.check_gguf(source)
        except model_dir.ModelError as e:
            raise ConfigError(f"{key}.make: {e}") from None
        return
    if make.preset not in tiny.PRESETS:
        raise ConfigError(f"{key}.make.preset must be one of {', '.join(tiny.PRESETS)}, not {make.preset!r}")
    if make.steps is not None and make.steps < 1:
        raise ConfigError(f"{key}.make.steps must be 1 or more, not {make.steps}")
    if make.warm_start is not None and make.warm_start not in tiny.TASKS:
        raise ConfigError(f"{key}.make.warm_start must be one of {', '.join(tiny.TASKS)} or null, not "
                          f"{make.warm_start!r}")


def import_model(make: Any, path: Path, what: str = "model", *, chat_template: str | None = None,
                 dtype_key: str | None = None, log: Callable[[str], None] = print) -> Path:
    """``make`` (an import from GGUF: ``pretrained`` or ``gguf``) built at ``path`` unless it is there
    already, with ``chat_template`` (else the named source's, else the file's own); ``dtype: auto`` is
    bfloat16 where this machine computes in bf16 natively, else float32, and a line says which and why
    (``dtype_key`` names the setting in it). ModelError (one sentence) for a bad input; nothing is left
    at ``path``."""
    from lgt.trainer import gguf, make_model
    from lgt.trainer.serving.hardware import resolve_dtype

    source, template = make_model.import_source(make)
    template = chat_template if chat_template is not None else template
    if gguf.import_is_made(path, source, pretrained=make.pretrained, dtype=make.dtype,
                             chat_template=template):
        return path
    info = gguf.check_gguf(source)  # a file transformers cannot import: one sentence before torch is imported
    device = "cpu"
    if make.dtype == "auto":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype, why = resolve_dtype(make.dtype, device, key=dtype_key or f"{what}.make.dtype")
    return gguf.import_gguf(info, path, dtype=dtype, requested_dtype=make.dtype, chat_template=template,
                              pretrained=make.pretrained, why=why, log=log)


def hidden_from_agents(cfg: RunConfig) -> list[Path]:
    """What a sandboxed agent must not see even when its folder holds it: the tasks (answers and the
    held-out ones), the config, the model (the store and the run directory are hidden anyway)."""
    paths = [cfg.tasks, cfg.model.path]
    if cfg.teacher is not None and cfg.teacher.path is not None:
        paths.append(cfg.teacher.path)
    if cfg.eval is not None and cfg.eval.tasks:
        paths.append(cfg.eval.tasks)
    if cfg.source is not None:
        paths.append(cfg.source)
    return paths


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
                 display: Display | None = None) -> None:
        self.cfg = cfg  # read by setup only
        self.run_dir = run_dir
        self.resume = resume
        self.store = cfg.store_path(run_dir)
        self.remote = cfg.store_remote()  # the store on S3: self.store is its local mirror
        self.runlog = RunLog(run_dir, display, steps=cfg.steps, trackers=cfg.log)
        self.progress = Progress()
        self.stopped: str | None = None  # why training ended (the final summary says it)
        self.tasks: list[dict[str, Any]] = []
        self.eval_tasks: list[dict[str, Any]] = []  # held out: evaluated, never trained
        self.backend: Any = None
        self.supervisor: Supervisor | None = None
        self.controller: Any = None
        self.scheduler: GroupScheduler | None = None
        self.teacher: Any = None  # on-policy distillation's teacher (lgt.trainer.distill.opd.Teacher)

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
            self.progress = Progress.from_checkpoint(extra)
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
        teacher_dir = self.ensure_teacher(model_dir)  # made and its tokenizer checked before any engine
        self.serve(ckpt or model_dir, weights=self.backend.named_weights)
        if cfg.teacher is not None:
            self.start_teacher(teacher_dir)
        self.scheduler = GroupScheduler(
            self.controller, self.store, self.tasks,
            admission.Limits(cfg.mode, cfg.group_size, cfg.batch_groups, cfg.max_inflight, cfg.max_staleness),
            seed=cfg.seed, retries=cfg.agent.retries, progress=self.progress,
            rollouts_dir=self.run_dir / "rollouts", log=self.runlog.log, record=self.runlog.rollout,
            refresh=self.runlog.refresh)
        self.scheduler.recover(resume=self.resume)
        self.runlog.follow(self.scheduler.counts)
        self.evaluator = evaluation.Evaluator(cfg.eval, self.eval_tasks, self.controller.run, self.run_dir,
                                              log=self.runlog.log, elapsed=self.runlog.elapsed,
                                              on_done=self.scheduler.wake, record=self.runlog.eval)
        # what the steps need from the config, and nothing more
        self.adopt_jobs = self.resume and cfg.agent.runner == "kubernetes"
        self.stop_rules = StopRules(cfg.steps, cfg.max_minutes, cfg.max_samples, cfg.target_reward)
        self.algorithm, self.max_staleness = cfg.algorithm, cfg.max_staleness
        self.updates_per_step, self.checkpoint_every = cfg.backend.updates_per_step, cfg.checkpoint_every
        self.keep_checkpoints = cfg.keep_checkpoints
        self.columns = {"mode": cfg.mode, "backend": cfg.backend.name}  # in every metrics row
        # last: nothing after it fails, so a tracker run that began is always ended (run's finally)
        self.runlog.start_trackers(cfg.to_json(), resume_step=self.progress.step if self.resume else None)

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
            write_json(self.run_dir / cfgmod.RUN_FILE, self.cfg.to_json())

    def serve(self, serve_dir: Path, weights: Callable[[], Any] | None = None) -> None:
        """The engine on ``serve_dir`` and lgt-proxy in front of it (the supervisor), the rollout
        controller."""
        from lgt.trainer.rollout.controller import RolloutController

        cfg = self.cfg
        self.supervisor = Supervisor(cfg.engine, cfg.proxy, store=self.store,
                                     store_url=self.remote.url if self.remote is not None else self.store,
                                     logs_dir=self.run_dir / "logs", seed=cfg.seed, restarts=cfg.restarts,
                                     progress=self.progress, log=self.runlog.log)
        self.supervisor.serve(serve_dir, weights)
        resources = None
        if cfg.resources:
            from lgt.trainer.rollout.resources import Resources
            resources = Resources(cfg.resources)
            resources.save(self.run_dir)
        self.controller = RolloutController(cfg.agent, self.supervisor.endpoints(), self.store, self.run_dir,
                                            cfg.max_inflight, batch_records=True, resources=resources,
                                            hide=hidden_from_agents(cfg))

    def setup_eval(self, checkpoint: Path | None) -> None:
        """``lgt-train eval`` and ``apo``: the engine serves ``checkpoint`` (or the config's model), no
        backend."""
        from lgt.trainer.backends import checkpoints

        self.prepare()
        if checkpoint is not None:
            updates, extra, _ = checkpoints.read_state(checkpoint)
            step = int(extra.get("step", updates))  # the run's step; the backend may update more often
            self.progress = Progress(step=step, version=int(extra.get("version", step)))
        self.serve(with_chat_template(self.cfg, checkpoint, self.run_dir, f"model-{checkpoint.name}")
                   if checkpoint is not None else self.ensure_model())

    def ensure_model(self) -> Path:
        """The model's directory as the run trains and serves it: made first when ``model.make`` says
        so; with ``model.chat_template``, the run's folder that gives it that template
        (:func:`with_chat_template`)."""
        m = self.cfg.model
        if m.make is not None:
            self.make(m.make, m.path, "model", need_chat_template=m.chat_template is None)
        return with_chat_template(self.cfg, m.path, self.run_dir)

    def make(self, make: Any, path: Path, what: str, *, need_chat_template: bool = False) -> None:
        """``model.make`` or ``teacher.make``: the model built at ``path`` (reused when it was made with
        the same settings): a tiny demo model, or an import from GGUF."""
        from lgt.trainer import model_dir
        from lgt.trainer.demo import tiny

        if make.imported:
            import_model(make, path, what, log=self.runlog.log)
            model_dir.check_model_dir(path, need_chat_template=need_chat_template).check_context(
                self.cfg.engine.max_model_len)
            return
        # the held-out tasks are never shown in the warm start either: eval measures the unseen
        exclude = sorted({str(t["question"]) for t in self.eval_tasks if "question" in t})
        budget = dict(seconds=make.seconds, steps=make.steps, seed=make.seed, exclude=exclude,
                      correct_fraction=make.correct_fraction)
        made = tiny.is_made(path, preset=make.preset, warm_start_task=make.warm_start, **budget)
        if not made:
            size = f"{make.steps} steps" if make.steps else f"~{make.seconds:.0f} s"
            self.runlog.log(f"building the {what} {path} (preset {make.preset}, warm start "
                            f"{make.warm_start or 'none'}, {size}, {make.correct_fraction:g} right) ...")
        tiny.make_model(path, preset=make.preset, warm_start_task=make.warm_start, progress=not made,
                        **budget)
        info = model_dir.check_model_dir(path, need_chat_template=need_chat_template)
        info.check_context(self.cfg.engine.max_model_len)

    def ensure_teacher(self, student_dir: Path) -> Path | None:
        """The teacher's model directory (made when ``teacher.make`` says so), its tokenizer checked
        against the student's; None for a teacher at a URL (attached and its tokenizer probed here, before
        the student's engine starts) or no teacher."""
        from lgt.trainer.distill.opd import Teacher, TeacherError, probe_mismatch

        t = self.cfg.teacher
        if t is None:
            return None
        if t.path is None:
            try:
                self.teacher = Teacher.attach(t, log=self.runlog.log)
                mismatch = probe_mismatch(student_dir, self.teacher.tokenize)
            except TeacherError as e:
                raise ConfigError(str(e)) from None
            if mismatch:
                raise ConfigError(mismatch)
            return None
        if t.make is not None:
            self.make(t.make, t.path, "teacher")
        mismatch = cfgmod.teacher_tokenizer_problem(student_dir, t.path)
        if mismatch:
            raise ConfigError(mismatch)
        return t.path

    def start_teacher(self, teacher_dir: Path | None) -> None:
        """The teacher's engine, started on ``teacher_dir`` (a teacher at ``teacher.url`` is attached
        already: :meth:`ensure_teacher`)."""
        from lgt.trainer.distill.opd import Teacher

        cfg = self.cfg
        if teacher_dir is not None:
            self.teacher = Teacher.start(cfg.teacher, teacher_dir, cfg.engine,
                                         log_path=self.run_dir / "logs" / "teacher-engine.log",
                                         seed=cfg.seed, restarts=cfg.restarts, log=self.runlog.log)
        self.opd_reward_coef = cfg.algorithm.opd_reward_coef

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
        # the batch's groups are finished: their samples are built while the other rollouts still run
        await timed("record", self.controller.flush_records)
        await timed("flush", sup.proxy.flush, paused=False)
        if self.remote is not None:  # the rollouts just recorded up; other replicas' calls down
            await timed("store_sync", lambda: (self.remote.push_all(), self.remote.pull()))
        prepared = await timed("samples", self.samples_for, batch)
        distill: dict[str, float] = {}
        if self.teacher is not None and prepared.samples.num_rows:  # still while the rollouts run
            prepared, distill = await timed("teacher", self.distill, prepared)
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
            metrics = await timed("train", self.train_on, prepared.samples)
            if asleep:
                await timed("wake", sup.engine.wake_up)
            await timed("sync", lambda: sup.engine.update_weights(self.backend.named_weights()),
                        paused=True)  # a new engine
        progress.trained([g.group_id for g in batch], prepared.samples.num_rows)
        self.scheduler.trained(batch)
        if progress.step % self.checkpoint_every == 0 or progress.step >= self.stop_rules.steps:
            await timed("checkpoint", self.save_checkpoint)
        await timed("resume", sup.proxy.resume, progress.version, paused=True)
        self.runlog.trained(progress.step, progress.version, prepared.samples)
        self.runlog.step(step_row(
            step=progress.step, version=progress.version, time_s=self.runlog.elapsed(), columns=self.columns,
            groups=len(batch), prepared=prepared.metrics(),
            results=[r for g in batch for r in g.results if r is not None],
            groups_failed=self.scheduler.failed_since_last(),
            sample_ids=prepared.samples["sample_id"].to_pylist(), running=self.scheduler.running,
            pause=pause, perf=perf, update_s=time.monotonic() - t_step, paused_s=time.monotonic() - t_paused,
            metrics={**distill, **metrics}))

    def samples_for(self, batch: list[Group]) -> admission.Prepared:
        """The batch's samples from the store, ready for the loss (:func:`~.run.admission.prepare`)."""
        samples = build_group_samples(self.store, [g.group_id for g in batch],
                                      mode=self.algorithm.sample_mode, tokenizer=self.tokenizer).samples
        return admission.prepare(samples, self.progress.version, self.algorithm, self.max_staleness)

    def distill(self, prepared: admission.Prepared) -> tuple[admission.Prepared, dict[str, float]]:
        """The teacher's logprob of every token of the batch's samples, and the per-token advantages
        (:func:`~lgt.trainer.distill.opd.token_advantages`; a generated token without a recorded behaviour
        logprob uses the backend's own before the update); the step's ``teacher/*`` and ``opd/*``
        metrics."""
        import dataclasses

        from lgt.trainer.distill import opd

        samples = prepared.samples
        scored = self.teacher.score(samples.column("input_ids").to_pylist())
        recomputed = self.backend.sample_logprobs(samples) if opd.needs_recompute(samples) else None
        samples, metrics = opd.token_advantages(samples, scored.logprobs, self.opd_reward_coef, recomputed,
                                                scored.top)
        return dataclasses.replace(prepared, samples=samples), {**scored.metrics(), **metrics}

    def train_on(self, samples: pa.Table) -> dict[str, float]:
        """``backend.updates_per_step`` optimizer steps on disjoint shares of the batch's groups (each
        share weighted so its rollouts count once); metrics averaged over them."""
        runs = [self.backend.train_step(share)
                for share in admission.shares(samples, self.updates_per_step, self.algorithm)]
        if len(runs) == 1:
            return runs[0]
        keys = {key for m in runs for key in m if isinstance(m[key], (int, float))}
        return {key: sum(m.get(key, 0.0) for m in runs) / len(runs) for key in keys}

    def save_checkpoint(self) -> None:
        # named by the run's step (backend.updates_per_step > 1 makes several updates in one)
        root = self.run_dir / "checkpoints"
        self.backend.save_checkpoint(root, self.progress.checkpoint(), name=self.progress.step)
        prune_checkpoints(root, self.keep_checkpoints)

    # ---------------------------------------------------------------------------------- cleanup
    async def close_rollouts(self) -> None:
        if self.controller is not None:
            with contextlib.suppress(Exception):
                await self.controller.aclose()

    def cleanup(self) -> None:
        if self.teacher is not None:
            with contextlib.suppress(Exception):
                self.teacher.stop()
        if self.supervisor is not None:
            self.supervisor.stop()
        if self.backend is not None:
            with contextlib.suppress(Exception):
                self.backend.close()


def run(cfg: RunConfig, *, run_dir: Path | None = None, resume: bool = False,
        display: Display | None = None) -> Path:
    """Run ``cfg`` to the end; returns the run directory (metrics, checkpoints, plots, report)."""
    run_dir = (run_dir or cfg.run_dir or cfgmod.default_run_dir(cfg)).resolve()
    r = Recipe(cfg, run_dir, resume=resume, display=display)
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


def evaluate(cfg: RunConfig, *, checkpoint: Path | None = None, run_dir: Path | None = None,
             display: Display | None = None) -> tuple[Path, evaluation.EvalResult]:
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
        evaluator = evaluation.Evaluator(cfg.eval, r.eval_tasks, r.controller.run, run_dir, log=r.runlog.log,
                                         elapsed=r.runlog.elapsed)

        async def once() -> evaluation.EvalResult:
            r.runlog.restart_clock()
            try:
                return await evaluator.once(r.progress.step, r.progress.version)
            finally:
                await r.close_rollouts()

        return run_dir, asyncio.run(once())
    finally:
        r.cleanup()


def optimize_prompt(cfg: RunConfig, *, run_dir: Path | None = None, resume: bool = False,
                    checkpoint: Path | None = None,
                    display: Display | None = None) -> tuple[Path, dict[str, Any]]:
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
        critic = apo.Critic(cfg.apo.critic, f"{r.supervisor.engine.url}", cfg.engine.served_model_name)
        run = apo.make_runner(r.controller, r.store, cfg.apo.samples)

        async def go() -> dict[str, Any]:
            try:
                return await apo.optimize(cfg.apo, r.controller.resources, run, train, val, critic, run_dir,
                                          log=r.runlog.log)
            finally:
                await r.close_rollouts()

        best = asyncio.run(go())
        apo.plot(run_dir)
        apo.write_report(run_dir)
        return run_dir, {**best, "critic_calls": critic.calls, "critic_failures": critic.failures}
    finally:
        r.cleanup()


def _quiet_transformers() -> None:
    """No per-call progress bars from transformers (loading / writing shards at every checkpoint)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    with contextlib.suppress(Exception):
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()


def _decoder(model_dir: Path) -> Any:
    """A tokenizer with ``decode`` for realigned samples (the tokenizers library, no transformers)."""
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.exists() else None
