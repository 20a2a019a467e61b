"""What lgt-proxy adds to an LLM call: the same workload direct, through plain mitmdump (the floor)
and through lgt-proxy, in one run, over loopback HTTPS with an instant fake-vLLM upstream.

    .venv-proxy/bin/python bench/proxy_overhead.py                  # 2000 calls, 16 clients, 3 repeats
    .venv-proxy/bin/python bench/proxy_overhead.py --stream         # SSE responses
    .venv-proxy/bin/python bench/proxy_overhead.py --stream --chunk-delay-ms 20 --calls 200 \
        --concurrency 4    # a slow stream: time to first chunk vs the whole stream
    .venv-proxy/bin/python bench/proxy_overhead.py --calls 500 --repeat 1 --json > summary.json
    .venv-proxy/bin/python bench/proxy_overhead.py --api responses   # + the same calls as Responses
    .venv-proxy/bin/python bench/proxy_overhead.py --api messages --stream   # … as Anthropic Messages
    .venv-proxy/bin/python bench/proxy_overhead.py --stream --upstream-timeout 30   # with the proxy's clock

Processes: the fake upstream (``lgt.testing.fake_upstream`` over TLS, throw-away CA), the proxies,
and this script as the client load (aiohttp, ``--concurrency`` workers on one keep-alive pool, short
chat completions). The paths, in rotating order per repeat:

* ``direct``: https://127.0.0.1:<upstream>/v1, no proxy;
* ``mitmdump`` (the floor): mitmproxy's CLI with an empty addon (with ``--stream``, one that only
  turns on pass-through streaming of SSE, as lgt-proxy must stream), ``connection_strategy=lazy``
  and the upstream's CA trusted, as HTTPS proxy for the same URL;
* ``lgt-proxy --upstream https://127.0.0.1:<upstream>/v1``, the client aiming at
  https://api.bench.invalid/v1 with a rollout's credentials: every call is authenticated, routed,
  rewritten for token capture, and recorded;
* with ``--api responses|messages``, ``lgt-<api>``: the same question as an OpenAI Responses (or
  Anthropic Messages) call through the same lgt-proxy, which translates it to chat/completions and the
  answer (or stream) back: its cost per call next to chat/completions' (goal: within 1.2x).

A run: ``--warmup`` calls, ``--calls`` timed calls at full concurrency (proxy/upstream/client CPU
from /proc over these), ``--solo-calls`` from one client (latency without queueing); numbers are
medians over ``--repeat`` runs. Then lgt's store is flushed and must hold exactly one row per call
lgt-proxy served: exit status 1 if not, or if a call failed (missed goals only print MISS).
Profile the proxy under load with ``py-spy record --pid <lgt-proxy pid, printed at start>``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import shutil
import signal
import ssl
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from yarl import URL

from lgt.testing.processes import Procs, rss_mb
from lgt.testing.tls import make_certs
from lgt.trainer.serving.children import free_port

PY = sys.executable
GOAL_FLOOR_RATIO, GOAL_ADDED_P50_MS, GOAL_API_RATIO = 1.3, 3.0, 1.2
QUESTION = "What is 6 times 7? Be brief."
ROLLOUT = "bench-1"
NOOP_ADDON = "class Noop:\n    pass\n\n\naddons = [Noop()]\n"
SSE_ADDON = ("class PassSSE:  # mitmproxy buffers bodies by default; lgt-proxy must stream SSE\n"
             "    def responseheaders(self, flow):\n"
             "        flow.response.stream = 'text/event-stream' in "
             "flow.response.headers.get('content-type', '')\n\n\naddons = [PassSSE()]\n")
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime, all threads


@dataclass
class Target:
    name: str
    url: str  # .../v1/chat/completions
    cafile: str  # what the client trusts on this path
    proxy: str | None = None  # http://[user:token@]127.0.0.1:port
    pid: int | None = None  # the proxy's process
    served: int = 0  # calls sent through this path so far, warm-ups included
    api: str = "chat"  # chat | responses | messages: the request this path sends


def request_body(api: str, stream: bool) -> tuple[str, bytes]:
    """The same short question in ``api``'s request shape, and a marker of a complete answer."""
    if api == "responses":
        body = {"model": "bench-model", "max_output_tokens": 16, "stream": stream, "input": QUESTION}
        return json.dumps(body), b"response.completed" if stream else b'"output"'
    body = {"model": "bench-model", "max_tokens": 16, "stream": stream,  # chat and Messages alike
            "messages": [{"role": "user", "content": QUESTION}]}
    if api == "messages":
        return json.dumps(body), b"message_stop" if stream else b'"content"'
    return json.dumps(body), b"data: [DONE]" if stream else b'"choices"'


