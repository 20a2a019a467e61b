"""The recipe's components driven in process, no vLLM and no proxy: the group scheduler over a real
store in ``tmp_path``, the supervisor restarting fakes that die, the run log's files, the evaluator."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from lgt.store.ingest import add_rollout
from lgt.trainer.run import admission, evaluation, scheduler
from lgt.trainer.run.progress import Progress
from lgt.trainer.run.runlog import RunLog, finish, metric_rows, step_row
from lgt.trainer.run.scheduler import GroupScheduler, finished_groups, next_group, recorded_attempts
from lgt.trainer.run.stopping import TARGET_WINDOW, StopRules
from lgt.trainer.run.supervisor import Supervisor
from lgt.trainer.serving.launch import EngineError
from lgt.trainer.serving.proxy import ProxyError
from lgt.trainer.serving.sync import FullWeights

TASKS = [{"task_id": f"t{i}", "question": f"{i}+1"} for i in range(3)]


@dataclass
class Result:
    """What the rollout controller's ``run`` returns, as far as the scheduler and the run log read it."""

    rollout_id: str
    status: str = "ok"
    attempt: int = 0
    reward: float | None = 1.0
    seconds: float = 2.0
    error: str | None = None
    stderr_path: str = "stderr.txt"

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class Controller:
    """A rollout controller whose rollouts end as ``statuses`` says (by rollout id; default ok)."""

    statuses: dict[str, str] = field(default_factory=dict)
    jobs: list[dict[str, str]] = field(default_factory=list)
    calls: list[tuple[str, str, int, int]] = field(default_factory=list)
    closed: bool = False
    done: int = 0
    failed: int = 0

    async def run(self, task: dict, rollout_id: str, group_id: str, version: int, *, first_attempt: int = 0,
                  **kw: Any) -> Result:
        self.calls.append((task["task_id"], rollout_id, version, first_attempt))
        await asyncio.sleep(0)
        status = self.statuses.get(rollout_id, "ok")
        self.done += 1
        self.failed += status != "ok"
        return Result(rollout_id, status, first_attempt)

    async def existing_jobs(self) -> list[dict[str, str]]:
        return self.jobs

    async def aclose(self) -> None:
        self.closed = True


def make_scheduler(store: Path, controller: Controller, *, mode: str = "async", group_size: int = 2,
                   batch_groups: int = 1, max_inflight: int = 100, max_staleness: int = 1,
                   progress: Progress | None = None, lines: list[str] | None = None) -> GroupScheduler:
    limits = admission.Limits(mode, group_size, batch_groups, max_inflight, max_staleness)
    out = lines if lines is not None else []
    return GroupScheduler(controller, store, TASKS, limits, seed=0, retries=1,
                          progress=progress or Progress(), rollouts_dir=store.parent / "rollouts",
                          log=out.append)


def record(store: Path, group: str, k: int, task: str, *, step: int = 0, attempt: int = 0,
           status: str = "ok", split: str | None = None) -> None:
    add_rollout(store, f"{group}-{k}", attempt=attempt, task_id=task, group_id=group, step=step,
                status=status, split=split)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    path = tmp_path / "store"
    path.mkdir()
    return path


# -- the group scheduler over a real store --------------------------------------------------------

def test_group_numbers_go_on_after_the_stores_highest_training_group(store: Path) -> None:
    assert next_group(store) == 0  # an empty store
    record(store, "g000004", 0, "t0")
    record(store, "g000001", 0, "t1")
    add_rollout(store, "e000009-00000-g", task_id="t2", group_id="e000009-00000", split="eval")
    assert next_group(store) == 5  # eval groups (e…) do not count


