"""The run config: one YAML file describes a training run (``lgt-train run FILE``).

Every section is a frozen dataclass; unknown keys, wrong types and bad values are refused with one
sentence naming the key (``ConfigError``). Relative paths are relative to the YAML file's folder.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

MODES = ("sync", "async")
PROXY_MODES = ("https_proxy", "base_url")
SAMPLE_MODES = ("exact", "realign")


class ConfigError(ValueError):
    """A run config that cannot be used; the message names the bad key."""


@dataclass(frozen=True)
class MakeModel:
    """Build the model locally when ``model.path`` does not exist yet (lgt.trainer.tiny)."""

    preset: str = "demo"
    warm_start: str | None = "arith"  # arith | calc | both | null
    seconds: float = 90.0
    seed: int = 0


@dataclass(frozen=True)
class ModelSection:
    path: Path = Path("model")
    make: MakeModel | None = None


@dataclass(frozen=True)
class EngineSection:
    max_model_len: int = 512
    port: int = 0
    ready_timeout: float = 240.0
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class BackendSection:
    name: str = "torch"
    lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_tokens: int = 4096
    updates_per_step: int = 1  # optimizer steps per training step (the batch split evenly)


@dataclass(frozen=True)
class AlgorithmSection:
    std_normalize: bool = True
    clip_low: float = 0.2
    clip_high: float = 0.28
    is_mode: str = "truncate"
    is_cap: float = 2.0
    kl_coef: float = 0.0
    agg: str = "rollout"
    sample_mode: str = "realign"
    skip_zero_variance: bool = False  # leave groups whose rewards are all equal out of the batch


@dataclass(frozen=True)
class AgentSection:
    command: tuple[str, ...] = ()
    cwd: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    proxy_mode: str = "https_proxy"
    timeout_s: float = 120.0
    retries: int = 1
    evaluator: tuple[str, ...] | None = None
    # Python agents only: modules imported once by a fork server, so each rollout starts warm
    python_preload: tuple[str, ...] | None = None


@dataclass(frozen=True)
class ProxySection:
    url: str | None = None  # a running lgt-proxy's control URL; null: start one
    token: str | None = None  # its control token (or LGT_CONTROL_TOKEN)
    port: int = 0
    control_port: int = 0
    command: tuple[str, ...] | None = None  # how to start lgt-proxy; default: found next to this install


@dataclass(frozen=True)
class RunConfig:
    name: str
    model: ModelSection
    agent: AgentSection
    tasks: Path
    engine: EngineSection = EngineSection()
    backend: BackendSection = BackendSection()
    algorithm: AlgorithmSection = AlgorithmSection()
    proxy: ProxySection = ProxySection()
    mode: str = "async"
    group_size: int = 8
    batch_groups: int = 4
    steps: int = 20
    max_minutes: float | None = None
    max_samples: int | None = None  # stop once this many samples were trained
    target_reward: float | None = None  # stop once the mean reward of the last 10 steps reaches it
    max_staleness: int = 1
    max_inflight: int = 32
    seed: int = 0
    store: Path | None = None  # default: <run_dir>/store
    run_dir: Path | None = None  # default: runs/<name>-<timestamp>
    checkpoint_every: int = 1
    source: Path | None = None  # the YAML file this came from

    def store_path(self, run_dir: Path) -> Path:
        return self.store or run_dir / "store"

    def to_json(self) -> dict[str, Any]:
        return _jsonable(dataclasses.asdict(self))


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
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
    raw.setdefault("name", path.stem if path.stem != "run" else path.parent.name)
    cfg = build(RunConfig, raw, "", path.parent.resolve())
    cfg = dataclasses.replace(cfg, source=path.resolve())
    validate(cfg)
    return cfg


def from_dict(raw: dict[str, Any], base: Path) -> RunConfig:
    cfg = build(RunConfig, dict(raw), "", base)
    validate(cfg)
    return cfg


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    d = raw
    for p in parts[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError(f"cannot set {key}: {p} is not a section")
    d[parts[-1]] = value


def build(cls: type, raw: Any, prefix: str, base: Path) -> Any:
    """``cls`` from a mapping, checking every key and type; paths resolved against ``base``."""
    name = prefix.rstrip(".") or "the run config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{name} must be a mapping, not {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "source"}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key {prefix}{unknown[0]} (known in {name}: {', '.join(fields)})")
    kwargs = {}
    for key, value in raw.items():
        kwargs[key] = convert(hints[key], value, prefix + key, base)
    missing = [k for k, f in fields.items() if k not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{prefix}{missing[0]} is required")
    return cls(**kwargs)


def convert(tp: Any, value: Any, key: str, base: Path) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
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
        return build(tp, value, key + ".", base)
    if tp is Path:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{key} must be a path (a string), not {value!r}")
        p = Path(value).expanduser()
        return p if p.is_absolute() else (base / p)
    if origin is tuple:
        if isinstance(value, str):
            import shlex
            value = shlex.split(value)
        if not isinstance(value, list) or not all(isinstance(x, (str, int, float)) for x in value):
            raise ConfigError(f"{key} must be a list of strings (or one command line)")
        return tuple(str(x) for x in value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping")
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
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    need(cfg.mode in MODES, f"mode must be one of {', '.join(MODES)}, not {cfg.mode!r}")
    need(cfg.group_size >= 1, f"group_size must be at least 1, not {cfg.group_size}")
    need(cfg.batch_groups >= 1, f"batch_groups must be at least 1, not {cfg.batch_groups}")
    need(cfg.steps >= 1, f"steps must be at least 1, not {cfg.steps}")
    need(cfg.max_staleness >= 0, f"max_staleness must be 0 or more, not {cfg.max_staleness}")
    need(cfg.max_inflight >= cfg.group_size,
         f"max_inflight ({cfg.max_inflight}) must hold at least one group ({cfg.group_size} rollouts)")
    need(cfg.checkpoint_every >= 1, f"checkpoint_every must be at least 1, not {cfg.checkpoint_every}")
    need(bool(cfg.agent.command), "agent.command is required: the program that runs one rollout")
    need(cfg.agent.proxy_mode in PROXY_MODES,
         f"agent.proxy_mode must be one of {', '.join(PROXY_MODES)}, not {cfg.agent.proxy_mode!r}")
    need(cfg.agent.timeout_s > 0, f"agent.timeout_s must be positive, not {cfg.agent.timeout_s}")
    need(cfg.agent.retries >= 0, f"agent.retries must be 0 or more, not {cfg.agent.retries}")
    need(cfg.backend.name in ("torch", "verl"),
         f"backend.name must be torch or verl, not {cfg.backend.name!r}")
    need(cfg.backend.lr > 0, f"backend.lr must be positive, not {cfg.backend.lr}")
    need(cfg.backend.updates_per_step >= 1, "backend.updates_per_step must be at least 1")
    need(cfg.algorithm.sample_mode in SAMPLE_MODES,
         f"algorithm.sample_mode must be one of {', '.join(SAMPLE_MODES)}, not {cfg.algorithm.sample_mode!r}")
    need(cfg.engine.max_model_len >= 16, "engine.max_model_len must be at least 16")
    need(cfg.tasks.suffix in (".jsonl", ".json", ".parquet"),
         f"tasks must be a .jsonl or .parquet file, not {cfg.tasks.name}")
    need(cfg.max_minutes is None or cfg.max_minutes > 0, "max_minutes must be positive")
    if cfg.proxy.url is not None:
        need(cfg.proxy.url.startswith(("http://", "https://")),
             f"proxy.url must be the control API's http(s) URL, not {cfg.proxy.url!r}")
        need(cfg.store is not None, "store is required with proxy.url: the running proxy's --store folder")


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


def default_run_dir(cfg: RunConfig, cwd: Path | None = None) -> Path:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return (cwd or Path.cwd()) / "runs" / f"{cfg.name}-{stamp}"
