"""Training samples from the store: calls merged per rollout attempt, with their rollout's facts.

A rollout attempt makes a run of model calls; each call's prompt is the agent's whole context. When a
call's prompt starts with the previous call's prompt + generated tokens, the two calls are one sample:
the later prompt already holds the earlier tokens, so only its new tokens are appended. Every split
is recorded in ``merge_breaks`` with its reason.

How the work is divided (``sql/samples.sql`` holds the views, ``sql/sample_build.sql`` and
``sql/sample_stream.sql`` the queries this module runs):

* SQL, over scalar columns: which attempts can be trained, the seq order of their calls
  (``sample_order``), and after the merge each attempt's group, reward and trained-token count
  (``sample_rollouts``). The store gives facts: advantages and loss weights are the trainer's
  (:mod:`lgt.trainer.rl.algorithm`, by a registered estimator).
* One streaming pass over the calls files' token lists (:func:`merge_calls`): the prefix check is a
  memcmp (``pyarrow.Buffer.equals``) on zero-copy slices of the Arrow buffers, and samples are
  assembled by joining byte ranges. The files are read with pyarrow, as the store's contract lays
  them out (``<store>/calls/*.parquet``, whole files), not through DuckDB: on 10k rollouts
  (bench/samples.py) DuckDB's Arrow export of the list columns cost as much CPU as its scan. The
  plain-SQL ``samples`` view (DuckDB list and window functions) builds the same rows ~4x slower;
  the tests hold the two to each other.

``mode="realign"`` merges across re-tokenisation drift: where the next prompt is not a token
extension of the previous call's tokens but its decoded text is, the held tokens are kept unchanged
and the prompt's tokens after the matching text are appended (:func:`realign_offset`).
"""

from __future__ import annotations

import queue
import threading
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from .migrations import migrate
from .query import connect, group_rollouts, named_queries
from .schema import CALLS, TABLES

SQL = named_queries("lgt.store", "sql/sample_build.sql")
PLAN_SQL = named_queries("lgt.store", "sql/sample_stream.sql")

MODES = ("exact", "realign")

SAMPLES = pa.schema([
    ("sample_id", pa.string()),
    ("rollout_id", pa.string()),
    ("attempt", pa.int32()),
    ("group_id", pa.string()),
    ("task_id", pa.string()),
    ("sample_index", pa.int32()),
    ("n_calls", pa.int32()),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("behaviour_logprobs", pa.list_(pa.float32())),
    ("policy_versions", pa.list_(pa.int32())),
    ("reward", pa.float64()),
    ("rollout_tokens", pa.int64()),  # generated (loss-masked) tokens of the rollout's samples
    ("mode", pa.string()),
])
TOKEN_LISTS = ("input_ids", "loss_mask", "behaviour_logprobs", "policy_versions")

MERGE_BREAKS = pa.schema([
    ("rollout_id", pa.string()),
    ("attempt", pa.int32()),
    ("seq", pa.int64()),  # the call that starts the new sample
    ("reason", pa.string()),
])

# Why a call starts a new sample (merge_breaks.reason).
EXCLUDED_CALL = "excluded_call"  # the call before it was excluded (failed, no token ids, ...)
TRUNCATION = "truncation"  # its prompt is shorter than what the sample holds: context trimmed
TEXT_CHANGE = "text_change"  # its decoded prompt does not start with the held text: history rewritten
BOUNDARY_RESPLIT = "boundary_resplit"  # the text extends, but no token boundary ends the held text
RETOKENIZED = "retokenized"  # exact mode: the text extends at a clean boundary; realign would merge
NO_TOKENIZER = "no_tokenizer"  # exact mode without a tokenizer: the tokens differ, reason unknown

# The finish reasons of a reply that ended on a stop token, which realign may find left out of the next
# prompt: vLLM reports tool_calls, not stop, for a reply its tool parser read calls from.
STOPPED = ("stop", "tool_calls")

BATCH_ROWS = 16384  # calls per Arrow batch read from the calls files
CALL_COLUMNS = ["rollout_id", "attempt", "seq", "status", "policy_version", "finish_reason",
                "prompt_token_ids", "response_token_ids", "response_logprobs"]

SampleScalars = tuple[str, int, int, int, int]  # rollout_id, attempt, sample_index, n_calls, masked


@dataclass(frozen=True)
class SampleBuild:
    """What :func:`build_samples` made of a store.

    ``samples`` has the columns of :data:`SAMPLES`, one row per sample, in the order the rollouts
    were read; ``merge_breaks`` one row per split (:data:`MERGE_BREAKS`); ``report`` the counts.
    """

    samples: pa.Table
    merge_breaks: pa.Table
    report: dict[str, Any]