def test_a_resume_trains_the_finished_untrained_groups_and_nothing_else(store: Path) -> None:
    record(store, "g000000", 0, "t0")
    record(store, "g000000", 1, "t0")  # finished and trained (in the checkpoint)
    record(store, "g000001", 0, "t1", step=3)
    record(store, "g000001", 1, "t1", step=2, attempt=0, status="failed")
    record(store, "g000001", 1, "t1", step=2, attempt=1)  # finished, after a retry: to train
    record(store, "g000002", 0, "t2")  # one rollout of two: unfinished, run again from scratch
    record(store, "g000003", 0, "gone")
    record(store, "g000003", 1, "gone")  # a task no longer in the tasks file
    progress = Progress(trained_groups={"g000000"})
    lines: list[str] = []
    s = make_scheduler(store, Controller(), progress=progress, lines=lines)
    s.recover(resume=True)
    ready = [(g.group_id, g.task["task_id"], g.version, g.pending) for g in s.ready]
    assert ready == [("g000001", "t1", 2, 0)]
    assert list(s.groups) == ["g000001"]
    assert s.next_group == 4
    assert lines == ["1 finished group(s) from before the restart will be trained"]
    assert s.batch_ready()
    assert [g.group_id for g in s.take_batch()] == ["g000001"] and s.ready == []


def test_a_new_run_on_a_store_recovers_nothing(store: Path) -> None:
    record(store, "g000000", 0, "t0")
    record(store, "g000000", 1, "t0")
    s = make_scheduler(store, Controller())
    s.recover(resume=False)
    assert s.ready == [] and s.next_group == 1
    assert finished_groups(store, TASKS, 2, set())[0].group_id == "g000000"


def test_async_admission_launches_within_the_staleness_bound(store: Path) -> None:
    async def go() -> None:
        progress = Progress()
        s = make_scheduler(store, Controller(), batch_groups=2, max_staleness=1, progress=progress)
        s.recover(resume=False)
        s.begin()
        s.launch()
        # launched ≤ (updates + 1 + max_staleness) · batch_groups = (0 + 1 + 1) · 2
        assert s.next_group == 4 and s.running == 8
        s.launch()
        assert s.next_group == 4
        progress.version += 1  # one update: two more groups may start, at the new version
        s.launch()
        assert s.next_group == 6
        assert [g.version for g in s.groups.values()] == [0, 0, 0, 0, 1, 1]
        assert [g.task["task_id"] for g in s.groups.values()] == \
            [TASKS[admission.task_index(0, 3, i)]["task_id"] for i in range(6)]
        await s.stop_rollouts()

    asyncio.run(go())


def test_async_admission_starts_no_group_past_what_the_run_has_left_to_train(store: Path) -> None:
    async def go() -> None:
        progress, left = Progress(), {"n": 1}
        s = make_scheduler(store, Controller(), batch_groups=2, max_staleness=3, progress=progress)
        s.groups_left = lambda: left["n"]
        s.recover(resume=False)
        s.begin()
        s.launch()
        # the staleness bound allows (0 + 1 + 3) · 2 = 8 groups; one left to train + a spare batch of 2
        assert s.next_group == 3
        left["n"] = None  # a time limit: only the staleness bound
        s.launch()
        assert s.next_group == 8
        await s.stop_rollouts()

    asyncio.run(go())


def test_sync_admission_launches_one_batch_and_waits_for_all_of_it(store: Path) -> None:
    async def go() -> None:
        ctl = Controller()
        s = make_scheduler(store, ctl, mode="sync", batch_groups=2)
        s.recover(resume=False)
        s.begin()
        s.launch()
        assert s.next_group == 2 and not s.batch_ready()
        while s.running:
            await s.wait(0.05)
        assert s.batch_ready() and s.counts() == (0, 4, 0)
        s.launch()
        assert s.next_group == 2  # the batch is complete: nothing more until it is trained
        batch = s.take_batch()
        s.trained(batch)
        assert s.groups == {} and [g.group_id for g in batch] == ["g000000", "g000001"]

    asyncio.run(go())


