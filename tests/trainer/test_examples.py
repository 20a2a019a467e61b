"""The framework examples, unmodified agents in their own environments, trained by `lgt-train run`.

Each has its agent's own environment (``DIR/.venv`` from its requirements.txt, or ``DIR/node_modules``
from its package-lock.json), built by ``scripts/setup_agent.sh``, which ``scripts/setup.sh`` runs.
One training step on the tiny model: every token the engine generated is in the store (the recorded
ids count what the engine reported), the calls came in through the API the framework speaks, samples
were built and trained, and every rollout has its reward. The runs share the session's engine on the
arith model (``engine.url``, conftest.py's ``arith_engine``): each loads its own weights into it first,
and leaves it running.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lgt.store.query import connect
from lgt.testing.runs import lgt_train, lgt_train_cmd, metrics
from lgt.trainer.serving.engine import Engine

ROOT = Path(__file__).resolve().parents[2]
# example -> (the API it calls, what its agent environment is)
EXAMPLES = {"agents_sdk": ("responses", ".venv/bin/python"),
            "anthropic_sdk": ("messages", ".venv/bin/python"),
            "langgraph": ("chat/completions", ".venv/bin/python"),
            "node_agent": ("chat/completions", "node_modules/openai"),
            "mini_swe_agent": ("chat/completions", ".venv/bin/python"),
            # real coding-agent harnesses as they ship (their npm packages), two steps each
            "claude_code": ("messages", "node_modules/.bin/claude"),
            "codex": ("responses", "node_modules/.bin/codex"),
            "gemini_cli": ("gemini", "node_modules/.bin/gemini")}
HARNESSES = {"claude_code", "codex", "gemini_cli"}


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_a_framework_example_trains_a_step(tmp_path: Path, arith_model_dir: Path, example: str,
                                           arith_engine: Engine) -> None:
    here, (api, env) = ROOT / "examples" / example, EXAMPLES[example]
    if not (here / env).exists():
        pytest.skip(f"no agent environment in {here} (bash scripts/setup_agent.sh examples/{example})")
    steps = 2 if example in HARNESSES else 1
    cfg = yaml.safe_load((here / "run.yaml").read_text())
    cfg.update(model={"path": str(arith_model_dir)}, tasks=str((here / cfg["tasks"]).resolve()),
               group_size=2, batch_groups=2, max_inflight=8, steps=steps, eval=None,
               engine={"url": arith_engine.url, "max_model_len": None})  # the shared engine's whole context
    cfg["agent"] = {**cfg["agent"], "cwd": str(here), "timeout_s": 90}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    out = lgt_train(str(path), "--run-dir", str(run_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["samples"] > 0 and r["rollouts"] == 4 and r["rollout/failed"] == 0 for r in rows)
    con = connect(run_dir / "store")
    calls = con.execute("SELECT api, endpoint, capture, len(response_token_ids), usage_completion_tokens "
                        "FROM calls WHERE status = 'ok'").fetchall()
    assert calls and {(a, endpoint) for a, endpoint, *_ in calls} == {(api, "chat/completions")}
    assert all(capture == "full" and n == used for _, _, capture, n, used in calls)  # every token
    rewards = con.execute("SELECT count(DISTINCT rollout_id) FROM rewards").fetchone()[0]
    rollouts = con.execute("SELECT count(DISTINCT rollout_id) FROM rollouts_log WHERE status = 'ok'"
                           ).fetchone()[0]  # finished (rollouts the run's end cut off have no reward)
    assert rewards == rollouts >= 4 * steps
    with_tools = con.execute("SELECT count(*) FROM calls WHERE json_array_length(request_json, '$.tools') > 0"
                             ).fetchone()[0]
    if with_tools:  # the shared engine parses tool calls; the example's own engine must be told to as well
        own = yaml.safe_load((here / "run.yaml").read_text()).get("engine") or {}
        assert "--enable-auto-tool-choice" in (own.get("extra_args") or []), \
            f"{example}'s agent offers tools: its engine needs a tool-call parser"
    if example in HARNESSES:  # the reward is the task's own check, printed by task.sh after the harness
        done = con.execute("SELECT rollout_id || '~' || attempt FROM rollouts_log WHERE status = 'ok'"
                           ).fetchall()
        outs = {n: (run_dir / "rollouts" / f"{n}.out").read_text(errors="replace")  # an agent's bytes: any
                for (n,) in done}
        bad = {n: o[-600:] for n, o in outs.items()
               if not o.strip() or '"reward": ' not in o.splitlines()[-1]}
        assert len(outs) >= 4 * steps and not bad, bad
    arith_engine.check_alive()  # used, not stopped: the next example's run loads its weights into it


def swe_images_task(tmp_path: Path, task: str = "acme__ledger-1") -> dict:
    """examples/swe_images' first steps as its README says, for one task: its image built from Debian's
    packages (the .debs cached under build/debs; the layers kept under build/swe_images_test, so a rerun
    reuses them), then its task written to ``tmp_path/tasks.jsonl`` by `lgt-train tasks swebench`. The
    task's instance; skips when Debian's packages cannot be had."""
    import json
    import subprocess
    import sys

    images = ROOT / "build" / "swe_images_test"
    built = subprocess.run([sys.executable, str(ROOT / "examples" / "swe_images" / "build_images.py"),
                            "--out", str(images), "--debs", str(ROOT / "build" / "debs"), "--only", task,
                            "--instances", str(tmp_path / "instances.jsonl")],
                           capture_output=True, text=True, timeout=900)
    if built.returncode == 3:
        pytest.skip(f"Debian's packages cannot be had here: {built.stderr.strip()}")
    assert built.returncode == 0, built.stderr[-3000:]
    line = next(line for line in (tmp_path / "instances.jsonl").read_text().splitlines()
                if json.loads(line)["instance_id"] == task)
    (tmp_path / "one.jsonl").write_text(line + "\n")
    out = lgt_train_cmd("tasks", "swebench", str(tmp_path / "one.jsonl"), "--image-dir", str(images),
                        "--out", str(tmp_path / "tasks.jsonl"), "--test-timeout", "60")
    assert out.returncode == 0, out.stderr
    return json.loads(line)


@pytest.mark.slow
def test_swe_images_trains_mini_swe_agent_inside_each_tasks_image(tmp_path: Path, arith_model_dir: Path,
                                                                 arith_engine: Engine) -> None:
    """examples/swe_images as its README says: the task's image built from Debian's packages (the .debs
    cached under build/debs), its tasks written by `lgt-train tasks swebench`, then two steps of
    `lgt-train run` on it — mini-swe-agent in the image through lgt-proxy, the evaluator in the same image
    on the tree it left (the tiny model fixes nothing: reward 0, the hidden test named as failed)."""
    import json

    here = ROOT / "examples" / "swe_images"
    swe_images_task(tmp_path)
    cfg = yaml.safe_load((here / "run.yaml").read_text())
    cfg.update(model={"path": str(arith_model_dir)}, tasks=str(tmp_path / "tasks.jsonl"), group_size=2,
               batch_groups=1, max_inflight=2, steps=2, eval=None,
               engine={"url": arith_engine.url, "max_model_len": None})
    cfg["agent"] = {**cfg["agent"], "cwd": str(here), "timeout_s": 120}
    cfg["agent"]["env"] = {**cfg["agent"]["env"], "SWE_STEP_LIMIT": "2"}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    out = lgt_train(str(tmp_path / "run.yaml"), "--run-dir", str(run_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and all(r["rollout/failed"] == 0 for r in rows)
    con = connect(run_dir / "store")
    calls, = con.execute("SELECT count(*) FROM calls WHERE status = 'ok' AND len(response_token_ids) > 0"
                         ).fetchone()
    sources = con.execute("SELECT list(DISTINCT source), list(DISTINCT value) FROM rewards").fetchone()
    con.close()
    assert calls >= 4 and sources == (["evaluator"], [0.0])
    graded = [json.loads(p.read_text().splitlines()[-1]) for p in (run_dir / "rollouts").glob("*.eval.out")]
    assert len(graded) >= 4 and all(not g["resolved"] and "FAIL_TO_PASS tests did not pass" in g["reason"]
                                    and "test_total_counts_every_row" in g["reason"] for g in graded), graded


CLAUDE = ROOT / "examples" / "claude_code" / "node_modules" / ".bin" / "claude"


@pytest.mark.slow
@pytest.mark.skipif(not CLAUDE.exists(), reason="Claude Code is not installed in examples/claude_code "
                                                "(bash scripts/setup_agent.sh examples/claude_code)")
def test_swe_images_trains_claude_code_mounted_into_each_tasks_image(tmp_path: Path, arith_model_dir: Path,
                                                                     arith_engine: Engine) -> None:
    """examples/swe_images/claude_code.yaml as its README says, two steps on one task: Claude Code as it
    ships, mounted read-only from examples/claude_code into the task's image built from Debian's
    packages, works in /testbed through lgt-proxy; the evaluator in the same image is the reward. Each
    attempt first looks for the host's files (and tries to write the harness) before the example's
    script runs."""
    import json

    here = ROOT / "examples" / "swe_images"
    instance = swe_images_task(tmp_path)
    cfg = yaml.safe_load((here / "claude_code.yaml").read_text())
    cfg.update(model={"path": str(arith_model_dir)}, tasks=str(tmp_path / "tasks.jsonl"), group_size=2,
               batch_groups=1, max_inflight=2, steps=2, eval=None,
               engine={"url": arith_engine.url, "max_model_len": None})
    script = cfg["agent"]["command"][-1]
    probe = (f"for f in /etc/hostname {ROOT}/pyproject.toml {CLAUDE.resolve()} {here}/instances.jsonl; do "
             f'test -e "$f" && echo "SEES HOST $f"; done; touch /opt/claude/x 2>/dev/null && echo WRITABLE; '
             f"exec bash {script}")
    cfg["agent"] = {**cfg["agent"], "cwd": str(here), "timeout_s": 120, "command": ["bash", "-c", probe]}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    out = lgt_train(str(tmp_path / "run.yaml"), "--run-dir", str(run_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["samples"] > 0 and r["rollout/failed"] == 0 for r in rows), rows
    con = connect(run_dir / "store")
    done = [n for (n,) in con.execute("SELECT rollout_id || '~' || attempt FROM rollouts_log "
                                      "WHERE status = 'ok'").fetchall()]  # finished (not cut off by the end)
    calls = con.execute("SELECT rollout_id || '~' || attempt, api, original_host, capture, status, "
                        "len(prompt_token_ids), len(response_token_ids), usage_completion_tokens, "
                        "request_json FROM calls").fetchall()
    rewards = dict(con.execute("SELECT rollout_id, value FROM rewards WHERE source = 'evaluator'").fetchall())
    sources = con.execute("SELECT list(DISTINCT source) FROM rewards").fetchone()[0]
    con.close()
    assert len(done) >= 4 and sources == ["evaluator"], (done, sources)
    # every call of a finished attempt is Claude Code's (its Messages request to api.anthropic.com with its
    # Bash tool), recorded with the engine's token ids
    calls = [c for c in calls if c[0] in done]
    assert {c[0] for c in calls} == set(done)
    for _, api, host, capture, status, prompt, response, used, request in calls:
        body = json.loads(request)
        assert (api, host, capture, status) == ("messages", "api.anthropic.com", "full", "ok")
        assert prompt > 0 and response == used > 0
        assert [t["name"] for t in body["tools"]] == ["Bash"] and "Claude Agent SDK" in str(body["system"])
    # inside the task's image: its repository at the instance's base commit, none of the host's files,
    # the harness read-only; Claude Code ran to its end there, and the evaluator graded the tree it left
    head = f"in /testbed at {instance['base_commit']}"
    for n in done:
        text = (run_dir / "rollouts" / f"{n}.out").read_text(errors="replace")
        assert text.startswith("claude code 2.") and head in text.splitlines()[0], text[-2000:]
        # its JSON result, of which claude_code.sh prints the first 2,000 bytes (a long answer pushes its
        # "type" field past them; "stop_reason" comes first)
        assert "SEES HOST" not in text and "WRITABLE" not in text and '"stop_reason":' in text, text[-2000:]
        graded = json.loads((run_dir / "rollouts" / f"{n}.eval.out").read_text().splitlines()[-1])
        assert graded["reward"] == rewards[n.split("~")[0]], (graded, rewards)
        assert graded["resolved"] or "test_total_counts_every_row" in graded["reason"], graded
    assert not (CLAUDE.parent.parent / "x").exists()
    # the evaluator's rewards are what was trained, two steps
    trained = [json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()]
    assert {t["step"] for t in trained} == {1, 2} and len(trained) >= 4
    assert all(t["reward"] == rewards[t["rollout_id"]] for t in trained), (trained, rewards)


@pytest.mark.slow
@pytest.mark.skipif(not CLAUDE.exists(), reason="Claude Code is not installed in examples/claude_code "
                                                "(bash scripts/setup_agent.sh examples/claude_code)")
def test_claude_code_with_sub_agents_on_a_policy_of_their_own_trains_a_step(tmp_path: Path,
                                                                            arith_model_dir: Path) -> None:
    """examples/claude_code/policies.yaml, one step on the tiny model: Claude Code without --bare, offered
    its Agent tool; the run's own engine serves the two policies' adapters (main-v0, side-v0). The tiny
    model never delegates, so every call is the main conversation's and only main trains
    (tests/test_claude_code_policies.py shows a sub-agent's calls going to side)."""
    here = ROOT / "examples" / "claude_code"
    cfg = yaml.safe_load((here / "policies.yaml").read_text())
    cfg.update(model={"path": str(arith_model_dir)}, tasks=str((here / cfg["tasks"]).resolve()),
               group_size=2, batch_groups=2, max_inflight=4, steps=1)
    cfg["agent"] = {**cfg["agent"], "cwd": str(here)}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    out = lgt_train(str(tmp_path / "run.yaml"), "--run-dir", str(run_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "LoRA: 2 policies (main, side)" in " ".join((out.stdout + out.stderr).split())
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1] and rows[0]["rollout/failed"] == 0
    assert rows[0]["policy/main/samples"] > 0 and rows[0]["policy/side/samples"] == 0
    con = connect(run_dir / "store")
    calls = con.execute("SELECT DISTINCT policy, served_model, api FROM calls WHERE status = 'ok'").fetchall()
    tools = con.execute("SELECT DISTINCT list_sort(json_extract_string(request_json, '$.tools[*].name')) "
                        "FROM calls").fetchall()
    con.close()
    assert calls == [("main", "main-v0", "messages")]
    assert tools == [(["Agent", "Bash"],)]  # offered its Agent tool: the example's settings took
