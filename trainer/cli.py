"""``lgt-train``: the trainer's command line (inspection commands work without torch).

Each command checks its input, calls one function of ``lgt.store`` and prints the result; a user's
mistake ends in one sentence (``click.ClickException``), with nothing written.
"""

from __future__ import annotations

import csv
import datetime as dt
import os
import shutil
import subprocess
import sys
import tempfile
import threading
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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """lgt's trainer: train an unmodified agent (`run`), inspect the store, join rewards, build samples."""


# --- sql -----------------------------------------------------------------------------------------

@main.command()
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

@main.command(context_settings={"ignore_unknown_options": True})  # VALUE may be negative: -1
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


@main.command()
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


# --- samples, show, report -----------------------------------------------------------------------

@main.command()
@store_option
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Where to write the samples (Parquet, written whole).")
@click.option("--mode", type=click.Choice(["exact", "realign"]), default="exact", show_default=True,
              help="realign keeps merging through re-tokenisation drift (needs --tokenizer).")
@tokenizer_option
@click.option("--estimator", type=click.Choice(["grpo", "rloo", "reinforce"]), default="grpo",
              show_default=True, help="How advantages are estimated from the rollouts' rewards.")
@click.option("--no-std", is_flag=True, help="grpo: advantages r - mean(group), not divided by the std.")
def samples(store: Path, out: Path, mode: str, tokenizer: Path | None, estimator: str, no_std: bool) -> None:
    """Build the training samples the trainer would train on, and say how they came out."""
    import pyarrow.parquet as pq

    from lgt.store.samples import SAMPLES, trained_rollouts
    from lgt.store.writer import publish
    from lgt.trainer.rl import algorithm

    cfg = algorithm.AlgorithmConfig(estimator=estimator, std_normalize=not no_std, sample_mode=mode)
    check_out(out, mode, tokenizer)
    with user_errors():
        r = trained_rollouts(store)  # every chunk's loss weights count each rollout once among all R
    tmp = out.with_name(out.name + ".tmp")
    writer: pq.ParquetWriter | None = None
    written = 0

    def write(chunk: Any) -> None:  # one chunk of whole groups at a time: memory holds one chunk
        nonlocal writer, written
        table = algorithm.assign(chunk, cfg, rollouts=r)
        if writer is None:
            writer = pq.ParquetWriter(tmp, table.schema, compression="zstd")
        writer.write_table(table)
        written += table.num_rows

    try:
        _, report = build_streamed(store, mode, tokenizer, write)
        if writer is None:  # a store without rollouts: the file is written all the same, empty
            write(SAMPLES.empty_table())
        assert writer is not None
        writer.close()
        trained = report.get("rollouts", {}).get("trained", 0)  # the chunks' trained rollouts, summed
        if trained != r:
            raise click.ClickException(f"the store changed during the build ({r} rollouts to train when it "
                                       f"began, {trained} built); run it again")
        publish(tmp, out)
    finally:
        if writer is not None and writer.is_open:  # the build failed: nothing half-written is left
            writer.close()
        tmp.unlink(missing_ok=True)
    for line in show_mod.render_build(report):
        click.echo(line)
    click.echo(f"wrote {show_mod.plural(written, 'sample')} to {out}")


def check_out(out: Path, mode: str, tokenizer: Path | None) -> None:
    if not out.parent.is_dir():
        raise click.UsageError(f"--out {out}: directory {out.parent} does not exist")
    if mode == "realign" and tokenizer is None:
        raise click.UsageError("--mode realign needs --tokenizer (it compares decoded text)")


def build_streamed(store: Path, mode: str, tokenizer: Path | None,
                   each: Any = None) -> tuple[duckdb.DuckDBPyConnection, dict[str, Any]]:
    """The store's samples, built a chunk of whole groups at a time (``lgt.store.samples.stream_samples``:
    memory holds one chunk, whatever the store's size); ``each`` gets every chunk's samples table.
    Returns the connection and the report of the whole build (the chunks' reports added up as they
    come: nothing else is kept from a chunk)."""
    from lgt.store.samples import merge_reports, stream_samples

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


@main.command("show")
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
    for line in show_mod.render(traj, tok, truncate=None if full else show_mod.TRUNCATE):
        click.echo(line)


@main.command()
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



# --- run / make-model (need the trainer's environment: torch, transformers, vLLM) --------------------

@main.command("run")
@click.argument("config_file", type=click.Path(path_type=Path), required=False)
@click.option("--mode", type=click.Choice(["sync", "async"]), help="Override the config's mode.")
@click.option("--steps", type=click.IntRange(min=1), help="Override the number of training steps.")
@click.option("--max-minutes", type=click.FloatRange(min=0, min_open=True), help="Stop after this long.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where the run writes (default runs/<name>-<time>).")
@click.option("--resume", "resume_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Continue a run from its last checkpoint and its store, as it was configured (its "
                   "config.json), with this command's overrides on top.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override any config key (dotted, YAML value), e.g. --set backend.lr=1e-4.")