def test_groups_whose_every_rollout_failed_end_a_run_whose_agent_never_worked(store: Path) -> None:
    async def go() -> None:
        failing = {f"g{i:06d}-{k}": "failed" for i in range(3) for k in range(2)}
        lines: list[str] = []
        s = make_scheduler(store, Controller(statuses=failing), batch_groups=1, lines=lines)
        s.recover(resume=False)
        s.begin()
        s.launch()
        while s.running:
            await s.wait(0.05)
        assert s.failed_groups == 2 and s.ready == [] and s.groups == {}
        assert s.fatal is not None and s.fatal.startswith(
            "the agent failed in every rollout of the first 2 groups, so it does not run here; its last "
            "attempt: status failed (stderr.txt)")
        assert any(line.startswith("group g000000: every rollout failed; see ") for line in lines)
        assert s.failed_since_last() == 2 and s.failed_since_last() == 0
        # failed groups leave the staleness window: the next launches are not held up by them
        s.launch()
        assert s.next_group == 4

    asyncio.run(go())


def test_one_ok_rollout_makes_a_group_trainable(store: Path) -> None:
    async def go() -> None:
        s = make_scheduler(store, Controller(statuses={"g000000-0": "timeout"}), batch_groups=1)
        s.recover(resume=False)
        s.begin()
        s.start_group()
        while s.running:
            await s.wait(0.05)
        assert [g.group_id for g in s.ready] == ["g000000"] and s.fatal is None
        assert sorted(r.status for r in s.ready[0].results) == ["ok", "timeout"]

    asyncio.run(go())


def test_jobs_that_outlived_the_trainer_are_adopted_and_nothing_is_run_twice(store: Path) -> None:
    # g000003: rollout 0's first Job still runs (adopted), rollout 1 ended ok (its Job is gone): not run
    # again. g000004: rollout 0 failed attempt 0 and its attempt-1 Job runs (adopted); rollout 1 has no
    # record and no Job: run from attempt 0. g000006: rollout 0 failed its last attempt (retries=1) and
    # is not run again; rollout 1 is. g000008: only Jobs, nothing recorded. g000002: already trained.
    record(store, "g000003", 1, "t0")
    record(store, "g000004", 0, "t1", status="failed")
    record(store, "g000006", 0, "t2", attempt=0, status="failed")
    record(store, "g000006", 0, "t2", attempt=1, status="failed")
    jobs = [{"group": "g000003", "rollout": "g000003-0", "attempt": "0", "task": "t0", "step": "5"},
            {"group": "g000004", "rollout": "g000004-0", "attempt": "1", "task": "t1", "step": "6"},
            {"group": "g000004", "rollout": "g000004-0", "attempt": "2", "task": "t1", "step": "6",
             "role": "evaluator"},
            {"group": "g000006", "rollout": "g000006-0", "attempt": "1", "task": "t2", "step": "7"},
            {"group": "g000008", "rollout": "g000008-1", "attempt": "0", "task": "t0", "step": "8"},
            {"group": "g000002", "rollout": "g000002-0", "attempt": "0", "task": "t2", "step": "1"},
            {"group": "e000001-00000", "rollout": "e000001-00000-g", "attempt": "0", "task": "t2"}]
    assert recorded_attempts(store, ["g000003", "g000006"]) == {
        "g000003-1": {0: "ok"}, "g000006-0": {0: "failed", 1: "failed"}}

    async def go() -> tuple[GroupScheduler, Controller, list[str]]:
        ctl = Controller(jobs=jobs)
        lines: list[str] = []
        s = make_scheduler(store, ctl, batch_groups=2, progress=Progress(trained_groups={"g000002"}),
                           lines=lines)
        s.recover(resume=True)
        assert s.ready == [] and s.next_group == 7
        await s.adopt_jobs()
        while s.running:
            await s.wait(0.05)
        return s, ctl, lines

    s, ctl, lines = asyncio.run(go())
    assert sorted(ctl.calls) == [("t0", "g000003-0", 5, 0), ("t0", "g000008-0", 8, 0),
                                 ("t0", "g000008-1", 8, 0), ("t1", "g000004-0", 6, 1),
                                 ("t1", "g000004-1", 6, 0), ("t2", "g000006-1", 7, 0)]
    assert lines[-1] == "resumed 5 group(s) whose Jobs outlived the last run: 3 Job(s) adopted"
    assert {g.group_id: g.recovered_ok for g in s.ready} == {"g000003": 1, "g000004": 0, "g000006": 0,
                                                             "g000008": 0}
    assert s.next_group == 9


