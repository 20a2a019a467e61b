"""lgt.store.files: a file is replaced whole or not at all, its temporary file never stays behind, and
``fsync=True`` flushes the file before the rename and the directory after it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from lgt.store import files
from lgt.store.files import atomic_path, replace_atomic, write_atomic


def leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".tmp"))


def test_write_atomic_bytes_and_text(tmp_path: Path) -> None:
    dest = tmp_path / "a.json"
    write_atomic(dest, b'{"a": 1}\n')
    assert dest.read_bytes() == b'{"a": 1}\n'
    write_atomic(dest, "ünïcode · text\n")  # text is written as UTF-8, over the old file
    assert dest.read_text(encoding="utf-8") == "ünïcode · text\n"
    assert leftovers(tmp_path) == []


def test_the_new_file_has_the_usual_permissions(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    os.umask(umask)
    write_atomic(tmp_path / "f", "x")
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path: Path) -> None:
    dest = tmp_path / "report.html"
    dest.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(dest) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".report.html.") and tmp.exists()
        tmp.write_text("half of the ne")
        raise RuntimeError("the writer died")
    assert dest.read_text() == "old" and leftovers(tmp_path) == []


def test_a_failed_rename_leaves_the_old_file_and_no_temp_file(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / "summary.json"
    dest.write_text("old")

    def refuse(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "replace", refuse)
    with pytest.raises(OSError, match="No space"):
        write_atomic(dest, "new")
    assert dest.read_text() == "old" and leftovers(tmp_path) == []


def test_a_write_into_a_missing_directory_fails_cleanly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "nope" / "f", "x")
    assert not (tmp_path / "nope").exists()


def test_a_given_temp_name_is_used_and_removed_on_failure(tmp_path: Path) -> None:
    dest = tmp_path / "part-1.parquet"
    named = tmp_path / "part-1.parquet.tmp"
    with atomic_path(dest, tmp=named) as tmp:
        assert tmp == named
        tmp.write_bytes(b"PAR1 whole")
    assert dest.read_bytes() == b"PAR1 whole" and not named.exists()
    with pytest.raises(ValueError), atomic_path(dest, tmp=named) as tmp:
        tmp.write_bytes(b"PAR1 ha")
        raise ValueError
    assert dest.read_bytes() == b"PAR1 whole" and not named.exists()


@pytest.mark.parametrize("fsync", [False, True])
def test_fsync_flushes_the_file_before_the_rename_and_the_directory_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: bool) -> None:
    dest = tmp_path / "DONE"
    dest.write_text("old")
    synced: list[tuple[str, str]] = []  # (what the fd is, what dest holds then)
    real = os.fsync

    def spy(fd: int) -> None:
        target = Path(os.readlink(f"/proc/self/fd/{fd}"))
        synced.append(("dir" if target.is_dir() else "file", dest.read_text()))
        real(fd)

    monkeypatch.setattr(files.os, "fsync", spy)
    write_atomic(dest, "7\n", fsync=fsync)
    assert dest.read_text() == "7\n"
    assert synced == ([("file", "old"), ("dir", "7\n")] if fsync else [])


def test_replace_atomic_with_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = os.fsync
    monkeypatch.setattr(files.os, "fsync", lambda fd: (calls.append(fd), real(fd)))
    done = tmp_path / "out.parquet.tmp"
    done.write_bytes(b"whole")
    replace_atomic(done, tmp_path / "out.parquet", fsync=True)
    assert (tmp_path / "out.parquet").read_bytes() == b"whole" and not done.exists() and len(calls) == 2


def test_concurrent_writers_never_mix(tmp_path: Path) -> None:
    dest = tmp_path / "ca-bundle.pem"
    payloads = [bytes([65 + i]) * 200_000 for i in range(8)]
    threads = [threading.Thread(target=write_atomic, args=(dest, p)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert dest.read_bytes() in payloads and leftovers(tmp_path) == []


def test_atomic_dir_replaces_a_folder_or_a_link_whole_and_a_failure_leaves_it(tmp_path: Path) -> None:
    dest = tmp_path / "model"
    with files.atomic_dir(dest) as tmp:
        (tmp / "a").write_text("1")
        assert not dest.exists()  # nothing at dest while the folder is built
    assert (dest / "a").read_text() == "1"
    assert dest.stat().st_mode & 0o777 == 0o777 & ~_umask()  # not mkdtemp's private 0700
    with pytest.raises(RuntimeError), files.atomic_dir(dest) as tmp:
        (tmp / "b").write_text("2")
        raise RuntimeError("half built")
    assert sorted(p.name for p in dest.iterdir()) == ["a"]
    other = tmp_path / "other"
    other.mkdir()
    link = tmp_path / "link"
    link.symlink_to(other)
    with files.atomic_dir(link) as tmp:
        (tmp / "c").write_text("3")
    assert not link.is_symlink() and (link / "c").exists() and other.is_dir()  # the link's target stays
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "model", "other"]  # nothing left over


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
