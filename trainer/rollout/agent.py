"""The agent as a run config describes it (:class:`AgentSpec`), and the pure helpers every runner shares: the
task's variables, ``${VAR}`` expansion, where the agent's command is, and rewards read from text.

An attempt's environment is built in layers:

* the machine's environment minus its proxy, CA and lgt-secret variables (:data:`STRIPPED_VARS`);
* the rollout's proxy variables from :func:`lgt.proxy.auth.rollout_env` for identity
  ``<rollout_id>~<attempt>`` (``base_url`` mode sets no ``HTTP(S)_PROXY``: the agent is given
  ``LGT_PROXY_BASE_URL`` and a reverse-mode ``LGT_REWARD_URL``);
* one variable per task field, ``TASK_<FIELD>`` (upper case, anything not a letter or digit → ``_``;
  strings as they are, other values as JSON), ``TASK_JSON`` (path of a file holding the whole task),
  ``TASK_ID`` and ``REWARD_FILE`` (a path the agent may write ``0.5`` or ``{"reward": 0.5}`` to);
* ``AgentSpec.env``, whose values may name any of the above as ``${VAR}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from lgt.proxy import auth
from lgt.store.ingest import reward_value
from lgt.trainer.rollout.forkserver import python_script_command
from lgt.trainer.rollout.sandbox import SandboxSpec
from lgt.trainer.serving.proxy import PROXY_VARS

PROXY_MODES = ("https_proxy", "base_url")
# agent.runner → where its runner is: "module:name", a runner class (rollout/runners/base.py) or a
# function that picks one for the agent spec; imported only when a controller is made
# (lgt.trainer.rollout.runners.runner_class). A new runner is a file in rollout/runners/ and a line here.
RUNNERS: Mapping[str, str] = MappingProxyType({
    # in a sandbox unless agent.sandbox: none; in a container image with agent.image or agent.image_field
    "local": "lgt.trainer.rollout.runners.image:local_runner",
    "kubernetes": "lgt.trainer.rollout.runners.kubernetes:KubernetesRunner",
})
# Taken out of the machine's environment before a rollout's are added: proxy and CA settings the
# machine sets globally (they would send the agent elsewhere or distrust the proxy's CA), and the
# proxy's secrets (an agent holding them could mint other rollouts' credentials).
STRIPPED_VARS = frozenset((
    *PROXY_VARS, "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy", *auth.CA_VARS, "SSL_CERT_DIR",
    auth.SECRET_ENV, auth.CONTROL_TOKEN_ENV,
))
ROLLOUT_VARS = frozenset((
    *PROXY_VARS, "NO_PROXY", "no_proxy", *auth.CA_VARS, "LGT_ROLLOUT_ID", "LGT_ATTEMPT",
    "LGT_PROXY_BASE_URL", "LGT_REWARD_URL",
))
RESERVED_VARS = ("TASK_JSON", "TASK_ID", "REWARD_FILE")
REWARD_SOURCES = ("proxy", "file", "stdout", "evaluator")  # in order of preference
SOURCE_NAMES = {"proxy": "the proxy's reward endpoint", "file": "the reward file",
                "stdout": "the last stdout line", "evaluator": "the evaluator"}
_VAR_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TAIL_BYTES = 65536  # how much of the end of stdout is read for its last line


class RolloutError(ValueError):
    """Bad input to the rollout controller (agent spec, task, rollout id); one sentence naming it."""


@dataclass(frozen=True)
class AgentSpec:
    """How to run the agent: argv, working directory, extra environment, proxy mode, limits.

    ``timeout_s`` is per attempt (seconds of wall time); ``retries`` counts extra attempts after a
    failed or timed-out one; ``evaluator`` is an argv given ``TASK_JSON STDOUT_PATH`` as two more
    arguments (bounded by ``timeout_s`` too); ``reward_sources`` are the places a reward is looked for,
    always in the order of :data:`REWARD_SOURCES` (leave ``stdout`` out for an agent whose last line
    may be a bare number that is not its reward).
    """

    command: tuple[str, ...] = ()
    cwd: Path | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    proxy_mode: str = "https_proxy"
    timeout_s: float = 120.0
    retries: int = 1
    evaluator: tuple[str, ...] | None = None
    task_env_prefix: str = "TASK_"
    reward_sources: tuple[str, ...] = REWARD_SOURCES
    # Python agents only (``python agent.py ...``): modules a fork server imports once, so each rollout
    # starts warm; ``auto`` learns them from the first rollouts' imports
    python_preload: tuple[str, ...] | None = None
    # ``kubernetes``: each attempt is a Job from ``job_template`` (:mod:`lgt.trainer.rollout.kube`), its pod
    # reaching the proxy at ``proxy_host``
    runner: str = "local"
    job_template: Path | None = None
    namespace: str = "default"
    kubeconfig: Path | None = None
    proxy_host: str | None = None
    jobs_per_s: float = 50.0
    job_ttl_s: int = 3600
    # local runner: each attempt in namespaces of its own (lgt.trainer.rollout.sandbox); none: no isolation
    sandbox: SandboxSpec = SandboxSpec()
    # task fields the agent never sees (answers, hidden tests): not in its variables nor its $TASK_JSON;
    # the evaluator gets them
    private: tuple[str, ...] = ()
    # local runner in a container image (lgt.trainer.rollout.runners.image): ``image`` a path (an OCI
    # layout, an OCI or docker archive; relative to ``cwd``), ``image_field`` the task field that names a
    # task's own image (else ``image``); ``mounts``: host path → path in the image, read-only
    image: str | None = None
    image_field: str | None = None
    mounts: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.runner not in RUNNERS:
            raise RolloutError(f"agent runner must be one of {', '.join(RUNNERS)}, not {self.runner!r}")
        command = (self.command,) if isinstance(self.command, str) else tuple(self.command or ())
        if self.runner == "kubernetes":
            _check_kubernetes(self, command)
        elif not command or not all(isinstance(a, str) for a in command) or not command[0]:
            raise RolloutError(f"the agent command must be a non-empty list of strings, not {self.command!r}")
        self._set("command", command)
        if isinstance(self.sandbox, str):
            self._set("sandbox", SandboxSpec(kind=self.sandbox))
        private = (self.private,) if isinstance(self.private, str) else tuple(self.private)
        if not all(isinstance(x, str) and x for x in private):
            raise RolloutError(f"agent private must list task field names, not {list(private)!r}")
        self._set("private", private)
        if self.evaluator is not None:
            evaluator = (self.evaluator,) if isinstance(self.evaluator, str) else tuple(self.evaluator)
            if not evaluator or not all(isinstance(a, str) for a in evaluator) or not evaluator[0]:
                raise RolloutError(f"the evaluator command must be a non-empty list of strings, not "
                                   f"{self.evaluator!r}")
            self._set("evaluator", evaluator)
        if self.cwd is not None:
            self._set("cwd", Path(self.cwd))
        self._set("env", MappingProxyType(_checked_env(self.env)))
        _check_image(self)
        _check_limits(self)
        self._set("reward_sources", _reward_sources(self.reward_sources))
        if not isinstance(self.task_env_prefix, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*|",
                                                                         self.task_env_prefix):
            raise RolloutError(f"task_env_prefix {self.task_env_prefix!r} cannot start an environment "
                               "variable name")
        if self.python_preload is not None:
            self._set("python_preload", _preload(self.python_preload, command))

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)


def _check_kubernetes(agent: AgentSpec, command: tuple[str, ...]) -> None:
    if command:
        raise RolloutError("agent command is not used with runner: kubernetes (the job template's "
                           "first container runs the agent); leave it out")
    if agent.job_template is None or not agent.proxy_host:
        raise RolloutError("runner: kubernetes needs agent job_template (a Job manifest) and "
                           "proxy_host (the address its pods reach lgt-proxy at)")
    if agent.python_preload is not None:
        raise RolloutError("agent python_preload is for local processes, not runner: kubernetes")
    if not agent.jobs_per_s > 0 or agent.job_ttl_s < 0:
        raise RolloutError("agent jobs_per_s must be positive and job_ttl_s ≥ 0")


def _check_image(agent: AgentSpec) -> None:
    if agent.image is None and agent.image_field is None:
        if agent.mounts:
            raise RolloutError("agent mounts are for an agent in a container image (agent.image or "
                               "agent.image_field); a sandboxed agent's are agent.sandbox.mounts")
        return
    for name in ("image", "image_field"):
        value = getattr(agent, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise RolloutError(f"agent {name} must be a non-empty string, not {value!r}")
    if agent.runner != "local" or not agent.sandbox.on:
        raise RolloutError("agent.image runs each attempt in the local runner's sandbox: it needs "
                           "agent.runner: local and agent.sandbox: bwrap")
    if agent.python_preload is not None:
        raise RolloutError("agent python_preload starts the host's interpreter warm; it cannot be used "
                           "with agent.image (the agent runs the image's own programs)")
    if agent.sandbox.mounts:
        raise RolloutError("agent.sandbox.mounts show host paths to a bare sandboxed agent; in an image, "
                           "name them in agent.mounts (host path: path in the image)")
    mounts = dict(agent.mounts or {})
    for src, dest in mounts.items():
        if not isinstance(src, str) or not src or not isinstance(dest, str) or not dest.startswith("/") \
                or dest.rstrip("/") == "":
            raise RolloutError(f"agent mounts must map host paths to absolute paths in the image, not "
                               f"{src!r}: {dest!r}")
    object.__setattr__(agent, "mounts", MappingProxyType(mounts))


def _checked_env(env: Mapping[str, str]) -> dict[str, str]:
    for k, v in dict(env).items():
        if not isinstance(k, str) or not _ENV_NAME.match(k):
            raise RolloutError(f"agent env key {k!r} is not a valid environment variable name")
        if not isinstance(v, str):
            raise RolloutError(f"agent env {k} must be a string, not {v!r}")
    return dict(env)


def _check_limits(agent: AgentSpec) -> None:
    if agent.proxy_mode not in PROXY_MODES:
        raise RolloutError(f"agent proxy_mode must be one of {', '.join(PROXY_MODES)}, "
                           f"not {agent.proxy_mode!r}")
    if isinstance(agent.timeout_s, bool) or not isinstance(agent.timeout_s, (int, float)) \
            or not agent.timeout_s > 0:
        raise RolloutError(f"agent timeout_s must be a positive number of seconds, "
                           f"not {agent.timeout_s!r}")
    if isinstance(agent.retries, bool) or not isinstance(agent.retries, int) or agent.retries < 0:
        raise RolloutError(f"agent retries must be a whole number ≥ 0, not {agent.retries!r}")


def _reward_sources(given: Sequence[str]) -> tuple[str, ...]:
    sources = tuple(given)
    unknown = [x for x in sources if x not in REWARD_SOURCES]
    if unknown or not sources:
        raise RolloutError(f"agent reward_sources must be some of {', '.join(REWARD_SOURCES)}, "
                           f"not {list(given)!r}")
    return tuple(x for x in REWARD_SOURCES if x in sources)


def _preload(preload: str | Sequence[str], command: tuple[str, ...]) -> tuple[str, ...]:
    modules = (preload,) if isinstance(preload, str) else tuple(preload)
    if not all(isinstance(m, str) and re.fullmatch(r"[A-Za-z_][\w.]*", m) for m in modules):
        raise RolloutError(f"agent python_preload must list module names, not {list(modules)!r}")
    if python_script_command(command) is None:
        raise RolloutError(f"agent python_preload needs an agent command that runs a Python script "
                           f"(python agent.py ...), not {' '.join(command)!r}")
    return modules


def check_env_refs(agent: AgentSpec, environ: Mapping[str, str]) -> None:
    """Refuse an ``env`` value naming a variable no rollout has (``environ``: what the machine gives it)."""
    known = set(environ) | ROLLOUT_VARS | set(RESERVED_VARS)
    for key, value in agent.env.items():
        for name in _VAR_REF.findall(value):
            if name not in known and not (agent.task_env_prefix and name.startswith(agent.task_env_prefix)):
                raise RolloutError(f"agent env {key} refers to ${{{name}}}, which is neither a rollout "
                                   "variable, a task variable nor set in this environment")


def resolve_executable(name: str, cwd: Path | None, path_env: str | None, what: str) -> str:
    """The file ``name`` would run as: relative to ``cwd`` when it holds a ``/``, else found on PATH.
    RolloutError (one sentence) when it does not exist or cannot be executed."""
    if "/" in name:
        path = Path(name) if Path(name).is_absolute() or cwd is None else cwd / name
        if not path.exists():
            raise RolloutError(f"the {what} {name!r} does not exist" + (f" (looked in {cwd})" if cwd else ""))
        if path.is_dir() or not os.access(path, os.X_OK):
            raise RolloutError(f"the {what} {str(path)!r} is not an executable file (chmod +x it, or put "
                               "its interpreter first in the command)")
        return str(path)
    found = shutil.which(name, path=path_env)
    if found is None:
        raise RolloutError(f"the {what} {name!r} was not found on PATH")
    return found




def real_python(python: str, cwd: Path | None = None) -> str:
    """The interpreter ``python`` runs: itself, or, when it is a script standing in for one (pyenv's
    and asdf's shims, which find the interpreter under the user's home and so cannot run inside a
    sandbox), the interpreter it picks here (``sys.executable``, asked in ``cwd``: a
    ``.python-version`` there counts). Unchanged when it cannot be asked."""
    import subprocess

    try:
        with open(python, "rb") as f:
            if f.read(4) == b"\x7fELF":
                return python
        out = subprocess.run([python, "-c", "import sys; print(sys.executable)"], capture_output=True,
                             text=True, timeout=30, cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return python
    found = out.stdout.strip()
    return found if out.returncode == 0 and found and os.access(found, os.X_OK) else python


def env_name(key: str, prefix: str = "TASK_") -> str:
    """``TASK_<KEY upper, non-alphanumerics → _>``: ``"max-steps"`` → ``TASK_MAX_STEPS``."""
    return prefix + re.sub(r"[^A-Za-z0-9]", "_", str(key)).upper()


def env_value(value: Any) -> str:
    """Strings as they are, anything else as JSON (``3`` → ``"3"``, ``None`` → ``"null"``)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def task_env(task: Mapping[str, Any], prefix: str = "TASK_", private: Sequence[str] = ()) -> dict[str, str]:
    """One variable per task field (but the ``private`` ones); RolloutError when two fields map to one
    name, a field would replace ``TASK_JSON`` / ``REWARD_FILE``, or a value cannot be put in an
    environment."""
    out: dict[str, str] = {}
    origin: dict[str, str] = {}
    for key, value in task.items():
        if key in private:
            continue
        name = env_name(key, prefix)
        if name in ("TASK_JSON", "REWARD_FILE"):
            raise RolloutError(f"task field {key!r} would be ${name}, which the controller sets; rename it")
        if name in origin:
            raise RolloutError(f"task fields {origin[name]!r} and {key!r} both become ${name}; rename one")
        text = env_value(value)
        if "\0" in text:
            raise RolloutError(f"task field {key!r} holds a NUL character, which no environment can carry")
        out[name], origin[name] = text, str(key)
    return out


