"""The image store (lgt.trainer.rollout.images): images built here (lgt.testing.images) unpack to the exact
tree their layers describe, once, atomically, refusing what is corrupt, foreign or hostile; and a command
runs under bubblewrap with the unpacked root as ``/``."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lgt.testing.images import (
    Config,
    Dir,
    File,
    Hardlink,
    Layer,
    Opaque,
    Symlink,
    Whiteout,
    busybox_layer,
    busybox_root,
    bwrap_argv,
    tree_layer,
    write_docker_archive,
    write_oci_archive,
    write_oci_layout,
)
from lgt.trainer.rollout import images
from lgt.trainer.rollout.images import ImageError, fresh_workdir, open_image

MOUNTS = {"proc", "dev", "tmp", "work"}  # made by the store for bwrap and the working folder

WRITERS = {
    "oci-layout": lambda dest, layers, config=None: write_oci_layout(dest, layers, config),
    "oci-archive": lambda dest, layers, config=None: write_oci_archive(
        dest.with_suffix(".tar"), layers, config),
    "docker-archive": lambda dest, layers, config=None: write_docker_archive(
        dest.with_suffix(".tar"), layers, config),
}


def build(tmp: Path, kind: str, layers, config=None) -> Path:
    dest = tmp / "image"
    WRITERS[kind](dest, layers, config)
    return dest if kind == "oci-layout" else dest.with_suffix(".tar")


def tree(root: Path) -> dict[str, tuple]:
    """A root as {path: ("d",) | ("f", bytes, mode) | ("l", target)}, the store's mount points left out."""
    out: dict[str, tuple] = {}
    for here, dirs, files in os.walk(root):
        rel = Path(here).relative_to(root)
        if rel == Path("."):
            dirs[:] = [d for d in dirs if d not in MOUNTS]
        for name in dirs + files:
            p, key = Path(here) / name, str(rel / name).removeprefix("./")
            if p.is_symlink():
                out[key] = ("l", os.readlink(p))
            elif p.is_dir():
                out[key] = ("d",)
            else:
                out[key] = ("f", p.read_bytes(), p.stat().st_mode & 0o7777)
    return out


def cache_entries(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for p in cache.glob("*/*"))


LAYERS = [
    Layer([Dir("etc"), File("etc/keep", b"keep"), File("etc/gone", b"gone"), Dir("var"), Dir("var/lib"),
           File("var/lib/a", b"a"), File("var/lib/b", b"b", 0o600), Dir("opt"), File("opt/x", b"x"),
           File("bin/tool", b"#!tool", 0o755), Symlink("bin/alias", "tool"),
           Hardlink("bin/again", "bin/tool")],
          gzip=True),
    Layer([Whiteout("etc/gone"), Opaque("var/lib"), Dir("var/lib"), File("var/lib/c", b"c"),
           Whiteout("opt"), File("etc/keep", b"kept again", 0o640), Hardlink("etc/tool-link", "bin/tool")],
          gzip=False),
    Layer([File("opt", b"opt is a file now"), Symlink("etc/keep-link", "/etc/keep")], gzip=True),
]
EXPECTED = {
    "etc": ("d",), "etc/keep": ("f", b"kept again", 0o640), "etc/tool-link": ("f", b"#!tool", 0o755),
    "etc/keep-link": ("l", "/etc/keep"), "var": ("d",), "var/lib": ("d",), "var/lib/c": ("f", b"c", 0o644),
    "bin": ("d",), "bin/tool": ("f", b"#!tool", 0o755), "bin/alias": ("l", "tool"),
    "bin/again": ("f", b"#!tool", 0o755), "opt": ("f", b"opt is a file now", 0o644),
}


@pytest.mark.parametrize("kind", sorted(WRITERS))
def test_whiteouts_opaque_folders_and_links_unpack_to_the_exact_tree(tmp_path: Path, kind: str) -> None:
    image = open_image(build(tmp_path, kind, LAYERS), cache=tmp_path / "cache")
    assert tree(image.root) == EXPECTED
    ino = os.stat(image.root / "bin/tool").st_ino
    assert os.stat(image.root / "bin/again").st_ino == ino  # a hard link in its layer
    assert os.stat(image.root / "etc/tool-link").st_ino == ino  # one to a lower layer's file
    assert {"proc", "dev", "tmp", "work"} <= set(os.listdir(image.root))
    assert image.config.working_dir == "/work" and image.config.environment()["PATH"] == "/bin:/usr/bin"
    assert image.digest.startswith("sha256:") and cache_entries(tmp_path / "cache")[-1].startswith("roots/")


