"""The store's commands (``lgt-train sql``, ``reward``, ``rollout``, ``show``, ``report``): inspect a
store, join rewards and rollouts to its calls, read one trajectory, write its report. They need the
store's own dependencies only (no torch, no proxy), so they work in either environment.

Each command checks its input, calls one function of ``lgt.store`` and prints the result; a user's
mistake ends in one sentence (``click.ClickException``), with nothing written. ``show`` displays a
translated call (Responses, Messages, Gemini) as the chat call it became when the command line that
mounts these commands gives it the proxy's reader (``ctx.obj["as_chat"]``); without one it shows the
agent's own request.
"""

from __future__ import annotations

import csv
import datetime as dt
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
import duckdb
import orjson

from lgt.store import ingest
from lgt.store import show as show_mod
from lgt.store.migrations import StoreVersionError
from lgt.store.query import connect
from lgt.store.schema import ROLLOUT_STATUSES


def _store(ctx: click.Context, param: click.Parameter, value: str) -> Path:
    """A store folder; or ``s3://bucket/prefix``: its local mirror, brought up to date first, and what a
    command added to it (rewards, rollouts) uploaded when it ends."""
    from lgt.store.remote import resolve

    try:
        local, remote = resolve(value)
        if remote is not None:
            remote.pull()
            ctx.call_on_close(remote.push_all)  # rewards or rollouts a command added
    except (ValueError, OSError) as e:
        raise click.BadParameter(str(e)) from None
    if not local.is_dir():
        raise click.BadParameter(f"store directory {str(local)!r} does not exist")
    return local


store_option = click.option(
    "--store", required=True, envvar="LGT_STORE", show_envvar=True, callback=_store,
    help="The store directory (the proxy's --store), or s3://bucket/prefix (read through a local mirror).")
tokenizer_option = click.option(
    "--tokenizer", type=click.Path(exists=True, path_type=Path),
    help="A tokenizer.json, or a model directory holding one (decoding needs `tokenizers` only).")


@contextmanager
def user_errors() -> Iterator[None]:
    """Bad input found below the command line becomes one sentence, not a traceback."""
    try:
        yield
    except (ValueError, FileNotFoundError, StoreVersionError) as e:
        raise click.ClickException(str(e)) from None


def open_store(store: Path) -> duckdb.DuckDBPyConnection:
    with user_errors():
        return connect(store)


# --- sql -----------------------------------------------------------------------------------------

@click.command()
@store_option
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table",
              show_default=True)
@click.option("--max-rows", type=click.IntRange(min=0), default=40, show_default=True,
              help="Rows a table shows (0: all); csv and json print every row.")
@click.argument("query", required=False)
def sql(store: Path, fmt: str, max_rows: int, query: str | None) -> None:
    """Run QUERY over the store's views (calls, rollouts, rewards, rollouts_log, rewards_log).

    Without QUERY: an interactive shell with the views loaded (the duckdb CLI when it is installed).
    """
    con = open_store(store)
    if query is None:
        shell(con, store, fmt, max_rows)
        return
    try:
        run_statement(con, query, fmt, max_rows)
    except duckdb.Error as e:
        raise click.ClickException(_duckdb_message(e)) from None


def run_statement(con: duckdb.DuckDBPyConnection, query: str, fmt: str, max_rows: int) -> None:
    rel = con.sql(query)
    if rel is None:  # a statement without a result (SET, CREATE VIEW …)
        return
    if fmt == "table":
        rel.show(max_width=shutil.get_terminal_size().columns, max_rows=max_rows or 2**62)
        return
    columns, rows = rel.columns, rel.fetchall()
    out = click.get_text_stream("stdout")
    if fmt == "csv":
        w = csv.writer(out, lineterminator="\n")
        w.writerow(columns)
        w.writerows([_csv_value(v) for v in row] for row in rows)
    else:
        out.write("[" + ",\n".join(orjson.dumps(dict(zip(columns, row)), default=str).decode()
                                   for row in rows) + "]\n")


def _csv_value(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, dict)):
        return orjson.dumps(v, default=str).decode()
    if isinstance(v, (dt.datetime, dt.date)):
        return v.isoformat()
    return v


def _duckdb_message(e: duckdb.Error) -> str:
    return " ".join(str(e).split("\n\n")[0].split())  # DuckDB's first paragraph, on one line


