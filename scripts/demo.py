"""Demo: wrap an unchanged OpenAI-SDK agent with lgt-proxy and look at what was recorded, with SQL.

1. starts a local vLLM-compatible upstream (lgt.testing.fake_upstream: deterministic, token ids and
   logprobs like vLLM) and `lgt-proxy` in front of it, store under runs/demo/store;
2. runs examples/openai_agent/agent.py for a few rollouts with `eval "$(lgt-proxy creds ID)"`'s
   environment — the agent still aims at https://api.openai.invalid/v1;
3. pauses the proxy, "updates the policy", resumes with policy_version 1, runs one more rollout;
4. prints the calls view with DuckDB.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from lgt.trainer.serving import children

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def lgt_proxy(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "lgt.proxy.cli", *args], check=True, text=True,
                          capture_output=True, **kw)


def wait_port(port: int, proc: subprocess.Popen, what: str) -> None:
    if children.wait_until(lambda: children.listens(port), proc, 15, every=0.05):
        return
    if proc.returncode is not None:
        sys.exit(f"{what} exited early with code {proc.returncode}")
    sys.exit(f"{what} did not start")


def main() -> None:
    run_dir = ROOT / "runs" / "demo"
    store = run_dir / "store"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    up_port, px_port, ctl_port = children.free_port(), children.free_port(), children.free_port()
    base_env = {k: v for k, v in os.environ.items()
                if "proxy" not in k.lower() and k not in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE")}
    procs = []
    try:
        up = subprocess.Popen([PY, "-m", "lgt.testing.fake_upstream", "--port", str(up_port)],
                              stdout=subprocess.DEVNULL, env=base_env)
        procs.append(up)
        wait_port(up_port, up, "the upstream")
        log = open(run_dir / "proxy.log", "w")
        px = subprocess.Popen(
            [PY, "-m", "lgt.proxy.cli", "--store", str(store),
             "--upstream", f"http://127.0.0.1:{up_port}/v1", "--served-model", "policy",
             "--listen-port", str(px_port), "--control-port", str(ctl_port)],
            stdout=log, stderr=subprocess.STDOUT, env=base_env)
        procs.append(px)
        wait_port(ctl_port, px, "lgt-proxy")
        print(f"lgt-proxy on 127.0.0.1:{px_port} -> upstream 127.0.0.1:{up_port}, store {store}")

        def rollout(rid: str, question: str) -> None:
            creds = lgt_proxy("creds", rid, "--store", str(store), "--listen-port", str(px_port),
                              "--format", "json").stdout
            env = {**base_env, **json.loads(creds)}
            out = subprocess.run([PY, str(ROOT / "examples/openai_agent/agent.py"), question],
                                 env=env, check=True, capture_output=True, text=True).stdout
            print(f"  rollout {rid}: {out.strip()}")

        print("running the unchanged agent (it aims at https://api.openai.invalid/v1):")
        for i, q in enumerate(["What is 17*23?", "What is 6*7?", "What is 100-58?"]):
            rollout(f"demo-{i}", q)
        ctl = ["--store", str(store), "--control-port", str(ctl_port)]
        paused = json.loads(lgt_proxy("ctl", "pause", *ctl).stdout)
        print(f"paused: drained in {paused['drain_seconds'] * 1000:.1f} ms; "
              "(a trainer would update the policy here)")
        lgt_proxy("ctl", "resume", *ctl, "--policy-version", "1")
        rollout("demo-3", "What is 2**10?")
        lgt_proxy("ctl", "flush", *ctl)

        sys.path.insert(0, str(ROOT))
        from lgt.store.query import connect

        con = connect(store)
        sql = """
            SELECT rollout_id, seq, streamed, status, policy_version AS version,
                   original_host AS host, requested_model || '->' || served_model AS model,
                   len(prompt_token_ids) AS prompt_toks, len(response_token_ids) AS resp_toks,
                   finish_reason, round(latency_ms, 1) AS ms
            FROM calls ORDER BY rollout_id, seq"""
        print(f"\nrecorded calls (DuckDB over {store.relative_to(ROOT)}/calls/*.parquet):")
        con.sql(sql).show(max_width=200)
        con.sql("SELECT rollout_id, count(*) AS calls, sum(usage_total_tokens) AS tokens, "
                      "max(policy_version) AS version FROM calls GROUP BY 1 ORDER BY 1").show()
    finally:
        for p in reversed(procs):
            children.stop(p, 10, group=False)


if __name__ == "__main__":
    main()