def test_a_group_recovery_counts_finished_is_adopted_while_its_retry_job_still_runs(store: Path) -> None:
    """Every rollout of g000010 has a recorded attempt (rollout 0's attempt 0 failed, rollout 1 ok), but
    the Job of rollout 0's retry (attempt 1) outlived the trainer: the group waits for that Job instead
    of being trained without it."""
    record(store, "g000010", 0, "t1", step=3, status="failed")
    record(store, "g000010", 1, "t1", step=3)
    jobs = [{"group": "g000010", "rollout": "g000010-0", "attempt": "1", "task": "t1", "step": "3"}]

    async def go() -> tuple[GroupScheduler, Controller, list[str], list[str]]:
        ctl = Controller(jobs=jobs)
        lines: list[str] = []
        s = make_scheduler(store, ctl, progress=Progress(), lines=lines)
        s.recover(resume=True)
        recovered = [g.group_id for g in s.ready]
        await s.adopt_jobs()
        while s.running:
            await s.wait(0.05)
        return s, ctl, lines, recovered

    s, ctl, lines, recovered = asyncio.run(go())
    assert recovered == ["g000010"]  # what the store alone says
    assert ctl.calls == [("t1", "g000010-0", 3, 1)]  # the retry's Job, adopted
    assert [(g.group_id, g.recovered_ok) for g in s.ready] == [("g000010", 1)]
    assert lines[-1] == "resumed 1 group(s) whose Jobs outlived the last run: 1 Job(s) adopted"


def test_the_sql_queries_live_in_a_file_next_to_the_scheduler() -> None:
    assert sorted(scheduler.QUERIES) == ["next_group", "recorded_attempts", "recorded_groups"]
    assert all(q.startswith("SELECT") for q in scheduler.QUERIES.values())


# -- the supervisor ----------------------------------------------------------------------------------

@dataclass
class EngineCfg:
    port: int = 0


@dataclass
class FakeEngine:
    port: int = 8100
    died: bool = False
    attached: bool = False
    cfg: EngineCfg = field(default_factory=EngineCfg)
    stopped: bool = False
    base_url: str = "http://127.0.0.1:8100"
    updates: list[list[Any]] = field(default_factory=list)

    def check_alive(self) -> None:
        if self.died:
            raise EngineError(f"the vLLM engine (pid 42) exited with code -9; its log: {self.port}.log")

    def stop(self, timeout: float = 30) -> None:
        self.stopped = True

    def update_weights(self, weights: Any) -> None:
        self.updates.append(list(weights))


class FakeProxy:
    def __init__(self) -> None:
        self.dead = False
        self.calls: list[tuple[Any, ...]] = []
        self.replicas: list[Any] = []

    def check_alive(self) -> None:
        if self.dead:
            raise ProxyError("lgt-proxy exited with code -9; its log: proxy.log")

    def restart_dead(self, version: int, served_model: str | None = None) -> bool:  # ProxyGroup's
        self.calls.append(("restart_dead", version) if served_model is None else
                          ("restart_dead", version, served_model))
        self.dead = False
        return True

    def pause(self, timeout: float = 120) -> dict:
        self.calls.append(("pause", timeout))
        return {"drained": True}

    def resume(self, version: int, served_model: str | None = None, served: dict | None = None) -> dict:
        self.calls.append(("resume", version) if served_model is None and not served else
                          ("resume", version, served_model, served))
        return {}


def make_supervisor(tmp_path: Path, restarts: int, progress: Progress) -> tuple[Supervisor, list[str]]:
    lines: list[str] = []
    sup = Supervisor(None, None, store=tmp_path, store_url=tmp_path, logs_dir=tmp_path, seed=0,  # type: ignore[arg-type]
                     restarts=restarts, progress=progress, log=lines.append)
    sup.engine, sup.proxy = FakeEngine(), FakeProxy()
    return sup, lines


