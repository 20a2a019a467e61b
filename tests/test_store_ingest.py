"""Adding rewards and rollouts, store migrations, bad files on connect, and `show`'s rendering.

The stores are real Parquet written by the store's own ``TableWriter`` with rows shaped as the proxy
writes them: a byte tokenizer (id = byte + 3, as ``lgt.testing.fake_upstream``) and a ChatML-like
template, so that a real ``tokenizers`` tokenizer built here decodes them.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
from pathlib import Path

import click
import duckdb
import orjson
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import pyarrow.parquet as pq
import pytest

from lgt.store import migrations, schema
from lgt.store.ingest import add_reward, add_rollout, add_rows, attempt_reward_row, rollout_row
from lgt.store.migrations import META_DIR, RECORD, StoreVersionError, migrate, store_version
from lgt.store.query import StoreFileError, connect, named_queries, views_sql
from lgt.store.show import load_tokenizer, load_trajectory, render
from lgt.store.writer import TableWriter
from lgt.testing.store import T0, byte_tokenizer, call_row, files, make_store, tool_rollout


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_store(tmp_path_factory.mktemp("store"))


@pytest.fixture
def fresh(store: Path, tmp_path: Path) -> Path:
    """A copy of the module's store that a test may write to."""
    shutil.copytree(store, tmp_path / "s")
    return tmp_path / "s"


# --- rewards ---------------------------------------------------------------------------------------

def test_a_batch_of_attempts_is_two_files_and_lands_in_the_views(fresh: Path) -> None:
    before = {t: len(list((fresh / t).glob("*.parquet"))) for t in ("rollouts", "rewards")}
    rows = [rollout_row(f"batch-{i}", attempt=i % 2, group_id="g1", status="ok" if i else "failed",
                        metadata={"seconds": i}) for i in range(5)]
    rewards = [attempt_reward_row(f"batch-{i}", i / 4, attempt=i % 2, source="stdout") for i in range(1, 5)]
    add_rows(fresh, rows, rewards)
    after = {t: len(list((fresh / t).glob("*.parquet"))) for t in ("rollouts", "rewards")}
    assert after == {t: n + 1 for t, n in before.items()}
    con = connect(fresh)
    got = con.execute("SELECT o.rollout_id, o.status, w.value FROM rollouts o LEFT JOIN rewards w "
                      "USING (rollout_id, attempt) WHERE o.rollout_id LIKE 'batch-%' ORDER BY 1").fetchall()
    assert got == [("batch-0", "failed", None), ("batch-1", "ok", 0.25), ("batch-2", "ok", 0.5),
                   ("batch-3", "ok", 0.75), ("batch-4", "ok", 1.0)]
    with pytest.raises(ValueError, match="not one of"):
        rollout_row("x", status="great")
    with pytest.raises(ValueError, match="finite number"):
        attempt_reward_row("x", float("inf"), attempt=0, source="stdout")


def test_rewards_land_in_the_views(store: Path) -> None:
    con = connect(store)
    rows = con.execute("SELECT rollout_id, attempt, call_id, value, source FROM rewards "
                       "ORDER BY call_id NULLS FIRST").fetchall()
    # the rollout reward resolved to the latest attempt; the per-call one took its call's attempt
    assert rows == [("r-ok", 0, None, 1.0, "cli"), ("r-ok", 0, "r-ok.0.1", 0.25, "cli")]
    assert con.execute("SELECT count(*) FROM rewards_log").fetchone() == (3,)


@pytest.mark.parametrize("value, message", [
    ("abc", "reward value 'abc' is not a number"),
    ("", "reward value '' is not a number"),
    ("nan", "reward value must be a finite number, not 'nan'"),
    (float("inf"), "reward value must be a finite number, not inf"),
    ("-inf", "finite number"),
    (True, "reward value True is not a number"),
    (None, "reward value None is not a number"),
])
def test_a_reward_must_be_a_finite_number(fresh: Path, value: object, message: str) -> None:
    before = files(fresh)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        add_reward(fresh, "r-ok", value)
    assert files(fresh) == before


