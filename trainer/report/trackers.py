"""Experiment trackers: what the run writes into its directory, also sent to TensorBoard, W&B or MLflow.

The run config's ``log`` names them (``log: [console, tensorboard]``; ``console`` alone by default).
Each is a null object: :class:`Tracker` (``console``) does nothing, since the console lines and the run
directory are written whatever ``log`` says; the others receive

- each metrics.jsonl row's numbers under the same names, at x = its ``step`` (``sample_ids``, strings
  and values that are not finite numbers left out);
- each eval.jsonl row's numbers under ``eval/…`` (``eval/version``, ``eval/time_s``) at its ``step``;
- the run config as the tracker's config;
- at the end: summary.json's figures as the tracker's summary, the plots and report.html (SVG where
  the tracker shows it, else PNG drawn from the same SVG by :func:`svg_png`).

A resumed run continues the same tracker run: what a tracker needs to find it again is kept in
``<run_dir>/trackers.json``. :class:`Trackers` calls each chosen tracker; one that raises is dropped with
one warning and the run goes on. The libraries are imported only when their tracker starts; a library
that is missing is refused when the config is checked (:func:`problem`).
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from lgt.store.files import write_atomic
from lgt.trainer.report.summary import number, read_json

STATE_FILE = "trackers.json"  # in the run directory: {tracker name: what it needs to reopen its run}
PIP = {"PIL": "pillow", "mlflow": "mlflow-skinny"}  # module -> the package that installs it


@dataclass
class Final:
    """What the trackers get when the run ends: summary.json, the plots, report.html."""

    run_dir: Path
    step: int  # the last training step (x of the images)
    stopped: str | None
    summary: dict[str, Any]
    plots: dict[str, Path]  # name -> plots/<name>.svg
    report: Path | None
    _png: dict[str, bytes] = field(default_factory=dict)

    @classmethod
    def read(cls, run_dir: Path, stopped: str | None, step: int) -> Final:
        summary = read_json(run_dir / "summary.json")
        steps = summary.get("steps")
        report = run_dir / "report.html"
        return cls(run_dir, max(step, steps if isinstance(steps, int) else 0), stopped, summary,
                   {p.stem: p for p in sorted((run_dir / "plots").glob("*.svg"))},
                   report if report.exists() else None)

    def png(self, name: str) -> bytes:
        """Plot ``name`` as PNG (drawn once, for every tracker that needs it)."""
        if name not in self._png:
            self._png[name] = svg_png(self.plots[name].read_text())
        return self._png[name]

    def figures(self) -> dict[str, float]:
        """summary.json's numbers, nested keys joined by ``/`` (true/false as 1/0)."""
        return {k: float(v) for k, v in flatten(self.summary).items()
                if isinstance(v, (int, float)) and math.isfinite(v)}


class Tracker:
    """The null tracker (``console``): the run's console lines and files are all there is."""

    name = "console"
    needs: tuple[str, ...] = ()  # modules it imports
    where = ""  # where it writes, for the run's log line

    def start(self, run_dir: Path, config: dict[str, Any], state: dict[str, Any],
              resume_step: int | None) -> dict[str, Any]:
        """Begin, or (``state``: what this tracker kept in trackers.json) continue the run's tracker
        run; ``resume_step``: a resumed run's step (None for a new run). Returns what to keep."""
        return {}

    def log(self, step: int, values: dict[str, float]) -> None:
        """Numbers at training step ``step``."""

    def finish(self, final: Final) -> None:
        """The run ended: its summary and pictures; the tracker run is closed."""


