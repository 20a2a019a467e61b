"""Load held through pause/resume: many concurrent agents through one lgt-proxy while a driver pauses
and resumes it every few seconds, as the trainer does at each update. Nothing may be lost.

    .venv-proxy/bin/python bench/soak.py                         # 1,000 agents, 3 minutes
    .venv-proxy/bin/python bench/soak.py --agents 200 --minutes 1 --pause-every 2
    .venv-proxy/bin/python bench/soak.py --json > soak.json      # the figures as JSON (table on stderr)

Processes: the fake vLLM upstream (``lgt.testing.fake_upstream`` over TLS on loopback), lgt-proxy, and
this script: ``--agents`` agents (asyncio, each its own rollout credentials and its own connection
through the proxy, as separate agent processes would have) and the driver. Each agent loops: one chat
call (``--stream-share`` of them streamed; answers of 16, 64 or 256 tokens; ``--slow-share`` of them
wait a heavy-tailed time at the upstream first — Pareto(``--slow-shape``) × ``--slow-scale`` s, at
most ``--slow-cap`` s), then a short think time. The driver pauses (``POST /pause``: new calls are
held, the pause returns once none is in flight), holds the pause ``--pause-for`` seconds (the update),
and resumes with the next policy version, every ``--pause-every`` seconds.

Printed: calls answered, calls recorded in the store (``calls`` rows after a flush), calls lost
(answered but not recorded: must be 0), failed calls; held-call wait p50/p99 (from sending the call
to the resume that let it through, for calls sent while paused; next to the proxy's own count of held
calls); drain time p50/p99 (how long each pause waited for in-flight calls); the proxy's RSS and open
file descriptors at the start, middle and end of the load and when 10k and 100k calls had been
answered (goal: RSS grows less than ``--rss-growth-mb`` from the middle to the end — no growth with
the number of calls). Exit status 1 if a call was lost or failed.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import shutil
import signal
import ssl
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from yarl import URL

from lgt.testing.processes import Procs, rss_mb
from lgt.testing.tls import make_certs
from lgt.trainer.serving.children import free_port

PY = sys.executable

HOSTED = "https://api.soak.invalid/v1/chat/completions"  # never resolves: the proxy routes it
LENGTHS, LENGTH_WEIGHTS = (16, 64, 256), (6, 3, 1)
MILESTONES = (10_000, 50_000, 100_000)


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class Tally:
    answered: int = 0  # 200 with a complete answer
    failed: int = 0  # anything else: an error status, a cut stream, a connection error
    errors: dict[str, int] = field(default_factory=dict)
    sent: list[float] = field(default_factory=list)  # send time of each call (monotonic)
    pauses: list[tuple[float, float]] = field(default_factory=list)  # (pause sent, resume answered)
    drains: list[float] = field(default_factory=list)
    at_pause: list[int] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)  # proxy RSS/fds over time
    stop: bool = False

    def fail(self, why: str) -> None:
        self.failed += 1
        self.errors[why] = self.errors.get(why, 0) + 1


def _q(xs: list[float], p: int) -> float | None:
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[p - 1]


async def agent(i: int, proxy_url: str, ctx: ssl.SSLContext, args, tally: Tally) -> None:
    rng = random.Random(f"{args.seed}-{i}")
    url = URL(proxy_url)
    basic = base64.b64encode(f"{url.user}:{url.password}".encode()).decode()
    proxy, headers = url.with_user(None), {"Proxy-Authorization": f"Basic {basic}"}
    await asyncio.sleep(rng.random() * args.ramp)  # agents start over the ramp, not all at once
    timeout = aiohttp.ClientTimeout(total=args.call_timeout)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1, ssl=ctx),
                                     timeout=timeout) as session:
        turn = 0
        while not tally.stop:
            turn += 1
            stream = rng.random() < args.stream_share
            n = rng.choices(LENGTHS, LENGTH_WEIGHTS)[0]
            slow = ""
            if rng.random() < args.slow_share:
                delay = min(args.slow_scale * rng.paretovariate(args.slow_shape), args.slow_cap)
                slow = f"__sleep:{delay:.3f}__ "
            body = {"model": "soak", "max_tokens": n, "stream": stream,
                    "messages": [{"role": "user", "content": f"{slow}__long:{n}__ agent {i} turn {turn}"}]}
            done = b"data: [DONE]" if stream else b'"choices"'
            tally.sent.append(time.monotonic())
            try:
                async with session.post(HOSTED, json=body, proxy=proxy, proxy_headers=headers) as r:
                    data = await r.read()
                if r.status == 200 and done in data:
                    tally.answered += 1
                else:
                    tally.fail(f"HTTP {r.status}" if r.status != 200 else "incomplete answer")
            except (TimeoutError, aiohttp.ClientError) as e:
                tally.fail(type(e).__name__)
            await asyncio.sleep(rng.uniform(0, 2 * args.think))


async def driver(control: str, token: str, args, tally: Tally) -> None:
    auth = {"Authorization": f"Bearer {token}"}
    version = 0
    async with aiohttp.ClientSession(headers=auth) as s:
        await asyncio.sleep(args.ramp)
        while not tally.stop:
            await asyncio.sleep(args.pause_every)
            if tally.stop:
                break
            t0 = time.monotonic()
            async with s.post(f"{control}/pause", json={"timeout": args.call_timeout}) as r:
                res = await r.json()
            tally.drains.append(res["drain_seconds"])
            tally.at_pause.append(res["in_flight_at_pause"])
            await asyncio.sleep(args.pause_for)  # the update
            version += 1
            async with s.post(f"{control}/resume", json={"policy_version": version}) as r:
                r.raise_for_status()
            tally.pauses.append((t0, time.monotonic()))


async def monitor(pid: int, tally: Tally, t_start: float) -> None:
    while not tally.stop:
        tally.samples.append({"t": time.monotonic() - t_start, "answered": tally.answered,
                              "rss_mb": rss_mb(pid), "fds": fds(pid)})
        await asyncio.sleep(1.0)


async def soak(proxy_urls: list[str], ctx: ssl.SSLContext, control: str, token: str, pid: int,
               args, out) -> Tally:
    tally = Tally()
    t_start = time.monotonic()
    tasks = [asyncio.create_task(agent(i, u, ctx, args, tally)) for i, u in enumerate(proxy_urls)]
    tasks += [asyncio.create_task(driver(control, token, args, tally)),
              asyncio.create_task(monitor(pid, tally, t_start))]
    end = t_start + args.minutes * 60
    while (now := time.monotonic()) < end:
        await asyncio.sleep(min(10.0, end - now))
        s = tally.samples[-1] if tally.samples else {"rss_mb": 0, "fds": 0}
        print(f"  {time.monotonic() - t_start:5.0f} s  answered {tally.answered:7d}  failed {tally.failed}  "
              f"pauses {len(tally.pauses):3d}  proxy RSS {s['rss_mb']:6.1f} MB  fds {s['fds']}",
              file=out, flush=True)
    tally.stop = True  # agents finish the call they are in
    await asyncio.gather(*tasks)
    return tally


def held_waits(tally: Tally) -> list[float]:
    """For each call sent while paused: seconds from sending it to the resume that let it through."""
    out, sent = [], sorted(tally.sent)
    for t_pause, t_resume in tally.pauses:
        out += [t_resume - t for t in sent if t_pause <= t < t_resume]
    return out


def rss_at(samples: list[dict], **where) -> dict | None:
    key, value = next(iter(where.items()))
    return next((s for s in samples if s[key] >= value), None)


def count_rows(store: Path, control: int) -> tuple[int, int]:
    from lgt.proxy.client import ControlClient, resolve_token
    from lgt.store.query import connect
    from lgt.store.schema import STATUS_OK

    ControlClient(f"http://127.0.0.1:{control}", resolve_token(store=store)).flush()
    rows, ok = connect(store).execute(
        "SELECT count(*), count(*) FILTER (WHERE status = ?) FROM calls", [STATUS_OK]).fetchone()
    return int(rows), int(ok)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=1000, help="concurrent agents (each its own rollout)")
    ap.add_argument("--minutes", type=float, default=3.0, help="how long the load runs")
    ap.add_argument("--pause-every", type=float, default=5.0, help="seconds between pauses")
    ap.add_argument("--pause-for", type=float, default=1.0, help="seconds a pause holds (the update)")
    ap.add_argument("--stream-share", type=float, default=0.5, help="share of calls streamed")
    ap.add_argument("--slow-share", type=float, default=0.2, help="share of calls the upstream delays")
    ap.add_argument("--slow-scale", type=float, default=0.2, help="Pareto scale of a delay (s)")
    ap.add_argument("--slow-shape", type=float, default=1.5, help="Pareto shape (smaller: heavier tail)")
    ap.add_argument("--slow-cap", type=float, default=20.0, help="longest delay (s)")
    ap.add_argument("--think", type=float, default=0.5, help="mean think time between an agent's calls (s)")
    ap.add_argument("--ramp", type=float, default=5.0, help="seconds over which the agents start")
    ap.add_argument("--call-timeout", type=float, default=120.0, help="a client's limit for one call (s)")
    ap.add_argument("--rss-growth-mb", type=float, default=50.0, help="goal: RSS growth middle → end")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="JSON summary on stdout (table on stderr)")
    args = ap.parse_args()
    out = sys.stderr if args.json else sys.stdout
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import resource

    from lgt.proxy.auth import ensure_ca, rollout_env
    from lgt.proxy.client import resolve_token

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, 4 * args.agents + 1024))
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))  # this process and the proxy it starts
    tmp = Path(tempfile.mkdtemp(prefix="lgt-soak-"))
    procs = Procs(tmp)
    try:
        ca, cert, key = make_certs(tmp)
        up_port, port, ctl_port = free_port(), free_port(), free_port()
        procs.start("upstream", [PY, "-m", "lgt.testing.fake_upstream", "--port", str(up_port),
                                 "--tls-cert", str(cert), "--tls-key", str(key)], up_port)
        store = tmp / "store"
        urls = [rollout_env(store, f"soak-{i}", port=port, ca="proxy")["HTTPS_PROXY"]
                for i in range(args.agents)]
        pid = procs.start("lgt-proxy", [
            PY, "-m", "lgt.proxy.cli", "--store", str(store), "--upstream", f"https://127.0.0.1:{up_port}/v1",
            "--upstream-ca", str(ca), "--served-model", "policy", "--listen-port", str(port),
            "--control-port", str(ctl_port), "--log-level", "WARNING"], port)
        ctx = ssl.create_default_context(cafile=str(ensure_ca(store / "_proxy")))
        print(f"{args.agents} agents for {args.minutes:g} min, a pause of {args.pause_for:g} s every "
              f"{args.pause_every:g} s; lgt-proxy pid {pid}, logs in {tmp}", file=out, flush=True)
        t0 = time.monotonic()
        tally = asyncio.run(soak(urls, ctx, f"http://127.0.0.1:{ctl_port}", resolve_token(store=store), pid,
                                 args, out))
        wall = time.monotonic() - t0
        from lgt.proxy.client import ControlClient
        proxy_state = ControlClient(f"http://127.0.0.1:{ctl_port}", resolve_token(store=store)).state()
        rows, ok_rows = count_rows(store, ctl_port)
        end = {"rss_mb": rss_mb(pid), "fds": fds(pid)}
        return report(args, tally, wall, rows, ok_rows, proxy_state, end, out)
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


def report(args, tally: Tally, wall: float, rows: int, ok_rows: int, proxy_state: dict, end: dict,
           out) -> int:
    waits, s = held_waits(tally), tally.samples
    loaded = [x for x in s if x["t"] >= args.ramp] or s  # after the agents have all started
    first, middle, last = loaded[0], loaded[len(loaded) // 2], loaded[-1]
    lost = tally.answered - ok_rows
    growth = last["rss_mb"] - middle["rss_mb"]

    def ms(x: float | None) -> str:
        return "—" if x is None else f"{x * 1e3:,.0f} ms"
    lines = [
        "",
        f"calls answered   {tally.answered:,} in {wall:.0f} s ({tally.answered / wall:,.0f}/s), "
        f"{args.agents} agents",
        f"calls recorded   {ok_rows:,} ok rows ({rows:,} rows in all)",
        f"calls lost       {lost}   (answered, not recorded: must be 0)",
        f"calls failed     {tally.failed}   {tally.errors or ''}",
        f"pauses           {len(tally.pauses)}; calls held {len(waits):,} "
        f"(the proxy counted {proxy_state.get('held_total', '?'):,})",
        f"held-call wait   p50 {ms(_q(waits, 50))}   p99 {ms(_q(waits, 99))}   "
        f"(each pause held {args.pause_for:g} s after its drain)",
        f"drain time       p50 {ms(_q(tally.drains, 50))}   p99 {ms(_q(tally.drains, 99))}   "
        f"(in flight at a pause: p50 {_q([float(x) for x in tally.at_pause], 50) or 0:.0f})",
        "proxy RSS / fds  " + "   ".join(
            f"{name} {x['rss_mb']:.0f} MB / {x['fds']}" for name, x in
            (("start", first), ("middle", middle), ("end", last), ("after", end))),
    ]
    marks = {}
    for m in MILESTONES:
        at = rss_at(s, answered=m)
        marks[m] = at
        lines.append(f"at {m:>7,} calls  " + (f"RSS {at['rss_mb']:.0f} MB, fds {at['fds']} ({at['t']:.0f} s)"
                                              if at else "not reached"))
    ok = lost == 0 and tally.failed == 0 and rows == ok_rows
    lines.append(f"goal  RSS growth middle → end {growth:+.1f} MB <= {args.rss_growth_mb:g} MB  "
                 f"{'PASS' if growth <= args.rss_growth_mb else 'MISS'}")
    lines.append(f"check nothing lost, nothing failed: {'OK' if ok else 'FAIL'}")
    print(*lines, sep="\n", file=out)
    if args.json:
        json.dump({"config": vars(args) | {"cpus": os.cpu_count()}, "answered": tally.answered,
                   "recorded": ok_rows, "rows": rows, "lost": lost, "failed": tally.failed,
                   "errors": tally.errors, "pauses": len(tally.pauses), "held": len(waits),
                   "proxy_held_total": proxy_state.get("held_total"),
                   "held_wait_s": {"p50": _q(waits, 50), "p99": _q(waits, 99)},
                   "drain_s": {"p50": _q(tally.drains, 50), "p99": _q(tally.drains, 99)},
                   "samples": s, "at_calls": marks, "rss_growth_mb": growth}, sys.stdout, indent=1)
        print()
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
