"""runner: kubernetes — rollouts as Jobs, with the official ``kubernetes`` client against the fake API
server (testing/fake_kube.py), whose kubelet runs each Job's container as a local process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from lgt.store.query import connect
from lgt.testing.fake_kube import FakeKube
from lgt.testing.rollouts import AGENTS, attempts, endpoint, rewards
from lgt.trainer.rollout import kube
from lgt.trainer.rollout.agent import AgentSpec, RolloutError
from lgt.trainer.rollout.controller import RolloutController

pytest.importorskip("kubernetes")
ROOT = Path(__file__).resolve().parents[2]


def template(tmp_path: Path, script: str = "chat_agent.py", image: str = "python:3.12-slim",
             **container: Any) -> Path:
    """A Job manifest whose container runs one of tests/trainer/agents/ (here: a local process)."""
    doc = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"labels": {"team": "rl"}},
           "spec": {"template": {"spec": {"containers": [{
               "name": "agent", "image": image, "command": [sys.executable, str(AGENTS / script)],
               "env": [{"name": "FROM_TEMPLATE", "value": "kept"}], **container}]}}}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def spec(tmp_path: Path, cluster: FakeKube, **kw: Any) -> AgentSpec:
    kw.setdefault("timeout_s", 30)
    kw.setdefault("retries", 0)
    return AgentSpec(runner="kubernetes", job_template=kw.pop("job_template", None) or template(tmp_path),
                     kubeconfig=cluster.write_kubeconfig(tmp_path / "kubeconfig"), namespace="rl",
                     proxy_host="127.0.0.1", **kw)


@pytest.fixture
def cluster() -> Iterator[FakeKube]:
    with FakeKube.in_thread() as fake:
        yield fake


# -- the pieces -------------------------------------------------------------------------------------

def test_names_are_dns_labels_and_stay_distinct() -> None:
    assert kube.dns_name("lgt", "ab12", "g000001-3", "0") == "lgt-ab12-g000001-3-0"
    a, b = kube.dns_name("lgt", "k", "Eval_A~1", "0"), kube.dns_name("lgt", "k", "eval-a-1", "0")
    assert a != b and all(len(n) <= 63 and n.replace("-", "").isalnum() and n.islower() for n in (a, b))
    assert len(kube.dns_name("x" * 200)) == 63


def test_pod_states_that_end_an_attempt_at_once() -> None:
    waiting = {"status": {"containerStatuses": [{"state": {"waiting": {
        "reason": "ImagePullBackOff", "message": "Back-off pulling image \"nope\""}}}]}}
    assert kube.pod_failure(waiting) == ("the agent's container cannot start: ImagePullBackOff "
                                         "(Back-off pulling image \"nope\")")
    assert "cannot be scheduled: 0/3 nodes" in kube.pod_failure({"status": {"conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes"}]}})
    assert "OOMKilled" in kube.pod_failure({"status": {"containerStatuses": [
        {"state": {"terminated": {"reason": "OOMKilled", "exitCode": 137}}}]}})
    assert kube.pod_failure({"status": {"phase": "Failed", "reason": "Evicted", "message": "low memory"}}) \
        == "the pod was evicted: low memory"
    assert kube.pod_failure({"status": {"containerStatuses": [{"state": {"waiting": {
        "reason": "ContainerCreating"}}}]}}) is None  # still starting: wait


def test_the_job_is_the_template_plus_what_the_controller_owns(tmp_path: Path) -> None:
    runner = kube.KubeRunner(template=template(tmp_path), namespace="rl", run_dir=tmp_path / "run",
                             run_name="run", ttl_s=600)
    runner.parent = {"apiVersion": "v1", "kind": "ConfigMap", "name": "lgt-run-x", "uid": "u1"}
    labels = {"lgt/run": runner.key, "lgt/rollout": "g1-0", "lgt/attempt": "0"}
    job = runner.job("lgt-x-g1-0-0", labels, {"TASK_ID": "t1", "SSL_CERT_FILE": f"{kube.MOUNT}/ca.pem"},
                     {"HTTPS_PROXY": "http://g1-0~0:tok@proxy:8080"}, {}, 42.5)
    spec_ = job["spec"]
    assert (spec_["backoffLimit"], spec_["activeDeadlineSeconds"], spec_["ttlSecondsAfterFinished"]) == \
        (0, 42, 600)
    assert job["metadata"]["labels"] == {"team": "rl", **labels}
    assert job["metadata"]["ownerReferences"][0]["uid"] == "u1"
    pod = spec_["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and spec_["template"]["metadata"]["labels"] == labels
    c = pod["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert env["FROM_TEMPLATE"]["value"] == "kept" and env["TASK_ID"]["value"] == "t1"
    assert env["HTTPS_PROXY"] == {"name": "HTTPS_PROXY", "valueFrom": {"secretKeyRef": {
        "name": "lgt-x-g1-0-0", "key": "HTTPS_PROXY"}}}
    assert "tok" not in json.dumps(job)  # the token is in the Secret only
    assert {"name": "lgt-rollout", "mountPath": kube.MOUNT, "readOnly": True} in c["volumeMounts"]


def documented(marker: str) -> dict:
    """The YAML block of docs/kubernetes.md that holds ``marker``."""
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    block = next(b.split("```", 1)[0] for b in text.split("```yaml")[1:] if marker in b.split("```", 1)[0])
    return yaml.safe_load(block)


def test_the_documented_template_holds_the_sandbox_guarantees(tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(documented("# job.yaml")))
    runner = kube.KubeRunner(template=tmp_path / "job.yaml", namespace="rl-agents", run_dir=tmp_path / "run",
                             run_name="run", ttl_s=600)
    runner.parent = {"apiVersion": "v1", "kind": "ConfigMap", "name": "lgt-run-x", "uid": "u1"}
    labels = {"lgt/run": runner.key, "lgt/rollout": "g1-0", "lgt/attempt": "0"}
    job = runner.job("lgt-x-g1-0-0", labels, {"TASK_ID": "t1"}, {"HTTPS_PROXY": "http://x"}, {}, 60)
    pod = job["spec"]["template"]["spec"]
    [c] = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["automountServiceAccountToken"] is False
    assert c["securityContext"] == {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"]}}
    assert c["resources"]["limits"]["memory"] and c["resources"]["limits"]["ephemeral-storage"]
    writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
    assert writable == {"/work", "/tmp"}
    assert all(v["emptyDir"]["sizeLimit"] for v in pod["volumes"] if "emptyDir" in v)
    # the NetworkPolicy selects every rollout's pod and lets it reach the proxy's port and DNS only
    policy = documented("lgt-agents-reach-only-the-proxy")
    [expr] = policy["spec"]["podSelector"]["matchExpressions"]
    assert expr == {"key": "lgt/run", "operator": "Exists"} and "lgt/run" in \
        job["spec"]["template"]["metadata"]["labels"]
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"} and policy["spec"]["ingress"] == []
    ports = sorted(p["port"] for rule in policy["spec"]["egress"] for p in rule["ports"])
    assert ports == [53, 53, 8080] and all(rule["to"] for rule in policy["spec"]["egress"])


@pytest.mark.parametrize("kw,message", [
    (dict(runner="kubernetes", job_template=Path("job.yaml")), "needs agent job_template (a Job manifest) "
                                                               "and proxy_host"),
    (dict(runner="kubernetes", command=("python", "a.py"), job_template=Path("j"), proxy_host="p"),
     "agent command is not used with runner: kubernetes"),
    (dict(runner="slurm", command=("a",)), "agent runner must be one of local, kubernetes, not 'slurm'"),
])
def test_bad_kubernetes_settings_are_one_sentence(kw: dict, message: str) -> None:
    with pytest.raises(RolloutError, match=message.replace("(", r"\(").replace(")", r"\)")):
        AgentSpec(**kw)


def test_a_bad_template_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "job.yaml"
    bad.write_text("kind: Job\nspec: {template: {spec: {containers: []}}}\n")
    with pytest.raises(kube.KubeError, match=r"containers\[0\] must name an image"):
        kube.load_template(bad)


# -- rollouts as Jobs, through the real proxy --------------------------------------------------------

def kube_controller(proxy: Any, tmp_path: Path, agent: AgentSpec, concurrency: int = 4) -> RolloutController:
    return RolloutController(agent, endpoint(proxy), proxy.store, tmp_path / "run", concurrency)


async def run_and_close(ctl: RolloutController, jobs: list[tuple[dict, str]], group: str = "g000001"):
    try:
        return await asyncio.gather(*(ctl.run(task, rid, group, 0) for task, rid in jobs))
    finally:
        await ctl.aclose()


def test_rollouts_run_as_jobs_with_their_credentials_only_in_a_secret(tmp_path, proxy, cluster):
    agent = spec(tmp_path, cluster, env={"EXTRA": "${LGT_ROLLOUT_ID}/${TASK_ID}",
                                         "OPENAI_BASE_URL": "${LGT_PROXY_BASE_URL}"})
    ctl = kube_controller(proxy, tmp_path, agent)
    tasks = [({"task_id": f"t{i}", "report_dir": str(tmp_path), "rewards": {"stdout": 0.25 * i}}, f"k8s-{i}")
             for i in range(3)]

    async def go():
        results = await asyncio.gather(*(ctl.run(task, rid, "g000001", 0) for task, rid in tasks))
        jobs = cluster.objects("jobs", "rl")  # before the end of the run deletes them
        for _ in range(100):  # each attempt's Secret is deleted (in the background) when it ends
            if not (secrets := cluster.objects("secrets", "rl")):
                break
            await asyncio.sleep(0.05)
        await ctl.aclose()
        return results, jobs, secrets

    results, jobs, secrets = asyncio.run(go())
    assert [(r.status, r.exit_code, r.reward, r.reward_source) for r in results] == [
        ("ok", 0, 0.25 * i, "stdout") for i in range(3)]
    assert "model said: The answer is" in results[0].stdout_path.read_text()  # the pod's log
    seen = json.loads((tmp_path / "k8s-1~0.json").read_text())["env"]
    assert seen["EXTRA"] == "k8s-1/t1" and seen["TASK_ID"] == "t1" and seen["LGT_ATTEMPT"] == "0"
    assert "//k8s-1:" in seen["HTTPS_PROXY"] and "/r/k8s-1/" in seen["OPENAI_BASE_URL"]
    assert json.loads(Path(seen["TASK_JSON"]).read_text())["task_id"] == "t1"  # the mounted task file
    assert [(r["status"], r["attempt"]) for r in attempts(proxy, "k8s-2")] == [("ok", 0)]
    assert rewards(proxy, "k8s-2") == [(0, "stdout", 0.5)]
    # the proxy recorded each rollout's call under its identity
    assert {r["rollout_id"] for r in proxy.calls("rollout_id LIKE 'k8s-%'")} == {"k8s-0", "k8s-1", "k8s-2"}
    assert len(jobs) == 3 and all(j["spec"]["backoffLimit"] == 0 for j in jobs)
    pods = [j["spec"]["template"]["spec"] for j in jobs]  # as the API server stored them
    assert all(p["automountServiceAccountToken"] is False for p in pods)
    assert all(p["containers"][0]["securityContext"] == {"allowPrivilegeEscalation": False,
                                                         "capabilities": {"drop": ["ALL"]}} for p in pods)
    assert {j["metadata"]["labels"]["lgt/rollout"] for j in jobs} == {"k8s-0", "k8s-1", "k8s-2"}
    token = seen["HTTPS_PROXY"].split("@")[0].rsplit(":", 1)[1]
    assert token not in json.dumps(jobs) and len(token) > 20  # the credentials: in the Secret only
    assert secrets == []  # each deleted when its attempt ended
    assert cluster.requests[("create", "jobs")] == 3 and cluster.requests[("create", "secrets")] == 3
    # the end of the run deleted what it made
    assert cluster.objects("jobs") == [] and cluster.objects("configmaps") == []
    assert cluster.processes_running() == 0


def test_an_evaluator_runs_as_its_own_job_on_the_agents_output(tmp_path, proxy, cluster):
    agent = spec(tmp_path, cluster, evaluator=(sys.executable, str(AGENTS / "evaluator.py")),
                 reward_sources=("evaluator",))
    ctl = kube_controller(proxy, tmp_path, agent)

    async def go():
        r = await ctl.run({"task_id": "e1", "eval_reward": 0.75}, "judged", "g000001", 0)
        jobs = cluster.objects("jobs", "rl")
        await ctl.aclose()
        return r, jobs

    r, jobs = asyncio.run(go())
    assert (r.status, r.reward, r.reward_source) == ("ok", 0.75, "evaluator")
    assert "evaluating judged" in Path(r.stdout_path.with_name("judged~0.eval.out")).read_text()
    roles = sorted(j["metadata"]["labels"]["lgt/role"] for j in jobs)
    assert roles == ["agent", "evaluator"]  # a Job each, from the same template
    [ev] = [j for j in jobs if j["metadata"]["labels"]["lgt/role"] == "evaluator"]
    assert ev["spec"]["template"]["spec"]["containers"][0]["command"][-2:] == [
        f"{kube.MOUNT}/task.json", f"{kube.MOUNT}/agent-output.txt"]


@pytest.mark.parametrize("image,reason", [
    ("registry.invalid/pull-error:1", "the agent's container cannot start: ErrImagePull"),
    ("registry.invalid/unschedulable:1", "the pod cannot be scheduled: 0/1 nodes are available"),
    ("registry.invalid/oom:1", "killed for exceeding its memory limit (OOMKilled)"),
])
def test_a_pod_that_cannot_run_fails_at_once_with_the_reason_and_is_retried(tmp_path, proxy, cluster,
                                                                             image, reason):
    agent = spec(tmp_path, cluster, job_template=template(tmp_path, image=image), timeout_s=60, retries=1)
    ctl = kube_controller(proxy, tmp_path, agent)
    t0 = time.monotonic()
    rid = "doomed-" + image.split("/")[1].split(":")[0]
    [r] = asyncio.run(run_and_close(ctl, [({"task_id": "t", "sleep": 5}, rid)]))
    assert time.monotonic() - t0 < 15  # not at the 60 s deadline
    assert r.status == "failed" and r.attempt == 1 and reason in r.error
    assert [(a["attempt"], a["status"]) for a in attempts(proxy, rid)] == [(0, "failed"), (1, "failed")]
    assert reason in json.loads(attempts(proxy, rid)[0]["metadata_json"])["error"]
    assert cluster.objects("jobs") == [] and cluster.processes_running() == 0


def test_an_evicted_pod_fails_its_attempt_and_the_retry_runs(tmp_path, proxy, cluster):
    agent = spec(tmp_path, cluster, retries=1)
    ctl = kube_controller(proxy, tmp_path, agent)

    async def go():
        run = asyncio.create_task(ctl.run({"task_id": "t", "sleep": 3, "rewards": {"stdout": 1}}, "evicted",
                                          "g000001", 0))
        while not [p for p in cluster.objects("pods", "rl") if p["status"].get("phase") == "Running"]:
            await asyncio.sleep(0.05)
        [pod] = cluster.objects("pods", "rl")
        cluster.evict(pod["metadata"]["name"], "rl")
        try:
            return await run
        finally:
            await ctl.aclose()

    r = asyncio.run(go())
    assert (r.status, r.attempt, r.reward) == ("ok", 1, 1.0)
    [first, _] = attempts(proxy, "evicted")
    assert "the pod was evicted: The node was low on resource: memory." in \
        json.loads(first["metadata_json"])["error"]


def test_the_deadline_is_the_rollout_timeout(tmp_path, proxy, cluster, pid_dir):
    agent = spec(tmp_path, cluster, job_template=template(tmp_path, "sleeper_agent.py"), timeout_s=1,
                 env={"TASK_PID_DIR": str(pid_dir)})
    ctl = kube_controller(proxy, tmp_path, agent)
    t0 = time.monotonic()
    [r] = asyncio.run(run_and_close(ctl, [({"task_id": "t"}, "slow")]))
    assert r.status == "timeout" and time.monotonic() - t0 < 10
    assert "ran past its 1 s timeout" in r.error
    assert cluster.processes_running() == 0


def test_watches_that_expire_mid_run_are_listed_again(tmp_path, proxy, cluster):
    ctl = kube_controller(proxy, tmp_path, spec(tmp_path, cluster))

    async def go():
        run = asyncio.gather(*(ctl.run({"task_id": f"t{i}", "sleep": 1.5, "rewards": {"stdout": 1}},
                                       f"w{i}", "g000001", 0) for i in range(2)))
        while len(cluster.objects("pods", "rl")) < 2:
            await asyncio.sleep(0.05)
        cluster.expire_watches()  # 410 Gone for every open watch, while both rollouts run
        try:
            return await run
        finally:
            await ctl.aclose()

    results = asyncio.run(go())
    assert [r.status for r in results] == ["ok", "ok"]
    assert cluster.requests[("list", "jobs")] >= 2 and cluster.requests[("list", "pods")] >= 2  # re-listed


def test_a_restarted_controller_adopts_the_runs_jobs_and_never_creates_one_twice(tmp_path, proxy, cluster):
    agent = spec(tmp_path, cluster)
    tasks = [({"task_id": f"t{i}", "sleep": 1.0 + i, "rewards": {"stdout": 0.5}}, f"a{i}") for i in range(3)]

    async def crash_then_resume():
        first = kube_controller(proxy, tmp_path, agent)
        running = asyncio.gather(*(first.run(task, rid, "g000001", 0) for task, rid in tasks))
        while len(cluster.objects("pods", "rl")) < 3:
            await asyncio.sleep(0.05)
        running.cancel()  # the controller dies: its Jobs go on without it
        with contextlib.suppress(asyncio.CancelledError):
            await running
        await first.runner.jobs.aclose(delete=False)
        await asyncio.sleep(1.5)  # one Job finishes while no controller runs
        second = kube_controller(proxy, tmp_path, agent)
        existing = await second.existing_jobs()
        try:
            results = await asyncio.gather(*(second.run(task, rid, "g000001", 0) for task, rid in tasks))
            return existing, results
        finally:
            await second.aclose()

    existing, results = asyncio.run(crash_then_resume())
    assert sorted(j["rollout"] for j in existing) == ["a0", "a1", "a2"]
    assert [(r.status, r.attempt, r.reward) for r in results] == [("ok", 0, 0.5)] * 3
    assert cluster.requests[("create", "jobs")] == 3  # adopted, not made again
    assert cluster.objects("jobs") == [] and cluster.processes_running() == 0


# -- lgt-train run with Jobs ------------------------------------------------------------------------

@pytest.mark.slow
def test_lgt_train_runs_arith_as_jobs_and_a_killed_trainer_resumes_them(tmp_path, arith_model_dir, cluster,
                                                                        arith_engine):
    """``examples/arith`` trained with Jobs for 2 steps, the trainer killed with -9 in step 2 and resumed:
    Jobs that outlived it are adopted (none made twice), no rollout is lost, the run finishes."""
    from lgt.testing.runs import lgt_train, metrics, trained_ids, write_config

    job = template(tmp_path)
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["template"]["spec"]["containers"][0]["command"] = [sys.executable,
                                                                  str(ROOT / "examples/arith/agent.py")]
    job.write_text(yaml.safe_dump(doc))
    agent = {"runner": "kubernetes", "job_template": str(job), "namespace": "rl", "proxy_host": "127.0.0.1",
             "kubeconfig": str(cluster.write_kubeconfig(tmp_path / "kubeconfig")), "timeout_s": 90,
             "retries": 1, "env": {"OPENAI_BASE_URL": "https://api.openai.invalid/v1",
                                   "OPENAI_API_KEY": "sk-x"}}
    cfg = write_config(tmp_path, arith_model_dir, engine_url=arith_engine.url, agent=agent, steps=2,
                       eval=None)
    run_dir = tmp_path / "run"
    # the trainer kills itself (SIGKILL) in step 2's backend update: faults/sitecustomize.py
    faults = str(Path(__file__).parent / "faults")
    path = os.pathsep.join(filter(None, [faults, os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": path, "LGT_TEST_KILL_AT_TRAIN_STEP": "2"}
    out = lgt_train(str(cfg), "--run-dir", str(run_dir), env=env)
    assert out.returncode == -9, out.stderr[-3000:]
    assert [r["step"] for r in metrics(run_dir)] == [1]
    left = cluster.objects("jobs", "rl")
    assert left, "the killed trainer's Jobs outlive it"

    out = lgt_train(str(cfg), "--resume", str(run_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Job(s) adopted" in out.stderr
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    ids = trained_ids(rows)
    assert len(ids) == len(set(ids)), "a sample was trained twice"
    con = connect(run_dir / "store")
    try:
        recorded = set(con.execute("SELECT rollout_id, attempt FROM rollouts_log").fetchall())
        errors = [e for (e,) in con.execute("SELECT metadata_json FROM rollouts_log").fetchall()
                  if "cannot create" in (e or "")]
        calls = con.execute("SELECT count(*) FROM calls WHERE status = 'ok'").fetchone()[0]
    finally:
        con.close()
    assert errors == []  # a Job made twice would have been refused (409) and recorded so
    outlived = {(j["metadata"]["labels"]["lgt/rollout"], int(j["metadata"]["labels"]["lgt/attempt"]))
                for j in left}
    assert outlived <= recorded, "a Job that outlived the trainer was not collected"
    assert calls >= 16  # every rollout of both steps' groups made its call through the proxy
    assert cluster.objects("jobs") == [] and cluster.objects("configmaps") == []  # cleaned up at the end


# -- a real cluster (skipped here) -------------------------------------------------------------------

REAL_AGENT = """
import json, os, urllib.request
body = json.dumps({"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "2+3?"}]})
req = urllib.request.Request("https://api.openai.invalid/v1/chat/completions", data=body.encode(),
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=60) as r:  # HTTPS_PROXY and SSL_CERT_FILE from the Secret
    print(json.load(r)["choices"][0]["message"]["content"])
print(1.0)
"""


@pytest.mark.k8s
def test_a_real_cluster_runs_rollouts_as_jobs(tmp_path, upstream, request):
    """Against the cluster in $KUBECONFIG: LGT_K8S_IMAGE (any image with python3), LGT_K8S_PROXY_HOST
    (where its pods reach this machine, whose proxy listens on 0.0.0.0), LGT_K8S_NAMESPACE."""
    need = ("KUBECONFIG", "LGT_K8S_IMAGE", "LGT_K8S_PROXY_HOST")
    if not all(os.environ.get(v) for v in need):
        pytest.skip(f"needs a Kubernetes cluster: set {', '.join(need)}")
    job = template(tmp_path, image=os.environ["LGT_K8S_IMAGE"], command=["python3", "-c", REAL_AGENT])
    agent = AgentSpec(runner="kubernetes", job_template=job, namespace=os.environ.get("LGT_K8S_NAMESPACE",
                                                                                       "default"),
                      proxy_host=os.environ["LGT_K8S_PROXY_HOST"], timeout_s=300, retries=0)
    proxy_proc = type(request.getfixturevalue("proxy"))  # tests/conftest.py's ProxyProc
    proxy = proxy_proc(tmp_path / "store", upstream.url, "--listen-host", "0.0.0.0").start()
    try:
        ctl = kube_controller(proxy, tmp_path, agent)
        results = asyncio.run(run_and_close(ctl, [({"task_id": f"t{i}"}, f"real-{i}") for i in range(2)]))
    finally:
        proxy.stop()
    assert [(r.status, r.reward) for r in results] == [("ok", 1.0)] * 2