async def load(t: Target, args: argparse.Namespace, upstream_pid: int) -> dict:
    """One run: warm-up, ``calls`` at full concurrency (timed, CPU counted), ``solo_calls``."""
    body, done = request_body(t.api, args.stream)
    proxy = URL(t.proxy) if t.proxy else None
    proxy_headers = {}  # credentials go on the CONNECT, as with HTTPS_PROXY=http://user:token@...
    if proxy and proxy.user:
        basic = base64.b64encode(f"{proxy.user}:{proxy.password}".encode()).decode()
        proxy_headers, proxy = {"Proxy-Authorization": f"Basic {basic}"}, proxy.with_user(None)
    conns = [0]

    async def count_connection(*_) -> None:
        conns[0] += 1
    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(count_connection)
    connector = aiohttp.TCPConnector(limit=args.concurrency,
                                     ssl=ssl.create_default_context(cafile=t.cafile))
    async with aiohttp.ClientSession(connector=connector, trace_configs=[trace],
                                     headers={"content-type": "application/json"}) as session:
        async def phase(n: int, workers: int) -> tuple[list[float], list[float], int]:
            left, lat, first, errors = [n], [], [], [0]

            async def worker() -> None:
                while left[0] > 0:
                    left[0] -= 1
                    t0 = time.perf_counter()
                    try:
                        async with session.post(t.url, data=body, proxy=proxy,
                                                proxy_headers=proxy_headers) as r:
                            data = await r.content.readany()  # the first chunk of the body
                            first.append(time.perf_counter() - t0)
                            data += await r.read()
                        ok = r.status == 200 and done in data
                    except (TimeoutError, aiohttp.ClientError):
                        ok = False
                    lat.append(time.perf_counter() - t0)
                    errors[0] += not ok
            await asyncio.gather(*(worker() for _ in range(workers)))
            t.served += n
            return sorted(lat), first, errors[0]

        await phase(args.warmup, args.concurrency)
        pids = [t.pid or os.getpid(), upstream_pid, os.getpid()]
        cpu0, t0 = [cpu_s(p) for p in pids], time.perf_counter()
        lat, _, errors = await phase(args.calls, args.concurrency)
        wall, cpu = time.perf_counter() - t0, [cpu_s(p) for p in pids]
        solo, solo_first, solo_errors = await phase(args.solo_calls, 1)
    per_call = [(b - a) / args.calls * 1e3 for a, b in zip(cpu0, cpu, strict=True)]
    q = statistics.quantiles(lat, n=100, method="inclusive")
    return {"calls_s": args.calls / wall, "p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3,
            "solo_p50_ms": statistics.median(solo) * 1e3, "errors": errors + solo_errors,
            "solo_first_chunk_ms": statistics.median(solo_first) * 1e3,
            "connections": conns[0], "proxy_cpu_ms": per_call[0] if t.pid else None,
            "upstream_cpu_ms": per_call[1], "client_cpu_ms": per_call[2]}


def median_of(runs: list[dict]) -> dict:
    out = {k: statistics.median(r[k] for r in runs) for k, v in runs[0].items() if v is not None}
    out.update(errors=sum(r["errors"] for r in runs),
               connections=max(r["connections"] for r in runs))
    return out


def count_rows(store: Path, control_port: int) -> tuple[int, int]:
    """Flush lgt-proxy's store through the control API; (rows, ok rows) of the bench rollout."""
    from lgt.proxy.client import ControlClient, resolve_token
    from lgt.store.query import connect
    from lgt.store.schema import STATUS_OK

    ControlClient(f"http://127.0.0.1:{control_port}", resolve_token(store=store)).flush()
    rows, ok = connect(store).execute(
        "SELECT count(*), count(*) FILTER (WHERE status = ?) FROM calls WHERE rollout_id = ?",
        [STATUS_OK, ROLLOUT]).fetchone()
    return int(rows), int(ok)


