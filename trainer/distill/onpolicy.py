"""On-policy distillation as the training step sees it (``algorithm.estimator: opd``): between the
batch's samples and the update, the teacher scores every token and the per-token advantages replace the
rollout's (:mod:`lgt.trainer.distill.opd`). Without a teacher, :class:`NoTeacher` leaves the samples as
they are, so the step calls one or the other the same way."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from lgt.trainer.distill import opd
from lgt.trainer.distill.teacher import Teacher

# the step's stopwatch: timed(name, fn, *args) runs fn off the event loop, its seconds in perf/<name>_s
Timed = Callable[..., Awaitable[Any]]


class Distillation:
    """The teacher (:class:`~lgt.trainer.distill.teacher.Teacher`: one at a URL, attached already, or an
    engine ``start`` starts once the student's runs) scoring the student's samples; ``backend``
    recomputes a behaviour logprob the proxy could not record."""

    def __init__(self, backend: Any, reward_coef: float, *, teacher: Teacher | None = None,
                 start: Callable[[], Teacher] | None = None) -> None:
        self.backend, self.reward_coef = backend, reward_coef
        self.teacher, self._start = teacher, start

    def start(self) -> None:
        """The teacher's engine started (a teacher at a URL is there already)."""
        if self.teacher is None and self._start is not None:
            self.teacher = self._start()

    async def apply(self, prepared: Any, timed: Timed) -> tuple[Any, dict[str, float]]:
        """The batch with per-token advantages and the step's ``teacher/*`` and ``opd/*`` metrics (timed
        as ``teacher``); an empty batch as it is."""
        if not prepared.samples.num_rows:
            return prepared, {}
        return await timed("teacher", self.score, prepared)

    def score(self, prepared: Any) -> tuple[Any, dict[str, float]]:
        """The teacher's logprob of every token of the batch's samples, and the per-token advantages
        (:func:`~lgt.trainer.distill.opd.token_advantages`; a generated token without a recorded behaviour
        logprob uses the backend's own before the update)."""
        samples = prepared.samples
        scored = self.teacher.score(samples.column("input_ids").to_pylist())
        recomputed = self.backend.sample_logprobs(samples) if opd.needs_recompute(samples) else None
        samples, metrics = opd.token_advantages(samples, scored.logprobs, self.reward_coef, recomputed,
                                                scored.top)
        return dataclasses.replace(prepared, samples=samples), {**scored.metrics(), **metrics}

    def stop(self) -> None:
        if self.teacher is not None:
            with contextlib.suppress(Exception):
                self.teacher.stop()


class NoTeacher:
    """No on-policy distillation: the samples train as they are; nothing to start, time or stop."""

    def start(self) -> None:
        pass

    async def apply(self, prepared: Any, timed: Timed) -> tuple[Any, dict[str, float]]:
        return prepared, {}

    def stop(self) -> None:
        pass
