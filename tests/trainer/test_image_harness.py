"""A harness binary from the host in a container image: Claude Code (examples/claude_code's npm package,
unmodified) as an lgt rollout of the image runner, mounted read-only from the host with ``agent.mounts``.

The image is built here: busybox, the host's bash (Claude Code's Bash tool runs it) and the shared
libraries bash and Claude Code's native binary load — nothing else of the host; Claude Code itself is
not in it. One real lgt-proxy (``--egress deny``) in front of the scripted engine of test_harnesses.py
(``lgt.testing.harness_policy``: a call of the harness's own tool, then a short final text). Claude Code
aims at api.anthropic.com through the proxy, trusting its CA where the image runner put it. The task is
write-a-word's; the evaluator (a shell script run in the same image, on the tree the harness left) is the
reward. Then the same in a SWE task's own image (examples/swe_images, built from Debian's packages), as
its claude_code.yaml runs it: the scripted engine's Bash call fixes the bug (or does not), and the
SWE-bench evaluator in that image grades the tree Claude Code left."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from lgt.proxy.auth import CA_VARS
from lgt.testing import harnesses
from lgt.testing.fake_upstream import FakeUpstream
from lgt.testing.harness_policy import ScriptedPolicy, task_text
from lgt.testing.images import (
    Config,
    Dir,
    File,
    Layer,
    Symlink,
    busybox_layer,
    busybox_root,
    bwrap_argv,
    host_programs_layer,
    write_oci_layout,
)
from lgt.testing.proxy import ProxyProc
from lgt.testing.rollouts import endpoint, rows, run_all
from lgt.trainer.rollout import swebench
from lgt.trainer.rollout.agent import AgentSpec
from lgt.trainer.rollout.controller import RolloutController, RolloutResult
from lgt.trainer.rollout.images import fresh_workdir, open_image

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "examples" / "claude_code" / "node_modules"  # npm ci there (scripts/setup_agent.sh)
CLAUDE = PACKAGE / ".bin" / "claude"
BASH = "/usr/bin/bash"
APPLETS = ("cat", "echo", "head", "id", "ls", "mkdir", "rm", "test", "touch", "tr", "uname", "which")
H = harnesses.HARNESSES["claude_code"]["minimal"]  # test_harnesses.py's smallest prompt: --bare, one tool

pytestmark = [
    pytest.mark.skipif(busybox_root() is None, reason="busybox-static is not unpacked under build/ "
                                                      "(scripts/setup.sh fetches it)"),
    pytest.mark.skipif(not CLAUDE.exists(), reason="Claude Code is not installed in examples/claude_code "
                                                   "(bash scripts/setup_agent.sh examples/claude_code)"),
    pytest.mark.skipif(not os.path.isfile(BASH), reason=f"no {BASH} here to put in the image"),
    pytest.mark.usefixtures("image_cache"),  # conftest.py: this module's own cache of unpacked images
]

# the attempt: what it can see of the host and of its mount, then Claude Code as task.sh runs it
SCRIPT = r"""
for f in /etc/hostname {repo}/pyproject.toml {package}/.bin/claude; do
  test -e "$f" && echo "SEES HOST $f"