def render(res: dict[str, dict], rss: dict[str, tuple[float, float]], args) -> list[str]:
    d, floor = res["direct"], res["mitmdump"]
    mode = "SSE stream" if args.stream else "non-streaming"
    lines = [
        (f"{args.calls} calls/run, {args.repeat} run(s) per path (medians), {args.concurrency} "
         f"clients, HTTPS, {mode}, {os.cpu_count()} CPUs"),
        (f"{'path':<14}{'calls/s':>8}{'p50 ms':>8}{'p99 ms':>8}{'+p50':>8}{'+p99':>8}"
         f"{'direct/x':>9}{'floor/x':>8} |{'1-client p50':>13}{'+p50':>7} |"
         f"{'CPU ms/call: proxy':>19}{'upstr':>6}{'client':>7} |{'proxy RSS MB':>13}"),
    ]
    for name, r in res.items():
        if name == "direct":
            add = dict.fromkeys(("p50_ms", "p99_ms", "solo_p50_ms"), "-")
            vs_floor = proxy_cpu = mem = "-"
        else:
            add = {k: f"{r[k] - d[k]:+.2f}" for k in ("p50_ms", "p99_ms", "solo_p50_ms")}
            vs_floor = f"{floor['calls_s'] / r['calls_s']:.2f}x"
            proxy_cpu, mem = f"{r['proxy_cpu_ms']:.2f}", "{:.0f} -> {:.0f}".format(*rss[name])
        lines.append(
            f"{name:<14}{r['calls_s']:>8.0f}{r['p50_ms']:>8.2f}{r['p99_ms']:>8.2f}"
            f"{add['p50_ms']:>8}{add['p99_ms']:>8}{d['calls_s'] / r['calls_s']:>8.2f}x"
            f"{vs_floor:>8} |"
            f"{r['solo_p50_ms']:>13.2f}{add['solo_p50_ms']:>7} |{proxy_cpu:>19}"
            f"{r['upstream_cpu_ms']:>6.2f}{r['client_cpu_ms']:>7.2f} |{mem:>13}")
    lines.append("+p50/+p99: added vs direct (ms); direct/x, floor/x: throughput of direct (of the "
                 "mitmdump floor) over this path's; CPU over the timed calls, per call")
    if args.stream:
        lines.append("time to first chunk, 1 client (median ms; whole stream in brackets): " + ", ".join(
            f"{n} {r['solo_first_chunk_ms']:.2f} ({r['solo_p50_ms']:.2f})" for n, r in res.items()))
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000, help="timed calls per path and run")
    ap.add_argument("--concurrency", type=int, default=16, help="concurrent clients")
    ap.add_argument("--stream", action="store_true", help="SSE streaming responses")
    ap.add_argument("--repeat", type=int, default=3, help="runs per path; medians are reported")
    ap.add_argument("--warmup", type=int, default=200, help="untimed calls before each run")
    ap.add_argument("--solo-calls", type=int, default=200, help="single-client calls per run")
    ap.add_argument("--json", action="store_true", help="JSON summary on stdout (table on stderr)")
    ap.add_argument("--api", choices=["responses", "messages"],
                    help="also send the calls as this API through lgt-proxy (translated to chat)")
    ap.add_argument("--upstream-timeout", type=float,
                    help="run lgt-proxy with --upstream-timeout (its per-call clock is then timed too)")
    ap.add_argument("--chunk-delay-ms", type=float, default=0.0,
                    help="upstream pause between stream chunks (shows time to first chunk)")
    args = ap.parse_args()
    out = sys.stderr if args.json else sys.stdout
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` cleans up

    from lgt.proxy.auth import ensure_ca, rollout_env

    tmp = Path(tempfile.mkdtemp(prefix="lgt-bench-"))
    procs = Procs(tmp)
    try:
        ca, cert, key = make_certs(tmp)
        up_port, mitm_port, lgt_port, ctl_port = (free_port() for _ in range(4))
        up_pid = procs.start("upstream", [
            PY, "-m", "lgt.testing.fake_upstream", "--port", str(up_port),
            "--tls-cert", str(cert), "--tls-key", str(key),
            "--chunk-delay-ms", str(args.chunk_delay_ms)], up_port)
        up_url = f"https://127.0.0.1:{up_port}/v1"

        confdir = tmp / "mitmdump"
        mitm_ca = ensure_ca(confdir)  # mitmproxy's own CertStore makes it, as mitmdump would
        (tmp / "floor_addon.py").write_text(SSE_ADDON if args.stream else NOOP_ADDON)
        mitm_pid = procs.start("mitmdump", [str(Path(PY).with_name("mitmdump")),
            "-q", "--listen-host", "127.0.0.1", "--listen-port", str(mitm_port),
            "-s", str(tmp / "floor_addon.py"), "--set", f"confdir={confdir}",
            "--set", "connection_strategy=lazy", "--set", f"ssl_verify_upstream_trusted_ca={ca}"],
            mitm_port)

        store = tmp / "store"
        env = rollout_env(store, ROLLOUT, port=lgt_port)  # creates the secret, CA and bundle
        lgt_pid = procs.start("lgt-proxy", [
            PY, "-m", "lgt.proxy.cli", "--store", str(store), "--upstream", up_url,
            "--upstream-ca", str(ca), "--served-model", "policy", "--listen-port", str(lgt_port),
            "--control-port", str(ctl_port), "--log-level", "WARNING",
            *(["--upstream-timeout", str(args.upstream_timeout)] if args.upstream_timeout else [])], lgt_port)
        print(f"pids: upstream {up_pid}, mitmdump {mitm_pid}, lgt-proxy {lgt_pid}; logs in {tmp}",
              file=out, flush=True)

        targets = [
            Target("direct", f"{up_url}/chat/completions", str(ca)),
            Target("mitmdump", f"{up_url}/chat/completions", str(mitm_ca),
                   f"http://127.0.0.1:{mitm_port}", mitm_pid),
            Target("lgt-proxy", "https://api.bench.invalid/v1/chat/completions",
                   env["SSL_CERT_FILE"], env["HTTPS_PROXY"], lgt_pid),
        ]
        if args.api:
            host = "api.anthropic.invalid" if args.api == "messages" else "api.bench.invalid"
            targets.append(Target(f"lgt-{args.api}", f"https://{host}/v1/{args.api}", env["SSL_CERT_FILE"],
                                  env["HTTPS_PROXY"], lgt_pid, api=args.api))
        rss0 = {t.name: rss_mb(t.pid) for t in targets if t.pid}
        runs: dict[str, list[dict]] = {t.name: [] for t in targets}
        for i in range(args.repeat):
            k = i % len(targets)
            for t in targets[k:] + targets[:k]:  # rotate: no path always goes first
                r = asyncio.run(load(t, args, up_pid))
                runs[t.name].append(r)
                print(f"  run {i + 1}/{args.repeat} {t.name:<14}{r['calls_s']:6.0f} calls/s  "
                      f"p50 {r['p50_ms']:6.2f}  p99 {r['p99_ms']:6.2f}  1-client p50 "
                      f"{r['solo_p50_ms']:5.2f} ms  connections {r['connections']}  "
                      f"errors {r['errors']}", file=out, flush=True)
        rss = {t.name: (rss0[t.name], rss_mb(t.pid)) for t in targets if t.pid}
        res = {name: median_of(rs) for name, rs in runs.items()}
        rows, ok_rows = count_rows(store, ctl_port)
        served = sum(t.served for t in targets if t.name.startswith("lgt"))

        print("", *render(res, rss, args), "", sep="\n", file=out)
        lgt, floor, direct = res["lgt-proxy"], res["mitmdump"], res["direct"]
        goals = {  # name: (lgt's value, the floor's, limit, text)
            "floor_ratio": (floor["calls_s"] / lgt["calls_s"], 1.0, GOAL_FLOOR_RATIO,
                            f"lgt throughput within {GOAL_FLOOR_RATIO}x of the floor's: {{:.2f}}x"),
            "added_p50_ms": (lgt["p50_ms"] - direct["p50_ms"], floor["p50_ms"] - direct["p50_ms"],
                             GOAL_ADDED_P50_MS, (f"lgt added p50 <= {GOAL_ADDED_P50_MS:g} ms, "
                                                 f"{args.concurrency} clients: {{:+.2f}} ms")),
            "added_solo_p50_ms": (lgt["solo_p50_ms"] - direct["solo_p50_ms"],
                                  floor["solo_p50_ms"] - direct["solo_p50_ms"], GOAL_ADDED_P50_MS,
                                  "the same, 1 client (no queueing): {:+.2f} ms"),
        }
        if args.api:
            api = res[f"lgt-{args.api}"]
            goals["api_cpu_ratio"] = (api["proxy_cpu_ms"] / lgt["proxy_cpu_ms"], 1.0, GOAL_API_RATIO,
                                      f"lgt's CPU per {args.api} call within {GOAL_API_RATIO}x of a "
                                      "chat/completions call's: {:.2f}x")
            goals["api_throughput_ratio"] = (lgt["calls_s"] / api["calls_s"], 1.0, GOAL_API_RATIO,
                                             f"{args.api} calls/s within {GOAL_API_RATIO}x of "
                                             "chat/completions': {:.2f}x")
        for v, fv, lim, text in goals.values():
            print(f"goal  {text.format(v)}  {'PASS' if v <= lim else 'MISS'}  "
                  f"(mitmdump: {text.rpartition(': ')[2].format(fv)})", file=out)
        errors = sum(r["errors"] for r in res.values())
        recorded = rows == served and ok_rows == served
        print(f"check lgt-proxy served {served} calls; its store has {rows} rows ({ok_rows} ok): "
              f"{'OK' if recorded else 'MISMATCH'}; failed calls: {errors}", file=out)
        if args.json:
            json.dump({"config": vars(args) | {"cpus": os.cpu_count()}, "paths": res,
                       "runs": runs, "rss_mb": rss,
                       "goals": {k: {"lgt": v, "mitmdump": fv, "limit": lim, "pass": v <= lim}
                                 for k, (v, fv, lim, _) in goals.items()},
                       "recorded": {"served": served, "rows": rows, "ok_rows": ok_rows,
                                    "ok": recorded},
                       "errors": errors}, sys.stdout, indent=2)
            print()
        return 0 if recorded and errors == 0 else 1
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the subprocesses are already stopped
        sys.exit(130)
