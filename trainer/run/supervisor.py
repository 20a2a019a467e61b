"""The vLLM engine and lgt-proxy in front of it, kept alive for the run.

:meth:`Supervisor.serve` starts the engine on a model directory (or attaches to a running one, which
then gets those weights) and lgt-proxy in front of it (or connects to running replicas), then warms the
engine up. During the run :meth:`~Supervisor.keep_alive` starts again an engine that died, or a proxy
this run started that died — at most ``restarts`` times in all; one more death ends the run with its
error. The engine comes back on its port with the current policy's weights; the proxy on its ports and
store (its write-ahead log recovered). Calls that were in flight failed: their agents' SDKs retry them,
or the attempt fails and is retried; new calls are held while the engine starts.

Each policy version reaches the engine through the run's weight sync (:mod:`lgt.trainer.serving.sync`:
the full weights, or a LoRA adapter loaded under a versioned name): :meth:`~Supervisor.push` after a
training step; ``served_model`` is then the name the proxy's resume gives, so the calls released go to
that version (an engine or a proxy started again gets it too).

With a ``policies`` section the proxy it starts gets it (``--policies``, the file ``policies_file``
with each policy's current served model written in, rewritten after each push, so a proxy started
again routes as the one before); several policies' adapters (:class:`~lgt.trainer.serving.sync.
PolicyAdapters`) give each policy's served model (:attr:`~Supervisor.served`), which every resume sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lgt.proxy.tool_parsers import PARSERS as TOOL_PARSERS
from lgt.trainer.run.progress import Progress
from lgt.trainer.serving.launch import EngineConfig, EngineError, tool_call_parser
from lgt.trainer.serving.proxy import ProxyClient, ProxyError, ProxyGroup, ProxySection
from lgt.trainer.serving.sync import Adapters, FullWeights, PolicyAdapters, WeightSync

DYING_S = 2.0  # how long a call that failed is given to show it was its engine's or proxy's death


class Supervisor:
    """The engine (``.engine``, an :class:`~lgt.trainer.serving.engine.Engine`: a new one after a
    restart, so read it from here each time) and the proxy replicas (``.proxy``, a
    :class:`~lgt.trainer.serving.proxy.ProxyGroup`), from the run config's ``engine`` and ``proxy``
    sections. ``progress`` gives the policy version to serve; ``weights`` (the backend's
    ``named_weights``, given to :meth:`serve`) gives a restarted engine the current weights."""

    def __init__(self, engine: EngineConfig, proxy: ProxySection, *, store: Path, store_url: str | Path,
                 logs_dir: Path, seed: int, restarts: int, progress: Progress,
                 log: Callable[[str], None], policies: list[dict[str, Any]] | None = None,
                 policies_file: Path | None = None) -> None:
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
        self.sync: WeightSync | None = None
        self.served_model: str | None = None  # the engine's model calls go to (None: its own name)
        self.restored = False  # the engine's starting weights are not model_dir's (serve's restore)
        self.policies = policies  # the proxy's policies section (lgt.proxy.policies), or None
        self.policies_file = policies_file  # where the proxy reads it (--policies)
        self.engine: Any = None
        self.proxy: Any = None

    @property
    def weights(self) -> Callable[[], Any] | None:
        """The full weights a restarted engine gets (None: the run's starting model is enough)."""
        return self.sync.weights if isinstance(self.sync, FullWeights) else None

    def serve(self, model_dir: Path, weights: Callable[[], Any] | None = None, *,
              sync: WeightSync | None = None, restore: bool = False) -> None:
        """The engine on ``model_dir`` (or the weights ``weights()`` yields, for an attached engine),
        lgt-proxy in front of it at the current policy version (the engine warmed up as it starts or is
        attached: :meth:`~lgt.trainer.serving.engine.Engine.warm_up`). ``sync``
        (default: the full ``weights``) puts each version into the engine; an adapter sync, or
        ``restore``, puts the current version there before the proxy starts (``model_dir`` is then the
        base model)."""
        from lgt.trainer.serving import engine as enginemod
        from lgt.trainer.serving.weights import checkpoint_tensors

        self.sync = sync if sync is not None else FullWeights(weights) if weights is not None else None
        adapters = isinstance(self.sync, (Adapters, PolicyAdapters))
        cfg, version = self.engine_cfg, self.progress.version
        if cfg.url:  # a running engine: it serves this run's weights from now on
            self.log(f"using the vLLM engine at {cfg.url} (engine.url): loading {model_dir.name} ...")
            self.engine = enginemod.Engine.attach(dataclasses.replace(cfg, model=model_dir))
            if self.sync is not None and not adapters:
                self.engine.update_weights(self.sync.weights())
            else:  # the base model's own weights (an adapter goes on top of them)
                self.engine.update_weights(checkpoint_tensors(model_dir))
        else:
            self.log(f"starting the vLLM engine on {model_dir.name} ...")
            self.engine = enginemod.Engine.start(dataclasses.replace(
                cfg, model=model_dir, log_path=self.logs_dir / "engine.log", seed=self.seed))
            if self.engine.dtype_note:
                self.log(self.engine.dtype_note)
        if self.sync is not None and (adapters or (restore and not cfg.url)):
            self.served_model = self.sync.restore(self.engine, version)
            self.restored = True
        p = self.proxy_cfg
        if p.url:  # running replicas, one or several, on the run's store
            self.proxy = ProxyGroup([ProxyClient.connect(self.store, url, p.port, p.token) for url in p.url])
            self.proxy.check_served(cfg.served_model_name)
            self.proxy.resume(version, self.served_model, self.served)
        else:
            parser = tool_call_parser(cfg.extra_args)
            if p.on_update == "continue" and parser is not None and parser not in TOOL_PARSERS:
                self.log(f"proxy.on_update continue: the proxy cannot read the tool calls of the engine's "
                         f"{parser} parser, so calls offering tools drain at an update")
            started = ProxyClient.start(
                self.store_url, self.engine.url, log_path=self.logs_dir / "proxy.log",
                policy_version=version, port=p.port, control_port=p.control_port,
                command=list(p.command) if p.command else None,
                upstream_timeout=p.upstream_timeout_s, listen_host=p.listen_host, egress=p.egress_args(),
                served_model=self.served_model or cfg.served_model_name,
                max_output_tokens=p.max_output_tokens, policies=self.write_policies(), on_update=p.on_update,
                tool_parser=parser)
            self.proxy = ProxyGroup([started])

    def push(self, version: int, *, drained: bool = True) -> str | None:
        """Policy ``version`` into the engine (after a training step, the proxy paused): the run's weight
        sync; ``drained``: the pause drained (an adapter sync then unloads the older adapters). Returns
        the model name the proxy's resume names (:attr:`served_model`; None: the engine's own)."""
        assert self.sync is not None, "serve() was given no weights to sync"
        served = self.sync.update(self.engine, version, drained=drained)
        self.served_model = served
        self.write_policies()
        return served

    @property
    def served(self) -> dict[str, str] | None:
        """Each policy's served model now (several policies' adapters), for the proxy's resume; None
        for a run of one policy."""
        return dict(self.sync.served) if isinstance(self.sync, PolicyAdapters) else None

    def write_policies(self) -> Path | None:
        """The policies section as the proxy reads it (``--policies``), each policy's current served
        model written in; None without one. Written whole under another name, then renamed."""
        if self.policies is None or self.policies_file is None:
            return None
        import json

        served = self.served or {}
        section = [{**p, "served": served[p["name"]]} if p["name"] in served else p for p in self.policies]
        partial = self.policies_file.with_name(self.policies_file.name + ".tmp")
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(section, indent=1) + "\n")
        partial.replace(self.policies_file)
        return self.policies_file

    def endpoints(self) -> list[ProxyClient]:
        """The proxy replicas, for the rollout controller."""
        return list(self.proxy.replicas)

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
        # it serves the weights the run started from; the current version's adapter is loaded again
        if isinstance(self.sync, (Adapters, PolicyAdapters)):
            self.served_model = await asyncio.to_thread(self.sync.restore, self.engine, self.progress.version)
            self.write_policies()
        elif (self.progress.updates_this_run or self.restored) and self.weights is not None:
            await asyncio.to_thread(self.engine.update_weights, self.weights())
        if not paused:
            await asyncio.to_thread(self.proxy.resume, self.progress.version, self.served_model, self.served)

    async def _restart_proxy(self, paused: bool) -> None:
        restarted = await asyncio.to_thread(self.proxy.restart_dead, self.progress.version, self.served_model)
        if not restarted:  # the error was not a replica this run started dying: nothing to restart
            raise RuntimeError("lgt-proxy stopped answering and it was not started by this run")
        if paused:
            await asyncio.to_thread(self.proxy.pause, 10)

    def stop(self) -> None:
        """The proxy and the engine (an error stopping one does not keep the other running); an adapter
        sync's folders (and its adapters, from an engine that outlives the run)."""
        if isinstance(self.sync, (Adapters, PolicyAdapters)):
            attached = self.engine is not None and self.engine.attached and not self.engine.died
            with contextlib.suppress(Exception):
                self.sync.close(self.engine if attached else None)
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
