"""Images named in a local store (lgt.trainer.rollout.images.find_stored): podman's
(``containers-storage:NAME``) and docker's (``docker-daemon:NAME``), each a store of the test's own —
podman pointed at a private storage.conf, a private dockerd (root only) — with a real image built here
loaded into it. lgt asks the store for the image's id, saves the image to an archive only when the cache
has no root with that id, unpacks it and deletes the archive; a wrapper first on PATH records each call
the tool gets."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lgt.testing.images import (
    Config,
    Dir,
    File,
    Layer,
    Whiteout,
    docker_daemon,
    podman_store,
    write_docker_archive,
)
from lgt.trainer.rollout import images
from lgt.trainer.rollout.images import ImageError, open_image

LAYERS = [Layer([Dir("etc"), File("etc/os-release", b"ID=lgt-test\n"), File("etc/gone", b"x")]),
          Layer([Whiteout("etc/gone"), Dir("srv"), File("srv/app.txt", b"v1\n", mode=0o755)])]


@dataclass
class Store:
    tool: str
    transport: str
    log: Path  # one line per call of the tool: its arguments

    def calls(self, verb: str) -> int:
        return sum(1 for line in self.log.read_text().splitlines() if line.startswith(f"image {verb}")) \
            if self.log.exists() else 0

    def load(self, archive: Path, name: str) -> None:
        for argv in ([self.tool, "load", "-i", str(archive)], [self.tool, "tag", "lgt-test:latest", name]):
            done = subprocess.run(argv, capture_output=True, text=True)
            assert done.returncode == 0, done.stderr


def _usable(tool: str) -> str | None:
    """Why ``tool`` cannot give this test a store of its own, or None."""
    if shutil.which(tool) is None:
        return f"{tool} is not installed (scripts/setup.sh installs it with apt-get as root)"
    if tool == "docker" and (shutil.which("dockerd") is None or os.geteuid() != 0):
        return "a private docker daemon needs dockerd and root"
    return None


@pytest.fixture(scope="module", params=["podman", "docker"])
def store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    tool = request.param
    if why := _usable(tool):
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp(tool)
    bin_dir, log = tmp / "bin", tmp / "calls.log"
    bin_dir.mkdir()
    wrapper = bin_dir / tool
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {shutil.which(tool)} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    made = podman_store(tmp / "store") if tool == "podman" else docker_daemon(tmp / "daemon")
    with made as env, pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        mp.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
        yield Store(tool, {"podman": "containers-storage", "docker": "docker-daemon"}[tool], log)


def test_an_image_named_in_a_store_is_saved_once_unpacked_and_its_archive_deleted(store, tmp_path):
    archive = tmp_path / "image.tar"
    digest = write_docker_archive(archive, LAYERS, Config(env=["PATH=/bin"], working_dir="/srv"))
    store.load(archive, "lgt-test/files:1")
    cache = tmp_path / "cache"
    saves = store.calls("save")
    image = open_image(f"{store.transport}:lgt-test/files:1", cache=cache)
    assert image.digest == digest and image.ref == f"{store.transport}:lgt-test/files:1"
    assert (image.root / "srv/app.txt").read_bytes() == b"v1\n"
    assert (image.root / "etc/os-release").read_bytes() == b"ID=lgt-test\n"
    assert not (image.root / "etc/gone").exists()  # the whiteout, honoured as from an archive
    assert image.config.working_dir == "/srv"
    assert store.calls("save") == saves + 1
    assert list((cache / "tmp").iterdir()) == []  # the saved archive is gone
    # the same root as the archive gives
    direct = open_image(archive, cache=tmp_path / "cache2")
    assert direct.digest == image.digest
    assert sorted(p.name for p in direct.root.rglob("*")) == sorted(p.name for p in image.root.rglob("*"))
    # named again, by the bare name this time (podman's first, then docker's): the store is asked for
    # the id, nothing is saved again
    again = open_image("lgt-test/files:1", cache=cache)
    assert again.root == image.root and store.calls("save") == saves + 1


def test_a_name_no_store_has_or_of_another_architecture_is_one_sentence_and_nothing_is_saved(store,
                                                                                              tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(ImageError, match=rf"^image {store.transport}:lgt-test/nowhere:1 is not a file or "
                                         rf"folder here, nor an image {store.tool} could give \({store.tool} "
                                         rf"image inspect: .*\)$"):
        open_image(f"{store.transport}:lgt-test/nowhere:1", cache=cache)
    other = "arm64" if images.machine_arch() != "arm64" else "amd64"
    archive = tmp_path / "foreign.tar"
    write_docker_archive(archive, LAYERS[:1], Config(architecture=other))
    store.load(archive, "lgt-test/foreign:1")
    saves = store.calls("save")
    with pytest.raises(ImageError, match=rf"^image {store.transport}:lgt-test/foreign:1 is for "
                                         rf"linux/{other}; this machine is linux/"):
        open_image(f"{store.transport}:lgt-test/foreign:1", cache=cache)
    assert store.calls("save") == saves
    assert not (cache / "roots").exists()


def test_a_bare_name_with_no_store_installed_says_how_to_save_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # neither podman nor docker
    with pytest.raises(ImageError, match=r"^image python:3.11 is not a file or folder here, and neither "
                                         r"podman nor docker is installed to look it up by name: save it "
                                         r"to an archive where it is \(docker save python:3.11 -o image.tar"):
        open_image("python:3.11", cache=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