def test_a_folder_becomes_a_layer_and_unpacks_to_itself(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg/sub").mkdir(parents=True)
    (src / "pkg/run.sh").write_text("#!/bin/sh\n")
    os.chmod(src / "pkg/run.sh", 0o750)
    os.link(src / "pkg/run.sh", src / "pkg/sub/same.sh")
    (src / "pkg/link").symlink_to("run.sh")
    image = open_image(build(tmp_path, "docker-archive", [Layer(tree_layer(src, "opt"))]),
                       cache=tmp_path / "cache")
    assert tree(image.root) == {"opt": ("d",), **{f"opt/{k}": v for k, v in tree(src).items()}}
    assert os.stat(image.root / "opt/pkg/run.sh").st_ino == os.stat(image.root / "opt/pkg/sub/same.sh").st_ino


# -- a reference model of layers applied in order, against random stacks -----------------------------------

NAMES = ["a", "b", "a/b", "a/c", "b/a", "a/b/c"]


def sanitize(ops: dict[str, tuple]) -> dict[str, tuple]:
    """One layer's members kept only where valid in a tar: every folder above a member that the layer
    names is a folder of it (not a file, symlink or whiteout)."""
    kept: dict[str, tuple] = {}
    for path in sorted(ops, key=lambda p: p.count("/")):
        parents = ["/".join(path.split("/")[:i]) for i in range(1, path.count("/") + 1)]
        if all(kept.get(p, ("d",))[0] in ("d", "o") and p in kept or p not in ops for p in parents):
            kept[path] = ops[path]
    return kept


def model(layers: list[dict[str, tuple]]) -> dict[str, tuple]:
    state: dict[str, tuple] = {}

    def remove(path: str) -> None:
        for k in [k for k in state if k == path or k.startswith(path + "/")]:
            del state[k]

    def folder(path: str) -> None:
        parts = path.split("/")
        for i in range(1, len(parts) + 1):
            p = "/".join(parts[:i])
            if state.get(p, ("d",))[0] != "d":
                remove(p)
            state[p] = ("d",)

    for ops in layers:
        for path, op in ops.items():
            if op[0] == "o":
                for k in [k for k in state if k.startswith(path + "/")]:
                    del state[k]
        for path, op in ops.items():
            if op[0] == "w":
                remove(path)
        for path, op in sorted(ops.items(), key=lambda kv: kv[0].count("/")):
            if "/" in path:
                folder(path.rsplit("/", 1)[0])
            if op[0] in ("d", "o"):
                folder(path)
        for path, op in ops.items():
            if op[0] in ("f", "l"):
                remove(path)
                state[path] = ("f", op[1], 0o644) if op[0] == "f" else ("l", op[1])
    return state


def members(ops: dict[str, tuple]) -> list:
    out = []
    for path, op in sorted(ops.items()):
        if op[0] == "f":
            out.append(File(path, op[1]))
        elif op[0] == "l":
            out.append(Symlink(path, op[1]))
        elif op[0] == "d":
            out.append(Dir(path))
        elif op[0] == "o":
            out += [Dir(path), Opaque(path)]
        else:
            out.append(Whiteout(path))
    return out


OP = st.one_of(st.tuples(st.just("f"), st.binary(max_size=8)),
               st.tuples(st.just("l"), st.sampled_from(["a", "/b", "x"])),
               st.just(("d",)), st.just(("o",)), st.just(("w",)))
STACK = st.lists(st.dictionaries(st.sampled_from(NAMES), OP, max_size=5).map(sanitize),
                 min_size=1, max_size=4)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stack=STACK, gz=st.booleans())
def test_random_layer_stacks_unpack_as_the_reference_model_says(tmp_path_factory, stack, gz) -> None:
    tmp = tmp_path_factory.mktemp("stack")
    layers = [Layer(members(ops), gzip=gz) for ops in stack]
    image = open_image(build(tmp, "oci-layout", layers), cache=tmp / "cache")
    assert tree(image.root) == model(stack)


