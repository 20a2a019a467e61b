"""FakeKube driven by the real `kubernetes` client (v37), as the Jobs rollout runner will drive it.

How the client's Watch meets a 410 (kubernetes/watch/watch.py in v37): it never yields an ERROR event
whose Status has code 410. Without `timeout_seconds`, Watch.stream quietly reconnects once, from the last
resourceVersion it saw; if that is too old as well (as after expire_watches) it raises
ApiException(status=410, reason="Expired: too old resource version: N (M)"). With `timeout_seconds` it
raises at the first 410, without retrying. Other v37 details the tests rely on: delete_namespaced_job,
_secret and _config_map return the answer as a plain dict (a Status, or the object marked for deletion);
delete_namespaced_pod returns a V1Pod, delete_collection_namespaced_job a V1Status (of the JobList the
server answers); `timeout_seconds` must be an int.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

kubernetes = pytest.importorskip("kubernetes")
from kubernetes import client, config, watch  # noqa: E402
from kubernetes.client.exceptions import ApiException  # noqa: E402

from lgt.testing.fake_kube import FakeKube  # noqa: E402

NS = "default"
Json = dict[str, Any]


def connect(kube: FakeKube, tmp: Path) -> client.ApiClient:
    """A fresh ApiClient from the kubeconfig the fake writes."""
    return config.new_client_from_config(config_file=str(kube.write_kubeconfig(tmp / f"config-{kube.port}")))


@pytest.fixture(scope="module")
def kube() -> Iterator[FakeKube]:
    with FakeKube.in_thread() as k:
        yield k


@pytest.fixture(scope="module")
def api_client(kube: FakeKube, tmp_path_factory: pytest.TempPathFactory) -> client.ApiClient:
    return connect(kube, tmp_path_factory.mktemp("kube"))


@pytest.fixture(scope="module")
def batch(api_client: client.ApiClient) -> client.BatchV1Api:
    return client.BatchV1Api(api_client)


@pytest.fixture(scope="module")
def core(api_client: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api_client)


def wait_for(fn: Callable[[], Any], timeout: float = 5.0) -> Any:
    """fn()'s first truthy value, polled; fails after `timeout` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if value := fn():
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {fn}")


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def job_body(name: str, command: list[str], *, image: str = "python:3.11", env: Any = None,
             env_from: Any = None, args: Any = None, volume_mounts: Any = None, volumes: Any = None,
             owner_references: Any = None, **spec: Any) -> client.V1Job:
    container = client.V1Container(name="main", image=image, command=command, args=args, env=env,
                                   env_from=env_from, volume_mounts=volume_mounts)
    pod_spec = client.V1PodSpec(restart_policy="Never", containers=[container], volumes=volumes)
    template = client.V1PodTemplateSpec(metadata=client.V1ObjectMeta(labels={"app": "lgt"}), spec=pod_spec)
    return client.V1Job(metadata=meta(name, owner_references=owner_references),
                        spec=client.V1JobSpec(template=template, backoff_limit=0, **spec))


def meta(name: str, **kw: Any) -> client.V1ObjectMeta:
    return client.V1ObjectMeta(name=name, **kw)


def env_ref(name: str, **source: Any) -> client.V1EnvVar:
    return client.V1EnvVar(name=name, value_from=client.V1EnvVarSource(**source))


def terminal_condition(batch: client.BatchV1Api, name: str) -> client.V1JobCondition | None:
    """The Job's Complete or Failed condition, once it has one."""
    conditions = batch.read_namespaced_job(name, NS).status.conditions or []
    return next((c for c in conditions if c.type in ("Complete", "Failed") and c.status == "True"), None)


def job_pod(core: client.CoreV1Api, job: str) -> client.V1Pod:
    pods = core.list_namespaced_pod(NS, label_selector=f"job-name={job}").items
    assert len(pods) == 1, [p.metadata.name for p in pods]
    return pods[0]


def running_pod(core: client.CoreV1Api, job: str) -> client.V1Pod:
    return wait_for(lambda: (p := job_pod(core, job)).status.phase == "Running" and p)


