"""The local runner's sandbox (agent.sandbox: bwrap, the default), attacked by agents run through the
real rollout controller and a real lgt-proxy: each attack is refused or contained, the attempt is
recorded with its reason, and the controller goes on to run an honest agent."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from lgt.testing.rollouts import AGENTS, endpoint, run_all, running_with
from lgt.trainer.rollout import sandbox as sandboxing
from lgt.trainer.rollout.agent import AgentSpec, RolloutError
from lgt.trainer.rollout.controller import RolloutController
from lgt.trainer.rollout.runners import check_agent
from lgt.trainer.rollout.sandbox import SandboxSpec


def spec(script: str = "attacker.py", **kw: Any) -> AgentSpec:
    kw.setdefault("timeout_s", 60)
    kw.setdefault("retries", 0)
    return AgentSpec(command=(sys.executable, str(AGENTS / script)), **kw)


def run(proxy: Any, tmp_path: Path, agent: AgentSpec, jobs: list[tuple[dict, str]], **kw: Any) -> list[Any]:
    ctl = RolloutController(agent, endpoint(proxy), proxy.store, tmp_path / "run", 4, **kw)
    return asyncio.run(run_all(ctl, jobs))


def outcomes(result: Any) -> dict[str, Any]:
    lines = result.stdout_path.read_text().splitlines()
    report = next(json.loads(line) for line in reversed(lines) if line.startswith("{"))
    return report["outcomes"]


def listening_ports() -> set[int]:
    """Every TCP port listening on this machine (the engine's, the proxy's, its control API, the
    test's own servers)."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_the_store_the_tasks_and_other_rollouts_are_out_of_sight(tmp_path, proxy):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"task_id": "a", "answer": 42}\n')
    private = proxy.store / "_proxy"
    secrets = [str(p) for p in sorted(private.iterdir()) if p.is_file()]
    assert any(p.endswith("secret") for p in secrets) and any("key" in p or "ca" in p for p in secrets)
    targets = [*secrets, str(private) + "/", str(proxy.store) + "/", str(tasks), str(tmp_path / "run") + "/",
               sandboxing.ATTEMPTS + "/"]
    jobs = [({"attack": "read", "targets": json.dumps(targets)}, "read-0"),
            ({"attack": "write", "targets": json.dumps(["mine"])}, "read-1")]
    agent = spec(cwd=tmp_path)
    r, _ = run(proxy, tmp_path, agent, jobs, hide=[tasks])
    assert r.status == "ok", r.error
    seen = outcomes(r)
    # refused, or an empty stand-in (a hidden file reads as empty, a hidden folder lists nothing)
    assert not [t for t, what in seen.items() if what.startswith(("READ", "LISTED"))
                and what not in ("READ ", "LISTED ")], seen
    # the agent's folder is visible (read-only); the tasks file in it is not
    assert tasks.read_text().startswith('{"task_id"')


def test_private_fields_reach_only_the_evaluator(tmp_path, proxy):
    (tmp_path / "grade.py").write_text(
        "import json, os, sys\n"
        "task = json.load(open(sys.argv[1]))\n"
        "answer = open(os.path.join(os.environ['LGT_WORK_DIR'], 'answer.txt')).read()\n"
        "print(1.0 if answer == str(task['answer']) else 0.0)\n")
    agent = spec(cwd=tmp_path, private=("answer",), reward_sources=("evaluator",),
                 evaluator=(sys.executable, str(tmp_path / "grade.py")))
    jobs = [({"attack": "env", "answer": 42, "question": "6*7?"}, "priv-env"),
            ({"attack": "write", "targets": json.dumps(["42"]), "answer": 42}, "priv-right"),
            ({"attack": "write", "targets": json.dumps(["41"]), "answer": 42}, "priv-wrong")]
    env, right, wrong = run(proxy, tmp_path, agent, jobs)
    seen = outcomes(env)
    assert "TASK_ANSWER" not in seen["environ"] and "answer" not in seen["task_json"]
    assert seen["environ"]["TASK_QUESTION"] == "6*7?" and seen["task_json"]["question"] == "6*7?"
    assert not [k for k in seen["environ"] if "SECRET" in k]
    assert seen["id"] == sandboxing.AGENT_UID and seen["pid"] == 1 and seen["procs"] == [1]
    assert (right.status, right.reward, right.reward_source) == ("ok", 1.0, "evaluator")
    assert (wrong.status, wrong.reward) == ("ok", 0.0)
    assert not (tmp_path / "run" / "rollouts" / "work" / "priv-right~0").exists()  # cleaned up after


