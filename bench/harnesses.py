"""Real coding-agent harnesses through lgt-proxy: calls per task, what the proxy adds, and what its
translation costs next to chat/completions.

    .venv-proxy/bin/python bench/harnesses.py                       # every installed harness, default profile
    .venv-proxy/bin/python bench/harnesses.py --profile minimal --repeat 3 --harness pi,codex
    .venv-proxy/bin/python bench/harnesses.py --cpu-only            # the translation part alone (no binaries)

Two parts, one run:

1. **Live.** Each harness (``lgt.testing.harnesses``: its own flags, env and config files) does the task
   "Write the word W into the file answer.txt" through one ``lgt-proxy --egress deny`` in front of the
   fake vLLM answering as ``lgt.testing.harness_policy`` (a tool call, then a final text), ``--repeat``
   times. Per harness: calls per task (rows in the store), the engine's own time per call (measured
   inside the engine, from the request's arrival to its last byte), and the proxy's hop per call: the
   call's recorded latency (from the moment the proxy starts the call, its request read and translated,
   to the answer's last byte handed on) minus the engine's time for the same request (matched by its
   prompt token ids), and per task (the sum over its calls). The baseline is the engine's own clock, not
   a second run of the harness: a harness's wall time varies by more than the whole hop between runs.
   Not counted in the hop: the TLS handshake of a new connection and reading the request before the
   proxy's hooks (``bench/proxy_overhead.py`` measures the whole hop on a synthetic workload), nor
   translating the request (part 2 measures it). Next to it, the proxy process's CPU time over each
   task (everything it did for the harness: TLS, egress refusals, calls, records).
2. **CPU.** Over the model calls the harnesses sent when the fixtures were recorded
   (tests/fixtures/harnesses), in this process, per call: the translated path — parse the agent's
   body, ``dialects.agent_request`` + ``dialects.to_chat``, ``wire.prepare_request``, then the
   engine's real answer to it (asked once) through ``dialects.translator`` event by event as the proxy
   does — next to the chat/completions path for the equivalent chat body (the one ``to_chat`` made, as
   an agent speaking chat would have sent it): ``wire.parse_request`` + ``wire.prepare_request``, and
   the same answer captured and stripped event by event. Thread CPU time, the ratio per API (goal:
   within 1.2x). Calls that continue a Responses conversation by ``previous_response_id`` (Codex over
   its WebSocket) need the proxy's conversation store and are left out.

Nothing here is a test: it prints a table and asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

from aiohttp import web

from lgt.proxy import dialects, wire
from lgt.proxy.auth import rollout_env
from lgt.proxy.client import ControlClient, resolve_token
from lgt.testing import harnesses
from lgt.testing.fake_upstream import FakeUpstream, detokenize, render_chat, tokenize
from lgt.testing.harness_policy import ScriptedPolicy, task_text
from lgt.trainer.serving import children

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "harnesses"
MODEL_CALLS = ("main-tool-call", "main-final", "main-text", "side", "side-json", "router", "title")


def cpu_s(pid: int) -> float:
    """A process's CPU seconds so far (user + system, all threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prompt_key(body: dict[str, Any]) -> int:
    return hash(tuple(tokenize(render_chat(body.get("messages") or [], body.get("tools")))))


