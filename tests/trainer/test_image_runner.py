"""The local runner in a container image (agent.image): real bubblewrap, real images built here by
lgt.testing.images, the real rollout controller and a real lgt-proxy in front of a fake upstream.

Two images: busybox alone (Debian's busybox-static, for shell agents and graders), and busybox with the
host's python3, the shared libraries it loads and its standard library (for the hostile agent of
test_sandbox.py, whose attacks must fail in an image as they do outside)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from lgt.testing.images import (
    Config,
    Dir,
    File,
    Layer,
    Symlink,
    busybox_layer,
    busybox_root,
    podman_store,
    python_layer,
    python_root,
    write_docker_archive,
    write_oci_layout,
)
from lgt.testing.rollouts import AGENTS, endpoint, run_all, running_with
from lgt.trainer.rollout import images
from lgt.trainer.rollout import sandbox as sandboxing
from lgt.trainer.rollout.agent import AgentSpec, RolloutError
from lgt.trainer.rollout.controller import RolloutController
from lgt.trainer.rollout.runners import check_agent, runner_class
from lgt.trainer.rollout.runners.image import CA_STORES, ImageRunner, check_task_images
from lgt.trainer.rollout.sandbox import SandboxSpec

pytestmark = [pytest.mark.skipif(busybox_root() is None or python_root() is None,
                                 reason="busybox-static is not unpacked under build/ (scripts/setup.sh "
                                        "fetches it), or there is no Debian python3 to build an image from"),
              pytest.mark.usefixtures("image_cache")]  # conftest.py: this module's own cache of images

SEED = [Dir("work"), File("work/seed.txt", b"from the image\n"), Dir("work/src"),
        File("work/src/app.txt", b"v1\n")]


@pytest.fixture(scope="module")
def busybox(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("busybox") / "image"
    write_oci_layout(path, [Layer(busybox_layer()), Layer(SEED)], Config(env=["PATH=/bin", "FROM_IMAGE=yes"]))
    return path


@pytest.fixture(scope="module")
def python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """busybox + python3 as a docker archive; OpenSSL's default store points at the system one, as
    Debian's openssl package has it (and the image has no /etc/ssl/certs of its own)."""
    path = tmp_path_factory.mktemp("python") / "image.tar"
    ssl = [Dir("usr/lib/ssl"), Symlink("usr/lib/ssl/cert.pem", "/etc/ssl/certs/ca-certificates.crt"),
           Symlink("usr/lib/ssl/certs", "/etc/ssl/certs")]
    write_docker_archive(path, [Layer(busybox_layer()), Layer(python_layer() + ssl), Layer(SEED)],
                         Config(env=["PATH=/usr/bin:/bin"]))
    return path


def spec(image: Path | str, command: tuple[str, ...], **kw: Any) -> AgentSpec:
    kw.setdefault("timeout_s", 60)
    kw.setdefault("retries", 0)
    return AgentSpec(command=command, image=str(image), **kw)


def python_spec(image: Path, script: str = "attacker.py", **kw: Any) -> AgentSpec:
    mounts = {str(AGENTS): "/agents", **kw.pop("mounts", {})}
    return spec(image, ("python3", f"/agents/{script}"), mounts=mounts, **kw)


def run(proxy: Any, tmp_path: Path, agent: AgentSpec, jobs: list[tuple[dict, str]], concurrency: int = 4,
        **kw: Any) -> list[Any]:
    ctl = RolloutController(agent, endpoint(proxy), proxy.store, tmp_path / "run", concurrency, **kw)
    return asyncio.run(run_all(ctl, jobs))


def outcomes(result: Any) -> dict[str, Any]:
    lines = result.stdout_path.read_text().splitlines()
    report = next(json.loads(line) for line in reversed(lines) if line.startswith("{"))
    return report["outcomes"]


def test_an_image_selects_the_image_runner_through_the_registry(busybox):
    assert runner_class(spec(busybox, ("sh", "-c", "true"))) is ImageRunner
    assert runner_class(AgentSpec(command=("sh",), image_field="image")) is ImageRunner
    assert runner_class(AgentSpec(command=("sh",))).__name__ == "SandboxedRunner"