# -- the cache --------------------------------------------------------------------------------------------

def test_layers_shared_by_two_images_are_extracted_once(tmp_path: Path) -> None:
    base = [Dir("usr"), File("usr/base", b"base" * 1000)]
    first = build(tmp_path / "1", "oci-layout", [Layer(base, gzip=True), Layer([File("one", b"1")])])
    second = build(tmp_path / "2", "docker-archive", [Layer(base, gzip=False), Layer([File("two", b"2")])])
    cache = tmp_path / "cache"
    a = open_image(first, cache=cache)
    shared = next(p for p in (cache / "layers").iterdir() if (p / "tree/usr/base").exists())
    made = os.stat(shared).st_ino
    b = open_image(second, cache=cache)
    assert len(list((cache / "layers").iterdir())) == 3 and os.stat(shared).st_ino == made
    assert os.stat(a.root / "usr/base").st_ino == os.stat(b.root / "usr/base").st_ino  # one copy on disk
    again = open_image(first, cache=cache)
    assert again.root == a.root and len(list((cache / "roots").iterdir())) == 2
    assert not list((cache / "tmp").iterdir())


def test_a_files_time_is_kept_so_timestamp_checked_pyc_stay_valid(tmp_path: Path) -> None:
    # a .pyc records its source's mtime; an image whose files all read "now" would recompile every import
    when = 1_700_000_000
    image = build(tmp_path / "i", "oci-layout", [Layer([Dir("app"), File("app/m.py", b"x = 1\n", mtime=when),
                                                         Hardlink("app/same.py", "app/m.py")])])
    root = open_image(image, cache=tmp_path / "cache").root
    assert os.stat(root / "app/m.py").st_mtime == when and os.stat(root / "app/same.py").st_mtime == when


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_docker_archive_with_a_linked_layer_reads_and_its_names_stay_inside_it(tmp_path: Path) -> None:
    archive = build(tmp_path, "docker-archive", [Layer([File("a", b"a")], gzip=False)])
    folder = archive.with_name("image.tar.docker")
    first = next(folder.glob("*/layer.tar"))
    (folder / "again").mkdir()
    (folder / "again/layer.tar").symlink_to(f"../{first.parent.name}/layer.tar")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest[0]["Layers"].append("again/layer.tar")
    (folder / "manifest.json").write_text(json.dumps(manifest))
    config = folder / manifest[0]["Config"]
    doc = json.loads(config.read_text())
    doc["rootfs"]["diff_ids"] *= 2
    (folder / "new.json").write_text(json.dumps(doc))
    manifest[0]["Config"] = "../../../new.json"  # stays inside the archive: its own new.json
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with tarfile.open(tmp_path / "linked.tar", "w") as tar:
        for p in sorted(folder.rglob("*")):
            tar.add(p, str(p.relative_to(folder)), recursive=False)
    image = open_image(tmp_path / "linked.tar", cache=tmp_path / "cache")
    assert tree(image.root) == {"a": ("f", b"a", 0o644)}
    assert len(list((tmp_path / "cache/layers").iterdir())) == 1


def test_a_layer_that_does_not_match_its_digest_leaves_nothing_in_the_cache(tmp_path: Path) -> None:
    layout = build(tmp_path, "oci-layout", [Layer([File("a", b"a" * 4096)], gzip=False)])
    index = json.loads((layout / "index.json").read_text())
    manifest = json.loads((layout / "blobs/sha256" / index["manifests"][0]["digest"][7:]).read_text())
    blob = layout / "blobs/sha256" / manifest["layers"][0]["digest"][7:]
    data = bytearray(blob.read_bytes())
    data[600] ^= 0xFF  # inside the file's bytes: the tar still reads
    blob.write_bytes(bytes(data))
    cache = tmp_path / "cache"
    says = r"layer blobs/sha256/\w+ does not match its digest sha256:\w+ \(corrupt image\)"
    with pytest.raises(ImageError, match=says):
        open_image(layout, cache=cache)
    assert cache_entries(cache) == []


