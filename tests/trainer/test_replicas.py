"""Several lgt-proxy replicas on one store: each rollout keeps to one replica, every replica writes its
own files, the trainer pauses / resumes / flushes them as one and names a replica that died; a replica
restarted on the store recovers its write-ahead log."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from typing import Any

import httpx
import pytest

from lgt.testing.rollouts import AGENTS, rows, run_all
from lgt.trainer.recipe import undrained
from lgt.trainer.rollout.agent import AgentSpec
from lgt.trainer.rollout.controller import RolloutController
from lgt.trainer.serving.proxy import ProxyClient, ProxyError, ProxyGroup


@pytest.fixture
def replicas(tmp_path, upstream, request):
    """Two proxies on one store (tests/conftest.py's ProxyProc, taken from its fixture's class)."""
    proc = type(request.getfixturevalue("proxy"))
    store = tmp_path / "store"
    # Parquet only when asked (the control API's flush): a replica killed keeps its rows in its WAL
    started = [proc(store, upstream.url, "--flush-seconds", "600").start() for _ in range(2)]
    yield started
    for p in started:
        p.stop()


def group(replicas: list[Any]) -> ProxyGroup:
    return ProxyGroup([ProxyClient.connect(p.store, p.control_url) for p in replicas])


def test_rollouts_spread_over_replicas_each_keeping_to_one(tmp_path, replicas):
    g = group(replicas)
    assert [r.port for r in g.replicas] == [p.port for p in replicas]  # from each one's GET /state
    agent = AgentSpec(command=(sys.executable, str(AGENTS / "chat_agent.py")), timeout_s=60, retries=0)
    ctl = RolloutController(agent, g.replicas, replicas[0].store, tmp_path / "run", 4)
    tasks = [({"task_id": f"t{i}", "question": "What is 2+3?", "rewards": {"proxy": i / 10}}, f"rep-{i}")
             for i in range(8)]

    results = asyncio.run(run_all(ctl, tasks, "g000001"))
    # each reward was asked of the replica its agent posted it to
    assert [(r.status, r.reward, r.reward_source) for r in results] == \
        [("ok", i / 10, "proxy") for i in range(8)]
    g.flush()
    calls = rows(replicas[0], "SELECT rollout_id, proxy_session FROM calls ORDER BY rollout_id")
    sessions = {r["proxy_session"] for r in calls}
    assert len(calls) == 8 and len(sessions) == 2  # both replicas served, into one store
    assert {ctl.proxy_for(rid).port for _, rid in tasks} == {p.port for p in replicas}
    state = g.state()
    assert state["replicas"] == 2 and state["rows_written"] == 8 and state["calls"] == {"ok": 8}  # summed
    assert sum(e["rows_written"] for e in state["each"]) == state["rows_written"]


def test_a_pause_holds_every_replica_and_a_dead_one_is_named(tmp_path, replicas):
    g = group(replicas)
    out = g.pause(timeout=10)
    assert out["drained"] and len(out["replicas"]) == 2
    assert g.state()["paused"] and all(e["paused"] for e in g.state()["each"])
    g.resume(3)
    assert g.state()["policy_version"] == 3 and not g.state()["paused"]

    dead = replicas[1]
    dead.kill9()
    with pytest.raises(ProxyError, match=f"proxy replica {dead.control_url} did not answer"):
        g.pause(timeout=5)
    assert replicas[0].client.state()["paused"]  # the live one did pause; the trainer stops here
    replicas[0].client.resume(4)


def test_a_pause_that_does_not_drain_comes_back_naming_the_call_it_waited_for(tmp_path, replicas):
    """A call still running at the pause's timeout does not end the run: the pause comes back undrained
    (the replicas stay paused) with the oldest call under way, and the trainer says so and updates."""
    slow = {"model": "m", "messages": [{"role": "user", "content": "__sleep:3__ slow"}]}
    env = replicas[1].env("slow-one")
    out: dict[str, Any] = {}

    def call() -> None:
        with httpx.Client(proxy=env["HTTPS_PROXY"], verify=env["SSL_CERT_FILE"], timeout=30) as c:
            out["status"] = c.post("https://api.openai.invalid/v1/chat/completions", json=slow).status_code

    t = threading.Thread(target=call)
    t.start()
    g = group(replicas)
    deadline = time.monotonic() + 10
    while g.state()["in_flight"] == 0:
        assert time.monotonic() < deadline, "the slow call never started"
        time.sleep(0.05)
    paused = g.pause(timeout=0.5)
    assert paused["drained"] is False and paused["in_flight"] == 1
    oldest = paused["oldest_in_flight"]
    assert oldest["rollout_id"] == "slow-one" and oldest["attempt"] == 0
    assert oldest["seconds"] >= 0.5 and oldest["answer_begun"] is False
    assert all(e["paused"] for e in g.state()["each"])
    line = undrained(paused, 7)
    assert line.startswith("1 LLM call still running after 1 s of the pause: updating without waiting "
                           "for it (recorded at policy version 7, though tokens made after the weight sync "
                           "come from the next); the oldest, of rollout slow-one attempt 0, has run"), line
    g.resume(8)
    t.join(10)
    state = g.state()
    assert out["status"] == 200 and state["in_flight"] == 0
    assert [e["oldest_in_flight"] for e in state["each"]] == [None, None]
    assert [r["policy_version"] for r in rows(replicas[1], "SELECT policy_version FROM calls "
                                                           "WHERE rollout_id = 'slow-one'")] == [0]


def test_a_replica_restarted_on_the_store_recovers_what_it_recorded(tmp_path, replicas, upstream):
    import httpx

    victim = replicas[1]
    env = victim.env("before-crash")
    with httpx.Client(proxy=env["HTTPS_PROXY"], verify=env["SSL_CERT_FILE"], trust_env=False) as c:
        r = c.post("https://api.openai.invalid/v1/chat/completions",
                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
    victim.kill9()  # its row only in its write-ahead log
    proc = type(victim)
    again = proc(victim.store, upstream.url).start()  # the same store, a new process
    try:
        found = rows(again, "SELECT rollout_id FROM calls WHERE rollout_id = 'before-crash'")
        assert found == [{"rollout_id": "before-crash"}]
    finally:
        again.stop()


@pytest.mark.slow
def test_lgt_train_drives_two_replicas_as_one(tmp_path, arith_model_dir, arith_engine, request):
    """``proxy: {url: [replica 1, replica 2]}``: a run on two running proxies over one store (and the
    session's running engine, ``engine.url``, which both replicas forward to)."""
    from lgt.testing.runs import lgt_train, metrics, write_config

    proc = type(request.getfixturevalue("proxy"))
    store = tmp_path / "store"
    started = [proc(store, arith_engine.url).start() for _ in range(2)]
    try:
        cfg = write_config(tmp_path, arith_model_dir, engine_url=arith_engine.url, steps=2, store=str(store),
                           proxy={"url": [p.control_url for p in started]})
        out = lgt_train(str(cfg), "--run-dir", str(tmp_path / "run"))
        assert out.returncode == 0, out.stderr[-3000:]
        assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2]
        sessions = rows(started[0], "SELECT proxy_session, count(*) AS n FROM calls GROUP BY 1")
        assert len(sessions) == 2 and all(s["n"] > 0 for s in sessions)  # both replicas served the run
        versions = {p.client.state()["policy_version"] for p in started}
        assert versions == {2}  # both resumed with the new policy after each update
    finally:
        for p in started:
            p.stop()