def test_a_dead_engine_is_started_again_with_the_current_weights(tmp_path, monkeypatch) -> None:
    from lgt.trainer.serving import engine as enginemod

    started: list[EngineCfg] = []
    monkeypatch.setattr(enginemod.Engine, "start",
                        lambda cfg: started.append(cfg) or FakeEngine(port=cfg.port))
    progress = Progress(version=3, version_at_start=1)
    sup, lines = make_supervisor(tmp_path, 2, progress)
    sup.sync = FullWeights(lambda: iter([("w", 1)]))  # a full-weights run: the backend's named_weights
    old = sup.engine
    old.died = True
    asyncio.run(sup.keep_alive())
    assert old.stopped and sup.engine is not old and started == [EngineCfg(port=8100)]
    # two updates since the weights the engine starts from: the new engine gets the current ones
    assert sup.engine.updates == [[("w", 1)]] and old.updates == []
    assert sup.proxy.calls == [("pause", 10), ("resume", 3)]  # new calls held while it starts
    assert lines[0] == ("the vLLM engine (pid 42) exited with code -9; starting it again at policy "
                        "version 3 (restart 1 of 2)")
    assert lines[1].startswith("the vLLM engine is back after ")
    asyncio.run(sup.keep_alive())  # alive now: nothing happens
    assert sup.restarts == 1 and len(lines) == 2


def test_a_dead_proxy_is_started_again_and_paused_when_the_step_had_paused_it(tmp_path) -> None:
    sup, lines = make_supervisor(tmp_path, 1, Progress(version=2))
    sup.proxy.dead = True
    asyncio.run(sup.keep_alive(paused=True))
    assert sup.proxy.calls == [("restart_dead", 2), ("pause", 10)]
    assert lines[0].startswith("lgt-proxy exited with code -9; starting it again")
    sup.proxy.dead = True  # one death more than restarts allows ends the run
    with pytest.raises(RuntimeError, match=r"^lgt-proxy exited with code -9 — and the run has restarted its "
                                           r"engine or proxy 1 times already \(restarts: 1\)"):
        asyncio.run(sup.keep_alive())


def test_a_call_that_failed_because_the_engine_died_runs_again_once_it_is_back(tmp_path, monkeypatch) -> None:
    from lgt.trainer.serving import engine as enginemod

    monkeypatch.setattr(enginemod.Engine, "start", lambda cfg: FakeEngine(port=cfg.port))
    sup, _ = make_supervisor(tmp_path, 3, Progress())
    tries: list[Any] = []

    def push() -> str:
        tries.append(sup.engine)
        if sup.engine.died:
            raise EngineError("connection refused")
        return "pushed"

    sup.engine.died = True
    assert asyncio.run(sup.alive(push, paused=True)) == "pushed"
    assert len(tries) == 2 and tries[0] is not tries[1] and sup.restarts == 1

    def broken() -> None:  # an engine error with everything alive is the caller's to see
        raise EngineError("bad request")

    with pytest.raises(EngineError, match="bad request"):
        asyncio.run(sup.alive(broken, paused=False))


# -- the run log ----------------------------------------------------------------------------------

def row_for(step: int, reward: float, **extra: Any) -> dict[str, Any]:
    return step_row(step=step, version=step, time_s=1.23456, columns={"mode": "async", "backend": "torch"},
                    groups=2,
                    prepared={"samples": 8, "rollout/reward_mean": reward, "rollout/staleness_max": 1},
                    results=[Result("a", "ok", 0, seconds=2.0), Result("b", "timeout", 1, seconds=4.0),
                             Result("c", "failed", 2, seconds=0.0)],
                    groups_failed=1, sample_ids=[f"s{step}"], running=3,
                    pause={"drain_seconds": 0.5, "in_flight_at_pause": 2, "drained": False, "in_flight": 1},
                    perf={"perf/train_s": 1.5, "perf/sync_s": 0.25}, update_s=3.14159, paused_s=2.0,
                    metrics={"loss/pg": 0.1, "tokens_per_s": 100.0, "note": "not a number"}, **extra)


