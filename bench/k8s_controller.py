"""The Kubernetes rollout runner under load: N rollouts as Jobs against the fake API server, ours
(watches) next to a polling controller (the baseline: one GET per running Job every --poll-s), in
one run.

    .venv/bin/python bench/k8s_controller.py                 # 1,000 rollouts, 128 in flight
    .venv/bin/python bench/k8s_controller.py --rollouts 200 --inflight 32

The fake API server (testing/fake_kube.py) runs in its own process, its kubelet starting each
Job's container as a local process (a shell agent: it works --agent-s seconds, prints the time it
ended and its reward). The
controller is lgt's RolloutController with ``runner: kubernetes`` in this process; its CPU and peak
memory are this process's. Printed per controller: Jobs created per second (over the first --inflight
Jobs, made back to back when the run starts), rollouts finished per second, wall time, controller CPU
per rollout, peak RSS, watch events handled per second, API requests per rollout, and the time from
the agent's exit to its result being recorded (p50/p99; it includes the fake kubelet noticing the
exit). Goals: ≥ 50 Jobs/s created, < 200 MB.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

AGENT = "sleep {s}; date +%s.%N; echo 1.0"  # works, prints the time it ended, then its reward
SERVE = """
import sys, time, json
from lgt.testing.fake_kube import FakeKube
with FakeKube.in_thread(history=100000) as kube:
    kube.write_kubeconfig({kubeconfig!r})
    print("ready", flush=True)
    sys.stdin.read()                     # until the bench closes stdin
    print(json.dumps({{"requests": {{"/".join(k): v for k, v in kube.requests.items()}}}}), flush=True)
