"""Container images built here, never downloaded: layers from member lists or directory trees, packed as
an OCI image layout, an OCI archive or a docker archive (``docker save``'s format).

A layer is a list of members: ``File``, ``Dir``, ``Symlink``, ``Hardlink``, ``Whiteout`` (the
``.wh.NAME`` marker that deletes NAME from lower layers) and ``Opaque`` (``.wh..wh..opq``: the folder's
lower contents hidden). :func:`tree_layer` makes one from a folder (hard links found by inode). A root
that can really run a command is Debian's ``busybox-static`` unpacked by ``scripts/setup.sh`` under
``build/busybox-static/root`` (:func:`busybox_root`; tests skip without it). :func:`bwrap_argv` runs a
command in an unpacked image under bubblewrap alone (the tests' and benchmarks' way; attempts run
through the image runner). :func:`podman_store` and :func:`docker_daemon` give a test a podman store or a
docker daemon of its own, to name images in.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import signal
import subprocess
import tarfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lgt.trainer.rollout.images import Image, machine_arch, workdir_of

BUSYBOX = Path(__file__).resolve().parent.parent / "build" / "busybox-static" / "root"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"


@dataclass(frozen=True)
class File:
    path: str
    data: bytes = b""
    mode: int = 0o644
    mtime: int = 0


@dataclass(frozen=True)
class Dir:
    path: str
    mode: int = 0o755


@dataclass(frozen=True)
class Symlink:
    path: str
    target: str


@dataclass(frozen=True)
class Hardlink:
    path: str
    target: str  # a path inside the root, as tar names it


@dataclass(frozen=True)
class Whiteout:
    path: str  # what it deletes; the member is the folder's ``.wh.NAME``


@dataclass(frozen=True)
class Opaque:
    path: str  # the folder; the member is ``path/.wh..wh..opq``


Member = File | Dir | Symlink | Hardlink | Whiteout | Opaque


@dataclass
class Layer:
    members: Sequence[Member]
    gzip: bool = True
    raw: bytes | None = None  # a tar given as is (for hostile or corrupt layers)

    def tar(self) -> bytes:
        return self.raw if self.raw is not None else layer_tar(self.members)

    def blob(self) -> bytes:
        data = self.tar()
        return gzip.compress(data, mtime=0) if self.gzip else data


@dataclass
class Config:
    env: list[str] = field(default_factory=lambda: ["PATH=/bin:/usr/bin"])
    working_dir: str = "/work"
    cmd: list[str] = field(default_factory=lambda: ["sh"])
    architecture: str = field(default_factory=machine_arch)

    def document(self, layers: Sequence[Layer]) -> dict:
        return {"architecture": self.architecture, "os": "linux",
                "config": {"Env": self.env, "WorkingDir": self.working_dir, "Cmd": self.cmd},
                "rootfs": {"type": "layers", "diff_ids": [_digest(layer.tar()) for layer in layers]}}


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _info(name: str, kind: bytes, mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime = kind, mode, 0
    return info


def layer_tar(members: Sequence[Member]) -> bytes:
    """A layer's tar from members, in their order."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for m in members:
            if isinstance(m, File):
                info = _info(m.path, tarfile.REGTYPE, m.mode)
                info.size, info.mtime = len(m.data), m.mtime
                tar.addfile(info, io.BytesIO(m.data))
            elif isinstance(m, Dir):
                tar.addfile(_info(m.path, tarfile.DIRTYPE, m.mode))
            elif isinstance(m, Symlink):
                info = _info(m.path, tarfile.SYMTYPE, 0o777)
                info.linkname = m.target
                tar.addfile(info)
            elif isinstance(m, Hardlink):
                info = _info(m.path, tarfile.LNKTYPE)
                info.linkname = m.target
                tar.addfile(info)
            elif isinstance(m, Whiteout):
                head, _, name = m.path.rpartition("/")
                tar.addfile(_info(f"{head}/.wh.{name}".lstrip("/"), tarfile.REGTYPE))
            else:
                tar.addfile(_info(f"{m.path.rstrip('/')}/.wh..wh..opq", tarfile.REGTYPE))
    return out.getvalue()