def waiting_reason(core: client.CoreV1Api, job: str) -> str | None:
    statuses = job_pod(core, job).status.container_statuses or []
    return statuses[0].state.waiting.reason if statuses and statuses[0].state.waiting else None


def pod_events(core: client.CoreV1Api, pod: client.V1Pod) -> list[client.CoreV1Event]:
    return core.list_namespaced_event(NS, field_selector=f"involvedObject.uid={pod.metadata.uid}").items


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_job_runs_with_secrets_and_the_watch_sees_it_complete(kube, batch, core) -> None:
    for name, data in (("env-secret", {"X": "from-secret"}), ("file-secret", {"token": "s3cret"})):
        core.create_namespaced_secret(NS, client.V1Secret(metadata=meta(name), string_data=data))
    requests = kube.requests
    start = batch.list_namespaced_job(NS).metadata.resource_version
    # A local process cannot see /etc/creds: the fake rewrites argv elements and env values starting with it.
    code = ("import os, sys; print('hello'); print(os.environ['X']); "
            "print(open(os.environ['TOKEN_PATH']).read()); print(sys.argv[1:4]); "
            "print(open(sys.argv[4]).read(), os.environ['POD'], os.environ['APP'])")
    body = job_body(
        "hello", py(code), args=["$(X)", "$$(X)", "$(UNDEFINED)", "/etc/creds/token"],
        env_from=[client.V1EnvFromSource(secret_ref=client.V1SecretEnvSource(name="env-secret"))],
        env=[env_ref("POD", field_ref=client.V1ObjectFieldSelector(field_path="metadata.name")),
             env_ref("APP", field_ref=client.V1ObjectFieldSelector(field_path="metadata.labels['app']")),
             client.V1EnvVar(name="TOKEN_PATH", value="/etc/creds/token")],
        volume_mounts=[client.V1VolumeMount(name="creds", mount_path="/etc/creds", read_only=True)],
        volumes=[client.V1Volume(name="creds",
                                 secret=client.V1SecretVolumeSource(secret_name="file-secret"))])
    created = batch.create_namespaced_job(NS, body)
    assert created.metadata.uid and created.metadata.creation_timestamp and created.spec.backoff_limit == 0
    assert created.spec.template.metadata.labels["controller-uid"] == created.metadata.uid

    events, w = [], watch.Watch()
    for event in w.stream(batch.list_namespaced_job, NS, resource_version=start, timeout_seconds=10):
        events.append((event["type"], event["object"]))
        if any(c.status == "True" for c in event["object"].status.conditions or []):
            w.stop()
    types, final = [t for t, _ in events], events[-1][1]
    assert types[0] == "ADDED" and set(types[1:]) == {"MODIFIED"}, types
    assert isinstance(final, client.V1Job)
    assert [(c.type, c.status) for c in final.status.conditions] == [("SuccessCriteriaMet", "True"),
                                                                    ("Complete", "True")]
    assert final.status.succeeded == 1 and final.status.completion_time and not final.status.active

    pod = job_pod(core, "hello")
    assert re.fullmatch(r"hello-[a-z0-9]{5}", pod.metadata.name)
    assert pod.metadata.labels["app"] == "lgt"
    assert pod.metadata.labels["batch.kubernetes.io/job-name"] == "hello"
    owner = pod.metadata.owner_references[0]
    assert (owner.kind, owner.name, owner.uid, owner.controller) == ("Job", "hello", created.metadata.uid,
                                                                     True)
    terminated = pod.status.container_statuses[0].state.terminated
    assert (pod.status.phase, terminated.exit_code, terminated.reason) == ("Succeeded", 0, "Completed")
    assert terminated.started_at and terminated.finished_at
    log = core.read_namespaced_pod_log(pod.metadata.name, NS).splitlines()
    assert log == ["hello", "from-secret", "s3cret", "['from-secret', '$(X)', '$(UNDEFINED)']",
                   f"s3cret {pod.metadata.name} lgt"], log
    assert [e.reason for e in pod_events(core, pod)] == ["Scheduled", "Started"]
    assert kube.requests - requests == {("list", "jobs"): 1, ("create", "jobs"): 1, ("watch", "jobs"): 1,
                                        ("list", "pods"): 1, ("get", "pods/log"): 1, ("list", "events"): 1}