class TensorBoard(Tracker):
    """Event files in ``<run_dir>/tensorboard``: scalars; the config as hyperparameters (flattened) and
    as text; at the end the summary's numbers as ``summary/…`` scalars, the summary as text and the
    plots as PNG images (TensorBoard shows no SVG). A resumed run writes a new event file into the same
    folder that starts with a restart marker just past its checkpoint's step: TensorBoard drops what the
    interrupted process logged after that step."""

    name, needs = "tensorboard", ("tensorboard", "PIL")

    def start(self, run_dir: Path, config: dict[str, Any], state: dict[str, Any],
              resume_step: int | None) -> dict[str, Any]:
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.dir = run_dir / "tensorboard"
        self.where = str(self.dir)
        fresh = not any(self.dir.glob("events.out.tfevents.*"))  # a new run, or tensorboard added on resume
        self.writer = EventFileWriter(str(self.dir))
        if fresh:
            self._write(0, summary=_hparams(flatten(config, sep=".")))
        elif resume_step is not None:
            self._write(resume_step + 1, session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START))
        self._write(resume_step or 0, summary=_text("config", f"```\n{json.dumps(config, indent=2)}\n```"))
        return {}

    def log(self, step: int, values: dict[str, float]) -> None:
        from tensorboard.compat.proto import summary_pb2

        self._write(step, summary=summary_pb2.Summary(value=[
            summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in values.items()]))

    def finish(self, final: Final) -> None:
        from tensorboard.compat.proto import summary_pb2

        from lgt.trainer.report.summary import render

        try:
            self.log(final.step, {f"summary/{k}": v for k, v in final.figures().items()})
            self._write(final.step, summary=_text("summary", f"```\n{render(final.summary)}\n```"))
            for name in final.plots:
                png = final.png(name)
                w, h = _png_size(png)
                image = summary_pb2.Summary.Image(height=h, width=w, colorspace=3, encoded_image_string=png)
                self._write(final.step, summary=summary_pb2.Summary(value=[
                    summary_pb2.Summary.Value(tag=f"plots/{name}", image=image)]))
        finally:
            self.writer.close()

    def _write(self, step: int, **fields: Any) -> None:
        from tensorboard.compat.proto import event_pb2

        self.writer.add_event(event_pb2.Event(wall_time=time.time(), step=step, **fields))
        self.writer.flush()


class WandB(Tracker):
    """A W&B run in ``<run_dir>/wandb``, offline unless ``WANDB_MODE`` says otherwise (upload later
    with ``wandb sync <run_dir>/wandb/offline-run-*``). Project ``$WANDB_PROJECT`` or ``lgt``, the run
    named after the run directory. Metrics use ``step`` as their x axis (``define_metric``): eval rows
    and a resumed run's steps are never dropped as out of order. At the end: summary.json as the run
    summary, the plots as PNG images (``plots/<name>``), report.html (its charts inline SVG) as HTML
    media (``report``). A resumed run reopens the same run id."""

    name, needs = "wandb", ("wandb", "PIL")

    def start(self, run_dir: Path, config: dict[str, Any], state: dict[str, Any],
              resume_step: int | None) -> dict[str, Any]:
        import wandb

        mode, run_id = os.environ.get("WANDB_MODE") or "offline", state.get("id")
        self.run = wandb.init(dir=str(run_dir), mode=mode, project=os.environ.get("WANDB_PROJECT") or "lgt",
                              name=run_dir.name, id=run_id, resume="allow" if run_id else None,
                              job_type="train", settings=wandb.Settings(console="off", silent=True))
        os.environ.pop("WANDB_SERVICE", None)  # W&B's socket for child processes: not the agents' business
        self.run.config.update(config, allow_val_change=True)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.where = f"{run_dir / 'wandb'} ({mode})"
        return {"id": self.run.id}

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"step": step, **values})

    def finish(self, final: Final) -> None:
        import wandb
        from PIL import Image

        try:
            self.run.summary.update(final.summary)
            media: dict[str, Any] = {f"plots/{name}": wandb.Image(Image.open(io.BytesIO(final.png(name))))
                                     for name in final.plots}
            if final.report is not None:
                media["report"] = wandb.Html(final.report.read_text(), inject=False)
            self.run.log({"step": final.step, **media})
        finally:
            self.run.finish(exit_code=1 if final.stopped == "interrupted" else 0)
            wandb.teardown()  # W&B's writer process done: the run's files complete when the run returns


