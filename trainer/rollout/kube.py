"""Rollouts as Kubernetes Jobs (``agent: {runner: kubernetes, job_template: job.yaml, namespace: …}``).

One Job per rollout attempt, made from the user's template (a Job manifest; its first container runs
the agent). The controller adds, and owns:

* labels ``lgt/run``, ``lgt/group``, ``lgt/rollout``, ``lgt/attempt`` on the Job and its pod
  template; ``backoffLimit: 0`` (a retry is a new attempt, decided by the controller as for local
  processes), ``activeDeadlineSeconds`` from ``agent.timeout_s``, ``ttlSecondsAfterFinished``,
  ``restartPolicy: Never``;
* a Secret per attempt holding what carries the rollout's credentials — the proxy variables
  (``HTTPS_PROXY`` with the rollout's token, ``LGT_PROXY_BASE_URL``, agent variables whose value
  names them) — plus the proxy's CA certificate and the task as files, mounted at
  :data:`MOUNT`; the pod spec never holds a credential in clear. The task's ``TASK_*`` variables,
  ``TASK_ID``, ``TASK_JSON`` (the mounted file) and the CA variables are plain ``env``;
* owner references to one ConfigMap per run (``lgt-run-<key>``): deleting it deletes everything the
  run made. The Secret is deleted as soon as its attempt ends; the Job is left for
  ``ttlSecondsAfterFinished`` (its pod's log stays readable with ``kubectl logs``).

Jobs and pods are watched, not polled: one watch each, by label, from the resourceVersion of a list,
re-listed when the API answers 410 Gone. An attempt ends when its Job completes or fails — or at
once, with the reason, when its pod cannot run: an image that cannot be pulled, a pod that cannot be
scheduled, a container killed for its memory limit (OOMKilled), an evicted pod. The pod's log becomes
the attempt's stdout file (so a last-line reward works as for local processes; the proxy's reward
endpoint and an evaluator do too; a reward *file* cannot: it would be in the pod).

Creation is rate-limited (``agent.jobs_per_s``); the number in flight is the controller's
concurrency (``max_inflight``). A controller restarted on the same run directory (``lgt-train run
--resume``) finds the run's Jobs by label: an attempt whose Job exists is adopted — waited for if it
is still running, collected if it finished while the controller was down — never created twice.
``aclose()`` deletes what the run created.

The client is the official ``kubernetes`` package (blocking: its calls run in threads, its watches
in one thread each).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

log = logging.getLogger("lgt.trainer.rollout.kube")

MOUNT = "/var/run/lgt"  # where the attempt's Secret (CA certificate, task JSON) is mounted
LABEL = "lgt"  # label prefix: lgt/run, lgt/group, lgt/rollout, lgt/attempt
# pod states that will not get better by waiting: the attempt fails at once, with the reason
WAITING_FATAL = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
                 "CreateContainerError", "ErrImageNeverPull"}
WATCH_TIMEOUT_S = 60  # a watch is re-opened (from its resourceVersion) at least this often
API_THREADS = 32  # concurrent API calls (the client is blocking); also its connection pool's size


class KubeError(RuntimeError):
    """The Kubernetes API refused something the run needs; one sentence."""


def dns_name(*parts: str, limit: int = 63) -> str:
    """A DNS-1123 label from ``parts``: lower case, ``[a-z0-9-]``; a hash keeps distinct inputs apart
    when characters had to be replaced or the name cut."""
    raw = "-".join(parts)
    name = re.sub(r"[^a-z0-9-]+", "-", raw.lower()).strip("-")
    if name != raw or len(name) > limit:
        digest = hashlib.sha1(raw.encode()).hexdigest()[:8]
        name = f"{name[:limit - 9].rstrip('-')}-{digest}"
    return name


def label_value(value: str) -> str:
    """A label value (≤ 63 of ``[A-Za-z0-9._-]``, alphanumeric at both ends)."""
    v = re.sub(r"[^A-Za-z0-9._-]+", "_", value)[:63].strip("._-")
    return v or "none"


def run_key(run_dir: Path) -> str:
    """The run's name in the cluster: the same for a run directory and its ``--resume``."""
    return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:10]