def install(con: duckdb.DuckDBPyConnection) -> None:
    """Create the sample views (``sql/samples.sql``) on a connection that has the store's views."""
    sql = resources.files("lgt.store").joinpath("sql/samples.sql").read_text()
    try:
        con.execute(sql)
    except duckdb.CatalogException as e:
        raise ValueError("the connection has no store views (calls, rollouts, rewards); open the store "
                         f"with lgt.store.query.connect ({str(e).splitlines()[0]})") from None


def build_samples(con: duckdb.DuckDBPyConnection, *, mode: str = "exact",
                  tokenizer: Any = None) -> SampleBuild:
    """Training samples of every trainable rollout attempt of the store open on ``con``.

    ``mode``: ``exact`` merges a call into the previous one's sample only when its prompt extends
    the previous prompt + generated tokens token by token; ``realign`` also merges when the decoded
    text extends (needs ``tokenizer``, anything with ``decode(ids) -> str``). A tokenizer given in
    exact mode only names the reasons of splits.
    """
    decode = check_args(mode, tokenizer)
    root = store_root(con)
    install(con)
    check_unique_seq(con)
    order = call_order(con)
    merged = merge_calls(prefetched(call_batches(root, scoped_files(con))), order, mode, decode)
    per_sample, rollouts = rollout_scalars(con, merged.scalars)
    samples = assemble(merged, per_sample, mode)
    breaks = pa.Table.from_pylist(merged.breaks, schema=MERGE_BREAKS)
    return SampleBuild(samples, breaks, make_report(mode, merged, samples, breaks, rollouts))


def build_group_samples(store: str | Path, group_ids: Iterable[str], *, mode: str = "exact",
                        tokenizer: Any = None) -> SampleBuild:
    """:func:`build_samples` of the rollout groups ``group_ids`` alone (a trainer's batch).

    Only the files holding those groups' rollouts are read (``connect(rollout_ids=…)``; which files
    hold which rollouts is remembered per process), so a trainer's step costs what its batch costs
    however large the store has grown. Groups are whole: the same rows as a build of the whole
    store, filtered to these groups. A group id of the
    form ``<rollout_id>~<attempt>`` also names an attempt seen only in calls (its own group).
    """
    root = Path(store).resolve()
    groups = sorted(set(group_ids))
    migrate(root, readonly_ok=True)
    ids = group_rollouts(root, groups) | {g.rsplit("~", 1)[0] for g in groups if "~" in g}
    return _scoped_build(root, groups, ids, None, mode, tokenizer)


def _scoped_build(root: Path, groups: list[str], ids: Iterable[str], files: dict[str, list[str]] | None,
                  mode: str, tokenizer: Any) -> SampleBuild:
    """The samples of ``groups``, built on a connection that sees only the rollouts ``ids`` (their
    ``files``, where known: see ``connect``)."""
    con = connect(root, rollout_ids=ids, files=files)
    try:
        built = build_samples(con, mode=mode, tokenizer=tokenizer)
    finally:
        con.close()
    keep = pc.is_in(built.samples["group_id"], value_set=pa.array(groups, pa.string()))
    if pc.all(keep).as_py() is not False:
        return built
    samples = built.samples.filter(keep)  # attempts seen only in calls that share a rollout id
    kept = pa.array(sorted(set(samples["rollout_id"].to_pylist())), pa.string())
    breaks = built.merge_breaks.filter(pc.is_in(built.merge_breaks["rollout_id"], value_set=kept))
    return SampleBuild(samples, breaks, {**built.report, **table_counts(samples, breaks)})


STREAM_ROLLOUTS = 4096  # rollout attempts per chunk of a streamed build (~300 MB of samples at 3-4k tokens)
SQL_MEMORY = "1GB"  # DuckDB's memory limit for the streamed build's whole-store queries


def stream_samples(store: str | Path, *, mode: str = "exact", tokenizer: Any = None,
                   chunk_rollouts: int = STREAM_ROLLOUTS) -> Iterator[SampleBuild]:
    """:func:`build_samples` of the whole store, a chunk of whole groups at a time (about
    ``chunk_rollouts`` rollout attempts, more when one group is larger), so that memory holds one
    chunk's samples however large the store is. Each chunk is :func:`build_group_samples` of its
    groups; the chunks' samples together are the whole build's rows (groups in the order of the
    calls files that hold them, so that a chunk reads few files). Use :func:`trained_rollouts` for
    the loss weights' R, and :func:`merge_reports` for the report of the whole store.

    Which groups make each chunk, and which files hold their rollouts, is planned once in DuckDB
    (temporary tables under :data:`SQL_MEMORY`, spilled to disk beyond it), not in Python: what the
    build keeps between chunks does not grow with the store."""
    if chunk_rollouts < 1:
        raise ValueError(f"chunk_rollouts must be at least 1, not {chunk_rollouts}")
    root = Path(store).resolve()
    con = connect(root)
    try:
        con.execute(f"SET memory_limit = '{SQL_MEMORY}'")
        files = plan_chunks(con, root)
        for first, last in chunk_bounds(con, chunk_rollouts):
            chunk = {"first": first, "last": last}
            groups = [g for (g,) in con.execute(PLAN_SQL["chunk_groups"], chunk).fetchall()]
            ids = [r for (r,) in con.execute(PLAN_SQL["chunk_rollouts"], chunk).fetchall()]
            where: dict[str, list[str]] = {}
            for t, n in con.execute(PLAN_SQL["chunk_files"], chunk).fetchall():
                where.setdefault(t, []).append(files[t][n])
            yield _scoped_build(root, groups, ids, where, mode, tokenizer)
    finally:
        con.close()