def shell(con: duckdb.DuckDBPyConnection, store: Path, fmt: str, max_rows: int) -> None:
    """The duckdb CLI over the same views when one is installed and we are at a terminal; else
    a small line-based shell here (also what runs when statements are piped in)."""
    binary = shutil.which("duckdb")
    if binary and sys.stdin.isatty():
        with tempfile.NamedTemporaryFile("w", suffix=".sql", prefix="lgt-views-") as init:
            init.write(shell_init_sql(con, store))
            init.flush()
            raise SystemExit(subprocess.call([binary, "-init", init.name]))
    python_shell(con, fmt, max_rows)


def shell_init_sql(con: duckdb.DuckDBPyConnection, store: Path) -> str:
    """SQL that recreates ``con``'s views in another DuckDB (tables without files as empty ones)."""
    root = str(Path(store).resolve()).replace("'", "''")
    out = [f"SET file_search_path = '{root}';"]
    for (name,) in con.execute("SELECT view_name FROM duckdb_views() WHERE temporary AND NOT internal "
                               "AND view_name LIKE '\\_empty\\_%' ESCAPE '\\'").fetchall():
        cols = ", ".join(f'"{c}" {t}' for c, t, *_ in con.execute(f'DESCRIBE "{name}"').fetchall())
        out.append(f'CREATE TEMP TABLE "{name}" ({cols});')
    for (text,) in con.execute("SELECT sql FROM duckdb_views() WHERE NOT temporary AND NOT internal "
                               "ORDER BY view_oid").fetchall():
        out.append(text.rstrip(";") + ";")
    return "\n".join(out) + "\n"


SHELL_HELP = """\
Statements end with ';'. Views: calls, rollouts, rewards, rollouts_log, rewards_log.
.tables    list the views          .mode table|csv|json    how results print
.help      this text               .quit / .exit           leave (so does end of input)"""


def python_shell(con: duckdb.DuckDBPyConnection, fmt: str = "table", max_rows: int = 40) -> None:
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        click.echo("lgt sql shell (DuckDB " + duckdb.__version__ + "); .help for help")

    def read(prompt: str) -> str | None:
        if interactive:
            try:
                return input(prompt)
            except EOFError:
                click.echo()
                return None
        line = sys.stdin.readline()
        return line.rstrip("\n") if line else None

    buf: list[str] = []
    while (line := read("...> " if buf else "lgt> ")) is not None:
        text = line.strip()
        if not buf and text.startswith("."):
            cmd, *args = text.split()
            if cmd in (".quit", ".exit", ".q"):
                return
            if cmd == ".help":
                click.echo(SHELL_HELP)
            elif cmd == ".tables":
                names = [n for (n,) in con.execute(
                    "SELECT view_name FROM duckdb_views() WHERE NOT internal AND NOT temporary "
                    "ORDER BY 1").fetchall()]
                click.echo("  ".join(names))
            elif cmd == ".mode" and args and args[0] in ("table", "csv", "json"):
                fmt = args[0]
            else:
                click.echo(f"Error: unknown command {text!r}; .help lists the commands", err=True)
            continue
        if not text and not buf:
            continue
        buf.append(line)
        if text.endswith(";"):
            _shell_run(con, "\n".join(buf), fmt, max_rows)
            buf = []
    if "".join(buf).strip():  # a last statement without its ';'
        _shell_run(con, "\n".join(buf), fmt, max_rows)


def _shell_run(con: duckdb.DuckDBPyConnection, statement: str, fmt: str, max_rows: int) -> None:
    try:
        run_statement(con, statement, fmt, max_rows)
    except duckdb.Error as e:
        click.echo(f"Error: {_duckdb_message(e)}", err=True)


# --- reward, rollout -----------------------------------------------------------------------------

@click.command(context_settings={"ignore_unknown_options": True})  # VALUE may be negative: -1
@store_option
@click.option("--attempt", type=click.IntRange(min=0), help="The rollout attempt (default: its latest).")
@click.option("--call", "call_id", help="Reward one call of the rollout instead of the whole.")
@click.option("--source", default="cli", show_default=True, help="Who gives the reward.")
@click.argument("rollout_id")
@click.argument("value")
def reward(store: Path, attempt: int | None, call_id: str | None, source: str, rollout_id: str,
           value: str) -> None:
    """Record VALUE as the reward of ROLLOUT_ID (the latest reward recorded counts)."""
    with user_errors():
        row = ingest.add_reward(store, rollout_id, value, attempt=attempt, call_id=call_id,
                                source=source)
    where = f"attempt {row['attempt']}" if row["attempt"] is not None else "its latest attempt"
    target = f"call {row['call_id']} of rollout {rollout_id}" if row["call_id"] else f"rollout {rollout_id}"
    click.echo(f"reward {row['value']:g} recorded for {target} ({where})")


