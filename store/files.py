"""Files written whole: whoever reads one (or a crash) finds the old file or the new one, never a part.

The one way lgt writes a file atomically: into a temporary file beside the destination (the same
directory, so the rename stays on one filesystem), then ``os.replace`` over it. A write that fails
leaves the old file as it was and removes its temporary file. ``fsync=True`` also survives a machine
crash: the file is flushed to disk before the rename and its directory after it.

- :func:`write_atomic`: bytes or text already in memory.
- :func:`atomic_path`: a temporary path for a writer that writes to a path itself (pyarrow,
  safetensors, a stream copy); renamed over the destination when the block ends without an error.
- :func:`replace_atomic`: rename a finished file (under a name of the caller's) over the destination.
- :func:`fsync_dir`: flush a directory's entries (after a rename the caller did itself).

Temporary names start with ``.`` and end with ``.tmp`` (hidden from globs of the real names) and carry
the process id and a random token, so concurrent writers of one destination never share one.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def temp_path(dest: str | os.PathLike) -> Path:
    """A fresh temporary name beside ``dest``: ``.<name>.<pid>-<random>.tmp``."""
    dest = Path(dest)
    return dest.with_name(f".{dest.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush the directory ``path`` (the names in it: a rename or a new file) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomic(tmp: str | os.PathLike, dest: str | os.PathLike, *, fsync: bool = False) -> None:
    """Make the finished file ``tmp`` appear as ``dest`` whole (``os.replace``); with ``fsync``, the file
    is flushed to disk before the rename and ``dest``'s directory after it."""
    if fsync:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.replace(tmp, dest)
    if fsync:
        fsync_dir(Path(dest).parent)


@contextmanager
def atomic_path(dest: str | os.PathLike, *, fsync: bool = False,
                tmp: str | os.PathLike | None = None) -> Iterator[Path]:
    """Yield a temporary path for the block to write ``dest``'s new content to; when the block ends
    without an error it is renamed over ``dest`` (:func:`replace_atomic`), when it raises the temporary
    file is removed and ``dest`` is left as it was. The temporary file is created empty (exclusively,
    with the usual permissions) under a fresh name of :func:`temp_path` unless ``tmp`` names one: a
    caller whose recovery looks for its own temporary names gives them."""
    if tmp is None:
        path = temp_path(dest)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    else:
        path = Path(tmp)
    try:
        yield path
        replace_atomic(path, dest, fsync=fsync)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def write_atomic(dest: str | os.PathLike, data: bytes | str, *, fsync: bool = False) -> None:
    """Write ``data`` (text as UTF-8) to ``dest`` whole: :func:`atomic_path` around one write."""
    with atomic_path(dest, fsync=fsync) as tmp, open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


@contextmanager
def atomic_dir(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh folder beside ``dest`` for the block to fill; when the block ends without an error
    it takes ``dest``'s place whole (an old ``dest`` — a folder, or a link — is moved aside, then
    removed), when it raises the folder is removed and ``dest`` is left as it was. The folder gets the
    usual permissions (``mkdtemp`` makes it private)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp-"))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    try:
        yield tmp
        old = None
        if dest.exists() or dest.is_symlink():
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
            os.replace(dest, old)
        os.replace(tmp, dest)
        if old is not None and old.is_symlink():
            old.unlink()
        elif old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