class MLflow(Tracker):
    """An MLflow run in ``$MLFLOW_TRACKING_URI`` or a local file store, ``<run_dir>/mlruns``;
    experiment ``$MLFLOW_EXPERIMENT_NAME`` or ``lgt``, the run named after the run directory. The config
    as params (flattened, dotted keys) and as ``config.json``; metrics with their step; at the end the
    summary's numbers as ``summary/…`` metrics, summary.json, the SVG plots (``plots/``) and
    report.html as artifacts (MLflow's UI shows both). A resumed run reopens the same run id and adds
    only the params it did not have (MLflow refuses changed values; config.json is the current one).
    In a file store a name that is also another's folder (``loss`` beside ``loss/pg``) becomes
    ``loss/value``: the store keeps each metric in a file named after it."""

    name, needs = "mlflow", ("mlflow",)

    def start(self, run_dir: Path, config: dict[str, Any], state: dict[str, Any],
              resume_step: int | None) -> dict[str, Any]:
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # lgt's own choice of store: no telemetry, and MLflow 3's opt-in to the file store
            uri = (run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.entities import Param, RunStatus
        from mlflow.tracking import MlflowClient

        self.client = c = MlflowClient(tracking_uri=uri)
        if state.get("run_id"):
            run = c.get_run(state["run_id"])
            c.update_run(run.info.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "lgt"
            exp = c.get_experiment_by_name(name)
            run = c.create_run(exp.experiment_id if exp else c.create_experiment(name), run_name=run_dir.name,
                               tags={"lgt.run_dir": str(run_dir)})
        self.run_id = run.info.run_id
        # the file store keeps a metric in a file of its name: `loss` cannot sit beside the folder `loss/`
        self.file_store = urlparse(uri).scheme in ("", "file")
        flat = {k: v if isinstance(v, str) else json.dumps(v) for k, v in flatten(config, sep=".").items()}
        params = [Param(k[:250], v[:6000]) for k, v in flat.items() if k not in run.data.params]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params in one call
            c.log_batch(self.run_id, params=params[i:i + 100])
        c.log_dict(self.run_id, config, "config.json")
        self.where = uri
        return {"run_id": self.run_id}

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        spaces = {k[:i] for k in values for i, c in enumerate(k) if c == "/"} if self.file_store else set()
        metrics = [Metric(f"{k}/value" if k in spaces else k, float(v), now, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, final: Final) -> None:
        c = self.client
        try:
            self.log(final.step, {f"summary/{k}": v for k, v in final.figures().items()})
            if final.stopped:
                c.set_tag(self.run_id, "lgt.stopped", final.stopped)
            if (final.run_dir / "summary.json").exists():
                c.log_artifact(self.run_id, str(final.run_dir / "summary.json"))
            for path in final.plots.values():
                c.log_artifact(self.run_id, str(path), "plots")
            if final.report is not None:
                c.log_artifact(self.run_id, str(final.report))
        finally:
            c.set_terminated(self.run_id, "KILLED" if final.stopped == "interrupted" else "FINISHED")


TRACKERS: dict[str, type[Tracker]] = {t.name: t for t in (Tracker, TensorBoard, WandB, MLflow)}


def problem(names: Iterable[str]) -> str | None:
    """Why ``names`` (the config's ``log``) cannot be used, in one sentence, or None: an unknown name,
    or a tracker whose library is not installed (looked up, not imported)."""
    for name in names:
        if name not in TRACKERS:
            return f"log names an unknown tracker {name!r}: choose from {', '.join(TRACKERS)}"
        missing = next((m for m in TRACKERS[name].needs if not _installed(m)), None)
        if missing is not None:
            pip = PIP.get(missing, missing)
            return (f"log names {name}, but the {pip} package is not installed for {sys.executable}: "
                    f"pip install 'lgt[observe]' (or pip install {pip}), or leave {name} out of log")
    return None


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


class Trackers:
    """The run's trackers (``names``), each hook passed to each; one that raises is dropped with one
    warning and the run goes on without it. ``say``: a line for the run's log."""

    def __init__(self, names: Iterable[str], say: Callable[[str], None]) -> None:
        self.idle = [TRACKERS[n]() for n in dict.fromkeys(names) if TRACKERS[n] is not Tracker]
        self.live: list[Tracker] = []  # started and not failed
        self.failed: list[Tracker] = []
        self.say = say
        self.last_step = 0

    def start(self, run_dir: Path, config: dict[str, Any], resume_step: int | None = None) -> None:
        """Each tracker started (a resumed run: continued, from ``<run_dir>/trackers.json``)."""
        path = run_dir / STATE_FILE
        state = read_json(path)
        for t in self.idle:
            kept = self._call(t, "start", run_dir, config, state.get(t.name) or {}, resume_step)
            if t not in self.failed:
                self.live.append(t)
                state[t.name] = kept or {}
        self.idle = []
        if self.live:
            write_atomic(path, json.dumps(state, indent=2) + "\n")
            self.say("tracking: " + "; ".join(f"{t.name} in {t.where}" for t in self.live))

    def step(self, row: Mapping[str, Any]) -> None:
        """A metrics.jsonl row."""
        self.last_step = int(row["step"])
        self._log(self.last_step, numbers(row))

    def eval(self, row: Mapping[str, Any]) -> None:
        """An eval.jsonl row: its numbers under ``eval/…``."""
        self._log(int(row["step"]), {k if k.startswith("eval/") else f"eval/{k}": v
                                     for k, v in numbers(row).items()})

    def finish(self, run_dir: Path, stopped: str | None) -> None:
        """The run ended (summary.json and the plots written): each tracker gets them and closes."""
        if not self.live:
            return
        final = Final.read(run_dir, stopped, self.last_step)
        for t in list(self.live):
            self._call(t, "finish", final)
        self.live = []

    def _log(self, step: int, values: dict[str, float]) -> None:
        for t in list(self.live):
            self._call(t, "log", step, values)

    def _call(self, t: Tracker, hook: str, *args: Any) -> Any:
        try:
            return getattr(t, hook)(*args)
        except Exception as e:  # noqa: BLE001 - a tracker must never end the run
            self.failed.append(t)
            if t in self.live:
                self.live.remove(t)
            self.say(f"the {t.name} tracker failed at {hook} ({type(e).__name__}: {e}); the run goes on "
                      "without it")
            return None


def numbers(row: Mapping[str, Any]) -> dict[str, float]:
    """A row's finite numbers but its ``step`` (no lists, strings, true/false, NaN)."""
    return {k: v for k, v in row.items() if k != "step" and number(v) is not None}


def flatten(d: Mapping[str, Any], prefix: str = "", sep: str = "/") -> dict[str, Any]:
    """Nested mappings as one level, keys joined by ``sep``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, f"{prefix}{k}{sep}", sep))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _text(tag: str, markdown: str) -> Any:
    from tensorboard.plugins.text.summary_v2 import text_pb

    return text_pb(tag, markdown)


def _hparams(flat: dict[str, Any]) -> Any:
    """TensorBoard's HParams record of a run's config (what ``hparams`` summaries write, without
    TensorFlow): numbers, true/false and strings as they are, anything else as JSON."""
    from google.protobuf import struct_pb2
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2

    info = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
    for k, v in flat.items():
        if isinstance(v, bool):
            info.hparams[k].CopyFrom(struct_pb2.Value(bool_value=v))
        elif isinstance(v, (int, float)):
            info.hparams[k].CopyFrom(struct_pb2.Value(number_value=v))
        else:
            text = v if isinstance(v, str) else json.dumps(v)
            info.hparams[k].CopyFrom(struct_pb2.Value(string_value=text))
    meta = metadata.create_summary_metadata(plugin_data_pb2.HParamsPluginData(session_start_info=info))
    return summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=metadata.SESSION_START_INFO_TAG,
                                                                 metadata=meta)])


def _png_size(png: bytes) -> tuple[int, int]:
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")


# --------------------------------------------------------------------------------------- SVG to PNG
_NS = "{http://www.w3.org/2000/svg}"


def svg_png(svg: str, scale: float = 2.0) -> bytes:
    """A PNG of one of lgt's charts (:mod:`lgt.store.charts`), for trackers that show no SVG.

    Draws the subset of SVG those charts use (rect, line, polyline with dashes, circle, text with
    its anchor and the y label's rotation, fill and stroke opacity) with Pillow, ``scale`` pixels per
    SVG unit. Text is Pillow's default font, not bold or italic: the picture is the same, plainer."""
    from PIL import Image, ImageDraw, ImageFont

    root = ET.fromstring(svg)
    w, h = float(root.get("width", 600)), float(root.get("height", 300))
    img = Image.new("RGB", (round(w * scale), round(h * scale)), "white")
    draw = ImageDraw.Draw(img, "RGBA")
    fonts: dict[float, Any] = {}

    def font(size: float) -> Any:
        if size not in fonts:
            fonts[size] = ImageFont.load_default(size=size * scale)
        return fonts[size]

    def num(el: ET.Element, key: str, default: float = 0.0) -> float:
        v = el.get(key)
        return float(v) if v not in (None, "") else default

    def color(value: str | None, opacity: str | None) -> tuple[int, int, int, int] | None:
        if value in (None, "none"):
            return None
        from PIL import ImageColor
        r, g, b = ImageColor.getrgb(value)[:3]
        return r, g, b, round(255 * float(opacity or 1))

    def lines(points: list[tuple[float, float]], fill: Any, width: float, dash: str | None) -> None:
        pts = [(x * scale, y * scale) for x, y in points]
        for seg in _dashed(pts, [float(d) * scale for d in dash.split()] if dash else []):
            draw.line(seg, fill=fill, width=max(1, round(width * scale)), joint="curve")

    base_size, base_fill = num(root, "font-size", 11), root.get("fill", "#000")
    for el in root.iter():
        tag = el.tag.replace(_NS, "")
        stroke = color(el.get("stroke"), el.get("stroke-opacity"))
        width = num(el, "stroke-width", 1.0)
        if tag == "rect":
            x, y = num(el, "x"), num(el, "y")
            box = [x * scale, y * scale, (x + num(el, "width")) * scale, (y + num(el, "height")) * scale]
            draw.rectangle(box, fill=color(el.get("fill", "#000"), el.get("fill-opacity")), outline=stroke,
                           width=max(1, round(width * scale)))
        elif tag == "line" and stroke:
            lines([(num(el, "x1"), num(el, "y1")), (num(el, "x2"), num(el, "y2"))], stroke, width,
                  el.get("stroke-dasharray"))
        elif tag == "polyline" and stroke:
            pts = [tuple(map(float, p.split(","))) for p in el.get("points", "").split()]
            lines(pts, stroke, width, el.get("stroke-dasharray"))  # type: ignore[arg-type]
        elif tag == "circle":
            cx, cy, r = num(el, "cx") * scale, num(el, "cy") * scale, num(el, "r") * scale
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=color(el.get("fill", "#000"),
                                                                      el.get("fill-opacity")))
        elif tag == "text" and el.text and not el.get("stroke"):  # a label's white halo is left out
            f = font(num(el, "font-size", base_size))
            fill = color(el.get("fill", base_fill), None)
            anchor = {"middle": "ms", "end": "rs"}.get(el.get("text-anchor", ""), "ls")
            x, y = num(el, "x"), num(el, "y")
            if "rotate(-90)" in el.get("transform", ""):  # the y axis's name: reads bottom to top
                _rotated_text(img, (y * scale, -x * scale), el.text, f, fill)
            else:
                draw.text((x * scale, y * scale), el.text, font=f, fill=fill, anchor=anchor)
    out = io.BytesIO()
    img.save(out, "PNG", optimize=True)
    return out.getvalue()


def _rotated_text(img: Any, at: tuple[float, float], text: str, font: Any, fill: Any) -> None:
    """``text`` turned a quarter left, its middle's baseline at ``at``."""
    from PIL import Image, ImageDraw

    left, top, right, bottom = font.getbbox(text, anchor="ls")
    width, height = right - left, bottom - top
    label = Image.new("RGBA", (max(1, round(width)), max(1, round(height))), (0, 0, 0, 0))
    ImageDraw.Draw(label).text((-left, -top), text, font=font, fill=fill, anchor="ls")
    turned = label.rotate(90, expand=True)  # (px, py) -> (py, width - px)
    img.paste(turned, (round(at[0] + top), round(at[1] - width / 2)), turned)


def _dashed(pts: list[tuple[float, float]], pattern: list[float]) -> list[list[tuple[float, float]]]:
    """The drawn pieces of the line through ``pts`` with dash ``pattern`` (on, off, …; none: whole)."""
    if not pattern or sum(pattern) <= 0 or len(pts) < 2:
        return [pts]
    pieces: list[list[tuple[float, float]]] = []
    i, left, on = 0, pattern[0], True
    current: list[tuple[float, float]] = [pts[0]]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        seg = math.hypot(x1 - x0, y1 - y0)
        pos = 0.0
        while seg - pos > left:
            pos += left
            p = (x0 + (x1 - x0) * pos / seg, y0 + (y1 - y0) * pos / seg)
            if on:
                pieces.append([*current, p])
            current = [p]
            i, on = (i + 1) % len(pattern), not on
            left = pattern[i]
        left -= seg - pos
        current.append((x1, y1))
    if on and len(current) > 1:
        pieces.append(current)
    return pieces