def run_cmd(config_file: Path | None, mode: str | None, steps: int | None, max_minutes: float | None,
            run_dir: Path | None, resume_dir: Path | None, sets: tuple[str, ...]) -> None:
    """Train the agent of CONFIG_FILE (a run YAML) with RL; see examples/arith/run.yaml. With --resume
    RUN_DIR, CONFIG_FILE may be left out: the run goes on as it was configured."""
    from lgt.trainer import config as cfgmod
    from lgt.trainer import recipe

    overrides = _overrides(sets)
    for key, value in (("mode", mode), ("steps", steps), ("max_minutes", max_minutes)):
        if value is not None:
            overrides[key] = value
    if resume_dir is not None and run_dir is not None and resume_dir.resolve() != run_dir.resolve():
        raise click.ClickException("give either --resume DIR or --run-dir DIR, not two different folders")
    if config_file is None and resume_dir is None:
        raise click.UsageError("give a run config (CONFIG_FILE), or --resume RUN_DIR to continue a run")
    try:
        if resume_dir is not None:
            cfg = cfgmod.saved(resume_dir, overrides)
            if config_file is not None:
                _note_config_differences(cfgmod, config_file, overrides, cfg, resume_dir)
        else:
            cfg = cfgmod.load(config_file, overrides)
        recipe.validate(cfg, resume_dir=resume_dir, run_dir=run_dir)  # everything, before anything starts
        python = recipe.backend_python(cfg)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if python != sys.executable:  # the backend lives in its own environment (verl on CPU machines)
        _reexec(python, cfg)
    try:
        with _display() as display:
            out = recipe.run(cfg, run_dir=resume_dir or run_dir, resume=resume_dir is not None,
                             display=display)
    except KeyboardInterrupt:
        raise click.ClickException("interrupted; continue with --resume") from None
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise click.ClickException(_run_error(e)) from None
    from lgt.trainer.report import summary

    click.echo(summary.render(summary.write(out)))


@main.command("eval")
@click.argument("config_file", type=click.Path(path_type=Path))
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A run's checkpoints/step-N folder (default: the config's model, untrained).")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where the evaluation writes (default runs/<name>-eval-<time>).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override any config key (dotted, YAML value), e.g. --set eval.samples=8.")
def eval_cmd(config_file: Path, checkpoint: Path | None, run_dir: Path | None, sets: tuple[str, ...]) -> None:
    """Evaluate a checkpoint (or the base model) on CONFIG_FILE's held-out tasks (its eval section),
    through the same agent, proxy and engine as training: greedy and sampled reward."""
    from lgt.trainer import config as cfgmod
    from lgt.trainer import recipe

    try:
        cfg = cfgmod.load(config_file, _overrides(sets))
        with _display() as display:
            out, res = recipe.evaluate(cfg, checkpoint=checkpoint, run_dir=run_dir, display=display)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise click.ClickException(_run_error(e)) from None
    click.echo(f"{cfg.name}: {res.line()}")
    click.echo(f"  {len(res.greedy) + len(res.sampled)} rewards in {out / 'eval.jsonl'}; the rollouts in "
               f"{out / 'store'} (split 'eval')")


@main.command("apo")
@click.argument("config_file", type=click.Path(path_type=Path))
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where the search writes (default runs/<name>-apo-<time>).")
@click.option("--resume", "resume_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Continue a search in this run directory (finished candidates are not scored again).")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="An RL run's checkpoints/step-N folder to serve (default: the config's model).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override any config key, e.g. --set apo.rounds=5.")
def apo_cmd(config_file: Path, run_dir: Path | None, resume_dir: Path | None, checkpoint: Path | None,
            sets: tuple[str, ...]) -> None:
    """Optimise CONFIG_FILE's prompt resource (its apo section) with real rollouts: a critic reads the
    worst and best traces, rewrites the prompt, and the best rewrites by validation reward go on."""
    from lgt.trainer import config as cfgmod
    from lgt.trainer import recipe
    from lgt.trainer.apo import optimize as apo

    try:
        cfg = cfgmod.load(config_file, _overrides(sets))
        with _display() as display:
            out, best = recipe.optimize_prompt(cfg, run_dir=resume_dir or run_dir, checkpoint=checkpoint,
                                               resume=resume_dir is not None, display=display)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise click.ClickException(_run_error(e)) from None
    rows = apo.table(out)
    click.echo(f"{'version':12s}  round  parent        train   valid.")
    for c in rows:
        tr = "-" if c["train_reward"] is None else f"{c['train_reward']:.3f}"
        va = "-" if c["val_reward"] is None else f"{c['val_reward']:.3f}"
        click.echo(f"{c['version']:12s}  {c['round']:5d}  {c['parent'] or '-':12s}  {tr:>6s}  {va:>6s}")
    click.echo(f"best: {best['version']} (validation reward {best['val_reward']:.3f}), written to "
               f"{out / 'apo' / 'best_prompt.txt'}; {best['critic_calls']} critic calls "
               f"({best['critic_failures']} unusable); all candidates in {out / 'apo' / 'candidates.jsonl'}")