def load_template(path: Path) -> dict[str, Any]:
    """The user's Job manifest; KubeError names what is wrong with it."""
    import yaml

    try:
        doc = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise KubeError(f"agent.job_template {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise KubeError(f"agent.job_template {path} is not valid YAML: {e}") from None
    if not isinstance(doc, dict) or doc.get("kind", "Job") != "Job":
        raise KubeError(f"agent.job_template {path} must be one Job manifest (kind: Job)")
    pod = ((doc.get("spec") or {}).get("template") or {}).get("spec") or {}
    containers = pod.get("containers")
    if not isinstance(containers, list) or not containers or not isinstance(containers[0], dict) \
            or not containers[0].get("image"):
        raise KubeError(f"agent.job_template {path}: spec.template.spec.containers[0] must name an image "
                        "(the container that runs the agent)")
    return doc


def pod_failure(pod: Mapping[str, Any]) -> str | None:
    """Why a pod will never run its agent to the end, or None while it still may."""
    status = pod.get("status") or {}
    if status.get("reason") == "Evicted":
        return f"the pod was evicted: {status.get('message') or 'no message'}"
    for cond in status.get("conditions") or ():
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" \
                and cond.get("reason") == "Unschedulable":
            return f"the pod cannot be scheduled: {cond.get('message') or 'no node fits it'}"
    for cs in status.get("containerStatuses") or ():
        state = cs.get("state") or {}
        waiting = state.get("waiting") or {}
        if waiting.get("reason") in WAITING_FATAL:
            return (f"the agent's container cannot start: {waiting['reason']}"
                    + (f" ({waiting['message']})" if waiting.get("message") else ""))
        terminated = state.get("terminated") or {}
        if terminated.get("reason") == "OOMKilled":
            return "the agent's container was killed for exceeding its memory limit (OOMKilled)"
    return None


def exit_code(pod: Mapping[str, Any] | None) -> int | None:
    for cs in ((pod or {}).get("status") or {}).get("containerStatuses") or ():
        terminated = (cs.get("state") or {}).get("terminated")
        if terminated and terminated.get("exitCode") is not None:
            return int(terminated["exitCode"])
    return None


def pod_outcome(pod: Mapping[str, Any]) -> str | None:
    """``complete``, ``deadline``, ``failed`` once the pod's container has ended — or None."""
    status = pod.get("status") or {}
    if status.get("phase") not in ("Succeeded", "Failed") or exit_code(pod) is None:
        return None
    if status.get("phase") == "Succeeded":
        return "complete"
    return "deadline" if status.get("reason") == "DeadlineExceeded" else "failed"


def job_outcome(job: Mapping[str, Any]) -> str | None:
    """``complete``, ``deadline``, ``failed`` — or None while the Job runs."""
    conds = [c for c in (job.get("status") or {}).get("conditions") or () if c.get("status") == "True"]
    if any(c.get("type") == "Complete" for c in conds):
        return "complete"
    if any(c.get("type") in ("Failed", "FailureTarget") and c.get("reason") == "DeadlineExceeded"
           for c in conds):  # FailureTarget: set before the Job's pods are stopped (Kubernetes ≥ 1.31)
        return "deadline"
    return "failed" if any(c.get("type") == "Failed" for c in conds) else None


class _RateLimit:
    """At most ``per_s`` acquisitions a second (a token bucket of one second's worth)."""

    def __init__(self, per_s: float) -> None:
        self.per_s, self.tokens, self.t = per_s, per_s, time.monotonic()
        self.lock = asyncio.Lock()

    async def acquire(self) -> None:
        async with self.lock:
            while True:
                now = time.monotonic()
                self.tokens = min(self.per_s, self.tokens + (now - self.t) * self.per_s)
                self.t = now
                if self.tokens >= 1:
                    self.tokens -= 1
                    return
                await asyncio.sleep((1 - self.tokens) / self.per_s)


class _Watch:
    """One resource kind watched by label in a thread: list, then watch from the list's
    resourceVersion; re-list on 410 Gone (or any broken stream). Each object is handed to
    ``on_object`` (in the event loop) on every change, and once from every list."""

    def __init__(self, name: str, list_fn: Callable[..., Any], namespace: str, selector: str,
                 loop: asyncio.AbstractEventLoop, on_object: Callable[[str, dict[str, Any]], None]) -> None:
        self.name, self.list_fn, self.namespace, self.selector = name, list_fn, namespace, selector
        self.loop, self.on_object = loop, on_object
        self.stopped = threading.Event()
        self.listed = threading.Event()
        self.relists = 0
        self.events = 0
        self._watch: Any = None
        self.thread = threading.Thread(target=self._run, name=f"lgt-watch-{name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        if self._watch is not None:
            self._watch.stop()

    def _relist(self) -> str:
        listed = self.list_fn(self.namespace, label_selector=self.selector, _preload_content=False)
        body = json.loads(listed.data)
        for item in body.get("items") or ():
            self.loop.call_soon_threadsafe(self.on_object, "LISTED", item)
        self.listed.set()
        return body["metadata"]["resourceVersion"]

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        rv = None
        while not self.stopped.is_set():
            try:
                if rv is None:
                    rv = self._relist()
                    self.relists += 1
                self._watch = watch.Watch()
                # deserialize=False: plain JSON, not the client's models (most of its CPU per event)
                for ev in self._watch.stream(self.list_fn, self.namespace, label_selector=self.selector,
                                             resource_version=rv, timeout_seconds=WATCH_TIMEOUT_S,
                                             allow_watch_bookmarks=True, deserialize=False):
                    if self.stopped.is_set():
                        break
                    obj = ev.get("object") or {}
                    kind = ev.get("type")
                    if kind == "ERROR":  # a 410 that the client passed on instead of raising
                        rv = None
                        break
                    rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                    if kind != "BOOKMARK":
                        self.events += 1
                        self.loop.call_soon_threadsafe(self.on_object, kind, obj)
            except ApiException as e:
                if e.status != 410:
                    log.warning("watching %s: %s; listing again", self.name, e.reason)
                    self.stopped.wait(1.0)
                rv = None
            except KeyError:  # the client (v37) reads an ERROR event's "raw_object", which only its
                rv = None     # deserializing path sets: that ERROR is the 410 Gone
            except Exception as e:  # noqa: BLE001 - a broken connection: list again, never stop
                if self.stopped.is_set():
                    break
                log.warning("watching %s: %s; listing again", self.name, e)
                self.stopped.wait(1.0)
                rv = None


class KubeRunner:
    """Runs rollout attempts as Jobs (see the module docstring). ``start()`` before the first
    ``execute()``; ``aclose()`` at the end."""

    def __init__(self, *, template: Path, namespace: str, run_dir: Path, run_name: str,
                 kubeconfig: Path | None = None, jobs_per_s: float = 50.0, ttl_s: int = 3600) -> None:
        self.template = load_template(template)
        self.namespace, self.run_dir, self.run_name = namespace, Path(run_dir), run_name
        self.key = run_key(run_dir)
        self.selector = f"{LABEL}/run={self.key}"
        self.kubeconfig, self.ttl_s = kubeconfig, ttl_s
        self.rate = _RateLimit(jobs_per_s)
        self.jobs: dict[str, dict[str, Any]] = {}  # Job name -> its latest object
        self.pods: dict[str, dict[str, Any]] = {}  # Job name -> its pod's latest object
        self.waiters: dict[str, asyncio.Future[str]] = {}
        self.adopted = 0
        self.parent: dict[str, Any] | None = None
        self._watches: list[_Watch] = []
        self._api: Any = None
        self._pool = ThreadPoolExecutor(API_THREADS, thread_name_prefix="lgt-kube")
        self._background: set[asyncio.Future[Any]] = set()

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A blocking client call on the runner's own threads (not the loop's default executor)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # -- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        from kubernetes import client, config

        def connect() -> Any:
            conf = client.Configuration()
            if self.kubeconfig is not None:
                config.load_kube_config(config_file=str(self.kubeconfig), client_configuration=conf)
            else:
                try:
                    config.load_incluster_config(client_configuration=conf)
                except config.ConfigException:
                    config.load_kube_config(client_configuration=conf)
            conf.connection_pool_maxsize = API_THREADS
            return client.ApiClient(conf)

        try:
            self._api = await self._call(connect)
        except Exception as e:
            raise KubeError(f"cannot load the Kubernetes client configuration: {e}") from None
        self.core, self.batch = client.CoreV1Api(self._api), client.BatchV1Api(self._api)
        self.parent = await self._call(self._ensure_parent)
        loop = asyncio.get_running_loop()
        self._watches = [
            _Watch("jobs", self.batch.list_namespaced_job, self.namespace, self.selector, loop, self._on_job),
            _Watch("pods", self.core.list_namespaced_pod, self.namespace, self.selector, loop, self._on_pod)]
        for w in self._watches:
            w.start()
        for w in self._watches:  # the run's Jobs as they are now: adopted by execute()
            await self._call(w.listed.wait, 30)

    async def aclose(self, *, delete: bool = True) -> None:
        """Stop watching; with ``delete``, delete the run's Jobs (their pods too), Secrets and the
        parent ConfigMap."""
        for w in self._watches:
            w.stop()
        for fut in self.waiters.values():
            if not fut.done():
                fut.set_result("closed")
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if delete and self._api is not None:
            await self._call(self._delete_all)
        if self._api is not None:
            await self._call(self._api.close)
        self._pool.shutdown(wait=False)

    def _ensure_parent(self) -> dict[str, Any]:
        from kubernetes.client.exceptions import ApiException

        name = f"lgt-run-{self.key}"
        body = {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": name, "labels": {f"{LABEL}/run": self.key,
                                                      f"{LABEL}/run-name": label_value(self.run_name)}},
                "data": {"run_dir": str(self.run_dir.resolve())}}
        try:
            made = self.core.create_namespaced_config_map(self.namespace, body)
        except ApiException as e:
            if e.status != 409:
                raise KubeError(f"cannot create the run's ConfigMap {name} in namespace {self.namespace}: "
                                f"{_reason(e)}") from None
            made = self.core.read_namespaced_config_map(name, self.namespace)
        return {"apiVersion": "v1", "kind": "ConfigMap", "name": name, "uid": made.metadata.uid,
                "blockOwnerDeletion": False}

    def _delete_all(self) -> None:
        from kubernetes.client.exceptions import ApiException

        for fn in (self.batch.delete_collection_namespaced_job,
                   self.core.delete_collection_namespaced_secret):
            with contextlib.suppress(ApiException):
                fn(self.namespace, label_selector=self.selector, propagation_policy="Background")
        if self.parent is not None:
            with contextlib.suppress(ApiException):
                self.core.delete_namespaced_config_map(self.parent["name"], self.namespace,
                                                       propagation_policy="Background")

    # -- watch events (in the event loop) -------------------------------------------------------------
    def _on_job(self, kind: str, job: dict[str, Any]) -> None:
        name = (job.get("metadata") or {}).get("name")
        if not name:
            return
        if kind == "DELETED":
            self.jobs.pop(name, None)
            self._resolve(name, "deleted")
            return
        self.jobs[name] = job
        outcome = job_outcome(job)
        if outcome is not None:
            self._resolve(name, outcome)

    def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        name = labels.get("job-name") or labels.get("batch.kubernetes.io/job-name")
        if not name or kind == "DELETED":
            return
        self.pods[name] = pod
        if pod_failure(pod) is not None:
            self._resolve(name, "pod")
        elif (outcome := pod_outcome(pod)) is not None:  # the pod ends before its Job says so
            self._resolve(name, outcome)

    def _resolve(self, name: str, outcome: str) -> None:
        fut = self.waiters.get(name)
        if fut is not None and not fut.done():
            fut.set_result(outcome)

    # -- one attempt ----------------------------------------------------------------------------------
    def job_name(self, rollout_id: str, attempt: int) -> str:
        return dns_name("lgt", self.key, rollout_id, str(attempt))

    def existing(self) -> list[dict[str, str]]:
        """The run's Jobs seen so far (after ``start()``: all that exist), as their lgt labels."""
        out = []
        for job in self.jobs.values():
            labels = (job.get("metadata") or {}).get("labels") or {}
            out.append({k.removeprefix(f"{LABEL}/"): v for k, v in labels.items()
                        if k.startswith(f"{LABEL}/")})
        return out

    async def execute(self, *, rollout_id: str, attempt: int, group_id: str | None, task_id: str,
                      step: int | None, plain_env: Mapping[str, str], secret_env: Mapping[str, str],
                      files: Mapping[str, bytes], timeout_s: float, stdout: Path,
                      stderr: Path, command: list[str] | None = None,
                      role: str = "agent") -> tuple[int | None, bool, str | None]:
        """Run one attempt as a Job (or adopt the one that exists); (exit code, timed out, error)
        as :meth:`~.controller.RolloutController._execute` returns them. ``role="evaluator"``:
        the attempt's evaluator Job, ``command`` replacing the template container's."""
        name = self.job_name(rollout_id, attempt) if role == "agent" else \
            dns_name("lgt", self.key, rollout_id, str(attempt), role)
        t0 = time.monotonic()
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.waiters[name] = fut
        try:
            if name in self.jobs:
                self.adopted += 1
                log.info("rollout %s attempt %d: adopting its Job %s", rollout_id, attempt, name)
            else:
                await self.rate.acquire()
                labels = {f"{LABEL}/run": self.key, f"{LABEL}/rollout": label_value(rollout_id),
                          f"{LABEL}/attempt": str(attempt), f"{LABEL}/group": label_value(group_id or "none"),
                          f"{LABEL}/task": label_value(task_id), f"{LABEL}/step": str(step or 0),
                          f"{LABEL}/role": role}
                error = await self._call(self._create, name, labels, plain_env, secret_env, files, timeout_s,
                                         command)
                if error is not None:
                    return None, False, error
            outcome = self._outcome_now(name)
            if outcome is None:
                try:  # activeDeadlineSeconds ends it; this only guards a cluster that never says so
                    outcome = await asyncio.wait_for(fut, timeout_s + 120)
                except TimeoutError:
                    outcome = "lost"
            if outcome == "failed" and time.monotonic() - t0 >= timeout_s:  # its pod stopped at the Job's
                outcome = "deadline"                                       # deadline, before the Job said so
            result = await self._call(self._finish, name, outcome, timeout_s, stdout, stderr)
            cleanup = asyncio.ensure_future(self._call(self._delete_secret, name))  # not waited for
            self._background.add(cleanup)
            cleanup.add_done_callback(self._background.discard)
            return result
        finally:
            self.waiters.pop(name, None)
            self.jobs.pop(name, None)
            self.pods.pop(name, None)

    def _outcome_now(self, name: str) -> str | None:
        job, pod = self.jobs.get(name), self.pods.get(name)
        if pod is not None and pod_failure(pod) is not None:
            return "pod"
        if pod is not None and pod_outcome(pod) is not None:
            return pod_outcome(pod)
        if job is not None and job_outcome(job) is not None:
            return job_outcome(job)
        return None

    def _create(self, name: str, labels: dict[str, str], plain_env: Mapping[str, str],
                secret_env: Mapping[str, str], files: Mapping[str, bytes], timeout_s: float,
                command: list[str] | None = None) -> str | None:
        from kubernetes.client.exceptions import ApiException

        assert self.parent is not None
        owner = [self.parent]
        data = {k: base64.b64encode(v.encode()).decode() for k, v in secret_env.items()}
        data.update({k: base64.b64encode(v).decode() for k, v in files.items()})
        secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                  "metadata": {"name": name, "labels": labels, "ownerReferences": owner}, "data": data}
        try:
            try:
                self.core.create_namespaced_secret(self.namespace, secret)
            except ApiException as e:
                if e.status != 409:
                    raise
                # left by an attempt that died before making its Job: this attempt's values instead
                self.core.patch_namespaced_secret(name, self.namespace, {"data": data})
        except ApiException as e:
            return f"cannot create the rollout's Secret {name}: {_reason(e)}"
        try:
            self.batch.create_namespaced_job(self.namespace, self.job(name, labels, plain_env, secret_env,
                                                                      files, timeout_s, command))
        except ApiException as e:
            with contextlib.suppress(ApiException):
                self.core.delete_namespaced_secret(name, self.namespace)
            return f"cannot create the rollout's Job {name}: {_reason(e)}"
        return None

    def job(self, name: str, labels: dict[str, str], plain_env: Mapping[str, str],
            secret_env: Mapping[str, str], files: Mapping[str, bytes], timeout_s: float,
            command: list[str] | None = None) -> dict[str, Any]:
        """The Job for one attempt: the template plus what the controller owns."""
        assert self.parent is not None
        job = copy.deepcopy(self.template)
        job["apiVersion"], job["kind"] = "batch/v1", "Job"
        meta = job.setdefault("metadata", {})
        meta.pop("generateName", None)
        meta["name"] = name
        meta.setdefault("labels", {}).update(labels)
        meta.setdefault("annotations", {})[f"{LABEL}/run-dir"] = str(self.run_dir.resolve())
        meta["ownerReferences"] = [self.parent]
        spec = job.setdefault("spec", {})
        spec.update(backoffLimit=0, completions=1, parallelism=1,
                    activeDeadlineSeconds=max(1, int(timeout_s)), ttlSecondsAfterFinished=self.ttl_s)
        template = spec.setdefault("template", {})
        template.setdefault("metadata", {}).setdefault("labels", {}).update(labels)
        pod = template.setdefault("spec", {})
        pod["restartPolicy"] = "Never"
        # what an agent never needs, unless the template says otherwise: the API server's token, a way
        # to gain privileges, capabilities
        pod.setdefault("automountServiceAccountToken", False)
        for container in pod["containers"]:
            sc = container.setdefault("securityContext", {})
            sc.setdefault("allowPrivilegeEscalation", False)
            sc.setdefault("capabilities", {"drop": ["ALL"]})
        pod.setdefault("volumes", []).append({"name": "lgt-rollout", "secret": {"secretName": name}})
        c = pod["containers"][0]
        if command is not None:  # an evaluator Job: the same image, its own command
            c["command"] = list(command)
            c.pop("args", None)
        ours = {*plain_env, *secret_env}
        env = [e for e in c.get("env") or () if e.get("name") not in ours]
        env += [{"name": k, "value": v} for k, v in plain_env.items()]
        env += [{"name": k, "valueFrom": {"secretKeyRef": {"name": name, "key": k}}} for k in secret_env]
        c["env"] = env
        c.setdefault("volumeMounts", []).append({"name": "lgt-rollout", "mountPath": MOUNT, "readOnly": True})
        return job

    def _delete_secret(self, name: str) -> None:
        from kubernetes.client.exceptions import ApiException

        with contextlib.suppress(ApiException):
            self.core.delete_namespaced_secret(name, self.namespace)

    def _read_pod(self, name: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            listed = self.core.list_namespaced_pod(self.namespace, label_selector=f"job-name={name}",
                                                   _preload_content=False)
        except ApiException:
            return None
        items = json.loads(listed.data).get("items") or []
        return items[0] if items else None

    def _finish(self, name: str, outcome: str, timeout_s: float, stdout: Path,
                stderr: Path) -> tuple[int | None, bool, str | None]:
        from kubernetes.client.exceptions import ApiException

        pod = self.pods.get(name)
        if outcome != "pod" and (pod is None or exit_code(pod) is None):  # the Job's watch event came
            pod = self._read_pod(name) or pod                            # first: the pod as it is now
        text = b""
        if pod is not None:
            try:
                text = self.core.read_namespaced_pod_log(pod["metadata"]["name"], self.namespace,
                                                         _preload_content=False).data
            except ApiException:
                pass
        stdout.write_bytes(text)
        stderr.write_bytes(b"")  # the pod's log holds both streams
        code = exit_code(pod)
        if outcome == "complete":
            return (0 if code is None else code), False, None
        if outcome == "deadline":
            return code, True, None
        why = pod_failure(pod) if pod is not None else None
        if outcome in ("pod", "lost", "deleted", "closed"):
            with contextlib.suppress(ApiException):  # a pod that cannot run would hold its node slot
                self.batch.delete_namespaced_job(name, self.namespace, propagation_policy="Background")
        if why is not None:
            return code, False, why
        if outcome == "failed":
            return (1 if code is None else code), False, None
        if outcome == "lost":
            return None, False, f"the Job {name} did not finish within {timeout_s + 120:g} s"
        if outcome == "deleted":
            return None, False, f"the Job {name} was deleted before it finished"
        return None, False, "the controller was closed before the Job finished"


def _reason(e: Any) -> str:
    """The API's own message of an ApiException."""
    try:
        return json.loads(e.body).get("message") or str(e.reason)
    except (TypeError, ValueError, AttributeError):
        return str(e.reason)
