"""How each policy version reaches the running engine without a restart: one small seam, two ways.

- :class:`FullWeights` — every tensor of the model (the backend's ``named_weights``) into the engine
  (:meth:`~lgt.trainer.serving.engine.Engine.update_weights`); the proxy goes on naming the engine's
  own model (``engine.served_model_name``).
- :class:`Adapters` — LoRA: the backend writes its adapter as a PEFT folder (``save_adapter(path)``),
  the engine loads it under a versioned name, ``<served_model_name>-v<version>``
  (:meth:`~lgt.trainer.serving.engine.Engine.load_adapter`, tens of milliseconds), and the proxy's
  resume names it, so the calls released after the pause go to it. Once a pause drained (no call in
  flight), the adapters of older versions are used by no call: they are unloaded and their folders
  removed; the current one stays. After a pause that did not drain, nothing is unloaded (a call still
  running may use the previous version); the next drained pause does it.

:func:`choose` picks one for a backend and an engine, and says which in one line: adapters where the
backend trains one and the engine serves adapters, else the full weights (a LoRA backend's merged
weights, ``named_weights``, through today's path).

Both have ``update(engine, version, drained=...)`` (after a training step: returns the model name the
proxy's resume should name, None for the engine's own) and ``restore(engine, version)`` (an engine
started again, or a run's first: the current version served; returns the same).
:class:`PolicyAdapters` holds one :class:`Adapters` per policy of a run of several
(docs/policies.md): each policy's adapter loaded as ``<policy>-v<version>``.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from lgt.trainer.serving.launch import EngineError

log = logging.getLogger(__name__)


class WeightSync(Protocol):
    """What the run calls to put a policy version into the engine (see the module docstring)."""

    kind: str  # "full" or "adapter", for the run's log and metrics

    def update(self, engine: Any, version: int, *, drained: bool = True) -> str | None: ...

    def restore(self, engine: Any, version: int) -> str | None: ...


class FullWeights:
    """Every weight of the model into the engine (today's path). ``weights()``: the backend's
    ``named_weights()`` (a LoRA backend's merged weights)."""

    kind = "full"

    def __init__(self, weights: Callable[[], Iterable[tuple[str, Any]]]) -> None:
        self.weights = weights

    def update(self, engine: Any, version: int, *, drained: bool = True) -> str | None:
        engine.update_weights(self.weights())
        return None

    def restore(self, engine: Any, version: int) -> str | None:
        return self.update(engine, version)


class Adapters:
    """Each version's LoRA adapter, written by ``save(folder)`` (the backend's ``save_adapter``) under
    ``root/v<version>`` and loaded into the engine as ``<base>-v<version>`` (see the module
    docstring). ``root`` must be readable by the engine (the same machine) and is this object's own."""

    kind = "adapter"

    def __init__(self, save: Callable[[Path], Any], root: Path, base: str) -> None:
        self.save = save
        self.root = Path(root)
        self.base = base
        self.loaded: dict[str, Path] = {}  # adapter name -> its folder, in the order loaded
        self.current: str | None = None
        self.load_s: float | None = None  # the last load's seconds (save excluded)
        self.save_s: float | None = None

    def name(self, version: int) -> str:
        return f"{self.base}-v{version}"

    def update(self, engine: Any, version: int, *, drained: bool = True) -> str:
        """Write and load ``version``'s adapter; with ``drained`` (the pause drained: no call in flight),
        unload every other one. Returns its name, for the proxy's resume."""
        name = self._load(engine, version)
        if drained:
            self.unload_others(engine)
        return name

    def restore(self, engine: Any, version: int) -> str:
        """``version``'s adapter in an engine that does not have it (started again: it has none), every
        other one forgotten; returns its name."""
        served = set(engine.adapters())
        for other, folder in list(self.loaded.items()):
            if other not in served:
                self.loaded.pop(other)
                shutil.rmtree(folder, ignore_errors=True)
        for stale in served - set(self.loaded):  # an attached engine's, from an earlier run
            if stale.startswith(f"{self.base}-v"):
                engine.unload_adapter(stale)
        if self.name(version) in self.loaded:
            self.current = self.name(version)
            return self.current
        return self._load(engine, version)

    def unload_others(self, engine: Any) -> list[str]:
        """Unload every adapter but the current one and remove its folder; their names."""
        gone = []
        for other in [n for n in self.loaded if n != self.current]:
            try:
                engine.unload_adapter(other)
            except EngineError as e:  # not loaded any more (an engine started again): nothing to free
                log.info("LoRA adapter %s was not unloaded: %s", other, e)
            shutil.rmtree(self.loaded.pop(other), ignore_errors=True)
            gone.append(other)
        return gone

    def _load(self, engine: Any, version: int) -> str:
        import time

        name, folder = self.name(version), self.root / f"v{version}"
        if name in self.loaded:  # loaded before (an update retried): load it afresh
            try:
                engine.unload_adapter(name)
            except EngineError:
                pass
            self.loaded.pop(name)
        shutil.rmtree(folder, ignore_errors=True)
        partial = self.root / f".v{version}.tmp"
        shutil.rmtree(partial, ignore_errors=True)
        partial.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        self.save(partial)
        partial.rename(folder)  # the engine only ever reads a whole folder
        self.save_s = time.perf_counter() - t0
        self.load_s = engine.load_adapter(name, folder)
        self.loaded[name] = folder
        self.current = name
        return name

    def close(self, engine: Any = None) -> None:
        """Unload every adapter from ``engine`` (one that outlives the run: ``engine.url``), then remove
        the folders."""
        for name in list(self.loaded) if engine is not None else []:
            try:
                engine.unload_adapter(name)
            except EngineError as e:
                log.info("LoRA adapter %s was not unloaded: %s", name, e)
        shutil.rmtree(self.root, ignore_errors=True)
        self.loaded.clear()
        self.current = None


class PolicyAdapters:
    """Several policies' LoRA adapters on one engine: one :class:`Adapters` per policy, its base name the
    policy's name, so policy ``coder``'s version N is loaded as ``coder-vN`` (under ``root/<policy>/``).
    Every policy gets each run-wide version (a policy that did not train in a step has its unchanged
    adapter loaded under the new version's name), so a call's served model always names its policy
    and its ``policy_version``. :attr:`served` maps each policy to its current adapter: the proxy's
    resume sends it (``served``); the proxy's own served model stays the engine's (None)."""

    kind = "adapter"

    def __init__(self, saves: dict[str, Callable[[Path], Any]], root: Path) -> None:
        self.root = Path(root)
        self.policies = {name: Adapters(save, self.root / name, name) for name, save in saves.items()}
        self.served: dict[str, str] = {}

    def update(self, engine: Any, version: int, *, drained: bool = True) -> None:
        self.served = {name: a.update(engine, version, drained=drained) for name, a in self.policies.items()}
        return None

    def restore(self, engine: Any, version: int) -> None:
        self.served = {name: a.restore(engine, version) for name, a in self.policies.items()}
        return None

    @property
    def load_s(self) -> float | None:
        times = [a.load_s for a in self.policies.values() if a.load_s is not None]
        return sum(times) if times else None

    def close(self, engine: Any = None) -> None:
        for a in self.policies.values():
            a.close(engine)
        shutil.rmtree(self.root, ignore_errors=True)


def choose(backend: Any, engine_cfg: Any, root: Path, *, lora: Any = None,
           say: Callable[[str], None] = print) -> FullWeights | Adapters:
    """The weight sync for ``backend`` (its ``lora``: the run's ``backend.lora``, None for full
    fine-tuning) and an engine of ``engine_cfg``: :class:`Adapters` where the backend writes adapters
    (``save_adapter``) and the engine serves them (``serves_adapters``), else :class:`FullWeights` —
    one line through ``say`` when a LoRA run falls back to the merged weights, and why."""
    full = FullWeights(backend.named_weights)
    if lora is None:
        return full
    if not callable(getattr(backend, "save_adapter", None)):
        say(f"LoRA: the {type(backend).__name__} backend writes no adapter for the engine: each update "
            "sends the merged weights (the full weight path)")
        return full
    if not getattr(engine_cfg, "serves_adapters", False):
        why = " (engine.serve_adapters: false)" if not getattr(engine_cfg, "serve_adapters", True) else ""
        say(f"LoRA: the engine was not started for adapters{why}: each update sends the merged weights "
            "(the full weight path)")
        return full
    say("LoRA: each update loads the new adapter into the engine as "
        f"{engine_cfg.served_model_name}-v<version>")
    return Adapters(backend.save_adapter, root, engine_cfg.served_model_name)