def plan_chunks(con: duckdb.DuckDBPyConnection, root: Path) -> dict[str, list[str]]:
    """Three temporary tables on ``con`` (a whole-store connection): ``_lgt_plan_groups`` (i, g, n):
    every group numbered in the order of the first calls file holding its rollouts, with its number
    of rollout attempts; ``_lgt_plan_members`` (i, rollout_id); ``_lgt_plan_files`` (i, t, n): group i
    has rows in file n of table t. Returns each table's files (what ``n`` indexes)."""
    files = {t: sorted(str(p) for p in (root / t).glob("*.parquet")) for t in TABLES}
    names = pa.table({"t": [t for t, fs in files.items() for _ in fs],
                      "n": [n for fs in files.values() for n in range(len(fs))],
                      "filename": [f for fs in files.values() for f in fs]},
                     schema=pa.schema([("t", pa.string()), ("n", pa.int32()), ("filename", pa.string())]))
    con.register("_lgt_plan_names", names)
    try:
        con.execute(PLAN_SQL["plan_held_table"])
        for t, fs in files.items():
            if fs:
                con.execute("SET VARIABLE lgt_plan_files = ?", [fs])
                con.execute(PLAN_SQL["plan_held"], {"t": t})
        con.execute(PLAN_SQL["plan"])
    finally:
        con.execute(PLAN_SQL["plan_cleanup"])
        con.unregister("_lgt_plan_names")
    return files


def chunk_bounds(con: duckdb.DuckDBPyConnection, chunk_rollouts: int) -> list[tuple[int, int]]:
    """The planned groups (:func:`plan_chunks`) in chunks of about ``chunk_rollouts`` rollout
    attempts: ``(first, last)`` group numbers of each, whole groups, a group larger than that alone."""
    con.execute(PLAN_SQL["plan_sizes"])
    bounds: list[tuple[int, int]] = []
    first, size, last = None, 0, 0
    while rows := con.fetchmany(65536):
        for i, n in rows:
            if first is not None and size + n > chunk_rollouts:
                bounds.append((first, last))
                first, size = None, 0
            if first is None:
                first = i
            size += n
            last = i
    if first is not None:
        bounds.append((first, last))
    return bounds


