"""Container images without a daemon: read an image, unpack it once into a content-addressed cache, and
run a command with its root filesystem as ``/`` under bubblewrap.

An image is named by a path: an OCI image layout (a folder with ``oci-layout`` and ``index.json``), an
OCI archive (a tar of such a folder) or a docker archive (``docker save``: ``manifest.json`` and layer
tars; a folder of those is read too). Or by a name in a local podman or docker store
(``containers-storage:NAME``, ``docker-daemon:NAME``, or a bare ``NAME`` looked up in each store that is
installed, podman's first): lgt asks the store for the image's id, and only when no root in the cache has
that id does it have the store save the image to an archive in the cache's ``tmp/``, unpack it and delete
the archive. Nothing runs a container: podman reads its store itself, docker asks its daemon.

The cache (``LGT_IMAGE_CACHE``, else ``$XDG_CACHE_HOME/lgt/images``, else ``~/.cache/lgt/images``)::

    layers/sha256-<diff id>/tree        one layer's files, whiteout markers kept as empty files
    layers/sha256-<diff id>/meta.json   its folders' modes and its hard links to lower layers
    roots/sha256-<config digest>/rootfs the image's root filesystem, the layers applied in order
    roots/sha256-<config digest>/config.json

A layer is keyed by its uncompressed digest (the config's ``rootfs.diff_ids``), so one shared by two
images, or packed gzip in one and plain in the other, is extracted once; a root by its config digest
(docker's image id). Every entry is built in ``tmp/`` and renamed into place whole, so an entry that
exists is complete, two processes unpacking one image both end with the same entry (the second rename
loses and its copy is dropped), and a failure — a digest that does not match, a corrupt tar, a member
that would land outside the root — leaves nothing behind.

Root files are hard links into the layers' trees (one copy on disk, modes kept, setuid/setgid bits
dropped, ownership not kept: the cache belongs to lgt's user). Folders keep their modes with the owner's
``rwx`` added, so the cache can be cleaned. Device nodes and fifos are skipped. The root is mounted
read-only; an attempt writes only in its own folder (:func:`fresh_workdir`; the image runner,
:mod:`lgt.trainer.rollout.runners.image`, runs it).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import platform
import posixpath
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

DEFAULT_WORKDIR = "/work"  # where an attempt's folder goes when the image names no WorkingDir
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BWRAP_DIRS = ("proc", "dev", "tmp")  # mount points bwrap needs in a read-only root
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json")
ARCHES = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64", "armv7l": "arm",
          "i686": "386", "i386": "386", "ppc64le": "ppc64le", "s390x": "s390x", "riscv64": "riscv64"}
STALE_SECONDS = 24 * 3600  # a folder in the cache's tmp/ this old is a dead build's
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_CHUNK = 1 << 20


class ImageError(ValueError):
    """An image that cannot be used: one sentence naming it and what is wrong."""


@dataclass(frozen=True)
class ImageConfig:
    """What the image's config says about running it."""

    env: tuple[str, ...] = ()  # "NAME=value", in the image's order
    working_dir: str = ""
    user: str = ""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    architecture: str = ""
    os: str = "linux"

    @classmethod
    def parse(cls, config: Mapping) -> ImageConfig:
        c = config.get("config") or {}
        return cls(env=tuple(c.get("Env") or ()), working_dir=c.get("WorkingDir") or "",
                   user=c.get("User") or "", entrypoint=tuple(c.get("Entrypoint") or ()),
                   cmd=tuple(c.get("Cmd") or ()), architecture=config.get("architecture", ""),
                   os=config.get("os", "linux"))

    def environment(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The image's Env with ``extra`` over it (and a PATH when neither sets one)."""
        env = dict(e.partition("=")[::2] for e in self.env)
        env.update(extra or {})
        env.setdefault("PATH", DEFAULT_PATH)
        return env


@dataclass(frozen=True)
class Layer:
    diff_id: str  # sha256 of the uncompressed tar (the cache key)
    digest: str | None  # sha256 of the blob as stored (OCI), checked too when known
    path: str  # where the blob is, inside the source


@dataclass(frozen=True)
class Image:
    """An unpacked image: its root filesystem in the cache and its config."""

    ref: str
    digest: str  # the config's digest (docker's image id): the root's key
    root: Path
    config: ImageConfig


def default_cache() -> Path:
    if os.environ.get("LGT_IMAGE_CACHE"):
        return Path(os.environ["LGT_IMAGE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lgt" / "images"


def machine_arch() -> str:
    return ARCHES.get(platform.machine().lower(), platform.machine().lower())


# -- reading a source: a folder or a tar, addressed by paths inside it --------------------------------------

class _Source:
    """An image's files, in a folder or a tar archive, read by their path inside it."""

    def __init__(self, ref: str, path: Path) -> None:
        self.ref, self.path = ref, path
        self._tar: tarfile.TarFile | None = None
        self._members: dict[str, tarfile.TarInfo] = {}
        if path.is_file():
            try:
                self._tar = tarfile.open(path, "r:*")
                # (links too: older docker saves link a repeated layer.tar to its first copy)
                self._members = {_clean(m.name): m for m in self._tar.getmembers()
                                 if m.isfile() or m.issym() or m.islnk()}
            except (tarfile.TarError, OSError, EOFError, gzip.BadGzipFile) as e:
                raise ImageError(f"image {ref} is not a readable tar archive ({e})") from None

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()

    def has(self, name: str) -> bool:
        if self._tar is not None:
            return _clean(name) in self._members
        return (self.path / name).is_file()

    def open(self, name: str) -> IO[bytes]:
        try:
            if self._tar is not None:
                f = self._tar.extractfile(self._members[_clean(name)])
                assert f is not None
                return f
            return open(self.path / _clean(name), "rb")
        except (KeyError, OSError) as e:
            raise ImageError(f"image {self.ref} lacks {name}, which its manifest names ({e})") from None

    def read(self, name: str, digest: str | None = None) -> bytes:
        with self.open(name) as f:
            try:
                data = f.read()
            except (OSError, EOFError, tarfile.TarError, gzip.BadGzipFile) as e:
                raise ImageError(f"image {self.ref}: {name} cannot be read ({e})") from None
        if digest is not None and "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            raise ImageError(f"image {self.ref}: {name} does not match its digest {digest} (corrupt image)")
        return data

    def json(self, name: str, digest: str | None = None, shape: type = dict) -> dict | list:
        data = self.read(name, digest)
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ImageError(f"image {self.ref}: {name} is not JSON ({e})") from None
        if not isinstance(doc, shape):
            raise ImageError(f"image {self.ref}: {name} is not a JSON {shape.__name__}")
        return doc


def _clean(name: str) -> str:
    """A path inside the source, never above it (``..`` stops at its top)."""
    return posixpath.normpath("/" + name).lstrip("/")


def _blob(digest: str) -> str:
    if not _DIGEST.fullmatch(digest or ""):
        raise ImageError(f"unsupported or malformed digest {digest!r} (lgt reads sha256 digests)")
    return "blobs/sha256/" + digest.removeprefix("sha256:")


def _looks_like_name(ref: str) -> bool:
    return bool(re.fullmatch(r"[a-z0-9][a-z0-9._/-]*(:[\w.-]+)?(@sha256:[0-9a-f]{64})?", ref)) \
        and not ref.startswith(("./", "../")) and not ref.endswith((".tar", ".tar.gz", ".tgz"))


def _missing(ref: str) -> ImageError:
    if _looks_like_name(ref):
        return ImageError(
            f"image {ref} is not a file or folder here, and neither podman nor docker is installed to look "
            f"it up by name: save it to an archive where it is (docker save {ref} -o image.tar, or podman "
            f"save --format oci-archive {ref} -o image.tar) and name that file")
    return ImageError(f"image {ref} does not exist")


def resolve(ref: str | os.PathLike) -> tuple[dict, str, list[Layer], _Source]:
    """Read an image's manifest and config without unpacking anything: (config, config digest, layers,
    source). Refuses, one sentence each, a missing path, something that is not an image, a blob that
    does not match its digest and an image of another architecture."""
    ref = str(ref)
    path = Path(ref).expanduser()
    if not path.exists():
        raise _missing(ref)
    source = _Source(ref, path)
    try:
        if source.has("index.json") or source.has("oci-layout"):
            config, digest, blobs = _read_oci(source)
        elif source.has("manifest.json"):
            config, digest, blobs = _read_docker(source)
        else:
            raise ImageError(f"{ref} is not an image: it has no index.json (an OCI layout or archive) and no "
                             f"manifest.json (a docker archive)")
        _check_platform(ref, config)
        diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
        if len(diff_ids) != len(blobs):
            raise ImageError(f"image {ref}: its config lists {len(diff_ids)} layer diff ids and its manifest "
                             f"{len(blobs)} layers")
        return config, digest, [Layer(d, b, p) for d, (p, b) in zip(diff_ids, blobs)], source
    except BaseException:
        source.close()
        raise


# Each reader gives (config, its digest, [(layer's path in the source, its digest when known)]).

def _read_oci(source: _Source) -> tuple[dict, str, list[tuple[str, str | None]]]:
    manifest = _pick_manifest(source, source.json("index.json"))
    config_digest = manifest.get("config", {}).get("digest", "")
    config = source.json(_blob(config_digest), config_digest)
    return config, config_digest, [(_blob(d.get("digest", "")), d.get("digest"))
                                   for d in manifest.get("layers") or []]


def _pick_manifest(source: _Source, index: Mapping, depth: int = 0) -> dict:
    """The manifest for this machine in an index (nested indexes followed)."""
    want = machine_arch()
    entries = index.get("manifests") or []
    fitting = [m for m in entries
               if not m.get("platform") or (m["platform"].get("architecture") == want
                                            and m["platform"].get("os", "linux") == "linux")]
    if not fitting:
        offered = sorted({f"{m['platform'].get('os')}/{m['platform'].get('architecture')}" for m in entries})
        raise ImageError(f"image {source.ref} has no entry for linux/{want} (it offers {', '.join(offered)})")
    if len(fitting) > 1:
        names = [m.get("annotations", {}).get("org.opencontainers.image.ref.name", m.get("digest"))
                 for m in fitting]
        raise ImageError(f"image {source.ref} holds {len(fitting)} images for linux/{want} "
                         f"({', '.join(names)}); lgt reads a layout or archive of one")
    entry = fitting[0]
    body = source.json(_blob(entry.get("digest", "")), entry.get("digest"))
    if body.get("mediaType", entry.get("mediaType")) in INDEX_TYPES or "manifests" in body:
        if depth > 4:
            raise ImageError(f"image {source.ref}: its indexes nest too deep")
        return _pick_manifest(source, body, depth + 1)
    return body


def _read_docker(source: _Source) -> tuple[dict, str, list[tuple[str, str | None]]]:
    manifest = source.json("manifest.json", shape=list)
    if len(manifest) != 1 or not isinstance(manifest[0], dict):
        raise ImageError(f"image {source.ref}: its manifest.json should describe one image, not "
                         f"{len(manifest)}")
    entry = manifest[0]
    data = source.read(entry.get("Config", ""))
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    config = source.json(entry.get("Config", ""))  # (read again: small)
    return config, digest, [(p, None) for p in entry.get("Layers") or []]


def _check_platform(ref: str, config: Mapping) -> None:
    arch, want = config.get("architecture", ""), machine_arch()
    if (arch and ARCHES.get(arch, arch) != want) or config.get("os", "linux") != "linux":
        raise ImageError(f"image {ref} is for {config.get('os', 'linux')}/{arch}; this machine is "
                         f"linux/{want}")


# -- the cache --------------------------------------------------------------------------------------------

def open_image(ref: str | os.PathLike, cache: Path | None = None) -> Image:
    """The image ``ref`` (a path, or a name in a local podman or docker store) unpacked in ``cache``
    (done once per image, each layer once)."""
    cache = Path(cache) if cache is not None else default_cache()
    stored = find_stored(str(ref)) if not Path(str(ref)).expanduser().exists() else None
    if stored is not None:
        return _open_stored(stored, cache)
    config, digest, layers, source = resolve(ref)
    try:
        entry = cache / "roots" / digest.replace(":", "-")
        if not entry.is_dir():
            trees = [_layer(cache, source, layer) for layer in layers]
            with _building(cache, entry) as tmp:
                _assemble(tmp / "rootfs", trees, ImageConfig.parse(config).working_dir or DEFAULT_WORKDIR)
                (tmp / "config.json").write_text(json.dumps(config))
    finally:
        source.close()
    return Image(str(ref), digest, entry / "rootfs", ImageConfig.parse(config))


# -- images in a local podman or docker store --------------------------------------------------------------

STORES = {"containers-storage": "podman", "docker-daemon": "docker"}  # skopeo's transport names -> tool
STORE_TIMEOUT_S = 60  # to ask a store for an image's id (saving it has no limit: images can be large)


@dataclass(frozen=True)
class Stored:
    """An image found by name in a store: the tool that reads it, its name there, its id (the config's
    digest) and platform."""

    ref: str
    tool: str
    name: str
    digest: str
    os: str
    architecture: str


def find_stored(ref: str) -> Stored | None:
    """The image ``ref`` names in a local store: ``containers-storage:NAME`` (podman's),
    ``docker-daemon:NAME`` (docker's), or a bare name looked up in each installed store, podman's first.
    None when ``ref`` is no name and no store is asked; ImageError (one sentence) when the stores asked
    do not have it."""
    transport, _, rest = ref.partition(":")
    if transport in STORES and rest:
        name, tools = rest, [STORES[transport]]
    elif _looks_like_name(ref):
        name, tools = ref, [t for t in STORES.values() if shutil.which(t)]
        if not tools:
            return None
    else:
        return None
    answers = []
    for tool in tools:
        found, why = _inspect(ref, tool, name)
        if found is not None:
            return found
        answers.append(why)
    raise ImageError(f"image {ref} is not a file or folder here, nor an image {' or '.join(tools)} could "
                     f"give ({'; '.join(answers)})")


def _inspect(ref: str, tool: str, name: str) -> tuple[Stored | None, str]:
    """(the image, "") when ``tool``'s store has it, else (None, what ``tool`` said)."""
    if shutil.which(tool) is None:
        return None, f"{tool} is not installed"
    argv = [tool, "image", "inspect", "--format", "{{.Id}} {{.Os}} {{.Architecture}}", name]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=STORE_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{tool} image inspect: {e}"
    fields = done.stdout.split()
    if done.returncode != 0 or len(fields) != 3:
        return None, f"{tool} image inspect: {_last_line(done.stderr)}"
    digest = fields[0] if fields[0].startswith("sha256:") else "sha256:" + fields[0]
    if not _DIGEST.fullmatch(digest):
        return None, f"{tool} image inspect gave an id lgt cannot read, {fields[0]!r}"
    return Stored(ref, tool, name, digest, fields[1], fields[2]), ""


def _last_line(stderr: str) -> str:
    return (stderr.strip().splitlines() or ["no answer"])[-1].removeprefix("Error: ").strip()


def _open_stored(stored: Stored, cache: Path) -> Image:
    """A stored image's root: the cache's when one has its id, else saved from the store, unpacked, and
    the archive deleted."""
    entry = cache / "roots" / stored.digest.replace(":", "-")
    if not (entry / "config.json").is_file():
        _check_platform(stored.ref, {"os": stored.os, "architecture": stored.architecture})
        (cache / "tmp").mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="save.", dir=cache / "tmp"))
        try:
            archive = folder / "image.tar"
            argv = [stored.tool, "image", "save", "-o", str(archive), stored.name]
            done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            if done.returncode != 0 or not archive.is_file():
                raise ImageError(f"image {stored.ref}: {stored.tool} could not save it from its store "
                                 f"({_last_line(done.stderr)})")
            saved = open_image(archive, cache)
        finally:
            _remove(folder)
        if saved.digest != stored.digest:
            raise ImageError(f"image {stored.ref}: {stored.tool} saved an image with id {saved.digest}, not "
                             f"the {stored.digest} it named (did the name move meanwhile?)")
    config = json.loads((entry / "config.json").read_text())
    return Image(stored.ref, stored.digest, entry / "rootfs", ImageConfig.parse(config))


@contextlib.contextmanager
def _building(cache: Path, entry: Path) -> Iterator[Path]:
    """A folder to build ``entry`` in, renamed to it whole when the block succeeds, removed when it fails
    or when another process renamed its own first."""
    (cache / "tmp").mkdir(parents=True, exist_ok=True)
    entry.parent.mkdir(parents=True, exist_ok=True)
    for stale in (cache / "tmp").iterdir():  # left by a process killed while building
        with contextlib.suppress(OSError):
            if time.time() - stale.lstat().st_mtime > STALE_SECONDS:
                _remove(stale)
    tmp = Path(tempfile.mkdtemp(prefix=entry.name + ".", dir=cache / "tmp"))
    try:
        yield tmp
        try:
            os.rename(tmp, entry)
        except OSError:
            if not entry.is_dir():
                raise
    finally:
        if tmp.exists():
            _remove(tmp)


def _remove(path: Path) -> None:
    def writable(func, p, _exc):  # folders kept without the owner's write bit by a failed build
        os.chmod(os.path.dirname(p), 0o700)
        func(p)
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=writable)
    else:
        shutil.rmtree(path, onerror=writable)


