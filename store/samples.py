"""Training samples from the store: calls merged per rollout attempt, with their rollout's facts.

A rollout attempt makes a run of model calls; each call's prompt is the agent's whole context. When a
call's prompt starts with the previous call's prompt + generated tokens, the two calls are one sample:
the later prompt already holds the earlier tokens, so only its new tokens are appended. Every split
is recorded in ``merge_breaks`` with its reason.

How the work is divided (``sql/samples.sql`` holds the views, ``sql/sample_build.sql`` the queries
this module runs):

* SQL, over scalar columns: which attempts can be trained, the seq order of their calls
  (``sample_order``), and after the merge each attempt's group, reward and trained-token count
  (``sample_rollouts``). The store gives facts: advantages and loss weights are the trainer's
  (:mod:`lgt.trainer.rl.algorithm`, by a registered estimator).
* One streaming pass over the calls files' token lists (:func:`lgt.store.merge.merge_calls`): the
  prefix check is a memcmp (``pyarrow.Buffer.equals``) on zero-copy slices of the Arrow buffers, and
  samples are assembled by joining byte ranges. The files are read with pyarrow, as the store's
  contract lays them out (``<store>/calls/*.parquet``, whole files), not through DuckDB: on 10k
  rollouts (bench/samples.py) DuckDB's Arrow export of the list columns cost as much CPU as its scan.
  The plain-SQL ``samples`` view (DuckDB list and window functions) builds the same rows ~4x slower;
  the tests hold the two to each other.

``mode="realign"`` merges across re-tokenisation drift: where the next prompt is not a token
extension of the previous call's tokens but its decoded text is, the held tokens are kept unchanged
and the prompt's tokens after the matching text are appended (:mod:`lgt.store.realign`). A store of
any size is built a chunk of whole groups at a time by :func:`lgt.store.stream.stream_samples`.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from .merge import Merged, SampleScalars, merge_calls
from .migrations import migrate
from .query import connect, group_rollouts, named_queries
from .schema import CALLS, DEFAULT_POLICY

SQL = named_queries("lgt.store", "sql/sample_build.sql")

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
    ("rollout_tokens", pa.int64()),  # generated (loss-masked) tokens of the rollout's samples of its policy
    ("mode", pa.string()),
    ("policy", pa.string()),  # the policy whose calls the sample holds (calls.policy; docs/policies.md)
])
TOKEN_LISTS = ("input_ids", "loss_mask", "behaviour_logprobs", "policy_versions")

MERGE_BREAKS = pa.schema([
    ("rollout_id", pa.string()),
    ("attempt", pa.int32()),
    ("seq", pa.int64()),  # the call that starts the new sample
    ("reason", pa.string()),  # why: one of the reasons listed in lgt.store.merge
])

BATCH_ROWS = 16384  # calls per Arrow batch read from the calls files
CALL_COLUMNS = ["rollout_id", "attempt", "seq", "status", "policy_version", "finish_reason",
                "prompt_token_ids", "response_token_ids", "response_logprobs", "policy",
                "response_policy_versions"]


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
    return scoped_build(root, groups, ids, None, mode, tokenizer)


def scoped_build(root: Path, groups: list[str], ids: Iterable[str], files: dict[str, list[str]] | None,
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


SQL_MEMORY = "1GB"  # DuckDB's memory limit for whole-store queries (the streamed build's and the count)


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


# --- rollout facts, assembly, report -------------------------------------------------------------

def rollout_scalars(con: duckdb.DuckDBPyConnection,
                    scalars: list[SampleScalars]) -> tuple[pa.Table, pa.Table]:
    """``(per_sample, rollouts)``: every rollout attempt's row of ``sample_rollouts`` given the merged
    samples, and per sample (in merge order) its rollout's group, task, reward and trained tokens,
    ``keep`` false where the rollout is not trained (it generated no tokens)."""
    meta = pa.table([pa.array(col, t) for col, t in zip(
                        list(zip(*scalars)) or [[]] * 6,
                        (pa.string(), pa.int32(), pa.int32(), pa.int32(), pa.int64(), pa.string()))],
                    names=["rollout_id", "attempt", "sample_index", "n_calls", "masked", "policy"])
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
    ids = [sample_id(r, a, k, p) for r, a, k, p in zip(*(per_sample.column(c).to_pylist() for c in (
        "rollout_id", "attempt", "sample_index", "policy")))]
    cols = {"sample_id": pa.array(ids, pa.string()),
            "mode": pa.array([mode] * per_sample.num_rows, pa.string()), **dict(zip(TOKEN_LISTS, lists))}
    table = pa.table([cols[f.name] if f.name in cols else per_sample.column(f.name).cast(f.type)
                      for f in SAMPLES], schema=SAMPLES)
    keep = per_sample.column("keep")
    return table if all(keep.to_pylist()) else table.filter(keep)


def sample_id(rollout_id: str, attempt: int, index: int, policy: str) -> str:
    """``<rollout>~<attempt>#<index>``, the index counted within the policy's calls; a policy other
    than the default named before it (``#planner.0``). The ``samples`` view spells it the same."""
    return f"{rollout_id}~{attempt}#{index}" if policy == DEFAULT_POLICY else \
        f"{rollout_id}~{attempt}#{policy}.{index}"


def split_by_policy(samples: pa.Table) -> dict[str, pa.Table]:
    """Each policy's samples (rows of :data:`SAMPLES`), in the order of their first sample: what each
    policy trains on. Every sample already holds one policy's calls, its rollout's reward, and the
    rollout's tokens of that policy (``rollout_tokens``), so each rollout counts once in each update
    when each table gets its own advantages and loss weights (``lgt.trainer.rl.algorithm.assign``)."""
    names = list(dict.fromkeys(samples.column("policy").to_pylist()))
    return {n: samples.filter(pc.equal(samples.column("policy"), n)) for n in names}


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

