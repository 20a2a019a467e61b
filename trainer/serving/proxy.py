"""The trainer's side of ``lgt-proxy``: start one for a run, or use a running one, and drive its control API.

The proxy is a separately deployed tool with its own environment; the trainer only starts its executable
and talks HTTP to it through :mod:`lgt.proxy.client` (pause / resume / flush / state). One
:class:`ProxyClient` is the trainer's handle on one running proxy — where agents reach it, its control
API, the variables of a rollout that goes through it, and its process when this one started it;
:class:`ProxyGroup` drives several replicas as one. Nothing here imports mitmproxy.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lgt.proxy import auth
from lgt.proxy.client import ControlClient, resolve_token
from lgt.proxy.tool_parsers import PARSERS as TOOL_PARSERS
from lgt.trainer.serving import children

REPO = Path(__file__).resolve().parents[2]
PROXY_VARS = ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy")


class ProxyError(RuntimeError):
    """The proxy could not be found or started, or its process exited (control calls: ControlError)."""


class ProxyControlError(RuntimeError):
    """The proxy is not ready for rollouts (its CA is not in the store yet). The control API's own
    failures are :class:`lgt.proxy.client.ControlError`."""


@dataclass(frozen=True)
class ProxySection:
    """The run config's ``proxy`` section: a running lgt-proxy to use, or how to start one."""

    url: tuple[str, ...] | None = None  # running lgt-proxy replicas' control URLs; null: start one
    token: str | None = None  # its control token (or LGT_CONTROL_TOKEN)
    port: int = 0
    control_port: int = 0
    command: tuple[str, ...] | None = None  # how to start lgt-proxy; default: found next to this install
    upstream_timeout_s: float | None = None  # the started proxy's --upstream-timeout (none: no limit)
    listen_host: str = "127.0.0.1"  # where the started proxy listens for agents (0.0.0.0: pods too)
    # what agents reach besides the policy (whose calls, to any host, always go to the engine): allowlist
    # of allow_hosts (none listed: nothing else), deny, or allow (anything, the internet included)
    egress: str = "allowlist"
    allow_hosts: tuple[str, ...] = ()
    # the most tokens one reply of the policy may generate (lgt-proxy --max-output-tokens): a harness
    # asks for tens of thousands, which an untrained policy spends to the agent's timeout; each capped
    # call says so in its record (calls.translation). null: the agent's own limit
    max_output_tokens: int | None = None
    # at an update, the calls in flight: drain (the update waits for them to finish on the old weights)
    # or continue (each is stopped where it is and continued by the proxy on the new weights, its tokens
    # recorded with each one's version; calls offering tools are continued when the proxy can read the
    # engine's --tool-call-parser's format (hermes), else drained: docs/proxy.md)
    on_update: str = "drain"

    def __post_init__(self) -> None:
        if self.on_update not in ("drain", "continue"):
            raise ValueError(f"proxy.on_update must be drain or continue, not {self.on_update!r}")
        if self.egress not in EGRESS_MODES:
            raise ValueError(f"proxy.egress must be one of {', '.join(EGRESS_MODES)}, not {self.egress!r}")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ValueError(f"proxy.max_output_tokens must be a positive number of tokens (or null: the "
                             f"agent's own limit), not {self.max_output_tokens}")

    def egress_args(self) -> list[str]:
        """The started proxy's egress options: ``allowlist`` with no hosts is ``deny``."""
        if self.egress == "allowlist" and not self.allow_hosts:
            return ["--egress", "deny"]
        return ["--egress", self.egress, *(a for h in self.allow_hosts for a in ("--allow-host", h))]


EGRESS_MODES = ("allow", "allowlist", "deny")  # lgt-proxy --egress (the proxy's own list; not imported)


def find_proxy_command() -> list[str]:
    """How to start ``lgt-proxy``: ``$LGT_PROXY_COMMAND``; else this checkout's proxy environment
    (``.venv-proxy``); else ``lgt-proxy`` on PATH (when this environment has mitmproxy, or it is
    another environment's)."""
    if os.environ.get("LGT_PROXY_COMMAND"):
        return shlex.split(os.environ["LGT_PROXY_COMMAND"])
    local = REPO / ".venv-proxy" / "bin" / "lgt-proxy"
    if local.exists():
        return [str(local)]
    found = shutil.which("lgt-proxy")
    here = Path(sys.executable).parent
    if found and (importlib.util.find_spec("mitmproxy") is not None or Path(found).parent != here):
        return [found]
    raise ProxyError("lgt-proxy was not found (its own environment, with mitmproxy): run scripts/setup.sh, "
                     "or set proxy.command in the run config or $LGT_PROXY_COMMAND")


