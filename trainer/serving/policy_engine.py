"""A policy that is a full model on a vLLM engine of its own, in a run of several policies
(docs/policies.md, "A policy on an engine of its own"): ``policies[i].model`` names the model, the run
starts its engine (the run's ``engine`` section with the policy's own ``engine`` keys over it), serving it
under the policy's name, and the proxy sends the policy's calls there (the policy's ``upstream`` and
``served`` in the section the proxy reads). After a step in which the policy trained, every weight goes
to its engine (:meth:`PolicyEngine.push`, while the proxy is paused and drained, as the run's own full
weight path does); an engine that died is started again on the same port with the policy's current
weights (:meth:`PolicyEngine.keep_alive`).

It does not sleep at an update: on a GPU shared with training, leave room for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from lgt.trainer.serving.launch import EngineConfig


class PolicyEngine:
    """Policy ``name``'s own engine (:meth:`start`), its weights from ``weights()`` (the policy's
    backend's ``named_weights``)."""

    def __init__(self, name: str, engine: Any, weights: Callable[[], Iterable[tuple[str, Any]]],
                 log: Callable[[str], None]) -> None:
        self.name = name
        self.engine = engine
        self.weights = weights
        self.log = log
        self.moved = False  # its weights are no longer those it was started on (restarts need them)

    @classmethod
    def start(cls, name: str, cfg: EngineConfig, serve_dir: Path, *, log_path: Path, seed: int | None,
              weights: Callable[[], Iterable[tuple[str, Any]]], log: Callable[[str], None]) -> PolicyEngine:
        """The engine on ``serve_dir`` (the policy's model, or the checkpoint a resumed run continues)."""
        from lgt.trainer.serving.engine import Engine

        cfg = dataclasses.replace(cfg, model=serve_dir, served_model_name=name, log_path=log_path, seed=seed,
                                  url=None, port=0, lora_rank=None)
        log(f"starting policy {name}'s own vLLM engine on {serve_dir.name} ...")
        return cls(name, Engine.start(cfg), weights, log)

    def route(self) -> dict[str, str]:
        """The policy's keys in the proxy's policies section: where its calls go, under which name."""
        return {"upstream": self.engine.url, "served": self.name}

    def push(self) -> None:
        """The policy's current weights into its engine (no call in flight: the proxy is drained)."""
        self.engine.update_weights(self.weights())
        self.moved = True

    def keep_alive(self) -> None:
        """An engine that died started again on its port (so the proxy's route holds), with the policy's
        current weights."""
        from lgt.trainer.serving.engine import Engine

        if not self.engine.died:
            return
        old = self.engine
        self.log(f"policy {self.name}'s engine died; starting it again on port {old.port}")
        self.engine = Engine.start(dataclasses.replace(old.cfg, port=old.port))
        if self.moved:
            self.engine.update_weights(self.weights())

    def stop(self) -> None:
        self.engine.stop()
