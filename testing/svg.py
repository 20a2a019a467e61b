"""Reading the SVG the chart module draws, in tests: parse a chart and list its texts."""

from __future__ import annotations

import xml.etree.ElementTree as ET

SVG = "{http://www.w3.org/2000/svg}"


def parse(svg: str) -> ET.Element:
    """The chart's root element; it must be standalone SVG."""
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    return root


def texts(root: ET.Element) -> list[str]:
    """Every ``<text>`` of the chart, in document order."""
    return ["".join(t.itertext()) for t in root.iter(f"{SVG}text")]
