"""The rollout controller: run an unmodified agent program once per rollout, through lgt-proxy.

Each attempt of a rollout is one process (``AgentSpec.command``) in its own process group, with:

* the machine's environment minus its proxy, CA and lgt-secret variables (:data:`STRIPPED_VARS`);
* the rollout's proxy variables from :func:`lgt.proxy.auth.rollout_env` for identity
  ``<rollout_id>~<attempt>`` (``base_url`` mode sets no ``HTTP(S)_PROXY``: the agent is given
  ``LGT_PROXY_BASE_URL`` and a reverse-mode ``LGT_REWARD_URL``);
* one variable per task field, ``TASK_<FIELD>`` (upper case, anything not a letter or digit → ``_``;
  strings as they are, other values as JSON), ``TASK_JSON`` (path of a file holding the whole task),
  ``TASK_ID`` and ``REWARD_FILE`` (a path the agent may write ``0.5`` or ``{"reward": 0.5}`` to);
* ``AgentSpec.env``, whose values may name any of the above as ``${VAR}``.

stdout and stderr go to ``<run_dir>/rollouts/<rollout_id>~<attempt>.out`` / ``.err``. Past
``timeout_s`` the whole group gets SIGTERM, then SIGKILL after ``kill_grace_s``: status ``timeout``.
A non-zero exit is ``failed``. After a zero exit the reward is taken from the first of:

1. the proxy's reward endpoint (the agent POSTed to ``$LGT_REWARD_URL``): the proxy's
   ``GET /rewards`` answers its latest whole-rollout reward for this attempt from memory;
2. the reward file;
3. the last line of stdout, when it is a number or ``{"reward": x}``;
4. the evaluator command, run as ``evaluator... TASK_JSON STDOUT_PATH`` with the task variables: its
   last stdout line.

``AgentSpec.reward_sources`` can leave some of these out. An attempt that exits 0 with no reward is
``failed`` (never trained as reward 0). Each attempt is recorded as a ``rollouts`` row and its
reward as a ``rewards`` row (unless it came from the proxy, which recorded it already): at once, or
with ``batch_records`` when the owner calls :meth:`RolloutController.flush_records` (one file per
table per batch — the training loop does so at each update). Failed and timed-out attempts are retried up to
``AgentSpec.retries`` times, each under its own identity, so the store keeps attempts apart.

With ``AgentSpec.python_preload`` (a Python agent: ``python agent.py ...``) each attempt is forked from a warm
interpreter that imported those modules once (:mod:`lgt.trainer.rollout.forkserver`); it is still its own
process group with the same environment, files, timeout and exit status.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from lgt.proxy import auth
from lgt.proxy.client import ControlClient, resolve_token
from lgt.store.files import write_atomic
from lgt.store.ingest import add_rows, attempt_reward_row, reward_value, rollout_row
from lgt.store.schema import ROLLOUT_SPLITS
from lgt.store.writer import os_reason
from lgt.trainer.rollout import sandbox as sandboxing
from lgt.trainer.rollout.forkserver import ForkedProcess, ForkServer, ForkServerError, python_script_command
from lgt.trainer.rollout.sandbox import SandboxError, SandboxSpec
from lgt.trainer.serving.children import signal_group

if TYPE_CHECKING:
    from lgt.trainer.rollout.kube import KubeRunner
    from lgt.trainer.rollout.resources import Resources

PROXY_MODES = ("https_proxy", "base_url")
RUNNERS = ("local", "kubernetes")
PROXY_VARS = ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy")
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
_SOURCE_NAMES = {"proxy": "the proxy's reward endpoint", "file": "the reward file",
                 "stdout": "the last stdout line", "evaluator": "the evaluator"}
_VAR_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TAIL_BYTES = 65536  # how much of the end of stdout is read for its last line


class RolloutError(ValueError):
    """Bad input to the rollout controller (agent spec, task, rollout id); one sentence naming it."""


class StoreWriteError(RuntimeError):
    """The store cannot be written (a full or read-only disk); one sentence."""


class ProxyControlError(RuntimeError):
    """The proxy is not ready for rollouts (its CA is not in the store yet). The control API's own
    failures are :class:`lgt.proxy.client.ControlError`."""


# -- specs ----------------------------------------------------------------------------------------
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

    def __post_init__(self) -> None:
        if self.runner not in RUNNERS:
            raise RolloutError(f"agent runner must be one of {', '.join(RUNNERS)}, not {self.runner!r}")
        command = (self.command,) if isinstance(self.command, str) else tuple(self.command or ())
        if self.runner == "kubernetes":
            if command:
                raise RolloutError("agent command is not used with runner: kubernetes (the job template's "
                                   "first container runs the agent); leave it out")
            if self.job_template is None or not self.proxy_host:
                raise RolloutError("runner: kubernetes needs agent job_template (a Job manifest) and "
                                   "proxy_host (the address its pods reach lgt-proxy at)")
            if self.python_preload is not None:
                raise RolloutError("agent python_preload is for local processes, not runner: kubernetes")
            if not self.jobs_per_s > 0 or self.job_ttl_s < 0:
                raise RolloutError("agent jobs_per_s must be positive and job_ttl_s ≥ 0")
        elif not command or not all(isinstance(a, str) for a in command) or not command[0]:
            raise RolloutError(f"the agent command must be a non-empty list of strings, not {self.command!r}")
        object.__setattr__(self, "command", command)
        if isinstance(self.sandbox, str):
            object.__setattr__(self, "sandbox", SandboxSpec(kind=self.sandbox))
        private = (self.private,) if isinstance(self.private, str) else tuple(self.private)
        if not all(isinstance(x, str) and x for x in private):
            raise RolloutError(f"agent private must list task field names, not {list(private)!r}")
        object.__setattr__(self, "private", private)
        if self.evaluator is not None:
            evaluator = (self.evaluator,) if isinstance(self.evaluator, str) else tuple(self.evaluator)
            if not evaluator or not all(isinstance(a, str) for a in evaluator) or not evaluator[0]:
                raise RolloutError(f"the evaluator command must be a non-empty list of strings, not "
                                   f"{self.evaluator!r}")
            object.__setattr__(self, "evaluator", evaluator)
        if self.cwd is not None:
            object.__setattr__(self, "cwd", Path(self.cwd))
        for k, v in dict(self.env).items():
            if not isinstance(k, str) or not _ENV_NAME.match(k):
                raise RolloutError(f"agent env key {k!r} is not a valid environment variable name")
            if not isinstance(v, str):
                raise RolloutError(f"agent env {k} must be a string, not {v!r}")
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))
        if self.proxy_mode not in PROXY_MODES:
            raise RolloutError(f"agent proxy_mode must be one of {', '.join(PROXY_MODES)}, "
                               f"not {self.proxy_mode!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) \
                or not self.timeout_s > 0:
            raise RolloutError(f"agent timeout_s must be a positive number of seconds, "
                               f"not {self.timeout_s!r}")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise RolloutError(f"agent retries must be a whole number ≥ 0, not {self.retries!r}")
        sources = tuple(self.reward_sources)
        unknown = [x for x in sources if x not in REWARD_SOURCES]
        if unknown or not sources:
            raise RolloutError(f"agent reward_sources must be some of {', '.join(REWARD_SOURCES)}, "
                               f"not {list(self.reward_sources)!r}")
        object.__setattr__(self, "reward_sources", tuple(x for x in REWARD_SOURCES if x in sources))
        if not isinstance(self.task_env_prefix, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*|",
                                                                         self.task_env_prefix):
            raise RolloutError(f"task_env_prefix {self.task_env_prefix!r} cannot start an environment "
                               "variable name")
        if self.python_preload is not None:
            preload = self.python_preload
            modules = (preload,) if isinstance(preload, str) else tuple(preload)
            if not all(isinstance(m, str) and re.fullmatch(r"[A-Za-z_][\w.]*", m) for m in modules):
                raise RolloutError(f"agent python_preload must list module names, not {list(modules)!r}")
            if python_script_command(command) is None:
                raise RolloutError(f"agent python_preload needs an agent command that runs a Python script "
                                   f"(python agent.py ...), not {' '.join(command)!r}")
            object.__setattr__(self, "python_preload", modules)


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


def check_agent(agent: AgentSpec, environ: Mapping[str, str] | None = None) -> None:
    """Refuse an agent spec that cannot start: missing cwd, command or evaluator not found or not
    executable, an ``env`` value naming a variable no rollout has. Starts nothing."""
    environ = os.environ if environ is None else environ
    if agent.runner == "kubernetes":
        from lgt.trainer.rollout.kube import load_template

        try:
            load_template(agent.job_template)
        except RuntimeError as e:
            raise RolloutError(str(e)) from None
        environ = {}  # a pod has only the rollout's variables
    elif agent.cwd is not None and not agent.cwd.is_dir():
        raise RolloutError(f"the agent's working directory {str(agent.cwd)!r} does not exist")
    if agent.runner == "local" and agent.sandbox.on:
        for path in agent.sandbox.mounts:
            if not path.exists():
                raise RolloutError(f"agent sandbox mount {str(path)!r} does not exist")
        try:
            sandboxing.check(agent.sandbox)
        except SandboxError as e:
            raise RolloutError(str(e)) from None
    if agent.runner == "local":
        resolve_executable(agent.command[0], agent.cwd, environ.get("PATH"), "agent command")
    if agent.evaluator is not None and agent.runner == "local":  # a pod runs its own
        resolve_executable(agent.evaluator[0], agent.cwd, environ.get("PATH"), "evaluator command")
    known = set(environ) | ROLLOUT_VARS | set(RESERVED_VARS)
    for key, value in agent.env.items():
        for name in _VAR_REF.findall(value):
            if name not in known and not (agent.task_env_prefix and name.startswith(agent.task_env_prefix)):
                raise RolloutError(f"agent env {key} refers to ${{{name}}}, which is neither a rollout "
                                   "variable, a task variable nor set in this environment")


@dataclass(frozen=True)
class ProxyEndpoint:
    """A running lgt-proxy: the port agents use and its control API.

    The secret comes from ``$LGT_PROXY_SECRET``, ``secret_file`` or ``<store>/_proxy/secret``
    (:func:`lgt.proxy.auth.load_secret`); the control token from ``control_token``,
    ``$LGT_CONTROL_TOKEN`` or the secret (:func:`lgt.proxy.client.resolve_token`).
    """

    store: Path
    port: int
    control_port: int
    host: str = "127.0.0.1"
    secret_file: Path | None = None
    control_token: str | None = None

    @property
    def control_url(self) -> str:
        return f"http://{self.host}:{self.control_port}"

    def rollout_env(self, rollout_id: str, attempt: int = 0, proxy_mode: str = "https_proxy", *,
                    greedy: bool = False, host: str | None = None) -> dict[str, str]:
        """The proxy variables of one rollout attempt (``base_url`` mode: no ``HTTP(S)_PROXY``, and
        ``LGT_REWARD_URL`` is the reverse-mode reward path). With ``HTTPS_PROXY`` every HTTPS
        connection goes through the proxy, so the CA variables name the proxy's CA alone (loading
        the system bundle costs a short-lived agent ~50 ms); ``base_url`` mode keeps the system CAs
        for the agent's other connections. ProxyControlError when the proxy's CA is not in the store
        yet (lgt-proxy creates it when it starts)."""
        ca = auth.ca_cert_path(auth.proxy_dir(self.store))
        if not ca.exists():
            raise ProxyControlError(f"the proxy's CA certificate {ca} does not exist: start lgt-proxy with "
                                    f"--store {self.store} before running rollouts")
        env = auth.rollout_env(self.store, rollout_id, attempt=attempt, host=host or self.host,
                               port=self.port, secret_file=self.secret_file,
                               ca="proxy" if proxy_mode == "https_proxy" else "system+proxy", greedy=greedy)
        if proxy_mode == "base_url":
            for var in PROXY_VARS:
                env.pop(var)
            env["LGT_REWARD_URL"] = env["LGT_PROXY_BASE_URL"].removesuffix("/v1") + "/reward"
        return env

    def token(self) -> str:
        return resolve_token(self.control_token, self.store, self.secret_file)

    @property
    def client(self) -> ControlClient:
        """The proxy's control API (:class:`lgt.proxy.client.ControlClient`)."""
        return ControlClient(self.control_url, self.token())

    async def flush(self) -> Any:
        """``POST /flush``: every recorded call and reward becomes Parquet (in a thread)."""
        return await asyncio.to_thread(self.client.flush)

    async def reward(self, rollout_id: str, attempt: int) -> float | None:
        """The latest whole-rollout reward the agent reported through the proxy (``GET /rewards``:
        answered from the proxy's memory, no flush and no store query per rollout)."""
        return await asyncio.to_thread(self.client.reward, rollout_id, attempt)