def test_no_way_out_but_the_proxy(tmp_path, proxy, upstream):
    ports = listening_ports() - {proxy.port}
    assert proxy.control_port in ports and urlsplit(upstream.url).port in ports
    jobs = [({"attack": "ports", "targets": json.dumps(sorted(ports))}, "net-ports"),
            ({"attack": "route"}, "net-route"),
            ({"question": "What is 2+3?", "rewards": {"stdout": 1}}, "net-honest")]
    agent = spec()
    r_ports, r_route = run(proxy, tmp_path, agent, jobs[:2])
    assert [what for what in outcomes(r_ports).values() if what == "CONNECTED"] == []
    assert len(outcomes(r_ports)) == len(ports)
    route = outcomes(r_route)
    assert route["interfaces"] == ["lo"] and route["routes"] == [] and route["routes6"] == []
    # through the proxy, the one way out, the model answers as usual
    [honest] = run(proxy, tmp_path, spec("chat_agent.py"), jobs[2:])
    assert honest.status == "ok" and "model said: The answer is" in honest.stdout_path.read_text()


def test_daemons_forks_disk_and_memory_are_contained(tmp_path, proxy):
    marker = f"lgt-daemon-{os.getpid()}-{tmp_path.name}"
    limits = SandboxSpec(processes=64, disk_mb=8, tmp_mb=4, memory_mb=256)
    jobs = [({"attack": "daemon", "targets": json.dumps([marker])}, "c-daemon"),
            ({"attack": "forkbomb"}, "c-fork"),
            ({"attack": "memory", "targets": json.dumps([1 << 30])}, "c-mem"),
            ({"attack": "file", "targets": json.dumps([64])}, "c-file"),
            ({"attack": "tmp", "targets": json.dumps([64])}, "c-tmp"),
            ({"attack": "files", "targets": json.dumps([40])}, "c-files")]
    daemon, fork, mem, big, tmp, files = run(proxy, tmp_path, spec(sandbox=limits), jobs)
    assert daemon.status == "ok" and outcomes(daemon)["started"]
    assert running_with(marker) == []  # the daemon ended with its attempt
    assert fork.status == "ok" and outcomes(fork)["error"] == "BlockingIOError" \
        and outcomes(fork)["forked"] < 64
    assert outcomes(mem)["allocated"] == "MemoryError"
    assert outcomes(big)["error"] == "OSError" and outcomes(big)["written_mb"] <= 8  # a file's size
    assert outcomes(tmp)["error"] == "OSError" and outcomes(tmp)["written_mb"] <= 4  # /tmp's size
    assert files.status == "failed" and "grew past its 8 MB limit" in files.error


def test_a_sandbox_that_cannot_start_is_refused_with_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap here
    with pytest.raises(RolloutError, match="bwrap is not on PATH: install bubblewrap .* agent.sandbox: none"):
        check_agent(AgentSpec(command=("/bin/true",)))
    check_agent(AgentSpec(command=("/bin/true",), sandbox="none"))  # off: nothing to check
    with pytest.raises(ValueError, match="agent sandbox must be one of bwrap, none, not 'docker'"):
        SandboxSpec(kind="docker")