@dataclass
class ProxyClient:
    """A running lgt-proxy: where agents reach it (``host``, ``port``), its control API (``api``:
    :class:`lgt.proxy.client.ControlClient`) and, when this process started it, its process. Control
    calls raise :class:`lgt.proxy.client.ControlError` unless answered 200.

    A rollout's variables (:meth:`rollout_env`) are signed with the store's secret: ``$LGT_PROXY_SECRET``,
    ``secret_file`` or ``<store>/_proxy/secret`` (:func:`lgt.proxy.auth.load_secret`)."""

    store: Path
    port: int
    api: ControlClient
    host: str = ""  # where agents reach it ("": the control API's host)
    secret_file: Path | None = None
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    argv: list[str] | None = None  # how this process started it (restart() starts it again)

    def __post_init__(self) -> None:
        if not self.host:
            self.host = self.control_url.split("://", 1)[-1].rsplit(":", 1)[0]

    @property
    def control_url(self) -> str:
        return self.api.url

    @property
    def token(self) -> str:
        return self.api.token

    # --- lifecycle -------------------------------------------------------------------------------
    @classmethod
    def start(cls, store: Path | str, upstream: str | None, *, log_path: Path, policy_version: int = 0,
              port: int = 0, control_port: int = 0, command: list[str] | None = None,
              upstream_timeout: float | None = None, listen_host: str = "127.0.0.1",
              egress: list[str] | None = None, served_model: str = "policy",
              max_output_tokens: int | None = None, policies: Path | None = None,
              on_update: str = "drain", tool_parser: str | None = None, timeout: float = 60) -> ProxyClient:
        """Start lgt-proxy on ``store`` (a folder, or ``s3://…``: the proxy uploads there and both
        work in its local mirror). ``upstream`` None: observe-only (calls go where the agent sent them,
        and are recorded as a hosted model's: ``lgt-train record``). ``served_model``: the name the
        upstream serves the policy under (``engine.served_model_name``), which every routed call asks
        for; ``max_output_tokens``: the proxy's cap on a reply's length (``proxy.max_output_tokens``);
        ``policies``: the run's policies section as JSON (``--policies``; read again by a restart);
        ``on_update``: what a pause does with the calls in flight (``--on-update``); ``tool_parser``: the
        engine's tool call parser, passed on when the proxy can read its tool calls (``--tool-parser``:
        calls offering tools are then continued too)."""
        from lgt.store.remote import resolve

        store_arg, store = str(store), resolve(store)[0]
        port = port or children.free_port()
        control_port = control_port or children.free_port()
        route = ["--upstream", upstream, "--served-model", served_model] if upstream is not None else []
        if upstream is not None and max_output_tokens:
            route += ["--max-output-tokens", str(max_output_tokens)]
        if policies is not None:
            route += ["--policies", str(policies)]
        if upstream is not None and on_update != "drain":
            route += ["--on-update", on_update]
            if tool_parser in TOOL_PARSERS:
                route += ["--tool-parser", tool_parser]
        cmd = [*(command or find_proxy_command()), "--store", store_arg, *route,
               "--listen-port", str(port), "--control-port", str(control_port),
               "--policy-version", str(policy_version), "--flush-seconds", "0.5"]
        if listen_host != "127.0.0.1":
            cmd += ["--listen-host", listen_host]
        if upstream_timeout is not None:
            cmd += ["--upstream-timeout", str(upstream_timeout)]
        cmd += egress or []
        client = cls(store=store, port=port, api=ControlClient(f"http://127.0.0.1:{control_port}", ""),
                     log_path=log_path, argv=cmd)
        client._launch(timeout)
        return client

    def _launch(self, timeout: float) -> None:
        """Run ``argv`` and wait until its control API answers."""
        assert self.argv is not None and self.log_path is not None
        env = {k: v for k, v in os.environ.items()
               if k.upper() not in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "NO_PROXY")}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                preexec_fn=children.die_with_parent)
        finally:
            log.close()
        url = self.api.url
        self.api = ControlClient(url, "")
        if children.wait_until(lambda: self.api.healthz(timeout=1), proc, timeout):
            # the proxy has made its secret: the token can be read
            self.api = ControlClient(url, resolve_token(store=self.store))
            return
        if proc.returncode is not None:
            raise ProxyError(f"lgt-proxy exited with code {proc.returncode} while starting; "
                             f"its log ({self.log_path}):\n{children.log_tail(self.log_path, 15)}")
        self.stop()
        raise ProxyError(f"lgt-proxy did not answer on its control port within {timeout:.0f} s; "
                         f"its log: {self.log_path}")

    @property
    def died(self) -> bool:
        """This process started it and it has exited."""
        return self.proc is not None and self.proc.poll() is not None

    def restart(self, policy_version: int, timeout: float = 60, served_model: str | None = None) -> None:
        """Start the proxy this process started again, on the same ports and store (it recovers its
        write-ahead log), serving ``policy_version`` (and sending calls to ``served_model``, when given:
        the adapter of that version)."""
        if self.argv is None:
            raise ProxyError(f"the proxy at {self.control_url} was not started by this run: it cannot be "
                             "restarted from here")
        argv = list(self.argv)
        argv[argv.index("--policy-version") + 1] = str(policy_version)
        if served_model is not None and "--served-model" in argv:
            argv[argv.index("--served-model") + 1] = served_model
        self.argv = argv
        self._launch(timeout)

    @classmethod
    def connect(cls, store: Path, control_url: str, port: int = 0, token: str | None = None) -> ProxyClient:
        """A running proxy; ControlError unless it answers ``GET /state`` with this token
        (:func:`resolve_token`: ``token``, ``$LGT_CONTROL_TOKEN`` or the store's secret). ``port``: where
        agents reach it (0: the port its ``GET /state`` says it listens on)."""
        client = cls(store=store, port=port, api=ControlClient(control_url, resolve_token(token, store)))
        state = client.state()
        if not port:
            client.port = int((state.get("listen") or {}).get("port") or 0)
            if not client.port:
                raise ProxyError(f"the proxy at {control_url} does not say which port agents use: give "
                                 "proxy.port")
        return client

    def stop(self, timeout: float = 20) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        children.stop(self.proc, timeout, group=False)  # one process, in the trainer's group

    # --- a rollout's way in ---------------------------------------------------------------------
    def rollout_env(self, rollout_id: str, attempt: int = 0, proxy_mode: str = "https_proxy", *,
                    greedy: bool = False, host: str | None = None) -> dict[str, str]:
        """The proxy variables of one rollout attempt (``base_url`` mode: no ``HTTP(S)_PROXY``, and
        ``LGT_REWARD_URL`` is the reverse-mode reward path). With ``HTTPS_PROXY`` every HTTPS
        connection goes through the proxy, so the CA variables name the proxy's CA alone (loading
        the system bundle costs a short-lived agent ~50 ms); ``base_url`` mode keeps the system CAs
        for the agent's other connections. ``host``: where this agent reaches the proxy, if not at
        ``self.host``. ProxyControlError when the proxy's CA is not in the store yet (lgt-proxy
        creates it when it starts)."""
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

    # --- control API -----------------------------------------------------------------------------
    def pause(self, timeout: float = 120) -> dict[str, Any]:
        """Hold new calls and wait until in-flight ones finish: ``drain_seconds``, ``in_flight_at_pause``.
        Calls still running after ``timeout`` s do not make it fail: the state comes back with
        ``drained`` false (the proxy stays paused; ``oldest_in_flight`` names the call waited for)."""
        from lgt.proxy.client import ControlError

        self.check_alive()
        try:
            return self.api.pause(timeout)
        except ControlError as e:
            if e.status == 504 and isinstance(e.body, dict) and e.body.get("paused"):
                return {**e.body, "drained": False}
            raise

    def resume(self, policy_version: int, served_model: str | None = None,
               served: dict[str, str | None] | None = None) -> dict[str, Any]:
        """Release held calls at ``policy_version``; with ``served_model``, they go to that model of the
        engine from now on (the version's LoRA adapter). A restart of this proxy keeps it. ``served``:
        each named policy's model (its adapter), changed before the held calls go on."""
        self.check_alive()
        out = self.api.resume(policy_version, served_model, served)
        if served_model is not None and self.argv is not None and "--served-model" in self.argv:
            self.argv[self.argv.index("--served-model") + 1] = served_model
        return out

    def flush(self) -> dict[str, Any]:
        self.check_alive()
        return self.api.flush()

    def state(self) -> dict[str, Any]:
        self.check_alive()
        return self.api.state()

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise ProxyError(f"lgt-proxy exited with code {self.proc.returncode}; its log "
                             f"({self.log_path}):\n{children.log_tail(self.log_path, 15)}")