"""


def start_fake(tmp: Path) -> tuple[subprocess.Popen, Path]:
    kubeconfig = tmp / "kubeconfig"
    proc = subprocess.Popen([sys.executable, "-c", SERVE.format(kubeconfig=str(kubeconfig))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            stderr=open(tmp / "fake-kube.log", "w"))
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc, kubeconfig


def stop_fake(proc: subprocess.Popen) -> dict[str, int]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.close()
    out = json.loads(proc.stdout.readline())
    proc.wait(30)
    return out["requests"]


def make_store(tmp: Path) -> Path:
    from lgt.proxy import auth
    from lgt.store.migrations import migrate

    store = tmp / "store"
    store.mkdir()
    migrate(store)
    auth.load_secret(store)
    ca = auth.ca_cert_path(auth.proxy_dir(store))  # no proxy runs: the agents make no HTTPS call
    ca.parent.mkdir(parents=True, exist_ok=True)
    ca.write_text("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n")
    return store


def polling_runner(base: type, poll_s: float) -> type:
    """The baseline: the same Jobs and Secrets, but each attempt polls its own Job (then reads its
    pod) every ``poll_s`` instead of sharing two watches."""
    from lgt.trainer.rollout import kube

    class Polling(base):  # type: ignore[misc,valid-type]
        async def start(self) -> None:
            await super().start()
            for w in self._watches:
                w.stop()
            self._watches = []

        def _poll(self, name: str) -> str | None:
            try:
                job = json.loads(self.batch.read_namespaced_job(name, self.namespace,
                                                                _preload_content=False).data)
            except Exception:  # noqa: BLE001 - not created yet
                return None
            outcome = kube.job_outcome(job)
            if outcome is not None:
                self.jobs[name] = job
                self.pods[name] = self._read_pod(name) or {}
            return outcome

        async def execute(self, **kw):  # type: ignore[no-untyped-def]
            name = self.job_name(kw["rollout_id"], kw["attempt"])

            async def poll() -> None:
                while True:
                    await asyncio.sleep(poll_s)
                    outcome = await asyncio.to_thread(self._poll, name)
                    if outcome is not None:
                        self._resolve(name, outcome)
                        return

            task = asyncio.create_task(poll())
            try:
                return await super().execute(**kw)
            finally:
                task.cancel()

    return Polling


async def run_one(kind: str, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    from lgt.proxy.client import ControlClient
    from lgt.trainer.rollout import controller as rollouts
    from lgt.trainer.rollout import kube
    from lgt.trainer.rollout.agent import AgentSpec
    from lgt.trainer.serving.proxy import ProxyClient

    proc, kubeconfig = start_fake(tmp)
    store = make_store(tmp)
    template = tmp / "job.yaml"
    container = {"name": "agent", "image": "bench/agent:1",
                 "command": ["/bin/sh", "-c", AGENT.format(s=args.agent_s)]}
    template.write_text(yaml.safe_dump({"apiVersion": "batch/v1", "kind": "Job",
                                        "spec": {"template": {"spec": {"containers": [container]}}}}))
    agent = AgentSpec(runner="kubernetes", job_template=template, kubeconfig=kubeconfig, namespace="bench",
                      proxy_host="127.0.0.1", timeout_s=120, retries=0, reward_sources=("stdout",),
                      jobs_per_s=args.jobs_per_s)
    endpoint = ProxyClient(store=store, port=9, api=ControlClient("http://127.0.0.1:9", ""))
    if kind == "polling":
        original = kube.KubeRunner
        kube.KubeRunner = polling_runner(original, args.poll_s)  # what the Kubernetes runner instantiates
    ctl = rollouts.RolloutController(agent, endpoint, store, tmp / "run", args.inflight, batch_records=True)
    created: list[float] = []
    create = kube.KubeRunner._create

    def timed_create(self, *a, **kw):  # type: ignore[no-untyped-def]
        out = create(self, *a, **kw)
        created.append(time.monotonic())
        return out

    kube.KubeRunner._create = timed_create
    latencies: list[float] = []

    async def one(i: int) -> None:
        r = await ctl.run({"task_id": f"t{i}"}, f"r{i:05d}", f"g{i:06d}", 0)
        recorded = time.time()
        lines = r.stdout_path.read_text().split()
        if r.ok and len(lines) >= 2:
            latencies.append(recorded - float(lines[-2]))

    cpu0, t0 = time.process_time(), time.monotonic()
    try:
        await asyncio.gather(*(one(i) for i in range(args.rollouts)))
        wall = time.monotonic() - t0
        cpu = time.process_time() - cpu0
        jobs = ctl.runner.jobs
        events = sum(w.events for w in jobs._watches) if jobs is not None else 0
        await asyncio.to_thread(ctl.flush_records)
    finally:
        kube.KubeRunner._create = create
        await ctl.aclose()
        if kind == "polling":
            kube.KubeRunner = original
        requests = stop_fake(proc)
    ok = ctl.done - ctl.failed
    latencies.sort()
    burst = sorted(created)[:min(args.inflight, len(created))]  # at the start: Jobs made back to back
    return {"ok": ok, "wall_s": wall, "jobs_per_s": (len(burst) - 1) / (burst[-1] - burst[0]),
            "rollouts_per_s": args.rollouts / wall,
            "cpu_ms": 1000 * cpu / args.rollouts,
            "events_per_s": events / wall, "api_per_rollout": sum(requests.values()) / args.rollouts,
            "p50_ms": 1000 * statistics.median(latencies) if latencies else float("nan"),
            "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))] if latencies else float("nan")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=1000)
    ap.add_argument("--inflight", type=int, default=128, help="Jobs in flight (the run's max_inflight)")
    ap.add_argument("--jobs-per-s", type=float, default=200.0, help="the runner's creation rate limit")
    ap.add_argument("--poll-s", type=float, default=0.5, help="the polling baseline's interval")
    ap.add_argument("--agent-s", type=float, default=2.0, help="how long each agent works")
    args = ap.parse_args()
    results = {}
    for kind in ("watch", "polling"):
        with tempfile.TemporaryDirectory(prefix=f"lgt-k8s-{kind}-") as tmp:
            results[kind] = asyncio.run(run_one(kind, args, Path(tmp)))
            if kind == "watch":
                rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        r = results[kind]
        print(f"{kind:8s} {r['ok']:5d} ok  {r['wall_s']:6.1f} s  created {r['jobs_per_s']:6.1f} Jobs/s  "
              f"finished {r['rollouts_per_s']:6.1f}/s  "
              f"controller CPU {r['cpu_ms']:5.2f} ms/rollout  watch events {r['events_per_s']:6.1f}/s  "
              f"API requests {r['api_per_rollout']:5.1f}/rollout  exit→recorded p50 {r['p50_ms']:6.0f} ms "
              f"p99 {r['p99_ms']:6.0f} ms", flush=True)
    w, p = results["watch"], results["polling"]
    print(f"\n{args.rollouts} rollouts, {args.inflight} in flight, {os.cpu_count()} CPUs; controller "
          f"peak RSS {rss_mb:.0f} MB (after the watch run)")
    print(f"watch vs polling: API requests {w['api_per_rollout'] / p['api_per_rollout']:.2f}x, "
          f"exit→recorded p50 {w['p50_ms'] / p['p50_ms']:.2f}x, "
          f"rollouts finished per second {w['rollouts_per_s'] / p['rollouts_per_s']:.2f}x")
    goals = [("Jobs created per second >= 50", w["jobs_per_s"] >= 50, f"{w['jobs_per_s']:.1f}"),
             ("controller peak RSS < 200 MB", rss_mb < 200, f"{rss_mb:.0f} MB")]
    for name, ok, value in goals:
        print(f"goal  {name}: {value}  {'PASS' if ok else 'MISS'}")
    return 0 if w["ok"] == args.rollouts else 1


if __name__ == "__main__":
    sys.exit(main())