def test_lists_selectors_and_patches(core) -> None:
    for name, labels in (("cm-a", {"app": "lgt", "tier": "x"}), ("cm-b", {"app": "lgt"}),
                         ("cm-c", {"app": "other"})):
        core.create_namespaced_config_map(NS, client.V1ConfigMap(
            metadata=meta(name, labels=labels), data={"k": name}))

    def names(**kw: str) -> list[str]:
        return [c.metadata.name for c in core.list_namespaced_config_map(NS, **kw).items]

    assert names(label_selector="app=lgt") == ["cm-a", "cm-b"]
    assert names(label_selector="app=lgt,tier") == ["cm-a"]
    assert names(label_selector="app,!tier") == ["cm-b", "cm-c"]
    assert names(label_selector="app in (other, nope)") == ["cm-c"]
    assert names(field_selector="metadata.name=cm-b") == ["cm-b"]
    listed = core.list_namespaced_config_map(NS, label_selector="app")
    newest = max(int(c.metadata.resource_version) for c in listed.items)
    assert int(listed.metadata.resource_version) >= newest
    assert listed.kind == "ConfigMapList" and listed.items[0].kind is None  # list items carry no kind

    patch = {"metadata": {"labels": {"tier": "y", "app": None}}}  # sent as a strategic merge patch
    patched = core.patch_namespaced_config_map("cm-c", NS, patch)
    assert patched.metadata.labels == {"tier": "y"} and patched.data == {"k": "cm-c"}
    assert int(patched.metadata.resource_version) > int(listed.metadata.resource_version)
    merged = core.patch_namespaced_config_map("cm-c", NS, {"data": {"k2": "v"}},
                                              _content_type="application/merge-patch+json")
    assert merged.data == {"k": "cm-c", "k2": "v"}
    stale = {"metadata": {"resourceVersion": listed.metadata.resource_version}, "data": {}}
    with pytest.raises(ApiException) as e:
        core.patch_namespaced_config_map("cm-c", NS, stale)
    assert e.value.status == 409 and json.loads(e.value.body)["reason"] == "Conflict"


def test_errors_are_status_objects(kube, batch, core, tmp_path) -> None:
    with pytest.raises(ApiException) as e:
        batch.read_namespaced_job("nope", NS)
    assert e.value.status == 404
    assert json.loads(e.value.body) == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": 'jobs.batch "nope" not found', "reason": "NotFound",
        "details": {"name": "nope", "group": "batch", "kind": "jobs"}, "code": 404}
    with pytest.raises(ApiException) as e:
        core.read_namespaced_pod_log("nope", NS)
    assert e.value.status == 404 and json.loads(e.value.body)["message"] == 'pods "nope" not found'

    core.create_namespaced_config_map(NS, client.V1ConfigMap(metadata=meta("dup")))
    with pytest.raises(ApiException) as e:
        core.create_namespaced_config_map(NS, client.V1ConfigMap(metadata=meta("dup")))
    assert e.value.status == 409 and json.loads(e.value.body)["reason"] == "AlreadyExists"

    bad = job_body("bad-restart", py("pass"))
    bad.spec.template.spec.restart_policy = None  # defaults to Always, which a Job may not have
    with pytest.raises(ApiException) as e:
        batch.create_namespaced_job(NS, bad)
    assert e.value.status == 422
    assert 'restartPolicy: Unsupported value: "Always"' in json.loads(e.value.body)["message"]

    stranger = FakeKube(port=kube.port)  # the same address, another token
    with pytest.raises(ApiException) as e:
        client.CoreV1Api(connect(stranger, tmp_path)).list_namespaced_pod(NS)
    assert e.value.status == 401 and json.loads(e.value.body)["reason"] == "Unauthorized"


