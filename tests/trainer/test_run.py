"""``lgt-train run`` end to end: real lgt-proxy, real vLLM (CPU build), the unmodified example agent.

Slow. The runs that only need an engine running use the session's engine on the arith model
(``engine.url``, conftest.py's ``arith_engine``; each run loads its own weights into it first); the runs
that test the engine's start, restart and a killed run's resume start their own (~30–60 s each here).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import pytest

from lgt.store.query import connect
from lgt.testing.runs import lgt_train, lgt_train_cmd, metrics, trained_ids, write_config
from lgt.trainer.run.evaluation import held_out

if TYPE_CHECKING:
    from lgt.trainer.serving.engine import Engine

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_async_run_trains_syncs_and_records_everything(tmp_path: Path, arith_model_dir: Path,
                                                        arith_engine: Engine) -> None:
    run_dir = tmp_path / "run"
    # two optimizer updates a step (a share of the batch's groups each): checkpoints and evaluations
    # still count the run's steps
    cfg = write_config(tmp_path, arith_model_dir, engine_url=arith_engine.url,
                       eval={"split": 0.05, "every": 2, "samples": 1},
                       backend={"lr": 1e-3, "updates_per_step": 2})
    out = lgt_train(str(cfg), "--run-dir", str(run_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["version"] for r in rows] == [1, 2, 3]
    ids = trained_ids(rows)
    assert len(ids) == len(set(ids)) >= 3 * 2 * 4 * 0.75  # each sample once; most rollouts succeed
    # staleness: truncate (the default): every generated token trained, one past the bound counted
    assert all(r["rollout/tokens_trained"] == r["rollout/tokens_generated"] > 0 for r in rows)
    assert all(r["rollout/staleness_max"] <= 1 or r["rollout/tokens_past_bound"] > 0 for r in rows)
    assert all(r["perf/sync_s"] > 0 for r in rows)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step-{s:08d}" for s in (1, 2, 3)]
    for step in (1, 2, 3):
        assert (run_dir / "checkpoints" / f"step-{step:08d}" / "DONE").exists()
        state = json.loads((run_dir / "checkpoints" / f"step-{step:08d}" / "trainer_state.json").read_text())
        assert (state["step"], state["extra"]["step"]) == (2 * step, step)  # the backend's updates, the run's
    for f in ("metrics.csv", "report.html", "store-report.html", "plots/reward.svg",
              "plots/rollout_duration.svg", "plots/staleness.svg", "plots/drain_seconds.svg"):
        assert (run_dir / f).stat().st_size > 0, f
    con = connect(run_dir / "store")
    versions = [v for (v,) in con.execute("SELECT DISTINCT policy_version FROM calls ORDER BY 1").fetchall()]
    assert versions[0] == 0 and len(versions) >= 2  # later calls ran on synced weights
    # every attempt the controller recorded as ok has its reward (rollouts cut off by the end of the
    # run appear in the rollouts view only as derived rows, from their calls, with no metadata)
    n_ok, n_rewarded = con.execute(
        "SELECT count(*) FILTER (WHERE status = 'ok'), count(w.value) FILTER (WHERE status = 'ok') "
        "FROM rollouts_log o LEFT JOIN rewards w USING (rollout_id, attempt)").fetchone()
    assert n_ok >= 24 and n_rewarded >= n_ok
    # the agent's output is in the run directory, one file per attempt
    outs = sorted((run_dir / "rollouts").glob("g000000-0~0.out"))
    assert outs and json.loads(outs[0].read_text().splitlines()[-1])["reward"] in (0.0, 1.0)

    # held-out evaluation: before the first update, every 2 steps, and at the end
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [(e["step"], e["version"]) for e in evals] == [(0, 0), (2, 2), (3, 3)]
    tasks = map(json.loads, (ROOT / "examples/arith/tasks.jsonl").read_text().splitlines())
    held = {t["task_id"] for t in tasks if held_out(t["task_id"], 0.05)}
    assert held and all(e["eval/rollouts"] == 2 * len(held) and e["eval/failed"] == 0 for e in evals)
    assert all(0 <= e["eval/reward_greedy"] <= 1 and 0 <= e["eval/reward_sampled"] <= 1 for e in evals)
    by_split = dict(con.execute("SELECT split, count(DISTINCT rollout_id) FROM rollouts GROUP BY 1"
                                ).fetchall())
    assert by_split["eval"] == 3 * 2 * len(held)
    eval_tasks, = con.execute("SELECT list(DISTINCT task_id) FROM rollouts WHERE split = 'eval'").fetchone()
    trained_tasks, = con.execute("SELECT list(DISTINCT task_id) FROM rollouts WHERE split = 'train' "
                                 "AND task_id IS NOT NULL").fetchone()
    assert set(eval_tasks) == held and not held & set(trained_tasks)  # never trained on
    assert not any(sid.startswith("e") for sid in ids)
    # each evaluation ran at one policy version; its greedy calls were decoded greedily
    per_step = con.execute(
        "SELECT o.step, list(DISTINCT c.policy_version), count(*) FILTER (WHERE c.sampling = 'greedy'), "
        "count(*) FILTER (WHERE o.rollout_id LIKE '%-g') "
        "FROM calls c JOIN rollouts o USING (rollout_id, attempt) "
        "WHERE o.split = 'eval' GROUP BY 1 ORDER BY 1").fetchall()
    assert [(st, v) for st, v, _, _ in per_step] == [(0, [0]), (2, [2]), (3, [3])]
    assert all(g == n == len(held) for _, _, g, n in per_step)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["stopped"] == "step limit (3 steps)"
    assert summary["eval_before"]["step"] == 0 and summary["eval_after"]["step"] == 3
    assert "held-out eval" in out.stdout and str(run_dir) in out.stdout

    # lgt-train eval on the last checkpoint: the same held-out tasks at that policy
    eval_dir = tmp_path / "eval"
    out = lgt_train_cmd("eval", str(cfg), "--checkpoint", str(run_dir / "checkpoints" / "step-00000003"),
                        "--run-dir", str(eval_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    [row] = [json.loads(line) for line in (eval_dir / "eval.jsonl").read_text().splitlines()]
    assert (row["step"], row["version"], row["eval/rollouts"]) == (3, 3, 2 * len(held))
    assert "eval at step 3" in out.stdout
    # greedy decoding of the same weights gives the same answers as in the run's last evaluation
    answers = ("SELECT o.task_id, c.response_token_ids "
               "FROM calls c JOIN rollouts o USING (rollout_id, attempt) "
               "WHERE c.sampling = 'greedy' AND o.step = 3 ORDER BY 1")
    assert connect(eval_dir / "store").execute(answers).fetchall() == con.execute(answers).fetchall()


def test_killed_mid_step_resumes_without_training_a_sample_twice(tmp_path: Path, arith_model_dir: Path,
                                                                 arith_engine) -> None:
    run_dir = tmp_path / "run"
    # keep_checkpoints 2: the resume finds step 2 kept, and the run ends with steps 3 and 4 only
    cfg = write_config(tmp_path, arith_model_dir, engine_url=arith_engine.url, steps=4, keep_checkpoints=2)
    # the trainer kills itself (SIGKILL) in step 3's backend update: faults/sitecustomize.py
    faults = str(Path(__file__).parent / "faults")
    path = os.pathsep.join(filter(None, [faults, os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": path, "LGT_TEST_KILL_AT_TRAIN_STEP": "3"}
    out = lgt_train(str(cfg), "--run-dir", str(run_dir), env=env)
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    before = metrics(run_dir)
    assert [r["step"] for r in before] == [1, 2]
    # what the crashed step was about to train: groups whose rollouts were all recorded, not trained
    con = connect(run_dir / "store")
    finished = {g for (g,) in con.execute(
        "SELECT group_id FROM rollouts GROUP BY group_id HAVING count(DISTINCT rollout_id) = 4").fetchall()}
    con.close()
    trained_before = {sid.split("-")[0] for sid in trained_ids(before)}
    pending = finished - trained_before
    assert pending, "the crash should leave finished, untrained groups behind"

    out = lgt_train(str(cfg), "--resume", str(run_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming from step-00000002" in out.stderr
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    ids = trained_ids(rows)
    assert len(ids) == len(set(ids)), "a sample was trained twice"
    trained_groups = {sid.split("-")[0] for sid in ids}
    assert pending <= trained_groups, "finished groups from before the crash were lost"
    state = json.loads((run_dir / "checkpoints" / "step-00000004" / "trainer_state.json").read_text())
    assert set(state["extra"]["trained_groups"]) == trained_groups
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000003", "step-00000004"]


def start_run(cfg: Path, run_dir: Path, log: Path) -> subprocess.Popen:
    """``lgt-train run`` in the background, its output in ``log``."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "lgt.trainer.cli", "run", str(cfg), "--run-dir",
                                 str(run_dir)], stdout=out, stderr=subprocess.STDOUT, env=env)


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, log: Path, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while not ((run_dir / "metrics.jsonl").exists() and len(metrics(run_dir)) >= step):
        assert proc.poll() is None, f"lgt-train exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no step {step} after {timeout:.0f} s"
        time.sleep(0.2)


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.NoSuchProcess:  # a rollout's process that ended meanwhile
        return []