def test_a_steps_row_counts_its_rollouts_and_times(tmp_path: Path) -> None:
    row = row_for(1, 0.5)
    assert row == {
        "step": 1, "version": 1, "time_s": 1.235, "mode": "async", "backend": "torch", "groups": 2,
        "samples": 8, "rollout/reward_mean": 0.5, "rollout/staleness_max": 1,
        "rollout/failed": 1, "rollout/timeout": 1, "rollout/retried": 2, "rollout/groups_failed": 1,
        "rollout/duration_mean": 2.0, "sample_ids": ["s1"], "rollout/running": 3, "perf/drain_s": 0.5,
        "perf/in_flight_at_pause": 2, "perf/undrained_calls": 1, "perf/train_s": 1.5, "perf/sync_s": 0.25,
        "perf/update_s": 3.1416, "perf/paused_s": 2.0, "loss/pg": 0.1, "tokens_per_s": 100.0}


def test_the_run_log_writes_metrics_shows_each_step_and_keeps_the_recent_rewards(tmp_path: Path) -> None:
    shown: list[str] = []
    log = RunLog(tmp_path, lambda stats, line: shown.append(line), steps=20)
    log.follow(lambda: (5, 7, 1))
    for step in range(1, TARGET_WINDOW + 3):
        log.step(row_for(step, step / 100))
    log.step(row_for(TARGET_WINDOW + 3, float("nan")))  # no reward: the window keeps the last ones
    rows = metric_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, TARGET_WINDOW + 4))
    assert math.isnan(rows[-1]["rollout/reward_mean"])
    assert log.recent_rewards == [s / 100 for s in range(3, TARGET_WINDOW + 3)]
    assert shown[0] == ("step 1/20  reward 0.010  samples 8  staleness≤1  drain 0.50s  train 1.50s  "
                        "sync 0.25s")
    s = log.stats
    assert (s.step, s.running, s.done, s.failed, s.tokens_per_s) == (TARGET_WINDOW + 3, 5, 7, 1, 100.0)

    again = RunLog(tmp_path)  # a resumed run at step 4 sees the rewards of steps 1-4 only
    again.restore(4)
    assert again.recent_rewards == [0.01, 0.02, 0.03, 0.04]


def test_finish_writes_the_summary_and_a_csv_without_sample_ids(tmp_path: Path) -> None:
    log = RunLog(tmp_path, steps=2)
    log.step(row_for(1, 0.25))
    log.step(row_for(2, 0.75))
    log.rollout(Result("g000000-0"))
    finish(tmp_path, None, stopped="step limit (2 steps)")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stopped"] == "step limit (2 steps)"
    header, *lines = (tmp_path / "metrics.csv").read_text().splitlines()
    assert header.split(",")[:3] == ["step", "time_s", "version"] and "sample_ids" not in header
    assert len(lines) == 2
    assert json.loads((tmp_path / "rollouts.jsonl").read_text())["rollout_id"] == "g000000-0"
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))


def test_stop_rules_say_which_limit_ends_training() -> None:
    rules = StopRules(steps=5, max_minutes=2.0, max_samples=100, target_reward=0.8)
    assert rules.limit(step=4, minutes=1.9, samples=99) is None
    assert rules.limit(step=5, minutes=3, samples=200) == "step limit (5 steps)"
    assert rules.limit(step=4, minutes=2.0, samples=200) == "time limit (2 min)"
    assert rules.limit(step=4, minutes=0, samples=100) == "sample limit (100 samples)"
    assert rules.target([0.9] * (TARGET_WINDOW - 1)) is None  # not a full window yet
    assert rules.target([0.7] + [0.9] * (TARGET_WINDOW - 1)) == pytest.approx(0.88)
    assert rules.target([0.0] + [0.85] * (TARGET_WINDOW - 1)) is None  # mean 0.765
    assert StopRules(steps=5).target([1.0] * TARGET_WINDOW) is None