def trained_rollouts(store: str | Path) -> int:
    """How many rollout attempts a build of the whole store trains (R, the loss weights'
    denominator), from scalar SQL: candidate attempts with generated tokens in a usable call."""
    con = connect(Path(store).resolve())
    try:
        install(con)
        # DuckDB's own default is 80% of the machine: over 1M rollouts this count peaked at 6.5 GB,
        # with 1 GB it streams (1.2 GB peak, spilling what does not fit)
        con.execute(f"SET memory_limit = '{SQL_MEMORY}'")
        return int(con.execute(SQL["trained_rollouts"]).fetchone()[0])
    finally:
        con.close()


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The report of a whole build from its chunks' (:func:`stream_samples`): counts added up."""
    def add(a: Any, b: Any) -> Any:
        if isinstance(a, dict) and isinstance(b, dict):
            return {k: add(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in a | b}
        return a + b if isinstance(a, int | float) and not isinstance(a, bool) else a

    out: dict[str, Any] = {}
    for r in reports:
        out = add(out, {k: v for k, v in r.items() if k != "why_empty"})
    if "samples_per_rollout" in out:
        out["samples_per_rollout"] = dict(sorted(out["samples_per_rollout"].items(),
                                                 key=lambda kv: int(kv[0])))
    if "merge_breaks" in out:
        out["merge_breaks"] = dict(sorted(out["merge_breaks"].items(), key=lambda kv: (-kv[1], kv[0])))
    if not out.get("rollouts", {}).get("trained"):
        excluded = Counter(out.get("rollouts", {}).get("excluded", {}))
        out["why_empty"] = why_empty(sum(excluded.values()), excluded,
                                     Counter(out.get("calls", {}).get("excluded", {})))
    return out


def check_args(mode: str, tokenizer: Any) -> Callable[[list[int]], str] | None:
    """The tokenizer's decode function (None without one); a ValueError for a bad argument."""
    if mode not in MODES:
        raise ValueError(f"unknown sample mode {mode!r}: use one of {', '.join(MODES)}")
    if tokenizer is None:
        if mode == "realign":
            raise ValueError("mode 'realign' needs a tokenizer (anything with decode(ids) -> str)")
        return None
    if not callable(getattr(tokenizer, "decode", None)):
        raise ValueError(f"the tokenizer ({type(tokenizer).__name__}) has no decode(ids) method")
    return decoder(tokenizer)


def decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """``tokenizer.decode`` keeping special tokens where it can (template markers are text too)."""
    try:
        tokenizer.decode([], skip_special_tokens=False)
    except TypeError:
        return tokenizer.decode
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


def store_root(con: duckdb.DuckDBPyConnection) -> Path:
    """The store directory of a connection made by :func:`lgt.store.query.connect`."""
    path = con.execute(SQL["file_search_path"]).fetchall()[0][0]
    if not path or "," in path or not Path(path).is_dir():
        raise ValueError("build_samples needs a connection from lgt.store.query.connect (it reads the "
                         f"store's calls files; this connection's file_search_path is {path!r})")
    return Path(path)


def call_order(con: duckdb.DuckDBPyConnection) -> dict[tuple[str, int, int], tuple[int | None, int | None]]:
    """(rollout_id, attempt, seq) -> (prev_seq, next_seq) of every call of a candidate attempt."""
    t = con.sql(SQL["call_order"]).to_arrow_table()
    cols = [t.column(name).to_pylist() for name in ("rollout_id", "attempt", "seq", "prev_seq", "next_seq")]
    return dict(zip(zip(*cols[:3]), zip(*cols[3:])))


def scoped_files(con: duckdb.DuckDBPyConnection) -> list[str] | None:
    """The calls files of a connection scoped to some rollouts (``connect(rollout_ids=…)``), else None."""
    return con.execute(SQL["scoped_calls_files"]).fetchall()[0][0]


def call_batches(root: Path, files: list[str] | None = None) -> Iterator[pa.RecordBatch]:
    """The calls files' rows (all of ``calls/``, or ``files``), in file order (whole files only:
    writers rename finished files in)."""
    files = sorted(files if files is not None else (str(p) for p in (root / "calls").glob("*.parquet")))
    if not files:
        return iter(())
    schema = pa.schema([CALLS.field(name) for name in CALL_COLUMNS])
    return iter(ds.dataset(files, schema=schema, format="parquet").to_batches(
        batch_size=BATCH_ROWS, batch_readahead=4, fragment_readahead=2))


def check_unique_seq(con: duckdb.DuckDBPyConnection) -> None:
    dups = con.execute(SQL["duplicate_seq"]).fetchall()
    if dups:
        dup = dups[0]
        raise ValueError(f"rollout {dup[0]!r} attempt {dup[1]} has more than one call with seq {dup[2]}; "
                         "calls cannot be ordered")


def prefetched(items: Iterator[Any], depth: int = 2) -> Iterator[Any]:
    """``items``, produced up to ``depth`` ahead in a thread: pyarrow reads and decodes the next batch
    (without the GIL) while this one is merged, so the two cores both work. Errors reach the
    consumer; a consumer that stops early stops the thread."""
    q: queue.Queue = queue.Queue(depth)
    stop = threading.Event()
    done = object()

    def put(x: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(x, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for x in items:
                if not put(x):
                    return
        except BaseException as e:  # handed to the consumer, raised there
            put(e)
            return
        put(done)

    thread = threading.Thread(target=produce, name="lgt-samples-read", daemon=True)
    thread.start()
    try:
        while (x := q.get()) is not done:
            if isinstance(x, BaseException):
                raise x
            yield x
    finally:
        stop.set()
        thread.join()


# --- the merge: one pass over the token lists ----------------------------------------------------

_ZEROS = pa.py_buffer(bytes(4 << 16))  # logprob 0.0 for up to 64k context tokens at a time
_EMPTY = pa.py_buffer(b"")


@dataclass(slots=True)
class _Call:
    """One call of the stream. Its token lists are zero-copy slices of its batch's Arrow buffers:
    comparing two (``Buffer.equals``) is a memcmp, and joining them copies each byte once."""

    key: tuple[str, int]
    seq: int
    prev_seq: int | None
    next_seq: int | None
    excluded: str | None
    policy_version: int
    stop: bool
    prompt: pa.Buffer = field(default_factory=lambda: _EMPTY)  # little-endian int32 ids
    response: pa.Buffer = field(default_factory=lambda: _EMPTY)  # int32 ids
    logprobs: pa.Buffer = field(default_factory=lambda: _EMPTY)  # float32 (NaN: not recorded)
    missing_logprobs: bool = False  # recorded without logprobs: the trainer recomputes them

    def detach(self) -> _Call:
        """A copy holding its own bytes (it waits for its predecessor, past its batch)."""
        own = lambda b: pa.py_buffer(b.to_pybytes())  # noqa: E731
        return _Call(self.key, self.seq, self.prev_seq, self.next_seq, self.excluded,
                     self.policy_version, self.stop, own(self.prompt), own(self.response),
                     own(self.logprobs), self.missing_logprobs)


@dataclass(slots=True)
class _Sample:
    """A sample being assembled: references to byte ranges, copied once when its chunk is built."""

    index: int
    ids: list = field(default_factory=list)  # byte ranges of int32 token ids
    logprobs: list = field(default_factory=list)  # byte ranges of float32 logprobs
    runs: array = field(default_factory=lambda: array("q"))  # n_context, n_generated of each call
    versions: array = field(default_factory=lambda: array("i"))  # -1, policy version of each call
    masked: int = 0
    owned: int = 0  # pieces before this index hold their own bytes

    def own(self) -> None:
        """Copy the pieces that still point into a batch (small: new tokens only), so the sample
        does not keep whole batches alive while its attempt waits for its next call."""
        for pieces in (self.ids, self.logprobs):
            for i in range(self.owned, len(pieces)):
                pieces[i] = bytes(pieces[i])
        self.owned = len(self.ids)

    def add(self, c: _Call, context_from: int) -> None:
        """Append ``c``'s prompt tokens from ``context_from`` on (context) and its generated tokens."""
        n_ctx, n_gen = (c.prompt.size >> 2) - context_from, c.response.size >> 2
        self.ids.append(c.prompt.slice(4 * context_from))
        self.ids.append(c.response)
        self.logprobs.append(_ZEROS.slice(0, 4 * n_ctx) if n_ctx <= 1 << 16 else bytes(4 * n_ctx))
        self.logprobs.append(c.logprobs)
        self.runs.extend((n_ctx, n_gen))
        self.versions.extend((-1, c.policy_version))
        self.masked += n_gen


@dataclass(slots=True)
class _Attempt:
    """A rollout attempt while its calls go by in seq order."""

    last_seq: int | None = None
    sample: _Sample | None = None
    held: _Call | None = None  # the last trainable call: the sample holds its prompt + generated tokens
    after_excluded: bool = False
    n_samples: int = 0

    def own(self) -> None:
        """Hold no reference into the current batch (it is about to be released)."""
        if self.held is not None:
            self.held = self.held.detach()
        if self.sample is not None:
            self.sample.own()


@dataclass
class Merged:
    """The merge's output: token-list chunks, per-sample scalars, splits and counts."""

    chunks: list[list[pa.Array]]  # [input_ids, loss_mask, behaviour_logprobs, policy_versions] a chunk
    scalars: list[SampleScalars]  # per sample, in chunk order
    breaks: list[dict[str, Any]]
    excluded_calls: Counter
    used_calls: int = 0
    realigned: int = 0
    missing_logprobs: int = 0  # used calls without logprobs (NaN in behaviour_logprobs)


class _Output:
    """Finished samples, joined into chunks of list arrays, each byte copied once."""

    CHUNK_TOKENS = 1 << 24  # also bounds how many input batches finished samples keep alive

    def __init__(self) -> None:
        self.chunks: list[list[pa.Array]] = []
        self.scalars: list[SampleScalars] = []
        self._reset()

    def _reset(self) -> None:
        self.ids: list = []
        self.logprobs: list = []
        self.runs = array("q")
        self.versions = array("i")
        self.offsets = array("i", [0])

    def add(self, key: tuple[str, int], s: _Sample) -> None:
        self.ids += s.ids
        self.logprobs += s.logprobs
        self.runs += s.runs
        self.versions += s.versions
        self.offsets.append(self.offsets[-1] + sum(s.runs))
        self.scalars.append((key[0], key[1], s.index, len(s.runs) // 2, s.masked))
        if self.offsets[-1] >= self.CHUNK_TOKENS:
            self.flush()

    def flush(self) -> None:
        """Build the chunk's four list arrays: token ids and logprobs by joining the byte ranges,
        mask and policy versions by decoding runs (context: 0 / -1, generated: 1 / version)."""
        if len(self.offsets) == 1:
            return
        n = self.offsets[-1]
        offsets = pa.Array.from_buffers(pa.int32(), len(self.offsets), [None, pa.py_buffer(self.offsets)])
        lengths = _flat(pa.int64(), len(self.runs), self.runs)
        mask_values = _flat(pa.int8(), len(self.runs), b"\0\1" * (len(self.runs) // 2))
        version_values = _flat(pa.int32(), len(self.versions), self.versions)
        self.chunks.append([
            pa.ListArray.from_arrays(offsets, _flat(pa.int32(), n, b"".join(self.ids))),
            pa.ListArray.from_arrays(offsets, _run_decode(lengths, mask_values)),
            pa.ListArray.from_arrays(offsets, _flat(pa.float32(), n, b"".join(self.logprobs))),
            pa.ListArray.from_arrays(offsets, _run_decode(lengths, version_values)),
        ])
        self._reset()


def _flat(t: pa.DataType, n: int, data: bytes | bytearray | array) -> pa.Array:
    """An array of ``n`` values of fixed-width type ``t`` over ``data`` (no copy)."""
    return pa.Array.from_buffers(t, n, [None, pa.py_buffer(data)])


def _run_decode(lengths: pa.Array, values: pa.Array) -> pa.Array:
    """``values[i]`` repeated ``lengths[i]`` times, one after another."""
    nonzero = pc.greater(lengths, 0)
    ends = pc.cumulative_sum(lengths.filter(nonzero))
    if len(ends) == 0:
        return pa.array([], values.type)
    return pc.run_end_decode(pa.RunEndEncodedArray.from_arrays(ends, values.filter(nonzero)))


def merge_calls(batches: Iterable[pa.RecordBatch], order: dict, mode: str,
                decode: Callable[[list[int]], str] | None) -> Merged:
    """Merge the calls in ``batches`` (rows of the calls table, any order) into samples, one pass.

    Only the calls in ``order`` (:func:`call_order`: candidate attempts) are taken, each attempt's
    in seq order: a call whose predecessor has not come by yet waits (with its own copy of its
    bytes) until it has. Guarantees: every generated token of a trainable call lands in exactly one
    sample, unchanged, with its logprob and policy version, and mask 1; every other token has mask
    0, logprob 0 and policy version -1.
    """
    attempts: dict[tuple[str, int], _Attempt] = {}
    waiting: dict[tuple[tuple[str, int], int], _Call] = {}
    out = _Output()
    state = Merged([], [], [], Counter())
    seen = 0
    for batch in batches:
        touched = set()
        for call in _calls(batch, order):
            seen += 1
            touched.add(call.key)
            att = attempts.get(call.key)
            if att is None:
                att = attempts[call.key] = _Attempt()
            while call is not None:
                if call.prev_seq != att.last_seq:  # its predecessor is still to come
                    waiting[(call.key, call.prev_seq)] = call.detach()
                    break
                _take(att, call, mode, decode, state, out)
                if call.next_seq is None:
                    if att.sample is not None:
                        out.add(call.key, att.sample)
                    del attempts[call.key]
                    break
                call = waiting.pop((call.key, call.seq), None) if waiting else None
        for key in touched & attempts.keys():  # attempts that go on in a later batch
            attempts[key].own()
    out.flush()
    if seen != len(order):
        raise RuntimeError(f"the calls view lists {len(order)} calls of trainable rollout attempts, the "
                           f"calls files hold {seen}; was the store written to during the build?")
    if waiting:  # a predecessor never came: the store changed under the query
        (key, seq), call = next(iter(waiting.items()))
        raise RuntimeError(f"rollout {key[0]!r} attempt {key[1]}: call {call.seq} came without call "
                           f"{seq}; was the store written to during the build?")
    state.chunks, state.scalars = out.chunks, out.scalars
    return state


def _take(att: _Attempt, c: _Call, mode: str, decode: Callable[[list[int]], str] | None,
          state: Merged, out: _Output) -> None:
    """Add call ``c`` (the next in seq order) to its attempt: extend the sample or start one."""
    att.last_seq = c.seq
    if c.excluded is not None:
        state.excluded_calls[c.excluded] += 1
        att.after_excluded = att.sample is not None
        return
    state.used_calls += 1
    state.missing_logprobs += c.missing_logprobs
    context_from, reason = 0, None
    if att.sample is not None:
        if att.after_excluded:
            reason = EXCLUDED_CALL
        else:
            context_from, reason = _link(att.held, c, mode, decode)
            if reason is None and mode == "realign":
                state.realigned += context_from != (att.held.prompt.size + att.held.response.size) >> 2
    if att.sample is None or reason is not None:
        if att.sample is not None:
            out.add(c.key, att.sample)
            state.breaks.append({"rollout_id": c.key[0], "attempt": c.key[1], "seq": c.seq, "reason": reason})
        att.sample = _Sample(att.n_samples)
        att.n_samples += 1
    att.sample.add(c, context_from)
    att.held, att.after_excluded = c, False


def _link(held: _Call, c: _Call, mode: str,
          decode: Callable[[list[int]], str] | None) -> tuple[int, str | None]:
    """(context_from, None) when ``c`` continues ``held``'s prompt + generated tokens, else (0, why not)."""
    n_prompt, n_held = held.prompt.size, held.prompt.size + held.response.size
    if (c.prompt.size >= n_held and c.prompt.slice(0, n_prompt).equals(held.prompt)
            and c.prompt.slice(n_prompt, held.response.size).equals(held.response)):
        return n_held >> 2, None
    if decode is None:
        return 0, TRUNCATION if c.prompt.size < n_held else NO_TOKENIZER
    held_ids = _ints(held.prompt) + _ints(held.response)
    offset, reason = realign_offset(decode, held_ids, n_prompt >> 2, held.stop, _ints(c.prompt))
    if offset is None:
        return 0, reason
    return (offset, None) if mode == "realign" else (0, RETOKENIZED)


def _ints(b: pa.Buffer) -> list[int]:
    a = array("i")
    a.frombytes(b)
    return a.tolist()


def _calls(batch: pa.RecordBatch, order: dict) -> Iterator[_Call]:
    """The batch's rows that are in ``order``, as :class:`_Call` views over its buffers (no copies).

    A call is excluded (the ``sample_calls`` view says the same in SQL) when its status is not ok or
    it lacks prompt or generated token ids. A call without one logprob per generated token is kept,
    its logprobs NaN (the trainer recomputes them; ``Merged.missing_logprobs`` counts such calls)."""
    col = batch.column
    p, r, lp = col("prompt_token_ids"), col("response_token_ids"), col("response_logprobs")
    prompt, response, logprobs = _values(p), _values(r), _values(lp)
    po, ro, lpo = p.offsets.to_pylist(), r.offsets.to_pylist(), lp.offsets.to_pylist()
    pb, rb, lb = 4 * p.values.offset, 4 * r.values.offset, 4 * lp.values.offset
    tokens_ok = pc.and_(p.is_valid(), r.is_valid()).to_pylist()
    logprobs_ok = lp.is_valid().to_pylist()
    rows = zip(col("rollout_id").to_pylist(), col("attempt").to_pylist(), col("seq").to_pylist(),
               col("status").to_pylist(), col("policy_version").to_pylist(),
               col("finish_reason").to_pylist())
    for i, (rid, attempt, seq, status, version, finish) in enumerate(rows):
        neighbours = order.get((rid, attempt, seq))
        if neighbours is None:
            continue
        prev, nxt = neighbours
        n_gen = ro[i + 1] - ro[i]
        excluded = status if status != "ok" else "no_token_ids" if not tokens_ok[i] else None
        if excluded is None:
            has_logprobs = logprobs_ok[i] and lpo[i + 1] - lpo[i] == n_gen
            yield _Call((rid, attempt), seq, prev, nxt, None, version, finish in STOPPED,
                        prompt.slice(pb + 4 * po[i], 4 * (po[i + 1] - po[i])),
                        response.slice(rb + 4 * ro[i], 4 * n_gen),
                        logprobs.slice(lb + 4 * lpo[i], 4 * n_gen) if has_logprobs else _nans(n_gen),
                        not has_logprobs)
        else:
            yield _Call((rid, attempt), seq, prev, nxt, excluded, version, False)


_NAN = b"\x00\x00\xc0\x7f"  # float32 quiet NaN, little-endian


def _nans(n: int) -> pa.Buffer:
    """``n`` float32 NaNs: the logprobs of a call recorded without them."""
    return pa.py_buffer(_NAN * n)


def _values(a: pa.ListArray) -> pa.Buffer:
    """The data buffer under a list array's values (offsets index into it past ``values.offset``)."""
    return a.values.buffers()[1] or pa.py_buffer(b"")


# --- realign --------------------------------------------------------------------------------------

def realign_offset(decode: Callable[[list[int]], str], held: list[int], n_prompt: int, stop: bool,
                   prompt: list[int]) -> tuple[int | None, str | None]:
    """Where ``prompt`` continues the held tokens as text: ``(offset, None)`` or ``(None, reason)``.

    ``held`` is the previous call's prompt (its first ``n_prompt`` tokens) + generated tokens. The
    held text is ``decode(held)``, or, when that call stopped on a stop token (``stop``) that the
    next prompt's template left out, the text without its last generated token. ``offset`` is the
    first prompt token after a token boundary whose decoded prefix is exactly the held text: the
    held tokens stay, ``prompt[offset:]`` is appended. Reasons: truncation (the prompt's text is
    shorter than the held text), text_change (it does not start with it), boundary_resplit (it does,
    but no token boundary ends there).
    """
    text = decode(prompt)
    targets = [held]
    if stop and len(held) > n_prompt:
        targets.append(held[:-1])
    for target in targets:
        held_text = decode(target)
        if text.startswith(held_text):
            offset = _boundary(decode, prompt, target, held_text)
            return (offset, None) if offset is not None else (None, BOUNDARY_RESPLIT)
    return None, TRUNCATION if len(text) < len(decode(held)) else TEXT_CHANGE


def _boundary(decode: Callable[[list[int]], str], prompt: list[int], held: list[int],
              held_text: str) -> int | None:
    """The least ``o`` with ``decode(prompt[:o]) == held_text``, searched from the common token prefix."""
    first_difference = next((i for i, (x, y) in enumerate(zip(prompt, held)) if x != y),
                            min(len(prompt), len(held)))
    for o in range(first_difference, len(prompt) + 1):
        got = decode(prompt[:o])
        if got == held_text:
            return o
        if len(got) > len(held_text):
            return None
    return None


# --- rollout facts, assembly, report -------------------------------------------------------------

def rollout_scalars(con: duckdb.DuckDBPyConnection,
                    scalars: list[SampleScalars]) -> tuple[pa.Table, pa.Table]:
    """``(per_sample, rollouts)``: every rollout attempt's row of ``sample_rollouts`` given the merged
    samples, and per sample (in merge order) its rollout's group, task, reward and trained tokens,
    ``keep`` false where the rollout is not trained (it generated no tokens)."""
    meta = pa.table([pa.array(col, t) for col, t in zip(
                        list(zip(*scalars)) or [[]] * 5,
                        (pa.string(), pa.int32(), pa.int32(), pa.int32(), pa.int64()))],
                    names=["rollout_id", "attempt", "sample_index", "n_calls", "masked"])
    meta = meta.append_column("row", pa.array(range(meta.num_rows), pa.int64()))
    con.register("_lgt_sample_meta", meta)
    try:
        con.execute(SQL["sample_tokens"])
        rollouts = con.sql(SQL["rollout_facts"]).to_arrow_table()
        con.register("_lgt_rollouts", rollouts)
        per_sample = con.sql(SQL["sample_facts"]).to_arrow_table()
    finally:
        con.execute(SQL["drop_sample_tokens"])
        for name in ("_lgt_sample_meta", "_lgt_rollouts"):
            con.unregister(name)
    return per_sample, rollouts


def assemble(merged: Merged, per_sample: pa.Table, mode: str) -> pa.Table:
    """The samples table: scalars beside the merged token lists, rollouts not trained left out."""
    lists = [pa.chunked_array([c[i] for c in merged.chunks], SAMPLES.field(name).type)
             for i, name in enumerate(TOKEN_LISTS)]
    ids = [f"{r}~{a}#{k}" for r, a, k in zip(per_sample.column("rollout_id").to_pylist(),
                                             per_sample.column("attempt").to_pylist(),
                                             per_sample.column("sample_index").to_pylist())]
    cols = {"sample_id": pa.array(ids, pa.string()),
            "mode": pa.array([mode] * per_sample.num_rows, pa.string()), **dict(zip(TOKEN_LISTS, lists))}
    table = pa.table([cols[f.name] if f.name in cols else per_sample.column(f.name).cast(f.type)
                      for f in SAMPLES], schema=SAMPLES)
    keep = per_sample.column("keep")
    return table if all(keep.to_pylist()) else table.filter(keep)


def make_report(mode: str, merged: Merged, samples: pa.Table, breaks: pa.Table,
                rollouts: pa.Table) -> dict[str, Any]:
    """The counts a person checks first: what was trained, what was left out and why."""
    excluded = Counter(r for r in rollouts.column("excluded").to_pylist() if r is not None)
    rewards: dict[str, list[float]] = {}  # trained rollouts' rewards by group
    for g, w, e in zip(*(rollouts.column(c).to_pylist() for c in ("group_id", "reward", "excluded"))):
        if e is None:
            rewards.setdefault(g, []).append(w)
    report: dict[str, Any] = {
        "mode": mode,
        "rollouts": {"trained": sum(map(len, rewards.values())), "excluded": dict(excluded.most_common())},
        "calls": {"used": merged.used_calls, "excluded": dict(merged.excluded_calls.most_common()),
                  "logprobs_recomputed": merged.missing_logprobs},
        **table_counts(samples, breaks),
        "groups": {"trained": len(rewards),  # equal rewards: no signal for a group-baseline estimator
                   "zero_variance": sum(1 for ws in rewards.values() if min(ws) == max(ws)),
                   "single_rollout": sum(1 for ws in rewards.values() if len(ws) == 1)},
    }
    if mode == "realign":
        report["realigned_merges"] = merged.realigned
    if samples.num_rows == 0:
        report["why_empty"] = why_empty(rollouts.num_rows, excluded, merged.excluded_calls)
    return report


def table_counts(samples: pa.Table, breaks: pa.Table) -> dict[str, dict[str, int]]:
    """The report's counts of the samples and merge breaks tables: samples per rollout attempt (how
    many attempts made 1, 2, … samples), merge breaks by reason."""
    per_rollout = pc.value_counts(pc.value_counts(pc.binary_join_element_wise(
        samples.column("rollout_id"), pc.cast(samples.column("attempt"), pa.string()), "~")).field("counts"))
    reasons = Counter(breaks.column("reason").to_pylist())
    return {"samples_per_rollout": {str(k): n for k, n in sorted(zip(per_rollout.field("values").to_pylist(),
                                                                     per_rollout.field("counts").to_pylist()))},
            "merge_breaks": {r: n for r, n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))}}


def why_empty(n_attempts: int, excluded: Counter, excluded_calls: Counter) -> str:
    if n_attempts == 0:
        return "the store has no rollouts and no calls"
    why = ", ".join(f"{n} {reason}" for reason, n in excluded.most_common())
    text = f"none of the {n_attempts} rollout attempt(s) can be trained ({why})"
    if excluded_calls:
        text += "; their calls were excluded: " + ", ".join(
            f"{n} {reason}" for reason, n in excluded_calls.most_common())
    return text