def test_an_agent_in_an_image_reaches_the_model_through_the_proxy_and_trusts_its_ca_from_the_system_store(
        tmp_path, proxy, python):
    jobs = [({"question": "What is 2+3?"}, "img-chat")]
    [r] = run(proxy, tmp_path, python_spec(python, "image_agent.py"), jobs)
    assert r.status == "ok", (r.error, r.stderr_path.read_text())
    assert "model said: The answer is" in r.stdout_path.read_text() and r.reward == 1.0


def test_an_agent_in_an_image_has_no_way_out_but_the_proxy(tmp_path, proxy, upstream, python):
    from urllib.parse import urlsplit

    from tests.trainer.test_sandbox import listening_ports

    ports = listening_ports() - {proxy.port}
    assert proxy.control_port in ports and urlsplit(upstream.url).port in ports
    jobs = [({"attack": "ports", "targets": json.dumps(sorted(ports))}, "inet-ports"), ({"attack": "route"},
                                                                                      "inet-route")]
    r_ports, r_route = run(proxy, tmp_path, python_spec(python), jobs)
    assert [what for what in outcomes(r_ports).values() if what == "CONNECTED"] == []
    assert len(outcomes(r_ports)) == len(ports)
    route = outcomes(r_route)
    assert route["interfaces"] == ["lo"] and route["routes"] == [] and route["routes6"] == []


def test_the_hostile_agents_attacks_fail_in_an_image_as_outside(tmp_path, proxy, python):
    private = proxy.store / "_proxy"
    secrets = [str(p) for p in sorted(private.iterdir()) if p.is_file()]
    targets = [*secrets, str(private) + "/", str(proxy.store) + "/", str(tmp_path / "run") + "/",
               sandboxing.ATTEMPTS + "/", os.environ["LGT_IMAGE_CACHE"] + "/",  # the images' cache
               "/usr/lib/python3/dist-packages/", "/root/", "/home/", "/etc/passwd", "/etc/hostname"]
    marker = f"lgt-image-daemon-{os.getpid()}-{tmp_path.name}"
    limits = SandboxSpec(processes=64, disk_mb=8, tmp_mb=4, memory_mb=256)
    jobs = [({"attack": "read", "targets": json.dumps(targets)}, "i-read"),
            ({"attack": "env", "answer": 42, "question": "6*7?"}, "i-env"),
            ({"attack": "daemon", "targets": json.dumps([marker])}, "i-daemon"),
            ({"attack": "forkbomb"}, "i-fork"),
            ({"attack": "memory", "targets": json.dumps([1 << 30])}, "i-mem"),
            ({"attack": "file", "targets": json.dumps([64])}, "i-file"),
            ({"attack": "tmp", "targets": json.dumps([64])}, "i-tmp"),
            ({"attack": "files", "targets": json.dumps([40])}, "i-files")]
    read, env, daemon, fork, mem, big, tmp, files = run(
        proxy, tmp_path, python_spec(python, sandbox=limits, private=("answer",)), jobs)
    seen = outcomes(read)
    assert not [t for t, what in seen.items() if what.startswith(("READ", "LISTED"))], seen
    seen = outcomes(env)
    assert "TASK_ANSWER" not in seen["environ"] and "answer" not in seen["task_json"]
    assert seen["environ"]["TASK_QUESTION"] == "6*7?" and not [k for k in seen["environ"] if "SECRET" in k]
    assert seen["id"] == sandboxing.AGENT_UID and seen["pid"] == 1 and seen["procs"] == [1]
    assert daemon.status == "ok" and outcomes(daemon)["started"]
    assert running_with(marker) == []  # the daemon ended with its attempt
    assert fork.status == "ok" and outcomes(fork)["error"] == "BlockingIOError" \
        and outcomes(fork)["forked"] < 64
    assert outcomes(mem)["allocated"] == "MemoryError"
    assert outcomes(big)["error"] == "OSError" and outcomes(big)["written_mb"] <= 8
    assert outcomes(tmp)["error"] == "OSError" and outcomes(tmp)["written_mb"] <= 4
    assert files.status == "failed" and "grew past its 8 MB limit" in files.error