@pytest.mark.parametrize("which", ["manifest", "config"])
def test_a_manifest_or_config_that_does_not_match_its_digest_is_refused(tmp_path: Path, which: str) -> None:
    layout = build(tmp_path, "oci-layout", [Layer([File("a", b"a")])])
    index = json.loads((layout / "index.json").read_text())
    manifest = layout / "blobs/sha256" / index["manifests"][0]["digest"][7:]
    blob = manifest if which == "manifest" else \
        layout / "blobs/sha256" / json.loads(manifest.read_text())["config"]["digest"][7:]
    _flip_last_byte(blob)
    says = r"^image \S+: blobs/sha256/\w+ does not match its digest sha256:\w+ \(corrupt image\)$"
    with pytest.raises(ImageError, match=says):
        open_image(layout, cache=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_a_manifest_and_config_that_count_different_layers_are_refused(tmp_path: Path) -> None:
    build(tmp_path, "docker-archive", [Layer([File("a")]), Layer([File("b")])])
    folder = tmp_path / "image.tar.docker"
    config = folder / json.loads((folder / "manifest.json").read_text())[0]["Config"]
    doc = json.loads(config.read_text())
    doc["rootfs"]["diff_ids"].pop()
    config.write_text(json.dumps(doc))
    with pytest.raises(ImageError, match="its config lists 1 layer diff ids and its manifest 2 layers"):
        open_image(folder, cache=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_a_docker_layer_that_does_not_match_its_diff_id_is_refused(tmp_path: Path) -> None:
    archive = build(tmp_path, "docker-archive", [Layer([File("a", b"a")], gzip=False)])
    folder = archive.with_name("image.tar.docker")
    layer = next(folder.glob("*/layer.tar"))
    layer.write_bytes(Layer([File("a", b"b")], gzip=False).tar())
    archive.unlink()
    cache = tmp_path / "cache"
    with pytest.raises(ImageError, match="does not match its diff id"):
        open_image(folder, cache=cache)  # (a docker archive unpacked into a folder reads too)
    assert cache_entries(cache) == []


def test_a_truncated_gzip_layer_is_corrupt_and_leaves_nothing(tmp_path: Path) -> None:
    layout = build(tmp_path, "oci-layout", [Layer([File("a", os.urandom(50_000))], gzip=True)])
    blob = max((layout / "blobs/sha256").iterdir(), key=lambda p: p.stat().st_size)
    blob.write_bytes(blob.read_bytes()[:20_000])
    cache = tmp_path / "cache"
    with pytest.raises(ImageError, match="is corrupt"):
        open_image(layout, cache=cache)
    assert cache_entries(cache) == []


def _raw(*infos: tuple[tarfile.TarInfo, bytes]) -> Layer:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for info, data in infos:
            info.size = len(data) if info.isfile() else 0
            tar.addfile(info, io.BytesIO(data))
    return Layer([], gzip=False, raw=out.getvalue())


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info


@pytest.mark.parametrize(("layers", "says"), [
    ([_raw((_member("../escaped"), b"x"))], "would land outside the root"),
    ([_raw((_member("/etc/escaped"), b"x"))], "would land outside the root"),
    ([_raw((_member("a", tarfile.SYMTYPE, "/tmp"), b""), (_member("a/escaped"), b"x"))],
     "goes through the symlink a"),
    ([_raw((_member("a", tarfile.SYMTYPE, "../../.."), b""), (_member("a/b/escaped"), b"x"))],
     "goes through the symlink a"),
    ([_raw((_member("h", tarfile.LNKTYPE, "../../../etc/passwd"), b""))], "would land outside the root"),
], ids=["dotdot", "absolute", "symlink-then-write", "symlink-dotdot", "hardlink-out"])
def test_members_that_would_escape_the_root_are_refused(tmp_path: Path, layers, says) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(ImageError, match=says):
        open_image(build(tmp_path, "oci-layout", layers), cache=cache)
    assert cache_entries(cache) == [] and not list(tmp_path.rglob("escaped"))


def test_an_image_symlink_is_replaced_by_a_later_layers_folder_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    layers = [Layer([Symlink("a", str(outside))]), Layer([Dir("a"), File("a/written", b"x")])]
    image = open_image(build(tmp_path, "oci-layout", layers), cache=tmp_path / "cache")
    assert not list(outside.iterdir())
    assert tree(image.root) == {"a": ("d",), "a/written": ("f", b"x", 0o644)}


def test_a_hard_link_through_a_lower_layers_symlink_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("host")
    layers = [Layer([Symlink("a", str(outside))]), _raw((_member("h", tarfile.LNKTYPE, "a/secret"), b""))]
    cache = tmp_path / "cache"
    with pytest.raises(ImageError, match="goes through the symlink a"):
        open_image(build(tmp_path, "oci-layout", layers), cache=cache)
    assert not list((cache / "roots").iterdir()) and os.stat(outside / "secret").st_nlink == 1


def test_two_processes_unpacking_one_image_leave_one_complete_root(tmp_path: Path) -> None:
    layers = [Layer([Dir("d"), *[File(f"d/{g}-{i}", os.urandom(200_000)) for i in range(20)]], gzip=bool(g))
              for g in (1, 0)]
    ref = build(tmp_path, "oci-archive", layers)
    cache = tmp_path / "cache"
    code = ("import sys; from lgt.trainer.rollout.images import open_image; "
            "print(open_image(sys.argv[1], cache=sys.argv[2]).root)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(ref), str(cache)], stdout=subprocess.PIPE,
                              text=True, env={**os.environ}) for _ in range(2)]
    roots = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert [p.returncode for p in procs] == [0, 0] and len(roots) == 1
    assert len(list((cache / "roots").iterdir())) == 1 and len(list((cache / "layers").iterdir())) == 2
    assert len(list((Path(roots.pop()) / "d").iterdir())) == 40 and not list((cache / "tmp").iterdir())


# -- bad input: one sentence, nothing unpacked -----------------------------------------------------------

def test_an_image_for_another_architecture_is_refused(tmp_path: Path) -> None:
    other = "arm64" if images.machine_arch() != "arm64" else "amd64"
    ref = build(tmp_path, "docker-archive", [Layer([File("a")])], Config(architecture=other))
    here = images.machine_arch()
    with pytest.raises(ImageError, match=f"is for linux/{other}; this machine is linux/{here}"):
        open_image(ref, cache=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_a_windows_image_is_refused(tmp_path: Path) -> None:
    build(tmp_path, "docker-archive", [Layer([File("a")])])
    folder = tmp_path / "image.tar.docker"
    config = folder / json.loads((folder / "manifest.json").read_text())[0]["Config"]
    doc = json.loads(config.read_text())
    config.write_text(json.dumps({**doc, "os": "windows"}))
    with pytest.raises(ImageError, match=f"is for windows/{doc['architecture']}; this machine is linux/"):
        open_image(folder, cache=tmp_path / "cache")


def test_a_dead_builds_folder_is_swept_and_a_live_ones_kept(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    (cache / "tmp/dead/x").mkdir(parents=True)
    (cache / "tmp/live").mkdir()
    old = os.stat(cache / "tmp/dead").st_mtime - images.STALE_SECONDS - 60
    os.utime(cache / "tmp/dead", (old, old))
    open_image(build(tmp_path, "oci-layout", [Layer([File("a")])]), cache=cache)
    assert sorted(os.listdir(cache / "tmp")) == ["live"]


def test_an_index_gives_this_machines_entry_or_says_what_it_offers(tmp_path: Path) -> None:
    here = images.machine_arch()
    other = "arm64" if here != "arm64" else "amd64"
    write_oci_layout(tmp_path / "multi", [Layer([File("a", b"a")])], Config(), platforms=[other, here])
    assert open_image(tmp_path / "multi", cache=tmp_path / "cache").config.architecture == here
    write_oci_layout(tmp_path / "foreign", [Layer([File("a")])], Config(), platforms=[other, "s390x"])
    says = rf"has no entry for linux/{here} \(it offers linux/{other}, linux/s390x\)"
    with pytest.raises(ImageError, match=says):
        open_image(tmp_path / "foreign", cache=tmp_path / "cache2")


def test_bad_references_are_one_sentence_each(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(ImageError, match=rf"^image {tmp_path}/nope does not exist$"):
        open_image(tmp_path / "nope", cache=cache)
    with pytest.raises(ImageError, match=r"image python:3.11 is not a file or folder here, (and neither "
                                         r"podman nor docker is installed|nor an image podman)"):
        open_image("python:3.11", cache=cache)  # (test_image_stores.py: each case)
    (tmp_path / "folder").mkdir()
    with pytest.raises(ImageError, match="is not an image: it has no index.json"):
        open_image(tmp_path / "folder", cache=cache)
    (tmp_path / "junk.tar").write_bytes(b"not a tar at all" * 10)
    with pytest.raises(ImageError, match="is not a readable tar archive"):
        open_image(tmp_path / "junk.tar", cache=cache)
    (tmp_path / "other.tar").write_bytes(Layer([File("x")], gzip=False).tar())
    with pytest.raises(ImageError, match="is not an image"):
        open_image(tmp_path / "other.tar", cache=cache)
    assert not cache.exists()


def test_zstd_layers_are_refused_with_a_sentence_unless_a_module_reads_them(tmp_path: Path) -> None:
    layout = build(tmp_path, "oci-layout", [Layer([File("a")], gzip=False)])
    blob = max((layout / "blobs/sha256").iterdir(), key=lambda p: p.stat().st_size)
    fake = blob.read_bytes()
    blob.write_bytes(b"\x28\xb5\x2f\xfd" + fake[4:])  # a zstd frame's magic
    try:
        import compression.zstd  # noqa: F401
    except ImportError:
        try:
            import zstandard  # noqa: F401
        except ImportError:
            with pytest.raises(ImageError, match="zstd-compressed layers, which need Python 3.14"):
                open_image(layout, cache=tmp_path / "cache")
            return
    with pytest.raises(ImageError):
        open_image(layout, cache=tmp_path / "cache")


# -- running a command in an image -----------------------------------------------------------------------

def test_bwrap_argv_shares_the_network_only_when_asked_and_merges_env(tmp_path: Path) -> None:
    image = images.Image("x", "sha256:" + "0" * 64, tmp_path / "rootfs",
                         images.ImageConfig(env=("PATH=/bin", "LANG=C"), working_dir="/srv/app"))
    argv = bwrap_argv(image, ["sh"], tmp_path / "w", env={"LANG": "C.UTF-8", "X": "1"})
    assert "--share-net" not in argv and "--unshare-all" in argv and argv[-2:] == ["--", "sh"]
    assert argv[argv.index("--ro-bind") + 1: argv.index("--ro-bind") + 3] == [str(tmp_path / "rootfs"), "/"]
    assert argv[argv.index("--bind") + 1: argv.index("--bind") + 3] == [str(tmp_path / "w"), "/srv/app"]
    env = {argv[i + 1]: argv[i + 2] for i, a in enumerate(argv) if a == "--setenv"}
    assert env == {"PATH": "/bin", "LANG": "C.UTF-8", "X": "1"} and "--clearenv" in argv
    assert "--share-net" in bwrap_argv(image, ["sh"], tmp_path / "w", share_net=True)
    assert bwrap_argv(image, ["sh"], tmp_path / "w", at="/elsewhere")[-3] != "/srv/app"


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install "
                    "bubblewrap)")
@pytest.mark.skipif(busybox_root() is None, reason="busybox-static is not unpacked under build/ "
                    "(scripts/setup.sh fetches it)")
def test_a_command_runs_in_the_image_and_each_attempt_writes_only_its_own_folder(tmp_path: Path) -> None:
    layers = [Layer(busybox_layer()), Layer([Dir("work"), File("work/seed.txt", b"from the image\n")])]
    image = open_image(build(tmp_path, "oci-layout", layers, Config(env=["PATH=/bin", "FOO=image"])),
                       cache=tmp_path / "cache")
    script = ("cat /etc/os-release; test -e /usr/bin/python3 || echo no-host-python; cat seed.txt; "
              "ls written.txt 2>/dev/null; echo $FOO $BAR; id -u; pwd; echo mine > written.txt; "
              "touch /escape 2>/dev/null || echo root-read-only")
    outputs = []
    for attempt in ("1", "2"):
        folder = fresh_workdir(image, tmp_path / "attempts" / attempt)
        argv = bwrap_argv(image, ["sh", "-c", script], folder, env={"BAR": "given"})
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout)
        assert (folder / "written.txt").read_text() == "mine\n"
    assert outputs[0] == outputs[1] == ('ID=lgt-test\nPRETTY_NAME="lgt test image"\nno-host-python\n'
                                        "from the image\nimage given\n1000\n/work\nroot-read-only\n")
    assert not (image.root / "work" / "written.txt").exists() and not (image.root / "escape").exists()