class TimedUpstream(FakeUpstream):
    """The fake engine, timing each chat request from its arrival to its last byte (``times``: prompt
    ids' hash → seconds)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.times: dict[int, list[float]] = defaultdict(list)

        @web.middleware
        async def timed(request: web.Request, handler: Any) -> web.StreamResponse:
            t0 = time.perf_counter()
            resp = await handler(request)
            took = time.perf_counter() - t0
            if request.path.endswith("/chat/completions"):
                self.times[prompt_key(json.loads(await request.read()))].append(took)
            return resp

        self.app.middlewares.append(timed)


# --- part 1: live ---------------------------------------------------------------------------------

def start_proxy(store: Path, upstream: str, log: Path) -> tuple[subprocess.Popen, int, ControlClient]:
    port, control = children.free_port(), children.free_port()
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lgt.proxy.cli", "--store", str(store), "--upstream",
                                 upstream, "--served-model", "policy", "--egress", "deny", "--listen-port",
                                 str(port), "--control-port", str(control), "--flush-seconds", "0.2"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
    ctl = ControlClient(f"http://127.0.0.1:{control}", "")
    if children.wait_until(lambda: ctl.healthz(timeout=1), proc, 30):
        return proc, port, ControlClient(ctl.url, resolve_token(store=store))
    if proc.returncode is not None:
        raise RuntimeError(f"lgt-proxy exited:\n{log.read_text()[-3000:]}")
    raise RuntimeError(f"lgt-proxy did not start:\n{log.read_text()[-3000:]}")


def live(names: list[str], profile: str, repeat: int, base: Path) -> list[dict[str, Any]]:
    from lgt.store.query import connect

    store = base / "store"
    policy = ScriptedPolicy()
    out = []
    with TimedUpstream.in_thread(reply=policy, max_model_len=1 << 20) as up:
        proc, port, ctl = start_proxy(store, up.url, base / "proxy.log")
        try:
            runs: dict[str, list[tuple[str, float, float, bool]]] = defaultdict(list)
            for i in range(repeat):
                for name in names:
                    h = harnesses.HARNESSES[name][profile]
                    if not harnesses.installed(h):
                        continue
                    rollout = f"bench-{name}-{profile}-{i}"
                    work = base / rollout / "work"  # minimal prompts leave the work dir out: name it
                    target = work / "answer.txt" if profile == "minimal" else Path("answer.txt")
                    place = harnesses.Place(task_text("BENCH", str(target)), work, base / rollout / "home")
                    harnesses.prepare(h, place)
                    env = harnesses.environment(h, place, rollout_env(store, rollout, port=port))
                    c0, t0 = cpu_s(proc.pid), time.monotonic()
                    r = harnesses.run(h, place, env, timeout=240)
                    wall = time.monotonic() - t0
                    time.sleep(0.3)  # the last record written
                    proxy_cpu = cpu_s(proc.pid) - c0
                    target = place.workdir / "answer.txt"
                    ok = r.returncode == 0 and target.exists() and "BENCH" in target.read_text()
                    if not ok:
                        print(f"  {name} [{profile}] run {i}: exit {r.returncode}: {r.stderr[-400:]!r}",
                              file=sys.stderr)
                    runs[name].append((rollout, wall, proxy_cpu, ok))
            ctl.flush()
            con = connect(store)
            for name, rs in runs.items():
                per_task_calls, hops, engine, task_hops = [], [], [], []
                for rollout, _, _, _ in rs:
                    rows = con.execute("SELECT latency_ms, prompt_token_ids, status, api FROM calls "
                                       "WHERE rollout_id = ? ORDER BY seq", [rollout]).fetchall()
                    per_task_calls.append(len(rows))
                    task_hop = 0.0
                    for latency, prompt, status, _ in rows:
                        took = up.times.get(hash(tuple(prompt or ())))
                        if status != "ok" or not took:
                            continue
                        e = took.pop(0) * 1000
                        engine.append(e)
                        hops.append(latency - e)
                        task_hop += latency - e
                    task_hops.append(task_hop)
                api = harnesses.HARNESSES[name][profile].api
                out.append({**samples_of(store, name, rs), "harness": name, "profile": profile, "api": api,
                            "runs": len(rs),
                            "ok": sum(ok for *_, ok in rs),
                            "calls_per_task": statistics.median(per_task_calls),
                            "wall_s": statistics.median(w for _, w, _, _ in rs),
                            "engine_ms": statistics.median(engine) if engine else None,
                            "hop_ms": statistics.median(hops) if hops else None,
                            "hop_task_ms": statistics.median(task_hops),
                            "proxy_cpu_task_ms": statistics.median(c for _, _, c, _ in rs) * 1000})
        finally:
            children.stop(proc, 15, group=False)
    return out


def samples_of(store: Path, name: str, rs: list[tuple[str, float, float, bool]]) -> dict[str, Any]:
    """The training samples the harness's rollouts become (exact mode; reward 1 when the file holds the
    word): samples per rollout, generated vs trained tokens (each generated token trained once), and
    why a rollout's calls did not merge into one sample."""
    from collections import Counter

    from lgt.store.ingest import add_reward, add_rollout
    from lgt.store.query import connect
    from lgt.store.samples import build_samples

    for rollout, _, _, ok in rs:
        add_rollout(store, rollout, task_id=name, group_id=name)
        add_reward(store, rollout, 1.0 if ok else 0.0)
    con = connect(store)
    ids = [r for r, *_ in rs]
    generated = con.execute("SELECT coalesce(sum(len(response_token_ids)), 0) FROM calls WHERE status = 'ok' "
                            "AND list_contains(?, rollout_id)", [ids]).fetchone()[0]
    out: dict[str, Any] = {"generated_tokens": int(generated)}
    for mode in ("exact", "realign"):  # the fake engine's byte tokenizer names (and realigns) breaks
        b = build_samples(con, mode=mode, tokenizer=ByteTokenizer())
        mine = [s for s in b.samples.to_pylist() if s["rollout_id"] in ids]
        per_rollout = Counter(Counter(s["rollout_id"] for s in mine).values())
        out[mode] = {"samples_per_rollout": dict(sorted(per_rollout.items())),
                     "trained_tokens": sum(sum(s["loss_mask"]) for s in mine),
                     "breaks": dict(Counter(r["reason"] for r in b.merge_breaks.to_pylist()
                                            if r["rollout_id"] in ids))}
    return out


