"""The fork server's process: imports an agent's heavy modules once, then forks one child per rollout.

Run by the agent's own interpreter as a plain script (it imports nothing of lgt):
``python zygote.py MODULE...``. Protocol, one JSON object per line:
  stdin  ← {"id": 1, "argv": ["agent.py", ...], "env": {...}, "cwd": "...", "stdout": PATH, "stderr": PATH}
  stdout → {"ready": true} once the modules are imported (or {"error": "..."}),
           {"id": 1, "pid": 123} when the child started, {"id": 1, "exit": 0} when it ended
           (a negative exit is the signal that killed it, as in subprocess).
Each child is its own session and process group (killable as a group), its environment and working
directory are exactly the request's, stdin is /dev/null, and it runs ``argv[0]`` as ``__main__``.
"""

import importlib
import json
import os
import runpy
import sys
import threading
import time

_lock = threading.Lock()
_ids: dict[int, int] = {}


def send(obj: dict) -> None:
    with _lock:
        out.write(json.dumps(obj) + "\n")
        out.flush()


def child(req: dict) -> None:
    code = 0
    try:
        os.setsid()
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
        for target, path in ((1, req["stdout"]), (2, req["stderr"])):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, target)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        if req.get("cwd"):
            os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = list(req["argv"])
        script = os.path.abspath(sys.argv[0])
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the agent's crash is its exit status, as in a fresh process
        import traceback
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def reaper() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            time.sleep(0.01)
            continue
        code = os.waitstatus_to_exitcode(status)
        with _lock:
            rid = _ids.pop(pid, None)
        if rid is not None:
            send({"id": rid, "exit": code})


def main() -> None:
    try:
        for name in sys.argv[1:]:
            importlib.import_module(name)
    except Exception as e:  # noqa: BLE001
        send({"error": f"could not import {name}: {e}"})
        return
    send({"ready": True})
    threading.Thread(target=reaper, daemon=True).start()
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        with _lock:  # the reaper must not see the child before its id is known
            pid = os.fork()
            if pid == 0:
                _lock.release()
                child(req)
            _ids[pid] = req["id"]
        send({"id": req["id"], "pid": pid})


if __name__ == "__main__":
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # modules that print while importing must not break the protocol
    main()