def test_generate_name_and_a_deleted_pod_fails_its_job(batch, core) -> None:
    body = job_body("", py("import time; time.sleep(30)"))
    body.metadata.name, body.metadata.generate_name = None, "gen-"
    name = batch.create_namespaced_job(NS, body).metadata.name
    assert re.fullmatch(r"gen-[a-z0-9]{5}", name)
    pod = running_pod(core, name)
    deleted = core.delete_namespaced_pod(pod.metadata.name, NS)
    assert isinstance(deleted, client.V1Pod) and deleted.metadata.deletion_timestamp is not None
    condition = wait_for(lambda: terminal_condition(batch, name))
    assert (condition.type, condition.reason) == ("Failed", "BackoffLimitExceeded")


def test_a_missing_secret_holds_the_container_until_it_exists(batch, core) -> None:
    body = job_body("late", py("import os; print(os.environ['LATE'])"), env=[
        env_ref("LATE", secret_key_ref=client.V1SecretKeySelector(name="late-secret", key="value")),
        env_ref("NONE", config_map_key_ref=client.V1ConfigMapKeySelector(name="no", key="k", optional=True))])
    batch.create_namespaced_job(NS, body)
    assert wait_for(lambda: waiting_reason(core, "late")) == "CreateContainerConfigError"
    pod = job_pod(core, "late")
    assert pod.status.container_statuses[0].state.waiting.message == 'secret "late-secret" not found'
    assert [(e.type, e.reason, e.message) for e in pod_events(core, pod)][-1] == (
        "Warning", "Failed", 'Error: secret "late-secret" not found')
    core.create_namespaced_secret(NS, client.V1Secret(metadata=meta("late-secret"),
                                                      string_data={"value": "here at last"}))
    assert wait_for(lambda: terminal_condition(batch, "late")).type == "Complete"
    assert core.read_namespaced_pod_log(pod.metadata.name, NS) == "here at last\n"
    assert batch.read_namespaced_job_status("late", NS).status.succeeded == 1


def test_following_a_log_streams_until_the_process_ends(batch, core) -> None:
    code = "import time; print('a', flush=True); time.sleep(0.3); print('b', flush=True)"
    batch.create_namespaced_job(NS, job_body("chatty", py(code)))
    pod = running_pod(core, "chatty")
    t0 = time.monotonic()
    lines = list(watch.Watch().stream(core.read_namespaced_pod_log, pod.metadata.name, NS, follow=True,
                                      _request_timeout=5))
    assert lines == ["a", "b"] and time.monotonic() - t0 > 0.2
    assert core.read_namespaced_pod_log(pod.metadata.name, NS, tail_lines=1) == "b\n"


def test_nonzero_exit_fails_the_job(batch, core) -> None:
    code = "import sys; print('bye', file=sys.stderr); sys.exit(3)"
    batch.create_namespaced_job(NS, job_body("exit3", py(code)))
    condition = wait_for(lambda: terminal_condition(batch, "exit3"))
    assert (condition.type, condition.reason) == ("Failed", "BackoffLimitExceeded")
    job = batch.read_namespaced_job("exit3", NS)
    assert job.status.failed == 1 and job.status.succeeded is None and job.status.completion_time is None
    pod = job_pod(core, "exit3")
    terminated = pod.status.container_statuses[0].state.terminated
    assert (pod.status.phase, terminated.exit_code, terminated.reason) == ("Failed", 3, "Error")
    assert core.read_namespaced_pod_log(pod.metadata.name, NS) == "bye\n"


def test_active_deadline_kills_the_process(batch, core) -> None:
    t0 = time.monotonic()
    code = "import os, time; print(os.getpid(), flush=True); time.sleep(60)"
    batch.create_namespaced_job(NS, job_body("slow", py(code), active_deadline_seconds=1))
    condition = wait_for(lambda: terminal_condition(batch, "slow"))
    assert (condition.type, condition.reason) == ("Failed", "DeadlineExceeded")
    assert 0.9 < time.monotonic() - t0 < 4
    pod = job_pod(core, "slow")
    assert (pod.status.phase, pod.status.reason) == ("Failed", "DeadlineExceeded")
    assert pod.status.container_statuses[0].state.terminated.exit_code == 137
    assert wait_for(lambda: gone(int(core.read_namespaced_pod_log(pod.metadata.name, NS))))


