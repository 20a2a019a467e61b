"""Build one container image per task of examples/swe_images from Debian's packages: no daemon, no
registry, no root.

    python3 examples/swe_images/build_images.py [--out build/swe_images] [--debs build/debs]
                                                 [--only INSTANCE_ID ...] [--no-agent]

1. The base: the dependency closure of BASE_PACKAGES (``apt-cache depends --recurse``, no recommends),
   each .deb fetched once with ``apt-get download`` into ``--debs`` and unpacked with ``dpkg-deb -x``
   (no maintainer scripts: what their postinst would make — /bin/sh, /usr/bin/python3, /etc/passwd — is
   made here), documentation dropped, Python's modules compiled once (unchecked-hash .pyc: an image's
   root is read-only and its files' times are not kept) by the image's own python3 under bubblewrap.
2. The agent (unless ``--no-agent``): mini-swe-agent's wheels for the image's Python 3.11, installed by the
   host's pip into /opt/mini-swe-agent/lib with ``agent.py`` beside it — a layer of its own, shared.
3. Per task (``repos.py``): the Debian packages its repository needs beyond the base (its own
   dependencies, in its image only) and the repository at /testbed, a git repository at its base commit.
   Each image is an OCI image layout ``OUT/<instance_id>``: base + agent + task layers (uncompressed
   tars; the layers' blobs are stored once in ``OUT/.blobs`` and hard-linked into each layout).
4. ``instances.jsonl`` beside this script: the tasks as SWE-bench instances (the hidden tests as the
   test patch, the fix as ``patch``), for ``lgt-train tasks swebench … --image-dir OUT``.

A layer is rebuilt only when what it is made of changed (its key: the .deb files, the repository's
text, the agent's requirements and this script); an image whose layers did not change is left
as it is. Needs apt-get, apt-cache, dpkg-deb, git and bwrap (Debian's or Ubuntu's; package lists
present: ``apt-get update``) and, for the agent, pip. Exit code 3: Debian's packages cannot be had here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from repos import REPOS, Repo

HERE = Path(__file__).resolve().parent
BASE_PACKAGES = ("python3", "python3-pytest", "git", "dash", "bash", "coreutils", "sed", "grep", "patch",
                 "findutils", "diffutils", "tar", "gzip", "mawk", "libstdc++6")
# the other providers of a virtual package the closure has one of (awk: mawk; debconf-2.0: debconf), and
# what only they need
NOT_WANTED = {"gawk", "original-awk", "cdebconf", "libdebian-installer4", "libnewt0.52", "libslang2",
              "libtextwrap1"}
DROP = ("usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale", "usr/share/lintian",
        "usr/share/bug", "usr/share/bash-completion", "usr/share/gitweb")
AGENT = "mini-swe-agent==2.4.6"  # installed without its dependencies: agent-requirements.txt names those
AGENT_REQUIREMENTS = HERE / "agent-requirements.txt"
AGENT_DIR = "opt/mini-swe-agent"
WORKDIR = "/testbed"
ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8",
       "PYTHONDONTWRITEBYTECODE=1"]
GIT_ENV = {"GIT_AUTHOR_NAME": "acme", "GIT_AUTHOR_EMAIL": "dev@acme.invalid", "GIT_COMMITTER_NAME": "acme",
           "GIT_COMMITTER_EMAIL": "dev@acme.invalid", "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+00:00",
           "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+00:00", "GIT_CONFIG_NOSYSTEM": "1",
           "HOME": "/nonexistent"}
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"


class BuildError(RuntimeError):
    """What stops the build: one sentence."""


class NoPackages(BuildError):
    """Debian's packages cannot be had here (no apt, no package lists, no network): exit code 3."""


def run(argv: list[str], **kw) -> str:
    try:
        done = subprocess.run(argv, check=True, capture_output=True, text=True, **kw)
    except FileNotFoundError:
        error = NoPackages if argv[0].startswith(("apt", "dpkg")) else BuildError
        raise error(f"{argv[0]} is not installed here (this script needs apt-get, apt-cache, dpkg-deb, "
                    "git and bwrap: a Debian or Ubuntu machine)") from None
    except subprocess.CalledProcessError as e:
        tail = (e.stderr or e.stdout or "").strip().splitlines()[-3:]
        raise BuildError(f"{' '.join(argv[:3])} … failed: {' / '.join(tail)}") from None
    return done.stdout