@pytest.mark.parametrize("kw, message", [
    ({"rollout_id": "nope"}, "rollout 'nope' is not in the store"),
    ({"attempt": 4}, "rollout 'r-ok' has no attempt 4 \\(it has 0\\)"),
    ({"call_id": "missing"}, "call 'missing' is not in the store"),
    ({"call_id": "r-err.0.0"}, "call 'r-err.0.0' belongs to rollout 'r-err', not 'r-ok'"),
    ({"rollout_id": ""}, "rollout id must be a non-empty string"),
    ({"attempt": -1}, "attempt must be a whole number ≥ 0"),
])
def test_a_reward_must_name_something_recorded(fresh: Path, kw: dict, message: str) -> None:
    before = files(fresh)
    args = {"rollout_id": "r-ok", "value": 1.0, **kw}
    with pytest.raises(ValueError, match=message):
        add_reward(fresh, args.pop("rollout_id"), args.pop("value"), **args)
    assert files(fresh) == before


def test_a_reward_for_a_rollout_known_only_from_rollouts_or_the_wal(fresh: Path) -> None:
    add_rollout(fresh, "planned", task_id="t", group_id="g")
    add_reward(fresh, "planned", 2)
    # calls a running proxy appended but has not converted to Parquet yet
    live = TableWriter(fresh, "calls", flush_seconds=3600).open()
    try:
        live.append(tool_rollout("in-wal", "1*1", "1")[0])
        add_reward(fresh, "in-wal", -1, call_id="in-wal.0.0")
    finally:
        live.close()
    got = connect(fresh).execute("SELECT rollout_id, attempt, value FROM rewards ORDER BY 1").fetchall()
    assert ("planned", 0, 2.0) in got and ("in-wal", 0, -1.0) in got


def test_adding_a_reward_loses_nothing_a_running_proxy_is_writing(fresh: Path) -> None:
    """The proxy's rewards writer has an open WAL segment; a CLI reward must not take it over."""
    live = TableWriter(fresh, "rewards", flush_seconds=3600).open()
    row = {"rollout_id": "r-ok", "attempt": 0, "value": 0.0, "source": "proxy", "recorded_at": T0}
    try:
        live.append({**row, "reward_id": "p1"})
        add_reward(fresh, "r-ok", 1.0)
        live.append({**row, "reward_id": "p2"})
    finally:
        live.close()
    ids = connect(fresh).execute("SELECT reward_id FROM rewards_log WHERE source = 'proxy'").fetchall()
    assert sorted(ids) == [("p1",), ("p2",)]


# --- rollouts --------------------------------------------------------------------------------------

def test_rollouts_define_groups_and_the_latest_row_wins(fresh: Path) -> None:
    add_rollout(fresh, "r-err", task_id="mult", group_id="g0", step=0, status="timeout")
    add_rollout(fresh, "r-err", task_id="mult", group_id="g1", step=1, exit_code=0,
                metadata={"seed": 7})
    rows = connect(fresh).execute("SELECT rollout_id, task_id, group_id, step, status, exit_code, "
                                  "metadata_json FROM rollouts ORDER BY 1").fetchall()
    assert rows == [("r-err", "mult", "g1", 1, "ok", 0, '{"seed":7}'),
                    ("r-fail", "add", "g0", 0, "failed", 3, None),
                    ("r-ok", "mult", "g0", 0, "ok", None, None)]


@pytest.mark.parametrize("kw, message", [
    ({"status": "crashed"}, "rollout status 'crashed' is not one of ok, failed, timeout"),
    ({"step": -2}, "step must be a whole number ≥ 0, not -2"),
    ({"attempt": "0"}, "attempt must be a whole number ≥ 0, not '0'"),
    ({"task_id": ""}, "task id must be a non-empty string"),
    ({"exit_code": 1.5}, "exit code must be an integer"),
    ({"started_at": dt.datetime(2026, 1, 1)}, "started_at must be a datetime with a time zone"),
    ({"metadata": {"f": object()}}, "rollout metadata is not JSON"),
])
def test_a_bad_rollout_is_refused_whole(fresh: Path, kw: dict, message: str) -> None:
    before = files(fresh)
    with pytest.raises(ValueError, match=message):
        add_rollout(fresh, "r-new", **kw)
    assert files(fresh) == before