def test_stop_rules_say_how_many_groups_the_run_has_left_to_train() -> None:
    assert StopRules(steps=5).groups_left(step=3, samples=0, batch_groups=4, samples_per_group=8) == 8
    rules = StopRules(steps=10, max_samples=100)
    # 100 - 40 samples left at 8 a group: 8 groups, fewer than the 6 steps' 24
    assert rules.groups_left(step=4, samples=40, batch_groups=4, samples_per_group=8) == 8
    assert rules.groups_left(step=4, samples=40, batch_groups=4, samples_per_group=2.5) == 24
    assert rules.groups_left(step=4, samples=120, batch_groups=4, samples_per_group=8) == 0
    assert rules.groups_left(step=4, samples=40, batch_groups=4, samples_per_group=0) == 24  # none given yet


def test_progress_round_trips_through_a_checkpoint() -> None:
    p = Progress()
    p.trained(["g000001", "g000000"], 12)
    p.trained(["g000002"], 5)
    back = Progress.from_checkpoint(json.loads(json.dumps(p.checkpoint())))
    assert back.checkpoint() == {"version": 2, "step": 2, "trained_groups": ["g000000", "g000001", "g000002"],
                                 "trained_samples": 17}
    assert back.version_at_start == 2 and back.updates_this_run == 0


# -- the evaluator --------------------------------------------------------------------------------

def test_the_evaluator_runs_once_per_step_and_records_each_evaluation(tmp_path: Path) -> None:
    calls: list[tuple[str, bool]] = []

    async def run_rollout(task, rollout_id, group, step, *, split, greedy=False) -> Result:
        calls.append((rollout_id, greedy))
        return Result(rollout_id, reward=1.0 if greedy else 0.5)

    lines: list[str] = []
    woken: list[int] = []
    cfg = evaluation.EvalConfig(split=0.5, every=2, samples=1)
    ev = evaluation.Evaluator(cfg, TASKS[:2], run_rollout, tmp_path, log=lines.append, elapsed=lambda: 7.0,
                              on_done=lambda: woken.append(1))

    async def go() -> None:
        ev.start(0, 0)
        assert ev.running
        await ev.wait()
        ev.start(0, 0)  # this step was evaluated: not again
        assert not ev.running
        assert [ev.due(s) for s in (1, 2, 3)] == [False, True, False]
        await ev.final(0, 0)  # evaluated just now: not again

    asyncio.run(go())
    assert len(calls) == 4 and woken == [1]
    rows = [json.loads(x) for x in (tmp_path / evaluation.EVAL_FILE).read_text().splitlines()]
    assert [(r["step"], r["eval/reward_greedy"], r["eval/reward_sampled"], r["time_s"]) for r in rows] == \
        [(0, 1.0, 0.5, 7.0)]
    assert lines[0].startswith("eval at step 0 (policy v0):  greedy 1.000  sampled 0.500  (4 rollouts, "
                               "0 failed")
    resumed = evaluation.Evaluator(cfg, TASKS[:2], run_rollout, tmp_path, log=lines.append, elapsed=lambda: 0)
    resumed.resume(0)
    assert resumed.last_step == 0
    resumed.resume(2)
    assert resumed.last_step is None


def test_without_an_eval_section_the_evaluator_does_nothing(tmp_path: Path) -> None:
    async def run_rollout(*a: Any, **kw: Any) -> Result:
        raise AssertionError("no evaluation without an eval section")

    ev = evaluation.Evaluator(None, [], run_rollout, tmp_path, log=print, elapsed=lambda: 0.0)

    async def go() -> None:
        ev.start(0, 0)
        await ev.final(3, 3)

    asyncio.run(go())
    assert not ev.enabled and not ev.due(0) and not (tmp_path / evaluation.EVAL_FILE).exists()