def test_image_pull_error(batch, core) -> None:
    batch.create_namespaced_job(NS, job_body("pull", py("pass"), image="registry.example/pull-error:1"))
    assert wait_for(lambda: waiting_reason(core, "pull")) in ("ErrImagePull", "ImagePullBackOff")
    assert wait_for(lambda: waiting_reason(core, "pull") == "ImagePullBackOff")
    pod = job_pod(core, "pull")
    assert pod.status.phase == "Pending"
    warnings = [e for e in pod_events(core, pod) if e.type == "Warning"]
    assert [e.reason for e in warnings] == ["Failed"] and "not found" in warnings[0].message
    assert warnings[0].involved_object.kind == "Pod" and warnings[0].involved_object.uid == pod.metadata.uid
    assert warnings[0].count == 1 and warnings[0].first_timestamp
    assert warnings[0].source.component == "kubelet"
    with pytest.raises(ApiException) as e:
        core.read_namespaced_pod_log(pod.metadata.name, NS)
    assert e.value.status == 400
    assert "is waiting to start: ImagePullBackOff" in json.loads(e.value.body)["message"]
    assert terminal_condition(batch, "pull") is None


def test_invalid_image_name(batch, core) -> None:
    batch.create_namespaced_job(NS, job_body("badimage", py("pass"), image="Python:3.11"))
    assert wait_for(lambda: waiting_reason(core, "badimage")) == "InvalidImageName"
    pod = job_pod(core, "badimage")
    assert "invalid reference format" in pod.status.container_statuses[0].state.waiting.message
    assert [(e.type, e.reason) for e in pod_events(core, pod)][-1] == ("Warning", "InspectFailed")


def test_unschedulable(batch, core) -> None:
    batch.create_namespaced_job(NS, job_body("huge", py("pass"), image="unschedulable/python"))

    def scheduled() -> client.V1PodCondition | None:
        conditions = job_pod(core, "huge").status.conditions or []
        return next((c for c in conditions if c.type == "PodScheduled"), None)
    condition = wait_for(scheduled)
    assert (condition.status, condition.reason) == ("False", "Unschedulable")
    assert condition.message == "0/1 nodes are available: 1 Insufficient cpu."
    pod = job_pod(core, "huge")
    assert pod.status.phase == "Pending" and pod.spec.node_name is None
    assert [(e.type, e.reason) for e in pod_events(core, pod)] == [("Warning", "FailedScheduling")]


def test_oom_killed(batch, core) -> None:
    batch.create_namespaced_job(NS, job_body("oom", py("import time; time.sleep(30)"), image="python-oom"))
    assert wait_for(lambda: terminal_condition(batch, "oom")).type == "Failed"
    pod = job_pod(core, "oom")
    terminated = pod.status.container_statuses[0].state.terminated
    assert (pod.status.phase, terminated.reason, terminated.exit_code) == ("Failed", "OOMKilled", 137)


def test_evict(kube, batch, core) -> None:
    batch.create_namespaced_job(NS, job_body("evictee", py("import time; time.sleep(30)")))
    kube.evict(running_pod(core, "evictee").metadata.name)
    assert wait_for(lambda: terminal_condition(batch, "evictee")).type == "Failed"
    pod = job_pod(core, "evictee")
    assert (pod.status.phase, pod.status.reason, pod.status.message) == (
        "Failed", "Evicted", "The node was low on resource: memory.")
    assert pod.status.container_statuses[0].state.terminated.exit_code == 137
    assert "Evicted" in [e.reason for e in pod_events(core, pod)]


