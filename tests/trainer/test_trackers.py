"""Experiment trackers (``log:``): each writes offline into the run directory and its own library reads
back what it wrote — TensorBoard's event accumulator, W&B's record format (its protobuf ``Record``s from
the offline run's ``.wandb`` file), MLflow's client on the local file store.

The runs here are played through :class:`~lgt.trainer.run.runlog.RunLog` (the recipe's calls: start,
steps, eval rows, :func:`~lgt.trainer.run.runlog.finish`, close), a first process interrupted after
step 3 and a resumed one from the checkpoint at step 2 (step 3 again, then 4). One test runs the real
trainer with all three trackers. Nothing leaves the machine: W&B offline, MLflow telemetry off.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from lgt.store import charts
from lgt.trainer import config as cfgmod
from lgt.trainer.report import trackers
from lgt.trainer.report.summary import read_jsonl
from lgt.trainer.run.evaluation import append_row
from lgt.trainer.run.runlog import RunLog, finish, metric_rows

ALL = ["console", "tensorboard", "wandb", "mlflow"]
CONFIG = {"name": "t", "steps": 4, "backend": {"name": "torch", "lr": 0.001}, "log": ALL}
RESUMED = {**CONFIG, "backend": {"name": "torch", "lr": 0.002}, "max_minutes": 5.0}  # --set on resume


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No tracker configured from outside; MLflow's telemetry off; what the trackers set in the
    environment themselves (MLflow's file-store opt-in) is undone after the test."""
    for var in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_API_KEY", "WANDB_DIR", "MLFLOW_TRACKING_URI",
                "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # the test's own downloads
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")  # recorded, so that undo removes it ...
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # ... and absent: the tracker opts in itself


def row(step: int, session: int) -> dict[str, Any]:
    """A metrics.jsonl row as the recipe writes one (strings, the sample ids, a NaN at step 2)."""
    return {"step": step, "version": step, "time_s": 1.5 * step + session, "mode": "async",
            "backend": "torch", "groups": 2, "rollouts": 8, "samples": 8.0,
            "rollout/reward_mean": float("nan") if step == 2 else 0.125 * step, "rollout/staleness_max": 1,
            "sample_ids": [f"g{step}-0~0#0"],
            "perf/drain_s": 0.25, "perf/train_s": 0.5, "perf/sync_s": 0.125, "loss/pg": -0.5 * step - session,
            "loss": 0.25 * step, "grad_norm": 1.5}  # `loss` beside `loss/…`, as the torch backend reports


def eval_row(step: int) -> dict[str, Any]:
    return {"step": step, "version": step, "time_s": 2.0 * step, "eval/reward_greedy": 0.25 + 0.125 * step,
            "eval/reward_sampled": None, "eval/tasks_greedy": 4, "eval/rollouts": 8, "eval/failed": 0,
            "eval/seconds": 1.25}


def play(run_dir: Path, names: list[str], steps: list[int], *, config: dict[str, Any] = CONFIG,
         resume_step: int | None = None, evals: tuple[int, ...] = (), stopped: str = "step limit (4 steps)",
         lines: list[str] | None = None) -> None:
    """One trainer process as the recipe drives its RunLog: the trackers start last in setup, get each
    step and each eval row, then finish writes the summary and plots and close ends the tracker runs."""
    run_dir.mkdir(exist_ok=True)
    if resume_step is None:
        (run_dir / "config.json").write_text(json.dumps({"name": "t", "target_reward": 0.5}))
    runlog = RunLog(run_dir, lambda stats, line: lines.append(line) if lines is not None else None,
                    steps=4, trackers=names)
    runlog.start_trackers(config, resume_step)
    session = 0 if resume_step is None else 1
    for step in [0, *steps]:
        if step:
            runlog.step(row(step, session))
        if step in evals:
            append_row(run_dir, eval_row(step))
            runlog.eval(eval_row(step))
    finish(run_dir, stopped=stopped)
    runlog.close(stopped)


def play_interrupted_and_resumed(run_dir: Path, names: list[str]) -> None:
    play(run_dir, names, [1, 2, 3], evals=(0, 2), stopped="interrupted")
    play(run_dir, names, [3, 4], config=RESUMED, resume_step=2, evals=(4,))