# -- Debian's packages ---------------------------------------------------------------------------------------

def closure(packages: list[str]) -> list[str]:
    """The packages ``packages`` need, recursively: Depends and Pre-Depends only."""
    try:
        out = run(["apt-cache", "depends", "--recurse", "--no-recommends", "--no-suggests", "--no-conflicts",
                   "--no-breaks", "--no-replaces", "--no-enhances", *packages])
    except NoPackages:
        raise
    except BuildError as e:
        raise NoPackages(f"{e} (run apt-get update)") from None
    names = {line.strip() for line in out.splitlines() if line and not line[0].isspace()}
    return sorted(n for n in names if not n.startswith("<") and ":" not in n and n not in NOT_WANTED)


def deb_files(packages: list[str], debs: Path) -> list[Path]:
    """Each package's candidate .deb in ``debs``, downloaded with apt-get when it is not there yet."""
    try:
        shown = run(["apt-cache", "show", "--no-all-versions", *packages])
    except NoPackages:
        raise
    except BuildError as e:
        raise NoPackages(f"{e} (run apt-get update)") from None
    wanted: dict[str, Path] = {}
    for stanza in shown.split("\n\n"):
        fields = dict(re.findall(r"^([A-Za-z-]+): (.*)$", stanza, re.M))
        if "Package" in fields:
            version = fields["Version"].replace(":", "%3a")
            wanted[fields["Package"]] = debs / f"{fields['Package']}_{version}_{fields['Architecture']}.deb"
    if set(wanted) != set(packages):
        raise NoPackages(f"apt-cache knows no candidate for {', '.join(sorted(set(packages) - set(wanted)))} "
                         "(run apt-get update)")
    missing = sorted(p for p, f in wanted.items() if not f.is_file())
    if missing:
        debs.mkdir(parents=True, exist_ok=True)
        print(f"downloading {len(missing)} .debs into {debs}: {' '.join(missing)}", flush=True)
        try:
            run(["apt-get", "download", "-q", *missing], cwd=debs)
        except BuildError as e:
            raise NoPackages(str(e)) from None
        absent = [p for p in missing if not wanted[p].is_file()]
        if absent:
            raise BuildError(f"apt-get download did not leave {', '.join(wanted[p].name for p in absent)}")
    return [wanted[p] for p in sorted(wanted)]


def unpack(debs: list[Path], root: Path) -> None:
    for deb in debs:
        run(["dpkg-deb", "-x", str(deb), str(root)])


def finish_base(root: Path) -> None:
    """What the maintainer scripts that did not run would have made, and the documentation dropped."""
    links = {"bin/sh": "dash", "usr/bin/python3": "python3.11", "usr/bin/python": "python3",
             "usr/bin/awk": "mawk", "usr/bin/pytest": "pytest-3"}
    for path, target in links.items():
        p = root / path
        if not p.exists() and not p.is_symlink() and (p.parent / target).exists():
            p.symlink_to(target)
    etc = root / "etc"
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:"
                                "/usr/sbin/nologin\nagent:x:1000:1000:agent:/tmp:/bin/bash\n")
    (etc / "group").write_text("root:x:0:\nnogroup:x:65534:\nagent:x:1000:\n")
    # the repository belongs to whoever runs the image (uid 1000 in lgt's sandbox): trust it all the same
    (etc / "gitconfig").write_text("[safe]\n\tdirectory = *\n[init]\n\tdefaultBranch = main\n")
    # mount points: bubblewrap's, and /lgt/eval for the evaluator a runner binds in (a root is read-only)
    for d in ("tmp", "root", "proc", "dev", "lgt/eval", WORKDIR.lstrip("/")):
        (root / d).mkdir(parents=True, exist_ok=True)
    for d in DROP:
        shutil.rmtree(root / d, ignore_errors=True)