# the agent: what it finds, then changes to its tree, then the tree as it leaves it (its last lines)
AGENT = r"""
echo "seen: $(ls -A | tr '\n' ' ')"
echo "env: $FROM_IMAGE $HOME $LGT_WORK_DIR $(pwd)"
test -e left-by-another && echo "LEAKED"
touch /etc/x 2>/dev/null && echo "ROOT WRITABLE"
test -e /lgt/evaluator && echo "SEES THE GRADER"
echo "$TASK_ID" > left-by-another; rm seed.txt; echo v2 > src/app.txt; mkdir -p new/deep
ln -s /etc/os-release new/link; echo "$TASK_ANSWER" > new/deep/answer; echo tmp > /tmp/scratch
echo "$TASK_ID" > "$HOME/notes"
find . | sort; cat src/app.txt
"""
# the grader: the tree it is given, as the agent printed it last; the private answer; then it writes
GRADER = r"""
find . | sort > /tmp/tree; cat src/app.txt >> /tmp/tree
tail -n "$(wc -l < /tmp/tree)" "$2" | cmp -s - /tmp/tree || { echo "tree differs"; exit 0; }
grep -q '"answer": 42' "$1" || { echo "no answer"; exit 0; }
test -e /tmp/scratch && { echo "sees the agent's /tmp"; exit 0; }
test -e "$HOME/notes" && { echo "sees the agent's home"; exit 0; }
echo graded > graded; echo "$TASK_ANSWER"; echo 1
"""


def test_each_attempt_starts_from_the_image_and_the_grader_sees_the_tree_the_agent_left(tmp_path, proxy,
                                                                                        busybox):
    (tmp_path / "grade.sh").write_text(GRADER)
    agent = spec(busybox, ("sh", "-c", AGENT), cwd=tmp_path, private=("answer",),
                 reward_sources=("evaluator",), evaluator=("sh", "grade.sh"))
    jobs = [({"answer": 42}, f"tree-{i}") for i in range(3)]
    results = run(proxy, tmp_path, agent, jobs, concurrency=1)
    for r in results:
        out = r.stdout_path.read_text()
        assert (r.status, r.reward, r.reward_source) == ("ok", 1.0, "evaluator"), (r.error, out)
        assert "seen: seed.txt src" in out and "LEAKED" not in out and "ROOT WRITABLE" not in out
        assert "SEES THE GRADER" not in out
        assert "env: yes /lgt/work /work /work" in out
        assert "42" not in out  # the private field: not in the agent's environment
        assert r.stdout_path.with_suffix(".eval.out").read_text().splitlines()[-2:] == ["42", "1"]
    assert not (tmp_path / "run" / "rollouts" / "work").exists() or \
        list((tmp_path / "run" / "rollouts" / "work").iterdir()) == []  # every attempt's folder removed
    cache = Path(os.environ["LGT_IMAGE_CACHE"])
    assert not list(cache.glob("roots/*/rootfs/work/graded"))
    assert not list(cache.glob("roots/*/rootfs/work/new"))  # the image as it was


def test_an_evaluator_file_named_through_dot_dot_is_bound_into_the_graders_sandbox(tmp_path, proxy, busybox):
    # a run config names lgt's evaluator relative to its folder (../../trainer/rollout/swebench_eval.py):
    # the zygote sees the file by its normalised path only
    (tmp_path / "sub").mkdir()
    (tmp_path / "grade.sh").write_text("echo graded from $0; echo 1\n")
    agent = spec(busybox, ("sh", "-c", "echo 0"), cwd=tmp_path / "sub",
                 reward_sources=("evaluator",), evaluator=("sh", "../sub/../grade.sh"))
    [r] = run(proxy, tmp_path, agent, [({}, "dotdot-0")])
    assert (r.status, r.reward, r.reward_source) == ("ok", 1.0, "evaluator"), r.error
    assert "graded from /lgt/evaluator/0/grade.sh" in r.stdout_path.with_suffix(".eval.out").read_text()


