"""The rollout controller (trainer/rollout/controller.py): real agent processes through a real lgt-proxy.

The agents (tests/trainer/agents/) are plain Python scripts using the OpenAI SDK against the fake vLLM
upstream, through ``HTTPS_PROXY`` (https://api.openai.invalid/v1) or ``base_url``; each test checks the
result, the files and what the store holds afterwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from lgt.proxy.client import ControlClient, ControlError
from lgt.store.query import connect
from lgt.testing.rollouts import AGENTS, attempts, endpoint, gone, rewards, run_all
from lgt.trainer.rollout.agent import (
    AgentSpec,
    RolloutError,
    env_name,
    expand,
    parse_reward,
    task_env,
    task_id_of,
)
from lgt.trainer.rollout.controller import RolloutController
from lgt.trainer.serving.proxy import ProxyClient, ProxyControlError


def agent(script: str = "chat_agent.py", **kw: Any) -> AgentSpec:
    kw.setdefault("timeout_s", 60)
    kw.setdefault("retries", 0)
    kw.setdefault("sandbox", "none")  # the controller's rules, with host paths (sandboxed: test_sandbox.py)
    return AgentSpec(command=(sys.executable, str(AGENTS / script)), **kw)


def controller(proxy: Any, run_dir: Path, spec: AgentSpec, concurrency: int = 4,
               **kw: Any) -> RolloutController:
    return RolloutController(spec, endpoint(proxy), proxy.store, run_dir, concurrency, **kw)


def call_attempts(proxy: Any, rid: str) -> list[int]:
    return [c["attempt"] for c in proxy.calls("rollout_id = ?", [rid])]


async def wait_gone(pid: int) -> bool:
    for _ in range(200):  # SIGKILL is immediate; this only absorbs the reaper's scheduling
        if gone(pid):
            return True
        await asyncio.sleep(0.05)
    return False


# -- pure helpers ---------------------------------------------------------------------------------------
def test_task_variables_rewards_and_expansion():
    assert env_name("max-steps") == "TASK_MAX_STEPS" and env_name("a.b c", "T_") == "T_A_B_C"
    env = task_env({"question": "2+3?", "n": 3, "meta": {"a": [1, None]}, "ok": True})
    assert env == {"TASK_QUESTION": "2+3?", "TASK_N": "3", "TASK_META": '{"a": [1, null]}',
                   "TASK_OK": "true"}
    with pytest.raises(RolloutError, match="'a-b' and 'a_b' both become \\$TASK_A_B"):
        task_env({"a-b": 1, "a_b": 2})
    with pytest.raises(RolloutError, match="task field 'json' would be \\$TASK_JSON"):
        task_env({"json": "x"})
    assert task_id_of({"id": 7}) == "7" and task_id_of({"task_id": "arith-0", "id": 1}) == "arith-0"
    assert task_id_of({"q": 1, "a": 2}) == task_id_of({"a": 2, "q": 1}) != task_id_of({"q": 2})
    assert parse_reward(" 0.5\n") == 0.5 and parse_reward('{"reward": -1}') == -1.0
    for bad in ("yes", "true", '{"value": 1}', "NaN", '"1"', "[1]"):
        with pytest.raises(ValueError):
            parse_reward(bad)
    assert expand("${A}/v1-${B}", {"A": "x", "B": "y"}, "K") == "x/v1-y"
    with pytest.raises(RolloutError, match="agent env K refers to \\$\\{C\\}"):
        expand("${C}", {}, "K")


def test_proxy_endpoint_errors_name_the_problem(tmp_path):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ep = ProxyClient(store=tmp_path, port=port, api=ControlClient(f"http://127.0.0.1:{port}", "x"))
    with pytest.raises(ProxyControlError, match="CA certificate .* does not exist: start lgt-proxy"):
        ep.rollout_env("r1")
    with pytest.raises(ControlError, match="no lgt-proxy control API answers at http://127.0.0.1:"):
        ep.flush()


def test_bad_input_is_refused_before_anything_starts(tmp_path, proxy):
    run_dir = tmp_path / "run"
    not_exec = tmp_path / "agent.sh"
    not_exec.write_text("#!/bin/sh\necho 1\n")

    def refused(spec_kw: dict, match: str, **ctl_kw: Any) -> None:
        with pytest.raises(RolloutError, match=match):
            RolloutController(AgentSpec(**spec_kw), endpoint(proxy), proxy.store, run_dir, **ctl_kw)

    refused({"command": ("no-such-agent-xyz", "--flag")},
            "agent command 'no-such-agent-xyz' was not found on PATH")
    refused({"command": (str(tmp_path / "missing.py"),)}, "agent command '.*missing.py' does not exist")
    refused({"command": ("./agent.sh",), "cwd": tmp_path}, "agent.sh' is not an executable file")
    refused({"command": ("true",), "cwd": tmp_path / "nope"}, "working directory '.*nope' does not exist")
    refused({"command": ("true",), "evaluator": ("no-such-eval-xyz",)},
            "evaluator command 'no-such-eval-xyz' was not found")
    refused({"command": ("true",), "env": {"X": "${NOT_A_VAR_ANYWHERE}"}}, "X refers to \\$\\{NOT_A_VAR")
    refused({"command": ("true",)}, "concurrency must be a whole number ≥ 1", concurrency=0)
    with pytest.raises(RolloutError, match="proxy_mode must be one of https_proxy, base_url"):
        AgentSpec(command=("true",), proxy_mode="socks")
    with pytest.raises(RolloutError, match="timeout_s must be a positive"):
        AgentSpec(command=("true",), timeout_s=0)
    with pytest.raises(RolloutError, match="reward_sources must be some of proxy, file, stdout, evaluator"):
        AgentSpec(command=("true",), reward_sources=("stdout", "llm"))

    not_exec.chmod(0o755)  # now it is a valid agent: bad tasks and rollout ids are refused at run()
    ctl = RolloutController(AgentSpec(command=("./agent.sh",), cwd=tmp_path, env={"X": "${TASK_NOPE}"}),
                            endpoint(proxy), proxy.store, run_dir)
    with pytest.raises(RolloutError, match="rollout id 'bad id' is not valid"):
        asyncio.run(ctl.run({}, "bad id"))
    with pytest.raises(RolloutError, match="cannot be written as JSON"):
        asyncio.run(ctl.run({"x": object()}, "r1"))
    with pytest.raises(RolloutError, match="X refers to \\$\\{TASK_NOPE\\}, which this rollout does not set"):
        asyncio.run(ctl.run({}, "r1"))
    assert not list(run_dir.rglob("*.out"))


# -- through the proxy ----------------------------------------------------------------------------------
def test_proxy_reward_task_env_files_and_identity(tmp_path, proxy, monkeypatch):
    spec = agent(env={"EXTRA": "${LGT_ROLLOUT_ID}/${TASK_ID}"}, cwd=tmp_path)
    ctl = controller(proxy, tmp_path / "run", spec)
    # what this machine (or the trainer) has set must not reach the agent
    monkeypatch.setenv("ALL_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("LGT_CONTROL_TOKEN", "must-not-leak")
    task = {"id": "task-1", "question": "What is 2+3?", "max-steps": 3, "meta": {"a": [1, 2]},
            "report_dir": str(tmp_path), "rewards": {"proxy": 0.75}}
    rid = "ro-env"
    [r] = asyncio.run(run_all(ctl, [(task, rid)], group="grp-1", step=7))
    monkeypatch.undo()

    assert (r.status, r.attempt, r.exit_code, r.reward, r.reward_source) == ("ok", 0, 0, 0.75, "proxy")
    assert r.error is None
    assert (r.task_id, r.group_id, r.step) == ("task-1", "grp-1", 7) and r.seconds > 0
    assert r.stdout_path == tmp_path / "run" / "rollouts" / "ro-env~0.out"
    assert "model said: The answer is" in r.stdout_path.read_text()
    assert "agent starting" in r.stderr_path.read_text()

    seen = json.loads((tmp_path / f"{rid}~0.json").read_text())
    env = seen["env"]
    assert (env["TASK_ID"], env["TASK_QUESTION"], env["TASK_MAX_STEPS"], env["TASK_META"]) == \
        ("task-1", "What is 2+3?", "3", '{"a": [1, 2]}')
    assert json.loads(Path(env["TASK_JSON"]).read_text()) == task == seen["task"]
    assert env["REWARD_FILE"] == str(tmp_path / "run" / "rollouts" / "ro-env~0.reward")
    assert env["EXTRA"] == f"{rid}/task-1" and env["LGT_ROLLOUT_ID"] == rid and env["LGT_ATTEMPT"] == "0"
    assert f"//{rid}:" in env["HTTPS_PROXY"] and "ALL_PROXY" not in env and "LGT_CONTROL_TOKEN" not in env
    assert seen["cwd"] == str(tmp_path)

    assert call_attempts(proxy, rid) == [0]  # the proxy recorded the call under this rollout's identity
    [row] = attempts(proxy, rid)
    assert (row["task_id"], row["group_id"], row["step"], row["status"], row["exit_code"]) == \
        ("task-1", "grp-1", 7, "ok", 0)
    assert json.loads(row["metadata_json"])["reward_source"] == "proxy"
    assert rewards(proxy, rid) == [(0, "proxy", 0.75)]  # recorded once, by the proxy


def test_reward_sources_in_order_of_preference(tmp_path, proxy):
    spec = agent(evaluator=(sys.executable, str(AGENTS / "evaluator.py")))
    ctl = controller(proxy, tmp_path / "run", spec, concurrency=3)
    quiet = {"call_model": False, "eval_reward": 4}
    jobs = [
        ({**quiet, "rewards": {"proxy": 1, "file": 2, "stdout": 3}}, "pref-proxy"),
        ({**quiet, "rewards": {"file": 2, "stdout": 3}}, "pref-file"),
        ({**quiet, "rewards": {"stdout": 3}}, "pref-stdout"),
        ({"eval_reward": 4}, "pref-eval"),  # calls the model: the evaluator finds its answer in stdout
        ({**quiet, "reward_file_text": "lots", "rewards": {"stdout": 3}}, "pref-badfile"),
        ({**quiet, "eval_fail": True}, "pref-evalfail"),
    ]
    results = {r.rollout_id: r for r in asyncio.run(run_all(ctl, jobs))}
    got = {rid: (r.status, r.reward_source, r.reward) for rid, r in results.items()}
    assert got == {"pref-proxy": ("ok", "proxy", 1.0), "pref-file": ("ok", "file", 2.0),
                   "pref-stdout": ("ok", "stdout", 3.0), "pref-eval": ("ok", "evaluator", 4.0),
                   "pref-badfile": ("failed", None, None), "pref-evalfail": ("failed", None, None)}
    assert "reward file" in results["pref-badfile"].error and "'lots'" in results["pref-badfile"].error
    assert results["pref-evalfail"].error.startswith("the evaluator exited with code 4")
    assert "evaluator failing on purpose" in results["pref-evalfail"].error
    # the evaluator runs only when no earlier source has a reward
    evaluated = {p.name for p in (tmp_path / "run" / "rollouts").glob("*.eval.out")}
    assert evaluated == {"pref-eval~0.eval.out", "pref-evalfail~0.eval.out"}
    for rid, (status, source, value) in got.items():
        assert rewards(proxy, rid) == ([(0, source, value)] if value is not None else [])
        [row] = attempts(proxy, rid)
        assert row["status"] == status and json.loads(row["metadata_json"])["reward_source"] == source

    # any executable is an agent; one that exits 0 without a reward failed
    script = tmp_path / "agent.sh"
    script.write_text("#!/bin/sh\necho \"model said: The answer is 5.\"\necho \"$TASK_ANSWER\"\n")
    script.chmod(0o755)
    ctl = controller(proxy, tmp_path / "run2", AgentSpec(command=(str(script),), timeout_s=30, retries=0))
    [r] = asyncio.run(run_all(ctl, [({"id": "t-sh", "answer": "five"}, "pref-none")]))
    assert (r.status, r.exit_code, r.reward) == ("failed", 0, None)
    assert r.error == ("the agent exited 0 but reported no reward (looked at: the proxy's reward endpoint, "
                       "the reward file, the last stdout line)")
    assert r.stdout_path.read_text() == "model said: The answer is 5.\nfive\n"
    assert [a["status"] for a in attempts(proxy, "pref-none")] == ["failed"]
    # an agent whose last line is a bare number that is not its reward: leave stdout out
    spec = AgentSpec(command=(str(script),), timeout_s=30, retries=0, reward_sources=("evaluator", "proxy"),
                     evaluator=(sys.executable, str(AGENTS / "evaluator.py")))
    ctl = controller(proxy, tmp_path / "run3", spec)
    [r] = asyncio.run(run_all(ctl, [({"answer": 5, "eval_reward": 0.5}, "pref-nostdout")]))
    assert (r.status, r.reward, r.reward_source) == ("ok", 0.5, "evaluator")


def test_retries_keep_attempts_apart(tmp_path, proxy):
    ctl = controller(proxy, tmp_path / "run", agent(retries=1))
    jobs = [({"fail_attempts": 1, "rewards": {"stdout": 0.5}}, "retry-ok"),
            ({"fail_attempts": 5, "call_model": False}, "retry-out")]
    ok, out = asyncio.run(run_all(ctl, jobs))
    assert (ok.status, ok.attempt, ok.reward, ok.reward_source) == ("ok", 1, 0.5, "stdout")
    assert (out.status, out.attempt, out.exit_code) == ("failed", 1, 3)
    assert out.error == "the agent exited with code 3 (last stderr line: failing on purpose)"
    assert (ctl.done, ctl.failed, ctl.retried, ctl.running) == (2, 1, 2, 0)

    first, second = attempts(proxy, "retry-ok")
    assert (first["attempt"], first["status"], first["exit_code"]) == (0, "failed", 3)
    assert "exited with code 3" in json.loads(first["metadata_json"])["error"]
    assert (second["attempt"], second["status"], second["exit_code"]) == (1, "ok", 0)
    assert call_attempts(proxy, "retry-ok") == [0, 1]  # each attempt's calls under its own identity
    assert rewards(proxy, "retry-ok") == [(1, "stdout", 0.5)]
    assert [a["status"] for a in attempts(proxy, "retry-out")] == ["failed", "failed"]
    outs = sorted(p.name for p in (tmp_path / "run" / "rollouts").glob("retry-ok~*.out"))
    assert outs == ["retry-ok~0.out", "retry-ok~1.out"]


def test_timeout_kills_the_whole_process_group(tmp_path, proxy, pid_dir):
    spec = agent("sleeper_agent.py", timeout_s=1.5)
    ctl = controller(proxy, tmp_path / "run", spec, kill_grace_s=0.5)
    jobs = [({"pid_dir": str(tmp_path), "ignore_term": True}, "slow-stubborn"),
            ({"pid_dir": str(tmp_path), "ignore_term": False}, "slow-polite")]

    async def main():
        stubborn, polite = await run_all(ctl, jobs)
        children = [int((tmp_path / f"{rid}~0.child").read_text()) for _, rid in jobs]
        return stubborn, polite, [await wait_gone(pid) for pid in children]

    stubborn, polite, children_gone = asyncio.run(main())
    assert (stubborn.status, stubborn.exit_code) == ("timeout", -9)  # it ignored SIGTERM: SIGKILL
    assert (polite.status, polite.exit_code) == ("timeout", -15)
    assert stubborn.error == "the agent ran past its 1.5 s timeout and was killed"
    assert children_gone == [True, True]  # the children that slept are gone too
    for rid in ("slow-stubborn", "slow-polite"):
        assert [(a["status"], a["attempt"]) for a in attempts(proxy, rid)] == [("timeout", 0)]


def test_an_agent_that_ignores_sigterm_is_killed_and_its_rollout_retried(tmp_path, proxy, pid_dir):
    ctl = controller(proxy, tmp_path / "run", agent("sleeper_agent.py", timeout_s=1.0, retries=1),
                     kill_grace_s=0.3)

    async def main():
        [result] = await run_all(ctl, [({"pid_dir": str(tmp_path), "ignore_term": True}, "stubborn")])
        children = [int((tmp_path / f"stubborn~{a}.child").read_text()) for a in (0, 1)]
        return result, [await wait_gone(pid) for pid in children]

    result, gone = asyncio.run(main())
    assert (result.status, result.attempt, result.exit_code) == ("timeout", 1, -9)  # retried, killed again
    assert ctl.retried == 1 and gone == [True, True]  # each attempt's whole process group is gone
    recorded = [(a["status"], a["attempt"]) for a in attempts(proxy, "stubborn")]
    assert recorded == [("timeout", 0), ("timeout", 1)]


def test_aclose_stops_running_rollouts(tmp_path, proxy, pid_dir):
    ctl = controller(proxy, tmp_path / "run", agent("sleeper_agent.py", retries=3), kill_grace_s=0.2)
    child_file = tmp_path / "closing~0.child"

    async def main():
        task = asyncio.create_task(ctl.run({"pid_dir": str(tmp_path), "ignore_term": True}, "closing"))
        while not child_file.exists():
            await asyncio.sleep(0.05)
        await ctl.aclose()
        result = await task
        return result, await wait_gone(int(child_file.read_text()))

    result, child_gone = asyncio.run(main())
    assert (result.status, result.attempt, result.exit_code) == ("failed", 0, -9)  # not retried
    assert "when the controller closed" in result.error
    assert child_gone
    with pytest.raises(RolloutError, match="controller is closed"):
        asyncio.run(ctl.run({}, "after-close"))


def test_concurrency_limit(tmp_path, proxy):
    ctl = controller(proxy, tmp_path / "run", agent(), concurrency=2)
    task = {"call_model": False, "sleep": 0.5, "report_dir": str(tmp_path), "rewards": {"stdout": 1}}
    seen_running: list[int] = []

    async def main():
        watch = True

        async def watcher():
            while watch:
                seen_running.append(ctl.running)
                await asyncio.sleep(0.01)

        w = asyncio.create_task(watcher())
        results = await run_all(ctl, [(task, f"conc-{i}") for i in range(5)])
        watch = False
        await w
        return results

    results = asyncio.run(main())
    assert [r.status for r in results] == ["ok"] * 5
    spans = [json.loads((tmp_path / f"conc-{i}~0.json").read_text()) for i in range(5)]
    events = sorted([(s["start"], 1) for s in spans] + [(s["end"], -1) for s in spans])
    level, most = 0, 0
    for _, delta in events:
        level += delta
        most = max(most, level)
    assert most == 2  # never more than the limit, and the limit is used
    assert max(seen_running) == 2 and (ctl.running, ctl.done, ctl.failed) == (0, 5, 0)


def test_base_url_mode_without_https_proxy(tmp_path, proxy, monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # a machine-wide proxy must not be used
    spec = agent(proxy_mode="base_url", env={"OPENAI_BASE_URL": "${LGT_PROXY_BASE_URL}"})
    ctl = controller(proxy, tmp_path / "run", spec)
    task = {"report_dir": str(tmp_path), "rewards": {"proxy": 0.25}}
    [r] = asyncio.run(run_all(ctl, [(task, "base-url")]))
    assert (r.status, r.reward, r.reward_source) == ("ok", 0.25, "proxy")
    env = json.loads((tmp_path / "base-url~0.json").read_text())["env"]
    assert not {"HTTPS_PROXY", "HTTP_PROXY", "https_proxy"} & set(env)
    assert env["OPENAI_BASE_URL"].startswith(f"http://127.0.0.1:{proxy.port}/r/base-url/")
    assert env["LGT_REWARD_URL"] == env["OPENAI_BASE_URL"].removesuffix("/v1") + "/reward"
    [call] = proxy.calls("rollout_id = ?", ["base-url"])
    assert call["attempt"] == 0 and call["requested_model"] == "agent-model"
    assert rewards(proxy, "base-url") == [(0, "proxy", 0.25)]
    assert os.environ["HTTPS_PROXY"] == "http://127.0.0.1:9"  # the trainer's own environment is untouched


def test_python_preload_forks_warm_agents(tmp_path, proxy, pid_dir):
    spec = dataclasses.replace(agent(retries=1, cwd=tmp_path), python_preload=("openai",))
    ctl = controller(proxy, tmp_path / "run", spec)
    jobs = [({"id": "warm", "report_dir": str(tmp_path), "rewards": {"proxy": 0.5}}, "warm-proxy"),
            ({"fail_attempts": 1, "report_dir": str(tmp_path), "rewards": {"stdout": 2}}, "warm-retry")]
    first, retried = asyncio.run(run_all(ctl, jobs))
    assert (first.status, first.reward, first.reward_source) == ("ok", 0.5, "proxy")
    assert (retried.status, retried.attempt, retried.reward) == ("ok", 1, 2.0)
    rows_ = attempts(proxy, "warm-retry")
    assert [(a["status"], a["exit_code"]) for a in rows_] == [("failed", 3), ("ok", 0)]
    assert call_attempts(proxy, "warm-retry") == [0, 1] and call_attempts(proxy, "warm-proxy") == [0]
    seen = json.loads((tmp_path / "warm-proxy~0.json").read_text())
    assert seen["preloaded"] and seen["pid"] == seen["pgid"] and seen["cwd"] == str(tmp_path)
    assert seen["env"]["TASK_ID"] == "warm" and "//warm-proxy:" in seen["env"]["HTTPS_PROXY"]
    assert "model said: The answer is" in first.stdout_path.read_text()
    assert "failing on purpose" in (tmp_path / "run" / "rollouts" / "warm-retry~0.err").read_text()

    # a forked agent that outlives its timeout is killed with its children
    ctl = controller(proxy, tmp_path / "run2", dataclasses.replace(
        agent("sleeper_agent.py", timeout_s=1.5), python_preload=("json",)), kill_grace_s=0.3)
    task = {"pid_dir": str(tmp_path), "ignore_term": True}

    async def main():
        [r] = await run_all(ctl, [(task, "warm-slow")])
        return r, await wait_gone(int((tmp_path / "warm-slow~0.child").read_text()))

    r, child_gone = asyncio.run(main())
    assert (r.status, r.exit_code) == ("timeout", -9) and child_gone

    # the agent's own environment by a relative path (as examples/agents_sdk runs .venv/bin/python):
    # the warm interpreter is that one, found from the agent's working directory
    (tmp_path / "own").symlink_to(sys.prefix)  # this environment, under another name
    spec = AgentSpec(command=("own/bin/python", str(AGENTS / "chat_agent.py")), cwd=tmp_path,
                     timeout_s=60, python_preload=("openai",), sandbox="none")
    own = controller(proxy, tmp_path / "run3", spec)
    [r] = asyncio.run(run_all(own, [({"id": "own", "report_dir": str(tmp_path), "rewards": {"stdout": 1}},
                                     "warm-own")]))
    assert r.status == "ok", (r.status, r.error)
    assert json.loads((tmp_path / "warm-own~0.json").read_text())["preloaded"]

    with pytest.raises(RolloutError, match="python_preload needs an agent command that runs a Python script"):
        AgentSpec(command=("true",), python_preload=("openai",))
    with pytest.raises(RolloutError, match="python_preload must list module names"):
        AgentSpec(command=("python", "a.py"), python_preload=("not a module",))


def test_a_full_store_keeps_the_records_and_says_so(tmp_path, proxy):
    """Records that cannot be written (a full disk: a small tmpfs) stay for the next flush, and the
    error is one sentence."""
    import subprocess

    from lgt.trainer.rollout.controller import StoreWriteError

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        store = disk / "store"
        store.mkdir()
        ctl = RolloutController(agent(), endpoint(proxy), store, tmp_path / "run", 2, batch_records=True)
        [r] = asyncio.run(run_all(ctl, [({"task_id": "t", "rewards": {"stdout": 1}}, "full-1")]))
        assert r.ok  # its row written when the run closed
        ctl._record(r)  # the next attempt's row, waiting for a flush
        filler = disk / "filler"
        with open(filler, "wb") as f, pytest.raises(OSError):
            while True:
                f.write(b"\0" * (64 << 10))
                f.flush()
        message = r"the store .* cannot be written \(No space left on device\): free space there, then"
        with pytest.raises(StoreWriteError, match=message):
            ctl.flush_records()
        filler.unlink()
        assert ctl.flush_records() == 1  # kept, then written
        con = connect(store)
        assert con.execute("SELECT count(*) FROM rollouts_log WHERE rollout_id = 'full-1'").fetchone() == (2,)
        con.close()
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