def test_eval_rollouts_are_marked_and_never_become_samples(fresh: Path) -> None:
    from lgt.store.samples import build_samples

    with TableWriter(fresh, "calls") as w:
        for row in tool_rollout("r-eval", "6*7", "42"):
            w.append(row)
    add_rollout(fresh, "r-eval", task_id="mult", group_id="e000000-00000", step=0, split="eval")
    add_reward(fresh, "r-eval", 1.0)
    con = connect(fresh)
    # files written before schema 4 hold no split column: their rollouts read as 'train'
    assert con.execute("SELECT rollout_id, split FROM rollouts ORDER BY 1").fetchall() == [
        ("r-err", "train"), ("r-eval", "eval"), ("r-fail", "train"), ("r-ok", "train")]
    built = build_samples(con)
    assert "r-eval" not in built.samples["rollout_id"].to_pylist()
    assert "r-ok" in built.samples["rollout_id"].to_pylist()
    with pytest.raises(ValueError, match="rollout split 'test' is not one of train, eval"):
        add_rollout(fresh, "r-x", split="test")


def test_a_missing_store_is_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="store directory .*nope does not exist"):
        add_reward(tmp_path / "nope", "r", 1)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        add_rollout(tmp_path / "nope", "r")


# --- migrations ------------------------------------------------------------------------------------

def write_v1_store(root: Path) -> None:
    """A store as the proxy wrote it at schema version 1: calls only, no migration record."""
    (root / "calls").mkdir(parents=True)
    rows = tool_rollout("old", "1+2", "3")
    later = ("capture", "capture_reason", "sampling", "api", "translation", "policy")  # after version 1
    v1 = pa.schema([f for f in schema.CALLS if f.name not in later],
                   metadata={schema.SCHEMA_VERSION_KEY: b"1", schema.TABLE_KEY: b"calls"})
    table = pa.Table.from_pylist(rows, schema=v1)
    pq.write_table(table, root / "calls" / "part-1.parquet")


def test_a_version_1_store_is_brought_to_the_current_version(tmp_path: Path) -> None:
    write_v1_store(tmp_path)
    assert store_version(tmp_path) == 1
    assert migrate(tmp_path) == 8 == schema.SCHEMA_VERSION
    record = orjson.loads((tmp_path / META_DIR / RECORD).read_bytes())
    assert record["schema_version"] == 8
    assert [(a["version"], a["name"]) for a in record["applied"]] == [
        (2, "add the rollouts and rewards tables"),
        (3, "add calls.capture, calls.capture_reason and the egress table"),
        (4, "add calls.sampling and rollouts.split"),
        (5, "add calls.api"),
        (6, "add calls.translation and each table's schema file"),
        (7, "add calls.policy"),
        (8, "add calls.response_policy_versions")]
    assert all((tmp_path / t).is_dir() for t in ("rollouts", "rewards", "egress"))
    for table, columns in schema.TABLES.items():  # no rows, the current columns
        t = pq.read_table(tmp_path / schema.schema_file(table))
        assert t.num_rows == 0 and t.schema.equals(columns)
        assert t.schema.metadata[schema.SCHEMA_VERSION_KEY] == b"8"
    # a plain DuckDB given only views.sql (no lgt): the v1 rows, the new columns as null, empty tables
    plain = duckdb.connect()
    plain.execute("SET file_search_path = ?", [str(tmp_path)])
    plain.execute(views_sql())
    assert plain.execute("SELECT count(*), count(api), count(translation) FROM calls").fetchone() == (2, 0, 0)
    # rows from before calls.policy read as the one policy of a run that named none
    assert plain.execute("SELECT list(DISTINCT policy) FROM calls").fetchone() == ([schema.DEFAULT_POLICY],)
    assert plain.execute("SELECT count(*) FROM egress").fetchone() == (0,)
    assert migrate(tmp_path) == 8  # nothing left to do; the record is kept as it was
    assert orjson.loads((tmp_path / META_DIR / RECORD).read_bytes()) == record
    add_reward(tmp_path, "old", 1)  # and the old rows are readable next to new tables
    con = connect(tmp_path)
    assert con.execute("SELECT count(*) FROM calls JOIN rewards USING (rollout_id)").fetchone() == (2,)
    assert con.execute("SELECT count(*) FROM egress").fetchone() == (0,)
    # a version-3 calls file next to the old one: the old rows read capture as null
    new_rows = [{**r, "call_id": r["call_id"] + "-new", "rollout_id": "new", "capture": "full",
                 "api": "messages", "policy": "planner"} for r in tool_rollout("new", "1+2", "3")]
    pq.write_table(pa.Table.from_pylist(new_rows, schema=schema.CALLS), tmp_path / "calls" / "part-2.parquet")
    assert connect(tmp_path).execute("SELECT rollout_id, capture, api, policy FROM calls GROUP BY ALL "
                                     "ORDER BY 1").fetchall() == [("new", "full", "messages", "planner"),
                                                      ("old", None, None, schema.DEFAULT_POLICY)]