def task_id_of(task: Mapping[str, Any]) -> str:
    """The task's ``task_id`` (or ``id``) field as text, else a stable digest of its JSON (``t-<12 hex>``)."""
    for key in ("task_id", "id"):
        if task.get(key) not in (None, ""):
            return env_value(task[key])
    blob = json.dumps(task, sort_keys=True, ensure_ascii=False, default=str).encode()
    return "t-" + hashlib.sha256(blob).hexdigest()[:12]


def expand(value: str, variables: Mapping[str, str], key: str) -> str:
    """``${VAR}`` → ``variables[VAR]``; RolloutError naming ``key`` and the variable when unset."""
    def sub(m: re.Match[str]) -> str:
        if m[1] not in variables:
            raise RolloutError(f"agent env {key} refers to ${{{m[1]}}}, which this rollout does not set")
        return variables[m[1]]

    return _VAR_REF.sub(sub, value)


def parse_reward(text: str) -> float:
    """A reward from text: a number or ``{"reward": x}`` (JSON). ValueError (one sentence) otherwise."""
    text = text.strip()
    try:
        obj = json.loads(text)
    except ValueError:
        raise ValueError(f"{_short(text)!r} is not a number or {{\"reward\": x}}") from None
    if isinstance(obj, dict):
        if "reward" not in obj:
            raise ValueError(f"{_short(text)!r} has no \"reward\" key")
        obj = obj["reward"]
    if isinstance(obj, bool) or not isinstance(obj, (int, float)):
        raise ValueError(f"{_short(text)!r} is not a number or {{\"reward\": x}}")
    return reward_value(obj)


def last_line(path: Path) -> str | None:
    """The last non-blank line of a text file (its final 64 KiB are read), or None."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _TAIL_BYTES))
            data = f.read()
    except FileNotFoundError:
        return None
    for line in reversed(data.decode(errors="replace").splitlines()):
        if line.strip():
            return line.strip()
    return None


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _short(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[:n] + "…"




def stderr_hint(path: Path) -> str:
    """`` (last stderr line: …)`` from a file of the attempt's, or nothing when it is empty."""
    line = last_line(path)
    return f" (last stderr line: {_short(line, 160)})" if line else ""
