"""lgt.store.charts (the one chart module, shared by the store's report and the trainer's run pictures):
every chart is well-formed standalone SVG with its title, named axes, tick labels and grid; runs in the
proxy's environment."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from lgt.store import charts
from lgt.testing.svg import SVG, parse, texts


def tips(root: ET.Element, tag: str) -> list[str]:
    return [t.text or "" for t in (e.find(f"{SVG}title") for e in root.iter(f"{SVG}{tag}")) if t is not None]


def grid_lines(root: ET.Element) -> int:
    return len([ln for ln in root.iter(f"{SVG}line") if ln.get("stroke") == charts.GRID])


def test_line_chart_frame_series_top_scale_and_legend() -> None:
    series = [charts.Series("a & b", [(0, 0.1), (5, 0.9)], "#000", marker=2),
              charts.Series("c", [(2, 0.5)], "#111", dash="4 2")]
    root = parse(charts.line_chart("Title <1>", series, x_label="round", y_label="score", x_name="r",
                                   top_ticks=lambda lo, hi: [(lo, "start"), (hi, "end")], top_label="time",
                                   hlines=[(0.8, "goal")], include_y=(0.0, 1.0)))
    words = texts(root)
    assert root.find(f"{SVG}title").text == "Title <1>"
    assert {"Title <1>", "round", "score", "time", "start", "end", "goal", "a & b", "c", "0", "5",
            "1"} <= set(words)
    assert grid_lines(root) > 5
    assert tips(root, "circle") == ["a & b, r 0: 0.100", "a & b, r 5: 0.900", "c, r 2: 0.500"]
    plain = parse(charts.line_chart("", [series[0]], x_label="step", y_label="y"))
    assert plain.find(f"{SVG}title") is None  # no title
    assert "a & b" not in texts(plain)  # one series: no legend
    assert tips(plain, "circle")[0] == "a & b, step 0: 0.100"  # the x value is named by the x axis
    empty = charts.line_chart("T", [], x_label="x", y_label="y", empty="nothing yet")
    assert "nothing yet" in texts(parse(empty))


def test_histogram_is_labelled_at_its_edges() -> None:
    root = parse(charts.histogram("Durations", [1.0, 2.0, 4.0], [3.0, 1.0], x_label="seconds", y_label="n",
                                  unit="s"))
    assert {"Durations", "seconds", "n", "1s", "2s", "4s", "0", "3"} <= set(texts(root))
    assert tips(root, "rect") == ["1–2s: 3", "2–4s: 1"]
    assert "none" in texts(parse(charts.histogram("D", [], [], x_label="x", y_label="y", empty="none")))


def test_category_chart_labels_few_bars_and_not_many() -> None:
    root = parse(charts.category_chart("", ["ok", "a-rather-long-status"], [9.0, 2.0], x_label="status",
                                       y_label="calls"))
    words = texts(root)
    assert {"status", "calls", "ok", "a-rather-lon", "9", "2"} <= set(words)
    assert tips(root, "rect") == ["ok: 9", "a-rather-long-status: 2"]
    widths = [float(r.get("width")) for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]
    assert max(widths) <= 60  # a few bars stay narrow
    many = parse(charts.category_chart("", [f"h{i}" for i in range(30)], [1.0] * 30, x_label="host",
                                       y_label="requests"))
    assert "h0" not in texts(many) and len(tips(many, "rect")) == 30


def test_axis_ticks() -> None:
    assert charts.axis(0.0, 1.0) == (0.0, 1.0, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    assert charts.axis(3.0, 3.0)[:2] == (2.6, 3.4) and charts.axis(0.0, 0.0, integer=True)[:2] == (0.0, 1.0)
