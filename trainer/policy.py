"""The policy served, the one way ``lgt-train run``, ``eval`` and ``apo`` serve it: the run directory and
its store, the model (made first when ``model.make`` says so, with ``model.chat_template`` given to it),
the vLLM engine serving it and ``lgt-proxy`` in front (the :class:`~lgt.trainer.run.supervisor.Supervisor`:
started or attached, and their restarts), the rollout controller that runs the unmodified agent through
them; with ``algorithm.estimator: opd``, the teacher's model (made, or attached at a URL) and its engine.

:class:`Policy` takes the config a command has checked (:mod:`lgt.trainer.preflight`) and the tasks it
read; nothing here checks the config again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lgt.trainer import config as cfgmod
from lgt.trainer.config import ConfigError, RunConfig
from lgt.trainer.distill.onpolicy import Distillation, NoTeacher
from lgt.trainer.preflight import Tasks, chat_template, teacher_matches
from lgt.trainer.run.progress import Progress
from lgt.trainer.run.runlog import Display, RunLog, write_json
from lgt.trainer.run.supervisor import Supervisor

POLICIES_FILE = "policies.json"  # in the run directory: the policies section lgt-proxy reads (--policies)


class Policy:
    """What a command serves from ``run_dir`` (see the module docstring): build it with :meth:`prepare`,
    the model with :meth:`ensure_model` (or a checkpoint: :meth:`serve_checkpoint`), then :meth:`serve`;
    :meth:`stop` stops what it started."""

    def __init__(self, cfg: RunConfig, tasks: Tasks, run_dir: Path, *, resume: bool = False,
                 display: Display | None = None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.resume = resume
        self.tasks, self.eval_tasks = tasks  # held out: evaluated, never trained
        self.store = cfg.store_path(run_dir)
        remote = cfg.store_remote()  # the store on S3: self.store is its local mirror
        self.remote: StoreMirror | LocalStore = StoreMirror(remote) if remote is not None else LocalStore()
        self.runlog = RunLog(run_dir, display, steps=cfg.steps, trackers=cfg.log)
        self.progress = Progress()
        self.supervisor: Supervisor | None = None
        self.controller: Any = None
        self.policy_engines: dict[str, Any] = {}  # policies on engines of their own (serve_policies)
        self.proxy_policies = cfgmod.proxy_section(cfg.policies)  # the section lgt-proxy reads

    def prepare(self) -> None:
        """The run directory, its store and (a new run's) config.json. A resumed run's config.json is
        rewritten only once its checkpoint was loaded (:meth:`lgt.trainer.recipe.Recipe.setup`): a
        resume that fails leaves the record as it was."""
        _quiet_transformers()
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.store.mkdir(parents=True, exist_ok=True)
        self.remote.pull()  # what the bucket holds already (a resumed run, other replicas)
        if not self.resume:
            write_json(self.run_dir / cfgmod.RUN_FILE, self.cfg.to_json())

    # ------------------------------------------------------------------------------------ models
    def ensure_model(self) -> Path:
        """The model's directory as the run trains and serves it: made first when ``model.make`` says
        so; with ``model.chat_template``, the run's folder that gives it that template
        (:func:`with_chat_template`)."""
        m = self.cfg.model
        if m.make is not None:
            self.make(m.make, m.path, "model", need_chat_template=m.chat_template is None)
        return with_chat_template(self.cfg, m.path, self.run_dir)

    def make(self, make: Any, path: Path, what: str, *, need_chat_template: bool = False) -> None:
        """``model.make`` or ``teacher.make`` built at ``path`` (:func:`lgt.trainer.make_model.make`);
        the held-out tasks are never shown in a warm start either: eval measures the unseen."""
        from lgt.trainer import make_model

        exclude = sorted({str(t["question"]) for t in self.eval_tasks if "question" in t})
        make_model.make(make, path, what, max_model_len=self.cfg.engine.max_model_len,
                        need_chat_template=need_chat_template, exclude=exclude, log=self.runlog.log)

    def ensure_teacher(self, student_dir: Path, backend: Any) -> Distillation | NoTeacher:
        """On-policy distillation's teacher, its tokenizer checked against the student's before any
        engine starts: its model directory made when ``teacher.make`` says so (its engine started by
        ``start()``, once the student's runs), or the teacher at ``teacher.url`` attached (its tokenizer
        probed); :class:`NoTeacher` without a teacher."""
        from lgt.trainer.distill.teacher import Teacher, TeacherError, probe_mismatch

        cfg, t = self.cfg, self.cfg.teacher
        if t is None:
            return NoTeacher()
        coef = cfg.algorithm.opd_reward_coef
        if t.path is None:
            try:
                teacher = Teacher.attach(t, log=self.runlog.log)
            except TeacherError as e:
                raise ConfigError(str(e)) from None
            distillation = Distillation(backend, coef, teacher=teacher)
            try:
                mismatch = probe_mismatch(student_dir, teacher.tokenize)
            except TeacherError as e:
                distillation.stop()
                raise ConfigError(str(e)) from None
            if mismatch:
                distillation.stop()
                raise ConfigError(mismatch)
            return distillation
        if t.make is not None:
            self.make(t.make, t.path, "teacher")
        teacher_matches(student_dir, t.path)
        path = t.path
        return Distillation(backend, coef, start=lambda: Teacher.start(
            t, path, cfg.engine, log_path=self.run_dir / "logs" / "teacher-engine.log", seed=cfg.seed,
            restarts=cfg.restarts, log=self.runlog.log))

    # ------------------------------------------------------------------------------------ serving
    def serve_backend(self, backend: Any, model_dir: Path, checkpoint: Path | None, *,
                      lora: Any = "run") -> None:
        """``lgt-train run``: serve what ``backend`` trains (:meth:`serve`), each version synced to the
        engine as :func:`lgt.trainer.serving.sync.choose` says: full fine-tuning serves ``checkpoint``
        (or ``model_dir``) and sends every weight after each step; a LoRA backend (``backend.lora``)
        serves the base model ``model_dir`` and loads its adapter under a versioned name, or, where the
        backend or engine cannot serve adapters, sends its merged weights (one line in the log says
        which). ``lora``: the backend's LoRA settings, if not the run's ``backend.lora``."""
        from lgt.trainer.serving import sync
        from lgt.trainer.serving.launch import lora_rank_of

        if lora == "run":
            lora = getattr(self.cfg.backend, "lora", None)
        if lora is None:
            self.serve(checkpoint or model_dir, weights=backend.named_weights)
            return
        engine = self.cfg.engine
        if engine.serve_adapters and callable(getattr(backend, "save_adapter", None)):
            engine = dataclasses.replace(engine, lora_rank=lora_rank_of(lora))
        how = sync.choose(backend, engine, self.run_dir / "engine-adapters", lora=lora, say=self.runlog.log)
        restore = checkpoint is not None or how.kind == "adapter"
        self.serve(model_dir, sync=how, restore=restore, engine=engine)

    def serve_policies(self, backends: dict[str, Any], model_dir: Path,
                       serve_dirs: dict[str, Path | None]) -> None:
        """``lgt-train run`` of several policies (``backends``: each policy's, in order). Each policy on an
        engine of its own (:func:`lgt.trainer.config.own_engines`) gets that engine, started first on
        ``serve_dirs[name]`` (:class:`~lgt.trainer.serving.policy_engine.PolicyEngine`) and written into
        the proxy's section as the policy's route. The policies on the run's engine: several are served
        on the base model ``model_dir`` with each one's adapter loaded as ``<policy>-v<version>``
        (:class:`lgt.trainer.serving.sync.PolicyAdapters`), the engine holding two adapters per policy
        (the current and the previous version's, whose calls may still run at an update) at the largest
        rank; one is served as a run of one policy is (:meth:`serve_backend`, from ``serve_dirs[name]``:
        a resumed run's checkpoint, or None)."""
        from lgt.trainer.serving import sync
        from lgt.trainer.serving.launch import lora_rank_of

        own = self.start_policy_engines(serve_dirs, {name: b.named_weights for name, b in backends.items()})
        shared = {name: b for name, b in backends.items() if name not in own}
        if len(shared) == 1:
            name, backend = next(iter(shared.items()))
            self.serve_backend(backend, model_dir, serve_dirs.get(name), lora=backends_lora(backend))
            return
        rank = max(lora_rank_of(b.cfg.lora) for b in shared.values())
        engine = dataclasses.replace(self.cfg.engine, lora_rank=rank,
                                     max_loras=max(self.cfg.engine.max_loras, 2 * len(shared)))
        how = sync.PolicyAdapters({name: b.save_adapter for name, b in shared.items()},
                                  self.run_dir / "engine-adapters")
        self.runlog.log(f"LoRA: {len(shared)} policies ({', '.join(shared)}), each update loads each "
                        "policy's adapter into the engine as <policy>-v<version>")
        self.serve(model_dir, sync=how, restore=True, engine=engine)

    def start_policy_engines(self, serve_dirs: dict[str, Path | None],
                             weights: dict[str, Callable[[], Any]]) -> dict[str, Any]:
        """The engines of the policies on engines of their own, each on ``serve_dirs[name]`` (else its
        model), and the proxy's section with their routes in (:attr:`proxy_policies`); those policies."""
        from lgt.trainer.serving.policy_engine import PolicyEngine

        own = cfgmod.own_engines(self.cfg)
        for name in own:
            self.policy_engines[name] = PolicyEngine.start(
                name, own[name].engine, serve_dirs.get(name) or own[name].model.path,
                log_path=self.run_dir / "logs" / f"engine-{name}.log", seed=self.cfg.seed,
                weights=weights.get(name, list), log=self.runlog.log)
        self.proxy_policies = [{**p, **self.policy_engines[p["name"]].route()} if p["name"] in own else p
                               for p in cfgmod.proxy_section(self.cfg.policies)]
        return own

    def serve_policy_checkpoints(self, folders: dict[str, Path]) -> None:
        """``lgt-train eval`` of a run of several policies: each policy's checkpoint of one step
        (``folders``, :func:`policy_checkpoints`) served as the run served that version: a policy on an
        engine of its own on its checkpoint's model, the policies on the run's engine as their adapters
        on the base model (``<policy>-v<version>``), or, one there, as :meth:`serve_checkpoint` serves it."""
        import json
        import shutil

        from lgt.trainer.serving import sync

        self.prepare()
        first = next(iter(folders.values()))  # the first policy's: always on the run's engine
        self.progress, base = saved_progress(first)
        own = self.start_policy_engines(dict(folders), {})
        shared = {name: folder for name, folder in folders.items() if name not in own}
        if len(shared) == 1:
            self.serve_saved(first, base)
            return
        adapters = {name: adapter_folder(folder) for name, folder in shared.items()}
        rank = max(int(json.loads((a / "adapter_config.json").read_text())["r"]) for a in adapters.values())
        engine = dataclasses.replace(self.cfg.engine, lora_rank=rank,
                                     max_loras=max(self.cfg.engine.max_loras, 2 * len(shared)))
        saves = {name: lambda dest, a=a: shutil.copytree(a, dest) for name, a in adapters.items()}
        how = sync.PolicyAdapters(saves, self.run_dir / "engine-adapters")
        self.runlog.log(f"serving {len(shared)} policies' adapters of {first.name} "
                        f"({', '.join(shared)}) as <policy>-v{self.progress.version}")
        self.serve(self.ensure_model(), sync=how, restore=True, engine=engine)

    def serve(self, serve_dir: Path, weights: Callable[[], Any] | None = None, *,
              sync: Any = None, restore: bool = False, engine: Any = None) -> None:
        """The engine on ``serve_dir`` and lgt-proxy in front of it (the supervisor), the rollout
        controller. ``sync``, ``restore``: :meth:`~lgt.trainer.run.supervisor.Supervisor.serve`'s;
        ``engine``: the engine's config, if not the run's (LoRA settings added)."""
        from lgt.trainer.rollout.controller import RolloutController

        cfg = self.cfg
        self.supervisor = Supervisor(engine or cfg.engine, cfg.proxy, store=self.store,
                                     store_url=self.remote.url or self.store,
                                     logs_dir=self.run_dir / "logs", seed=cfg.seed, restarts=cfg.restarts,
                                     progress=self.progress, log=self.runlog.log,
                                     policies=self.proxy_policies,
                                     policies_file=self.run_dir / POLICIES_FILE)
        self.supervisor.serve(serve_dir, weights, sync=sync, restore=restore)
        resources = None
        if cfg.resources:
            from lgt.trainer.rollout.resources import Resources
            resources = Resources(cfg.resources)
            resources.save(self.run_dir)
        self.controller = RolloutController(cfg.agent, self.supervisor.endpoints(), self.store, self.run_dir,
                                            cfg.max_inflight, batch_records=True, resources=resources,
                                            hide=hidden_from_agents(cfg))

    def serve_checkpoint(self, checkpoint: Path | None) -> None:
        """``lgt-train eval`` and ``apo``: the engine serves ``checkpoint`` (its step and policy version
        the progress) or the config's model; no backend. A LoRA checkpoint's adapter is served on its base
        (:meth:`serve_adapter`)."""
        self.prepare()
        base = None
        if checkpoint is not None:
            self.progress, base = saved_progress(checkpoint)
        self.serve_saved(checkpoint, base)

    def serve_saved(self, checkpoint: Path | None, base: Path | None) -> None:
        """The engine on ``checkpoint`` — a LoRA run's adapter on ``base`` (the model its run trained, as
        its state names it; the config's when that is the checkpoint itself or None), or a full model —
        or, without one, on the config's model."""
        adapter = adapter_folder(checkpoint) if checkpoint is not None else None
        if adapter is not None:  # a LoRA run's checkpoint: its base model, the adapter loaded on top
            self.serve_adapter(adapter, base if base is not None and base != checkpoint else None)
            return
        self.serve(with_chat_template(self.cfg, checkpoint, self.run_dir, f"model-{checkpoint.name}")
                   if checkpoint is not None else self.ensure_model())

    def serve_adapter(self, adapter: Path, base: Path | None = None) -> None:
        """The base model (``base``: the model the checkpoint's run trained, as its state names it; None:
        the config's) served with the LoRA adapter in ``adapter`` loaded on top (its rank read from
        adapter_config.json) as ``<served_model_name>-v<version>``, every call going to it (an engine
        given by ``engine.url`` must have been started for adapters: ``--enable-lora`` and
        ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``)."""
        import json
        import shutil

        from lgt.trainer.serving import sync

        rank = int(json.loads((adapter / "adapter_config.json").read_text())["r"])
        engine = dataclasses.replace(self.cfg.engine, lora_rank=rank)
        how = sync.Adapters(lambda dest: shutil.copytree(adapter, dest), self.run_dir / "engine-adapters",
                            engine.served_model_name)
        model_dir = base if base is not None else self.ensure_model()
        self.runlog.log(f"serving the LoRA adapter {adapter} on {model_dir} as "
                        f"{how.name(self.progress.version)}")
        self.serve(model_dir, sync=how, engine=engine)

    async def close_rollouts(self) -> None:
        if self.controller is not None:
            with contextlib.suppress(Exception):
                await self.controller.aclose()

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        for engine in self.policy_engines.values():
            with contextlib.suppress(Exception):
                engine.stop()


def policy_checkpoints(cfg: RunConfig, path: Path) -> dict[str, Path] | None:
    """A run of several policies' checkpoints that ``path`` names (the run's folder, its ``checkpoints``
    or ``checkpoints/policies``): each policy's of the newest step every policy finished; None when
    ``path`` holds no ``checkpoints/policies``. CheckpointError (one sentence) when a policy of ``cfg``
    has none, or no step is finished by all."""
    from lgt.trainer.backends.checkpoints import CheckpointError, common_step, finished_checkpoints

    path = Path(path)
    root = next((r for r in (path / "checkpoints" / "policies", path / "policies", path)
                 if r.name == "policies" and r.is_dir()), None)
    if root is None or not cfgmod.several_policies(cfg):
        return None
    names = [p["name"] for p in cfg.policies]
    missing = [name for name in names if not finished_checkpoints(root / name)]
    if missing:
        raise CheckpointError(f"{root} has no finished checkpoint of policy {missing[0]} (the config names "
                              f"{', '.join(names)}): give the run's folder and config")
    step = common_step(root, names)
    if step is None:
        raise CheckpointError(f"{root}: no step is finished by every policy ({', '.join(names)})")
    return {name: root / name / step for name in names}


def saved_progress(checkpoint: Path) -> tuple[Progress, Path | None]:
    """A finished checkpoint's step and policy version (the run's step: the backend may update more
    often), and the model its run trained, as its state names it."""
    from lgt.trainer.backends import checkpoints

    updates, extra, base = checkpoints.read_state(checkpoint)
    step = int(extra.get("step", updates))
    return Progress(step=step, version=int(extra.get("version", step))), base


def backends_lora(backend: Any) -> Any:
    """A torch backend's LoRA settings (None: it trains every weight)."""
    return getattr(getattr(backend, "cfg", None), "lora", None)


def adapter_folder(checkpoint: Path) -> Path | None:
    """The PEFT adapter folder a LoRA run's checkpoint holds (``adapter_config.json`` in it, or in its
    ``adapter`` folder), or None (a full model's checkpoint)."""
    for folder in (checkpoint, checkpoint / "adapter"):
        if (folder / "adapter_config.json").is_file():
            return folder
    return None


def with_chat_template(cfg: RunConfig, model_dir: Path, run_dir: Path, name: str = "model") -> Path:
    """``model_dir`` as the run serves, trains and renders it: with ``model.chat_template``, the folder
    ``<run_dir>/<name>`` that holds ``model_dir``'s files (linked) and that template
    (:func:`lgt.trainer.model_dir.with_chat_template`: vLLM, transformers and the checkpoints all read it
    from there); without one, ``model_dir`` itself. ``name``: ``model`` for the config's model (the
    checkpoints name it as their starting model), another for a checkpoint served."""
    from lgt.trainer import model_dir as dirs

    text = chat_template(cfg)
    return model_dir if text is None else dirs.with_chat_template(model_dir, text, run_dir / name)


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


class StoreMirror:
    """The store on S3 (:class:`lgt.store.remote.RemoteStore`), the run's store its local mirror."""

    def __init__(self, remote: Any) -> None:
        self.remote = remote
        self.url: str | None = remote.url

    def pull(self) -> None:
        self.remote.pull()

    async def sync(self, timed: Callable[..., Any]) -> None:
        """The rollouts just recorded up; other replicas' calls down (timed as ``store_sync``)."""
        await timed("store_sync", lambda: (self.remote.push_all(), self.remote.pull()))


class LocalStore:
    """A store in a folder: nothing to pull or push."""

    url: str | None = None

    def pull(self) -> None:
        pass

    async def sync(self, timed: Callable[..., Any]) -> None:
        pass


def _quiet_transformers() -> None:
    """No per-call progress bars from transformers (loading / writing shards at every checkpoint)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    with contextlib.suppress(Exception):
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
