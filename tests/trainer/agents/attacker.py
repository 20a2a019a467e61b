"""An agent that tries to get out of its sandbox: ``$TASK_ATTACK`` names the attempt, ``$TASK_TARGETS``
(JSON) what to aim at. It prints one JSON line of what it found ({"attack", "outcomes": {target: what
happened}}), then its reward, 0. Knows nothing of lgt beyond the variables every agent gets."""

import json
import os
import socket
import subprocess
import sys
import time


def try_read(path):
    try:
        with open(path, "rb") as f:
            return "READ " + f.read(40).decode(errors="replace")
    except OSError as e:
        return type(e).__name__


def try_list(path):
    try:
        return "LISTED " + ",".join(sorted(os.listdir(path)))
    except OSError as e:
        return type(e).__name__


def try_connect(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return "CONNECTED"
    except OSError as e:
        return type(e).__name__


def main():
    attack = os.environ["TASK_ATTACK"]
    targets = json.loads(os.environ.get("TASK_TARGETS", "[]"))
    out = {}
    if attack == "read":
        for path in targets:
            out[path] = try_list(path) if path.endswith("/") else try_read(path)
    elif attack == "env":
        out["environ"] = {k: v for k, v in os.environ.items() if k.startswith("TASK_") or "SECRET" in k}
        out["task_json"] = json.loads(open(os.environ["TASK_JSON"]).read())
        out["id"] = os.getuid()
        out["pid"] = os.getpid()
        out["procs"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    elif attack == "ports":
        for port in targets:
            out[str(port)] = try_connect(port)
    elif attack == "route":
        out["interfaces"] = [name for _, name in socket.if_nameindex()]
        out["routes"] = open("/proc/net/route").read().splitlines()[1:]
        out["routes6"] = [line for line in open("/proc/net/ipv6_route").read().splitlines()
                          if not line.rstrip().endswith("lo")]
    elif attack == "daemon":
        # a grandchild in a session of its own, detached from everything: it must not outlive us
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", targets[0]],
                         start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.3)
        out["started"] = True
    elif attack == "forkbomb":
        children, error = [], None
        for _ in range(5000):
            try:
                pid = os.fork()
            except OSError as e:
                error = type(e).__name__
                break
            if pid == 0:
                time.sleep(30)
                os._exit(0)
            children.append(pid)
        out["forked"], out["error"] = len(children), error
    elif attack == "memory":
        try:
            blob = bytearray(int(targets[0]))
            out["allocated"] = len(blob)
        except MemoryError:
            out["allocated"] = "MemoryError"
    elif attack in ("file", "tmp"):
        folder = os.environ["HOME"] if attack == "file" else "/tmp"
        chunk, written, error = b"x" * (1 << 20), 0, None
        try:
            with open(os.path.join(folder, "big"), "wb") as f:
                for _ in range(int(targets[0])):
                    f.write(chunk)
                    f.flush()
                    written += 1
        except OSError as e:
            error = type(e).__name__
        out["written_mb"], out["error"] = written, error
    elif attack == "files":  # many files, each under the size limit
        for i in range(int(targets[0])):
            with open(os.path.join(os.environ["HOME"], f"part{i}"), "wb") as f:
                f.write(b"y" * (1 << 20))
            time.sleep(0.02)
        out["done"] = True
    elif attack == "write":  # the agent's own work folder is its to write; the evaluator reads it
        with open(os.path.join(os.environ["HOME"], "answer.txt"), "w") as f:
            f.write(targets[0])
        out["wrote"] = True
    print(json.dumps({"attack": attack, "outcomes": out}))
    print(0)


if __name__ == "__main__":
    main()
