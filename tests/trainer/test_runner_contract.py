"""Every registered runner has what :class:`lgt.trainer.rollout.runners.base.Runner` states (each
method by name, coroutine where the protocol's is, with its parameters) and a ``check``; ``agent.runner``
picks the class its registry line names, and the local runner's settings pick sandboxed or not, in a
container image or not."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from lgt.trainer.rollout.agent import RUNNERS, AgentSpec, RolloutError
from lgt.trainer.rollout.runners import runner_class
from lgt.trainer.rollout.runners.base import Runner
from lgt.trainer.rollout.runners.image import ImageRunner
from lgt.trainer.rollout.runners.kubernetes import KubernetesRunner
from lgt.trainer.rollout.runners.local import LocalRunner
from lgt.trainer.rollout.runners.sandboxed import SandboxedRunner

MEMBERS = sorted(name for name, value in vars(Runner).items() if not name.startswith("_") and callable(value))
SPECS = {
    "local": AgentSpec(command=("/bin/true",)),
    "kubernetes": AgentSpec(runner="kubernetes", job_template=Path("job.yaml"), proxy_host="10.0.0.1"),
}
IN_AN_IMAGE = AgentSpec(command=("/bin/true",), image="image.tar")  # the local runner, in a container image


def test_the_registry_and_the_protocol() -> None:
    assert sorted(RUNNERS) == sorted(SPECS)
    assert MEMBERS == ["aclose", "collect", "evaluate", "existing", "place", "prepare", "release", "run"]


@pytest.mark.parametrize("name", [*sorted(RUNNERS), "local in an image"])
def test_each_runner_has_the_protocols_methods(name: str) -> None:
    cls = runner_class(SPECS.get(name, IN_AN_IMAGE))
    assert callable(getattr(cls, "check", None)), f"{cls.__name__} lacks check"
    for member in MEMBERS:
        wanted, got = getattr(Runner, member), getattr(cls, member, None)
        assert got is not None, f"{cls.__name__} lacks {member}"
        assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(wanted), member
        expected = [p.name for p in inspect.signature(wanted).parameters.values()]
        actual = [p.name for p in inspect.signature(got).parameters.values()]
        assert actual[:len(expected)] == expected, member


def test_agent_runner_picks_the_class() -> None:
    assert runner_class(SPECS["local"]) is SandboxedRunner
    assert runner_class(AgentSpec(command=("/bin/true",), sandbox="none")) is LocalRunner
    assert runner_class(SPECS["kubernetes"]) is KubernetesRunner
    assert runner_class(IN_AN_IMAGE) is ImageRunner
    assert runner_class(AgentSpec(command=("/bin/true",), image_field="image")) is ImageRunner
    with pytest.raises(RolloutError, match="agent runner must be one of local, kubernetes, not 'slurm'"):
        AgentSpec(runner="slurm", command=("a",))
