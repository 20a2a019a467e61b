"""Everything a command needs, checked before anything is built, started or written (``lgt-train run``,
``eval``, ``apo``, ``sft``): the config (each section checked itself when loaded,
:mod:`lgt.trainer.config`), the tasks file, the agent command on PATH, the model directory (or that it can
be made), the chat template, the backend's environment, the engine's interpreter, the proxy; for
``eval`` and ``apo``, the section they read.

One sentence (ConfigError, or another ValueError) names what is wrong. Fast, well under two seconds:
reads the tasks file and a few small JSON files, looks commands up on PATH; imports no torch, verl or
vLLM. A command checks once, and hands what it checked (the tasks) to the work it starts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from lgt.trainer import config as cfgmod
from lgt.trainer.backends.base import BackendError, entry
from lgt.trainer.config import ConfigError, RunConfig

# the training tasks and the held-out ones, as validate returns them
Tasks = tuple[list[dict[str, Any]], list[dict[str, Any]]]


def validate(cfg: RunConfig, *, resume_dir: Path | None = None, run_dir: Path | None = None) -> Tasks:
    """Everything the run needs, checked before anything is built or started; returns the training
    tasks and the held-out ones (``eval``: a file, or a share split off the tasks; none without eval).

    ConfigError (or another ValueError: one sentence) names what is wrong. Fast: reads the tasks file and
    a few small JSON files, looks commands up on PATH; imports no torch, verl or vLLM.
    """
    from lgt.trainer.model_dir import check_model_dir
    from lgt.trainer.rollout import controller as rollouts
    from lgt.trainer.serving.launch import EngineError, engine_python
    from lgt.trainer.serving.proxy import ProxyError, find_proxy_command

    tasks, held = cfgmod.split_tasks(cfg)
    try:
        rollouts.check_agent(cfg.agent)
        if cfg.agent.image_field is not None:  # every task's own image unpacked before the first attempt
            from lgt.trainer.rollout.runners.image import check_task_images
            check_task_images(cfg.agent, [*tasks, *held])
    except rollouts.RolloutError as e:
        raise ConfigError(str(e)) from None
    m, t = cfg.model, cfg.teacher
    chat_template(cfg)
    if m.make is not None:
        _check_make(m.make, m.path, "model")
    else:
        check_model_dir(m.path, need_chat_template=m.chat_template is None).check_context(
            cfg.engine.max_model_len)
    check_lora(cfg)
    for own in cfgmod.own_engines(cfg).values():  # the policies on engines of their own
        if own.model.make is not None:
            _check_make(own.model.make, own.model.path, own.key)
        else:
            check_model_dir(own.model.path).check_context(own.engine.max_model_len)
    if t is not None and t.make is not None and t.path is not None:
        _check_make(t.make, t.path, "teacher")
    elif t is not None and t.path is not None:
        check_model_dir(t.path)
    check_run_dir(cfg, resume_dir=resume_dir, run_dir=run_dir)
    try:
        backend_python(cfg)
        engine_python(cfg.engine)
        if cfg.resources:
            from lgt.trainer.rollout.resources import Resources
            Resources(cfg.resources)  # every template readable
        if cfg.proxy.url is None and not cfg.proxy.command:
            find_proxy_command()
    except (BackendError, EngineError, ProxyError, ValueError) as e:
        raise ConfigError(str(e)) from None
    return tasks, held


def check_lora(cfg: RunConfig) -> None:
    """``backend.lora``'s target modules against the model's linear layers, read from its weights files'
    headers (no torch), when the model is there already (a model still to be made is checked when it
    loads)."""
    from lgt.trainer.backends.base import lora_targets
    from lgt.trainer.model_dir import ModelError, check_model_dir, linear_layer_names

    lora = getattr(cfg.backend, "lora", None)
    if lora is None or not (cfg.model.path / "config.json").is_file():
        return
    try:
        info = check_model_dir(cfg.model.path)
    except ModelError:
        return  # made again by model.make
    have = linear_layer_names(cfg.model.path, info.vocab_size)
    if have is not None:
        try:
            lora_targets(lora, have, info.architecture)
        except BackendError as e:
            raise ConfigError(str(e)) from None


def _check_make(make: Any, path: Path, key: str) -> None:
    """``model.make`` or ``teacher.make`` (:func:`lgt.trainer.make_model.check_make`) as a ConfigError."""
    from lgt.trainer.make_model import check_make
    from lgt.trainer.model_dir import ModelError

    try:
        check_make(make, path, key)
    except ModelError as e:
        raise ConfigError(str(e)) from None


def validate_eval(cfg: RunConfig, checkpoint: Path | None = None) -> Tasks:
    """``lgt-train eval``'s :func:`validate`: the config has an eval section (the tasks held out), and
    ``checkpoint`` (when given) is a finished, readable checkpoint."""
    if cfg.eval is None:
        raise ConfigError("the run config has no eval section to say which tasks are held out: add e.g. "
                          "eval: {split: 0.2} or eval: {tasks: heldout.jsonl}")
    if checkpoint is not None:
        from lgt.trainer.backends.checkpoints import read_state
        read_state(checkpoint)  # not a finished, readable checkpoint: one sentence, before anything starts
    return validate(cfg)


def validate_apo(cfg: RunConfig) -> Tasks:
    """``lgt-train apo``'s :func:`validate`: the config has an apo section (the resource it rewrites)."""
    if cfg.apo is None:
        raise ConfigError("the run config has no apo section: add e.g. apo: {resource: system_prompt}")
    return validate(cfg)