def tree_layer(root: Path, prefix: str = "", skip: Sequence[str] = ()) -> list[Member]:
    """The members of a folder's tree (modes kept, hard links found by inode, symlinks as they are);
    ``skip``: names of its top folder left out."""
    members: list[Member] = []
    seen: dict[tuple[int, int], str] = {}
    for here, dirs, files in os.walk(root):
        if Path(here) == root:
            dirs[:] = [d for d in dirs if d not in skip]
            files = [f for f in files if f not in skip]
        dirs.sort()
        rel = Path(here).relative_to(root)
        for name in sorted(dirs) + sorted(files):
            p = Path(here) / name
            path = str(Path(prefix) / rel / name)
            st = os.lstat(p)
            if os.path.islink(p):
                members.append(Symlink(path, os.readlink(p)))
            elif p.is_dir():
                members.append(Dir(path, st.st_mode & 0o7777))
            elif (st.st_dev, st.st_ino) in seen:
                members.append(Hardlink(path, seen[(st.st_dev, st.st_ino)]))
            else:
                seen[(st.st_dev, st.st_ino)] = path
                members.append(File(path, p.read_bytes(), st.st_mode & 0o7777))
    return members


def busybox_root() -> Path | None:
    """Debian's busybox-static unpacked (``scripts/setup.sh``), or None when it is not there."""
    return BUSYBOX if (BUSYBOX / "bin" / "busybox").is_file() else None


def busybox_layer() -> list[Member]:
    """A root that runs commands: busybox and its ``sh`` link, nothing else of the host."""
    root = busybox_root()
    assert root is not None, "busybox-static is not unpacked: run scripts/setup.sh"
    data = (root / "bin" / "busybox").read_bytes()
    return [Dir("bin"), File("bin/busybox", data, 0o755), Symlink("bin/sh", "busybox"), Dir("etc"),
            File("etc/os-release", b'ID=lgt-test\nPRETTY_NAME="lgt test image"\n')]


def python_root() -> Path | None:
    """The host's Debian ``python3`` (``/usr/bin/python3`` with its standard library in
    ``/usr/lib/python3.X``), or None."""
    exe = Path(os.path.realpath("/usr/bin/python3"))
    return exe if exe.is_file() and (Path("/usr/lib") / exe.name / "os.py").is_file() else None


def python_layer() -> list[Member]:
    """A layer that runs Python: the host's ``/usr/bin/python3`` (:func:`python_root`), the shared
    libraries it and its extension modules load (``ldd``), and its standard library without its tests,
    GUI and packages — nothing else of the host."""
    exe = python_root()
    assert exe is not None, "no Debian python3 at /usr/bin/python3"
    stdlib = Path("/usr/lib") / exe.name
    members: list[Member] = [Dir("usr"), Dir("usr/bin"), File(f"usr/bin/{exe.name}", exe.read_bytes(), 0o755),
                             Symlink("usr/bin/python3", exe.name), Dir("usr/lib")]
    objects = [str(exe), *map(str, sorted((stdlib / "lib-dynload").glob("*.so")))]
    members += _files_at_their_paths(shared_libraries(objects), {"usr", "usr/bin", "usr/lib"})
    skip = ("test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data",
            "site-packages", "dist-packages", f"config-{exe.name[6:]}-x86_64-linux-gnu")
    return [*members, Dir(f"usr/lib/{exe.name}"), *tree_layer(stdlib, f"usr/lib/{exe.name}", skip)]


def shared_libraries(objects: Sequence[str]) -> list[str]:
    """The shared libraries ``objects`` (programs, libraries) load, the dynamic loader among them
    (``ldd``), by the paths they are loaded from."""
    out = subprocess.run(["ldd", *objects], capture_output=True, text=True, check=False).stdout
    libs = set()
    for line in out.splitlines():
        words = line.split()
        path = words[words.index("=>") + 1] if "=>" in words else (words[0] if words else "")
        if path.startswith("/") and not path.endswith(":"):  # (not a "file:" heading)
            libs.add(path)
    return sorted(libs)