def test_the_proxys_ca_is_the_images_system_store_and_host_files_are_mounted_read_only(tmp_path, proxy,
                                                                                      busybox):
    harness = tmp_path / "harness"
    harness.mkdir()
    (harness / "run").write_text("#!/bin/sh\necho harness ran\n")
    (harness / "run").chmod(0o755)
    checks = "; ".join(f"cmp -s {store} \"$SSL_CERT_FILE\" && echo same {store}" for store in CA_STORES)
    script = (f"/opt/harness/run; {checks}; grep -c BEGIN /etc/ssl/certs/ca-certificates.crt; "
              "echo x > /opt/harness/run 2>/dev/null || echo harness read-only; "
              "echo x > /etc/ssl/cert.pem 2>/dev/null || echo store read-only; "
              "echo $SSL_CERT_FILE $REQUESTS_CA_BUNDLE $NODE_EXTRA_CA_CERTS $CURL_CA_BUNDLE; echo 1")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x").write_text("data under /tmp\n")  # a target in the attempt's own /tmp
    script = "cat /tmp/data/x; " + script
    agent = spec(busybox, ("sh", "-c", script), mounts={str(harness): "/opt/harness", "data": "/tmp/data"},
                 cwd=tmp_path)
    [r] = run(proxy, tmp_path, agent, [({}, "ca-0")])
    out = r.stdout_path.read_text()
    assert r.status == "ok", (r.error, out)
    assert "harness ran" in out and "harness read-only" in out and "store read-only" in out
    assert "data under /tmp" in out
    assert [line for line in out.splitlines() if line.startswith("same ")] == [f"same {s}" for s in CA_STORES]
    ca = "/lgt/work/.lgt/ca.pem"
    assert f"{ca} {ca} {ca} {ca}" in out
    assert (harness / "run").read_text().startswith("#!/bin/sh")


def test_an_image_per_task_and_its_bad_input_in_one_sentence(tmp_path, proxy, busybox, python):
    other = tmp_path / "other"
    write_oci_layout(other, [Layer(busybox_layer()), Layer([Dir("srv"), File("srv/which", b"other\n")])],
                     Config(env=["PATH=/bin"], working_dir="/srv"))
    agent = AgentSpec(command=("sh", "-c", "cat which 2>/dev/null || ls; echo 1"), image=str(busybox),
                      image_field="image", timeout_s=60, retries=0)
    jobs = [({"image": str(other)}, "per-0"), ({}, "per-1"), ({"image": str(tmp_path / "nowhere")}, "per-2")]
    mine, default, missing = run(proxy, tmp_path, agent, jobs)
    assert mine.status == "ok" and "other" in mine.stdout_path.read_text()
    assert default.status == "ok" and "seed.txt" in default.stdout_path.read_text()
    assert missing.status == "failed" and missing.error == (
        f"task (no task_id)'s image: image {tmp_path / 'nowhere'} does not exist")
    # up front, before any attempt: the run's image, the command in it, every task's image
    with pytest.raises(RolloutError, match=r"^agent.image: image .*nowhere does not exist$"):
        check_agent(spec(tmp_path / "nowhere", ("sh",)))
    with pytest.raises(RolloutError, match=r"^the agent command 'python3' is not in image .* \(looked on its "
                                           r"PATH /bin\) nor mounted into it \(agent.mounts\)$"):
        check_agent(spec(busybox, ("python3", "agent.py")))
    check_agent(spec(python, ("python3", "agent.py")))
    with pytest.raises(RolloutError, match=r"^task 'b''s image: image .*nowhere does not exist$"):
        check_task_images(agent, [{"task_id": "a", "image": str(other)},
                                  {"task_id": "b", "image": str(tmp_path / "nowhere")}])
    no_default = AgentSpec(command=("sh",), image_field="image")
    with pytest.raises(RolloutError, match=r"^task 'c' names no image \(its field 'image'\) and agent.image "
                                           r"is not set$"):
        check_task_images(no_default, [{"task_id": "c"}])
    arm = tmp_path / "arm"
    write_oci_layout(arm, [Layer(busybox_layer())], Config(architecture="arm64" if
                                                               images.machine_arch() != "arm64" else "amd64"))
    with pytest.raises(RolloutError, match=r"^agent.image: image .*arm is for linux/\w+; this machine is"):
        check_agent(spec(arm, ("sh",)))
    corrupt = tmp_path / "corrupt.tar"
    corrupt.write_bytes(b"not a tar at all")
    with pytest.raises(RolloutError, match=r"^agent.image: image .*corrupt.tar is not a readable tar"):
        check_agent(spec(corrupt, ("sh",)))
    with pytest.raises(RolloutError, match="needs agent.runner: local and agent.sandbox: bwrap"):
        AgentSpec(command=("sh",), image=str(busybox), sandbox="none")
    with pytest.raises(RolloutError, match="agent mounts must map host paths to absolute paths"):
        AgentSpec(command=("sh",), image=str(busybox), mounts={"x": "relative"})
    with pytest.raises(RolloutError, match=r"in an image, name them in agent.mounts \(host path: path in"):
        AgentSpec(command=("sh",), image=str(busybox), sandbox=SandboxSpec(mounts=(Path("/opt"),)))