class ByteTokenizer:
    """The fake engine's tokenizer, as the sample builder asks for one (``decode``)."""

    @staticmethod
    def decode(ids: list[int]) -> str:
        return detokenize(ids)


# --- part 2: translation CPU ----------------------------------------------------------------------

def fixture_calls() -> tuple[list[dict[str, Any]], int]:
    """The model calls recorded in tests/fixtures/harnesses: (harness dir, api, path, body); and how
    many were left out (previous_response_id)."""
    calls, skipped = [], 0
    for manifest in sorted(FIXTURES.glob("*/manifest.json")):
        for entry in json.loads(manifest.read_text())["calls"]:
            if entry["kind"] not in MODEL_CALLS:
                continue
            c = json.loads((manifest.parent / entry["file"]).read_text())
            body = c.get("body")
            if not isinstance(body, dict):
                continue
            if c["transport"] == "ws":
                body = {k: v for k, v in body.items() if k != "type"}
            query = "&".join(f"{k}={v}" for k, v in (c.get("query") or {}).items())
            path = c["path"] + (f"?{query}" if query else "")
            api = dialects.api_of("POST", path) or wire.endpoint_of("POST", path)
            if api is None:
                continue
            if body.get("previous_response_id"):
                skipped += 1
                continue
            calls.append({"dir": manifest.parent.name, "api": api, "path": path, "body": body})
    return calls, skipped


def engine_answer(url: str, prepared: dict[str, Any]) -> bytes:
    req = urllib.request.Request(f"{url}/chat/completions", data=wire.dumps(prepared), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=60) as r:
        return r.read()


def translated_path(api: str, path: str, raw: bytes, answer: bytes) -> None:
    """What the proxy does for a translated call: the request to chat, the engine's answer back."""
    req = wire.loads(raw)
    req = dialects.agent_request(api, path, req)
    chat = dialects.to_chat(api, req, None, [])
    prepared, _ = wire.prepare_request(wire.CHAT, chat, served_model="policy", capture_tokens=True)
    wire.dumps(prepared)
    cap = wire.Capture(wire.CHAT)
    tr = dialects.translator(api, req, model=req.get("model"))
    if not prepared.get("stream"):
        obj = wire.loads(answer)
        cap.add_body(obj)
        wire.dumps(tr.body(obj, cap))
        return
    framer = wire.SSEFramer()
    for event in framer.feed(answer):
        data = wire.event_data(event)
        if data is None:
            continue
        if data.strip() == b"[DONE]":
            tr.finish(cap)
            continue
        obj = wire.loads(data)
        cap.add_chunk(obj)
        tr.chunk(obj)


def chat_path(raw_chat: bytes, answer: bytes) -> None:
    """What the proxy does for the same call in chat/completions: parse, inject, capture and strip."""
    req = wire.parse_request(wire.CHAT, raw_chat)
    prepared, inj = wire.prepare_request(wire.CHAT, req, served_model="policy", capture_tokens=True)
    wire.dumps(prepared)
    cap = wire.Capture(wire.CHAT)
    if not prepared.get("stream"):
        obj = wire.loads(answer)
        cap.add_body(obj)
        wire.strip_response(wire.CHAT, obj, inj)
        wire.dumps(obj)
        return
    framer = wire.SSEFramer()
    for event in framer.feed(answer):
        data = wire.event_data(event)
        if data is None or data.strip() == b"[DONE]":
            continue
        obj = wire.loads(data)
        cap.add_chunk(obj)
        wire.strip_response(wire.CHAT, obj, inj)
        if not wire.is_silent_chunk(obj):
            wire.rebuild_event(event, wire.dumps(obj))


def cpu_per_call(fn: Any, *args: Any, min_s: float = 0.05) -> float:
    """Thread CPU seconds per call of fn(*args), repeated until min_s has passed."""
    fn(*args)  # warm
    n, t0 = 0, time.thread_time()
    while True:
        fn(*args)
        n += 1
        took = time.thread_time() - t0
        if took >= min_s:
            return took / n