def _files_at_their_paths(paths: Sequence[str], dirs: set[str]) -> list[Member]:
    """Each host file of ``paths`` (its symlinks followed) at its own path, after the folders on the way
    that ``dirs`` (updated) does not hold yet."""
    members: list[Member] = []
    for path in paths:
        rel = path.lstrip("/")
        for parent in reversed(Path(rel).parents[:-1]):
            if str(parent) not in dirs:
                dirs.add(str(parent))
                members.append(Dir(str(parent)))
        members.append(File(rel, Path(os.path.realpath(path)).read_bytes(), 0o755))
    return members


def host_programs_layer(programs: Sequence[str] = (), mounted: Sequence[str] = ()) -> list[Member]:
    """A layer with host programs copied at their paths (``/usr/bin/bash`` at ``usr/bin/bash``) and the
    shared libraries they load — and those that ``mounted`` (host programs an attempt will have bound
    read-only from the host, through ``agent.mounts``, not copied) load: a native harness's runtime."""
    dirs: set[str] = set()
    members = _files_at_their_paths(programs, dirs)
    return members + _files_at_their_paths(shared_libraries([*programs, *mounted]), dirs)


def _blobs(layout: Path, blobs: dict[str, bytes]) -> None:
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    for digest, data in blobs.items():
        (layout / "blobs" / "sha256" / digest.removeprefix("sha256:")).write_bytes(data)


def write_oci_layout(dest: Path, layers: Sequence[Layer], config: Config | None = None,
                     platforms: Sequence[str] | None = None) -> str:
    """An OCI image layout at ``dest``; returns the config's digest. ``platforms`` (e.g. ["arm64"]) adds
    an index entry per architecture, each with its own config, the first being ``config``'s."""
    config = config or Config()
    dest.mkdir(parents=True, exist_ok=True)
    blobs: dict[str, bytes] = {}
    layer_descs = []
    for layer in layers:
        data = layer.blob()
        blobs[_digest(data)] = data
        kind = "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if layer.gzip else "")
        layer_descs.append({"mediaType": kind, "digest": _digest(data), "size": len(data)})
    entries, first = [], None
    for arch in platforms or [config.architecture]:
        doc = json.dumps({**config.document(layers), "architecture": arch}).encode()
        first = first or _digest(doc)
        blobs[_digest(doc)] = doc
        manifest = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                               "config": {"mediaType": OCI_CONFIG, "digest": _digest(doc), "size": len(doc)},
                               "layers": layer_descs}).encode()
        blobs[_digest(manifest)] = manifest
        entry = {"mediaType": OCI_MANIFEST, "digest": _digest(manifest), "size": len(manifest)}
        if platforms:
            entry["platform"] = {"architecture": arch, "os": "linux"}
        entries.append(entry)
    _blobs(dest, blobs)
    (dest / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}
    (dest / "index.json").write_text(json.dumps(index))
    assert first is not None
    return first


def _tar_folder(folder: Path, dest: Path) -> None:
    with tarfile.open(dest, "w") as tar:
        for p in sorted(folder.rglob("*")):
            tar.add(p, str(p.relative_to(folder)), recursive=False)


def write_oci_archive(dest: Path, layers: Sequence[Layer], config: Config | None = None) -> str:
    """An OCI archive (a tar of a layout) at ``dest``; returns the config's digest."""
    folder = dest.with_name(dest.name + ".layout")
    digest = write_oci_layout(folder, layers, config)
    _tar_folder(folder, dest)
    return digest