def test_a_recorded_version_1_is_migrated_on_connect(tmp_path: Path) -> None:
    write_v1_store(tmp_path)
    (tmp_path / META_DIR).mkdir()
    (tmp_path / META_DIR / RECORD).write_text('{"schema_version": 1, "applied": []}')
    connect(tmp_path)
    assert store_version(tmp_path) == schema.SCHEMA_VERSION
    assert not [p for p in (tmp_path / META_DIR).iterdir() if p.name.endswith(".tmp")]


def test_a_store_from_a_newer_lgt_is_refused(tmp_path: Path) -> None:
    write_v1_store(tmp_path)
    (tmp_path / META_DIR).mkdir()
    newer = schema.SCHEMA_VERSION + 1
    (tmp_path / META_DIR / RECORD).write_text(f'{{"schema_version": {newer}, "applied": []}}')
    message = (rf"was written by a newer lgt \(schema version {newer}; this lgt knows up to "
               rf"{schema.SCHEMA_VERSION}\); upgrade lgt to use this store")
    with pytest.raises(StoreVersionError, match=message):
        migrate(tmp_path)
    with pytest.raises(StoreVersionError, match=message):
        connect(tmp_path)
    with pytest.raises(StoreVersionError):
        add_reward(tmp_path, "old", 1)
    assert not (tmp_path / "rewards").exists()


def test_a_file_from_a_newer_lgt_is_refused_by_name(fresh: Path) -> None:
    src = next((fresh / "calls").glob("*.parquet"))
    t = pq.read_table(src)
    newer = str(schema.SCHEMA_VERSION + 1).encode()
    pq.write_table(t.replace_schema_metadata({**t.schema.metadata, schema.SCHEMA_VERSION_KEY: newer}),
                   fresh / "calls" / "new.parquet")
    with pytest.raises(StoreVersionError, match=r"calls/new.parquet was written by a newer lgt"):
        connect(fresh)