def test_garbage_collection_follows_owner_references(batch, core) -> None:
    owner = core.create_namespaced_config_map(NS, client.V1ConfigMap(metadata=meta("owner")))
    ref = client.V1OwnerReference(api_version="v1", kind="ConfigMap", name="owner", uid=owner.metadata.uid)
    core.create_namespaced_secret(NS, client.V1Secret(
        metadata=meta("owned", owner_references=[ref]), string_data={"a": "b"}))
    code = "import os, time; print(os.getpid(), flush=True); time.sleep(60)"
    batch.create_namespaced_job(NS, job_body("owned", py(code), owner_references=[ref]))
    pod = running_pod(core, "owned")
    pid = int(wait_for(lambda: core.read_namespaced_pod_log(pod.metadata.name, NS)))
    start = core.list_namespaced_pod(NS).metadata.resource_version

    status = core.delete_namespaced_config_map("owner", NS)
    assert status["status"] == "Success" and status["details"]["uid"] == owner.metadata.uid
    for read in (lambda: batch.read_namespaced_job("owned", NS),
                 lambda: core.read_namespaced_secret("owned", NS),
                 lambda: core.read_namespaced_pod(pod.metadata.name, NS)):
        with pytest.raises(ApiException) as e:
            read()
        assert e.value.status == 404
    assert wait_for(lambda: gone(pid))
    seen = [(e["type"], e["object"].metadata.name) for e in watch.Watch().stream(
        core.list_namespaced_pod, NS, resource_version=start, timeout_seconds=1)]
    assert seen[-1] == ("DELETED", pod.metadata.name), seen


def test_deleting_a_job_orphans_its_pods_unless_told(kube, batch, core) -> None:
    for name in ("orphaner", "cascader"):
        batch.create_namespaced_job(NS, job_body(name, py("import time; time.sleep(60)")))
        running_pod(core, name)
    answer, _, headers = batch.delete_namespaced_job_with_http_info("orphaner", NS)  # batch/v1: Orphan
    assert "child pods are preserved by default" in headers["Warning"]
    assert answer["metadata"]["finalizers"] == ["orphan"] and answer["metadata"]["deletionTimestamp"]
    pod = job_pod(core, "orphaner")
    assert pod.status.phase == "Running" and not pod.metadata.owner_references
    batch.delete_namespaced_job("cascader", NS, propagation_policy="Foreground")
    assert core.list_namespaced_pod(NS, label_selector="job-name=cascader").items == []
    assert wait_for(lambda: kube.processes_running() == 1)  # the orphan's; the cascader's went with its Job
    core.delete_namespaced_pod(pod.metadata.name, NS)
    assert wait_for(lambda: kube.processes_running() == 0)


def test_delete_collection_by_label(kube, batch, core) -> None:
    for name in ("sweep-a", "sweep-b"):
        body = job_body(name, py("import time; time.sleep(60)"))
        body.metadata.labels = {"sweep": "yes"}
        batch.create_namespaced_job(NS, body)
        running_pod(core, name)
    answer = batch.delete_collection_namespaced_job(NS, label_selector="sweep=yes",
                                                    propagation_policy="Background")
    assert answer.kind == "JobList"  # the deleted Jobs, read by v37 as a V1Status
    assert batch.list_namespaced_job(NS, label_selector="sweep").items == []
    assert core.list_namespaced_pod(NS, label_selector="job-name in (sweep-a, sweep-b)").items == []
    assert wait_for(lambda: kube.processes_running() == 0)
    assert kube.requests[("deletecollection", "jobs")] == 1


def test_ttl_deletes_the_finished_job(batch, core) -> None:
    batch.create_namespaced_job(NS, job_body("short-lived", py("pass"), ttl_seconds_after_finished=1))
    wait_for(lambda: terminal_condition(batch, "short-lived"))
    t0 = time.monotonic()
    assert wait_for(lambda: not batch.list_namespaced_job(NS, field_selector="metadata.name=short-lived")
                    .items, timeout=3)
    assert 0.5 < time.monotonic() - t0 < 2
    assert core.list_namespaced_pod(NS, label_selector="job-name=short-lived").items == []