def write_docker_archive(dest: Path, layers: Sequence[Layer], config: Config | None = None,
                         tag: str = "lgt-test:latest") -> str:
    """A docker archive (``docker save``'s layout: manifest.json, the config, one folder per layer with
    its layer.tar) at ``dest``; returns the config's digest."""
    config = config or Config()
    folder = dest.with_name(dest.name + ".docker")
    folder.mkdir(parents=True)
    doc = json.dumps(config.document(layers)).encode()
    digest = _digest(doc)
    (folder / f"{digest.removeprefix('sha256:')}.json").write_bytes(doc)
    paths = []
    for layer in layers:
        data = layer.blob()
        name = f"{_digest(data).removeprefix('sha256:')}/layer.tar"
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_bytes(data)
        paths.append(name)
    (folder / "manifest.json").write_text(json.dumps(
        [{"Config": f"{digest.removeprefix('sha256:')}.json", "RepoTags": [tag], "Layers": paths}]))
    _tar_folder(folder, dest)
    return digest


UID = 1000  # the command's uid (and gid) inside the image, as in the bare sandbox


def bwrap_argv(image: Image, command: Sequence[str], workdir: Path, *, at: str | None = None,
               env: Mapping[str, str] | None = None, share_net: bool = False,
               bwrap: str = "bwrap") -> list[str]:
    """bubblewrap's argument list to run ``command`` with the image's root as ``/``, read-only — a command
    in an unpacked image for the tests and benchmarks (attempts run through the image runner): ``workdir``
    (a folder of :func:`lgt.trainer.rollout.images.fresh_workdir`) bound writable at the image's working
    folder (or ``at``) and the command started there, fresh ``/proc``, ``/dev`` and ``/tmp``, every namespace
    unshared (the network too unless ``share_net``), uid and gid 1000, the image's Env with ``env`` over
    it and nothing of lgt's own environment."""
    inside = workdir_of(image, at)
    args = [bwrap, "--unshare-all", "--unshare-user", *(["--share-net"] if share_net else []),
            "--uid", str(UID), "--gid", str(UID), "--die-with-parent", "--hostname", "lgt-sandbox",
            "--ro-bind", str(image.root), "/", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
            "--bind", str(workdir), inside, "--chdir", inside, "--clearenv"]
    for name, value in image.config.environment(env).items():
        args += ["--setenv", name, value]
    return [*args, "--", *command]


# -- local container stores, private to a test ------------------------------------------------------------

@contextlib.contextmanager
def podman_store(tmp: Path) -> Iterator[dict[str, str]]:
    """A podman store of its own under ``tmp`` (vfs driver): the variables that point podman at it
    (``CONTAINERS_STORAGE_CONF``). Podman has no daemon; nothing is started. Needs podman on PATH."""
    tmp.mkdir(parents=True, exist_ok=True)
    conf = tmp / "storage.conf"
    conf.write_text(f'[storage]\ndriver = "vfs"\ngraphroot = "{tmp / "graph"}"\nrunroot = "{tmp / "run"}"\n')
    yield {"CONTAINERS_STORAGE_CONF": str(conf)}


@contextlib.contextmanager
def docker_daemon(tmp: Path, timeout: float = 60) -> Iterator[dict[str, str]]:
    """A docker daemon of its own (``dockerd``, root only) with its data, socket and containerd under
    ``tmp`` (vfs driver, no bridge, no iptables: it stores images and runs no container): the variables
    that point docker at it (``DOCKER_HOST``). Stopped at the end."""
    tmp.mkdir(parents=True, exist_ok=True)
    sock = tmp / "docker.sock"
    argv = ["dockerd", "--host", f"unix://{sock}", "--data-root", str(tmp / "data"),
            "--exec-root", str(tmp / "exec"), "--pidfile", str(tmp / "docker.pid"),
            "--storage-driver", "vfs", "--bridge", "none", "--iptables=false", "--ip6tables=false"]
    env = {"DOCKER_HOST": f"unix://{sock}"}
    log = open(tmp / "dockerd.log", "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        ask = ["docker", "version"]
        while subprocess.run(ask, env={**os.environ, **env}, capture_output=True).returncode:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dockerd did not start: {(tmp / 'dockerd.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield env
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