@click.command()
@store_option
@click.argument("rollout_id")
@click.option("--task", "task_id", required=True, help="The task the rollout worked on.")
@click.option("--group", "group_id", required=True,
              help="Its group: rollouts of one task in one step; advantages are normalised per group.")
@click.option("--step", type=click.IntRange(min=0), help="The training step it belongs to.")
@click.option("--attempt", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--status", type=click.Choice(ROLLOUT_STATUSES), default="ok", show_default=True,
              help="failed and timeout rollouts are never trained on.")
@click.option("--exit-code", type=int, help="The agent's exit code.")
def rollout(store: Path, rollout_id: str, task_id: str, group_id: str, step: int | None, attempt: int,
            status: str, exit_code: int | None) -> None:
    """Define ROLLOUT_ID's task, group, step and status (re-running it replaces the earlier row)."""
    with user_errors():
        row = ingest.add_rollout(store, rollout_id, attempt=attempt, task_id=task_id,
                                 group_id=group_id, step=step, status=status, exit_code=exit_code)
    step_text = f", step {row['step']}" if row["step"] is not None else ""
    click.echo(f"rollout {rollout_id} attempt {attempt} recorded: task {task_id}, group {group_id}"
               f"{step_text}, status {status}")


def check_out(out: Path, mode: str, tokenizer: Path | None) -> None:
    if not out.parent.is_dir():
        raise click.UsageError(f"--out {out}: directory {out.parent} does not exist")
    if mode == "realign" and tokenizer is None:
        raise click.UsageError("--mode realign needs --tokenizer (it compares decoded text)")


def build_streamed(store: Path, mode: str, tokenizer: Path | None,
                   each: Any = None) -> tuple[duckdb.DuckDBPyConnection, dict[str, Any]]:
    """The store's samples, built a chunk of whole groups at a time (``lgt.store.stream.stream_samples``:
    memory holds one chunk, whatever the store's size); ``each`` gets every chunk's samples table.
    Returns the connection and the report of the whole build (the chunks' reports added up as they
    come: nothing else is kept from a chunk)."""
    from lgt.store.stream import merge_reports, stream_samples

    con = open_store(store)
    report: dict[str, Any] = {}
    with user_errors():
        tok = show_mod.load_tokenizer(tokenizer) if tokenizer else None
        chunks = stream_samples(store, mode=mode, tokenizer=tok)
        while (chunk := next(chunks, None)) is not None:
            if each is not None:
                each(chunk.samples)
            report = merge_reports([report, chunk.report])
            chunk = None  # noqa: PLW2901 - not alive while the next one is built: one chunk in memory
    return con, {"mode": mode, **merge_reports([report])}


@click.command("show")
@store_option
@click.argument("rollout_id")
@click.option("--attempt", type=click.IntRange(min=0), help="Which attempt (default: the latest).")
@tokenizer_option
@click.option("--full", is_flag=True, help="Do not shorten long messages and token spans.")
def show_cmd(store: Path, rollout_id: str, attempt: int | None, tokenizer: Path | None,
             full: bool) -> None:
    """One trajectory as readable turns: messages, replies, tokens trained, rewards."""
    con = open_store(store)
    with user_errors():
        tok = show_mod.load_tokenizer(tokenizer) if tokenizer else None
        traj = show_mod.load_trajectory(con, rollout_id, attempt)
    as_chat = (click.get_current_context().obj or {}).get("as_chat")
    for line in show_mod.render(traj, tok, truncate=None if full else show_mod.TRUNCATE, as_chat=as_chat):
        click.echo(line)


@click.command()
@store_option
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The HTML page to write (whole).")
@click.option("--title", help="The page's title (default: the store's path).")
@click.option("--mode", type=click.Choice(["exact", "realign"]), default="exact", show_default=True)
@tokenizer_option
def report(store: Path, out: Path, title: str | None, mode: str, tokenizer: Path | None) -> None:
    """Write an HTML page: reward per step, samples per rollout, merge breaks, staleness."""
    from lgt.store.report import write_report

    check_out(out, mode, tokenizer)
    con, build_report = build_streamed(store, mode, tokenizer)
    data = write_report(con, out, title=title or f"lgt store {store}", build_report=build_report)
    t = data["totals"]
    click.echo(f"wrote {out}: {t['calls']} calls, {t['rollouts']} rollout attempts, "
               f"{t['rewarded_rollouts']} rewarded")


COMMANDS = (sql, reward, rollout, show_cmd, report)