def test_expire_watches_reaches_the_client_as_410(kube, core) -> None:
    watches = kube.requests[("watch", "configmaps")]
    start = core.list_namespaced_config_map(NS).metadata.resource_version
    core.create_namespaced_config_map(NS, client.V1ConfigMap(metadata=meta("watched")))
    w = watch.Watch()
    stream = w.stream(core.list_namespaced_config_map, NS, resource_version=start)  # no timeout: it retries
    first = next(stream)
    assert (first["type"], first["object"].metadata.name) == ("ADDED", "watched")
    threading.Timer(0.2, kube.expire_watches).start()
    guard = threading.Timer(5, w.stop)  # a fake that failed to expire would otherwise hang the test
    guard.start()
    with pytest.raises(ApiException) as e:
        next(stream)  # the open watch ends with a 410; the client tries once more, is refused, raises
    guard.cancel()
    assert e.value.status == 410 and e.value.reason.startswith("Expired: too old resource version: ")
    assert kube.requests[("watch", "configmaps")] - watches == 2


def test_too_old_resource_version_on_the_wire(tmp_path) -> None:
    with FakeKube.in_thread(history=3) as small:
        core = client.CoreV1Api(connect(small, tmp_path))
        for i in range(5):  # resourceVersions 2..6 (1 is the empty store's); the history keeps 4..6
            core.create_namespaced_config_map(NS, client.V1ConfigMap(metadata=meta(f"c{i}")))

        def watch_lines(rv: str) -> list[Json]:
            resp = core.list_namespaced_config_map(NS, watch=True, resource_version=rv, timeout_seconds=1,
                                                   _preload_content=False)
            return [json.loads(line) for line in resp.data.decode().splitlines()]

        assert watch_lines("2") == [{"type": "ERROR", "object": {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "too old resource version: 2 (3)", "reason": "Expired", "code": 410}}]
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in watch_lines("3")] == [
            ("ADDED", "c2"), ("ADDED", "c3"), ("ADDED", "c4")]
        assert [o["metadata"]["name"] for o in small.objects("ConfigMap")] == ["c0", "c1", "c2", "c3", "c4"]


def test_close_kills_every_process(tmp_path) -> None:
    pid_file = tmp_path / "pid"
    with FakeKube.in_thread() as k:
        code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
        client.BatchV1Api(connect(k, tmp_path)).create_namespaced_job(NS, job_body("forever", py(code)))
        wait_for(lambda: pid_file.exists() and pid_file.read_text())
        assert k.processes_running() == 1
    assert wait_for(lambda: gone(int(pid_file.read_text())))



def test_async_client_against_the_fake_on_its_own_loop(tmp_path) -> None:
    """The fake as an async context manager, driven by kubernetes.aio on the same event loop."""
    pytest.importorskip("kubernetes.aio")
    from kubernetes.aio import client as aclient
    from kubernetes.aio import config as aconfig
    from kubernetes.aio import watch as awatch

    async def main() -> tuple[list[str], str]:  # fresh: its first list answers the empty store's version
        async with FakeKube() as k:
            config_file = str(k.write_kubeconfig(tmp_path / "config"))
            async with await aconfig.new_client_from_config(config_file=config_file) as api:
                batch, core = aclient.BatchV1Api(api), aclient.CoreV1Api(api)
                start = (await batch.list_namespaced_job(NS)).metadata.resource_version
                await batch.create_namespaced_job(NS, client.ApiClient().sanitize_for_serialization(
                    job_body("aio", py("print('from aio')"))))
                types = []
                async with awatch.Watch() as w:
                    async for event in w.stream(batch.list_namespaced_job, NS, resource_version=start,
                                                timeout_seconds=10):
                        types.append(event["type"])
                        if event["object"].status.succeeded:
                            w.stop()
                pod = k.objects("Pod")[0]["metadata"]["name"]
                return types, await core.read_namespaced_pod_log(pod, NS)

    types, log = asyncio.run(main())
    assert types[0] == "ADDED" and types[-1] == "MODIFIED" and log == "from aio\n"