def compile_python(root: Path, *folders: str, binds: tuple[tuple[Path, str], ...] = ()) -> None:
    """Python's .pyc for ``folders``, written by the image's own python3 (so its magic matches) as
    unchecked-hash files: valid whatever times the files get when an image is unpacked."""
    argv = ["bwrap", "--bind", str(root), "/", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    for src, dest in binds:
        argv += ["--bind", str(src), dest]
    argv += ["--unshare-all", "--die-with-parent", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--",
             "python3", "-m", "compileall", "-q", "-q", "-j", "0", "--invalidation-mode", "unchecked-hash",
             *folders]
    try:
        done = subprocess.run(argv, check=False, capture_output=True, text=True)
    except FileNotFoundError:
        raise BuildError("bwrap is not installed here (apt-get install bubblewrap)") from None
    if done.returncode != 0 and done.stderr.startswith("bwrap:"):  # not compileall's: a file it skipped
        raise BuildError(f"bubblewrap could not run the image's python3 ({done.stderr.strip()})")


# -- layers and images --------------------------------------------------------------------------------------

class _Hashing:
    def __init__(self, f) -> None:
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.f.write(data)


def write_layer(tree: Path, blobs: Path) -> dict:
    """``tree`` as an uncompressed layer tar in ``blobs``; its descriptor. Owners are root, modes and hard
    links kept, names in sorted order."""
    (blobs / "sha256").mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=blobs, prefix=".layer-")
    with open(fd, "wb") as f:
        out = _Hashing(f)
        with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
            for here, dirs, files in os.walk(tree):
                dirs.sort()
                for name in sorted(dirs) + sorted(files):
                    path = Path(here) / name
                    info = tar.gettarinfo(str(path), str(path.relative_to(tree)))
                    if not (info.isfile() or info.isdir() or info.issym() or info.islnk()):
                        continue
                    info.uid = info.gid = 0
                    info.uname = info.gname = "root"
                    if info.isfile():
                        with open(path, "rb") as data:
                            tar.addfile(info, data)
                    else:
                        tar.addfile(info)
    digest = "sha256:" + out.sha.hexdigest()
    os.replace(tmp, blobs / "sha256" / digest.removeprefix("sha256:"))
    return {"mediaType": OCI_LAYER, "digest": digest, "size": out.size}


def key_of(*parts: object) -> str:
    h = hashlib.sha256(Path(__file__).read_bytes())  # this script changed: every layer is rebuilt
    for p in parts:
        h.update(b"\0" + (p.read_bytes() if isinstance(p, Path) else str(p).encode()))
    return h.hexdigest()[:16]


def cached_layer(out: Path, name: str, key: str, build) -> tuple[dict, bool]:
    """The layer ``name`` for ``key``: reused from ``out/.layers`` when its blob is there, else built by
    ``build(tree)`` in a fresh folder and written. (descriptor, built now)."""
    record = out / ".layers" / f"{name}-{key}.json"
    if record.is_file():
        desc = json.loads(record.read_text())
        if (out / ".blobs" / "sha256" / desc["digest"].removeprefix("sha256:")).is_file():
            return desc, False
    record.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".build-") as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        build(tree)
        desc = write_layer(tree, out / ".blobs")
    record.write_text(json.dumps(desc))
    for old in record.parent.glob(f"{name}-*.json"):  # an older build of this layer, and its blob
        if old != record:
            stale = json.loads(old.read_text())["digest"].removeprefix("sha256:")
            old.unlink()
            if stale != desc["digest"].removeprefix("sha256:"):
                (out / ".blobs" / "sha256" / stale).unlink(missing_ok=True)
    return desc, True