def _child(proc: subprocess.Popen, marker: str) -> psutil.Process:
    found = [p for p in psutil.Process(proc.pid).children(recursive=True)
             if any(marker in part for part in _cmdline(p))]
    assert found, f"no process of lgt-train has {marker!r} in its command line"
    return min(found, key=lambda p: p.pid)  # the first started: the engine's API server, not its core


def test_engine_and_proxy_killed_mid_run_are_started_again(tmp_path: Path, arith_model_dir: Path) -> None:
    """Also: a policy served under a name of the config's (``engine.served_model_name``), which the
    started proxy, the warm-up and the restarted engine and proxy all use."""
    run_dir, log = tmp_path / "run", tmp_path / "lgt-train.log"
    cfg = write_config(tmp_path, arith_model_dir, steps=4, restarts=2,
                       engine={"max_model_len": 256, "served_model_name": "qwen-named"})
    proc = start_run(cfg, run_dir, log)
    try:
        _wait_for_step(run_dir, 1, proc, log)
        engine = _child(proc, "vllm.entrypoints.openai.api_server")
        engine.kill()  # kill -9, while agents are calling it
        _wait_for_step(run_dir, 2, proc, log)
        proxy = _child(proc, "--flush-seconds")  # lgt-proxy as the run starts it
        proxy.kill()
        assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = " ".join(log.read_text().split())
    assert f"the vLLM engine (pid {engine.pid}) exited with code -9; starting it again" in text
    assert "lgt-proxy exited with code -9; starting it again" in text
    assert "(restart 2 of 2)" in text and "is back after" in text
    if "every rollout failed" in text:  # groups cut short by a kill: never trained, and the summary says so
        assert "groups that failed whole (not trained)" in text
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]
    assert not engine.is_running() and not proxy.is_running()
    con = connect(run_dir / "store")
    calls = con.execute("SELECT status, policy_version, len(response_token_ids), len(response_logprobs) "
                        "FROM calls").fetchall()
    served, = con.execute("SELECT list(DISTINCT served_model) FROM calls WHERE status = 'ok'").fetchone()
    refused, = con.execute("SELECT count(*) FROM calls WHERE error LIKE '%does not exist%'").fetchone()
    con.close()
    assert calls and all(n > 0 and n == m for status, _, n, m in calls if status == "ok")  # none half-written
    assert served == ["qwen-named"] and refused == 0
    assert max(v for _, v, _, _ in calls) >= 3  # the restarted engine and proxy served the later policies


