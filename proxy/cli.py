"""``lgt-proxy``: run the recording proxy, print a rollout's credentials, talk to the control API.

    lgt-proxy --store DIR [--upstream URL --served-model NAME] ...   (same as ``lgt-proxy run``)
    eval "$(lgt-proxy creds ROLLOUT_ID --store DIR --listen-port 8080)"
    lgt-proxy ctl state|pause|resume|metrics|flush --store DIR --control-port 8081
"""

from __future__ import annotations

import asyncio
import json
import shlex
from pathlib import Path

import click

from . import auth
from .client import ControlClient, ControlError, resolve_token
from .server import CAPTURE_MODES, EGRESS_MODES, ConfigError, ProxyConfig, serve
from .tool_parsers import PARSERS


class DefaultGroup(click.Group):
    """A group whose first argument, when it is not a command name, goes to ``run``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


@click.group(cls=DefaultGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """lgt's recording proxy: wraps any agent with HTTPS_PROXY= (or base_url=) and records every
    model call, token by token, into a Parquet store.

    `lgt-proxy --store DIR ...` runs the proxy (see `lgt-proxy run --help` for its options).
    """


def _store(ctx: click.Context, param: click.Parameter, value: str) -> Path:
    """A folder, or ``s3://bucket/prefix``: then its local mirror, the remote kept for ``run``."""
    from lgt.store.remote import resolve

    try:
        local, remote = resolve(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    ctx.meta["lgt_remote"] = remote
    return local


store_option = click.option(
    "--store", required=True, callback=_store,
    help="Store directory (Parquet files; the proxy's secret and CA live in its _proxy/), or "
         "s3://bucket/prefix (whole Parquet files uploaded there; see docs/proxy.md).",
)
secret_option = click.option(
    "--secret-file", type=click.Path(dir_okay=False, path_type=Path),
    help="HMAC secret file (default: <store>/_proxy/secret; $LGT_PROXY_SECRET wins).",
)


@main.command()
@store_option
@click.option("--upstream", help="OpenAI-compatible base URL LLM calls are routed to, e.g. "
              "http://127.0.0.1:8000/v1. Without it: observe-only (calls go where the agent sent them).")
@click.option("--served-model", help="Model name the upstream serves; requests' `model` is rewritten to it.")
@click.option("--policies", type=click.Path(dir_okay=False, path_type=Path),
              help="A JSON file naming the run's policies, [{name, match, served}, ...]: each call goes to "
                   "the first policy whose rule it matches (else the first) and upstream as that policy's "
                   "served model (see docs/policies.md).")
@click.option("--max-output-tokens", default=0, show_default=True, type=click.IntRange(min=0),
              help="With --upstream: the most tokens one reply may generate. A larger output limit is "
                   "lowered to it and a call without one gets it; the call's record says so (0: none).")
@click.option("--upstream-api-key", envvar="LGT_UPSTREAM_API_KEY",
              help="Bearer key for the upstream (agents' own keys are never forwarded to it).")
@click.option("--hosted-model", "hosted_models", multiple=True, metavar="GLOB",
              help="With --upstream: calls whose requested model matches (e.g. 'claude-*'; repeatable) go "
                   "where the agent sent them, unchanged, and are recorded as a hosted model's.")
@click.option("--upstream-ca", type=click.Path(dir_okay=False, path_type=Path),
              help="Extra CA file trusted for an https upstream (and for the hosts calls go to as sent).")
@click.option("--resolve", multiple=True, metavar="HOST:PORT=ADDR:PORT",
              help="Connect to ADDR:PORT whenever HOST:PORT is asked for (as curl's; the TLS name is still "
                   "HOST); repeatable. For private gateways, and for tests.")
@click.option("--upstream-insecure", is_flag=True, help="Do not verify upstream TLS certificates.")
@click.option("--upstream-timeout", type=float,
              help="Seconds an LLM call's upstream may stay silent (before its answer begins, or between "
                   "two pieces of a stream); past it the call is ended (504, or an error event in a "
                   "stream) and recorded as upstream_timeout. Default: no limit.")
@click.option("--idle-timeout", default=600, show_default=True, type=int,
              help="Seconds a connection (an agent's, or one to the upstream) may move no byte before it is "
                   "closed: an agent that stops sending its request or stops reading its answer lets go of "
                   "what it holds. A non-streamed answer the upstream takes longer than this to begin is cut "
                   "too; raise it for very long generations.")
@click.option("--listen-host", default="127.0.0.1", show_default=True)
@click.option("--listen-port", default=8080, show_default=True, type=int)
@click.option("--reverse-port", type=int, help="Also run mitmproxy's reverse mode on this port.")
@click.option("--control-host", default="127.0.0.1", show_default=True)
@click.option("--control-port", default=8081, show_default=True, type=int)
@secret_option
@click.option("--pause-mode", type=click.Choice(["hold", "reject"]), default="hold", show_default=True,
              help="While paused: hold new calls open, or answer 429 + Retry-After.")
@click.option("--on-update", type=click.Choice(["drain", "continue"]), default="drain", show_default=True,
              help="At a pause: wait for the calls in flight (drain), or stop them where they are and "
                   "continue each on the new weights after the resume (continue; docs/proxy.md).")
@click.option("--tool-parser", type=click.Choice(sorted(PARSERS)), default=None,
              help="The engine's --tool-call-parser: with --on-update continue, calls that offer tools "
                   "are continued too, their tool calls read by the proxy (docs/proxy.md); else drained.")
@click.option("--retry-after", default=5, show_default=True, type=int, help="Seconds, reject mode.")
@click.option("--egress", type=click.Choice(EGRESS_MODES), default="allow", show_default=True,
              help="Policy for traffic that is not an LLM call.")
@click.option("--allow-host", multiple=True, help="Host allowed under --egress allowlist "
              "(repeatable; '.example.org' allows subdomains).")
@click.option("--capture-tokens", type=click.Choice(CAPTURE_MODES), default="auto", show_default=True,
              help="Ask the upstream for token ids and logprobs (auto: when --upstream is set).")
@click.option("--max-body-mb", default=32.0, show_default=True, type=float)
@click.option("--policy-version", default=0, show_default=True, type=int)
@click.option("--flush-seconds", default=1.0, show_default=True, type=float,
              help="How often recorded calls are turned into Parquet files.")
@click.option("--fsync", is_flag=True, help="fsync every record (survives a machine crash too).")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]))
@click.pass_context
def run(ctx: click.Context, log_level: str, allow_host: tuple[str, ...], retry_after: int, **kw) -> None:
    """Run the proxy (the default command)."""
    cfg = ProxyConfig(allow_hosts=allow_host, retry_after_s=retry_after, remote=ctx.meta.get("lgt_remote"),
                      **kw)
    try:
        asyncio.run(serve(cfg, log_level=log_level))
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    except KeyboardInterrupt:
        pass


