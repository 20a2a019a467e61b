"""The vLLM engine and lgt-proxy in front of it, kept alive for the run.

:meth:`Supervisor.serve` starts the engine on a model directory (or attaches to a running one, which
then gets those weights) and lgt-proxy in front of it (or connects to running replicas), then warms the
engine up. During the run :meth:`~Supervisor.keep_alive` starts again an engine that died, or a proxy
this run started that died — at most ``restarts`` times in all; one more death ends the run with its
error. The engine comes back on its port with the current policy's weights; the proxy on its ports and
store (its write-ahead log recovered). Calls that were in flight failed: their agents' SDKs retry them,
or the attempt fails and is retried; new calls are held while the engine starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lgt.trainer.run.progress import Progress
from lgt.trainer.serving.launch import EngineConfig, EngineError
from lgt.trainer.serving.proxy import ProxyClient, ProxyError, ProxyGroup, ProxySection

DYING_S = 2.0  # how long a call that failed is given to show it was its engine's or proxy's death


class Supervisor:
    """The engine (``.engine``, an :class:`~lgt.trainer.serving.engine.Engine`: a new one after a
    restart, so read it from here each time) and the proxy replicas (``.proxy``, a
    :class:`~lgt.trainer.serving.proxy.ProxyGroup`), from the run config's ``engine`` and ``proxy``
    sections. ``progress`` gives the policy version to serve; ``weights`` (the backend's
    ``named_weights``, given to :meth:`serve`) gives a restarted engine the current weights."""

    def __init__(self, engine: EngineConfig, proxy: ProxySection, *, store: Path, store_url: str | Path,
                 logs_dir: Path, seed: int, restarts: int, progress: Progress,
                 log: Callable[[str], None]) -> None:
        self.engine_cfg = engine
        self.proxy_cfg = proxy
        self.store = store  # the store's local folder
        self.store_url = store_url  # where a started proxy writes: that folder, or s3://… it mirrors
        self.logs_dir = logs_dir
        self.seed = seed
        self.max_restarts = restarts
        self.restarts = 0  # engine and proxy restarts in this process
        self.progress = progress
        self.log = log
        self.weights: Callable[[], Any] | None = None
        self.engine: Any = None
        self.proxy: Any = None

    def serve(self, model_dir: Path, weights: Callable[[], Any] | None = None) -> None:
        """The engine on ``model_dir`` (or the weights ``weights()`` yields, for an attached engine),
        lgt-proxy in front of it at the current policy version, and one warm-up request."""
        from lgt.trainer.serving import engine as enginemod
        from lgt.trainer.serving.weights import checkpoint_tensors

        self.weights = weights
        cfg, version = self.engine_cfg, self.progress.version
        if cfg.url:  # a running engine: it serves this run's weights from now on
            self.log(f"using the vLLM engine at {cfg.url} (engine.url): loading {model_dir.name} ...")
            self.engine = enginemod.Engine.attach(dataclasses.replace(cfg, model=model_dir))
            if weights is not None:
                self.engine.update_weights(weights())
            else:
                self.engine.update_weights(checkpoint_tensors(model_dir))
        else:
            self.log(f"starting the vLLM engine on {model_dir.name} ...")
            self.engine = enginemod.Engine.start(dataclasses.replace(
                cfg, model=model_dir, log_path=self.logs_dir / "engine.log", seed=self.seed))
            if self.engine.dtype_note:
                self.log(self.engine.dtype_note)
        p = self.proxy_cfg
        if p.url:  # running replicas, one or several, on the run's store
            self.proxy = ProxyGroup([ProxyClient.connect(self.store, url, p.port, p.token) for url in p.url])
            self.proxy.check_served(cfg.served_model_name)
            self.proxy.resume(version)
        else:
            started = ProxyClient.start(
                self.store_url, self.engine.url, log_path=self.logs_dir / "proxy.log",
                policy_version=version, port=p.port, control_port=p.control_port,
                command=list(p.command) if p.command else None,
                upstream_timeout=p.upstream_timeout_s, listen_host=p.listen_host, egress=p.egress_args(),
                served_model=cfg.served_model_name, max_output_tokens=p.max_output_tokens)
            self.proxy = ProxyGroup([started])
        self.warm_up()

    def endpoints(self) -> list[ProxyClient]:
        """The proxy replicas, for the rollout controller."""
        return list(self.proxy.replicas)

    def warm_up(self) -> None:
        """One request straight to the engine, so the first rollouts do not pay its first-call cost."""
        import httpx

        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"{self.engine.url}/completions", trust_env=False, timeout=120,
                       json={"model": self.engine.cfg.served_model_name, "prompt": "hello", "max_tokens": 4})

    # ------------------------------------------------------------------------------- restarts
    async def keep_alive(self, *, paused: bool = False) -> None:
        """Start again what died (see the module docstring); ``paused``: the proxy holds new calls now
        and goes on holding them after a restart."""
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

    async def alive(self, fn: Callable[[], Any], *, paused: bool) -> Any:
        """``fn()`` in a thread; when it fails because the engine or proxy died, both are checked (and
        restarted) and it runs once more."""
        try:
            return await asyncio.to_thread(fn)
        except (EngineError, ProxyError):
            if not await asyncio.to_thread(self._died, DYING_S):
                raise
        await self.keep_alive(paused=paused)
        return await asyncio.to_thread(fn)

    def _died(self, within: float) -> bool:
        """Whether the engine or a proxy replica this run started has exited, waiting up to ``within``
        seconds: a process being killed closes its connections a moment before it can be reaped."""
        deadline = time.monotonic() + within
        while True:
            if self.engine.died or any(r.died for r in self.proxy.replicas):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    async def _restart(self, what: str, err: Exception, restart: Callable[[bool], Any], paused: bool) -> None:
        first = str(err).splitlines()[0].split("; its log")[0]  # "… exited with code -9"
        if self.restarts >= self.max_restarts:
            raise RuntimeError(f"{first} — and the run has restarted its engine or proxy {self.restarts} "
                               f"times already (restarts: {self.max_restarts}); resume it with --resume "
                               "once the cause is fixed") from None
        self.restarts += 1
        self.log(f"{first}; starting it again at policy version {self.progress.version} "
                 f"(restart {self.restarts} of {self.max_restarts})")
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
        # it serves the weights the run started from
        if self.progress.updates_this_run and self.weights is not None:
            await asyncio.to_thread(self.engine.update_weights, self.weights())
        if not paused:
            await asyncio.to_thread(self.proxy.resume, self.progress.version)

    async def _restart_proxy(self, paused: bool) -> None:
        restarted = await asyncio.to_thread(self.proxy.restart_dead, self.progress.version)
        if not restarted:  # the error was not a replica this run started dying: nothing to restart
            raise RuntimeError("lgt-proxy stopped answering and it was not started by this run")
        if paused:
            await asyncio.to_thread(self.proxy.pause, 10)

    def stop(self) -> None:
        """The proxy and the engine (an error stopping one does not keep the other running)."""
        for thing in (self.proxy, self.engine):
            if thing is not None:
                with contextlib.suppress(Exception):
                    thing.stop()


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