@dataclass(frozen=True)
class RolloutResult:
    """One attempt's outcome (``run`` returns the last attempt). Times are UTC; ``seconds`` is the
    agent process's wall time; ``reward`` is set only when ``status == "ok"``."""

    rollout_id: str
    attempt: int
    task_id: str
    group_id: str | None
    step: int | None
    status: str
    exit_code: int | None
    reward: float | None
    reward_source: str | None
    started_at: dt.datetime
    ended_at: dt.datetime
    seconds: float
    stdout_path: Path
    stderr_path: Path
    error: str | None = None
    split: str = "train"  # eval: a held-out evaluation rollout (recorded, never trained)
    resource_version: str | None = None  # the resources it ran with (lgt.trainer.rollout.resources)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def identity(self) -> str:
        return auth.Identity(self.rollout_id, self.attempt).name


# -- pure helpers -----------------------------------------------------------------------------------
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


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass(frozen=True)
class _Paths:
    stdout: Path
    stderr: Path
    task_json: Path
    reward_file: Path
    eval_out: Path
    eval_err: Path


# -- the controller ---------------------------------------------------------------------------------
class RolloutController:
    """Runs rollouts as local processes, at most ``concurrency`` at a time (attempts and evaluators).

    Counters for a progress display: ``running`` (attempts in progress), ``done`` (rollouts finished,
    whatever their status), ``failed`` (finished rollouts whose last attempt is not ``ok``),
    ``retried`` (attempts that were retried).
    """

    def __init__(self, agent: AgentSpec, proxy: ProxyEndpoint | Sequence[ProxyEndpoint],
                 store: str | os.PathLike, run_dir: str | os.PathLike, concurrency: int = 4, *,
                 kill_grace_s: float = 5.0, batch_records: bool = False,
                 resources: Resources | None = None, hide: Sequence[str | os.PathLike] = ()) -> None:
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise RolloutError(f"rollout concurrency must be a whole number ≥ 1, not {concurrency!r}")
        check_agent(agent)
        self._preload: tuple[str, tuple[str, ...]] | None = None
        if agent.python_preload is not None:
            # the agent's interpreter as the agent would run it: a relative path (an agent's own
            # environment, e.g. .venv/bin/python) is relative to the agent's working directory
            python = resolve_executable(python_script_command(agent.command)[0], agent.cwd,
                                        os.environ.get("PATH"), "agent command")
            self._preload = (python, agent.python_preload)
        self.store = Path(store).resolve()
        # batch_records: rows wait in memory for flush_records() (one file per table per batch,
        # instead of two files per attempt); a crash loses only unflushed rollouts' rows
        self.batch_records = batch_records
        self._rows: tuple[list[dict[str, Any]], list[dict[str, Any]]] = ([], [])
        self._rows_lock = threading.Lock()
        if not self.store.is_dir():
            raise RolloutError(f"the store directory {str(self.store)!r} does not exist")
        # several proxy replicas on one store: each rollout keeps to one (its calls, its reward)
        self.proxies = [proxy] if isinstance(proxy, ProxyEndpoint) else list(proxy)
        if not self.proxies:
            raise RolloutError("the rollout controller needs at least one proxy")
        self.agent, self.proxy = agent, self.proxies[0]
        self.run_dir = Path(run_dir).resolve()
        self.out_dir = self.run_dir / "rollouts"
        self.concurrency, self.kill_grace_s = concurrency, kill_grace_s
        self.running = self.done = self.failed = self.retried = 0
        self._slots = asyncio.Semaphore(concurrency)
        self._procs: set[asyncio.subprocess.Process | ForkedProcess] = set()
        self._closed = False
        self._forkserver: ForkServer | None = None
        self._forkserver_lock = asyncio.Lock()
        self.resources = resources  # prompts delivered to every rollout (lgt.trainer.rollout.resources)
        self._kube: KubeRunner | None = None  # runner: kubernetes (started on first use)
        self._kube_lock = asyncio.Lock()
        # the sandbox (runner: local): what no attempt may see, besides the store and the run directory
        self.sandboxed = agent.runner == "local" and agent.sandbox.on
        self.hidden = [Path(p).resolve() for p in (*hide, self.store, self.run_dir)]
        self.work_root = self.out_dir / "work"
        self._layout_keep: list[str] = []
        self._ca_pem: dict[int, bytes] = {}  # by proxy port: what each sandboxed attempt gets a copy of

    # -- public ---------------------------------------------------------------------------------------
    async def run(self, task: Mapping[str, Any], rollout_id: str, group_id: str | None = None,
                  step: int | None = None, *, task_id: str | None = None, split: str = "train",
                  greedy: bool = False, first_attempt: int = 0) -> RolloutResult:
        """Run attempt 0, then 1, 2, ... while they fail or time out, up to ``agent.retries`` extra;
        returns the last attempt's result. ``split="eval"`` records a held-out evaluation rollout
        (never trained); ``greedy`` has the proxy decode its calls greedily; ``first_attempt`` continues a
        rollout whose earlier attempts ran before a restart. RolloutError for a bad
        task or rollout id (nothing runs); ProxyControlError when the proxy's CA is not in the store
        yet; ControlError when the proxy does not answer a reward lookup (its rewards would be
        missed)."""
        if self._closed:
            raise RolloutError("the rollout controller is closed; make a new one to run more rollouts")
        if not isinstance(task, Mapping):
            raise RolloutError(f"a task must be a mapping of fields to values, not {type(task).__name__}")
        try:
            auth.check_rollout_id(rollout_id)
        except ValueError as e:
            raise RolloutError(str(e)) from None
        if split not in ROLLOUT_SPLITS:
            raise RolloutError(f"rollout split {split!r} is not one of {', '.join(ROLLOUT_SPLITS)}")
        task_id = task_id or task_id_of(task)
        try:
            task_json = json.dumps(dict(task), ensure_ascii=False).encode()
        except (TypeError, ValueError) as e:
            raise RolloutError(f"task {task_id!r} cannot be written as JSON ({e})") from None
        fields = task_env(task, self.agent.task_env_prefix)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        result = None
        for attempt in range(first_attempt, max(first_attempt, self.agent.retries) + 1):
            result = await self._attempt(task_json, fields, rollout_id, attempt, task_id, group_id, step,
                                         split=split, greedy=greedy, task=dict(task))
            if result.ok or self._closed:
                break
            if attempt < self.agent.retries:
                self.retried += 1
        assert result is not None
        self.done += 1
        self.failed += not result.ok
        return result

    async def existing_jobs(self) -> list[dict[str, str]]:
        """runner: kubernetes — the run's Jobs that exist in the cluster now (labels ``rollout``,
        ``attempt``, ``group``, ``task``, ``step``), e.g. after a restart; ``[]`` for local processes."""
        if self.agent.runner != "kubernetes":
            return []
        error = await self._kube_runner()
        if error is not None:
            raise RolloutError(error)
        assert self._kube is not None
        return self._kube.existing()

    async def aclose(self) -> None:
        """Stop everything still running (SIGTERM to each process group, SIGKILL after the grace
        period); later ``run`` calls are refused. Safe to call twice."""
        self._closed = True
        procs = list(self._procs)
        for proc in procs:
            signal_group(proc.pid, signal.SIGTERM)
        await asyncio.gather(*(self._reap(proc) for proc in procs))
        if self._forkserver is not None:
            await self._forkserver.aclose()
        if self._kube is not None:
            await self._kube.aclose(delete=True)
        if self._rows[0] or self._rows[1]:
            await asyncio.to_thread(self.flush_records)

    async def __aenter__(self) -> RolloutController:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- one attempt ----------------------------------------------------------------------------------
    def proxy_for(self, rollout_id: str) -> ProxyEndpoint:
        """The replica a rollout's attempts go through (the same one for all of them)."""
        if len(self.proxies) == 1:
            return self.proxies[0]
        return self.proxies[zlib.crc32(rollout_id.encode()) % len(self.proxies)]

    def paths(self, rollout_id: str, attempt: int) -> _Paths:
        """The attempt's files: ``<run_dir>/rollouts/<rollout_id>~<attempt>.out`` (``.err``,
        ``.task.json``, ``.reward``, ``.eval.out``, ``.eval.err``)."""
        stem = f"{rollout_id}~{attempt}"
        return _Paths(*(self.out_dir / f"{stem}.{ext}"
                        for ext in ("out", "err", "task.json", "reward", "eval.out", "eval.err")))

    def environment(self, fields: Mapping[str, str], rollout_id: str, attempt: int, task_id: str,
                    paths: _Paths, *, greedy: bool = False) -> dict[str, str]:
        """The attempt's whole environment (see the module docstring for the layers). Sandboxed, its
        paths are the sandbox's: ``/lgt/work`` (also ``HOME``), ``/lgt/work/.lgt/task.json``, the CA copied
        there, the proxy at ``127.0.0.1`` (the relayed port)."""
        env = {k: v for k, v in os.environ.items() if k not in STRIPPED_VARS}
        if self.sandboxed:
            lgt = f"{sandboxing.WORK}/.lgt"
            env.pop("TMPDIR", None)
            env.update(HOME=sandboxing.WORK, LGT_WORK_DIR=sandboxing.WORK)
            proxy_env = self.proxy_for(rollout_id).rollout_env(rollout_id, attempt, self.agent.proxy_mode,
                                                               greedy=greedy, host="127.0.0.1")
            env.update({k: f"{lgt}/ca.pem" if k in auth.CA_VARS else v for k, v in proxy_env.items()})
            env.update(fields)
            env.update(TASK_JSON=f"{lgt}/task.json", TASK_ID=task_id, REWARD_FILE=f"{lgt}/reward")
        else:
            env.update(self.proxy_for(rollout_id).rollout_env(rollout_id, attempt, self.agent.proxy_mode,
                                                              greedy=greedy))
            env.update(fields)
            task_json = paths.task_json.with_suffix(".agent.json") if self.agent.private else paths.task_json
            env.update(TASK_JSON=str(task_json), TASK_ID=task_id, REWARD_FILE=str(paths.reward_file))
        expanded = {k: expand(v, env, k) for k, v in self.agent.env.items()}
        env.update(expanded)
        return env

    async def _attempt(self, task_json: bytes, fields: Mapping[str, str], rollout_id: str, attempt: int,
                       task_id: str, group_id: str | None, step: int | None, *, split: str = "train",
                       greedy: bool = False, task: Mapping[str, Any] | None = None) -> RolloutResult:
        paths = self.paths(rollout_id, attempt)
        res = self.resources  # this attempt's version, whatever a prompt optimiser sets meanwhile
        filled = res.for_task(task or {}) if res is not None else {}
        # what the agent sees of its task: all but the private fields (the evaluator gets them all)
        view = {k: v for k, v in (task or {}).items() if k not in self.agent.private}
        agent_fields = {k: v for k, v in fields.items()
                        if k in task_env(view, self.agent.task_env_prefix)} if self.agent.private else fields
        agent_json = json.dumps(view, ensure_ascii=False).encode() if self.agent.private else task_json
        # the attempt's own folder ($LGT_WORK_DIR; /lgt/work, its HOME, sandboxed): the evaluator reads it
        work = self.work_root / f"{rollout_id}~{attempt}" if self.agent.runner == "local" else None
        extra_env, files = self._resource_delivery(res, filled, rollout_id, attempt,
                                                   work if self.sandboxed else None)
        env = self.environment(agent_fields, rollout_id, attempt, task_id, paths, greedy=greedy)
        env.update(extra_env)
        write_atomic(paths.task_json, task_json)
        if self.agent.private and not self.sandboxed and self.agent.runner == "local":
            write_atomic(paths.task_json.with_suffix(".agent.json"), agent_json)
        for stale in (paths.reward_file, paths.eval_out, paths.eval_err):
            stale.unlink(missing_ok=True)
        if self.sandboxed:
            self._make_work(work, agent_json, rollout_id, files)
        elif work is not None:
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            env["LGT_WORK_DIR"] = str(work)
        async with self._slots:
            started, t0 = _now(), time.monotonic()
            if self._closed:
                return self._result(rollout_id, attempt, task_id, group_id, step, "failed", None, None, None,
                                    started, 0.0, paths, "the controller was closed before it started")
            self.running += 1
            try:
                error = await self._deliver(res, filled, rollout_id, attempt)
                if error is not None:
                    code, timed_out = None, False
                elif self.agent.runner == "kubernetes":
                    code, timed_out, error = await self._execute_job(
                        agent_fields, rollout_id, attempt, task_id, group_id, step, agent_json, paths,
                        greedy=greedy, extra_env=extra_env, files=files)
                elif self.sandboxed:
                    code, timed_out, error = await self._execute_sandboxed(env, paths, work, rollout_id)
                else:
                    code, timed_out, error = await self._execute(
                        self.agent.command, env, paths.stdout, paths.stderr, forked=self._preload is not None)
                seconds = time.monotonic() - t0
                ended = _now()
                reward = source = None
                if error is not None or code is None:
                    status = "failed"
                elif timed_out:
                    status, error = "timeout", (f"the agent ran past its {self.agent.timeout_s:g} s timeout "
                                                "and was killed")
                elif self._closed:
                    status, error = "failed", f"the agent {describe_exit(code)} when the controller closed"
                elif code != 0:
                    status, error = "failed", f"the agent {describe_exit(code)}" + _stderr_hint(paths.stderr)
                else:
                    if self.sandboxed:
                        _take_reward_file(work, paths.reward_file)
                    eval_env = self._evaluator_env(fields, rollout_id, attempt, task_id, paths, work)
                    reward, source, error = await self._reward(rollout_id, attempt, eval_env, paths)
                    status = "ok" if reward is not None else "failed"
            finally:
                self.running -= 1
                if work is not None:
                    await asyncio.to_thread(shutil.rmtree, work, True)
        result = self._result(rollout_id, attempt, task_id, group_id, step, status, code, reward, source,
                              started, seconds, paths, error, ended, split)
        if res is not None:
            result = dataclasses.replace(result, resource_version=res.version)
        await asyncio.to_thread(self._record, result)
        return result

    def _resource_delivery(self, res: Resources | None, filled: Mapping[str, str], rollout_id: str,
                           attempt: int, work: Path | None = None) -> tuple[dict[str, str], dict[str, bytes]]:
        """The variables (``deliver: env``, and the paths of ``deliver: file``) and, for a pod, the files
        of this attempt's resources; local files are written here."""
        env: dict[str, str] = {}
        files: dict[str, bytes] = {}
        if res is None:
            return env, files
        from lgt.trainer.rollout.kube import MOUNT
        from lgt.trainer.rollout.resources import env_name

        for name, spec in res.specs.items():
            if spec.deliver == "env":
                env[env_name(name)] = filled[name]
            elif spec.deliver == "file":
                fname = f"resource-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.txt"
                if self.agent.runner == "kubernetes":
                    files[fname] = filled[name].encode()
                    env[env_name(name) + "_FILE"] = f"{MOUNT}/{fname}"
                elif work is not None:  # sandboxed: in the attempt's own folder (made before it starts)
                    files[fname] = filled[name].encode()
                    env[env_name(name) + "_FILE"] = f"{sandboxing.WORK}/.lgt/{fname}"
                else:
                    path = self.out_dir / f"{rollout_id}~{attempt}.{fname}"
                    write_atomic(path, filled[name].encode())
                    env[env_name(name) + "_FILE"] = str(path)
        return env, files

    async def _deliver(self, res: Resources | None, filled: Mapping[str, str], rollout_id: str,
                       attempt: int) -> str | None:
        """``deliver: proxy``: register the attempt's prompt with its proxy before it starts; the reason
        when that fails (the attempt fails: it would run on the agent's own prompt)."""
        subs = res.substitutions(filled) if res is not None else []
        if not subs:
            return None
        from lgt.proxy.client import ControlError

        try:
            await asyncio.to_thread(self.proxy_for(rollout_id).client.deliver, rollout_id, attempt, subs)
        except (ControlError, OSError) as e:
            return f"could not deliver the resources to the proxy: {e}"
        return None

    def _result(self, rollout_id: str, attempt: int, task_id: str, group_id: str | None, step: int | None,
                status: str, code: int | None, reward: float | None, source: str | None,
                started: dt.datetime, seconds: float, paths: _Paths, error: str | None,
                ended: dt.datetime | None = None, split: str = "train") -> RolloutResult:
        return RolloutResult(rollout_id=rollout_id, attempt=attempt, task_id=task_id, group_id=group_id,
                             step=step, status=status, exit_code=code, reward=reward, reward_source=source,
                             started_at=started, ended_at=ended or started, seconds=seconds,
                             stdout_path=paths.stdout, stderr_path=paths.stderr, error=error, split=split)

    async def _execute(self, argv: tuple[str, ...], env: Mapping[str, str], stdout: Path,
                       stderr: Path, *, forked: bool = False) -> tuple[int | None, bool, str | None]:
        """Run ``argv`` in its own process group until it exits or ``timeout_s`` passes (``forked``:
        forked from the warm fork server instead of started fresh). Returns (exit code or None when
        it could not start, timed out, error when it could not start). Whatever the process group
        still holds when it ends is killed."""
        proc: asyncio.subprocess.Process | ForkedProcess
        if forked:
            try:
                server = await self._fork_server()
                proc = await server.spawn(argv[1:], env, self.agent.cwd, stdout, stderr)
            except ForkServerError as e:
                return None, False, f"could not start {argv[1]!r} in the fork server: {e}"
        else:
            with open(stdout, "wb") as out, open(stderr, "wb") as err:
                try:
                    proc = await asyncio.create_subprocess_exec(
                        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=err, env=dict(env),
                        cwd=self.agent.cwd, start_new_session=True)
                except OSError as e:
                    return None, False, f"could not start {argv[0]!r}: {e.strerror or e}"
        return await self._wait(proc)

    async def _wait(self, proc: asyncio.subprocess.Process | ForkedProcess,
                    ) -> tuple[int | None, bool, str | None]:
        """Until ``proc`` exits or ``timeout_s`` passes (then SIGTERM, SIGKILL after the grace period);
        whatever its group still holds is killed."""
        self._procs.add(proc)
        if self._closed:  # aclose() ran while this one was starting
            signal_group(proc.pid, signal.SIGTERM)
        try:
            try:
                code = await asyncio.wait_for(proc.wait(), self.agent.timeout_s)
                timed_out = False
            except TimeoutError:
                signal_group(proc.pid, signal.SIGTERM)
                code = await self._reap(proc)
                timed_out = True
            signal_group(proc.pid, signal.SIGKILL)  # children left behind by the agent
        except asyncio.CancelledError:
            signal_group(proc.pid, signal.SIGKILL)
            raise
        finally:
            self._procs.discard(proc)
        return code, timed_out, None

    def _evaluator_env(self, fields: Mapping[str, str], rollout_id: str, attempt: int, task_id: str,
                       paths: _Paths, work: Path | None) -> dict[str, str]:
        """What the evaluator is given: every task field (the private ones too), the whole task's file,
        the attempt's identity and, sandboxed, ``LGT_WORK_DIR``: the agent's work folder, as it left it
        (the agent wrote it: read it as untrusted input)."""
        env = dict(fields)
        env.update(TASK_JSON=str(paths.task_json), TASK_ID=task_id, REWARD_FILE=str(paths.reward_file),
                   LGT_ROLLOUT_ID=rollout_id, LGT_ATTEMPT=str(attempt))
        if work is not None:
            env["LGT_WORK_DIR"] = str(work)
        return env

    def _make_work(self, work: Path, agent_json: bytes, rollout_id: str, files: Mapping[str, bytes]) -> None:
        """The attempt's own folder (``/lgt/work`` in its sandbox): its task, the proxy's CA, its resource
        files, owned by the sandbox's user."""
        self.work_root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.work_root, 0o711)
        shutil.rmtree(work, ignore_errors=True)
        (work / ".lgt").mkdir(parents=True, mode=0o700)
        proxy = self.proxy_for(rollout_id)
        if proxy.port not in self._ca_pem:  # the proxy's CA bundle, made and read once per run
            self._ca_pem[proxy.port] = Path(proxy.rollout_env(rollout_id, 0)["SSL_CERT_FILE"]).read_bytes()
        (work / ".lgt" / "task.json").write_bytes(agent_json)
        (work / ".lgt" / "ca.pem").write_bytes(self._ca_pem[proxy.port])
        for name, data in files.items():
            (work / ".lgt" / name).write_bytes(data)
        uid = sandboxing.sandbox_uid()
        if uid is not None:
            for path in (work, work / ".lgt", *(work / ".lgt").iterdir()):
                os.chown(path, uid, uid)
        os.chmod(work, 0o700)

    async def _execute_sandboxed(self, env: Mapping[str, str], paths: _Paths, work: Path,
                                 rollout_id: str) -> tuple[int | None, bool, str | None]:
        """One attempt forked into its own namespaces (:mod:`lgt.trainer.rollout.sandbox`), its loopback
        port relayed to its proxy, its work folder's size watched; the rest as :meth:`_execute`."""
        spec = self.agent.sandbox
        proxy = self.proxy_for(rollout_id)
        try:
            server = await self._fork_server()
            req = {"work": work.name, "port": proxy.port, "keep": self._layout_keep,
                   "map_to": sandboxing.sandbox_uid(), **spec.limits()}
            execute = self._preload is None
            argv = self.agent.command if execute else self.agent.command[1:]
            proc = await server.spawn(argv, env, self.agent.cwd, paths.stdout, paths.stderr, execute=execute,
                                      sandbox=req)
        except ForkServerError as e:
            return None, False, f"could not start {self.agent.command[0]!r} in its sandbox: {e}"
        relay = sandboxing.Relay(proxy.host, proxy.port)
        assert proc.listener is not None
        await relay.start(proc.listener)
        limit = spec.disk_mb << 20
        over = asyncio.Event()

        async def watch_disk() -> None:
            while True:
                await asyncio.sleep(0.5)
                if await asyncio.to_thread(sandboxing.disk_usage, work, limit) > limit:
                    over.set()
                    signal_group(proc.pid, signal.SIGKILL)
                    return

        watcher = asyncio.get_running_loop().create_task(watch_disk())
        try:
            code, timed_out, error = await self._wait(proc)
        finally:
            watcher.cancel()
            relay.close()
        if over.is_set():
            return None, False, (f"the agent's work folder grew past its {spec.disk_mb} MB limit "
                                 "(agent.sandbox.disk_mb) and the attempt was killed")
        return code, timed_out, error

    async def _execute_job(self, fields: Mapping[str, str], rollout_id: str, attempt: int, task_id: str,
                           group_id: str | None, step: int | None, task_json: bytes, paths: _Paths, *,
                           greedy: bool, extra_env: Mapping[str, str] = MappingProxyType({}),
                           files: Mapping[str, bytes] = MappingProxyType({}),
                           ) -> tuple[int | None, bool, str | None]:
        """One attempt as a Kubernetes Job (:mod:`lgt.trainer.rollout.kube`): the same variables as a local
        process, minus the machine's own; what carries the rollout's token goes in its Secret."""
        from lgt.trainer.rollout.kube import MOUNT

        error = await self._kube_runner()
        if error is not None:
            return None, False, error
        assert self._kube is not None
        proxy_env = self.proxy_for(rollout_id).rollout_env(rollout_id, attempt, self.agent.proxy_mode,
                                                           greedy=greedy, host=self.agent.proxy_host)
        ca = Path(proxy_env["SSL_CERT_FILE"]).read_bytes()
        plain = {k: f"{MOUNT}/ca.pem" if k in auth.CA_VARS else v for k, v in proxy_env.items()}
        plain.update(fields)
        plain.update(TASK_JSON=f"{MOUNT}/task.json", TASK_ID=task_id, **extra_env)
        plain.update({k: expand(v, plain, k) for k, v in self.agent.env.items()})
        secret = {k: plain.pop(k) for k in list(plain)
                  if k in PROXY_VARS or k == "LGT_PROXY_BASE_URL" or _carries_token(plain[k], proxy_env)}
        return await self._kube.execute(
            rollout_id=rollout_id, attempt=attempt, group_id=group_id, task_id=task_id, step=step,
            plain_env=plain, secret_env=secret, files={"ca.pem": ca, "task.json": task_json, **files},
            timeout_s=self.agent.timeout_s, stdout=paths.stdout, stderr=paths.stderr)

    async def _kube_runner(self) -> str | None:
        """Start the Kubernetes runner on first use; the reason when it cannot start."""
        from lgt.trainer.rollout.kube import KubeError, KubeRunner

        async with self._kube_lock:
            if self._kube is None:
                runner = KubeRunner(template=self.agent.job_template, namespace=self.agent.namespace,
                                    run_dir=self.run_dir, run_name=self.run_dir.name,
                                    kubeconfig=self.agent.kubeconfig, jobs_per_s=self.agent.jobs_per_s,
                                    ttl_s=self.agent.job_ttl_s)
                try:
                    await runner.start()
                except KubeError as e:
                    return str(e)
                self._kube = runner
        return None

    async def _fork_server(self) -> ForkServer:
        """The warm interpreter (started on first use, and again if it died); sandboxed, in its sandbox
        (with no modules to preload: any Python, only to fork and exec each attempt)."""
        assert self._preload is not None or self.sandboxed
        if self._forkserver is not None and self._forkserver.loop is not asyncio.get_running_loop():
            self._forkserver.abandon()  # started under an event loop that has ended
            self._forkserver = None
            self._forkserver_lock = asyncio.Lock()
        async with self._forkserver_lock:
            if self._forkserver is None or self._forkserver.proc.returncode is not None:
                python, modules = self._preload or (sandboxing.plain_python(), ())
                env = {k: v for k, v in os.environ.items() if k not in STRIPPED_VARS}
                layout = self._layout(python) if self.sandboxed else None
                self._forkserver = await ForkServer.start(python, modules, env=env, sandbox=layout)
                if layout is not None:  # with the zygote's own folders (its learning one), which stay
                    self._layout_keep = layout.keep()
            return self._forkserver

    def _layout(self, python: str) -> sandboxing.Layout:
        """What the sandbox shows: the interpreters, the agent's folder and the files its command names,
        ``agent.sandbox.mounts``; hidden: the store, the run directory and what the owner hides."""
        readonly = [*sandboxing.interpreter_dirs(python), *self.agent.sandbox.mounts]
        cmd = resolve_executable(self.agent.command[0], self.agent.cwd, os.environ.get("PATH"),
                                 "agent command")
        readonly += sandboxing.interpreter_dirs(cmd) if Path(cmd).parent.name == "bin" else [Path(cmd)]
        if self.agent.cwd is not None:
            readonly.append(self.agent.cwd.resolve())
        readonly += sandboxing.command_paths(self.agent.command[1:], self.agent.cwd)
        readonly = [Path(os.path.normpath(p.absolute())) for p in readonly]
        readonly += [p.resolve() for p in readonly if p.resolve() != p]  # what a link in them points to
        layout = sandboxing.Layout(readonly=readonly, hidden=list(self.hidden),
                                   attempts=self.work_root, cwd=self.agent.cwd)
        self.work_root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.work_root, 0o711)
        return layout

    async def _reap(self, proc: asyncio.subprocess.Process | ForkedProcess) -> int:
        """Wait ``kill_grace_s`` for a signalled group's leader, then SIGKILL the group; exit code."""
        try:
            await asyncio.wait_for(proc.wait(), self.kill_grace_s)
        except TimeoutError:
            pass
        signal_group(proc.pid, signal.SIGKILL)
        return await proc.wait()

    # -- rewards and records --------------------------------------------------------------------------
    async def _reward(self, rollout_id: str, attempt: int, env: Mapping[str, str],
                      paths: _Paths) -> tuple[float | None, str | None, str | None]:
        """(reward, source, error) from the first of ``agent.reward_sources`` that has one."""
        sources = self.agent.reward_sources
        if "proxy" in sources:
            value = await self.proxy_for(rollout_id).reward(rollout_id, attempt)
            if value is not None:
                return value, "proxy", None
        if "file" in sources and paths.reward_file.exists():
            text = paths.reward_file.read_text(errors="replace")
            try:
                return parse_reward(text), "file", None
            except ValueError as e:
                return None, None, f"the reward file {paths.reward_file} is unusable: {e}"
        line = last_line(paths.stdout) if "stdout" in sources else None
        if line is not None:
            with contextlib.suppress(ValueError):
                return parse_reward(line), "stdout", None
        if "evaluator" in sources and self.agent.evaluator is not None:
            return await self._evaluate(env, paths)
        looked = ", ".join(_SOURCE_NAMES[s] for s in sources
                           if s != "evaluator" or self.agent.evaluator is not None)
        return None, None, f"the agent exited 0 but reported no reward (looked at: {looked or 'nothing'})"

    async def _evaluate(self, env: Mapping[str, str], paths: _Paths) -> tuple[float | None, str | None,
                                                                               str | None]:
        assert self.agent.evaluator is not None
        eval_env = {k: v for k, v in os.environ.items() if k not in (auth.SECRET_ENV, auth.CONTROL_TOKEN_ENV)}
        eval_env.update({k: v for k, v in env.items()
                         if k.startswith(self.agent.task_env_prefix) or k in RESERVED_VARS
                         or k in ("LGT_ROLLOUT_ID", "LGT_ATTEMPT", "LGT_WORK_DIR")})
        if self.agent.runner == "kubernetes":  # an evaluator Job: the same image, the agent's output
            code, timed_out, error = await self._evaluate_job(eval_env, paths)
        else:
            argv = (*self.agent.evaluator, str(paths.task_json), str(paths.stdout))
            code, timed_out, error = await self._execute(argv, eval_env, paths.eval_out, paths.eval_err)
        if error is not None:
            return None, None, f"the evaluator {error.removeprefix('could not start ')}"
        if timed_out:
            return None, None, f"the evaluator ran past its {self.agent.timeout_s:g} s timeout and was killed"
        if code != 0:
            return None, None, f"the evaluator {describe_exit(code)}" + _stderr_hint(paths.eval_err)
        line = last_line(paths.eval_out)
        if line is None:
            return None, None, "the evaluator printed nothing (its last stdout line should be the reward)"
        try:
            return parse_reward(line), "evaluator", None
        except ValueError as e:
            return None, None, f"the evaluator's last stdout line is unusable: {e}"

    async def _evaluate_job(self, eval_env: Mapping[str, str],
                            paths: _Paths) -> tuple[int | None, bool, str | None]:
        """runner: kubernetes — the evaluator as a Job from the agent's template (its image, the task
        and the agent's output mounted), given ``TASK_JSON AGENT_OUTPUT`` like a local evaluator."""
        from lgt.trainer.rollout.kube import MOUNT

        assert self._kube is not None and self.agent.evaluator is not None
        plain = {k: v for k, v in eval_env.items() if k.startswith(self.agent.task_env_prefix)
                 or k in ("TASK_ID", "LGT_ROLLOUT_ID", "LGT_ATTEMPT")}
        plain["TASK_JSON"] = f"{MOUNT}/task.json"
        task_json = paths.task_json.read_bytes()
        return await self._kube.execute(
            rollout_id=eval_env["LGT_ROLLOUT_ID"], attempt=int(eval_env["LGT_ATTEMPT"]), group_id=None,
            task_id=eval_env.get("TASK_ID", ""), step=None, plain_env=plain, secret_env={},
            files={"task.json": task_json, "agent-output.txt": paths.stdout.read_bytes()},
            timeout_s=self.agent.timeout_s, stdout=paths.eval_out, stderr=paths.eval_err, role="evaluator",
            command=[*self.agent.evaluator, f"{MOUNT}/task.json", f"{MOUNT}/agent-output.txt"])

    def _record(self, r: RolloutResult) -> None:
        """The attempt's rollouts row, then its reward row unless the proxy recorded it already."""
        metadata: dict[str, Any] = {"reward_source": r.reward_source, "seconds": round(r.seconds, 6)}
        if r.error:
            metadata["error"] = r.error
        row = rollout_row(r.rollout_id, attempt=r.attempt, task_id=r.task_id, group_id=r.group_id,
                          step=r.step, status=r.status, exit_code=r.exit_code, started_at=r.started_at,
                          ended_at=r.ended_at, split=r.split, metadata=metadata,
                          resource_version=r.resource_version)
        reward = None
        if r.reward is not None and r.reward_source != "proxy":
            reward = attempt_reward_row(r.rollout_id, r.reward, attempt=r.attempt, source=r.reward_source)
        with self._rows_lock:  # _record and flush_records run in worker threads
            self._rows[0].append(row)
            if reward is not None:
                self._rows[1].append(reward)
        if not self.batch_records:
            self.flush_records()

    def flush_records(self) -> int:
        """Write the rows of attempts finished since the last call (one file per table); their count.
        A store that cannot be written (a full disk) keeps the rows for the next call and raises
        :class:`StoreWriteError`, one sentence."""
        with self._rows_lock:
            rollouts, rewards = self._rows
            self._rows = ([], [])
        try:
            add_rows(self.store, rollouts, rewards)
        except OSError as e:
            with self._rows_lock:  # nothing lost: the next flush writes them
                self._rows = (rollouts + self._rows[0], rewards + self._rows[1])
            raise StoreWriteError(f"the store {self.store} cannot be written ({os_reason(e)}): free space "
                                  "there, then continue the run with lgt-train run --resume") from None
        return len(rollouts)


def _carries_token(value: str, proxy_env: Mapping[str, str]) -> bool:
    """Whether ``value`` holds the rollout's proxy token (it is in the proxy URL's user info)."""
    url = proxy_env.get("LGT_PROXY_BASE_URL", "")
    token = url.split("/r/", 1)[-1].split("/")[1] if "/r/" in url else ""
    return bool(token) and token in value


def _take_reward_file(work: Path, dest: Path, limit: int = 65536) -> None:
    """The reward file a sandboxed agent wrote (``/lgt/work/.lgt/reward``) to its place among the attempt's
    files, never following a link the agent made."""
    dest.unlink(missing_ok=True)
    try:
        top = os.open(work, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            lgt = os.open(".lgt", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
            try:
                fd = os.open("reward", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=lgt)
            finally:
                os.close(lgt)
        finally:
            os.close(top)
    except OSError:
        return
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return
        write_atomic(dest, f.read(limit))


def _stderr_hint(path: Path) -> str:
    line = last_line(path)
    return f" (last stderr line: {_short(line, 160)})" if line else ""