def _layer(cache: Path, source: _Source, layer: Layer) -> Path:
    """The layer's extracted entry in the cache (extracted now when absent)."""
    if not _DIGEST.fullmatch(layer.diff_id):
        raise ImageError(f"image {source.ref}: layer {layer.path or '?'} has no sha256 diff id in the config")
    entry = cache / "layers" / layer.diff_id.replace(":", "-")
    if entry.is_dir():
        return entry
    with _building(cache, entry) as tmp, source.open(layer.path) as blob:
        _extract(source.ref, layer, blob, tmp)
    return entry


class _Hashing(io.RawIOBase):
    def __init__(self, inner: IO[bytes]) -> None:
        self.inner, self.hash = inner, hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.inner.read(len(b))
        self.hash.update(data)
        b[: len(data)] = data
        return len(data)

    def drain(self) -> str:
        while self.read(_CHUNK):
            pass
        return "sha256:" + self.hash.hexdigest()


def _decompressed(ref: str, blob: IO[bytes]) -> IO[bytes]:
    head = blob.peek(4)[:4] if hasattr(blob, "peek") else b""
    if head[:2] == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=blob, mode="rb")
    if head == b"\x28\xb5\x2f\xfd":
        for module in ("compression.zstd", "zstandard"):
            with contextlib.suppress(ImportError):
                z = __import__(module, fromlist=["x"])
                if hasattr(z, "ZstdFile"):
                    return z.ZstdFile(blob)
                return z.ZstdDecompressor().stream_reader(blob)
        raise ImageError(f"image {ref} has zstd-compressed layers, which need Python 3.14 or the zstandard "
                         f"package; re-save it with gzip or plain layers")
    return blob