def numbers(r: dict[str, Any]) -> dict[str, float]:
    """What a tracker should get of a row: its finite numbers, ``step`` being the x axis."""
    return {k: v for k, v in r.items() if k != "step" and type(v) in (int, float) and math.isfinite(v)}


# ------------------------------------------------------------------------------------------ config
def config_with(tmp_path: Path, **over: Any) -> Path:
    import yaml

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": "m"}, "agent": {"command": ["true"]},
                                    "tasks": "tasks.jsonl", **over}))
    return path


def test_log_is_console_by_default_a_name_or_a_list(tmp_path: Path) -> None:
    assert cfgmod.load(config_with(tmp_path)).log == ("console",)
    assert cfgmod.load(config_with(tmp_path, log="tensorboard")).log == ("tensorboard",)
    assert cfgmod.load(config_with(tmp_path, log=["console", "wandb"])).log == ("console", "wandb")
    # --set log=[mlflow] (a YAML value), and the run's config.json keeps it for a resume
    cfg = cfgmod.load(config_with(tmp_path), {"log": ["mlflow"]})
    assert cfg.log == ("mlflow",) and cfg.to_json()["log"] == ["mlflow"]


def test_an_unknown_tracker_is_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(cfgmod.ConfigError) as e:
        cfgmod.load(config_with(tmp_path, log=["console", "wandbb"]))
    assert str(e.value) == ("log names an unknown tracker 'wandbb': choose from console, tensorboard, wandb, "
                            "mlflow")


@pytest.mark.parametrize(("name", "module", "pip"), [("wandb", "wandb", "wandb"),
                                                     ("mlflow", "mlflow", "mlflow-skinny"),
                                                     ("tensorboard", "tensorboard", "tensorboard"),
                                                     ("tensorboard", "PIL", "pillow")])
def test_a_missing_tracker_library_is_one_sentence_at_validation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, module: str, pip: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import fails, find_spec says: not installed
    with pytest.raises(cfgmod.ConfigError) as e:
        cfgmod.load(config_with(tmp_path, log=["console", name]))
    msg = str(e.value)
    assert msg == (f"log names {name}, but the {pip} package is not installed for {sys.executable}: "
                   f"pip install 'lgt[observe]' (or pip install {pip}), or leave {name} out of log")
    assert cfgmod.load(config_with(tmp_path, log="console")).log == ("console",)  # console needs nothing