def test_a_directory_that_is_not_a_store_is_not_written_to(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hi")
    assert migrate(tmp_path) == schema.SCHEMA_VERSION
    assert connect(tmp_path).execute("SELECT count(*) FROM rollouts").fetchone() == (0,)
    assert files(tmp_path) == ["notes.txt"]


def test_a_store_that_cannot_be_written_is_still_read(tmp_path: Path, monkeypatch, caplog) -> None:
    write_v1_store(tmp_path)

    def read_only(*a, **k):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(migrations, "_write_record", read_only)
    assert connect(tmp_path).execute("SELECT count(*) FROM calls").fetchone() == (2,)
    assert "cannot be migrated here" in caplog.text
    with pytest.raises(PermissionError):
        migrate(tmp_path)  # a writer must not go on


# --- bad files on connect --------------------------------------------------------------------------

def test_a_truncated_parquet_file_is_named(fresh: Path) -> None:
    data = next((fresh / "calls").glob("*.parquet")).read_bytes()
    (fresh / "calls" / "cut.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(StoreFileError, match=r"^calls/cut.parquet is not a readable Parquet file "
                                             r"\(.+\); move it out of calls/$"):
        connect(fresh)


def test_an_empty_file_is_named(fresh: Path) -> None:
    (fresh / "rewards" / "zero.parquet").write_bytes(b"")
    with pytest.raises(StoreFileError, match=r"rewards/zero.parquet is not a readable Parquet file"):
        connect(fresh)


def test_a_foreign_parquet_file_is_named(fresh: Path) -> None:
    pq.write_table(pa.table({"id": [1], "text": ["x"]}), fresh / "calls" / "other.parquet")
    with pytest.raises(StoreFileError, match=r"calls/other.parquet is not an lgt calls file: it lacks "
                                             r"the column\(s\) call_id, rollout_id, attempt"):
        connect(fresh)


def test_a_file_with_a_clashing_column_type_is_named(fresh: Path) -> None:
    rows = pa.Table.from_pylist([{"rollout_id": "r", "attempt": 0, "status": "ok",
                                  "recorded_at": "yesterday"}])
    pq.write_table(rows, fresh / "rollouts" / "hand.parquet")
    with pytest.raises(StoreFileError, match="rollouts/hand.parquet is not an lgt rollouts file: its "
                                             "column recorded_at is string, where the rollouts schema "
                                             "has timestamp"):
        connect(fresh)


def test_a_file_of_another_table_is_named(fresh: Path) -> None:
    src = next((fresh / "rewards").glob("*.parquet"))
    shutil.copy(src, fresh / "calls" / "misplaced.parquet")
    with pytest.raises(StoreFileError, match="calls/misplaced.parquet holds rows of the rewards table, "
                                             "not calls; move it to rewards/"):
        connect(fresh)


def test_a_hand_written_file_with_the_right_columns_is_read(fresh: Path) -> None:
    # another tool's rows with the table's columns (narrower ints, no lgt tags) are welcome
    rows = pa.table({"rollout_id": ["r-err"], "attempt": pa.array([0], pa.int64()),
                     "status": ["ok"], "recorded_at": pa.array([T0], pa.timestamp("ms", tz="UTC"))})
    pq.write_table(rows, fresh / "rollouts" / "hand.parquet")
    assert connect(fresh).execute("SELECT status FROM rollouts WHERE rollout_id = 'r-err'"
                                  ).fetchall() == [("ok",)]


def test_an_empty_store_answers_with_nothing(tmp_path: Path) -> None:
    for table in schema.TABLES:
        (tmp_path / table).mkdir()
    con = connect(tmp_path)
    for view in ("calls", "rollouts", "rewards", "rollouts_log", "rewards_log"):
        assert con.execute(f"SELECT count(*) FROM {view}").fetchone() == (0,)


def test_named_queries_are_found_by_name_with_their_comments_left_out() -> None:
    build = named_queries("lgt.store", "sql/sample_build.sql")
    assert build["call_order"] == "FROM sample_order"  # its comment and trailing ; left out
    assert {"duplicate_seq", "trained_rollouts", "sample_tokens", "sample_facts"} <= build.keys()
    stream = named_queries("lgt.store", "sql/sample_stream.sql")
    assert stream["plan"].count("CREATE OR REPLACE TEMP TABLE") == 4  # several statements, kept whole
    lines = [line for queries in (build, stream) for q in queries.values() for line in q.splitlines()]
    assert lines and not any(line.lstrip().startswith("--") for line in lines)


# --- show ------------------------------------------------------------------------------------------

def plain(lines: list[str]) -> str:
    return "\n".join(click.unstyle(l) for l in lines)


def test_show_renders_a_messages_api_call_as_the_chat_call_it_became(tmp_path: Path) -> None:
    from lgt.proxy.dialects import as_chat  # what `lgt-train show` gives the store's renderer

    row = tool_rollout("r-claude", "6*7", "42")[0]
    row.update(api="messages", requested_model="claude-x", request_json=json.dumps({
        "model": "claude-x", "max_tokens": 64, "system": "Use the calculator.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "6*7"}]}]}),
        response_json=json.dumps({"type": "message", "role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "calculator", "input": {"expression": "6*7"}}]}))
    with TableWriter(tmp_path, "calls") as w:
        w.append(row)
    add_rollout(tmp_path, "r-claude", task_id="mult", group_id="g0", step=0)
    text = plain(render(load_trajectory(connect(tmp_path), "r-claude"), as_chat=as_chat))
    assert "· not streamed · messages → chat/completions · claude-x → policy" in text
    assert "  system: Use the calculator." in text and "  user: 6*7" in text
    assert '  reply → calculator({"expression": "6*7"})' in text


def test_show_lists_what_was_approximated_and_the_calls_the_proxy_refused(tmp_path: Path) -> None:
    from lgt.proxy.dialects import as_chat  # what `lgt-train show` gives the store's renderer

    first, second = tool_rollout("r-fit", "6*7", "42")
    first["translation"] = ["max_tokens 128000 is more than the engine's context of 512 tokens: left out"]
    second["seq"] = 2  # between them, a call the proxy answered 429 (reject mode); the agent sent it again
    refused = {**call_row("r-fit", 1, [], {}, status="rejected"), "http_status": 429,
               "error": "the policy is being updated; retry shortly"}
    with TableWriter(tmp_path, "calls") as w:
        for row in (first, refused, second):
            w.append(row)
    add_rollout(tmp_path, "r-fit", task_id="mult", group_id="g0", step=0)
    add_reward(tmp_path, "r-fit", 1)
    text = plain(render(load_trajectory(connect(tmp_path), "r-fit"), as_chat=as_chat))
    assert "  approximated: max_tokens 128000 is more than the engine's context of 512 tokens" in text
    assert "call 1 · policy v0 · rejected" in text
    assert "  error: the policy is being updated; retry shortly" in text
    assert "not trained: the proxy answered it itself; it never reached the policy" in text
    assert "extends the previous call" in text  # the refused call does not split the sample


def test_show_names_each_calls_policy_and_merges_within_it(tmp_path: Path) -> None:
    coder = tool_rollout("r-two", "6*7", "42")  # the coder's two calls, a planner's call between them
    planner = call_row("r-two", 1, [{"role": "user", "content": "plan 6*7"}], {"role": "assistant",
                                                                               "content": "Multiply."})
    coder[1]["seq"] = 2
    with TableWriter(tmp_path, "calls") as w:
        for row, policy in ((coder[0], "coder"), (planner, "planner"), (coder[1], "coder")):
            w.append({**row, "policy": policy})
    add_rollout(tmp_path, "r-two", task_id="mult", group_id="g0", step=0)
    add_reward(tmp_path, "r-two", 1)
    text = plain(render(load_trajectory(connect(tmp_path), "r-two")))
    assert "── call 0 · policy coder v0 · ok" in text and "── call 1 · policy planner v0 · ok" in text
    assert "── call 2 · policy coder v0 · ok" in text
    assert "extends the previous call" in text and "a new sample" not in text  # the coder's call 0
    assert "3 calls · 62 generated tokens, 62 trained · 2 samples" in text  # the coder's and the planner's
    assert "trained (sample coder.0)" in text and "trained (sample planner.0)" in text


def test_show_renders_turns_tool_calls_tokens_and_rewards(store: Path) -> None:
    text = plain(render(load_trajectory(connect(store), "r-ok")))
    assert text.splitlines()[0] == "rollout r-ok · attempt 0 · task mult · group g0 · step 0 · status ok"
    assert "reward 1 (cli," in text
    assert "── call 0 · policy v0 · ok · 12 ms · not streamed · chat/completions · gpt-4o → policy" in text
    assert "  system: Use the calculator." in text and "  user: 6*7" in text
    assert '  reply → calculator({"expression": "6*7"})' in text
    assert "(3 earlier message(s) unchanged)" in text  # call 1 shows only what is new
    assert "  tool [tc1]: 42" in text and "  reply: It is 42." in text
    # call 0 generates '<tool_call>{"expression": "6*7"}</tool_call>' = 11 + 21 + 12 = 44 bytes;
    # call 1 adds '<|im_end|>\n' (11) + '<|im_start|>tool\n42<|im_end|>\n' (30)
    # + '<|im_start|>assistant\n' (22) = 63 tokens and generates 'It is 42.' (9)
    assert "prompt 102 tokens · generated 44 · trained (sample 0) · finish tool_calls" in text
    assert ("prompt 209 tokens · +63 new, extends the previous call · generated 9 · trained "
            "(sample 0)") in text
    assert "reward for this call 0.25" in text
    assert "2 calls · 53 generated tokens, 53 trained · 1 sample" in text
    assert "masked │" not in text  # no tokenizer: counts only


def test_show_with_a_tokenizer_marks_masked_and_trained_spans(store: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(byte_tokenizer(tmp_path / "tokenizer.json"))
    lines = render(load_trajectory(connect(store), "r-ok"), tok)
    text = plain(lines)
    assert "   masked │ <|im_start|>system" in text
    assert '  trained │ <tool_call>{"expression": "6*7"}</tool_call>' in text
    # call 1 decodes only the tokens added since call 0: the tool turn, then the answer
    assert "   masked │ <|im_start|>tool\n   masked │ 42<|im_end|>" in text
    assert "  trained │ It is 42." in text
    styled = [l for l in lines if "It is 42." in l and "trained" in l]
    assert styled and styled[0].startswith(click.style("", bold=True)[:4])  # bold in a terminal


def test_show_says_why_nothing_is_trained(store: Path, tmp_path: Path) -> None:
    con = connect(store)
    failed = plain(render(load_trajectory(con, "r-fail")))
    assert "status failed (exit 3)" in failed and "reward none recorded yet" in failed
    assert ("2 calls · 52 generated tokens, 0 trained · would be 1 sample · nothing trained: "
            "the rollout's status is failed") in failed
    assert "generated 44 · not trained · finish tool_calls" in failed
    tok = load_tokenizer(byte_tokenizer(tmp_path / "tokenizer.json"))
    err = plain(render(load_trajectory(con, "r-err"), tok))
    assert "nothing trained: the rollout has no reward yet" in err
    assert "call 1 · policy v0 · http_error" in err
    assert "not trained: call status http_error" in err and "error: upstream answered 500" in err
    assert "\n  trained │ " not in err and "\n   masked │ <tool_call>" in err


def test_show_marks_what_the_sample_builder_trains(fresh: Path) -> None:
    """A rollout whose calls split every way the builder knows; show agrees with build_samples."""
    samples = pytest.importorskip("lgt.store.samples")
    calls = tool_rollout("mix", "6*7", "42")  # 0: the tool call, 1: the answer (extends 0)
    error = call_row("mix", 2, [{"role": "user", "content": "more"}], {}, status="http_error")
    again = call_row("mix", 3, [{"role": "user", "content": "more"}], {"content": "ok"})
    cut = call_row("mix", 4, [{"role": "user", "content": "m"}], {"content": "ok"})  # shorter
    other = call_row("mix", 5, [{"role": "user", "content": "something else entirely"}],
                     {"content": "fine"})
    nolp = {**call_row("mix", 6, [{"role": "user", "content": "x"}], {"content": "y"}),
            "response_logprobs": None}
    with TableWriter(fresh, "calls") as w:
        for row in [*calls, error, again, cut, other, nolp]:
            w.append(row)
    add_reward(fresh, "mix", 1)
    con = connect(fresh)
    text = plain(render(load_trajectory(con, "mix")))
    marks = [line.split(" · ", 1)[1] for line in text.splitlines() if line.startswith("  prompt ")]
    assert marks == [
        "generated 44 · trained (sample 0) · finish tool_calls",
        "+63 new, extends the previous call · generated 9 · trained (sample 0) · finish stop",
        "generated 0 · not trained: call status http_error",
        "a new sample: the call before is not trained · generated 2 · trained (sample 1) · finish stop",
        "a new sample: shorter than the previous prompt + reply (context trimmed) · generated 2 · "
        "trained (sample 2) · finish stop",
        "a new sample: does not extend the previous call token by token · generated 4 · trained "
        "(sample 3) · finish stop",
        # recorded without logprobs: trained all the same, the trainer recomputes them
        "a new sample: shorter than the previous prompt + reply (context trimmed) · generated 1 · "
        "trained (sample 4) · logprobs recomputed by the trainer · finish stop",
    ]
    build = samples.build_samples(con)
    mine = build.samples.filter(pa.compute.equal(build.samples.column("rollout_id"), "mix"))
    assert mine.num_rows == 5
    assert sum(sum(m) for m in mine.column("loss_mask").to_pylist()) == 44 + 9 + 2 + 2 + 4 + 1
    breaks = build.merge_breaks.filter(pa.compute.equal(build.merge_breaks.column("rollout_id"), "mix"))
    assert breaks.column("reason").to_pylist() == ["excluded_call", "truncation", "no_tokenizer",
                                                   "truncation"]


def test_show_refuses_unknown_rollouts_and_attempts(store: Path) -> None:
    con = connect(store)
    with pytest.raises(ValueError, match="rollout 'zzz' is not in the store"):
        load_trajectory(con, "zzz")
    with pytest.raises(ValueError, match=r"rollout 'r-ok' has no attempt 2 \(it has 0\)"):
        load_trajectory(con, "r-ok", 2)


def test_long_text_is_elided_unless_asked(fresh: Path) -> None:
    long = "x" * 5000
    with TableWriter(fresh, "calls") as w:
        w.append(call_row("long", 0, [{"role": "user", "content": long}], {"content": "ok"}))
    traj = load_trajectory(connect(fresh), "long")
    assert "characters] …" in plain(render(traj)) and long not in plain(render(traj))
    assert long in plain(render(traj, truncate=None))


def test_a_missing_or_broken_tokenizer_is_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no tokenizer at .*: give a tokenizer.json or a model dir"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not a tokenizer the tokenizers library can read"):
        load_tokenizer(tmp_path)