def _extract(ref: str, layer: Layer, blob: IO[bytes], out: Path) -> None:
    """One layer's tar into ``out/tree``, its digests checked; folder modes and hard links to files of
    lower layers in ``out/meta.json``."""
    packed = _Hashing(blob)
    buffered = io.BufferedReader(packed, _CHUNK)
    plain = _Hashing(_decompressed(ref, buffered))
    tree = out / "tree"
    tree.mkdir()
    dirs: dict[str, int] = {}
    lower_links: list[tuple[str, str]] = []
    try:
        with tarfile.open(fileobj=io.BufferedReader(plain, _CHUNK), mode="r|") as tar:
            for m in tar:
                name = _member_path(ref, m.name)
                if name is None:
                    continue  # the root itself
                parent = _parents(ref, tree, name)
                target = parent / name.name
                if m.isdir():
                    if target.is_symlink() or (target.exists() and not target.is_dir()):
                        target.unlink()
                    target.mkdir(exist_ok=True)
                    dirs[str(name)] = m.mode & 0o1777
                    continue
                if not (m.isfile() or m.issym() or m.islnk()):
                    continue  # device nodes, fifos: not made unprivileged
                _clear(target)
                if m.issym():
                    os.symlink(m.linkname, target)
                elif m.islnk():
                    linked = _member_path(ref, m.linkname)
                    if linked is None:
                        raise ImageError(f"image {ref}: hard link {m.name} points at the root")
                    source = _parents(ref, tree, linked, make=False) / linked.name
                    if source.is_symlink() or source.is_file():
                        os.link(source, target, follow_symlinks=False)
                    else:
                        lower_links.append((str(name), str(linked)))
                else:
                    f = tar.extractfile(m)
                    assert f is not None
                    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                    with open(fd, "wb") as w:
                        shutil.copyfileobj(f, w, _CHUNK)
                    os.chmod(target, m.mode & 0o1777)
                    # the member's time: Python's timestamp-checked .pyc (and make) compare it
                    os.utime(target, (m.mtime, m.mtime))
        diff_id = plain.drain()
        digest = packed.drain()
    except (tarfile.TarError, EOFError, OSError, gzip.BadGzipFile, zlib.error) as e:
        raise ImageError(f"image {ref}: layer {layer.path} is corrupt ({e})") from None
    if layer.digest and digest != layer.digest:
        raise ImageError(f"image {ref}: layer {layer.path} does not match its digest {layer.digest} "
                         f"(corrupt image)")
    if diff_id != layer.diff_id:
        raise ImageError(f"image {ref}: layer {layer.path} does not match its diff id {layer.diff_id} "
                         f"(corrupt image)")
    (out / "meta.json").write_text(json.dumps({"dirs": dirs, "links": lower_links}))


