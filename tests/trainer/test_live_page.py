"""The live run page (``lgt-train serve``, ``lgt-train run --serve``): its data from a store and a run's
files, the server's guarantees, and the page itself in a real browser (Debian's chromium driven by
Playwright) during a real CPU run. Screenshots go to ``$LGT_TEST_ARTIFACTS`` (default
``test-artifacts/``) for a person to look at.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from lgt.store.ingest import add_reward, add_rollout
from lgt.store.writer import TableWriter
from lgt.testing.runs import ROOT, metrics, write_config
from lgt.testing.store import byte_tokenizer, call_row, make_store, tool_rollout
from lgt.trainer.report import live, run_view, tails

if TYPE_CHECKING:
    from lgt.trainer.serving.engine import Engine

ARTIFACTS = Path(os.environ.get("LGT_TEST_ARTIFACTS") or ROOT / "test-artifacts")
SECRET = "sk-agent-secret-not-for-the-page"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run folder as a run leaves it: config.json (with a secret in the agent's env), metrics, an
    eval row, trained.jsonl, and a store with r-ok (trained, advantage 0.75), r-fail, r-err, r-break
    (its second call does not extend the first: the merge breaks) and r-eval (held-out)."""
    run = tmp_path / "run"
    store = make_store(run / "store")
    model = tmp_path / "model"
    model.mkdir()
    byte_tokenizer(model / "tokenizer.json")
    first, second = tool_rollout("r-break", "3+4", "7")
    rewritten = [{"role": "system", "content": "Answer with the number alone. " * 8},  # a new history
                 {"role": "user", "content": "3+4"}]
    second = call_row("r-break", 1, rewritten, {"role": "assistant", "content": "7"})
    with TableWriter(store, "calls") as w:
        for row in (first, second, *tool_rollout("r-eval", "5*5", "25")):
            w.append(row)
    add_rollout(store, "r-break", task_id="add", group_id="g1", step=1)
    add_reward(store, "r-break", 0.0)
    add_rollout(store, "r-eval", task_id="mult", group_id="e0", step=1, split="eval")
    add_reward(store, "r-eval", 1.0)
    (run / "config.json").write_text(json.dumps({
        "name": "live-test", "model": {"path": str(model)}, "mode": "async", "group_size": 2,
        "target_reward": 0.9, "agent": {"env": {"OPENAI_API_KEY": SECRET}, "sandbox": {"kind": "bwrap"}},
        "backend": {"name": "torch"}, "proxy": {"egress": "allowlist"}}))
    rows = [{"step": s, "version": s, "time_s": 2.0 * s, "rollout/reward_mean": 0.5 + 0.1 * s,
             "samples": 4, "perf/drain_s": 0.1, "rollout/staleness_max": 0, "sample_ids": ["x"]}
            for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "eval.jsonl").write_text(json.dumps({"step": 0, "version": 0, "eval/reward_greedy": 0.25,
                                                "eval/reward_sampled": 0.5}) + "\n")
    (run / "trained.jsonl").write_text(json.dumps({
        "step": 1, "version": 1, "sample_id": "r-ok~0#0", "rollout_id": "r-ok", "attempt": 0,
        "group_id": "g0", "reward": 1.0, "advantage": 0.75, "loss_weight": 0.05}) + "\n")
    return run