@contextmanager
def _display() -> Iterator[Any]:
    """The run's progress display (a live line on a terminal), stopped however the run ends."""
    from lgt.trainer import recipe

    display = recipe.default_display()
    try:
        yield display
    finally:
        live = getattr(display, "live", None)
        if live is not None:
            live.stop()


def _run_error(e: Exception) -> str:
    """A run's error for the user: its first line, unless it is a short multi-line explanation."""
    text = str(e)
    return text.splitlines()[0] if "\n" not in text[:300] else text


def _overrides(sets: tuple[str, ...]) -> dict[str, Any]:
    """``--set KEY=VALUE`` items as dotted overrides (values read as YAML)."""
    import yaml

    overrides: dict[str, Any] = {}
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise click.ClickException(f"--set {item!r} must look like key=value")
        overrides[key] = yaml.safe_load(value)
    return overrides


def _note_config_differences(cfgmod: Any, config_file: Path, overrides: dict[str, Any], cfg: Any,
                             resume_dir: Path) -> None:
    """A resumed run goes on as it was configured: say which keys of CONFIG_FILE that leaves unused."""
    if os.environ.get("LGT_REEXEC"):  # said once, before the backend's interpreter took over
        return
    try:
        other = cfgmod.load(config_file, overrides)
    except ValueError as e:
        click.echo(f"note: {config_file} is not used to resume {resume_dir} ({e})", err=True)
        return
    keys = cfgmod.differences(cfg, other)
    if keys:
        shown = ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")
        click.echo(f"note: resuming {resume_dir} as it was configured ({resume_dir / cfgmod.RUN_FILE}); "
                   f"{config_file} differs in {shown}, which stay as they were (--set KEY=VALUE changes "
                   "what a resume may change)", err=True)


def _reexec(python: str, cfg: Any) -> None:
    """Run this same command in ``python`` (the backend's environment); the engine keeps this
    environment's vLLM (``$LGT_ENGINE_PYTHON``)."""
    from lgt.trainer.serving.engine import engine_python

    os.environ.setdefault("LGT_ENGINE_PYTHON", engine_python(cfg.engine))
    os.environ["LGT_REEXEC"] = "1"
    click.echo(f"the {cfg.backend.name} backend runs in {python}", err=True)
    os.execv(python, [python, "-m", "lgt.trainer.cli", *sys.argv[1:]])


@main.command("make-model")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--preset", type=click.Choice(["tiny", "demo", "10m", "0.5b"]), default="demo",
              show_default=True)
@click.option("--warm-start", type=click.Choice(["none", "arith", "carry", "calc", "both"]), default="arith",
              show_default=True, help="A short SFT on synthetic task data, so RL has something to amplify.")
@click.option("--seconds", type=click.FloatRange(min=0), default=90.0, show_default=True,
              help="CPU seconds of warm start.")
@click.option("--steps", type=click.IntRange(min=1),
              help="Warm-start steps instead of seconds: the same model on any machine.")
@click.option("--seed", type=int, default=0, show_default=True)
def make_model_cmd(out: Path, preset: str, warm_start: str, seconds: float, steps: int | None,
                   seed: int) -> None:
    """Build a small model + tokenizer locally (HF format; nothing downloaded)."""
    from lgt.trainer.demo import tiny

    path = tiny.make_model(out, preset=preset, warm_start_task=None if warm_start == "none" else warm_start,
                           seconds=seconds, steps=steps, seed=seed)
    click.echo(str(path))


@main.command("engine", context_settings={"ignore_unknown_options": True})
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--max-model-len", type=click.IntRange(min=1), help="Its context (default: the model's).")
@click.option("--served-model-name", default="policy", show_default=True)
def engine_cmd(model_dir: Path, vllm_args: tuple[str, ...], port: int, max_model_len: int | None,
               served_model_name: str) -> None:
    """Serve MODEL_DIR with vLLM as lgt-train runs would (weight sync without restarts) until Ctrl-C;
    runs given `engine: {url: http://127.0.0.1:PORT/v1}` use it instead of starting their own and load
    their weights into it: several runs in a row pay one engine start. Arguments after `--` go to vLLM
    (e.g. -- --enable-auto-tool-choice --tool-call-parser hermes)."""
    import signal as sig

    from lgt.trainer.models import ModelError
    from lgt.trainer.serving.engine import Engine, EngineConfig, EngineError

    try:
        engine = Engine.start(EngineConfig(model=model_dir.resolve(), port=port, max_model_len=max_model_len,
                                           served_model_name=served_model_name, extra_args=vllm_args))
    except (EngineError, ModelError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"serving {model_dir} as {served_model_name!r} at {engine.url} (log {engine.log_path}); "
               "Ctrl-C stops it")
    stop = threading.Event()
    for s in (sig.SIGINT, sig.SIGTERM):
        sig.signal(s, lambda *_: stop.set())
    try:
        while not stop.wait(2.0):
            engine.check_alive()
    except EngineError as e:
        raise click.ClickException(str(e).splitlines()[0]) from None
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
