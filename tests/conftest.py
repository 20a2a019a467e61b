"""Fixtures: a real fake-vLLM upstream (aiohttp, in a thread) and a real ``lgt-proxy`` process.

Tests talk to both over loopback only. Agents that should look as if they call a hosted API aim at
names under ``.invalid``. This machine sets SSL_CERT_FILE / REQUESTS_CA_BUNDLE / proxy variables
globally; the ``clean_env`` fixture removes them so each test sets exactly what it means. The helpers
behind them (``ProxyProc``, SSE parsing) are in ``lgt.testing.proxy``; ``free_port`` is
``lgt.trainer.serving.children``'s.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from lgt.testing.fake_upstream import FakeUpstream
from lgt.testing.proxy import ENV_VARS, ProxyProc


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.fixture(scope="module")
def upstream() -> Iterator[FakeUpstream]:
    with FakeUpstream.in_thread(port=0) as up:
        yield up


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory, upstream: FakeUpstream) -> Iterator[ProxyProc]:
    p = ProxyProc(tmp_path_factory.mktemp("proxy") / "store", upstream.url).start()
    yield p
    p.stop()


@pytest.fixture
def rollout(request: pytest.FixtureRequest) -> str:
    """A rollout id unique to the test, so module-scoped proxies keep tests' records apart."""
    return "t-" + re.sub(r"[^A-Za-z0-9._-]", "-", request.node.name)[:100]


@pytest.fixture
def agent_env(proxy: ProxyProc, rollout: str, clean_env: pytest.MonkeyPatch) -> dict[str, str]:
    """This process's environment set as ``eval "$(lgt-proxy creds ...)"`` would set it."""
    env = proxy.env(rollout)
    for k, v in env.items():
        clean_env.setenv(k, v)
    return env