def test_the_rollout_table_filters_sorts_and_pages(run_dir: Path) -> None:
    view = run_view.RunView(run_dir)
    page = view.rollouts({})
    assert page["total"] == 5 and page["statuses"] == {"ok": 4, "failed": 1}
    by_id = {r["rollout_id"]: r for r in page["rows"]}
    ok = by_id["r-ok"]
    assert (ok["calls"], ok["calls_ok"], ok["reward"]) == (2, 2, 1.0)
    assert (ok["trained_step"], ok["advantage"]) == (1, 0.75)
    assert ok["generated"] == sum(len(c["response_token_ids"]) for c in tool_rollout("r-ok", "6*7", "42"))
    assert by_id["r-err"]["calls_ok"] == 1 and by_id["r-err"]["reward"] is None
    assert by_id["r-fail"]["status"] == "failed" and by_id["r-fail"]["trained_step"] is None

    assert [r["rollout_id"] for r in view.rollouts({"status": "failed"})["rows"]] == ["r-fail"]
    assert {r["rollout_id"] for r in view.rollouts({"task": "MUL"})["rows"]} == {"r-ok", "r-eval"}
    assert [r["rollout_id"] for r in view.rollouts({"split": "eval"})["rows"]] == ["r-eval"]
    assert [r["rollout_id"] for r in view.rollouts({"trained": "yes"})["rows"]] == ["r-ok"]
    rewarded = view.rollouts({"reward_min": "0.5", "split": "train"})["rows"]
    assert [r["rollout_id"] for r in rewarded] == ["r-ok"]
    ranked = [r["reward"] for r in view.rollouts({"sort": "reward", "desc": "0"})["rows"]]
    assert ranked == [0.0, 1.0, 1.0, None, None]  # rollouts without a reward last
    two = view.rollouts({"sort": "rollout_id", "desc": "0", "limit": "2", "offset": "2"})
    assert two["total"] == 5 and [r["rollout_id"] for r in two["rows"]] == ["r-eval", "r-fail"]
    for query, words in (({"sort": "reward; DROP TABLE calls"}, "cannot sort by"),
                         ({"step": "two"}, "step must be a whole number"),
                         ({"colour": "red"}, "unknown parameter 'colour'")):
        with pytest.raises(ValueError, match=words):
            view.rollouts(query)


def test_a_trajectory_shows_trained_tokens_logprobs_advantages_and_merge_breaks(run_dir: Path) -> None:
    view = run_view.RunView(run_dir)
    t = view.trajectory("r-ok")
    assert t["decoded"] and t["trained"] == {"step": 1, "advantage": 0.75, "loss_weight": 0.05}
    assert t["reward"]["value"] == 1.0 and t["samples"] == 1 and t["excluded"] is None
    first, second = t["calls"]
    assert first["trained"] and second["trained"] and second["link"] == "extends"
    assert "".join(tok for tok, _ in second["tokens"]) == "It is 42."  # decoded one token at a time
    assert {lp for _, lp in second["tokens"]} == {-0.25}
    assert [m["role"] for m in second["messages"]] == ["tool"] and second["skipped"] == 3
    assert first["reply"]["tool_calls"] == ['calculator({"expression": "6*7"})']
    assert second["reward"]["value"] == 0.25  # the per-call reward

    broken = view.trajectory("r-break")
    assert broken["samples"] == 2 and broken["trained"] is None
    assert broken["calls"][1]["link"] == "differs"
    assert "does not extend the previous call" in broken["calls"][1]["link_text"]

    assert view.trajectory("r-fail")["excluded"] == "the rollout's status is failed"
    held_out = view.trajectory("r-eval")
    assert "held-out evaluation" in held_out["excluded"] and not any(c["trained"] for c in held_out["calls"])
    err = view.trajectory("r-err")["calls"][1]
    assert err["status"] == "http_error" and not err["trained"]
    assert err["excluded"] == "call status http_error"
    with pytest.raises(ValueError, match="'nope' is not in the store"):
        view.trajectory("nope")


