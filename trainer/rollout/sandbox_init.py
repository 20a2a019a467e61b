"""Inside the sandbox: give one rollout attempt namespaces of its own (imported by ``zygote.py``).

Run by the agent's interpreter inside the zygote's bubblewrap sandbox, where the zygote is uid 0 of a
user namespace of its own, with capabilities over that sandbox's mounts and nothing else (bwrap
``--cap-add ALL``). Imports nothing of lgt. :func:`enter` is called in a freshly forked child for one
attempt and returns only in the attempt's own process, which is then:

* pid 1 of a new pid namespace (the whole tree ends with it: a daemon it leaves is killed with it),
  its ``/proc`` showing only that tree;
* in a new mount namespace: ``/lgt/work`` its own writable work directory (bound from the zygote's
  ``/lgt/attempts/<name>``, which is then covered so no other attempt's directory is visible), a private
  ``/tmp`` and ``/dev/shm`` of bounded size, everything else as the zygote's sandbox has it (read-only);
* in a new network namespace holding only its loopback, where ``127.0.0.1:<port>`` listens: the
  listening socket is handed to the controller (outside), which relays each connection to lgt-proxy —
  the only way out;
* in new IPC and UTS namespaces;
* uid 1000 of a nested user namespace, with no capabilities, ``no_new_privs`` and the attempt's limits
  (processes, a process's data memory, a file's size) — the nested namespace counts its processes
  apart from every other attempt's.

In a container image (``sandbox["image"]``: :mod:`lgt.trainer.rollout.runners.image`) the attempt's ``/`` is
the image's root instead: a read-only overlay of the attempt's skeleton (the mount points the image lacks)
over the image's unpacked root, with a fresh ``/proc``, the sandbox's ``/dev``, its own ``/tmp`` and
``/dev/shm``, and the binds the runner names (its folders, writable; the proxy's CA and host files,
read-only) — then ``pivot_root``, so nothing of the zygote's sandbox is left in its view.

The zygote forks it straight into its new pid namespace (:func:`fork`), so the attempt's process is the
zygote's own child: its exit is the attempt's, and nothing waits in between.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import resource
import signal
import socket
import struct
import sys
import threading
from array import array

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21  # statvfs's flags but relatime's
ST_RELATIME = 4096
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217, "riscv64": 41}
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
AGENT_UID = 1000
ATTEMPTS = "/lgt/attempts"
WORK = "/lgt/work"

_libc = ctypes.CDLL(None, use_errno=True)


class SandboxSetupError(OSError):
    pass


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise SandboxSetupError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def enc(s: str | None) -> bytes | None:
        return s.encode() if s is not None else None

    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {target}")


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH22x", b"lo", 0)))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))


def _drop_capabilities() -> None:
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    header, data = Header(0x20080522, 0), (Data * 2)()
    _check(_libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


_own_pid_ns: int | None = None  # the zygote's pid namespace, to undo each fork's unshare


def fork(req: dict, control: socket.socket) -> int | None:
    """(In the zygote) fork the attempt as pid 1 of a new pid namespace: its pid here, 0 in the child,
    or None when the namespace could not be made (the controller was told, with ``{"id", "error"}``).
    Run as root, a thread maps the child's uid once it has made its user namespace (:func:`enter`)."""
    global _own_pid_ns
    if _own_pid_ns is None:
        _own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    mapper = req["sandbox"].get("map_to")  # lgt as root: the zygote maps the attempt to this uid
    pipes = (*os.pipe(), *os.pipe()) if mapper is not None else None
    try:
        _check(_libc.unshare(CLONE_NEWPID), "unshare")  # the next child is pid 1 of a new namespace
    except OSError as e:
        for fd in pipes or ():
            os.close(fd)
        _report(req, control, e)
        return None
    pid = None
    try:
        pid = os.fork()
    except OSError as e:  # no process left for this user, say: this attempt fails, the zygote goes on
        for fd in pipes or ():
            os.close(fd)
        _report(req, control, e)
        return None
    finally:  # back to this namespace for the children after this one (a second unshare needs it)
        if pid != 0:
            _check(_libc.setns(_own_pid_ns, CLONE_NEWPID), "setns")
    if pid == 0:
        if pipes is not None:
            os.close(pipes[1])
            os.close(pipes[2])
            req["_pipes"] = (pipes[0], pipes[3])  # the child's ends: go (read), back (write)
        return 0
    if pipes is not None:
        go_r, go_w, back_r, back_w = pipes
        os.close(go_r)
        os.close(back_w)
        threading.Thread(target=_map_child, args=(pid, int(mapper), go_w, back_r), daemon=True).start()
    return pid


