"""What running in a container image costs: the first unpack, a cached resolve, and a command's start in
the image next to the bare sandbox's shape; with ``--rollouts``, whole rollouts through the rollout
controller in an image (``agent.image``) next to the bare sandbox.

    .venv-proxy/bin/python bench/images.py            # ~10 s; needs bwrap and scripts/setup.sh's busybox
    .venv-proxy/bin/python bench/images.py --n 50 --mb 24
    .venv/bin/python bench/images.py --rollouts 40    # + rollouts through the controller (~1 min)

The image: Debian's busybox-static, then three gzip layers of synthetic files (``--mb`` in all, a
third each, the last one deleting a folder of the second by a whiteout) and a working folder ``/work``
holding a small checkout (200 files, ~800 kB). Each figure is the median of ``--n`` tries:

- first unpack: :func:`open_image` into an empty cache (read, digests checked, layers extracted, the
  root assembled);
- cached resolve: :func:`open_image` again (manifest and config read, the root found);
- when podman is installed: the same image in a private podman store, named ``containers-storage:NAME``
  — the first open (the id asked, the image saved to an archive, unpacked, the archive deleted) and a
  cached one (the id asked, the root found), next to the layout's;
- start: ``busybox true`` under bubblewrap in the image (``bwrap_argv``) and under bubblewrap over the
  host's system folders, read-only, with the same busybox bound in (the bare sandbox's shape), one
  after the other; then the image's with the attempt's own copy of ``/work`` made first
  (``fresh_workdir``), as each attempt would. Goal: ≤ +50 ms at the median once unpacked.
- disk: the cache's size against the layers' (root files are hard links into the layers), and an
  attempt's own folder.
- ``--rollouts N`` (the trainer's environment): N rollouts, one at a time, of an agent that prints its
  reward (``sh -c 'echo 1.0'``) through the real rollout controller and a real lgt-proxy — in the image
  (the image runner: forked from the zygote, the image's root pivoted into, the attempt's copy of
  ``/work``, the CA bound) and in the bare sandbox (``agent.sandbox: bwrap``, the host's system
  folders); launch to recorded result, median and the difference. This is the goal's figure: an
  attempt's start in an image ≤ +50 ms at the median once unpacked.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lgt.testing.images import (
    Config,
    Dir,
    File,
    Layer,
    Whiteout,
    busybox_layer,
    busybox_root,
    bwrap_argv,
    podman_store,
    write_oci_layout,
)
from lgt.trainer.rollout.images import fresh_workdir, open_image

SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt")


def disk(path: Path) -> int:
    """Bytes on disk under ``path`` (files, folders, links), each inode once."""
    seen, total = set(), 0
    for here, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            st = os.lstat(Path(here) / name)
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_blocks * 512
    return total


def image_layers(mb: int) -> list[Layer]:
    per = mb * 2**20 // 3
    synthetic = [Layer([Dir(f"data{i}"), *[File(f"data{i}/f{j}", os.urandom(per // 50)) for j in range(50)]])
                 for i in range(3)]
    synthetic[2] = Layer([*synthetic[2].members, Whiteout("data1")])
    sources = [File(f"work/src/m{j}.py", os.urandom(2000).hex().encode()) for j in range(200)]
    checkout = Layer([Dir("work"), Dir("work/src"), *sources])
    return [Layer(busybox_layer()), *synthetic, checkout]


def host_argv(busybox: Path, workdir: Path) -> list[str]:
    args = ["bwrap", "--unshare-all", "--unshare-user", "--uid", "1000", "--gid", "1000", "--die-with-parent",
            "--hostname", "lgt-sandbox"]
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    return [*args, "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--dir", "/lgt",
            "--ro-bind", str(busybox), "/lgt/busybox", "--bind", str(workdir), "/work", "--chdir", "/work",
            "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--", "/lgt/busybox", "true"]


def ms(f) -> float:
    t = time.perf_counter()
    f()
    return (time.perf_counter() - t) * 1000


def run(argv: list[str]) -> None:
    subprocess.run(argv, check=True, stdin=subprocess.DEVNULL)


def rollout_times(layout: Path, n: int, tmp: Path) -> tuple[list[float], list[float]]:
    """Seconds per rollout, launch to recorded result, in the image and in the bare sandbox (the same
    agent, one rollout at a time through one controller each, the first three left out)."""
    import asyncio

    from lgt.testing.proxy import ProxyProc
    from lgt.testing.rollouts import endpoint
    from lgt.trainer.rollout.agent import AgentSpec
    from lgt.trainer.rollout.controller import RolloutController

    proxy = ProxyProc(tmp / "store").start()
    try:
        specs = {"image": AgentSpec(command=("sh", "-c", "echo 1.0"), image=str(layout), retries=0),
                 "bare": AgentSpec(command=("/bin/sh", "-c", "echo 1.0"), retries=0)}
        out: dict[str, list[float]] = {}
        for name, spec in specs.items():
            ctl = RolloutController(spec, endpoint(proxy), proxy.store, tmp / f"run-{name}", 1)

            async def each(name=name, ctl=ctl) -> list[float]:
                took = []
                try:
                    for i in range(n + 3):
                        t = time.perf_counter()
                        r = await ctl.run({"task_id": "t"}, f"{name}-{i}")
                        took.append(time.perf_counter() - t)
                        if r.reward != 1.0:
                            raise SystemExit(f"a {name} rollout failed: {r.status} {r.error}")
                finally:
                    await ctl.aclose()
                return took[3:]
            out[name] = asyncio.run(each())
        return out["image"], out["bare"]
    finally:
        proxy.stop()


def store_times(tmp: Path, first: int, n: int) -> tuple[list[float], list[float]]:
    """The layout loaded into a private podman store: ms to open it by name into an empty cache (``first``
    tries) and into a warm one (``n``)."""
    with podman_store(tmp / "podman") as env:
        os.environ.update(env)
        try:
            subprocess.run(["podman", "pull", "-q", f"oci:{tmp / 'layout'}"], check=True, capture_output=True)
            ids = subprocess.run(["podman", "images", "-q"], check=True, capture_output=True, text=True)
            subprocess.run(["podman", "tag", ids.stdout.split()[0], "lgt-bench/image:1"], check=True)
            ref = "containers-storage:lgt-bench/image:1"
            cold = [ms(lambda i=i: open_image(ref, cache=tmp / f"stored{i}")) for i in range(first)]
            warm = [ms(lambda: open_image(ref, cache=tmp / "stored0")) for _ in range(n)]
        finally:
            for k in env:
                os.environ.pop(k, None)
    return cold, warm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=30, help="tries per figure (median)")
    ap.add_argument("--mb", type=int, default=12, help="synthetic megabytes in the three layers")
    ap.add_argument("--rollouts", type=int, default=0,
                    help="rollouts through the controller, in the image and bare (the trainer's environment)")
    args = ap.parse_args()
    if shutil.which("bwrap") is None or busybox_root() is None:
        sys.exit("bench/images.py needs bwrap and busybox-static (scripts/setup.sh)")
    busybox = busybox_root() / "bin" / "busybox"
    with tempfile.TemporaryDirectory(prefix="lgt-images-") as d:
        tmp = Path(d)
        write_oci_layout(tmp / "layout", image_layers(args.mb), Config(env=["PATH=/bin"]))
        unpack = []
        for i in range(max(3, args.n // 6)):
            unpack.append(ms(lambda i=i: open_image(tmp / "layout", cache=tmp / f"cache{i}")))
        cache = tmp / "cache0"
        resolve = [ms(lambda: open_image(tmp / "layout", cache=cache)) for _ in range(args.n)]
        stored = store_times(tmp, max(3, args.n // 6), args.n) if shutil.which("podman") else None
        image = open_image(tmp / "layout", cache=cache)
        empty = tmp / "empty"
        empty.mkdir()
        host, inside, attempt = [], [], []
        for i in range(args.n + 3):
            h = ms(lambda: run(host_argv(busybox, empty)))
            g = ms(lambda: run(bwrap_argv(image, ["busybox", "true"], empty)))

            def whole(i=i) -> None:
                folder = fresh_workdir(image, tmp / "attempts" / str(i))
                run(bwrap_argv(image, ["busybox", "true"], folder))
            a = ms(whole)
            if i >= 3:  # the first ones warm the page cache
                host.append(h), inside.append(g), attempt.append(a)
        layers = disk(cache / "layers")
        total = disk(cache)
        per_attempt = disk(tmp / "attempts" / "3")
        if args.rollouts:
            os.environ["LGT_IMAGE_CACHE"] = str(cache)
            in_image, bare = rollout_times(tmp / "layout", args.rollouts, tmp)
    med = statistics.median
    print(f"image: busybox-static + {args.mb} MB in 3 gzip layers + a 200-file /work; median of {args.n}\n")
    print("| figure | ms |\n| --- | ---: |")
    print(f"| first unpack (empty cache, {len(unpack)} tries) | {med(unpack):.0f} |")
    print(f"| cached resolve | {med(resolve):.1f} |")
    if stored is not None:
        print(f"| by name in podman's store: first open (saved, unpacked, archive deleted) | "
              f"{med(stored[0]):.0f} ({med(stored[0]) / med(unpack):.2f}x the layout's) |")
        print(f"| by name in podman's store: cached (the store asked for the id) | {med(stored[1]):.1f} |")
    print("\n| start of `busybox true` | median ms | vs bare |\n| --- | ---: | ---: |")
    print(f"| bwrap over the host's system folders (bare sandbox's shape) | {med(host):.1f} | |")
    print(f"| bwrap in the image | {med(inside):.1f} | {med(inside) / med(host):.2f}x, "
          f"{med(inside) - med(host):+.1f} ms |")
    print(f"| bwrap in the image, the attempt's /work copied first | {med(attempt):.1f} | "
          f"{med(attempt) / med(host):.2f}x, {med(attempt) - med(host):+.1f} ms |")
    print(f"\ndisk: cache {total / 2**20:.1f} MiB (layers {layers / 2**20:.1f} MiB; the root adds "
          f"{(total - layers) / 2**20:.2f} MiB of folders and links), an attempt's /work "
          f"{per_attempt / 2**10:.0f} KiB")
    if args.rollouts:
        a, b = med(in_image) * 1e3, med(bare) * 1e3
        print(f"\n| a rollout through the controller and lgt-proxy, launch to result ({args.rollouts}) "
              f"| median ms | p90 ms |\n| --- | ---: | ---: |")
        p90 = {k: statistics.quantiles(v, n=10)[-1] * 1e3 for k, v in (("image", in_image), ("bare", bare))}
        print(f"| bare sandbox (agent.sandbox: bwrap) | {b:.1f} | {p90['bare']:.1f} |")
        print(f"| in the image (agent.image) | {a:.1f} | {p90['image']:.1f} |")
        print(f"\ngoal  an attempt in an image at most +50 ms over the bare sandbox (median): "
              f"{a - b:+.1f} ms ({a / b:.2f}x)  {'PASS' if a - b <= 50 else 'MISS'}")


if __name__ == "__main__":
    main()