class ProxyGroup:
    """Several proxy replicas on one store, driven as one: pause holds new calls on every replica and
    returns once all have drained; resume, flush and state act on each (state summed). A replica that
    does not answer is named (ProxyError). Each replica writes its own files in the store, so none
    needs the others; one restarted on the store recovers its write-ahead log."""

    def __init__(self, replicas: list[ProxyClient]) -> None:
        if not replicas:
            raise ValueError("a proxy group needs at least one replica")
        self.replicas = replicas

    def _each(self, fn: Any, *args: Any) -> list[Any]:
        from concurrent.futures import ThreadPoolExecutor

        from lgt.proxy.client import ControlError

        def call(r: ProxyClient) -> Any:
            try:
                return fn(r, *args)
            except (ControlError, OSError) as e:
                raise ProxyError(f"proxy replica {r.control_url} did not answer: {e}") from None

        if len(self.replicas) == 1:
            return [call(self.replicas[0])]
        with ThreadPoolExecutor(len(self.replicas)) as pool:
            return list(pool.map(call, self.replicas))

    def pause(self, timeout: float = 120) -> dict[str, Any]:
        out = self._each(ProxyClient.pause, timeout)
        return {"drained": all(o.get("drained", True) for o in out),
                "in_flight": sum(o.get("in_flight", 0) for o in out),
                "oldest_in_flight": max((o["oldest_in_flight"] for o in out if o.get("oldest_in_flight")),
                                        key=lambda c: c.get("seconds", 0), default=None),
                "drain_seconds": max(o.get("drain_seconds", 0.0) for o in out),
                "in_flight_at_pause": sum(o.get("in_flight_at_pause", 0) for o in out), "replicas": out}

    def resume(self, policy_version: int, served_model: str | None = None,
               served: dict[str, str | None] | None = None) -> dict[str, Any]:
        return {"replicas": self._each(ProxyClient.resume, policy_version, served_model, served)}

    def check_served(self, name: str) -> None:
        """ProxyError unless every replica rewrites calls to ``name``, the model the engine serves
        (``engine.served_model_name``), or to one of its adapters (``<name>-v<version>``, which the
        run's resume replaces): another name would have every routed call refused."""
        for r, state in zip(self.replicas, self._each(ProxyClient.state)):
            served = state.get("served_model")
            if served != name and not (isinstance(served, str) and served.startswith(f"{name}-v")):
                raise ProxyError(f"the proxy at {r.control_url} sends calls to model "
                                 f"{state.get('served_model')!r}, but the engine serves {name!r} "
                                 "(engine.served_model_name): start it with --served-model "
                                 f"{name}, or set engine.served_model_name to its name")

    def flush(self) -> dict[str, Any]:
        out = self._each(ProxyClient.flush)
        return {"rows_written": sum(o.get("rows_written", 0) for o in out), "replicas": out}

    def state(self) -> dict[str, Any]:
        """Every replica's ``GET /state``, numbers and counts summed (``paused``: all are)."""
        out = self._each(ProxyClient.state)
        sums: dict[str, Any] = {}
        for o in out:
            for k, v in o.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    sums[k] = sums.get(k, 0) + v
                elif isinstance(v, dict) and v and all(isinstance(x, (int, float)) for x in v.values()):
                    acc = sums.setdefault(k, {})
                    for kk, vv in v.items():
                        acc[kk] = acc.get(kk, 0) + vv
        return {**sums, "replicas": len(out), "paused": all(o.get("paused") for o in out),
                "policy_version": min(o.get("policy_version", 0) for o in out), "each": out}

    def check_alive(self) -> None:
        for r in self.replicas:
            r.check_alive()

    def restart_dead(self, policy_version: int, served_model: str | None = None) -> list[str]:
        """Start again every replica this process started that has exited; their control URLs."""
        dead = [r for r in self.replicas if r.died]
        for r in dead:
            r.restart(policy_version, served_model=served_model)
        return [r.control_url for r in dead]

    def stop(self) -> None:
        for r in self.replicas:
            r.stop()