def write_image(out: Path, name: str, layers: list[dict]) -> bool:
    """An OCI image layout ``out/name`` of ``layers``; False when it is there already, unchanged."""
    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "config": {"Env": ENV, "WorkingDir": WORKDIR, "Cmd": ["/bin/bash"]},
                         "rootfs": {"type": "layers", "diff_ids": [d["digest"] for d in layers]}},
                        sort_keys=True).encode()
    config_desc = {"mediaType": OCI_CONFIG, "digest": "sha256:" + hashlib.sha256(config).hexdigest(),
                   "size": len(config)}
    manifest = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": config_desc,
                           "layers": layers}, sort_keys=True).encode()
    manifest_desc = {"mediaType": OCI_MANIFEST, "digest": "sha256:" + hashlib.sha256(manifest).hexdigest(),
                     "size": len(manifest), "annotations": {"org.opencontainers.image.ref.name": name}}
    index = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                        "manifests": [manifest_desc]}, sort_keys=True)
    layout = out / name
    if (layout / "index.json").is_file() and (layout / "index.json").read_text() == index:
        return False
    tmp = Path(tempfile.mkdtemp(dir=out, prefix=f".{name}-"))
    blobs = tmp / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    for d in layers:
        hexd = d["digest"].removeprefix("sha256:")
        src = out / ".blobs" / "sha256" / hexd
        try:
            os.link(src, blobs / hexd)
        except OSError:
            shutil.copyfile(src, blobs / hexd)
    for data, desc in ((config, config_desc), (manifest, manifest_desc)):
        (blobs / desc["digest"].removeprefix("sha256:")).write_bytes(data)
    (tmp / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    (tmp / "index.json").write_text(index)
    if layout.exists():
        shutil.rmtree(layout)
    os.replace(tmp, layout)
    return True


# -- the tasks' repositories -------------------------------------------------------------------------------

def git(repo: Path, *args: str) -> str:
    return run(["git", "-c", "init.defaultBranch=main", *args], cwd=repo, env={**os.environ, **GIT_ENV})


def write_files(repo: Path, files: dict[str, str]) -> None:
    for path, text in files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)


def make_repo(spec: Repo, repo: Path) -> dict:
    """The repository at its base commit in ``repo`` (clean), and its SWE-bench instance."""
    repo.mkdir(parents=True)
    git(repo, "init", "-q")
    write_files(repo, spec.files)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", f"{spec.repo}: as released")
    base = git(repo, "rev-parse", "HEAD").strip()
    patches = {}
    for kind, files in (("test_patch", spec.tests), ("patch", spec.fix)):
        write_files(repo, files)
        patches[kind] = git(repo, "diff")
        git(repo, "checkout", "-q", "--", ".")
    return {"instance_id": spec.instance_id, "repo": spec.repo, "base_commit": base,
            "problem_statement": spec.problem_statement, "test_patch": patches["test_patch"],
            "patch": patches["patch"], "FAIL_TO_PASS": list(spec.fail_to_pass),
            "PASS_TO_PASS": list(spec.pass_to_pass), "image_name": f"lgt-example/{spec.instance_id}:latest",
            "version": "1.0"}


def agent_layer(tree: Path, base_root: Path) -> None:
    """mini-swe-agent and its wheels for the image's Python 3.11 in /opt/mini-swe-agent/lib, agent.py
    beside them."""
    lib = tree / AGENT_DIR / "lib"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-compile", "--no-warn-script-location",
           "--target", str(lib), "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
           "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_28_x86_64",
           "--only-binary=:all:"]
    print(f"installing {AGENT} and its wheels for Python 3.11 (pip)", flush=True)
    run([*pip, "--no-deps", AGENT])
    run([*pip, "-r", str(AGENT_REQUIREMENTS)])
    shutil.copyfile(HERE / "agent.py", tree / AGENT_DIR / "agent.py")
    shutil.rmtree(lib / "bin", ignore_errors=True)
    compile_python(base_root, f"/{AGENT_DIR}", binds=((tree / AGENT_DIR, f"/{AGENT_DIR}"),))


# -- the build -----------------------------------------------------------------------------------------------

