"""kill -9 of the proxy under load: every call whose response reached its agent is in the store."""

from __future__ import annotations

import json
import ssl
import threading
import time
from pathlib import Path

import httpx

from lgt.testing.fake_upstream import FakeUpstream
from lgt.testing.proxy import ProxyProc

HOSTED = "https://api.openai.invalid/v1"


def _agent(p: ProxyProc, rollout: str, acked: set[str], stop: threading.Event) -> None:
    ctx = ssl.create_default_context(cafile=p.ca_bundle)
    n = 0
    while not stop.is_set():
        marker = f"{rollout}-call-{n}"
        stream = n % 2 == 1
        n += 1
        body = {"model": "m", "stream": stream,
                "messages": [{"role": "user", "content": marker}]}
        try:
            with httpx.Client(proxy=p.proxy_url(rollout), verify=ctx, trust_env=False,
                              timeout=10) as c:
                r = c.post(f"{HOSTED}/chat/completions", json=body)
            if stream:
                ok = r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
            else:
                ok = r.status_code == 200 and bool(r.json()["choices"][0]["message"]["content"])
        except (httpx.HTTPError, ValueError):
            ok = False  # the proxy died under this call: it was never acknowledged
            time.sleep(0.05)
        if ok:
            acked.add(marker)


def test_kill_9_under_load_loses_no_acknowledged_call(tmp_path: Path, upstream: FakeUpstream) -> None:
    store = tmp_path / "store"
    p = ProxyProc(store, upstream.url).start()
    acked: set[str] = set()
    stop = threading.Event()
    agents = [threading.Thread(target=_agent, args=(p, f"dur-{i}", acked, stop), daemon=True)
              for i in range(8)]
    for t in agents:
        t.start()
    deadline = time.monotonic() + 30
    while len(acked) < 200 and time.monotonic() < deadline:
        time.sleep(0.02)
    p.kill9()  # mid-load: agents have calls in flight right now
    killed_at = len(acked)
    time.sleep(0.3)
    stop.set()
    for t in agents:
        t.join(15)
    assert killed_at >= 100, "the load never got going"

    p2 = ProxyProc(store, upstream.url).start()  # a restart recovers the write-ahead log
    try:
        rows = p2.calls()
        recorded = {json.loads(r["request_json"])["messages"][0]["content"] for r in rows}
        missing = acked - recorded
        assert not missing, f"{len(missing)} acknowledged calls lost, e.g. {sorted(missing)[:3]}"
        print(f"killed at {killed_at} acknowledged calls; {len(acked)} acknowledged in all; "
              f"{len(rows)} recorded after the restart")
        assert len({r["call_id"] for r in rows}) == len(rows)  # nothing recorded twice
        assert all(r["status"] == "ok" for r in rows)
        # the restarted proxy continues each rollout's numbering
        before = max(r["seq"] for r in rows if r["rollout_id"] == "dur-0")
        ctx = ssl.create_default_context(cafile=p2.ca_bundle)
        with httpx.Client(proxy=p2.proxy_url("dur-0"), verify=ctx, trust_env=False) as c:
            c.post(f"{HOSTED}/chat/completions",
                   json={"model": "m", "messages": [{"role": "user", "content": "after"}]})
        [after] = p2.calls("rollout_id = 'dur-0' AND seq > ?", [before])
        assert after["seq"] == before + 1
    finally:
        p2.stop()