def test_a_step_trained_between_two_looks_is_read_after_any_query(run_dir: Path, monkeypatch) -> None:
    """A page and a trajectory asked for, then trained.jsonl grows: the next look registers the new
    rows on the same connection (DuckDB 2 refuses that while a result is left half-read)."""
    monkeypatch.setattr(run_view, "REFRESH_S", 0.0)
    view = run_view.RunView(run_dir)
    row = {"step": 2, "version": 2, "sample_id": "r-break~0#0", "rollout_id": "r-break", "attempt": 0,
           "group_id": "g1", "reward": 0.0, "advantage": -0.5, "loss_weight": 0.05}
    for ask in (lambda: view.rollouts({"status": "ok"}), lambda: view.trajectory("r-ok")):
        ask()
        with (run_dir / "trained.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
            row = {**row, "step": row["step"] + 1}
        assert view.state()["steps"] == 2
    assert view.trajectory("r-break")["trained"]["step"] == 3  # the last step that trained it
    assert view.rollouts({"trained": "yes"})["total"] == 2


def test_files_are_read_as_they_grow_whole_lines_only(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = tails.Tail(path)
    assert tail.read() == []
    path.write_text('{"step": 1}\n{"step": 2, "note": "cut')
    assert [r["step"] for r in tail.read()] == [1]
    with open(path, "a") as f:
        f.write(' off"}\n{"step": 3}\n')
    assert [r["step"] for r in tail.read()] == [1, 2, 3]
    path.write_text('{"step": 1}\n')  # rewritten shorter (a resumed run): read again
    assert [r["step"] for r in tail.read()] == [1]

    rollouts = tmp_path / "rollouts.jsonl"  # a line per rollout: parsed in bulk, only seconds kept
    durations = tails.Durations(rollouts)
    rollouts.write_text('{"rollout_id": "a", "seconds": 1.5, "error": null}\n{"seconds": 2')
    assert durations.read() == [1.5]
    with open(rollouts, "a") as f:
        f.write('}\nnot json\n{"rollout_id": "c", "seconds": "x"}\n')  # torn by hand: line by line
    assert durations.read() == [1.5, 2.0, None]

    trained = tmp_path / "trained.jsonl"
    tail2 = tails.TrainedTail(trained)
    assert tail2.read_new() is None
    trained.write_text('{"step": 3, "rollout_id": "r", "attempt": 0, "advantage": -0.5, "loss_weight": 0.1,'
                       ' "sample_id": "r~0#0"}\n')
    assert tail2.read_new().to_pylist() == [{"rollout_id": "r", "attempt": 0, "step": 3, "advantage": -0.5,
                                             "loss_weight": 0.1}]
    assert tail2.read_new() is None
    trained.write_text("")
    with pytest.raises(tails.FileShrank):
        tail2.read_new()


def test_a_run_that_has_not_written_yet_is_an_empty_page_that_fills_in(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    run_view.REFRESH_S, before = 0.0, run_view.REFRESH_S
    try:
        view = run_view.RunView(run)
        assert view.rollouts({})["total"] == 0 and view.state()["steps"] == 0
        assert view.overview()["name"] == "run"
        (run / "store").mkdir()  # the store's folder first, its tables' files later
        assert view.rollouts({})["total"] == 0
        make_store(run / "store")
        (run / "config.json").write_text(json.dumps({"name": "late"}))
        assert view.rollouts({})["total"] == 3 and view.state()["store"][0] > 0
        assert view.overview()["name"] == "late"
    finally:
        run_view.REFRESH_S = before


def _get(url: str, *, host: str | None = None, method: str = "GET") -> tuple[int, str]:
    req = urllib.request.Request(url, method=method, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read(2_000_000).decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_the_server_is_read_only_on_loopback_and_shows_no_secret(run_dir: Path) -> None:
    page = live.Background(run_dir, "127.0.0.1", 0)
    url = page.start()
    try:
        bodies = []
        for path in ("", "api/overview", "api/metrics?since=1", "api/evals", "api/charts",
                     "api/rollouts?limit=500", "api/rollouts/r-ok"):
            code, body = _get(url + path)
            assert code == 200, (path, body)
            bodies.append(body)
        assert all(SECRET not in b for b in bodies)
        assert json.loads(bodies[2])["total"] == 2 and len(json.loads(bodies[2])["rows"]) == 1
        assert "sample_ids" not in bodies[2]
        assert json.loads(bodies[1])["settings"]["sandbox"] == "bwrap"
        assert _get(url + "api/overview", method="POST")[0] == 405
        code, body = _get(url + "api/overview", host="attacker.example:80")
        assert code == 403 and "answers on" in body
        code, body = _get(url + "api/rollouts?sort=nothing")
        assert code == 400 and "cannot sort by" in json.loads(body)["error"]
        assert _get(url + "api/rollouts/nope")[0] == 404
        with urllib.request.urlopen(url + "api/events", timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            first = json.loads(r.readline().decode().removeprefix("data: "))
        assert first["steps"] == 2 and first["evals"] == 1 and first["store"][0] > 0
    finally:
        page.stop()


def test_serve_refuses_a_folder_that_is_not_a_run_and_a_port_in_use(tmp_path: Path) -> None:
    import socket

    from lgt.testing.runs import lgt_train_cmd

    out = lgt_train_cmd("serve", str(tmp_path))
    assert out.returncode == 1 and "is not a run directory" in out.stderr
    (tmp_path / "metrics.jsonl").write_text("")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        out = lgt_train_cmd("serve", str(tmp_path), "--port", str(s.getsockname()[1]))
    assert out.returncode == 1 and "cannot serve the run page on 127.0.0.1:" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


# --- the page in a browser, during a real run -------------------------------------------------------

def _browser() -> str:
    pytest.importorskip("playwright.sync_api", reason="the browser test needs playwright (lgt[browser])")
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.skip("no chromium on PATH (scripts/setup.sh installs Debian's when run as root)")
    return path


def _until(page: Any, expression: str, timeout: float) -> None:
    """Poll ``expression`` in the page until it is true (the page's CSP forbids the eval that
    Playwright's own wait_for_function compiles its predicate with)."""
    deadline = time.monotonic() + timeout
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            page.screenshot(path=str(ARTIFACTS / "live-page" / "failed.png"), full_page=True)
            raise AssertionError(f"not true after {timeout:.0f} s: {expression}; the page says: "
                                 + page.inner_text("body")[:3000])
        time.sleep(0.25)


@pytest.mark.slow
def test_the_page_follows_a_real_run_in_a_browser(tmp_path: Path, arith_model_dir: Path,
                                                   arith_engine: Engine) -> None:
    from playwright.sync_api import sync_playwright

    chromium = _browser()
    shots = ARTIFACTS / "live-page"
    shots.mkdir(parents=True, exist_ok=True)
    run = tmp_path / "run"
    # a minute of training, whatever the number of steps: the page is checked while it goes on
    cfg = write_config(tmp_path, arith_model_dir, engine_url=arith_engine.url, steps=100_000, max_minutes=1)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.Popen([sys.executable, "-m", "lgt.trainer.cli", "run", str(cfg), "--run-dir", str(run),
                             "--serve", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    err_lines: list[str] = []
    found = threading.Event()

    def read_stderr() -> None:
        for line in proc.stderr:
            err_lines.append(line)
            if line.startswith("live run page: "):
                found.set()

    threading.Thread(target=read_stderr, daemon=True).start()
    problems: list[str] = []
    try:
        assert found.wait(60), "".join(err_lines)  # the page is up before the engine and the first step
        url = next(line for line in err_lines if line.startswith("live run page: ")).split(": ", 1)[1].strip()
        assert url.startswith("http://127.0.0.1:")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
                    if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.goto(url)
            _until(page, "document.body.dataset.steps !== undefined", 30)
            seen = int(page.evaluate("document.body.dataset.steps"))
            loads = page.evaluate("performance.getEntriesByType('navigation').length")
            # a step the page did not have when it loaded shows up without a reload
            _until(page, f"+document.body.dataset.steps > {seen}", 240)
            assert int(page.inner_text("#step")) > seen
            page.wait_for_selector("section.chart[data-chart=reward] svg")
            assert page.evaluate("performance.getEntriesByType('navigation').length") == loads
            page.screenshot(path=str(shots / "1-curves.png"))
            page.select_option("select[name=trained]", "yes")
            _until(page, "document.querySelectorAll('#rollouts tbody tr').length > 0 && "
                         "[...document.querySelectorAll('#rollouts tbody tr td:nth-child(6)')]"
                         ".every(td => td.textContent !== '–')", 60)
            page.click("#rollouts tbody tr:first-child")
            page.wait_for_selector(".tokens .tok.trained", timeout=30_000)
            tip = page.get_attribute(".tokens .tok.trained", "data-tip")
            assert "logprob -" in tip and "loss mask 1" in tip
            assert "advantage +" in tip or "advantage -" in tip  # a number, from the step that trained it
            assert "trained at step" in page.inner_text("#trajectory")
            page.hover(".tokens .tok.trained")
            assert page.is_visible("#tip")
            page.screenshot(path=str(shots / "2-trajectory.png"))
            assert proc.poll() is None, "the run ended before the page was checked"
            browser.close()
        assert proc.wait(300) == 0, "".join(err_lines[-40:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    said = "".join(line for line in err_lines if not line.startswith("step "))
    assert problems == [] and "the run page could not read" not in said, said[-6000:]
    assert json.loads((run / "summary.json").read_text())["stopped"].startswith("time limit")
    rows = metrics(run)  # trained.jsonl: what each step trained, as metrics.jsonl says
    trained = [json.loads(line) for line in (run / "trained.jsonl").read_text().splitlines()]
    assert {r["step"] for r in trained} == {r["step"] for r in rows if r["samples"]}
    assert sorted(r["sample_id"] for r in trained) == sorted(s for r in rows for s in r["sample_ids"])
    assert all(isinstance(r["advantage"], float) and r["loss_weight"] > 0 for r in trained)