done
touch /opt/claude/x 2>/dev/null && echo "HARNESS WRITABLE"
rm -f /opt/claude/.bin/claude 2>/dev/null; test -x /opt/claude/.bin/claude && echo "harness kept"
echo "id $(id -u) in $(pwd) home $HOME"
/opt/claude/.bin/claude {argv} < /dev/null > "$HOME/claude.json"
code=$?
head -c 1500 "$HOME/claude.json"; echo; echo "claude exited $code"
exit $code
"""
GRADER = r"""
got=$(cat "$TASK_FILE" 2>/dev/null)
echo "found: $got"
[ "$got" = "$TASK_WORD" ] && echo 1 || echo 0
"""


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("harness-image") / "image"
    users = b"root:x:0:0:root:/root:/bin/sh\nagent:x:1000:1000:agent:/lgt/work:/usr/bin/bash\n"
    tools = [Symlink(f"bin/{name}", "busybox") for name in APPLETS]
    passwd = [*tools, File("etc/passwd", users),
              File("etc/group", b"root:x:0:\nagent:x:1000:\n"), Dir("work")]
    runtime = host_programs_layer([BASH], mounted=[os.path.realpath(CLAUDE)])
    write_oci_layout(path, [Layer(busybox_layer()), Layer(runtime), Layer(passwd)],
                     Config(env=["PATH=/usr/bin:/bin", "LANG=C.UTF-8"]))
    return path


@pytest.fixture(scope="module")
def policy() -> ScriptedPolicy:
    return ScriptedPolicy()


@pytest.fixture(scope="module")
def engine(policy: ScriptedPolicy) -> Iterator[FakeUpstream]:
    with FakeUpstream.in_thread(reply=policy, max_model_len=1 << 20) as up:  # prompts: a token a byte
        yield up


@pytest.fixture(scope="module")
def lgt_proxy(tmp_path_factory: pytest.TempPathFactory, engine: FakeUpstream) -> Iterator[ProxyProc]:
    p = ProxyProc(tmp_path_factory.mktemp("image-harness") / "store", engine.url, "--egress", "deny").start()
    yield p
    p.stop()


def run_claude(tmp_path: Path, image: Path, lgt_proxy: ProxyProc, words: list[tuple[str, str]],
               **env: str) -> list[RolloutResult]:
    """Claude Code (test_harnesses.py's minimal profile, as examples/claude_code's task.sh runs it) on
    one write-a-word task per word, in the image, through the controller; each graded in the image."""
    place = harnesses.Place("$TASK_PROMPT", Path("/work"), Path("/lgt/work"))
    argv = " ".join('"$TASK_PROMPT"' if a == "$TASK_PROMPT" else shlex.quote(a) for a in H.argv(place))
    script = SCRIPT.format(repo=ROOT, package=PACKAGE, argv=argv)
    (tmp_path / "grade.sh").write_text(GRADER)
    agent = AgentSpec(command=("bash", "-c", script), image=str(image), mounts={str(PACKAGE): "/opt/claude"},
                      env={**H.env(place), "SHELL": BASH, "TERM": "dumb", "TMPDIR": "/tmp", **env},
                      cwd=tmp_path, timeout_s=150, retries=0, reward_sources=("evaluator",),
                      evaluator=("sh", "grade.sh"))
    jobs = [({"prompt": task_text(w, f), "file": f, "word": w}, f"{tmp_path.name[:20]}-{i}")
            for i, (w, f) in enumerate(words)]
    ctl = RolloutController(agent, endpoint(lgt_proxy), lgt_proxy.store, tmp_path / "run", len(jobs))
    return asyncio.run(run_all(ctl, jobs))


def check_done(lgt_proxy: ProxyProc, words: list[tuple[str, str]], results: list[RolloutResult]) -> None:
    """Each rollout: Claude Code exited 0, saw nothing of the host and could not change its own files;
    its calls are in the store with their token ids; the evaluator in the image found the word."""
    for (word, _), r in zip(words, results):
        out = r.stdout_path.read_text(errors="replace")
        why = f"{r.error}\nstdout: {out[-3000:]}\nstderr: {r.stderr_path.read_text(errors='replace')[-3000:]}"
        assert r.status == "ok" and "claude exited 0" in out, why
        assert "SEES HOST" not in out and "HARNESS WRITABLE" not in out and "harness kept" in out, why
        assert "id 1000 in /work home /lgt/work" in out, why
        graded = r.stdout_path.with_suffix(".eval.out").read_text()
        assert (r.reward, r.reward_source) == (1.0, "evaluator") and f"found: {word}" in graded, (why, graded)
        calls = rows(lgt_proxy, "SELECT * FROM calls WHERE rollout_id = ?", [r.rollout_id])
        assert len(calls) >= 2, why  # the tool call, then the final text
        assert all(c["status"] == "ok" and c["capture"] == "full" and c["api"] == "messages"
                   and c["prompt_token_ids"] and c["response_token_ids"] for c in calls), why
    assert not (PACKAGE / "x").exists() and CLAUDE.exists()


def test_claude_code_mounted_from_the_host_does_the_task_inside_an_image_through_lgt_proxy(
        tmp_path: Path, image: Path, lgt_proxy: ProxyProc, policy: ScriptedPolicy) -> None:
    first = len(policy.answers)
    from tests.test_harnesses import expected_tokens

    words = [("MELON", "result.txt"), ("FIG", "note.md")]
    results = run_claude(tmp_path, image, lgt_proxy, words)
    check_done(lgt_proxy, words, results)
    answers = policy.answers[first:]
    calls = rows(lgt_proxy, "SELECT * FROM calls WHERE rollout_id IN (?, ?)", [r.rollout_id for r in results])
    # every call that reached the engine is a row, with the very token ids the engine produced
    assert Counter((tuple(c["prompt_token_ids"]), tuple(c["response_token_ids"])) for c in calls) == \
        Counter(tuple(map(tuple, expected_tokens(a))) for a in answers)
    assert [a.reply[0] for a in answers if a.kind == "tool-call"] == ["Bash", "Bash"]  # the image's bash
    assert [a.kind for a in answers].count("final") == 2


def test_claude_code_in_an_image_trusts_the_proxys_ca_from_the_images_system_store(
        tmp_path: Path, image: Path, lgt_proxy: ProxyProc) -> None:
    # every CA variable emptied: the proxy's CA is then only where the image runner bound it over the
    # image's system CA stores (and under $HOME/.lgt), and Claude Code as it ships still trusts the proxy
    words = [("PEAR", "pear.txt")]
    no_vars = {var: "" for var in CA_VARS}
    check_done(lgt_proxy, words, run_claude(tmp_path, image, lgt_proxy, words, **no_vars))


# --- a SWE task in its own image: Claude Code fixes the bug, the hidden tests reward it ---------------------

SWE = ROOT / "examples" / "swe_images"
# what the scripted model's Bash call shows of where it runs: acme/ledger's own package (tabulate, in its
# image only) imported by the image's python3, the image's git in the repository at /testbed
PROBE = ("python3 -c 'import sys, tabulate; print(sys.executable, sys.version.split()[0], tabulate.__file__)'"
         " && git --version && echo \"$(pwd) at $(git rev-parse HEAD)\"")


@pytest.fixture(scope="module")
def swe_task(tmp_path_factory: pytest.TempPathFactory, image_cache: Path) -> tuple[dict, dict, str]:
    """acme/ledger's image built by examples/swe_images' script as tests/test_swe_images.py builds it
    (the .debs cached under build/debs, its layers under build/swe_images_test), its task as `lgt-train
    tasks swebench` writes it, and what PROBE prints run in that image directly (bubblewrap): the
    instance, the task, the probe's output."""
    from tests.test_swe_images import TASK, build

    tmp = tmp_path_factory.mktemp("swe-task")
    build(ROOT / "build" / "swe_images_test", tmp / "instances.jsonl")
    [instance] = [i for i in map(json.loads, (tmp / "instances.jsonl").read_text().splitlines())
                  if i["instance_id"] == TASK]
    [task] = swebench.convert([("line 1", instance)], image_dir=ROOT / "build" / "swe_images_test")
    image = open_image(task["image"], cache=image_cache)
    done = subprocess.run(bwrap_argv(image, ["bash", "-c", PROBE], fresh_workdir(image, tmp / "probe")),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return instance, task, done.stdout.strip()


def run_swe(tmp_path: Path, lgt_proxy: ProxyProc, task: dict, name: str) -> RolloutResult:
    """One attempt of ``task`` as examples/swe_images/claude_code.yaml runs it (its agent section: Claude
    Code mounted read-only into the task's image, claude_code.sh, the SWE-bench evaluator the reward)."""
    cfg = yaml.safe_load((SWE / "claude_code.yaml").read_text())["agent"]
    agent = AgentSpec(command=tuple(cfg["command"]), cwd=SWE, env=cfg["env"], image_field=cfg["image_field"],
                      mounts=cfg["mounts"], private=tuple(cfg["private"]), evaluator=tuple(cfg["evaluator"]),
                      reward_sources=tuple(cfg["reward_sources"]), timeout_s=120, retries=0)
    ctl = RolloutController(agent, endpoint(lgt_proxy), lgt_proxy.store, tmp_path / name, 1)
    [result] = asyncio.run(run_all(ctl, [(task, f"{tmp_path.name[:20]}-{name}")]))
    return result


def tool_result(request_json: str) -> str:
    """The text of the tool results in a Messages request, as Claude Code sent them."""
    blocks = [b for m in json.loads(request_json)["messages"] if isinstance(m["content"], list)
              for b in m["content"] if b.get("type") == "tool_result"]
    return "\n".join(b["content"] if isinstance(b["content"], str) else
                     "\n".join(c.get("text", "") for c in b["content"]) for b in blocks)


@pytest.mark.slow
def test_claude_code_fixes_a_swe_task_inside_its_image_and_the_hidden_tests_reward_it(
        tmp_path: Path, lgt_proxy: ProxyProc, policy: ScriptedPolicy, swe_task: tuple[dict, dict, str]
) -> None:
    from tests.test_harnesses import expected_tokens

    instance, task, probed = swe_task
    fix = f"git apply -v <<'PATCH'\n{instance['patch']}PATCH\n{PROBE}"  # the instance's gold patch
    results: dict[str, RolloutResult] = {}
    first = len(policy.answers)
    try:
        for name, command in (("fixed", fix), ("unfixed", PROBE)):
            policy.command = command
            results[name] = run_swe(tmp_path, lgt_proxy, task, name)
    finally:
        policy.command = None
    answers = policy.answers[first:]
    # per attempt, as scripted: Claude Code's Bash tool called with the exact command, then a final text
    assert [a.kind for a in answers] == ["tool-call", "final"] * 2, answers
    assert [(a.reply[0], json.loads(a.reply[1])["command"]) for a in answers[::2]] == [("Bash", fix),
                                                                                       ("Bash", PROBE)]
    for name, r in results.items():
        out, err = (path.read_text(errors="replace") for path in (r.stdout_path, r.stderr_path))
        graded = r.stdout_path.with_suffix(".eval.out").read_text()
        why = f"{name}: {r.error}\nstdout: {out[-3000:]}\nstderr: {err[-3000:]}\n{graded}"
        assert r.status == "ok" and f"in /testbed at {instance['base_commit']}" in out.splitlines()[0], why
        calls = rows(lgt_proxy, "SELECT * FROM calls WHERE rollout_id = ? ORDER BY started_at",
                     [r.rollout_id])
        # Claude Code's two Messages calls, each with the very token ids the engine produced
        assert [(c["api"], c["original_host"], c["status"], c["capture"]) for c in calls] == \
            [("messages", "api.anthropic.com", "ok", "full")] * 2, why
        assert all(c["prompt_token_ids"] and c["response_token_ids"] for c in calls), why
        # the Bash call ran in the image: its output, as Claude Code sent it back, is what the probe prints
        # there (the image's python3 with the task's own tabulate, its git in /testbed at the base commit)
        assert "tool_result" not in calls[0]["request_json"], why
        sent = tool_result(calls[1]["request_json"])
        assert probed in sent and f"/testbed at {instance['base_commit']}" in probed, (sent, probed)
        assert ("Applied patch ledger.py cleanly" in sent) == (name == "fixed"), sent
        assert ("git status:  M ledger.py" in out) == (name == "fixed"), why
    calls = rows(lgt_proxy, "SELECT * FROM calls WHERE rollout_id IN (?, ?)",
                 [r.rollout_id for r in results.values()])
    assert Counter((tuple(c["prompt_token_ids"]), tuple(c["response_token_ids"])) for c in calls) == \
        Counter(tuple(map(tuple, expected_tokens(a))) for a in answers)
    # the hidden tests, in the same image on the tree Claude Code left: the fix passes them, no fix fails
    verdicts = {name: json.loads(r.stdout_path.with_suffix(".eval.out").read_text().splitlines()[-1])
                for name, r in results.items()}
    assert {name: (r.reward, r.reward_source) for name, r in results.items()} == \
        {"fixed": (1.0, "evaluator"), "unfixed": (0.0, "evaluator")}, verdicts
    assert verdicts["fixed"] == {"reward": 1.0, "resolved": True}, verdicts
    assert "test_total_counts_every_row" in verdicts["unfixed"]["reason"], verdicts