def _member_path(ref: str, name: str) -> PurePosixPath | None:
    """A member's path inside the root, or None for the root itself; absolute names and ``..`` refused."""
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts:
        raise ImageError(f"image {ref}: layer member {name!r} would land outside the root (refused)")
    parts = [x for x in p.parts if x != "."]
    return PurePosixPath(*parts) if parts else None


def _parents(ref: str, tree: Path, name: PurePosixPath, make: bool = True) -> Path:
    """The folder ``name`` goes in, made when missing; a symlink on the way is refused (a write through
    it could land outside the root)."""
    here = tree
    for part in name.parts[:-1]:
        here = here / part
        st = _lstat(here)
        if st is None:
            if not make:
                return here
            here.mkdir()
        elif stat.S_ISLNK(st.st_mode):
            raise ImageError(f"image {ref}: layer member {str(name)!r} goes through the symlink "
                             f"{here.relative_to(tree)} (refused)")
        elif not stat.S_ISDIR(st.st_mode):
            raise ImageError(f"image {ref}: layer member {str(name)!r} goes through the file "
                             f"{here.relative_to(tree)}")
    return here


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _clear(path: Path) -> None:
    st = _lstat(path)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        _remove(path)
    else:
        path.unlink()


def _assemble(root: Path, layers: Sequence[Path], workdir: str) -> None:
    """The layers' trees applied in order onto ``root`` (whiteouts and opaque folders honoured; files
    hard-linked from the layers), then folder modes, then bwrap's mount points and ``workdir``."""
    root.mkdir()
    modes: dict[str, int] = {}
    for layer in layers:
        meta = json.loads((layer / "meta.json").read_text())
        _apply(layer / "tree", root)
        for name, target in meta["links"]:
            dest = _parents(layer.name, root, PurePosixPath(name)) / PurePosixPath(name).name
            src = _parents(layer.name, root, PurePosixPath(target), make=False) / PurePosixPath(target).name
            st = _lstat(src)
            if st is None or stat.S_ISDIR(st.st_mode):
                raise ImageError(f"layer {layer.name}: hard link {name} points at {target}, which no lower "
                                 f"layer has as a file")
            _clear(dest)
            os.link(src, dest, follow_symlinks=False)
        for name, mode in meta["dirs"].items():
            modes[name] = mode
    for d in (*BWRAP_DIRS, workdir.strip("/")):
        here = root
        for part in PurePosixPath(d).parts:
            here = here / part
            if here.is_symlink() or (here.exists() and not here.is_dir()):
                _clear(here)
            here.mkdir(exist_ok=True)
    for name, mode in sorted(modes.items(), key=lambda kv: -len(PurePosixPath(kv[0]).parts)):
        p = root / name
        if p.is_dir() and not p.is_symlink():
            os.chmod(p, mode | 0o700)