def test_the_run_config_default_is_sandbox_and_egress_allowlist(tmp_path):
    from lgt.trainer import config
    from lgt.trainer.report import summary

    (tmp_path / "tasks.jsonl").write_text('{"task_id": "a"}\n')
    (tmp_path / "run.yaml").write_text("agent: {command: [python, agent.py]}\ntasks: tasks.jsonl\n"
                                       "model: {path: m}\n")
    cfg = config.load(tmp_path / "run.yaml")
    assert cfg.agent.sandbox.kind == "bwrap" and cfg.proxy.egress_args() == ["--egress", "deny"]
    (tmp_path / "run.yaml").write_text("agent: {command: [python, agent.py], sandbox: none}\n"
                                       "tasks: tasks.jsonl\nmodel: {path: m}\n"
                                       "proxy: {allow_hosts: [pypi.org]}\n")
    cfg = config.load(tmp_path / "run.yaml")
    assert cfg.agent.sandbox.kind == "none"
    assert cfg.proxy.egress_args() == ["--egress", "allowlist", "--allow-host", "pypi.org"]
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_json()))
    line = summary.render(summary.summarize(tmp_path))
    assert "agents           NOT sandboxed (agent.sandbox: none) · egress allowlist" in line
    with pytest.raises(config.ConfigError, match="proxy.egress must be one of allow, allowlist, deny"):
        (tmp_path / "run.yaml").write_text("agent: {command: [python, agent.py]}\ntasks: tasks.jsonl\n"
                                           "model: {path: m}\nproxy: {egress: open}\n")
        config.load(tmp_path / "run.yaml")


def test_a_burst_of_warm_started_rollouts_all_start(tmp_path, proxy):
    """More sandboxed rollouts at once than a unix socket holds unread messages, while the zygote
    waits for its first (learning) child: none may wait on another (this once deadlocked)."""
    agent = spec("chat_agent.py", python_preload=("auto",), timeout_s=60)
    jobs = [({"question": f"What is {i}+1?", "rewards": {"stdout": 1}}, f"burst-{i}") for i in range(64)]
    ctl = RolloutController(agent, endpoint(proxy), proxy.store, tmp_path / "run", 64)
    results = asyncio.run(run_all(ctl, jobs))
    assert [r.error for r in results if r.status != "ok"] == []
    assert max(r.seconds for r in results) < 30


def _zygote_children() -> list[int]:
    """The children of this test's sandboxed zygotes (``zygote.py --sandbox``, under bwrap)."""
    def status(pid: int | str) -> dict[str, str]:
        try:
            text = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return {}
        return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)

    def ours(pid: int) -> bool:
        for _ in range(6):  # bwrap (outside), bwrap (its pid 1), the zygote
            pid = int(status(pid).get("PPid", "0"))
            if pid == os.getpid():
                return True
        return False

    zygotes = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"zygote.py\0--sandbox" in cmd and not cmd.split(b"\0")[0].endswith(b"bwrap") and ours(int(pid)):
            zygotes.add(pid)
    return [int(p) for p in filter(str.isdigit, os.listdir("/proc")) if status(p).get("PPid") in zygotes]


def test_each_attempt_is_the_zygotes_own_child_and_pid_1_of_its_namespace(tmp_path, proxy):
    """The zygote forks each attempt straight into a pid namespace of its own: no process stands
    between them (one fork and one exit an attempt, not two), the attempt's exit is the zygote's
    child's, and the next attempt gets a namespace of its own again."""
    script = tmp_path / "napper.py"
    script.write_text("import sys, time\ntime.sleep(float(sys.argv[1]))\nprint(1)\n"
                      "sys.exit(int(sys.argv[2]))\n")
    seen: list[list[str]] = []

    async def main() -> list[Any]:
        agent = AgentSpec(command=(sys.executable, str(script), "3", "0"), python_preload=("json",),
                          timeout_s=60, retries=0, reward_sources=("stdout",))
        ctl = RolloutController(agent, endpoint(proxy), proxy.store, tmp_path / "run", 4)
        task = asyncio.ensure_future(run_all(ctl, [({}, f"nap-{i}") for i in range(3)]))
        for _ in range(100):
            await asyncio.sleep(0.1)
            children = _zygote_children()
            if len(children) == 3:
                for pid in children:
                    seen.append(Path(f"/proc/{pid}/status").read_text().split("NSpid:\t")[1].split("\n")[0]
                                .split())
                break
        return await task

    results = asyncio.run(main())
    assert [r.status for r in results] == ["ok"] * 3
    assert len(seen) == 3 and all(ns[-1] == "1" and len(ns) >= 3 for ns in seen), seen
    assert len({ns[0] for ns in seen}) == 3
    # a failing agent's exit status is the attempt's, as before
    failing = AgentSpec(command=(sys.executable, str(script), "0", "3"), python_preload=("json",),
                        timeout_s=60, retries=0, reward_sources=("stdout",))
    [bad] = run(proxy, tmp_path / "bad", failing, [({}, "nap-bad")])
    assert bad.status == "failed" and bad.exit_code == 3