def test_the_run_config_names_the_image_and_every_tasks_image_is_checked_before_the_run(tmp_path, busybox):
    from lgt.trainer import config, preflight

    (tmp_path / "tools").mkdir()
    (tmp_path / "tasks.jsonl").write_text('{"task_id": "a"}\n{"task_id": "b", "image": "gone.tar"}\n')
    (tmp_path / "run.yaml").write_text(
        f"agent: {{command: [sh, -c, 'echo 1'], image: {busybox}, image_field: image,\n"
        "        mounts: {tools: /opt/tools}}\ntasks: tasks.jsonl\nmodel: {path: m}\n")
    cfg = config.load(tmp_path / "run.yaml")
    assert (cfg.agent.image, cfg.agent.image_field, dict(cfg.agent.mounts)) == (
        str(busybox), "image", {"tools": "/opt/tools"})
    assert runner_class(cfg.agent) is ImageRunner
    with pytest.raises(config.ConfigError, match=r"^task 'b''s image: image gone.tar does not exist$"):
        preflight.validate(cfg)


@pytest.mark.skipif(shutil.which("podman") is None,
                    reason="podman is not installed (scripts/setup.sh installs it with apt-get as root)")
def test_an_agent_runs_in_an_image_named_in_podmans_store(tmp_path, proxy, monkeypatch):
    archive = tmp_path / "busybox.tar"
    write_docker_archive(archive, [Layer(busybox_layer()), Layer(SEED)], Config(env=["PATH=/bin"]))
    with podman_store(tmp_path / "store") as env:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        subprocess.run(["podman", "load", "-i", str(archive)], check=True, capture_output=True)
        subprocess.run(["podman", "tag", "lgt-test:latest", "lgt-test/bb:1"], check=True, capture_output=True)
        agent = spec("containers-storage:lgt-test/bb:1", ("sh", "-c", "cat seed.txt; echo 1"))
        check_agent(agent)  # the run's checks: the image, and the command in it
        [r] = run(proxy, tmp_path, agent, [({}, "stored-0")])
        assert r.status == "ok" and "from the image" in r.stdout_path.read_text(), r.error
        with pytest.raises(RolloutError, match=r"^agent.image: image containers-storage:lgt-test/none:1 is "
                                               r"not a file or folder here, nor an image podman could give"):
            check_agent(spec("containers-storage:lgt-test/none:1", ("sh",)))


def test_paths_are_resolved_inside_the_image_and_the_skeleton_adds_only_what_it_lacks(tmp_path):
    from lgt.trainer.rollout.runners.image import _skeleton, in_root

    root = tmp_path / "root"
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "etc" / "pki").mkdir(parents=True)
    (root / "bin").symlink_to("usr/bin")
    (root / "etc" / "ssl").symlink_to("/etc/pki")  # absolute: inside the image, never the host's /etc/pki
    (root / "etc" / "pki" / "cert.pem").symlink_to("../../../../../outside.pem")  # .. stops at the root
    (root / "loop").symlink_to("loop")
    assert in_root(root, "/bin/tool") == "/usr/bin/tool"
    assert in_root(root, "/etc/ssl/certs/ca.crt") == "/etc/pki/certs/ca.crt"
    assert in_root(root, "/etc/ssl/cert.pem") == "/outside.pem"
    assert in_root(root, "/usr/../etc/./pki") == "/etc/pki"
    with pytest.raises(images.ImageError, match="more than 40 symlinks"):
        in_root(root, "/loop/x")
    skel = tmp_path / "skel"
    _skeleton(skel, root, [("/usr/bin/tool", False), ("/etc/pki/certs/ca.crt", False), ("/lgt/work", True),
                           ("/usr/bin", True)])
    made = sorted(str(p.relative_to(skel)) + ("/" if p.is_dir() else "") for p in skel.rglob("*"))
    assert made == ["etc/", "etc/pki/", "etc/pki/certs/", "etc/pki/certs/ca.crt", "lgt/", "lgt/work/", "usr/",
                    "usr/bin/", "usr/bin/tool"]
    assert not os.path.lexists(root / "usr" / "bin" / "tool")  # the image itself is never changed