def test_importing_the_config_imports_no_tracker_library() -> None:
    import subprocess

    code = ("import sys, lgt.trainer.config, lgt.trainer.run.runlog; "
            "print([m for m in ('wandb', 'mlflow', 'tensorboard', 'PIL') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------------ fan-out
class Recorder(trackers.Tracker):
    name = "recorder"
    calls: list[tuple[str, Any]] = []

    def start(self, run_dir: Path, config: dict[str, Any], state: dict[str, Any],
              resume_step: int | None) -> dict[str, Any]:
        self.calls.append(("start", (state, resume_step)))
        return {"n": state.get("n", 0) + 1}

    def log(self, step: int, values: dict[str, float]) -> None:
        self.calls.append(("log", (step, values)))

    def finish(self, final: trackers.Final) -> None:
        self.calls.append(("finish", (final.step, final.stopped, sorted(final.plots),
                                      final.summary["steps"])))


class Flaky(trackers.Tracker):
    name = "flaky"

    def log(self, step: int, values: dict[str, float]) -> None:
        if step >= 2:
            raise OSError("disk full")

    def finish(self, final: trackers.Final) -> None:
        raise AssertionError("a dropped tracker is not called again")


def test_trackers_get_rows_as_numbers_and_one_that_fails_is_dropped_with_one_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(trackers.TRACKERS, "recorder", Recorder)
    monkeypatch.setitem(trackers.TRACKERS, "flaky", Flaky)
    monkeypatch.setattr(Recorder, "calls", [])
    lines: list[str] = []
    play(tmp_path / "run", ["console", "flaky", "recorder"], [1, 2, 3], evals=(0,), lines=lines)
    warnings = [line for line in lines if "tracker failed" in line]
    assert warnings == ["the flaky tracker failed at log (OSError: disk full); the run goes on without it"]
    assert [r["step"] for r in metric_rows(tmp_path / "run")] == [1, 2, 3]  # the run went on
    calls = Recorder.calls
    assert calls[0] == ("start", ({}, None))
    logged = [args for hook, args in calls if hook == "log"]
    assert logged[0] == (0, {"eval/version": 0, "eval/time_s": 0.0, "eval/reward_greedy": 0.25,
                             "eval/tasks_greedy": 4, "eval/rollouts": 8, "eval/failed": 0,
                             "eval/seconds": 1.25})  # eval/reward_sampled: None, left out
    assert logged[1:] == [(r["step"], numbers(r)) for r in metric_rows(tmp_path / "run")]
    assert "rollout/reward_mean" not in logged[2][1] and "sample_ids" not in logged[1][1]  # NaN, a list
    assert calls[-1] == ("finish", (3, "step limit (4 steps)",
                                    ["drain_seconds", "reward", "rollout_duration", "staleness"], 3))
    state = json.loads((tmp_path / "run" / trackers.STATE_FILE).read_text())
    assert state == {"flaky": {}, "recorder": {"n": 1}}
    # a resumed run: the tracker gets what it kept
    play(tmp_path / "run", ["recorder"], [4], resume_step=3)
    assert ("start", ({"n": 1}, 3)) in Recorder.calls


def test_a_tracker_that_cannot_start_is_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class NoStart(trackers.Tracker):
        name = "nostart"

        def start(self, *args: Any) -> dict[str, Any]:
            raise ConnectionError("no route to host")

        def log(self, step: int, values: dict[str, float]) -> None:
            raise AssertionError("never started")

    monkeypatch.setitem(trackers.TRACKERS, "nostart", NoStart)
    lines: list[str] = []
    play(tmp_path / "run", ["nostart"], [1], lines=lines)
    assert [line for line in lines if "nostart" in line] == [
        "the nostart tracker failed at start (ConnectionError: no route to host); the run goes on without it"]
    assert not (tmp_path / "run" / trackers.STATE_FILE).exists()


# ---------------------------------------------------------------------------------------- pictures
def test_a_chart_as_png_has_its_lines_and_size() -> None:
    from io import BytesIO

    from PIL import Image

    svg = charts.line_chart("T", [charts.Series("a", [(0, 0.0), (10, 1.0)], "#ff0000", width=3)],
                            x_label="step", y_label="reward", hlines=[(0.5, "target")])
    png = trackers.svg_png(svg, scale=2)
    img = Image.open(BytesIO(png)).convert("RGB")
    width = float(svg.split('width="')[1].split('"')[0])
    assert img.size[0] == 2 * width
    colors = {c for _, c in img.getcolors(1 << 20)}
    assert {(255, 0, 0), (255, 255, 255), (0x33, 0x33, 0x33)} <= colors  # the line, the page, the target


def test_dashes() -> None:
    # a line of length 10 dashed 2 on, 3 off: drawn on 0-2 and 5-7, off 2-5 and 7-10
    assert trackers._dashed([(0, 0), (10, 0)], [2, 3]) == [[(0, 0), (2.0, 0.0)], [(5.0, 0.0), (7.0, 0.0)]]
    # around a corner: 0-2 on, 2-5 off (the corner at 4), 5-6 on ...
    assert trackers._dashed([(0, 0), (4, 0), (4, 4)], [2, 3])[:2] == [[(0, 0), (2.0, 0.0)],
                                                                      [(4.0, 1.0), (4.0, 3.0)]]


# ------------------------------------------------------------------------------------- TensorBoard
def test_tensorboard_round_trip_and_resume(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.plugins.hparams import metadata as hp_metadata
    from tensorboard.util import tensor_util

    run_dir = tmp_path / "run"
    play_interrupted_and_resumed(run_dir, ["console", "tensorboard"])
    acc = ea.EventAccumulator(str(run_dir / "tensorboard"),
                              size_guidance={ea.SCALARS: 0, ea.IMAGES: 0, ea.TENSORS: 0})
    acc.Reload()
    steps = {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    scalars = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    # metrics.jsonl has step 3 twice (the interrupted process's and the resumed one's); TensorBoard
    # dropped the first at the resumed process's restart marker: each step once, the later value
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 3, 4]
    latest = {r["step"]: r for r in rows}
    names = {k for r in rows for k in numbers(r)}
    for key in names:
        want = {s: r[key] for s, r in sorted(latest.items()) if key in numbers(r)}
        assert steps[key] == list(want) and scalars[key] == pytest.approx(want, rel=1e-6), key
    assert scalars["loss/pg"][3] == -2.5  # the resumed process's step 3
    assert steps["rollout/reward_mean"] == [1, 3, 4]  # NaN at step 2: no point
    assert not {"mode", "backend", "sample_ids", "step"} & set(scalars)
    evals = read_jsonl(run_dir / "eval.jsonl")
    assert scalars["eval/reward_greedy"] == {e["step"]: e["eval/reward_greedy"] for e in evals}
    assert steps["eval/version"] == [0, 2, 4] and "eval/reward_sampled" not in scalars
    # the config: as hyperparameters (the first process's) and as text (each process's)
    [content] = acc.PluginTagToContent("hparams").values()
    hparams = hp_metadata.parse_session_start_info_plugin_data(content).hparams
    assert hparams["backend.lr"].number_value == 0.001 and hparams["name"].string_value == "t"
    assert json.loads(hparams["log"].string_value) == ALL
    texts = [tensor_util.make_ndarray(e.tensor_proto).item().decode() for e in acc.Tensors("config")]
    assert len(texts) == 2 and '"lr": 0.002' in texts[1]
    # the summary and the plots, at the last step
    summary = json.loads((run_dir / "summary.json").read_text())
    assert scalars["summary/reward_last10"] == {4: pytest.approx(summary["reward_last10"])}
    assert scalars["summary/eval_after/greedy"] == {4: 0.75}
    *_, text = acc.Tensors("summary")  # (TensorBoard keeps text the interrupted process wrote, too)
    assert text.step == 4
    assert "stopped: step limit (4 steps)" in tensor_util.make_ndarray(text.tensor_proto).item().decode()
    images = acc.Tags()["images"]
    assert sorted(images) == ["plots/drain_seconds", "plots/reward", "plots/rollout_duration",
                              "plots/staleness"]
    [reward] = acc.Images("plots/reward")
    assert reward.step == 4 and reward.encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n"
    assert reward.width == 2 * charts.WIDE[0]


# ------------------------------------------------------------------------------------------- W&B
def wandb_records(path: Path) -> list[Any]:
    """The protobuf records of an offline run's ``.wandb`` file (W&B's transaction log: a 7-byte
    header, then LevelDB-style log blocks of 32 KiB, each chunk a 7-byte header — checksum, length,
    type: full, first, middle, last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pos, buf = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            records.append(rec)
    return records


def items(updates: Any) -> dict[str, Any]:
    """History / summary items as one dict (nested keys nested)."""
    out: dict[str, Any] = {}
    for item in updates:
        keys = list(item.nested_key) or [item.key]
        d = out
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        d[keys[-1]] = json.loads(item.value_json)
    return out


def test_wandb_offline_round_trip_and_resume(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    play_interrupted_and_resumed(run_dir, ["wandb"])
    run_id = json.loads((run_dir / trackers.STATE_FILE).read_text())["wandb"]["id"]
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))  # one per process, in order
    assert [f.name for f in files] == [f"run-{run_id}.wandb"] * 2  # resumed: the same run
    dirs = [f.parent for f in files]
    first, second = (wandb_records(f) for f in files)
    for records in (first, second):
        [run] = [r.run for r in records if r.HasField("run")]
        assert run.run_id == run_id and run.project == "lgt" and run.display_name == "run"
    history = [{k: v for k, v in items(r.history.item).items() if not k.startswith("_")}
               for records in (first, second) for r in records if r.HasField("history")]
    # every metrics.jsonl row, in order, the same names and values, `step` its x axis
    steps = [h for h in history if "loss/pg" in h]
    assert steps == [{"step": r["step"], **numbers(r)} for r in metric_rows(run_dir)]
    evals = [h for h in history if "eval/reward_greedy" in h]
    assert evals == [{"step": e["step"], **{k if k.startswith("eval/") else f"eval/{k}": v
                                            for k, v in numbers(e).items()}}
                     for e in read_jsonl(run_dir / "eval.jsonl")]
    # step is the x axis of every metric
    metrics = [r.metric for r in first if r.HasField("metric")]
    assert any(m.glob_name == "*" and m.step_metric == "step" for m in metrics)
    # the config, each process's
    configs = [items(r.config.update) for records in (first, second) for r in records if r.HasField("config")]
    assert {"name": "t", "backend": {"name": "torch", "lr": 0.001}}.items() <= configs[0].items()
    assert configs[-1]["backend"]["lr"] == 0.002 and configs[-1]["max_minutes"] == 5.0
    # the summary (summary.json's figures), the plots as PNG, the report as HTML, at the last step
    summary = json.loads((run_dir / "summary.json").read_text())
    merged: dict[str, Any] = {}
    for r in second:
        if r.HasField("summary"):
            merged.update(items(r.summary.update))
    assert {k: merged[k] for k in summary} == summary
    finals = [h for h in history if "plots/reward" in h]  # each process's end: interrupted, then done
    assert [h["step"] for h in finals] == [3, 4]
    final = finals[-1]
    assert final["report"]["_type"] == "html-file"
    for name in ("reward", "rollout_duration", "staleness", "drain_seconds"):
        image = final[f"plots/{name}"]
        assert image["_type"] == "image-file" and image["format"] == "png"
        assert (dirs[1] / "files" / image["path"]).read_bytes()[:4] == b"\x89PNG"
    assert "<svg" in (dirs[1] / "files" / final["report"]["path"]).read_text()
    exits = [r.exit.exit_code for records in (first, second) for r in records if r.HasField("exit")]
    assert exits == [1, 0]  # interrupted, then finished


def test_wandb_keeps_its_service_socket_from_the_agents(tmp_path: Path) -> None:
    # agents get the trainer's environment: W&B's socket for child processes is not in it
    import os

    t = trackers.Trackers(["wandb"], say=lambda line: None)
    t.start(tmp_path, CONFIG)
    try:
        assert t.live and "WANDB_SERVICE" not in os.environ
    finally:
        t.finish(tmp_path, None)


# ---------------------------------------------------------------------------------------- MLflow
def test_mlflow_file_store_round_trip_and_resume(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    play_interrupted_and_resumed(run_dir, ["console", "mlflow"])
    from mlflow.tracking import MlflowClient

    client = MlflowClient((run_dir / "mlruns").as_uri())
    run_id = json.loads((run_dir / trackers.STATE_FILE).read_text())["mlflow"]["run_id"]
    exp = client.get_experiment_by_name("lgt")
    [run] = client.search_runs([exp.experiment_id])  # resumed: the same run
    assert run.info.run_id == run_id and run.info.run_name == "run" and run.info.status == "FINISHED"
    rows = metric_rows(run_dir)
    for key in {k for r in rows for k in numbers(r)}:
        name = "loss/value" if key == "loss" else key  # the file store: `loss` is the folder of `loss/pg`
        got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))
        assert got == sorted((r["step"], float(r[key])) for r in rows if key in numbers(r)), key
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss/pg")) == [1, 2, 3, 3, 4]
    evals = read_jsonl(run_dir / "eval.jsonl")
    got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "eval/reward_greedy"))
    assert got == [(e["step"], e["eval/reward_greedy"]) for e in evals]
    # the config: params (the first process's values; a key new on resume added), config.json current
    params = run.data.params
    assert params["backend.lr"] == "0.001" and params["name"] == "t" and json.loads(params["log"]) == ALL
    assert params["max_minutes"] == "5.0"
    config = json.loads(Path(client.download_artifacts(run_id, "config.json", str(tmp_path))).read_text())
    assert config == RESUMED
    # the summary's numbers as metrics, the files as artifacts
    summary = json.loads((run_dir / "summary.json").read_text())
    *_, last10 = sorted(client.get_metric_history(run_id, "summary/reward_last10"), key=lambda m: m.step)
    assert (last10.step, last10.value) == (4, pytest.approx(summary["reward_last10"]))
    assert run.data.tags["lgt.stopped"] == "step limit (4 steps)"
    assert {f.path for f in client.list_artifacts(run_id)} >= {"config.json", "summary.json", "report.html",
                                                               "plots"}
    plots = {f.path for f in client.list_artifacts(run_id, "plots")}
    assert plots == {f"plots/{n}.svg" for n in ("reward", "rollout_duration", "staleness", "drain_seconds")}
    svg = Path(client.download_artifacts(run_id, "plots/reward.svg", str(tmp_path))).read_text()
    assert svg == (run_dir / "plots" / "reward.svg").read_text()


def test_mlflow_uses_the_tracking_uri_when_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "elsewhere"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a file URI the user chose: their opt-in
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "arith")
    play(tmp_path / "run", ["mlflow"], [1])
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store.as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("arith").experiment_id])
    assert run.data.metrics["loss/pg"] == -0.5 and not (tmp_path / "run" / "mlruns").exists()


# ---------------------------------------------------------------------------------- a real run
@pytest.mark.slow
def test_a_run_and_its_resume_log_to_every_tracker_what_they_write_to_metrics_jsonl(
        tmp_path: Path, arith_model_dir: Path, arith_engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing import event_accumulator as ea

    from lgt.testing.runs import lgt_train, write_config

    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path, arith_model_dir, engine_url=arith_engine.url, steps=2, log=ALL,
                       eval={"split": 0.05, "every": 0, "samples": 0})
    env = {"MLFLOW_DISABLE_TELEMETRY": "true"}
    out = lgt_train(str(cfg), "--run-dir", str(run_dir), env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tracking: tensorboard in" in out.stderr and "tracker failed" not in out.stderr
    state = json.loads((run_dir / trackers.STATE_FILE).read_text())
    out = lgt_train("--resume", str(run_dir), "--steps", "3", env=env)  # one step more
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tracker failed" not in out.stderr
    assert json.loads((run_dir / trackers.STATE_FILE).read_text()) == state  # the same tracker runs
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    want = {(k, r["step"]): v for r in rows for k, v in numbers(r).items()}
    assert len({k for k, _ in want}) > 30  # rollout/*, perf/*, loss/*, actor/*, the backend's own
    evals = [(e["step"], e["eval/reward_greedy"]) for e in read_jsonl(run_dir / "eval.jsonl")]
    assert [s for s, _ in evals] == [0, 2, 3]  # before the first update, at the end, the resume's end

    acc = ea.EventAccumulator(str(run_dir / "tensorboard"), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    tb = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] if not tag.startswith(("eval/", "summary/"))
          for e in acc.Scalars(tag)}
    assert tb == pytest.approx(want, rel=1e-6)
    assert {e.step: e.value for e in acc.Scalars("eval/reward_greedy")} == pytest.approx(dict(evals))

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # reading the run's file store, as docs/observe.md
    client = MlflowClient((run_dir / "mlruns").as_uri())
    run_id = state["mlflow"]["run_id"]
    ml = {(k, m.step): m.value for k in {k for k, _ in want}
          for m in client.get_metric_history(run_id, "loss/value" if k == "loss" else k)}
    assert ml == pytest.approx(want)
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "eval/reward_greedy")) == evals
    assert client.get_run(run_id).data.params["backend.lr"] == "0.001"

    files = sorted((run_dir / "wandb").glob(f"offline-run-*/run-{state['wandb']['id']}.wandb"))
    assert len(files) == 2  # the run and its resume: one W&B run
    history = [items(r.history.item) for f in files for r in wandb_records(f) if r.HasField("history")]
    wb = {(k, h["step"]): v for h in history if "loss/pg" in h for k, v in h.items() if not k.startswith("_")
          and k != "step"}
    assert wb == want
    assert [(h["step"], h["eval/reward_greedy"]) for h in history if "eval/reward_greedy" in h] == evals