def test_restarts_are_bounded_then_the_run_stops_with_one_sentence(tmp_path: Path, arith_model_dir: Path,
                                                                   arith_engine: Engine) -> None:
    # the bound is the same for the engine and the proxy (Supervisor._restart): the proxy the run started
    # is killed here, on the session's engine (an engine killed and started again: the test above)
    run_dir, log = tmp_path / "run", tmp_path / "lgt-train.log"
    cfg = write_config(tmp_path, arith_model_dir, engine_url=arith_engine.url, steps=20, restarts=0)
    proc = start_run(cfg, run_dir, log)
    try:
        _wait_for_step(run_dir, 1, proc, log)
        _child(proc, "--flush-seconds").kill()  # lgt-proxy as the run starts it
        assert proc.wait(timeout=120) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    text = " ".join(log.read_text().split())
    assert "exited with code -9 — and the run has restarted its engine or proxy 0 times already " \
           "(restarts: 0); resume it with --resume once the cause is fixed" in text, text[-3000:]


def test_sync_mode_trains_each_batch_of_the_current_policy(tmp_path: Path, arith_model_dir: Path,
                                                           arith_engine: Engine) -> None:
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path, arith_model_dir, engine_url=arith_engine.url, mode="sync", steps=2)
    out = lgt_train(str(cfg), "--run-dir", str(run_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/staleness_max"] == 0 and r["perf/in_flight_at_pause"] == 0 for r in rows)
    assert all(r["groups"] == 2 for r in rows)


def test_an_agent_that_never_runs_ends_the_run_with_its_error(tmp_path: Path, arith_model_dir: Path,
                                                              arith_engine: Engine) -> None:
    agent = {"command": [sys.executable, "-c", "import sys; sys.exit('cannot reach my sandbox')"],
             "timeout_s": 30, "retries": 1}
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path, arith_model_dir, engine_url=arith_engine.url, agent=agent)
    out = lgt_train(str(cfg), "--run-dir", str(run_dir))
    assert out.returncode == 1
    err = " ".join(out.stderr.split())
    assert "the agent failed in every rollout of the first 2 groups" in err, out.stderr[-2000:]
    assert "cannot reach my sandbox" in err
    assert not (run_dir / "metrics.jsonl").exists()  # nothing was trained


VERL_PYTHON = ROOT / ".venv-verl" / "bin" / "python"


@pytest.mark.skipif(not VERL_PYTHON.exists() or os.environ.get("LGT_SKIP_VERL") == "1",
                    reason="no verl environment (.venv-verl; scripts/setup.sh builds it)")
def test_verl_on_two_ray_ranks_trains_checkpoints_and_resumes(tmp_path: Path, arith_model_dir: Path,
                                                              arith_engine: Engine) -> None:
    # lgt-train runs in this (vLLM's) environment; the verl backend moves the trainer into .venv-verl,
    # where verl's own Ray worker groups train on 2 CPU ranks; the engine stays on this vLLM (the
    # session's, into which the verl ranks' weights are pushed)
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path, arith_model_dir, engine_url=arith_engine.url, steps=2)
    sets = ["--set", "backend.name=verl", "--set", "backend.world_size=2", "--set", "backend.lr=1e-3"]
    out = lgt_train(str(cfg), "--run-dir", str(run_dir), *sets)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"the verl backend runs in {VERL_PYTHON}" in out.stderr
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and {r["backend"] for r in rows} == {"verl"}
    assert all(r["perf/sync_s"] > 0 and "actor/grad_norm" in r and "batch/tokens" in r for r in rows)
    ckpt = run_dir / "checkpoints" / "step-00000002"
    assert (ckpt / "DONE").exists() and (ckpt / "model.safetensors").exists()
    assert sorted(p.name for p in (ckpt / "verl").glob("model_world_size_2_rank_*.pt")) == [
        "model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"]
    # resumed as a user would, with the same config file and without the --set: the run goes on as it
    # was configured (verl on 2 ranks), and says which keys of the file it leaves unused
    out = lgt_train(str(cfg), "--resume", str(run_dir), "--steps", "3")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming from step-00000002: step 2, policy version 2" in out.stderr
    assert "run.yaml differs in backend, which stay as they were" in " ".join(out.stderr.split())
    saved = json.loads((run_dir / "config.json").read_text())
    assert (saved["backend"]["name"], saved["backend"]["world_size"], saved["steps"]) == ("verl", 2, 3)
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    ids = trained_ids(rows)
    assert len(ids) == len(set(ids)), "a sample was trained twice"
    # step 3 trains policy version 2, so (max_staleness 1) only calls served on weights the verl ranks
    # trained and synced (version 1 or later) may be in it; whether any call of version 2 finished before
    # the run ended is a matter of timing, since groups finished before the restart are trained first
    con = connect(run_dir / "store")
    step3 = sorted({sid.split("~")[0] for sid in rows[-1]["sample_ids"]})
    oldest = con.execute("SELECT min(policy_version) FROM calls WHERE list_contains(?, rollout_id)",
                         [step3]).fetchone()[0]
    assert oldest >= 1
