"""The fork server's process: imports an agent's heavy modules once, then forks one child per rollout.

Run by the agent's own interpreter as a plain script (it imports nothing of lgt):
``python zygote.py MODULE...``. Protocol, one JSON object per line:
  stdin  ← {"id": 1, "argv": ["agent.py", ...], "env": {...}, "cwd": "...", "stdout": PATH, "stderr": PATH}
  stdout → {"ready": true} once the modules are imported (or {"error": "..."}),
           {"id": 1, "pid": 123} when the child started, {"id": 1, "exit": 0} when it ended
           (a negative exit is the signal that killed it, as in subprocess).
Each child is its own session and process group (killable as a group), its environment and working
directory are exactly the request's, stdin is /dev/null, and it runs ``argv[0]`` as ``__main__``; its
atexit handlers run when it ends, then it leaves without the interpreter's teardown (``os._exit``).

``--learn DIR`` (before the modules) learns the rest: the first children, as they exit, list the library
modules they imported (files under the interpreter's prefixes, never the agent's own code) in DIR, a
folder the caller made and removes, and the zygote imports those before the next fork — so later
rollouts start with everything the agent uses loaded. A learning child lists them twice: once it has
imported nothing new for SETTLE_S (its imports done: most often it is waiting on its first model call),
and as it exits. Forks wait for the first child's first list (at most 60 s), so a burst of rollouts
does not start cold, nor waits for a rollout that takes minutes to end.
"""

import atexit
import gc
import glob
import importlib
import json
import os
import platform
import runpy
import socket
import sys
import threading
import time
import typing

_lock = threading.Lock()
_ids: dict[int, int] = {}
LEARN_CHILDREN = 3
SETTLE_S = 0.3  # a learning child that imported nothing new for this long lists its modules
LEARN_WAIT_S = 60.0  # the most forks wait for the first learning child's list
learn_dir = ""
sandbox_init = None  # --sandbox: the module that makes each attempt's namespaces
control: "socket.socket | None" = None  # --sandbox: requests come here, each attempt in its own namespaces
_first_learned = threading.Event()  # set when a child has exited (the first learning child's list is in)
_roots = tuple({os.path.realpath(p) + os.sep for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})


def send(obj: dict) -> None:
    with _lock:
        out.write(json.dumps(obj) + "\n")
        out.flush()


def child(req: dict, fds: list[int]) -> None:
    code = 0
    try:
        if control is not None:  # the attempt's own namespaces (sandbox_init.py); its files came as fds
            sandbox_init.enter(req, control)
        os.setsid()
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
        for target, path in ((1, req["stdout"]), (2, req["stderr"])):
            fd = fds[target - 1] if fds else os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, target)
        if control is not None:  # nothing of the zygote's stays open in the agent (its protocol included)
            os.closerange(3, 65536)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        if req.get("cwd"):
            os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = list(req["argv"])
        if req.get("exec"):  # any program, not a Python script
            try:
                os.execvpe(sys.argv[0], sys.argv, req["env"])
            except OSError as e:
                print(f"lgt: could not run {sys.argv[0]!r}: {e.strerror or e}", file=sys.stderr)
                code = 127
                return
        script = os.path.abspath(sys.argv[0])
        sys.path[0] = os.path.dirname(script)
        if req.get("learn"):
            threading.Thread(target=_list_when_settled, daemon=True).start()
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
        if req.get("learn"):
            _list_library_modules()
        try:
            atexit._run_exitfuncs()  # as a process that exits normally does (the agent's log flushes …)
        except BaseException:  # noqa: BLE001 - like the interpreter, an atexit error is printed, not fatal
            pass
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _list_library_modules() -> None:
    """(In a child) the library modules it imported, for the zygote to import before later forks."""
    names = []
    for name, mod in list(sys.modules.items()):
        path = getattr(mod, "__file__", None)
        if path and os.path.realpath(path).startswith(_roots) and "site-packages" in path:
            names.append(name)
    try:
        tmp = os.path.join(learn_dir, f".{os.getpid()}-{threading.get_ident()}.tmp")  # listed twice
        with open(tmp, "w") as f:
            json.dump(names, f)
        os.replace(tmp, os.path.join(learn_dir, f"{os.getpid()}.json"))
    except OSError:
        pass


def _list_when_settled() -> None:
    """(In a learning child, beside the agent) the library modules listed as soon as the agent has
    imported nothing new for ``SETTLE_S``, so that the forks waiting on it go on then (listed again at
    its exit, with what it imported later)."""
    count, since = len(sys.modules), time.monotonic()
    while True:
        time.sleep(0.05)
        if len(sys.modules) != count:
            count, since = len(sys.modules), time.monotonic()
        elif time.monotonic() - since >= SETTLE_S:
            _list_library_modules()
            return


def _wait_learned() -> None:
    """(In the zygote) until the first learning child has listed its modules or a child exited, at most
    ``LEARN_WAIT_S``."""
    end = time.monotonic() + LEARN_WAIT_S
    while not _first_learned.is_set() and time.monotonic() < end:
        if glob.glob(os.path.join(learn_dir, "*.json")):
            return
        _first_learned.wait(0.02)


def _import_learned() -> bool:
    """Import what the learning children listed; whether anything new was imported."""
    before = len(sys.modules)
    for path in glob.glob(os.path.join(learn_dir, "*.json")):
        try:
            with open(path) as f:
                names = json.load(f)
            os.unlink(path)
        except (OSError, ValueError):
            continue
        for name in names:
            if name not in sys.modules:
                try:
                    importlib.import_module(name)
                except Exception:  # noqa: BLE001 - a module that cannot be imported ahead stays lazy
                    pass
    return len(sys.modules) > before