def test_a_pid_namespace_the_zygote_cannot_make_is_one_sentence_to_the_controller():
    """sandbox_init.fork when unshare or the fork fails: the controller is told why on the control
    socket, no child is forked, nothing is left open, and the zygote goes on (None) in its own pid
    namespace."""
    import ctypes
    import importlib.util
    import socket

    path = Path(sandboxing.__file__).with_name("sandbox_init.py")
    module_spec = importlib.util.spec_from_file_location("lgt_sandbox_init_under_test", path)
    sandbox_init = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(sandbox_init)

    class NoNamespaces:
        def unshare(self, flags: int) -> int:
            ctypes.set_errno(28)  # ENOSPC: the user's pid namespaces are used up
            return -1

        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"{name} must not be called")

    class NoForks:  # the namespace is made, the fork fails: the zygote's own namespace is set back
        def __init__(self) -> None:
            self.calls: list[str] = []

        def unshare(self, flags: int) -> int:
            self.calls.append("unshare")
            return 0

        def setns(self, fd: int, flags: int) -> int:
            self.calls.append("setns")
            return 0

    def no_fork() -> int:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    open_fds = len(os.listdir("/proc/self/fd"))
    try:
        sandbox_init._libc = NoNamespaces()
        before = os.getpid()
        assert sandbox_init.fork({"id": 7, "sandbox": {"map_to": 12345}}, theirs) is None
        assert os.getpid() == before
        answer = json.loads(ours.recv(4096))
        assert answer["id"] == 7 and answer["error"].startswith("the sandbox could not be set up (")
        assert "No space left on device" in answer["error"]

        sandbox_init._libc = libc = NoForks()
        sandbox_init.os = type("OsWithoutFork", (), {"__getattr__": lambda self, name: getattr(os, name),
                                                     "fork": staticmethod(no_fork)})()
        assert sandbox_init.fork({"id": 8, "sandbox": {"map_to": 12345}}, theirs) is None
        assert libc.calls == ["unshare", "setns"]
        answer = json.loads(ours.recv(4096))
        assert answer["id"] == 8 and "Resource temporarily unavailable" in answer["error"]
        os.close(sandbox_init._own_pid_ns)
        assert len(os.listdir("/proc/self/fd")) == open_fds  # the pipes for the uid's mapping closed
    finally:
        ours.close()
        theirs.close()


def test_a_python_on_path_that_is_a_shim_runs_the_interpreter_it_stands_for(tmp_path, proxy, monkeypatch):
    """`python` on PATH as pyenv or asdf put it there: a shell script under the user's home that finds
    the interpreter and execs it (here: this one). Inside the sandbox the script's folder is out of
    sight, so the warm interpreter is the one the shim picks, asked outside."""
    from lgt.trainer.rollout.agent import real_python

    shims = tmp_path / "home" / ".pyenv" / "shims"
    shims.mkdir(parents=True)
    (shims / "python").write_text(f'#!/usr/bin/env bash\nexec "{sys.executable}" "$@"\n')
    (shims / "python").chmod(0o755)
    assert real_python(str(shims / "python")) == sys.executable
    assert real_python(sys.executable) == sys.executable  # an interpreter is itself
    monkeypatch.setenv("PATH", f"{shims}:{os.environ['PATH']}")
    agent = AgentSpec(command=("python", str(AGENTS / "chat_agent.py")), python_preload=("auto",),
                      timeout_s=60, retries=0)
    [result] = run(proxy, tmp_path, agent, [({"question": "What is 1+1?", "rewards": {"stdout": 1}}, "shim")])
    assert result.status == "ok", result.error
