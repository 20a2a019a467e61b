"""The run config: one YAML file describes a training run (``lgt-train run FILE``).

A section of the run config *is* its component's config, not a copy of it: ``agent`` is the rollout
controller's :class:`~lgt.trainer.rollout.agent.AgentSpec`, ``engine`` the engine's
:class:`~lgt.trainer.serving.launch.EngineConfig`, ``backend`` the chosen backend's config
(:data:`lgt.trainer.backends.base.BACKENDS`, picked by ``backend.name``), ``algorithm`` the
:class:`~lgt.trainer.rl.algorithm.AlgorithmConfig` whose loss settings every backend uses. Each class
checks its own values when built; this module reads YAML into them, checking every key and type, and
refuses what the run sets itself (``backend.loss`` comes from ``algorithm``, ``engine.model`` is the
model being trained). ``ConfigError`` names the bad key in one sentence. Relative paths are relative to
the YAML file's folder. Nothing here imports torch, verl or vLLM: a config is checked in milliseconds.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import datetime as dt
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lgt.proxy import policies as proxy_policies
from lgt.trainer.apo.optimize import ApoConfig
from lgt.trainer.backends.base import BACKENDS, TorchConfig, VerlConfig
from lgt.trainer.distill.teacher import TeacherSection, tokenizer_mismatch
from lgt.trainer.distill.traces import SftConfig
from lgt.trainer.make_model import MakeModel
from lgt.trainer.report import trackers
from lgt.trainer.rl.algorithm import AlgorithmConfig, LossConfig
from lgt.trainer.rollout.agent import AgentSpec
from lgt.trainer.rollout.resources import ResourceSpec
from lgt.trainer.run.admission import STALENESS
from lgt.trainer.run.evaluation import EvalConfig
from lgt.trainer.serving.launch import EngineConfig, lora_max_rank, lora_rank_of
from lgt.trainer.serving.proxy import ProxySection

MODES = ("sync", "async")
BackendConfig = TorchConfig | VerlConfig
# Fields the run sets itself; a run config that names one is refused (what sets it, in the message).
SET_BY_RUN = {
    (TorchConfig, "loss"): "the algorithm section", (VerlConfig, "loss"): "the algorithm section",
    (VerlConfig, "model_path"): "model.path (or the checkpoint resumed)",
    (EngineConfig, "model"): "model.path (or the checkpoint resumed)",
    (EngineConfig, "log_path"): "the run (<run_dir>/logs/engine.log)",
    (EngineConfig, "seed"): "the run's seed",
    (EngineConfig, "lora_rank"): "backend.lora.rank",
}


class ConfigError(ValueError):
    """A run config that cannot be used; the message names the bad key."""


@dataclass(frozen=True)
class ModelSection:
    path: Path = Path("model")
    make: MakeModel | None = None
    # a Jinja chat template used instead of the model's own by the engine and by everything that renders
    # (lgt.trainer.model_dir.with_chat_template); checked before anything starts (preflight.validate)
    chat_template: Path | None = None


@dataclass(frozen=True)
class RunConfig:
    name: str
    model: ModelSection
    agent: AgentSpec
    tasks: Path
    engine: EngineConfig = EngineConfig(max_model_len=512)
    backend: BackendConfig = TorchConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    proxy: ProxySection = ProxySection()
    eval: EvalConfig | None = None  # held-out evaluation (lgt.trainer.run.evaluation); null: none
    resources: dict[str, ResourceSpec] = dataclasses.field(default_factory=dict)  # prompts (resources.py)
    apo: ApoConfig | None = None  # lgt-train apo: which resource, the optimiser, the critic (apo.py)
    teacher: TeacherSection | None = None  # on-policy distillation's teacher (distill/teacher.py)
    sft: SftConfig | None = None  # lgt-train sft: which of the teacher's traces (distill/traces.py)
    # several policies in one run: [{name, match, served}, ...], the first the default; which policy each
    # call belongs to is the proxy's rule (lgt.proxy.policies, docs/policies.md). null: one policy
    policies: Any = None
    mode: str = "async"
    group_size: int = 8
    batch_groups: int = 4
    steps: int = 20
    max_minutes: float | None = None
    max_samples: int | None = None  # stop once this many samples were trained
    target_reward: float | None = None  # stop once the mean reward of the last 10 steps reaches it
    max_staleness: int = 1
    # what is done with a generated token more than max_staleness versions behind the policy trained
    # (lgt.trainer.run.admission.prepare): truncate (trained, its importance weight truncated: nothing
    # generated is thrown away), mask (left out of the loss), group (its whole group dropped: the
    # behaviour before per-token versions)
    staleness: str = "truncate"
    max_inflight: int = 32
    seed: int = 0
    store: Path | None = None  # default: <run_dir>/store; s3://bucket/prefix: on S3 (kept as a string)
    run_dir: Path | None = None  # default: runs/<name>-<timestamp>
    checkpoint_every: int = 1
    # the newest N finished checkpoints are kept, older ones deleted once a newer one is finished (a real
    # model's checkpoint is its weights and optimizer: 0.7 GB for 135M parameters); null keeps every one
    keep_checkpoints: int | None = 3
    restarts: int = 3  # a dead engine (or a proxy the run started) is started again this often per run
    # experiment trackers the run also writes to (lgt.trainer.report.trackers): console (nothing more),
    # tensorboard, wandb, mlflow; one name or a list
    log: tuple[str, ...] = ("console",)
    source: Path | None = None  # the YAML file this came from

    def store_path(self, run_dir: Path) -> Path:
        """The store's folder: for ``s3://…``, its local mirror (:mod:`lgt.store.remote`)."""
        if self.store_remote() is not None:
            from lgt.store.remote import RemoteStore
            return RemoteStore(str(self.store)).local
        return Path(self.store) if self.store else run_dir / "store"

    def store_remote(self) -> Any:
        """The store on S3 (:class:`lgt.store.remote.RemoteStore`), or None for a folder."""
        from lgt.store.remote import RemoteStore, is_remote

        return RemoteStore(str(self.store)) if self.store is not None and is_remote(self.store) else None

    def to_json(self) -> dict[str, Any]:
        return _jsonable(self)