def check_run_dir(cfg: RunConfig, *, resume_dir: Path | None = None, run_dir: Path | None = None) -> None:
    """A resumed run's folder holds a run; a new run's does not hold one already."""
    if resume_dir is not None and not (resume_dir / "config.json").exists():
        raise ConfigError(f"{resume_dir} is not a run directory (it has no config.json)")
    target = run_dir or cfg.run_dir
    if resume_dir is None and target is not None and (target / "config.json").exists():
        raise ConfigError(f"{target} already holds a run (it has a config.json): continue it with --resume "
                          f"{target}, or give a new --run-dir")


def chat_template(cfg: RunConfig) -> str | None:
    """The text of ``model.chat_template``, checked (:func:`lgt.trainer.model_dir.check_chat_template`:
    tools, tool calls and results render, later prompts extend earlier ones) with the model's special
    tokens when the model exists already; None without one. ConfigError (one sentence) otherwise; the
    engine's own ``--chat-template`` is refused (vLLM would render with a template the trainer does not
    use)."""
    from lgt.trainer import model_dir

    flag = next((a for a in cfg.engine.extra_args if a.split("=")[0] == "--chat-template"), None)
    if flag is not None:
        raise ConfigError("engine.extra_args gives vLLM --chat-template, which the trainer would not render "
                          "with (SFT, realigned samples): give the template as model.chat_template instead")
    path = cfg.model.chat_template
    if path is None:
        return None
    try:
        text = model_dir.read_chat_template(path)
        special = model_dir.special_tokens(cfg.model.path) if cfg.model.path.is_dir() else {}
        model_dir.check_chat_template(text, name=f"model.chat_template {path}", special_tokens=special)
    except model_dir.ModelError as e:
        raise ConfigError(f"model.chat_template: {e}" if str(e).startswith("chat template") else str(e)) \
            from None
    return text


def teacher_matches(student_dir: Path, teacher_dir: Path) -> None:
    """The teacher's tokenizer is the student's, compared once both models are made (before any engine
    starts); ConfigError (one sentence) otherwise."""
    mismatch = cfgmod.teacher_tokenizer_problem(student_dir, teacher_dir)
    if mismatch:
        raise ConfigError(mismatch)


def backend_python(cfg: RunConfig) -> str:
    """The interpreter that can run ``cfg``'s backend: this one, or (verl) the one named by
    ``backend.python``, ``$LGT_VERL_PYTHON`` or this checkout's ``.venv-verl``. BackendError (one
    sentence) when there is none. verl 0.9.1 and vLLM's CPU build need different transformers, so on
    CPU machines they live in two environments: the trainer runs in verl's, the engine in vLLM's."""
    backend = entry(cfg.backend.name)
    if backend.available():
        return sys.executable
    repo = Path(__file__).resolve().parent.parent
    for candidate in (getattr(cfg.backend, "python", None), os.environ.get("LGT_VERL_PYTHON"),
                      str(repo / ".venv-verl" / "bin" / "python")):
        if candidate and Path(candidate).exists():
            return candidate
    raise BackendError(f"the {cfg.backend.name} backend needs the {backend.needs} package, which is not "
                       f"installed for {sys.executable}: run scripts/setup.sh (it builds .venv-verl) or set "
                       "backend.python to an interpreter that has it")
