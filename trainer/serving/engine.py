"""The vLLM inference engine as a managed subprocess: start, health, pause/resume, weight sync, stop.

``Engine.start(EngineConfig(model=DIR))`` runs vLLM (its command line and environment:
:mod:`lgt.trainer.serving.launch`) in its own process group, logs to a file, and returns once
``/health`` and ``/v1/models`` answer 200 and one warm-up request has done what vLLM does once for the
first call asking for logprobs (:meth:`Engine.warm_up`; ``Engine.attach`` warms a running engine the
same way).

Weight sync without a restart (``Engine.update_weights``): the tensors (Hugging Face names) are handed
to the workers (:mod:`lgt.trainer.serving.weights`: a file, shared memory or CUDA IPC handles), then
pause(wait) -> the workers load them (``/collective_rpc``) -> reset the prefix cache (cached KV of the
old weights would be served otherwise) -> resume. An engine started for LoRA (``cfg.lora_rank``) also
takes adapters without a restart: ``load_adapter(name, folder)`` (a PEFT folder) serves it under its own
name beside the base model, ``unload_adapter(name)`` stops serving it.

Every call first checks that the process is alive; a dead engine raises ``EngineError`` naming its pid,
exit code and log. ``stop()`` sends SIGTERM to the whole process group (vLLM's engine core is a child
process), then SIGKILL; it is idempotent and also runs at interpreter exit for engines left running.
"""

from __future__ import annotations

import atexit
import logging
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import httpx
    import torch

from lgt.trainer.model_dir import check_model_dir
from lgt.trainer.serving import children
from lgt.trainer.serving.launch import (
    EngineConfig,
    EngineError,
    build_command,
    build_env,
    engine_dtype,
    engine_python,
    is_cpu_build,
    lora_max_rank,
    make_scratch,
)
from lgt.trainer.serving.weights import (
    LOAD_METHODS,
    TRANSPORTS,
    SyncTimings,
    check_weights,
    checkpoint_shapes,
    collect_tensors,
    ipc_payload,
    shm_pack,
    weights_dir,
    write_weights,
)

log = logging.getLogger(__name__)

PAUSE_MODES = ("wait", "keep", "abort")
T = TypeVar("T")
WATCH_S = 2.0  # how often a request without a time limit looks at the engine's /health
HEALTH_MISSES = 3  # misses in a row after which an engine that we started is taken for dying
DYING_S = 15.0  # the most a failed request waits for an engine that stopped answering /health to exit


def adapter_rank(folder: Path) -> int | None:
    """The rank ``r`` a PEFT adapter folder's adapter_config.json gives (None: it gives none)."""
    import json

    try:
        r = json.loads((Path(folder) / "adapter_config.json").read_text()).get("r")
    except (OSError, ValueError, AttributeError):
        return None
    return r if isinstance(r, int) and not isinstance(r, bool) else None