def _complete_lazy_models() -> None:
    """Build, once, the validators pydantic defers to a model's first use (the OpenAI and Anthropic
    SDKs define hundreds of models): every fork would otherwise build the ones it touches again,
    ~20 ms of each short rollout. Nothing else runs; a model that cannot be built stays lazy."""
    pydantic = sys.modules.get("pydantic")
    base = getattr(pydantic, "BaseModel", None)
    if base is None:
        return
    seen, stack = set(), [base]
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in seen:
                seen.add(sub)
                stack.append(sub)
    for model in seen:
        if getattr(model, "__pydantic_complete__", True) is False:
            try:
                model.model_rebuild()
            except Exception:  # noqa: BLE001 - e.g. an unresolved forward reference: built on first use
                pass


def _warm_caches() -> None:
    """Fill, once, per-process caches that every child would otherwise fill again on its first call:

    * Stainless-generated SDKs (openai, anthropic and others: ``<sdk>._utils._transform``) turn each
      request's TypedDict parameters into JSON by resolving the TypedDicts' type hints, cached per
      process — ~19 ms of CPU in every one-call rollout. Resolved here for the SDK types loaded.
    * ``platform``: SDKs send the OS and CPU in their headers; ``platform.processor()`` runs ``uname -p``
      in a subprocess the first time in each process.
    * the ``idna`` codec, imported by the first host name a client encodes (~1 ms a child).
    Nothing else runs; whatever fails stays lazy. Pydantic's deferred models first
    (:func:`_complete_lazy_models`)."""
    _complete_lazy_models()
    try:
        platform.uname().processor  # noqa: B018 - a cached property: fills the cached uname result
        platform.platform()
        platform.freedesktop_os_release()
        "lgt.invalid".encode("idna")
    except Exception:  # noqa: BLE001 - e.g. no /etc/os-release: the child finds out itself
        pass
    typing_ext = sys.modules.get("typing_extensions")
    is_typeddict = getattr(typing_ext, "is_typeddict", None) or typing.is_typeddict
    for name, mod in list(sys.modules.items()):
        hints = getattr(mod, "get_type_hints", None) if name.endswith("._utils._transform") else None
        if hints is None or not hasattr(hints, "cache_info"):
            continue
        root = name.split(".", 1)[0] + ".types"
        for mname, m in list(sys.modules.items()):
            if mname != root and not mname.startswith(root + "."):
                continue
            for obj in list(vars(m).values()):
                if isinstance(obj, type) and getattr(obj, "__module__", None) == mname and is_typeddict(obj):
                    try:
                        hints(obj, include_extras=True)  # the call the SDK makes, so the cache key matches
                    except Exception:  # noqa: BLE001 - an unresolvable hint is resolved (or not) in the child
                        pass


def reaper() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            time.sleep(0.01)
            continue
        code = os.waitstatus_to_exitcode(status)
        _first_learned.set()
        with _lock:
            rid = _ids.pop(pid, None)
        if rid is not None:
            send({"id": rid, "exit": code})


def main() -> None:
    global learn_dir
    global control, sandbox_init
    modules = sys.argv[1:]
    if modules[:1] == ["--sandbox"]:
        import sandbox_init  # next to this file, in the sandbox too
        control = socket.socket(fileno=int(modules[1]))
        modules = modules[2:]
    if modules[:1] == ["--learn"]:
        learn_dir, modules = modules[1], modules[2:]
    learning = LEARN_CHILDREN if learn_dir else 0
    try:
        for name in modules:
            importlib.import_module(name)
    except Exception as e:  # noqa: BLE001
        send({"error": f"could not import {name}: {e}"})
        return
    _warm_caches()
    send({"ready": True})
    threading.Thread(target=reaper, daemon=True).start()
    for req, fds in requests():
        if learn_dir:
            if learning < LEARN_CHILDREN:  # a first child is learning: wait for its list (bounded) so
                _wait_learned()            # the rest do not all start cold at once
            if _import_learned():
                _warm_caches()
            if learning:
                req["learn"] = True
                learning -= 1
        gc.freeze()  # what the zygote holds stays out of the children's collections: no copy-on-write
        with _lock:  # the reaper must not see the child before its id is known
            # sandboxed: forked as pid 1 of a pid namespace of its own (None: it could not be made)
            pid = os.fork() if control is None else sandbox_init.fork(req, control)
            if pid == 0:
                _lock.release()
                child(req, fds)
            if pid is not None:
                _ids[pid] = req["id"]
        for fd in fds:
            os.close(fd)
        send({"id": req["id"], "pid": pid} if pid is not None else {"id": req["id"], "exit": 126})


def requests() -> typing.Iterator[tuple[dict, list[int]]]:
    """The requests: lines on stdin, or (``--sandbox FD``) messages on the control socket, each with
    the attempt's stdout and stderr as file descriptors (its paths are not visible in the sandbox)."""
    if control is None:
        for line in sys.stdin:
            if line.strip():
                yield json.loads(line), []
        return
    while True:
        msg, fds, _, _ = socket.recv_fds(control, 1 << 20, 2)
        if not msg:
            return
        yield json.loads(msg), list(fds)


if __name__ == "__main__":
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # modules that print while importing must not break the protocol
    main()
