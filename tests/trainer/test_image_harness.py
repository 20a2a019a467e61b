"""A harness binary from the host in a container image: Claude Code (examples/claude_code's npm package,
unmodified) as an lgt rollout of the image runner, mounted read-only from the host with ``agent.mounts``.

The image is built here: busybox, the host's bash (Claude Code's Bash tool runs it) and the shared
libraries bash and Claude Code's native binary load — nothing else of the host; Claude Code itself is
not in it. One real lgt-proxy (``--egress deny``) in front of the scripted engine of test_harnesses.py
(``lgt.testing.harness_policy``: a call of the harness's own tool, then a short final text). Claude Code
aims at api.anthropic.com through the proxy, trusting its CA where the image runner put it. The task is
write-a-word's; the evaluator (a shell script run in the same image, on the tree the harness left) is the
reward."""

from __future__ import annotations

import asyncio
import os
import shlex
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

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
    host_programs_layer,
    write_oci_layout,
)
from lgt.testing.proxy import ProxyProc
from lgt.testing.rollouts import endpoint, rows, run_all
from lgt.trainer.rollout.agent import AgentSpec
from lgt.trainer.rollout.controller import RolloutController, RolloutResult

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