def build(out: Path, debs: Path, only: list[str], agent: bool, instances_path: Path | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    specs = [r for r in REPOS if not only or r.instance_id in only]
    unknown = set(only) - {r.instance_id for r in REPOS}
    if unknown:
        raise BuildError(f"no task {', '.join(sorted(unknown))} (the tasks: "
                         f"{', '.join(r.instance_id for r in REPOS)})")
    base_names = closure(list(BASE_PACKAGES))
    base_debs = deb_files(base_names, debs)
    used = len(base_debs)
    base_key = key_of(*[d.name for d in base_debs], json.dumps(DROP))
    base_root = out / ".rootfs" / f"base-{base_key}"  # kept: the agent layer's .pyc are compiled in it

    def make_base(tree: Path) -> None:
        unpack(base_debs, tree)
        finish_base(tree)
        compile_python(tree, "/usr/lib/python3.11", "/usr/lib/python3/dist-packages")
        shutil.rmtree(out / ".rootfs", ignore_errors=True)  # an older base's
        base_root.parent.mkdir(parents=True)
        shutil.copytree(tree, base_root, symlinks=True)

    print(f"base: {len(base_names)} packages ({', '.join(BASE_PACKAGES)} and what they need), "
          f".debs in {debs}", flush=True)
    base, built = cached_layer(out, "base", base_key, make_base)
    if not base_root.is_dir():
        base_root.mkdir(parents=True)
        unpack(base_debs, base_root)
        finish_base(base_root)
    print(f"  layer {base['digest'][:19]} {base['size'] / 2**20:.0f} MiB "
          f"({'built' if built else 'reused'})", flush=True)
    layers = [base]
    if agent:
        agent_key = key_of(AGENT, AGENT_REQUIREMENTS, HERE / "agent.py", base_key)
        desc, built = cached_layer(out, "agent", agent_key, lambda tree: agent_layer(tree, base_root))
        print(f"agent: mini-swe-agent at /{AGENT_DIR} layer {desc['digest'][:19]} "
              f"{desc['size'] / 2**20:.0f} MiB ({'built' if built else 'reused'})", flush=True)
        layers.append(desc)
    # every task's instance, its image built or not (the file is always whole); the commit is the one in
    # the image, the dates being fixed
    instances = {}
    for spec in REPOS:
        with tempfile.TemporaryDirectory(dir=out, prefix=".repo-") as tmp:
            instances[spec.instance_id] = make_repo(spec, Path(tmp) / "repo")
    base_set = set(base_names)
    for spec in specs:
        own = [p for p in closure(list(spec.packages)) if p not in base_set]
        own_debs = deb_files(own, debs) if own else []
        used += len(own_debs)

        def make_task(tree: Path, spec: Repo = spec, own_debs: list[Path] = own_debs) -> None:
            unpack(own_debs, tree)
            for d in DROP:
                shutil.rmtree(tree / d, ignore_errors=True)
            if (tree / "usr/lib/python3/dist-packages").is_dir():
                compile_python(base_root, "/usr/lib/python3/dist-packages", binds=(
                    (tree / "usr/lib/python3/dist-packages", "/usr/lib/python3/dist-packages"),))
            make_repo(spec, tree / WORKDIR.lstrip("/"))

        instance = instances[spec.instance_id]
        task_key = key_of(*[d.name for d in own_debs], json.dumps(instance, sort_keys=True))
        desc, built = cached_layer(out, f"task-{spec.instance_id}", task_key, make_task)
        changed = write_image(out, spec.instance_id, [*layers, desc])
        print(f"{spec.instance_id}: {out / spec.instance_id} ({'written' if changed else 'unchanged'}; "
              f"its own packages: {', '.join(own) or 'none'})", flush=True)
    print(f".debs: {used} used from {debs}", flush=True)
    if instances_path is not None:
        instances_path.write_text("".join(json.dumps(i, sort_keys=True) + "\n" for i in instances.values()))
        print(f"instances: {instances_path}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("build/swe_images"),
                        help="where the images go, one OCI layout per task (default build/swe_images)")
    parser.add_argument("--debs", type=Path, default=Path("build/debs"),
                        help="the downloaded .debs, reused by later builds (default build/debs)")
    parser.add_argument("--only", nargs="+", default=[], metavar="INSTANCE_ID",
                        help="build these tasks' images only (the instances file names every task)")
    parser.add_argument("--no-agent", dest="agent", action="store_false",
                        help="leave mini-swe-agent's layer out (the images then only run the tests)")
    parser.add_argument("--instances", type=Path, default=HERE / "instances.jsonl",
                        help="where the SWE-bench instances go (default: beside this script)")
    args = parser.parse_args()
    try:
        build(args.out.resolve(), args.debs.resolve(), args.only, args.agent, args.instances)
    except BuildError as e:
        print(f"build_images: {e}", file=sys.stderr)
        raise SystemExit(3 if isinstance(e, NoPackages) else 1) from None


if __name__ == "__main__":
    main()