def _apply(src: Path, dest: Path) -> None:
    """One layer's folder onto the root's: an opaque marker empties it first, ``.wh.NAME`` removes NAME,
    folders merge, anything else replaces what was there. ``dest`` is a real folder (never a symlink)."""
    names = sorted(os.listdir(src))
    if OPAQUE in names:
        for existing in os.listdir(dest):
            _clear(dest / existing)
    for name in names:
        if name.startswith(WHITEOUT) and name != OPAQUE:
            _clear(dest / name[len(WHITEOUT):])
    for name in names:
        if name.startswith(WHITEOUT):
            continue
        s, d = src / name, dest / name
        if s.is_dir() and not s.is_symlink():
            st = _lstat(d)
            if st is not None and not stat.S_ISDIR(st.st_mode):
                d.unlink()
            d.mkdir(exist_ok=True)
            _apply(s, d)
        else:
            _clear(d)
            os.link(s, d, follow_symlinks=False)


# -- running a command in an image ----------------------------------------------------------------------

def workdir_of(image: Image, at: str | None = None) -> str:
    """Where an attempt's writable folder goes: ``at``, else the image's WorkingDir, else /work."""
    path = str(PurePosixPath("/", at or image.config.working_dir or DEFAULT_WORKDIR))
    if path == "/":
        raise ImageError(f"image {image.ref}: an attempt's folder cannot be the root itself")
    return path


def fresh_workdir(image: Image, dest: Path, at: str | None = None) -> Path:
    """An attempt's own writable folder at ``dest`` (which must not exist): a copy of what the image
    holds at its working folder. Refused when the image has no folder there (bwrap cannot make a mount
    point in a read-only root)."""
    inside = image.root / workdir_of(image, at).lstrip("/")
    if inside.is_symlink() or not inside.is_dir():
        raise ImageError(f"image {image.ref} has no folder {workdir_of(image, at)} to run in")
    shutil.copytree(inside, dest, symlinks=True)
    os.chmod(dest, 0o755)
    return dest
