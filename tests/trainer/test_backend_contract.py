"""Every registered backend has what :class:`lgt.trainer.backends.base.Backend` states: each method by
name, with the protocol's parameters (names, kinds, defaults, in order; more only with a default), the
class methods as class methods, and the attributes. The verl backend's class imports without verl."""

from __future__ import annotations

import inspect

import pytest

from lgt.trainer.backends.base import BACKENDS, Backend

MEMBERS = sorted(name for name, value in vars(Backend).items()
                 if not name.startswith("_") and (isinstance(value, classmethod) or callable(value)))
ATTRIBUTES = [name for name in Backend.__annotations__ if not name.startswith("_")]


def test_the_protocol_names_what_the_loop_calls() -> None:
    assert MEMBERS == ["close", "load", "named_weights", "resume", "sample_logprobs", "save_adapter",
                       "save_checkpoint", "train_step"]
    assert ATTRIBUTES == ["summary", "lora"]


def parameters(function) -> list[inspect.Parameter]:
    return list(inspect.signature(function).parameters.values())


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_each_backend_has_the_protocols_methods_and_signatures(name: str) -> None:
    cls = BACKENDS[name].load_class()
    for member in MEMBERS:
        assert hasattr(cls, member), f"{cls.__name__} lacks {member}"
        wanted = inspect.getattr_static(Backend, member)
        got = inspect.getattr_static(cls, member)
        assert isinstance(got, classmethod) == isinstance(wanted, classmethod), member
        expected, actual = parameters(getattr(Backend, member)), parameters(getattr(cls, member))
        assert [(p.name, p.kind, p.default) for p in actual[:len(expected)]] == \
            [(p.name, p.kind, p.default) for p in expected], f"{cls.__name__}.{member}"
        extra = actual[len(expected):]
        assert all(p.default is not inspect.Parameter.empty for p in extra), f"{cls.__name__}.{member}"
    for attribute in ATTRIBUTES:
        assert attribute in vars(cls) or attribute in getattr(cls, "__annotations__", {}), \
            f"{cls.__name__} lacks {attribute}"