def enter(req: dict, control: socket.socket) -> None:
    """Make this child's attempt namespaces (see the module docstring; :func:`fork` made it pid 1 of
    its own pid namespace). A setup failure is sent to the controller as ``{"id", "error"}`` and ends
    the child."""
    sb = req["sandbox"]
    go_r, back_w = req.pop("_pipes", (None, None))
    try:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
        if go_r is not None and os.read(go_r, 1) != b"g":  # the zygote holds our /proc entry now
            raise SandboxSetupError(1, "the zygote did not answer")
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        image = sb.get("image")
        if image is None:
            _enter_work(sb)
        socket.sethostname("lgt-sandbox")
        _loopback_up()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", int(sb["port"])))
        listener.listen(512)
        if image is not None:
            _enter_image(image, int(sb["tmp_bytes"]))
        limits = [(resource.RLIMIT_CORE, 0)]
        for name, key in (("RLIMIT_NPROC", "processes"), ("RLIMIT_DATA", "memory_bytes"),
                          ("RLIMIT_FSIZE", "file_bytes")):
            if sb.get(key):
                limits.append((getattr(resource, name), int(sb[key])))
        for which, value in limits:
            resource.setrlimit(which, (value, value))
        _check(_libc.unshare(CLONE_NEWUSER), "unshare user namespace")
        if go_r is None:  # the zygote's uid 0 is lgt's user outside: the attempt is that user, as 1000
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{AGENT_UID} 0 1\n")
            _write("/proc/self/gid_map", f"{AGENT_UID} 0 1\n")
        else:  # the zygote maps it (a root writer may name any uid); then it becomes that uid
            os.write(back_w, b"u")
            if os.read(go_r, 1) != b"k":
                raise SandboxSetupError(1, "the attempt's uid could not be mapped")
            os.setgroups([])
            os.setresgid(AGENT_UID, AGENT_UID, AGENT_UID)
            os.setresuid(AGENT_UID, AGENT_UID, AGENT_UID)
        # the listener last: the controller starts relaying (and timing) once it has it
        control.sendmsg([json.dumps({"id": req["id"], "ready": True}).encode()],
                        [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array("i", [listener.fileno()]))])
        listener.close()
        control.close()
        _drop_capabilities()  # the pipes to the zygote close with the rest of its descriptors (zygote.py)
    except OSError as e:
        _fail(req, control, e)


def _enter_work(sb: dict) -> None:
    """The zygote's view, with the attempt's own ``/lgt/work``, ``/tmp`` and ``/dev/shm``; no other
    attempt's folder."""
    _mount(f"{ATTEMPTS}/{sb['work']}", WORK, None, MS_BIND | MS_REC)
    _mount("tmpfs", ATTEMPTS, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0")
    # what the zygote's sandbox mounted under /tmp (an agent's folder, say) stays, over the new /tmp
    keep = [(path, os.open(path, os.O_PATH)) for path in sb.get("keep", ())]
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={int(sb['tmp_bytes'])},mode=1777")
    for path, fd in keep:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(path, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "a").close()
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)
    if os.path.isdir("/dev/shm"):
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
               f"size={int(sb['tmp_bytes'])},mode=1777")


def _enter_image(image: dict, tmp_bytes: int) -> None:
    """The image's root as ``/``: ``image["lower"]`` (the skeleton, then the unpacked root) mounted as a
    read-only overlay on ``image["mount"]`` (an empty folder of the attempt's), ``/proc``, ``/dev``,
    ``/tmp`` and ``/dev/shm`` in it, then each bind ``[source, target, writable]`` (targets are paths
    inside the image with no symlink on the way: the runner resolved them in the image's read-only
    root), then ``pivot_root`` there and the zygote's root detached."""
    new = image["mount"]
    # the layers by descriptor: a path's ':' or ',' would need escaping in the options
    lower = [os.open(path, os.O_PATH | os.O_DIRECTORY) for path in image["lower"]]
    _mount("overlay", new, "overlay", MS_RDONLY | MS_NOSUID | MS_NODEV,
           "lowerdir=" + ":".join(f"/proc/self/fd/{fd}" for fd in lower))
    for fd in lower:
        os.close(fd)
    _mount("proc", f"{new}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount("/dev", f"{new}/dev", None, MS_BIND | MS_REC)
    _mount("tmpfs", f"{new}/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp_bytes},mode=1777")
    if os.path.isdir(f"{new}/dev/shm"):
        _mount("tmpfs", f"{new}/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
               f"size={tmp_bytes},mode=1777")
    for source, target, writable in image["binds"]:
        if not os.path.lexists(new + target):  # under the new /tmp, say (the image's root has the rest)
            try:
                if os.path.isdir(source):
                    os.makedirs(new + target)
                else:
                    os.makedirs(os.path.dirname(new + target), exist_ok=True)
                    open(new + target, "a").close()
            except OSError:
                pass  # the mount below says what is wrong
        _mount(source, new + target, None, MS_BIND | MS_REC)
        if not writable:  # keeping the flags the source's mount has (a user namespace cannot drop them)
            has = os.statvfs(new + target).f_flag
            kept = has & (MS_NOEXEC | MS_NOATIME | MS_NODIRATIME) | (MS_RELATIME if has & ST_RELATIME else 0)
            _mount(None, new + target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | kept)
    os.chdir(new)
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise SandboxSetupError(1, f"pivot_root: unknown on {os.uname().machine}")
    _check(_libc.syscall(number, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "detach the sandbox's root")
    os.chdir("/")


def _map_child(pid: int, uid: int, go_w: int, back_r: int) -> None:
    """(A zygote thread, as root) map the child's new user namespace's 1000 to ``uid`` once it has one."""
    proc = -1
    try:
        proc = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY)  # before the child mounts its /proc
        os.write(go_w, b"g")
        ok = b"x"
        try:
            if os.read(back_r, 1) == b"u":
                for name in ("uid_map", "gid_map"):
                    fd = os.open(name, os.O_WRONLY, dir_fd=proc)
                    os.write(fd, f"{AGENT_UID} {uid} 1\n".encode())
                    os.close(fd)
                ok = b"k"
        except OSError:
            pass
        os.write(go_w, ok)
    except OSError:
        pass  # the child is gone (closing our ends below tells it, if not)
    finally:
        for fd in (proc, go_w, back_r):
            if fd >= 0:
                os.close(fd)


def _report(req: dict, control: socket.socket, e: OSError) -> None:
    control.sendmsg([json.dumps({"id": req["id"], "error": f"the sandbox could not be set up "
                                 f"({e.strerror or e})"}).encode()])


def _fail(req: dict, control: socket.socket, e: OSError) -> None:
    try:
        _report(req, control, e)
    finally:
        print(f"lgt sandbox: could not set up the attempt's namespaces: {e}", file=sys.stderr)
        os._exit(126)
