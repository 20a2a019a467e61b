"""Run lgt-proxy: mitmproxy embedded with lgt's addons, plus the control API, on one asyncio loop."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import re
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from lgt.store.writer import TableWriter

from . import auth, policies
from .addons import (
    Answers,
    Capture,
    Deadlines,
    Egress,
    Hold,
    Identify,
    Record,
    Rewards,
    Route,
    Runtime,
    Substitute,
    Translate,
)
from .addons.egress import EGRESS_MODES
from .addons.route import parse_resolve
from .codex import CodexModels
from .continuation import Relay
from .control import make_app
from .gate import CONTINUE, DRAIN, HOLD, ON_UPDATE, REJECT, Gate
from .resend import Resender
from .tool_parsers import PARSERS
from .wsbridge import Bridge, ResponsesSocket

log = logging.getLogger("lgt.proxy")

CAPTURE_MODES = ("auto", "on", "off")


class ConfigError(ValueError):
    """A setting a user gave that cannot work; the message names it."""


@dataclass(frozen=True)
class ProxyConfig:
    store: Path
    upstream: str | None = None
    served_model: str | None = None
    policies: Path | None = None  # a JSON file: the run's policies, [{name, match, served}] (policies.py)
    upstream_api_key: str | None = None
    upstream_ca: Path | None = None
    upstream_insecure: bool = False
    upstream_timeout: float | None = None  # seconds of upstream silence before a call is ended
    max_output_tokens: int = 0  # with an upstream: the most tokens a reply may generate (0: no cap)
    hosted_models: tuple[str, ...] = ()  # with an upstream: models whose calls go where the agent aimed
    resolve: tuple[str, ...] = ()  # HOST:PORT=ADDR:PORT, as curl's --resolve
    idle_timeout: int = 600  # seconds a connection may move no byte before it closes (tcp_timeout)
    remote: Any = None  # lgt.store.remote.RemoteStore: the store is on S3, ``store`` its local mirror
    listen_host: str = "127.0.0.1"
    listen_port: int = 8080
    reverse_port: int | None = None
    control_host: str = "127.0.0.1"
    control_port: int = 8081
    secret_file: Path | None = None
    confdir: Path | None = None
    pause_mode: str = HOLD
    on_update: str = DRAIN  # at a pause: drain the calls in flight, or stop and continue them
    tool_parser: str | None = None  # the engine's tool call parser: calls offering tools continued too
    retry_after_s: int = 5
    egress: str = "allow"
    allow_hosts: tuple[str, ...] = ()
    capture_tokens: str = "auto"
    max_body_mb: float = 32
    policy_version: int = 0
    flush_seconds: float = 1.0
    fsync: bool = False

    def checked(self) -> ProxyConfig:
        if self.upstream is not None:
            u = urlsplit(self.upstream)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise ConfigError(f"--upstream {self.upstream!r} is not an http(s) URL")
        if self.pause_mode not in (HOLD, REJECT):
            raise ConfigError(f"--pause-mode must be hold or reject, not {self.pause_mode!r}")
        if self.on_update not in ON_UPDATE:
            raise ConfigError(f"--on-update must be drain or continue, not {self.on_update!r}")
        if self.on_update == CONTINUE and (self.upstream is None or self.capture_tokens == "off"):
            raise ConfigError("--on-update continue needs --upstream and token capture (it continues a "
                              "call from its token ids): drop --capture-tokens off or use drain")
        if self.tool_parser is not None and self.tool_parser not in PARSERS:
            raise ConfigError(f"--tool-parser must be one of {', '.join(sorted(PARSERS))}, "
                              f"not {self.tool_parser!r}")
        if self.egress not in EGRESS_MODES:
            raise ConfigError(f"--egress must be one of {', '.join(EGRESS_MODES)}, not {self.egress!r}")
        if self.egress == "allowlist" and not self.allow_hosts:
            raise ConfigError("--egress allowlist needs at least one --allow-host")
        if self.capture_tokens not in CAPTURE_MODES:
            raise ConfigError(f"--capture-tokens must be auto, on or off, not {self.capture_tokens!r}")
        if self.hosted_models and self.upstream is None:
            raise ConfigError("--hosted-model needs --upstream (without one, every LLM call already goes "
                              "where the agent sent it)")
        if self.max_output_tokens < 0:
            raise ConfigError(f"--max-output-tokens must be 0 (no cap) or more, not {self.max_output_tokens}")
        if self.max_output_tokens and self.upstream is None:
            raise ConfigError("--max-output-tokens needs --upstream (it caps the engine's replies; without "
                              "one, every LLM call goes to the hosted model as the agent sent it)")
        try:
            parse_resolve(list(self.resolve))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.reverse_port is not None and self.upstream is None:
            raise ConfigError("--reverse-port needs --upstream (reverse mode forwards to it)")
        loopback = self.control_host in ("127.0.0.1", "::1", "localhost")
        if not loopback and not os.environ.get(auth.CONTROL_TOKEN_ENV):
            raise ConfigError(f"--control-host {self.control_host} opens the control API beyond this "
                              f"machine: give it its own token in ${auth.CONTROL_TOKEN_ENV}")
        if self.upstream_timeout is not None and not self.upstream_timeout > 0:
            raise ConfigError(f"--upstream-timeout must be a positive number of seconds, "
                              f"not {self.upstream_timeout}")
        if not self.idle_timeout > 0:
            raise ConfigError(f"--idle-timeout must be a positive number of seconds, not {self.idle_timeout}")
        if self.upstream_ca is not None and not Path(self.upstream_ca).is_file():
            raise ConfigError(f"--upstream-ca {self.upstream_ca} is not a file")
        if any(p.upstream for p in self.read_policies().policies) and self.upstream is None:
            raise ConfigError("--policies: a policy's upstream needs --upstream (without one, every LLM "
                              "call goes where the agent sent it)")
        ports = [p for p in (self.listen_port, self.control_port, self.reverse_port) if p]
        if len(set(ports)) != len(ports):
            raise ConfigError("--listen-port, --control-port and --reverse-port must differ")
        return self

    def read_policies(self) -> policies.Policies:
        """The policies of ``--policies`` (one, ``default``, without it); ConfigError names what is wrong."""
        if self.policies is None:
            return policies.Policies()
        try:
            spec = json.loads(Path(self.policies).read_text())
        except OSError as e:
            raise ConfigError(f"--policies {self.policies}: {e.strerror}") from None
        except ValueError as e:
            raise ConfigError(f"--policies {self.policies} is not valid JSON ({e})") from None
        try:
            return policies.parse(spec)
        except policies.PolicyError as e:
            raise ConfigError(f"--policies {self.policies}: {e}") from None

    @property
    def proxy_dir(self) -> Path:
        return Path(self.confdir) if self.confdir else auth.proxy_dir(self.store)


class RedactFilter(logging.Filter):
    """Keeps secrets out of every log line: reverse-path tokens and the given literal values."""

    PATH_TOKEN = re.compile(r"(/r/[^/\s]+/)[^/\s?]+")

    def __init__(self, secrets: list[str]) -> None:
        super().__init__()
        self.secrets = [s for s in secrets if s]

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        clean = self.PATH_TOKEN.sub(r"\1***", msg)
        for s in self.secrets:
            clean = clean.replace(s, "***")
        if clean != msg:
            record.msg, record.args = clean, None
        return True


def setup_logging(level: str, secrets: list[str]) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    handler.addFilter(RedactFilter(secrets))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("lgt").setLevel(level)


def _recover_seqs(store: Path) -> dict[tuple[str, int], int]:
    """Highest seq per (rollout, attempt) already in the store, so a restarted proxy continues."""
    if not any((store / "calls").glob("*.parquet")):
        return {}
    from lgt.store.query import connect

    con = connect(store)
    rows = con.execute("SELECT rollout_id, attempt, max(seq) FROM calls GROUP BY ALL").fetchall()
    return {(r, a): s for r, a, s in rows}


def lean_master(opts):
    """A mitmproxy Master with only the addons a recording proxy needs.

    mitmdump's ~30 default addons (playback, map local/remote, sticky cookies, HAR export…) are each
    visited on every hook of every flow; this proxy uses none of them, and dropping them is most of
    why it runs close to a bare mitmdump while doing much more per call.
    """
    from mitmproxy.addons import core, disable_h2c, next_layer, proxyserver, tlsconfig
    from mitmproxy.master import Master

    master = Master(opts, with_termlog=False)
    master.addons.add(core.Core(), disable_h2c.DisableH2C(), proxyserver.Proxyserver(),
                      next_layer.NextLayer(), tlsconfig.TlsConfig())
    return master


class LLMCalls:
    """The addons of the LLM API the proxy serves, as one entry of mitmproxy's addon chain: what it
    answers itself, then a call read, held, substituted, routed, timed, captured and recorded.

    Each part loads and configures its own options and has its hooks run in this order, as if it stood
    in the chain itself; but they are not mitmproxy sub-addons. mitmproxy looks up every event of every
    connection and flow on every addon and sub-addon it holds (some twenty events a call), which
    measured ~0.15 ms of the proxy's CPU per call for these eight; here each hook calls the parts that
    have it from a list made once.
    """

    HOOKS = ("load", "configure", "requestheaders", "request", "responseheaders", "response", "error",
             "server_connect")

    def __init__(self, rt: Runtime) -> None:
        self.parts = [Answers(rt), Translate(rt), Hold(rt), Substitute(rt), Route(rt), Deadlines(),
                      Capture(rt), Record(rt)]
        self._hooks = {name: [fn for part in self.parts if (fn := getattr(part, name, None)) is not None]
                       for name in self.HOOKS}

    def load(self, loader: Any) -> None:
        for fn in self._hooks["load"]:
            fn(loader)

    def configure(self, updated: set[str]) -> None:
        for fn in self._hooks["configure"]:
            fn(updated)

    async def _run(self, name: str, flow: Any) -> None:
        for fn in self._hooks[name]:
            if (res := fn(flow)) is not None and inspect.isawaitable(res):
                await res

    async def requestheaders(self, flow: Any) -> None:
        await self._run("requestheaders", flow)

    async def request(self, flow: Any) -> None:
        await self._run("request", flow)

    async def responseheaders(self, flow: Any) -> None:
        await self._run("responseheaders", flow)

    async def response(self, flow: Any) -> None:
        await self._run("response", flow)

    async def error(self, flow: Any) -> None:
        await self._run("error", flow)

    def server_connect(self, data: Any) -> None:  # Route's --resolve
        for fn in self._hooks["server_connect"]:
            fn(data)


def addons(rt: Runtime, bridge_port: int) -> list[Any]:
    """lgt's addons in the order their hooks run (see ``addons/__init__.py``): who is calling; the
    rewards and Codex endpoints; LLM calls; the WebSocket bridge; and last the egress policy for
    everything no addon before took."""
    return [Identify(rt), Rewards(rt), CodexModels(rt), LLMCalls(rt), ResponsesSocket(rt, bridge_port),
            Egress(rt)]


def _check_free(host: str, port: int, flag: str) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"{flag}: cannot listen on {host}:{port}: {e.strerror}") from None


def _upstream_ca_bundle(cfg: ProxyConfig) -> str | None:
    if cfg.upstream_ca is None:
        return None
    return str(auth.system_bundle_with(cfg.upstream_ca, cfg.proxy_dir / "upstream-ca-bundle.pem"))


async def serve(cfg: ProxyConfig, *, log_level: str = "INFO") -> None:
    """Run until cancelled or SIGINT/SIGTERM; the store is flushed on the way out.

    What is started is stopped by one exit stack, in the reverse order of its start: the proxy, the
    control API, the WebSocket bridge, the upstream client, the store's writers — whether the proxy ran
    and was stopped or failed while starting."""
    from mitmproxy import options

    cfg = cfg.checked()
    _check_ports(cfg)
    store = _open_store(Path(cfg.store))
    secret = auth.load_secret(store, cfg.secret_file)
    ctl_token = auth.control_token(secret)
    setup_logging(log_level, [secret.decode(), ctl_token, cfg.upstream_api_key or ""])
    auth.ca_bundle(cfg.proxy_dir)  # the CA and the bundle rollouts point at
    upload = await _remote_upload(cfg)

    async with contextlib.AsyncExitStack() as stack:
        writers = _open_writers(cfg, store, upload)
        stack.callback(_close_writers, writers)
        rt = _runtime(cfg, store, secret, writers)
        stack.push_async_callback(rt.resender.close)
        master = lean_master(options.Options())
        bridge = Bridge(rt)  # the Responses API over WebSocket, relayed to a loopback server (wsbridge.py)
        await bridge.start()
        stack.push_async_callback(bridge.stop)
        if cfg.on_update == CONTINUE:  # calls stopped at an update and continued (continuation.py)
            rt.relay = Relay(rt, cfg.tool_parser)
            await rt.relay.start()
            stack.push_async_callback(rt.relay.stop)
        master.addons.add(*addons(rt, bridge.port))
        master.options.update(**mitmproxy_options(cfg, rt))
        control = web.AppRunner(make_app(rt, ctl_token), access_log=None)
        await control.setup()
        stack.push_async_callback(control.cleanup)
        await _listen_control(control, cfg)
        _shutdown_on_signals(master)
        run = asyncio.create_task(master.run())
        stack.push_async_callback(_stop_master, master, run)
        await _wait_listening(master, run)
        log.info(
            "lgt-proxy listening on %s:%d (control %s:%d), upstream %s, store %s",
            cfg.listen_host, cfg.listen_port, cfg.control_host, cfg.control_port,
            rt.upstream or "none (observe-only)", cfg.remote.url if cfg.remote else store,
        )
        await run


def _check_ports(cfg: ProxyConfig) -> None:
    _check_free(cfg.listen_host, cfg.listen_port, "--listen-port")
    if cfg.reverse_port:
        _check_free(cfg.listen_host, cfg.reverse_port, "--reverse-port")
    _check_free(cfg.control_host, cfg.control_port, "--control-port")


def _open_store(store: Path) -> Path:
    """``store`` made a store, or brought up to date if it is an older one."""
    from lgt.store.migrations import StoreVersionError, migrate

    store.mkdir(parents=True, exist_ok=True)
    try:
        migrate(store)
    except StoreVersionError as e:
        raise ConfigError(str(e)) from None
    return store


async def _remote_upload(cfg: ProxyConfig) -> Callable[[Path], None] | None:
    """With the store on S3, what uploads each whole Parquet file as it is made (anything left over,
    and the migration record, uploaded first); None otherwise."""
    if cfg.remote is None:
        return None
    try:
        await asyncio.to_thread(cfg.remote.push_all)
    except OSError as e:
        raise ConfigError(f"--store {cfg.remote.url}: {e}") from None
    return cfg.remote.push


def _open_writers(cfg: ProxyConfig, store: Path, upload: Callable[[Path], None] | None) -> list[TableWriter]:
    """The writers of the calls, rewards and egress tables, in one session."""
    writer = TableWriter(store, "calls", flush_seconds=cfg.flush_seconds, fsync=cfg.fsync,
                         on_file=upload).open()
    rewards = TableWriter(store, "rewards", flush_seconds=cfg.flush_seconds, fsync=cfg.fsync,
                          session=writer.session, on_file=upload).open()
    egress_log = TableWriter(store, "egress", flush_seconds=cfg.flush_seconds, fsync=cfg.fsync,
                             session=writer.session, on_file=upload).open()
    return [writer, rewards, egress_log]


def _close_writers(writers: list[TableWriter]) -> None:
    for w in writers:
        w.close()


def _runtime(cfg: ProxyConfig, store: Path, secret: bytes, writers: list[TableWriter]) -> Runtime:
    writer, rewards, egress_log = writers
    return Runtime(
        secret=secret,
        writer=writer,
        rewards=rewards,
        egress_log=egress_log,
        resender=Resender(ca_bundle=_upstream_ca_bundle(cfg), insecure=cfg.upstream_insecure,
                          read_timeout_s=cfg.upstream_timeout),
        listen=(cfg.listen_host, cfg.listen_port),
        remote=cfg.remote,
        gate=Gate(cfg.pause_mode, cfg.policy_version, cfg.on_update),
        upstream=cfg.upstream.rstrip("/") if cfg.upstream else None,
        served_model=cfg.served_model,
        policies=cfg.read_policies(),
        upstream_api_key=cfg.upstream_api_key,
        max_body_bytes=int(cfg.max_body_mb * (1 << 20)),
        seqs=_recover_seqs(store),
    )


def mitmproxy_options(cfg: ProxyConfig, rt: Runtime) -> dict[str, Any]:
    """The options lgt-proxy runs mitmproxy with: its addons' (``lgt_*``) and mitmproxy's own."""
    modes = [f"regular@{cfg.listen_host}:{cfg.listen_port}"]
    if cfg.reverse_port:
        up = urlsplit(rt.upstream)  # mitmproxy takes scheme://host:port; Route adds the path
        modes.append(f"reverse:{up.scheme}://{up.netloc}@{cfg.listen_host}:{cfg.reverse_port}")
    capture = cfg.capture_tokens == "on" or (cfg.capture_tokens == "auto" and cfg.upstream is not None)
    opts = dict(
        lgt_capture_tokens=capture,
        lgt_retry_after=cfg.retry_after_s,
        lgt_upstream_timeout=cfg.upstream_timeout,
        lgt_max_output_tokens=cfg.max_output_tokens,
        lgt_egress=cfg.egress,
        lgt_allow_hosts=list(cfg.allow_hosts),
        mode=modes,
        confdir=str(cfg.proxy_dir),
        connection_strategy="lazy",  # never contact the host an agent aimed at before routing
        tcp_timeout=cfg.idle_timeout,  # a stalled client (slow body, unread answer) is let go
        ssl_insecure=cfg.upstream_insecure,
        lgt_hosted_models=list(cfg.hosted_models),
        lgt_resolve=list(cfg.resolve),
    )
    if rt.resender.ca_bundle:
        opts["ssl_verify_upstream_trusted_ca"] = rt.resender.ca_bundle
    return opts


async def _listen_control(runner: web.AppRunner, cfg: ProxyConfig) -> None:
    try:
        await web.TCPSite(runner, cfg.control_host, cfg.control_port).start()
    except OSError as e:
        raise ConfigError(f"cannot listen on control port {cfg.control_host}:{cfg.control_port}: "
                          f"{e.strerror}") from None


def _shutdown_on_signals(master) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, master.shutdown)
        except (NotImplementedError, RuntimeError):
            pass


async def _stop_master(master, run: asyncio.Task) -> None:
    if not run.done():
        master.shutdown()
        await asyncio.gather(run, return_exceptions=True)


async def _wait_listening(master, run: asyncio.Task) -> None:
    ps = master.addons.get("proxyserver")
    for _ in range(500):
        if run.done():
            await run
            raise ConfigError("the proxy stopped while starting")
        if ps.servers and all(s.is_running for s in ps.servers):
            return
        await asyncio.sleep(0.01)
    raise ConfigError("the proxy did not start listening within 5 s")
