"""The child-process helpers (trainer/serving/children.py) on real processes: a free port, a readiness
wait, a log's tail, a process group stopped whole, and a child that dies with its parent."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from lgt.trainer.serving import children

# a leader that starts a grandchild in its own group, prints the grandchild's pid and waits
LEADER = ("import subprocess, sys, time; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True); "
          "time.sleep(60)")


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie
    except OSError:
        return True


def test_a_free_port_can_be_bound_and_nothing_listens_on_it() -> None:
    port = children.free_port()
    assert children.port_is_free("127.0.0.1", port) and not children.listens(port)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert children.listens(port) and not children.port_is_free("127.0.0.1", port)


def test_wait_until_says_ready_exited_or_timed_out() -> None:
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        calls = []
        assert children.wait_until(lambda: calls.append(1) or len(calls) == 3, sleeper, 10, every=0.01)
        t0 = time.monotonic()
        assert not children.wait_until(lambda: False, sleeper, 0.2, every=0.05)
        assert time.monotonic() - t0 >= 0.2 and sleeper.returncode is None  # timed out, still running
    finally:
        children.stop(sleeper, 5)
    quitter = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert not children.wait_until(lambda: False, quitter, 30, every=0.05)
    assert quitter.returncode == 3  # exited: the caller's error names the code


def test_log_tail_is_the_last_lines_or_nothing(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("".join(f"line {i}\n" for i in range(100_000)))  # ~1 MB: only the end is read
    assert children.log_tail(log, 3) == "line 99997\nline 99998\nline 99999"
    assert len(children.log_tail(log).splitlines()) == children.LOG_TAIL_LINES
    assert children.log_tail(tmp_path / "missing.log") == "" and children.log_tail(None) == ""


def test_stop_ends_the_whole_group_and_kills_what_ignores_sigterm() -> None:
    leader = subprocess.Popen([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    grandchild = int(leader.stdout.readline())
    assert children.stop(leader, 10)  # SIGTERM was enough, for both
    assert leader.returncode == -signal.SIGTERM and gone(grandchild)
    assert not children.group_alive(leader.pid)

    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); "
                                 "time.sleep(60)"], stdout=subprocess.PIPE, start_new_session=True)
    stubborn.stdout.readline()  # its handler is set
    assert not children.stop(stubborn, 0.3)  # SIGKILL after 0.3 s
    assert stubborn.returncode == -signal.SIGKILL
    children.signal_group(stubborn.pid, signal.SIGTERM)  # a group that is gone: nothing happens


def test_stop_without_a_group_signals_the_process_alone() -> None:
    proc = subprocess.Popen(["sleep", "60"])  # in this process's group
    assert children.stop(proc, 10, group=False) and proc.returncode == -signal.SIGTERM
    assert children.stop(proc, 10, group=False)  # once reaped: nothing to do


def test_a_child_dies_with_its_parent() -> None:
    parent = ("import subprocess, sys; from lgt.trainer.serving.children import die_with_parent; "
              "p = subprocess.Popen(['sleep', '60'], preexec_fn=die_with_parent, start_new_session=True); "
              "print(p.pid, flush=True)")
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    orphan = int(out.stdout)
    deadline = time.monotonic() + 10
    while not gone(orphan) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(orphan)  # SIGTERM when its parent exited, though in a session of its own