def _jsonable(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _jsonable(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, collections.abc.Mapping):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, Path):
        return str(v)
    return v


def load(path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Read and validate a run config file; ``overrides`` are dotted keys (``mode``, ``backend.lr``)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"run config {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" (line {where.line + 1})" if where else ""
        raise ConfigError(f"run config {path} is not valid YAML{at}: {getattr(e, 'problem', e)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"run config {path} must be a mapping of keys to values")
    for key, value in (overrides or {}).items():
        _set_dotted(raw, key, value)
    path = path.resolve()  # `run.yaml` given from its own folder is named after that folder, not ""
    raw.setdefault("name", path.stem if path.stem != "run" else path.parent.name)
    cfg = from_dict(raw, path.parent)
    return dataclasses.replace(cfg, source=path)


RUN_FILE = "config.json"  # in a run directory: the config the run was trained with (RunConfig.to_json)
# What a run's checkpoints were made with: a resume cannot change these (another backend, world size
# or model would not read them).
FIXED_ON_RESUME = ("backend.name", "backend.world_size", "backend.lora", "model.path")
_SECTION_OF = {TorchConfig: "backend", VerlConfig: "backend", EngineConfig: "engine"}


def saved(run_dir: Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """The config ``run_dir``'s run was trained with (its ``config.json``), ``overrides`` on top: what
    ``--resume`` continues. An override of what the checkpoints were made with (:data:`FIXED_ON_RESUME`)
    is refused in one sentence."""
    path = run_dir / RUN_FILE
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a run directory (it has no {RUN_FILE})")
    try:
        raw = json.loads(path.read_text())
    except ValueError:
        raise ConfigError(f"{path} is not valid JSON: the run's record of its config is damaged") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} is not a run config")
    source = raw.pop("source", None)
    teacher = raw.get("teacher")
    for (cls, key) in SET_BY_RUN:  # written by the run, not by the user: set again by from_dict
        sections = [raw.get(_SECTION_OF[cls])]
        if cls is EngineConfig and isinstance(teacher, dict):
            sections.append(teacher.get("engine"))
        for section in sections:
            if isinstance(section, dict):
                section.pop(key, None)
    was = from_dict(json.loads(json.dumps(raw)), run_dir)
    name = (overrides or {}).get("backend.name", was.backend.name)
    if name != was.backend.name:  # checked first: the other backend's keys would not even build
        _refuse_resume(run_dir, "backend.name", was.backend.name, name)
    for key, value in (overrides or {}).items():
        _set_dotted(raw, key, value)
    cfg = from_dict(raw, run_dir)
    for key in FIXED_ON_RESUME:
        before, after = _attr(was, key), _attr(cfg, key)
        if before != after:
            _refuse_resume(run_dir, key, before, after)
    return dataclasses.replace(cfg, source=Path(source) if isinstance(source, str) else None)


def _attr(cfg: Any, key: str) -> Any:
    for p in key.split("."):
        cfg = getattr(cfg, p, None)
    return str(cfg) if isinstance(cfg, Path) else cfg


def _refuse_resume(run_dir: Path, key: str, was: Any, now: Any) -> None:
    raise ConfigError(f"{key} was {was!r} when {run_dir.name} was trained, and its checkpoints cannot be "
                      f"resumed with {now!r}: start a new run for that")


def differences(a: RunConfig, b: RunConfig) -> list[str]:
    """The dotted keys whose values differ between two configs (``source`` aside)."""
    def flat(v: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(v, dict):
            out: dict[str, Any] = {}
            for k, x in v.items():
                out.update(flat(x, f"{prefix}{k}."))
            return out
        return {prefix.rstrip("."): v}
    fa, fb = flat(a.to_json()), flat(b.to_json())
    keys = {k for k in fa.keys() | fb.keys() if k != "source" and fa.get(k) != fb.get(k)}
    if a.backend.name != b.backend.name:  # two backends' configs: the section differs as a whole
        keys = {k for k in keys if not k.startswith("backend.")} | {"backend"}
    return sorted(keys)


def from_dict(raw: dict[str, Any], base: Path) -> RunConfig:
    cfg = build(RunConfig, dict(raw), "", base)
    cfg = _derive(cfg, base, raw)
    validate(cfg)
    return cfg


def _derive(cfg: RunConfig, base: Path, raw: dict[str, Any] | None = None) -> RunConfig:
    """Fill in what one section takes from another: the backend's loss from ``algorithm``, the torch
    backend's longest sample from the engine's context, the started teacher's engine from the run's
    (keys ``teacher.engine`` leaves out: the run's, with one more position of context, since the
    teacher is asked for one token after the longest sample); the agent runs in the config's folder
    unless ``agent.cwd`` says otherwise (its sandbox's relative mounts are relative to that folder)."""
    if cfg.teacher is not None and cfg.teacher.path is not None:
        student = cfg.engine
        start = dataclasses.replace(student, url=None, max_model_len=student.max_model_len + 1
                                    if student.max_model_len else None)
        written = ((raw or {}).get("teacher") or {}).get("engine")
        engine = build(EngineConfig, written, "teacher.engine.", base, start) if written else start
        cfg = dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, engine=engine))
    loss = LossConfig(**{f.name: getattr(cfg.algorithm, f.name) for f in dataclasses.fields(LossConfig)})
    changes: dict[str, Any] = {"loss": loss}
    if isinstance(cfg.backend, TorchConfig) and cfg.backend.max_seq_len is None:
        changes["max_seq_len"] = cfg.engine.max_model_len
    agent = cfg.agent if cfg.agent.cwd is not None else dataclasses.replace(cfg.agent, cwd=base)
    mounts = tuple(m if m.is_absolute() else Path(agent.cwd or base) / m for m in agent.sandbox.mounts)
    if mounts != agent.sandbox.mounts:
        agent = dataclasses.replace(agent, sandbox=dataclasses.replace(agent.sandbox, mounts=mounts))
    try:
        return dataclasses.replace(cfg, backend=dataclasses.replace(cfg.backend, **changes), agent=agent)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    d = raw
    for p in parts[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError(f"cannot set {key}: {p} is not a section")
    d[parts[-1]] = value


def build(cls: type, raw: Any, prefix: str, base: Path, start: Any = None) -> Any:
    """``cls`` from a mapping, checking every key and type; paths resolved against ``base``. ``start``:
    the section's default (an instance of ``cls``), whose values stand for the keys the mapping leaves
    out — a section written with one key changes that key only (``engine: {extra_args: …}`` keeps the
    run's default ``max_model_len``), so a section has one default whether it is written or not."""
    name = prefix.rstrip(".") or "the run config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{name} must be a mapping, not {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "source"}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key {prefix}{unknown[0]} (known in {name}: "
                          f"{', '.join(k for k in fields if (cls, k) not in SET_BY_RUN)})")
    kwargs = {}
    for key, value in raw.items():
        if (cls, key) in SET_BY_RUN:
            raise ConfigError(f"{prefix}{key} is set by {SET_BY_RUN[cls, key]}; leave it out")
        kwargs[key] = convert(hints[key], value, prefix + key, base, fields[key].default)
    if start is not None:
        kwargs = {**{f.name: getattr(start, f.name) for f in dataclasses.fields(cls) if f.init
                     and f.name in fields}, **kwargs}
    missing = [k for k, f in fields.items() if k not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{prefix}{missing[0]} is required")
    try:
        return cls(**kwargs)
    except ValueError as e:  # the component's own check of its values
        text = str(e)
        raise ConfigError(text if not prefix or text.startswith(prefix) else f"{name}: {text}") from None


def convert(tp: Any, value: Any, key: str, base: Path, default: Any = None) -> Any:
    """``value`` as type ``tp``; ``default``: the field's default (a section's, see :func:`build`)."""
    if tp is Any:  # a section its component reads and checks itself (policies: validate)
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is BackendConfig or (origin in (typing.Union, types.UnionType)
                               and all(dataclasses.is_dataclass(a) for a in args)):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, not {type(value).__name__}")
        name = value.get("name", "torch")
        if name not in BACKENDS:
            raise ConfigError(f"{key}.name must be one of {', '.join(BACKENDS)}, not {name!r}")
        cls = BACKENDS[name].config
        return build(cls, value, key + ".", base, default if isinstance(default, cls) else None)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{key} must not be null")
        inner = [a for a in args if a is not type(None)]
        return convert(inner[0], value, key, base)
    if value is None:
        raise ConfigError(f"{key} must not be null")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, str) and "kind" in {f.name for f in dataclasses.fields(tp)}:
            value = {"kind": value}  # e.g. agent.sandbox: none
        return build(tp, value, key + ".", base, default if isinstance(default, tp) else None)
    if tp is Path:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{key} must be a path (a string), not {value!r}")
        if key == "store" and value.startswith("s3://"):  # a store on S3: see lgt.store.remote
            return value
        p = Path(value).expanduser()
        return p if p.is_absolute() else (base / p)
    if origin is tuple:
        if args and args[-1] is not Ellipsis:  # a fixed-size tuple, e.g. betas: [0.9, 0.999]
            if not isinstance(value, list) or len(value) != len(args):
                raise ConfigError(f"{key} must be a list of {len(args)} values, not {value!r}")
            return tuple(convert(a, v, f"{key}[{i}]", base) for i, (a, v) in enumerate(zip(args, value)))
        if isinstance(value, str):
            import shlex
            value = shlex.split(value)
        if not isinstance(value, list) or not all(isinstance(x, (str, int, float)) for x in value):
            raise ConfigError(f"{key} must be a list of strings (or one command line)")
        return tuple(str(x) for x in value)
    if origin in (dict, collections.abc.Mapping):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping")
        if dataclasses.is_dataclass(args[1]):  # e.g. resources: {name: {template: …}}
            return {str(k): build(args[1], v, f"{key}.{k}.", base) for k, v in value.items()}
        return {str(k): str(v) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, not {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, not {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            try:
                return float(value) if isinstance(value, str) else _bad(key, value)
            except ValueError:
                _bad(key, value)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, not {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported value {value!r}")


def _bad(key: str, value: Any) -> Any:
    raise ConfigError(f"{key} must be a number, not {value!r}")


def validate(cfg: RunConfig) -> None:
    """The run's own rules (each section checked its values when built)."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    need(bool(cfg.name) and "/" not in cfg.name and cfg.name not in (".", ".."),
         f"name must be a name for the run's folder (no '/'), not {cfg.name!r}")
    need(cfg.mode in MODES, f"mode must be one of {', '.join(MODES)}, not {cfg.mode!r}")
    need(cfg.group_size >= 1, f"group_size must be at least 1, not {cfg.group_size}")
    need(cfg.batch_groups >= 1, f"batch_groups must be at least 1, not {cfg.batch_groups}")
    need(cfg.steps >= 1, f"steps must be at least 1, not {cfg.steps}")
    need(cfg.max_staleness >= 0, f"max_staleness must be 0 or more, not {cfg.max_staleness}")
    need(cfg.staleness in STALENESS,
         f"staleness must be one of {', '.join(STALENESS)}, not {cfg.staleness!r}")
    need(cfg.max_inflight >= cfg.group_size,
         f"max_inflight ({cfg.max_inflight}) must hold at least one group ({cfg.group_size} rollouts)")
    need(cfg.checkpoint_every >= 1, f"checkpoint_every must be at least 1, not {cfg.checkpoint_every}")
    need(cfg.keep_checkpoints is None or cfg.keep_checkpoints >= 1,
         f"keep_checkpoints must be at least 1 (or null: keep every one), not {cfg.keep_checkpoints}")
    need(isinstance(cfg.restarts, int) and not isinstance(cfg.restarts, bool) and cfg.restarts >= 0,
         f"restarts must be a whole number ≥ 0, not {cfg.restarts!r}")
    need(cfg.engine.max_model_len is None or cfg.engine.max_model_len >= 16,
         "engine.max_model_len must be at least 16")
    lora = getattr(cfg.backend, "lora", None) if isinstance(cfg.backend, TorchConfig) else None
    if lora is not None and cfg.engine.serve_adapters:  # the adapters' rank within its --max-lora-rank
        try:
            lora_max_rank(lora_rank_of(lora), cfg.engine.max_lora_rank)
        except ValueError as e:
            need(False, str(e))
    need(cfg.tasks.suffix in (".jsonl", ".json", ".parquet"),
         f"tasks must be a .jsonl or .parquet file, not {cfg.tasks.name}")
    need(cfg.max_minutes is None or cfg.max_minutes > 0, "max_minutes must be positive")
    if cfg.proxy.url is not None:
        bad = [u for u in cfg.proxy.url if not u.startswith(("http://", "https://"))] or \
            ([] if cfg.proxy.url else ["nothing"])
        need(not bad, "proxy.url must be the control API's http(s) URL (or a list of them, one per "
                      f"replica), not {bad[:1] and bad[0]!r}")
        need(cfg.store is not None, "store is required with proxy.url: the running proxy's --store folder")
        need(cfg.proxy.upstream_timeout_s is None, "proxy.upstream_timeout_s sets a proxy the run starts; "
             "give the running proxy --upstream-timeout instead")
        need(cfg.proxy.max_output_tokens is None, "proxy.max_output_tokens sets a proxy the run starts; "
             "give the running proxy --max-output-tokens instead")
    if cfg.apo is not None:
        need(cfg.apo.resource in cfg.resources, f"apo.resource {cfg.apo.resource!r} is not one of the run's "
             f"resources ({', '.join(cfg.resources) or 'it has none: add a resources section'})")
    t = cfg.proxy.upstream_timeout_s
    need(t is None or t > 0, f"proxy.upstream_timeout_s must be a positive number of seconds, not {t}")
    bad_log = trackers.problem(cfg.log)
    need(bad_log is None, bad_log or "")
    if cfg.policies is not None:
        try:
            proxy_policies.parse(proxy_section(cfg.policies))
        except proxy_policies.PolicyError as e:
            raise ConfigError(str(e)) from None
    validate_teacher(cfg)


POLICY_BACKEND = "backend"  # a policy's own backend settings: the trainer's, never the proxy's
# a policy's keys that are the trainer's, never the proxy's: its backend settings, and for a full model on
# an engine of its own, that model and engine (the proxy gets the engine's URL and name instead)
TRAINER_KEYS = (POLICY_BACKEND, "model", "engine")


@dataclass(frozen=True)
class OwnEngine:
    """A policy that is a full model on an engine of its own (``policies[i].model``): its model section
    and its engine's config (the run's ``engine`` with the policy's own ``engine`` keys over it)."""

    model: ModelSection
    engine: EngineConfig
    key: str  # where the section says it: policies[i].model


def proxy_section(policies: Any) -> Any:
    """The ``policies`` section as lgt-proxy reads it (``--policies FILE``): each policy without the
    trainer's keys (:data:`TRAINER_KEYS`)."""
    if not isinstance(policies, list):
        return policies
    return [{k: v for k, v in p.items() if k not in TRAINER_KEYS} if isinstance(p, dict) else p
            for p in policies]


def several_policies(cfg: RunConfig) -> bool:
    """Whether the run trains several policies (a ``policies`` section of two or more); one policy
    trains as a run without the section does."""
    return isinstance(cfg.policies, list) and len(cfg.policies) > 1


def own_engines(cfg: RunConfig) -> dict[str, OwnEngine]:
    """The policies that are full models on engines of their own (a ``model`` section: its ``path``, and
    ``make`` as the run's ``model.make``), each with its engine (the run's ``engine`` section with the
    policy's own ``engine`` keys over it), in the section's order. ConfigError (one sentence): ``model``
    on the first policy (the run's model is the first policy's), ``engine`` without ``model``, an engine
    at a URL, a bad key."""
    base = cfg.source.parent if cfg.source is not None else Path.cwd()
    out: dict[str, OwnEngine] = {}
    for i, p in enumerate(cfg.policies or []):
        where = f"policies[{i}]"
        if p.get("model") is None:
            if p.get("engine") is not None:
                raise ConfigError(f"{where}.engine is for a policy on an engine of its own: give it a model "
                                  f"too ({where}.model: {{path: ...}}), or set the run's engine section")
            continue
        if i == 0:
            raise ConfigError(f"{where}.model: the first policy is the run's own model (model.path), served "
                              "by the run's engine; put the policy on an engine of its own later in the list")
        model = build(ModelSection, p["model"], f"{where}.model.", base)
        engine = build(EngineConfig, p.get("engine") or {}, f"{where}.engine.", base, cfg.engine)
        if engine.url is not None:
            raise ConfigError(f"{where}.engine.url: lgt-train run starts a policy's own engine (an engine "
                              "at a URL serves the weights it has, not the policy's): leave it out")
        out[p["name"]] = OwnEngine(model, engine, f"{where}.model")
    return out


def policy_backends(cfg: RunConfig) -> dict[str, BackendConfig]:
    """Each policy's backend config, in the section's order: the run's ``backend`` section with the
    policy's own ``backend`` keys written over it (a ``lora`` mapping over the run's ``lora`` key by
    key), so a policy changes only what it names. A policy on an engine of its own
    (:func:`own_engines`) trains its full weights (the run's ``lora`` is not its). The policies on the
    run's engine: one trains as a run without the section does (every weight, or an adapter with
    ``backend.lora``); several are LoRA adapters on the shared base model, one engine serving them all.
    ConfigError (one sentence, before anything starts) for what ``lgt-train run`` cannot train: several
    policies on the run's engine without ``backend.lora``, on another backend than torch, or with the
    engine's adapters switched off; a policy at an ``upstream`` of its own (lgt-train run starts a
    policy's own engine: ``model``); ``served`` with several policies (the run names each one's model);
    ``lora`` for a policy on its own engine; a bad key in a policy's ``backend``."""
    base = cfg.source.parent if cfg.source is not None else Path.cwd()
    out: dict[str, BackendConfig] = {}
    several = several_policies(cfg)
    own = own_engines(cfg)
    for i, p in enumerate(cfg.policies or []):
        where = f"policies[{i}]"
        if p.get("upstream") is not None:
            raise ConfigError(f"{where} ({p['name']}) has an upstream of its own, whose weights lgt-train "
                              f"run cannot update: give it a model ({where}.model: {{path: ...}}) and the "
                              "run starts and trains its engine")
        if several and p.get("served") is not None:
            raise ConfigError(f"{where}.served is set by lgt-train run (a policy's adapter is served as "
                              f"<name>-v<version>, a policy's own engine as <name>, here {p['name']}): "
                              "leave it out")
        mine = p.get(POLICY_BACKEND) or {}
        if not isinstance(mine, dict):
            raise ConfigError(f"{where}.backend must be a mapping of backend keys (e.g. {{lr: 1e-5}}), "
                              f"not {mine!r}")
        if mine and not several:
            raise ConfigError(f"{where}.backend is for a run of several policies: with one policy, set the "
                              "run's backend section instead")
        if "name" in mine:
            raise ConfigError(f"{where}.backend.name: every policy trains on the run's backend "
                              f"({cfg.backend.name}); leave it out")
        raw = dict(mine)
        run_lora = getattr(cfg.backend, "lora", None)
        if p["name"] in own:
            if raw.get("lora") is not None:
                raise ConfigError(f"{where}.backend.lora: a policy on an engine of its own trains its full "
                                  "weights; leave lora out")
            if run_lora is not None:
                raw["lora"] = None
        elif isinstance(raw.get("lora"), dict) and run_lora is not None:
            raw["lora"] = {**_jsonable(run_lora), **raw["lora"]}
        out[p["name"]] = build(type(cfg.backend), raw, f"{where}.backend.", base, cfg.backend) if raw \
            else cfg.backend
    if not several:
        return out
    if cfg.backend.name != "torch":
        raise ConfigError(f"several policies are trained by the torch backend, not {cfg.backend.name}: set "
                          "backend: {name: torch, lora: {rank: 8}}")
    if cfg.algorithm.estimator == "opd":
        raise ConfigError("on-policy distillation (algorithm.estimator: opd) trains one policy: leave out "
                          "the policies section or the estimator")
    shared = {name: b for name, b in out.items() if name not in own}
    if len(shared) < 2:  # the run's engine serves one policy: as a run without the section
        return out
    for name, b in shared.items():
        i = next(j for j, p in enumerate(cfg.policies) if p["name"] == name)
        lora = getattr(b, "lora", None)
        if lora is None:
            raise ConfigError(f"{len(shared)} policies on the run's engine need backend.lora: each trains a "
                              "LoRA adapter on the shared base model, served by the one engine (add e.g. "
                              "backend: {lora: {rank: 8}}, or give a policy an engine of its own: model)"
                              if getattr(cfg.backend, "lora", None) is None else
                              f"policies[{i}].backend.lora is null: each of several policies on the run's "
                              "engine trains a LoRA adapter")
        if cfg.engine.serve_adapters:
            try:
                lora_max_rank(lora_rank_of(lora), cfg.engine.max_lora_rank)
            except ValueError as e:
                raise ConfigError(f"policy {name!r}: {e}") from None
    if not cfg.engine.serve_adapters:
        raise ConfigError("several policies on the run's engine need it to serve their adapters side by "
                          "side: leave engine.serve_adapters at true")
    return out


def validate_teacher(cfg: RunConfig) -> None:
    """On-policy distillation's rules: ``estimator: opd`` needs a teacher, a teacher is for ``opd`` only,
    the torch backend trains it, and the teacher's tokenizer is the student's (compared when both model
    directories exist already; a model still to be made is compared once made, before any engine
    starts: :meth:`lgt.trainer.policy.Policy.ensure_teacher`)."""
    opd = cfg.algorithm.estimator == "opd"
    if opd and cfg.teacher is None:
        raise ConfigError("algorithm.estimator: opd needs a teacher section to score the student's tokens "
                          "(teacher: {path: MODEL_DIR} or teacher: {url: http://host:port/v1})")
    if cfg.teacher is not None and not opd:
        raise ConfigError(f"the teacher section is used only by algorithm.estimator: opd, not "
                          f"{cfg.algorithm.estimator!r}: set estimator: opd or leave the teacher out")
    if opd and cfg.backend.name != "torch" and cfg.teacher is not None and cfg.teacher.top_k:
        raise ConfigError(f"teacher.top_k adds a term over the student's whole vocabulary to the torch "
                          f"backend's loss, which the {cfg.backend.name} backend does not compute: set "
                          f"teacher.top_k: 0 (the sampled log-ratio only) or use backend: {{name: torch}}")
    if cfg.teacher is not None and cfg.teacher.path is not None:
        mismatch = teacher_tokenizer_problem(cfg.model.path, cfg.teacher.path)
        if mismatch:
            raise ConfigError(mismatch)


def teacher_tokenizer_problem(student: Path, teacher: Path) -> str | None:
    """:func:`~lgt.trainer.distill.teacher.tokenizer_mismatch` when both directories hold a tokenizer, else
    None (one still to be made)."""
    has = [(d / "tokenizer.json").is_file() or (d / "vocab.json").is_file() for d in (student, teacher)]
    return tokenizer_mismatch(student, teacher) if all(has) else None


def load_tasks(path: Path) -> list[dict[str, Any]]:
    """Tasks from JSONL or Parquet; each needs a unique ``task_id`` (else its row number is used)."""
    if not path.is_file():
        raise ConfigError(f"tasks file {path} does not exist")
    rows: list[dict[str, Any]] = []
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # noqa: BLE001 - any unreadable file is one message
            raise ConfigError(f"tasks file {path} is not a readable Parquet file: {e}") from None
    else:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise ConfigError(f"tasks file {path} line {n} is not JSON") from None
            if not isinstance(row, dict):
                raise ConfigError(f"tasks file {path} line {n} must be a JSON object")
            rows.append(row)
    if not rows:
        raise ConfigError(f"tasks file {path} holds no tasks")
    seen: set[str] = set()
    for i, row in enumerate(rows):
        tid = str(row.get("task_id", i))
        if tid in seen:
            raise ConfigError(f"tasks file {path}: task_id {tid!r} appears twice")
        seen.add(tid)
        row["task_id"] = tid
    return rows


def split_tasks(cfg: RunConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The run's training tasks and its held-out ones (``eval``: a file of their own or a share split
    off: lgt.trainer.run.evaluation.split_tasks); ConfigError (one sentence) when they cannot be read."""
    from lgt.trainer.run import evaluation

    tasks = load_tasks(cfg.tasks)
    held = load_tasks(cfg.eval.tasks) if cfg.eval is not None and cfg.eval.tasks else None
    try:
        return evaluation.split_tasks(tasks, cfg.eval, held)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def default_run_dir(cfg: RunConfig, cwd: Path | None = None) -> Path:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return (cwd or Path.cwd()) / "runs" / f"{cfg.name}-{stamp}"