@main.command()
@click.argument("rollout_id")
@store_option
@click.option("--attempt", default=0, show_default=True, type=int)
@click.option("--listen-host", "host", default="127.0.0.1", show_default=True)
@click.option("--listen-port", "port", default=8080, show_default=True, type=int)
@secret_option
@click.option("--format", "fmt", type=click.Choice(["sh", "json"]), default="sh", show_default=True)
@click.option("--greedy", is_flag=True, help="The proxy decodes this rollout's calls greedily (evaluation).")
def creds(rollout_id: str, store: Path, attempt: int, host: str, port: int,
          secret_file: Path | None, fmt: str, greedy: bool) -> None:
    """Print the environment that sends one rollout through the proxy (eval it in a shell)."""
    try:
        env = auth.rollout_env(store, rollout_id, attempt=attempt, host=host, port=port,
                               secret_file=secret_file, greedy=greedy)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if fmt == "json":
        click.echo(json.dumps(env, indent=2))
    else:
        for k, v in env.items():
            click.echo(f"export {k}={shlex.quote(v)}")


@main.command()
@click.argument("action", type=click.Choice(["state", "pause", "resume", "metrics", "flush"]))
@store_option
@click.option("--control-host", default="127.0.0.1", show_default=True)
@click.option("--control-port", default=8081, show_default=True, type=int)
@secret_option
@click.option("--policy-version", type=int, help="resume: the new policy version.")
@click.option("--served-model", default=None,
              help="resume: the upstream's model calls go to from now on (e.g. a LoRA adapter's name).")
@click.option("--timeout", default=60.0, show_default=True, type=float, help="pause: drain timeout.")
def ctl(action: str, store: Path, control_host: str, control_port: int, secret_file: Path | None,
        policy_version: int | None, served_model: str | None, timeout: float) -> None:
    """Call the running proxy's control API (token: $LGT_CONTROL_TOKEN, else from the store's secret)."""
    try:
        api = ControlClient(f"http://{control_host}:{control_port}", resolve_token(None, store, secret_file))
        calls = {"state": api.state, "metrics": api.metrics, "flush": api.flush,
                 "pause": lambda: api.pause(timeout),
                 "resume": lambda: api.resume(policy_version, served_model)}
        out = calls[action]()
    except (ControlError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(out.rstrip() if isinstance(out, str) else json.dumps(out))


if __name__ == "__main__":
    main()
