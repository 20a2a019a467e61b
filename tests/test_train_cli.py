"""``lgt-train``'s inspection commands through click's CliRunner, on real stores in tmp_path."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from lgt.store.cli import shell_init_sql
from lgt.store.query import connect
from lgt.testing.store import byte_tokenizer, files, make_store
from lgt.trainer.cli import main


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_store(tmp_path_factory.mktemp("cli") / "store")


@pytest.fixture
def fresh(store: Path, tmp_path: Path) -> Path:
    shutil.copytree(store, tmp_path / "s")
    return tmp_path / "s"


def lgt_train(*args: str, input: str | None = None, ok: bool = True, code: int | None = None):
    result = CliRunner().invoke(main, [str(a) for a in args], input=input, catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, result.output
    if code is not None:
        assert result.exit_code == code, result.output
    return result


def error_line(result) -> str:
    """A user error: exit code 1 and one line on stderr."""
    assert result.exit_code == 1, result.output
    (line,) = result.stderr.strip().splitlines()
    return line


# --- sql -------------------------------------------------------------------------------------------

def test_sql_prints_a_table(store: Path) -> None:
    out = lgt_train("sql", "--store", store, "SELECT rollout_id, count(*) AS calls FROM calls "
                    "GROUP BY 1 ORDER BY 1").output
    assert "│ rollout_id │ calls │" in out
    assert "│ r-err      │     2 │" in out and "│ r-ok       │     2 │" in out


def test_the_store_may_come_from_lgt_store(store: Path) -> None:
    r = CliRunner(env={"LGT_STORE": str(store)}).invoke(main, ["sql", "SELECT count(*) AS n FROM calls"])
    assert r.exit_code == 0 and "│     6 │" in r.output


def test_sql_as_csv_and_json(store: Path) -> None:
    q = ("SELECT call_id, streamed, response_token_ids[1:2] AS ids, started_at FROM calls "
         "WHERE rollout_id = 'r-ok' ORDER BY seq")
    csv_out = lgt_train("sql", "--store", store, "--format", "csv", q).output.splitlines()
    assert csv_out == ["call_id,streamed,ids,started_at",
                       'r-ok.0.0,false,"[63,119]",2026-11-30T12:00:00+00:00',
                       'r-ok.0.1,true,"[76,119]",2026-11-30T12:00:01+00:00']  # "It": bytes + 3
    rows = json.loads(lgt_train("sql", "--store", store, "--format", "json", q).output)
    assert rows[1] == {"call_id": "r-ok.0.1", "streamed": True, "ids": [76, 119],
                       "started_at": "2026-11-30T12:00:01+00:00"}


def test_a_long_query_prints_its_rows_and_nothing_else(store: Path) -> None:
    """DuckDB draws a progress bar on stdout (a file or pipe too) during a long query; lgt-train's
    connections turn it off. Here every connection starts with the bar drawn after 100 ms, not 2 s: a
    statement shorter than that (turning the bar off) draws nothing, the counting query would."""
    script = (
        "import sys, duckdb\n"
        "real = duckdb.connect\n"
        "def eager(*a, **k):\n"
        "    con = real(*a, **k)\n"
        "    con.execute('SET progress_bar_time = 100')  # also turns the bar on\n"
        "    return con\n"
        "duckdb.connect = eager\n"
        "from lgt.trainer.cli import main\n"
        "main(sys.argv[1:])\n")
    q = "SELECT count(*) AS n FROM range(60000000) r WHERE hash(r.range) % 7 = 1"
    out = subprocess.run([sys.executable, "-c", script, "sql", "--store", str(store), "--format", "csv", q],
                         capture_output=True, text=True).stdout
    assert out.splitlines() == ["n", "8571889"], out[:300]


def test_sql_errors_are_one_line(store: Path) -> None:
    r = lgt_train("sql", "--store", store, "SELEC 1", ok=False)
    assert error_line(r) == 'Error: Parser Error: syntax error at or near "SELEC"'
    r = lgt_train("sql", "--store", store, "SELECT nope FROM calls", ok=False)
    assert error_line(r).startswith('Error: Binder Error: Referenced column "nope" not found')


def test_a_missing_store_is_a_usage_error(tmp_path: Path) -> None:
    r = lgt_train("sql", "--store", tmp_path / "nope", "SELECT 1", ok=False, code=2)
    assert f"store directory '{tmp_path / 'nope'}' does not exist" in r.stderr


def test_an_empty_store_answers_with_nothing(tmp_path: Path) -> None:
    out = lgt_train("sql", "--store", tmp_path, "--format", "json",
                    "SELECT * FROM calls JOIN rewards USING (rollout_id)").output
    assert json.loads(out) == []


def test_samples_of_an_empty_store_are_an_empty_file_and_say_why(tmp_path: Path) -> None:
    pytest.importorskip("lgt.store.samples")
    store, out = tmp_path / "store", tmp_path / "samples.parquet"
    store.mkdir()
    r = lgt_train("samples", "--store", store, "--out", out)
    assert "why empty: the store has no rollouts and no calls" in r.stdout
    assert pq.read_table(out).num_rows == 0


def test_a_corrupt_file_is_named(fresh: Path) -> None:
    data = next((fresh / "calls").glob("*.parquet")).read_bytes()
    (fresh / "calls" / "torn.parquet").write_bytes(data[:100])
    for args in (["sql", "--store", fresh, "SELECT 1"], ["show", "--store", fresh, "r-ok"],
                 ["reward", "--store", fresh, "r-ok", "1"]):
        line = error_line(lgt_train(*args, ok=False))
        assert line.startswith("Error: calls/torn.parquet is not a readable Parquet file (")
    assert not list((fresh / "rewards").glob("*torn*"))


def test_the_shell_runs_statements_from_stdin(store: Path) -> None:
    script = "\n".join([
        "SELECT rollout_id, count(*) AS n",  # a statement over two lines
        "FROM calls GROUP BY 1 ORDER BY 1;",
        ".tables",
        "SELECT nope;",  # an error: reported, and the shell goes on
        ".mode csv",
        "SELECT value FROM rewards WHERE call_id IS NULL",  # the last statement needs no ';'
    ]) + "\n"
    r = lgt_train("sql", "--store", store, input=script)
    assert "│ r-fail     │     2 │" in r.stdout
    assert "calls  egress  rewards  rewards_log  rollouts  rollouts_log" in r.stdout
    assert r.stdout.rstrip().endswith("value\n1.0")
    assert 'Error: Binder Error: Referenced column "nope" was not found' in r.stderr


def test_the_shell_stops_at_quit(store: Path) -> None:
    r = lgt_train("sql", "--store", store, input=".help\n.quit\nSELECT 42 AS never;\n")
    assert ".tables" in r.stdout and "never" not in r.stdout
    r = lgt_train("sql", "--store", store, input=".frobnicate\n")
    assert "unknown command '.frobnicate'" in r.stderr


def test_the_duckdb_cli_gets_the_same_views(store: Path, tmp_path: Path) -> None:
    """What `sql` hands the duckdb binary as -init, run here in a fresh DuckDB."""
    for root in (store, tmp_path):  # with files, and a store without any
        other = duckdb.connect()
        other.execute(shell_init_sql(connect(root), root))
        for view in ("calls", "rollouts", "rewards", "rollouts_log", "rewards_log"):
            q = f"SELECT count(*) FROM {view}"
            assert other.execute(q).fetchone() == connect(root).execute(q).fetchone()


def test_views_sql_works_in_a_plain_duckdb_client(fresh: Path) -> None:
    """`cd store && duckdb -init store/sql/views.sql`, the duckdb CLI from PyPI (another DuckDB than
    lgt's), on a store lgt wrote whose egress table has no file yet: every view answers, the empty
    table with its columns; and the same counts as lgt's own connection."""
    from lgt.store.query import views_sql

    cli = Path(sys.executable).parent / "duckdb"
    assert cli.exists(), "the duckdb CLI (PyPI's duckdb-cli) is part of the test environment"
    assert not list((fresh / "egress").glob("*.parquet"))  # a table without files
    init = fresh.parent / "views.sql"
    init.write_text(views_sql())
    views = ("calls", "rollouts", "rewards", "rollouts_log", "rewards_log", "egress")
    query = " UNION ALL ".join(f"SELECT '{v}' AS v, count(*) AS n FROM {v}" for v in views)
    out = subprocess.run([str(cli), "-init", str(init), "-csv", "-c", query + ";",
                          "-c", "SELECT translation, host FROM calls, egress LIMIT 0;"],
                         cwd=fresh, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Error" not in out.stderr, out.stderr
    counts = dict(line.split(",") for line in out.stdout.splitlines()[1:len(views) + 1])
    con = connect(fresh)
    assert counts == {v: str(con.execute(f"SELECT count(*) FROM {v}").fetchone()[0]) for v in views}
    assert counts["egress"] == "0" and int(counts["calls"]) > 0
    assert out.stdout.splitlines()[len(views) + 1] == "translation,host"  # the columns, no rows


# --- reward, rollout -------------------------------------------------------------------------------

def test_reward_records_and_says_so(fresh: Path) -> None:
    assert lgt_train("reward", "--store", fresh, "r-err", "0.75").output == \
        "reward 0.75 recorded for rollout r-err (its latest attempt)\n"
    assert lgt_train("reward", "--store", fresh, "r-err", "-1", "--call", "r-err.0.0").output == \
        "reward -1 recorded for call r-err.0.0 of rollout r-err (attempt 0)\n"
    got = connect(fresh).execute("SELECT call_id, value FROM rewards WHERE rollout_id = 'r-err' "
                                 "ORDER BY call_id NULLS FIRST").fetchall()
    assert got == [(None, 0.75), ("r-err.0.0", -1.0)]


@pytest.mark.parametrize("args, message", [
    (["ghost", "1"], "Error: rollout 'ghost' is not in the store (no calls and no rollouts row have "
                     "that id)"),
    (["r-ok", "high"], "Error: reward value 'high' is not a number"),
    (["r-ok", "nan"], "Error: reward value must be a finite number, not 'nan'"),
    (["r-ok", "inf"], "Error: reward value must be a finite number, not 'inf'"),
    (["r-ok", "1", "--call", "r-err.0.1"], "Error: call 'r-err.0.1' belongs to rollout 'r-err', not "
                                           "'r-ok'"),
    (["r-ok", "1", "--call", "zzz"], "Error: call 'zzz' is not in the store"),
    (["r-ok", "1", "--attempt", "7"], "Error: rollout 'r-ok' has no attempt 7 (it has 0)"),
])
def test_reward_refuses_bad_input_and_writes_nothing(fresh: Path, args: list, message: str) -> None:
    before = files(fresh)
    assert error_line(lgt_train("reward", "--store", fresh, *args, ok=False)) == message
    assert files(fresh) == before


def test_rollout_defines_a_group(fresh: Path) -> None:
    out = lgt_train("rollout", "--store", fresh, "r-err", "--task", "mult", "--group", "g0",
                    "--step", "0", "--status", "timeout", "--exit-code", "124").output
    assert out == "rollout r-err attempt 0 recorded: task mult, group g0, step 0, status timeout\n"
    rows = connect(fresh).execute("SELECT rollout_id, status, exit_code FROM rollouts "
                                  "WHERE group_id = 'g0' ORDER BY 1").fetchall()
    assert rows == [("r-err", "timeout", 124), ("r-fail", "failed", 3), ("r-ok", "ok", None)]


def test_rollout_refuses_a_bad_status(fresh: Path) -> None:
    before = files(fresh)
    r = lgt_train("rollout", "--store", fresh, "r-err", "--task", "t", "--group", "g",
                  "--status", "maybe", ok=False, code=2)
    assert "'maybe' is not one of 'ok', 'failed', 'timeout'" in r.stderr
    r = lgt_train("rollout", "--store", fresh, "r-err", "--group", "g", ok=False, code=2)
    assert "Missing option '--task'" in r.stderr
    assert files(fresh) == before


# --- show ------------------------------------------------------------------------------------------

def test_show_prints_the_turns(store: Path, tmp_path: Path) -> None:
    out = lgt_train("show", "--store", store, "r-ok").output
    assert out.startswith("rollout r-ok · attempt 0 · task mult · group g0 · step 0 · status ok\n"
                          "reward 1 (cli, ")
    assert "\x1b[" not in out  # no terminal: no styles
    assert "  user: 6*7" in out and "  tool [tc1]: 42" in out and "  reply: It is 42." in out
    out = lgt_train("show", "--store", store, "r-ok", "--tokenizer",
                    byte_tokenizer(tmp_path / "tokenizer.json")).output
    assert "   masked │ <|im_start|>user\n   masked │ 6*7<|im_end|>" in out
    assert "  trained │ It is 42." in out


def test_show_errors(store: Path, tmp_path: Path) -> None:
    assert error_line(lgt_train("show", "--store", store, "zzz", ok=False)) == \
        "Error: rollout 'zzz' is not in the store"
    assert error_line(lgt_train("show", "--store", store, "r-ok", "--tokenizer", tmp_path,
                                ok=False)).startswith(f"Error: no tokenizer at {tmp_path}")


# --- samples, report (the sample builder is lgt.store.samples) -------------------------------------

def test_samples_are_written_whole_and_reported(store: Path, tmp_path: Path) -> None:
    pytest.importorskip("lgt.store.samples")
    out = tmp_path / "samples.parquet"
    r = lgt_train("samples", "--store", store, "--out", out)
    assert r.stdout.splitlines() == [
        "1 sample from 1 rollout attempt (exact mode)",
        "samples per rollout: 1 sample: 1 rollout",
        "merge breaks: none",
        "rollouts: 1 trained; excluded: failed 1, no_reward 1",
        "calls: 2 used; excluded: none",  # calls of rollouts that are trained
        "groups: 1 trained, 1 with zero variance (advantage 0), 1 of a single rollout",
        f"wrote 1 sample to {out}",
    ]
    table = pq.read_table(out)
    assert table.column("rollout_id").to_pylist() == ["r-ok"]
    assert sum(table.column("loss_mask")[0].as_py()) == 44 + 9  # the generated tokens of both calls
    assert [p.name for p in tmp_path.iterdir()] == ["samples.parquet"]


def test_samples_realign_with_a_tokenizer(store: Path, tmp_path: Path) -> None:
    pytest.importorskip("lgt.store.samples")
    tok = byte_tokenizer(tmp_path / "tokenizer.json")
    r = lgt_train("samples", "--store", store, "--out", tmp_path / "s.parquet", "--mode", "realign",
                  "--tokenizer", tok, "--no-std")
    assert "1 sample from 1 rollout attempt (realign mode)" in r.stdout
    assert "realigned merges: 0" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--out", "{tmp}/no/s.parquet"], "directory {tmp}/no does not exist"),
    (["--out", "{tmp}/s.parquet", "--mode", "realign"], "--mode realign needs --tokenizer"),
    (["--out", "{tmp}/s.parquet", "--mode", "both"], "'both' is not one of 'exact', 'realign'"),
])
def test_samples_refuse_bad_arguments(store: Path, tmp_path: Path, args: list, message: str) -> None:
    r = lgt_train("samples", "--store", store, *[a.format(tmp=tmp_path) for a in args], ok=False,
                  code=2)
    assert message.format(tmp=tmp_path) in r.stderr
    assert not list(tmp_path.iterdir())


def test_report_writes_a_page(store: Path, tmp_path: Path) -> None:
    pytest.importorskip("lgt.store.samples")
    out = tmp_path / "report.html"
    r = lgt_train("report", "--store", store, "--out", out, "--title", "run 1")
    assert r.stdout == f"wrote {out}: 6 calls, 3 rollout attempts, 1 rewarded\n"
    assert "<h1>run 1</h1>" in out.read_text()


def test_inspection_imports_no_training_stack(store: Path, tmp_path: Path) -> None:
    """sql, show, reward, samples and report work where only the proxy's dependencies are."""
    code = f"""
import sys
from click.testing import CliRunner
from lgt.trainer.cli import main
store, tmp = {str(store)!r}, {str(tmp_path)!r}
for args in (["sql", "--store", store, "SELECT 1"], ["show", "--store", store, "r-ok"],
             ["samples", "--store", store, "--out", tmp + "/s.parquet"],
             ["report", "--store", store, "--out", tmp + "/r.html"]):
    assert CliRunner().invoke(main, args).exit_code == 0, args
heavy = sorted(m for m in ("torch", "transformers", "vllm", "verl") if m in sys.modules)
assert not heavy, heavy
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