def cpu(min_s: float) -> tuple[list[dict[str, Any]], int]:
    calls, skipped = fixture_calls()
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    with FakeUpstream.in_thread(reply=ScriptedPolicy(), max_model_len=1 << 20) as up:
        for c in calls:
            api, raw = c["api"], wire.dumps(c["body"])
            if api == wire.CHAT:  # qwen speaks chat/completions: nothing to translate
                chat = wire.parse_request(wire.CHAT, raw)
            else:
                req = dialects.agent_request(api, c["path"], wire.loads(raw))
                chat = dialects.to_chat(api, req, None, [])
            prepared, _ = wire.prepare_request(wire.CHAT, chat, served_model="policy", capture_tokens=True)
            answer = engine_answer(up.url, prepared)
            raw_chat = wire.dumps(chat)
            plain = cpu_per_call(chat_path, raw_chat, answer, min_s=min_s)
            trans = plain if api == wire.CHAT else cpu_per_call(translated_path, api, c["path"], raw, answer,
                                                                 min_s=min_s)
            r = rows.setdefault((c["dir"], api), {"fixtures": c["dir"], "api": api, "calls": 0, "bytes": 0,
                                                  "translated_s": 0.0, "chat_s": 0.0})
            r["calls"] += 1
            r["bytes"] += len(raw)
            r["translated_s"] += trans
            r["chat_s"] += plain
    return list(rows.values()), skipped


# --- output ---------------------------------------------------------------------------------------

def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--harness", default=",".join(harnesses.HARNESSES))
    ap.add_argument("--profile", default="default", choices=("default", "minimal"))
    ap.add_argument("--repeat", type=int, default=3, help="runs of each harness (medians over them)")
    ap.add_argument("--cpu-only", action="store_true", help="only the translation's CPU (no harness runs)")
    ap.add_argument("--min-cpu-s", type=float, default=0.05, help="CPU time spent timing each recorded call")
    args = ap.parse_args()
    names = [n.strip() for n in args.harness.split(",") if n.strip()]
    base = Path(tempfile.mkdtemp(prefix="lgt-bench-harnesses-"))
    try:
        if not args.cpu_only:
            missing = [n for n in names if not harnesses.installed(harnesses.HARNESSES[n][args.profile])]
            if missing:
                print(f"not installed (scripts/setup.sh): {', '.join(missing)}", file=sys.stderr)
            res = live(names, args.profile, args.repeat, base)
            print(f"\nLive: each harness {args.repeat}x through lgt-proxy (--egress deny) to the scripted "
                  f"fake engine, profile {args.profile}; medians")
            print(table(["harness", "API", "ok", "calls/task", "task wall s", "engine ms/call",
                         "proxy hop ms/call", "proxy hop ms/task", "proxy CPU ms/task"],
                        [[r["harness"], r["api"], f"{r['ok']}/{r['runs']}", fmt(r["calls_per_task"], "g"),
                          fmt(r["wall_s"], ".2f"), fmt(r["engine_ms"]), fmt(r["hop_ms"]),
                          fmt(r["hop_task_ms"]), fmt(r["proxy_cpu_task_ms"], ".0f")] for r in res]))
            print("\nTheir trajectories as training samples (lgt.store.samples.build_samples; merge breaks "
                  "named with the fake engine's byte tokenizer)")
            print(table(["harness", "rollouts", "mode", "samples per rollout (rollouts)", "generated tokens",
                         "trained tokens", "merge breaks by reason"],
                        [[r["harness"], str(r["runs"]), mode,
                          ", ".join(f"{k}: {n}" for k, n in r[mode]["samples_per_rollout"].items()) or "-",
                          str(r["generated_tokens"]), str(r[mode]["trained_tokens"]),
                          ", ".join(f"{k} {n}" for k, n in r[mode]["breaks"].items()) or "none"]
                         for r in res for mode in ("exact", "realign")]))
        rows, skipped = cpu(args.min_cpu_s)
        print("\nCPU per call over the recorded calls (tests/fixtures/harnesses): translated vs the same "
              f"call as chat/completions ({skipped} previous_response_id calls left out)")
        by_api: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        out = []
        for r in rows:
            n = r["calls"]
            out.append([r["fixtures"], r["api"], str(n), f"{r['bytes'] / n / 1000:.1f}",
                        f"{r['translated_s'] / n * 1e6:.0f}", f"{r['chat_s'] / n * 1e6:.0f}",
                        f"{r['translated_s'] / r['chat_s']:.2f}x"])
            t = by_api[r["api"]]
            t[0] += n
            t[1] += r["translated_s"]
            t[2] += r["chat_s"]
        for api, (n, tr, ch) in sorted(by_api.items()):
            out.append([f"**all {api}**", api, str(n), "", f"{tr / n * 1e6:.0f}", f"{ch / n * 1e6:.0f}",
                        f"**{tr / ch:.2f}x**"])
        print(table(["fixtures", "API", "calls", "KB/call", "translated µs/call", "chat µs/call", "ratio"],
                    out))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
