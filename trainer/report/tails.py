"""The run's growing JSON-lines files, read from where the last read stopped: ``metrics.jsonl`` and
``eval.jsonl`` (:class:`Tail`), ``rollouts.jsonl``'s durations (:class:`Durations`) and
``trained.jsonl`` (:class:`TrainedTail`), the last two parsed in bulk into Arrow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lgt.trainer.report.summary import jsonl_rows


class FileShrank(Exception):
    """A file read as it grows was rewritten shorter: read it again from the start."""


def new_lines(path: Path, offset: int) -> tuple[bytes, int]:
    """The whole lines ``path`` holds past ``offset``, and the offset after them (a line a crash cut off
    is read once it is whole); FileShrank when it is shorter than ``offset``."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return b"", offset
    if size < offset:
        raise FileShrank(str(path))
    if size == offset:
        return b"", offset
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(size - offset)
    end = data.rfind(b"\n") + 1
    return data[:end], offset + end


def bulk_rows(data: bytes, columns: tuple[tuple[str, str], ...]) -> Any:
    """JSON lines as an Arrow table of ``columns`` ((name, type alias) pairs; other fields ignored),
    parsed in bulk; a line that is not JSON is skipped."""
    import io

    import pyarrow as pa
    import pyarrow.json as pj

    schema = pa.schema([(name, pa.type_for_alias(kind)) for name, kind in columns])
    try:
        return pj.read_json(io.BytesIO(data), parse_options=pj.ParseOptions(
            explicit_schema=schema, unexpected_field_behavior="ignore")).select(schema.names)
    except pa.ArrowInvalid:  # a torn or hand-written line: line by line, skipping it
        return pa.Table.from_pylist([{k: _typed(row.get(k), kind) for k, kind in columns}
                                     for row in jsonl_rows(data)], schema=schema)


def _typed(v: Any, kind: str) -> Any:
    try:
        if v is None:
            return None
        return float(v) if kind.startswith("float") else int(v) if kind.startswith("int") else str(v)
    except (TypeError, ValueError):
        return None


class Tail:
    """The rows of a growing JSON-lines file (metrics.jsonl, eval.jsonl: a line per step or evaluation),
    read from where the last read stopped; a file rewritten shorter is read again from the start."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self._offset = 0

    def read(self) -> list[dict[str, Any]]:
        """Every row so far (new ones appended)."""
        try:
            data, self._offset = new_lines(self.path, self._offset)
        except FileShrank:
            self.rows, self._offset = [], 0
            data, self._offset = new_lines(self.path, 0)
        self.rows += jsonl_rows(data)
        return self.rows


class Durations:
    """rollouts.jsonl's ``seconds``, a float per rollout (the file holds one line per rollout: parsed
    in bulk, nothing else kept)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: list[float | None] = []
        self._offset = 0

    def read(self) -> list[float | None]:
        try:
            data, self._offset = new_lines(self.path, self._offset)
        except FileShrank:
            self.seconds, self._offset = [], 0
            data, self._offset = new_lines(self.path, 0)
        if data:
            self.seconds += bulk_rows(data, (("seconds", "float64"),)).column("seconds").to_pylist()
        return self.seconds


class TrainedTail:
    """trained.jsonl's new lines as an Arrow table of :data:`TRAINED_COLUMNS` (a step writes a line per
    sample: a long run's file holds one per trained sample, so it is parsed in bulk)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def reset(self) -> None:
        self._offset = 0

    def read_new(self) -> Any:
        """The lines written since the last read, or None when there are none; FileShrank when the
        file was rewritten shorter."""
        data, self._offset = new_lines(self.path, self._offset)
        return bulk_rows(data, TRAINED_COLUMNS) if data else None


TRAINED_COLUMNS = (("rollout_id", "string"), ("attempt", "int32"), ("step", "int64"),
                   ("advantage", "float64"), ("loss_weight", "float64"))