class Engine:
    """A running vLLM server (see the module docstring). Build with ``Engine.start(cfg)``."""

    def __init__(self, cfg: EngineConfig, proc: subprocess.Popen | None, port: int, log_path: Path | None, *,
                 cpu: bool, weight_shapes: Mapping[str, tuple[int, ...]], tied: bool,
                 base_url: str | None = None) -> None:
        self.cfg = cfg
        self.proc = proc  # None: attached to an engine this process did not start (Engine.attach)
        self.port = port
        self.log_path = log_path
        self.cpu = cpu
        self.base_url = base_url or f"http://{cfg.host}:{port}"
        self.last_sync: SyncTimings | None = None
        self.weight_shapes = dict(weight_shapes)  # the checkpoint's names and shapes, checked on update
        self.tied = tied
        self._stopped = False
        self.scratch: str | None = None  # the engine's temporary folder (build_env), removed by stop()
        self._dead: str | None = None  # why the engine is unusable, once its process exited
        self._asleep = False
        self.dtype_note: str | None = None  # what vLLM computes in and why, for the run's log (start sets it)
        import httpx

        self._client = httpx.Client(base_url=self.base_url, trust_env=False, timeout=60.0)
        atexit.register(self.stop)

    # -- lifecycle

    @classmethod
    def start(cls, cfg: EngineConfig) -> Engine:
        """Start vLLM for ``cfg`` and wait until it serves (raises ModelError / EngineError, one sentence)."""
        if cfg.model is None:
            raise EngineError("the engine config names no model directory to serve")
        info = check_model_dir(cfg.model)
        info.check_context(cfg.max_model_len)
        if cfg.port and not children.port_is_free(cfg.host, cfg.port):
            raise EngineError(f"port {cfg.port} on {cfg.host} is already in use: choose another engine port "
                              "or 0 for a free one")
        port = cfg.port or children.free_port(cfg.host)
        shapes = checkpoint_shapes(cfg.model)
        python = engine_python(cfg)
        cpu = is_cpu_build(python)
        log_path = cfg.log_path or Path(tempfile.mkstemp(prefix="lgt-vllm-", suffix=".log")[1])
        log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = build_command(cfg, port, cpu=cpu, python=python)
        dtype, why = engine_dtype(cfg.dtype, cpu=cpu)
        dtype_note = f"vLLM computes in {dtype or 'the checkpoint dtype'} ({why})"
        log.info("starting vLLM (%s build) on port %d, log %s; %s", "CPU" if cpu else "GPU", port, log_path,
                 dtype_note)
        log.debug("vLLM command: %s", " ".join(cmd))
        scratch = make_scratch()
        try:
            with open(log_path, "ab") as log_file:
                env = build_env(cfg, cpu=cpu, scratch=scratch)
                proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                        preexec_fn=children.die_with_parent)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        engine = cls(cfg, proc, port, log_path, cpu=cpu, weight_shapes=shapes, tied=info.tie_word_embeddings)
        engine.scratch = scratch
        engine.dtype_note = dtype_note
        try:
            engine.wait_ready(cfg.ready_timeout)
            engine.warm_up()
        except BaseException:
            engine.stop()
            raise
        return engine

    @classmethod
    def attach(cls, cfg: EngineConfig) -> Engine:
        """The running engine at ``cfg.url`` (one lgt started), for ``cfg.model``'s weights: it must serve
        ``cfg.served_model_name`` and a model of the same names and shapes (checked at each update).
        ``stop()`` leaves it running; a restart is not possible. EngineError (one sentence) when it does
        not answer or serves another name."""
        if cfg.model is None or cfg.url is None:
            raise EngineError("attaching needs the engine's url and the model directory being trained")
        info = check_model_dir(cfg.model)
        base = re.sub(r"(/v1)?/?$", "", cfg.url)
        port = urlsplit(base).port or (443 if base.startswith("https") else 80)
        engine = cls(cfg, None, port, None, cpu=is_cpu_build(engine_python(cfg)),
                     weight_shapes=checkpoint_shapes(cfg.model), tied=info.tie_word_embeddings, base_url=base)
        import httpx

        try:
            cards = engine._client.get("/v1/models", timeout=10.0).json().get("data") or []
        except (httpx.HTTPError, ValueError, AttributeError):
            engine.stop()
            raise EngineError(f"the engine at {cfg.url} does not answer GET /v1/models: start one first "
                              "(lgt-train engine MODEL_DIR --port N) or leave engine.url out") from None
        names = [c.get("id") for c in cards if isinstance(c, dict)]
        if cfg.served_model_name not in names:
            engine.stop()
            served = ", ".join(map(str, names)) or "nothing"
            raise EngineError(f"the engine at {cfg.url} serves {served}, not {cfg.served_model_name!r} "
                              "(engine.served_model_name)")
        engine.warm_up()  # one lgt started is warm already (a tenth of a second); another is warmed here
        return engine

    @property
    def attached(self) -> bool:
        """Running before this run and left running after it (``engine.url``)."""
        return self.proc is None

    def wait_ready(self, timeout: float) -> None:
        """Return once the engine answers ``/health`` and ``/v1/models`` (200); ``EngineError`` with its
        log's last lines when its process exits first or ``timeout`` passes."""
        if children.wait_until(self._ready, self.proc, timeout, every=0.5):
            log.info("vLLM ready at %s (pid %d)", self.url, self.pid)
            return
        code = self.proc.returncode
        if code is not None:
            raise EngineError(f"the vLLM engine (pid {self.pid}) exited with code {code} while starting; "
                              f"its log: {self.log_path}; last lines:\n{children.log_tail(self.log_path)}")
        raise EngineError(f"the vLLM engine (pid {self.pid}) was not ready after {timeout:.0f} s; "
                          f"its log: {self.log_path}; last lines:\n{children.log_tail(self.log_path)}")

    def warm_up(self, timeout: float = 120.0) -> float | None:
        """One token asked with its logprob before any rollout's call: what vLLM does once, on the
        first request that wants logprobs, is done before the rollouts' calls arrive (the proxy asks
        every call's logprobs). With ``torch.compile`` on (a GPU build, or a CPU engine whose
        ``engine.env`` sets ``TORCHDYNAMO_DISABLE=0``) that is compiling its logprobs op, ~6.5 s on the
        CPU build here, which every call arriving meanwhile would wait out; lgt's CPU engines run it
        eagerly and the request takes ~0.1 s. Returns the seconds it took, or None when the engine
        refused (logged: the engine serves either way and the first call pays it)."""
        import httpx

        body = {"model": self.cfg.served_model_name, "prompt": [0], "max_tokens": 1, "temperature": 0.0,
                "logprobs": 1}
        t = time.monotonic()
        try:
            status = self._client.post("/v1/completions", json=body, timeout=timeout).status_code
        except httpx.HTTPError as e:
            status = f"{type(e).__name__}: {e}"
        if status != 200:
            log.warning("vLLM did not answer its warm-up request (%s); the first call asking for logprobs "
                        "will pay vLLM's first-request cost (a compile, when torch.compile is on)", status)
            return None
        seconds = time.monotonic() - t
        log.info("vLLM warmed up in %.1f s (its first logprobs request, before the first call's)", seconds)
        return seconds

    def _healthy(self, timeout: float = 5.0) -> bool:
        import httpx

        try:
            return self._client.get("/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def _ready(self) -> bool:
        import httpx

        try:
            return all(self._client.get(p, timeout=2.0).status_code == 200 for p in ("/health", "/v1/models"))
        except httpx.HTTPError:
            return False

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the engine's whole process group: SIGTERM, then SIGKILL after ``timeout`` s. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        self._client.close()
        if self.proc is None:  # attached: not ours to stop
            return
        children.stop(self.proc, timeout, name="vLLM")  # its whole group: the engine core too
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)
        log.info("vLLM (pid %d) stopped", self.proc.pid)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- state

    @property
    def url(self) -> str:
        """The OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1."""
        return f"{self.base_url}/v1"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def died(self) -> bool:
        """Its process exited without being stopped (``check_alive`` raises then)."""
        if self.proc is None:
            return self._dead is not None
        return self._dead is not None or (not self._stopped and self.proc.poll() is not None)

    def check_alive(self) -> None:
        """Raise EngineError when the engine was stopped or its process has exited (an attached one:
        when it no longer answers /health)."""
        if self.proc is None:
            if self._dead is None and not self._stopped and not self._healthy():
                self._dead = f"the engine at {self.base_url} (engine.url) no longer answers /health"
        elif self._dead is None and not self._stopped and self.proc.poll() is not None:
            self._dead = (f"the vLLM engine (pid {self.pid}) exited with code {self.proc.returncode}; its "
                          f"log: {self.log_path}; last lines:\n{children.log_tail(self.log_path)}")
            # its engine-core child may outlive it: stop the group so nothing is left behind
            self.stop(timeout=5.0)
        if self._dead is not None:
            raise EngineError(self._dead)
        if self._stopped:
            raise EngineError(f"the vLLM engine (pid {self.pid}) was stopped; start a new one")

    # -- HTTP

    def await_exit(self, seconds: float = DYING_S, *, shutting_down: bool = False) -> bool:
        """After a failed request: whether the engine is dying. It is not while it answers ``/health``
        (returns at once); else its process is given up to ``seconds`` to exit, since vLLM's shutdown
        after a SIGTERM takes seconds and answers 500 or drops connections meanwhile; one of ours still
        running then is killed (its clients' open connections can hold it up forever). True once it
        exited (:attr:`died`). ``shutting_down``: it said so (a 500 "… after shutdown"), and ``/health``
        answering a moment longer does not count."""
        deadline = time.monotonic() + seconds
        while True:
            if (self.proc is None or self.proc.poll() is not None
                    or (not shutting_down and self._healthy(timeout=1.0))):
                return self.died
            if time.monotonic() > deadline:  # dying, but held up by open connections: end it
                self._kill(f"still running {seconds:.0f} s after it "
                           + ("said it was shutting down" if shutting_down else "stopped answering /health"))
                return self.died
            time.sleep(0.2)

    def _kill(self, why: str) -> None:
        """SIGKILL the group of an engine we started that no longer answers: a vLLM server whose engine
        core is gone can wait forever for its clients' connections to close before it exits."""
        log.warning("the vLLM engine (pid %s) %s: killing it", self.pid, why)
        children.kill(self.proc)

    def _watched(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """A request without a time limit (a drain takes what it takes), sent while this engine is
        watched (:meth:`watch`)."""
        return self.watch(lambda: self._client.request(method, path, timeout=None, **kw), f"{method} {path}")

    def watch(self, fn: Callable[[], T], what: str) -> T:
        """``fn()`` (a request to this engine, by this client or another's) run from a thread while this
        one watches the engine: one shutting down (after a SIGTERM) stops answering ``/health`` but waits
        for open connections to close before it exits, while the request it accepted never gets its
        answer; after :data:`HEALTH_MISSES` misses in a row the engine we started is killed, which ends
        both (``fn``'s error is raised here, in the caller's thread)."""
        import threading

        out: dict[str, Any] = {}

        def send() -> None:
            try:
                out["resp"] = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
                out["error"] = e

        sender = threading.Thread(target=send, name=f"lgt-engine-{what}", daemon=True)
        sender.start()
        misses = 0
        while sender.is_alive():
            sender.join(WATCH_S)
            if not sender.is_alive() or self.proc is None or self.proc.poll() is not None:
                continue
            misses = 0 if self._healthy(timeout=5.0) else misses + 1
            if misses >= HEALTH_MISSES:
                self._kill(f"stopped answering /health during {what}")
                sender.join(30.0)
                break
        if "resp" in out:
            return out["resp"]
        if "error" in out:
            raise out["error"]
        self.check_alive()  # killed above and its request still not back: the error names the exit
        raise EngineError(f"the vLLM engine at {self.base_url} did not answer {what}")

    def _request(self, method: str, path: str, *, params: Mapping[str, Any] | None = None,
                 json: Any = None, timeout: float | None = 60.0) -> httpx.Response:
        self.check_alive()
        import httpx

        try:
            if timeout is None:
                resp = self._watched(method, path, params=params, json=json)
            else:
                resp = self._client.request(method, path, params=params, json=json, timeout=timeout)
        except httpx.HTTPError as e:
            # a refused or reset connection often means the engine is dying: wait for its exit, so the
            # error names it rather than the symptom and a supervisor starts it again
            self.await_exit()
            self.check_alive()
            raise EngineError(f"the vLLM engine at {self.base_url} did not answer {method} {path}: "
                              f"{e}") from e
        if resp.status_code >= 400:
            if resp.status_code >= 500:  # one shutting down answers 500 ("cannot schedule new futures")
                self.await_exit(shutting_down="after shutdown" in resp.text)
            self.check_alive()
            raise EngineError(f"the vLLM engine answered {resp.status_code} to {method} {path}: "
                              f"{resp.text[:500]} (its log: {self.log_path})")
        return resp

    def pause(self, mode: str = "wait") -> None:
        """Stop scheduling: "wait" drains in-flight requests, "keep" freezes them, "abort" ends them."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {', '.join(PAUSE_MODES)}")
        self._request("POST", "/pause", params={"mode": mode}, timeout=None)

    def resume(self) -> None:
        self._request("POST", "/resume")

    def is_paused(self) -> bool:
        return bool(self._request("GET", "/is_paused").json()["is_paused"])

    def reset_prefix_cache(self) -> None:
        """Drop cached KV blocks (computed by the old weights); EngineError when vLLM reports failure."""
        if not self._request("POST", "/reset_prefix_cache").json().get("success", False):
            raise EngineError("the vLLM engine could not reset its prefix cache (blocks still held by "
                              "running requests): pause it with mode 'wait' first")

    @property
    def sleeps_on_update(self) -> bool:
        """Whether the run puts this engine to sleep while it trains (``cfg.sleep_on_update``; by default
        on a GPU build, where the trainer needs the memory; the CPU build frees nothing asleep)."""
        return (not self.cpu) if self.cfg.sleep_on_update is None else self.cfg.sleep_on_update

    def sleep(self, level: int = 1) -> None:
        """Free the GPU memory (level 1: offload weights, drop KV cache; 2: drop both). No-op on CPU."""
        if self.cpu:
            log.debug("sleep(level=%d) skipped: the CPU build frees nothing when asleep", level)
            return
        self._request("POST", "/sleep", params={"level": level, "mode": "wait"}, timeout=None)
        self._asleep = True

    def wake_up(self) -> None:
        """Undo ``sleep`` (no-op on CPU)."""
        if self.cpu:
            log.debug("wake_up() skipped on the CPU build")
            return
        self._request("POST", "/wake_up", timeout=None)
        self._asleep = False

    def collective_rpc(self, method: str, *args: str, timeout: float | None = None) -> list[Any]:
        """Call ``method`` on every vLLM worker (string args only); return each worker's result."""
        resp = self._request("POST", "/collective_rpc", json={"method": method, "args": list(args)},
                             timeout=timeout)
        return resp.json()["results"] if resp.content else []

    # -- LoRA adapters

    def load_adapter(self, name: str, folder: Path) -> float:
        """Serve the PEFT adapter in ``folder`` (adapter_config.json, adapter_model.safetensors) under
        ``name`` beside the base model, without a pause (new adapters get new ids, so no cached KV is
        shared with the old); return the seconds it took. The folder must stay until the adapter is
        unloaded (vLLM reads it again when it evicted the adapter from its cache). EngineError (one
        sentence) when the engine was not started for adapters, the folder is not an adapter, or vLLM
        refuses it (a rank above its ``--max-lora-rank``, a name already served)."""
        folder = Path(folder)
        if not self.cfg.serves_adapters:
            raise EngineError("the vLLM engine was not started for LoRA adapters (engine.lora_rank is set by "
                              "a run whose backend.lora is set): it serves merged weights only")
        missing = [f for f in ("adapter_config.json", "adapter_model.safetensors")
                   if not (folder / f).exists()]
        if missing:
            raise EngineError(f"{folder} is not a PEFT adapter folder: it has no {' or '.join(missing)}")
        rank = adapter_rank(folder)
        most = self.max_lora_rank
        if rank is not None and most is not None and rank > most:
            raise EngineError(f"the LoRA adapter in {folder} has rank {rank}, above the engine's "
                              f"--max-lora-rank {most}: start the engine with engine.max_lora_rank of at "
                              f"least {rank}")
        self.check_alive()
        t0 = time.perf_counter()
        self._adapter_call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder.resolve())},
                           f"loading the LoRA adapter {name!r} from {folder}")
        seconds = time.perf_counter() - t0
        log.info("LoRA adapter %s loaded in %.3f s from %s", name, seconds, folder)
        return seconds

    @property
    def max_lora_rank(self) -> int | None:
        """The ``--max-lora-rank`` this process started the engine with (None: not known, attached)."""
        if self.proc is None or self.cfg.lora_rank is None:
            return self.cfg.max_lora_rank
        return lora_max_rank(self.cfg.lora_rank, self.cfg.max_lora_rank)

    def unload_adapter(self, name: str) -> None:
        """Stop serving the adapter ``name`` (calls naming it are refused from then on). EngineError
        when it is not loaded."""
        self.check_alive()
        self._adapter_call("/v1/unload_lora_adapter", {"lora_name": name},
                           f"unloading the LoRA adapter {name!r}")
        log.info("LoRA adapter %s unloaded", name)

    def adapters(self) -> list[str]:
        """The names of the adapters the engine serves now (its ``/v1/models`` cards with a parent)."""
        cards = self._request("GET", "/v1/models").json().get("data") or []
        return [c["id"] for c in cards if isinstance(c, dict) and c.get("parent") and c.get("id")]

    def _adapter_call(self, path: str, body: dict[str, str], what: str) -> None:
        import httpx

        try:
            resp = self._client.post(path, json=body, timeout=120.0)
        except httpx.HTTPError as e:
            self.await_exit()
            self.check_alive()
            raise EngineError(f"the vLLM engine at {self.base_url} did not answer {what}: {e}") from e
        if resp.status_code == 404 and "not found" in resp.text.lower() and "lora" not in resp.text.lower():
            raise EngineError(f"the vLLM engine at {self.base_url} has no {path}: it was not started with "
                              "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora")
        if resp.status_code >= 400:
            try:
                detail = resp.json().get("error", {}).get("message") or resp.text
            except (ValueError, AttributeError):
                detail = resp.text
            too_big = re.search(r"LoRA rank (\d+) is greater than max_lora_rank (\d+)", str(detail))
            if too_big:
                raise EngineError(f"{what} failed: its rank {too_big[1]} is above the engine's "
                                  f"--max-lora-rank {too_big[2]}")
            raise EngineError(f"{what} failed: the vLLM engine answered {resp.status_code}: "
                              f"{str(detail)[:400]} (its log: {self.log_path})")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       transport: str = "auto", *, directory: Path | None = None) -> float:
        """Replace the served weights with ``named_tensors`` (every parameter, Hugging Face names, any dtype
        and device) without a restart; return the seconds it took (details in ``self.last_sync``).

        ``transport``: ``file`` (one safetensors file under /dev/shm, read by the workers), ``shm``
        (the tensors copied once into a shared-memory segment the workers view in place: no file, no
        serialisation; the trainer must be on the engine's machine), ``ipc`` (CUDA IPC handles of the
        trainer's GPU tensors: nothing copied to the host; the trainer must share the engine's GPU),
        ``auto``: ipc for a GPU engine given GPU tensors, else shm. ``directory``: where ``file`` writes
        (default :func:`weights_dir`).
        Names and shapes are checked against the model's checkpoint first (EngineError, nothing sent).
        If the workers fail while loading, the engine is left paused (its weights may be partly updated;
        the CPU build's engine dies then) and EngineError says so: stop it.
        """
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, not {transport!r}")
        if self._asleep:
            raise EngineError("the vLLM engine is asleep: call wake_up() before update_weights()")
        self.check_alive()
        t0 = time.perf_counter()
        tensors = collect_tensors(named_tensors, to_cpu=self.cpu or transport in ("file", "shm"))
        check_weights(tensors, self.weight_shapes, tied=self.tied)
        n = len(tensors)
        if transport == "auto":
            on_gpu = not self.cpu and all(t.device.type == "cuda" for t in tensors.values())
            transport = "ipc" if on_gpu else "shm"
        if transport == "shm" and any(t.device.type != "cpu" for t in tensors.values()):
            tensors = {k: t.cpu() for k, t in tensors.items()}
        path: Path | None = None
        segment: Any = None
        if transport == "ipc":
            args = (ipc_payload(tensors),)
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        elif transport == "shm":
            segment, layout, nbytes = shm_pack(tensors)
            args = (segment.name, layout)
            del tensors
        else:
            path, nbytes = write_weights(tensors, directory or weights_dir())
            args = (str(path),)
            del tensors
        try:
            t1 = time.perf_counter()
            self.pause("wait")
            t2 = time.perf_counter()
            try:
                results = self.collective_rpc(LOAD_METHODS[transport], *args)
            except EngineError as e:
                raise EngineError(f"loading new weights into the vLLM engine failed; it is left paused as "
                                  f"its weights may be partly updated (stop it): {e}") from e
            loaded = {r.get("tensors") if isinstance(r, dict) else r for r in results}
            if loaded != {n}:
                raise EngineError(f"the vLLM workers read {sorted(map(str, loaded))} of the {n} weight "
                                  "tensors written; the engine is left paused (stop it)")
            t3 = time.perf_counter()
            self.reset_prefix_cache()
            t4 = time.perf_counter()
            self.resume()
            t5 = time.perf_counter()
        finally:
            if path is not None:
                path.unlink(missing_ok=True)
            if segment is not None:
                segment.close()
                segment.unlink()
        self.last_sync = SyncTimings(write=t1 - t0, pause=t2 - t1, load=t3 - t2, reset=t4 - t3,
                                     resume=t5 - t4, total=t5 - t0, tensors=n, nbytes=nbytes)
        log.info("weights updated in %.3f s (%d tensors, %.1f MB)", t5 - t0, n, nbytes / 1e6)
        return t5 - t0
