"""The fork server: each rollout a warm forked process with exactly its own env, cwd, files, exit status."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from lgt.trainer.rollout.forkserver import ForkServer, ForkServerError, python_script_command

AGENT = """
import atexit, json, os, sys, time
atexit.register(lambda: print("atexit ran", file=sys.stderr))
print(json.dumps({"x": os.environ.get("X"), "argv": sys.argv[1:], "cwd": os.getcwd(),
                  "leader": os.getpgid(0) == os.getpid(), "name": __name__,
                  "json_loaded_before": "decimal" in sys.modules}))
print("to stderr", file=sys.stderr)
if sys.argv[1] == "sleep":
    time.sleep(60)
if sys.argv[1] == "raise":
    raise RuntimeError("agent crashed")
sys.exit(int(sys.argv[1]))
"""


def run(coro):
    return asyncio.run(coro)


def test_children_get_their_own_env_cwd_files_and_exit_codes(tmp_path: Path) -> None:
    (tmp_path / "agent.py").write_text(AGENT)
    work = tmp_path / "work"
    work.mkdir()

    async def main():
        fs = await ForkServer.start(sys.executable, ["decimal"])
        try:
            procs = [await fs.spawn([str(tmp_path / "agent.py"), str(code)], {"X": f"x{i}"}, work,
                                    tmp_path / f"{i}.out", tmp_path / f"{i}.err")
                     for i, code in enumerate([0, 3, 0, 7])]
            return [p.pid for p in procs], [await p.wait() for p in procs]
        finally:
            await fs.aclose()

    pids, codes = run(main())
    assert codes == [0, 3, 0, 7]
    assert len(set(pids)) == 4
    import json
    for i in range(4):
        out = json.loads((tmp_path / f"{i}.out").read_text())
        assert out["x"] == f"x{i}" and out["cwd"] == str(work) and out["leader"] and out["name"] == "__main__"
        assert out["json_loaded_before"]  # the preloaded module was already imported
        assert (tmp_path / f"{i}.err").read_text() == "to stderr\natexit ran\n"  # as a fresh process


def test_crash_kill_and_environment_isolation(tmp_path: Path) -> None:
    (tmp_path / "agent.py").write_text(AGENT)
    os.environ["LGT_TEST_PARENT_ONLY"] = "1"

    async def main():
        fs = await ForkServer.start(sys.executable, [])
        try:
            crash = await fs.spawn([str(tmp_path / "agent.py"), "raise"], {}, tmp_path,
                                   tmp_path / "c.out", tmp_path / "c.err")
            sleeper = await fs.spawn([str(tmp_path / "agent.py"), "sleep"], {}, tmp_path,
                                     tmp_path / "s.out", tmp_path / "s.err")
            t = time.monotonic()
            while not (tmp_path / "s.out").exists() or not (tmp_path / "s.out").read_text():
                await asyncio.sleep(0.02)
                assert time.monotonic() - t < 20
            os.killpg(sleeper.pid, signal.SIGKILL)
            return await crash.wait(), await sleeper.wait()
        finally:
            await fs.aclose()

    crash_code, killed_code = run(main())
    assert crash_code == 1 and "RuntimeError: agent crashed" in (tmp_path / "c.err").read_text()
    assert killed_code == -signal.SIGKILL
    assert "LGT_TEST_PARENT_ONLY" not in (tmp_path / "c.out").read_text()


def test_bad_preload_is_one_sentence() -> None:
    with pytest.raises(ForkServerError, match="could not import no_such_module_xyz"):
        run(ForkServer.start(sys.executable, ["no_such_module_xyz"]))


def test_python_script_command() -> None:
    assert python_script_command(["python", "agent.py", "-v"]) == ("python", ["agent.py", "-v"])
    assert python_script_command(["/x/bin/python3.11", "a.py"]) == ("/x/bin/python3.11", ["a.py"])
    assert python_script_command(["python", "-m", "agent"]) is None
    assert python_script_command(["node", "agent.js"]) is None


def test_auto_preload_learns_the_library_modules_of_the_first_rollouts(tmp_path: Path) -> None:
    (tmp_path / "agent.py").write_text(
        "import sys\nprint('yaml' in sys.modules)\nimport yaml\n")

    async def main():
        fs = await ForkServer.start(sys.executable, ["auto"])
        try:
            seen = []
            for i in range(3):
                p = await fs.spawn([str(tmp_path / "agent.py")], {}, tmp_path, tmp_path / f"{i}.out",
                                   tmp_path / f"{i}.err")
                assert await p.wait() == 0
                seen.append((tmp_path / f"{i}.out").read_text().strip())
            return seen, fs.learn_dir
        finally:
            await fs.aclose()

    # the first child imports yaml itself; the zygote then imports it, so later children start with it
    seen, learn_dir = run(main())
    assert seen == ["False", "True", "True"]
    assert learn_dir and not os.path.exists(learn_dir)  # the folder the children listed modules in


def test_a_burst_waits_for_the_first_rollouts_imports_not_for_its_end(tmp_path: Path) -> None:
    """The forks after a learning child's wait for its list of modules, written once it has imported
    nothing new for a moment — not for its end: a rollout can take minutes (this one sleeps 120 s,
    twice the most the burst would wait for it to end)."""
    (tmp_path / "agent.py").write_text(
        "import sys, time\nprint('yaml' in sys.modules, flush=True)\nimport yaml\n"
        "if sys.argv[1:] == ['long']:\n    time.sleep(120)\n")

    async def main():
        fs = await ForkServer.start(sys.executable, ["auto"])
        try:
            first = await fs.spawn([str(tmp_path / "agent.py"), "long"], {}, tmp_path, tmp_path / "0.out",
                                   tmp_path / "0.err")
            second = await fs.spawn([str(tmp_path / "agent.py")], {}, tmp_path, tmp_path / "1.out",
                                    tmp_path / "1.err")
            assert await second.wait() == 0
            assert first.returncode is None  # still running
            os.killpg(first.pid, signal.SIGKILL)
            await first.wait()
        finally:
            await fs.aclose()

    run(main())
    assert (tmp_path / "0.out").read_text().strip() == "False"  # the first imported yaml itself
    assert (tmp_path / "1.out").read_text().strip() == "True"  # the zygote had imported it for the second


def test_the_learning_folder_is_removed_when_the_server_was_killed(tmp_path: Path) -> None:
    """A zygote SIGKILLed (or stopped by aclose's SIGTERM) cannot clean up: its folder is the caller's."""
    (tmp_path / "agent.py").write_text("import yaml\n")

    async def main():
        fs = await ForkServer.start(sys.executable, ["auto"])
        p = await fs.spawn([str(tmp_path / "agent.py")], {}, tmp_path, tmp_path / "out", tmp_path / "err")
        assert await p.wait() == 0
        assert os.listdir(fs.learn_dir)  # the first child listed what it imported
        os.killpg(fs.proc.pid, signal.SIGKILL)
        await fs.proc.wait()
        await fs.aclose()
        return fs.learn_dir

    assert not os.path.exists(run(main()))


def test_spawns_cancelled_while_starting_leave_no_child_and_no_stuck_server(tmp_path: Path) -> None:
    """A run that stops (Ctrl-C, a fatal error) cancels rollouts that are still being forked: their
    children are killed when their pids arrive, and the server goes on reporting the others' exits."""
    (tmp_path / "agent.py").write_text(AGENT)
    marker = str(tmp_path / "agent.py")
    work = tmp_path / "cancelled"  # the cwd of the cancelled spawns' children, and only theirs
    work.mkdir()

    async def main():
        fs = await ForkServer.start(sys.executable, [])
        try:
            tasks = [asyncio.get_running_loop().create_task(
                fs.spawn([marker, "sleep"], {}, work, tmp_path / f"{i}.out", tmp_path / f"{i}.err"))
                for i in range(20)]
            # The server is stopped while the requests are written, so no pid can come back before the
            # cancellations however fast this machine forks; it forks them all once it goes on.
            os.kill(fs.proc.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(0.05)
                cancelled = sum(t.cancel() for t in tasks)
            finally:
                os.kill(fs.proc.pid, signal.SIGCONT)
            await asyncio.gather(*tasks, return_exceptions=True)
            p = await asyncio.wait_for(
                fs.spawn([marker, "5"], {}, tmp_path, tmp_path / "last.out", tmp_path / "last.err"), 30)
            code = await asyncio.wait_for(p.wait(), 30)
            for t in tasks:  # the ones that did start are the caller's: stop them as the controller would
                if not t.cancelled():
                    os.killpg(t.result().pid, signal.SIGKILL)
            return cancelled, code
        finally:
            await fs.aclose()

    cancelled, code = run(main())
    assert cancelled == 20 and code == 5  # the server still reports exits after the cancellations
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _runs_in(pid, work)]
        if not left:
            break
        time.sleep(0.1)
    assert not left, f"children of cancelled spawns still running: {left}"


def _runs_in(pid: str, cwd: Path) -> bool:
    """A live process whose working directory is ``cwd`` (a forked child never execs: its cmdline is the
    fork server's, so the directory its request gave it is what tells it apart)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z" and os.readlink(f"/proc/{pid}/cwd") == str(cwd)
    except OSError:
        return False


def test_children_start_with_the_sdk_caches_filled(tmp_path: Path) -> None:
    """A forked child finds what every OpenAI-SDK agent would otherwise compute again on its first call:
    the resolved type hints of the request TypedDicts it sends, and platform.processor() (a `uname -p`
    subprocess the first time in a process)."""
    (tmp_path / "agent.py").write_text(
        "import json, platform\n"
        "from openai._utils import _transform\n"
        "from openai.types.chat import completion_create_params as p\n"
        "before = _transform.get_type_hints.cache_info()\n"
        "_transform.get_type_hints(p.CompletionCreateParamsBase, include_extras=True)\n"
        "after = _transform.get_type_hints.cache_info()\n"
        "import sys\n"
        "print(json.dumps({'cached': after.hits - before.hits, 'size': before.currsize,\n"
        "                  'processor': 'processor' in vars(platform.uname()),\n"
        "                  'idna': 'encodings.idna' in sys.modules}))\n")

    async def main():
        fs = await ForkServer.start(sys.executable, ["openai", "openai.types.chat.completion_create_params"])
        try:
            proc = await fs.spawn([str(tmp_path / "agent.py")], {}, tmp_path, tmp_path / "o", tmp_path / "e")
            return await proc.wait()
        finally:
            await fs.aclose()

    assert run(main()) == 0, (tmp_path / "e").read_text()
    import json
    out = json.loads((tmp_path / "o").read_text())
    assert out["cached"] == 1 and out["size"] > 100  # a cache hit: resolved before the fork
    assert out["processor"]  # the cached uname result already knows the processor
    assert out["idna"]  # the codec a client's first host name needs is imported
