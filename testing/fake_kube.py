"""A fake Kubernetes API server (aiohttp) for the official `kubernetes` client, with a "kubelet" that runs
each pod's first container as a local process: what the Jobs rollout runner is tested against.

Served for any namespace: batch/v1 jobs (/apis/batch/v1/namespaces/{ns}/jobs) and v1 pods, secrets,
configmaps, events (/api/v1/namespaces/{ns}/...): POST, GET (also .../{name}/status), list, watch, PATCH,
DELETE (of one, or of those a selector picks); and GET .../pods/{name}/log: text/plain, stdout and stderr
together, tailLines, follow=true streaming until the container has ended. Every request needs
`Authorization: Bearer <token>` (write_kubeconfig writes it), else a 401 Status.

Wire format, as kube-apiserver writes it:
* camelCase JSON; metadata.resourceVersion a string from one global counter (etcd's revision); uid a
  UUID; times RFC 3339 in whole seconds. Create answers 201 with server defaults filled in (a Job's
  selector and controller-uid/job-name template labels, backoffLimit 6, restartPolicy, imagePullPolicy;
  a Secret's stringData goes base64 into data). A list is {kind: JobList, apiVersion, metadata:
  {resourceVersion}, items}, and its items carry no kind/apiVersion. labelSelector: a=b, a!=b, a, !a,
  a in (x,y), a notin (x); fieldSelector: path=value or path!=value on any dotted field.
* Errors are Status objects: {kind: Status, apiVersion: v1, metadata: {}, status: Failure, message:
  'jobs.batch "x" not found', reason: NotFound, details: {name, group, kind: jobs}, code: 404}; also
  AlreadyExists 409, Conflict 409 (a patch naming a stale resourceVersion), Invalid 422 (a bad name, no
  containers or one without name or image, a Job whose restartPolicy is not Never/OnFailure), BadRequest
  400, UnsupportedMediaType 415.
* Watch: 200, then lines {"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": {...}}. resourceVersion
  unset or "0" starts with an ADDED per object; N replays the changes after N, then streams live ones.
  An object that comes into or leaves the selector arrives as ADDED or DELETED, as from the watch cache.
  The last `history` changes are kept; an older resourceVersion gets one ERROR line, a 410 Status with
  reason Expired and message "too old resource version: N (M)", and the stream ends. timeoutSeconds
  ends a watch; allowWatchBookmarks=true adds a BOOKMARK every BOOKMARK_S while idle.
* DELETE takes propagationPolicy (query, or the DeleteOptions body; orphanDependents too). Background
  removes the object, then its dependents: every object whose ownerReferences name its uid, unless
  another owner of it still exists (then only that reference goes). Foreground and Orphan first mark it
  (deletionTimestamp, finalizer foregroundDeletion/orphan), then deal with the dependents (Orphan drops
  their reference), then remove it. As in batch/v1, a Job deleted without a policy is Orphan -- its pods
  keep running -- and the answer has the apiserver's 299 Warning header. The answer is the marked object,
  or a Success Status if it went at once; a pod answers the pod, marked with its deletionTimestamp.

The kubelet. Each Job gets one pod <job>-<5 chars> (owner reference with controller: true). Every pod
goes Pending -> scheduled -> ContainerCreating -> Running -> Succeeded/Failed as MODIFIED events, with
Events from job-controller, default-scheduler and kubelet. Its first container runs in its own process
group: argv = command + args, `$(VAR)` expanded from the container's env ($$ gives $; without a command,
args run alone, as for an image without ENTRYPOINT); env = PATH and HOME of the host, HOSTNAME = the
pod, then envFrom and env (value, fieldRef, secretKeyRef, configMapKeyRef; optional and prefix honoured).
A missing Secret/ConfigMap or key leaves it waiting (CreateContainerConfigError for env; for a volume,
ContainerCreating and a FailedMount event) until it appears: the kubelet tries again every RETRY_S.
Volumes (secret, configMap; others are empty) are files in a directory per pod. The fake's one liberty:
a local process cannot see a mountPath, so every argv element, env value and workingDir that starts with
a volumeMount's mountPath is rewritten to that directory. workingDir is the cwd if it exists here, else
the pod's directory. Exit 0 -> pod Succeeded, Job conditions [SuccessCriteriaMet, Complete] and
completionTime; otherwise (signal n: 128 + n) pod Failed (reason Error), Job failed=1 and [FailureTarget,
Failed] with reason BackoffLimitExceeded; a command that cannot be executed is terminated StartError,
128. activeDeadlineSeconds kills the process group: pod Failed with status.reason DeadlineExceeded, Job
Failed reason DeadlineExceeded. ttlSecondsAfterFinished deletes the finished Job (Foreground, as the TTL
controller does). Deleting a pod, or its Job with cascade, kills its process group at once; so does
close(), for every pod.

Faults by image name: one that is no docker reference (an upper-case letter, a space) -> waiting
InvalidImageName, an InspectFailed event; `unschedulable` -> Pending, PodScheduled False (Unschedulable),
a FailedScheduling event; `pull-error` -> waiting ErrImagePull, after PULL_BACKOFF_S ImagePullBackOff,
Failed and BackOff events; `oom` -> SIGKILLed OOM_AFTER_S after it starts, reported OOMKilled with exit
code 137. Hooks: evict(pod) (Failed, reason Evicted, a DisruptionTarget condition and an Evicted event)
and expire_watches() (history compacted past the present: every open watch gets the 410 line and ends).

Not modelled: retries and restarts (every Job acts as if backoffLimit were 0; restartPolicy as Never;
parallelism and completions as 1), suspend, grace periods, admission, pagination (limit is ignored),
cluster-wide lists, PUT, JSON Patch (415; a strategic merge patch is applied as a JSON merge patch, lists
replaced), Event aggregation, resources and probes. A Job past its deadline keeps its Failed pod, so its
log can still be read (a real Job controller deletes it).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import hashlib
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Self

from aiohttp import web

from lgt.trainer.serving.children import signal_group

Json = dict[str, Any]
RESOURCES = {"jobs": ("batch/v1", "Job"), "pods": ("v1", "Pod"), "secrets": ("v1", "Secret"),
             "configmaps": ("v1", "ConfigMap"), "events": ("v1", "Event")}  # resource: apiVersion, kind
NODE, HOST_IP = "fake-node", "10.0.0.10"
PULL_BACKOFF_S = 0.3  # ErrImagePull -> ImagePullBackOff
OOM_AFTER_S = 0.2  # an `oom` image's process is killed this long after it starts
RETRY_S = 0.2  # how often the kubelet tries again to start a container that lacks a Secret or ConfigMap
BOOKMARK_S = 1.0  # an idle watch with allowWatchBookmarks gets a BOOKMARK this often
EVICTED = "The node was low on resource: memory."
DEADLINE = "Job was active longer than specified deadline"
_JOB_WARNING = ('299 - "child pods are preserved by default when jobs are deleted; set propagationPolicy='
                'Background to remove them or set propagationPolicy=Orphan to suppress this warning"')
_RAND = "bcdfghjklmnpqrstvwxz2456789"  # the alphabet of generateName suffixes (k8s util/rand)
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_LABEL_REQ = re.compile(r"\s*(!?)\s*([\w./-]+)\s*(?:(==|=|!=)\s*([\w./-]*)|\s(in|notin)\s*\(([^)]*)\))?"
                        r"\s*(?:,|$)")
_IMAGE = re.compile(r"((localhost|[\w-]+(\.[\w-]+)+)(:\d+)?/|[\w-]+:\d+/)?"  # a docker reference, near enough
                    r"[a-z0-9]+([._-]+[a-z0-9]+)*(/[a-z0-9]+([._-]+[a-z0-9]+)*)*(:\w[\w.-]{0,127})?"
                    r"(@sha256:[0-9a-f]{64})?")
_MERGE_TYPES = ("application/merge-patch+json", "application/strategic-merge-patch+json")


# --- wire helpers --------------------------------------------------------------------------------

def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _group(res: str) -> str:
    api_version = RESOURCES[res][0]
    return api_version.split("/")[0] if "/" in api_version else ""


def status_body(code: int, reason: str, message: str, details: Json | None = None) -> Json:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, **({"details": details} if details else {}), "code": code}


class ApiError(Exception):
    """An error answer: a Status about `name` of resource `res` (details as the apiserver fills them)."""

    def __init__(self, code: int, reason: str, message: str, res: str | None = None, name: str = "",
                 **details: Any) -> None:
        super().__init__(message)
        group = {"group": _group(res)} if res and _group(res) else {}
        about = {"name": name, **group, "kind": res, **details} if res else None
        self.body = status_body(code, reason, message, about)

    @classmethod
    def about(cls, code: int, reason: str, res: str, name: str, what: str) -> ApiError:
        qualified = f"{res}.{_group(res)}" if _group(res) else res
        return cls(code, reason, what.replace("%s", f'{qualified} "{name}"'), res, name)


def label_selector(text: str) -> Callable[[Json], bool]:
    """A labelSelector as a predicate over objects; ValueError when it does not parse."""
    reqs, pos = [], 0
    while pos < len(text):
        if not (m := _LABEL_REQ.match(text, pos)) or m.end() == pos:
            raise ValueError(f"unable to parse requirement: {text[pos:]!r}")
        reqs.append(m.groups())
        pos = m.end()

    def match(obj: Json) -> bool:
        labels = obj["metadata"].get("labels") or {}
        for neg, key, op, value, set_op, values in reqs:
            if op:
                ok = (labels.get(key) == value) != (op == "!=")
            elif set_op:
                ok = (labels.get(key) in {v.strip() for v in values.split(",")}) == (set_op == "in")
            else:
                ok = (key in labels) != bool(neg)
            if not ok:
                return False
        return True
    return match


def _dotted(obj: Json, path: str) -> str:
    """A field as a selector or fieldRef sees it: `status.phase`, `metadata.labels['app']`."""
    if m := re.fullmatch(r"metadata\.(labels|annotations)\['(.*)'\]", path):
        return (obj["metadata"].get(m[1]) or {}).get(m[2], "")
    cur: Any = obj
    for key in path.split("."):
        cur = cur.get(key) if isinstance(cur, dict) else None
    return "" if cur is None else str(cur)


def field_selector(text: str) -> Callable[[Json], bool]:
    """A fieldSelector (`metadata.name=x,status.phase!=Failed`) as a predicate over objects."""
    reqs = [re.fullmatch(r"\s*([\w.]+)\s*(==|=|!=)\s*(.*?)\s*", p) for p in filter(None, text.split(","))]
    if not all(reqs):
        raise ValueError(f"invalid selector: {text!r}")
    return lambda obj: all((_dotted(obj, m[1]) == m[3]) != (m[2] == "!=") for m in reqs)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)`: defined names are replaced, `$$` gives `$`, anything else stays as written."""
    return _VAR.sub(lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), text)


def _rewrite(value: str, mounts: dict[str, str]) -> str:
    for path in sorted(mounts, key=len, reverse=True):
        if value == path or value.startswith(path + "/"):
            return mounts[path] + value[len(path):]
    return value


def _data(res: str, obj: Json) -> dict[str, bytes]:
    """A Secret's or ConfigMap's keys, decoded."""
    data = {k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()}
    for k, v in (obj.get("data") or {}).items():
        data[k] = base64.b64decode(v) if res == "secrets" else v.encode()
    return data


def _referred(src: Json, secret_key: str, config_map_key: str) -> tuple[str, Json]:
    """The resource and reference of a `secret...`/`configMap...` pair of fields, whichever is there."""
    return ("secrets", src[secret_key]) if secret_key in src else ("configmaps", src[config_map_key])


def _encode_string_data(secret: Json) -> None:
    more = {k: base64.b64encode(v.encode()).decode() for k, v in (secret.pop("stringData", {})).items()}
    if data := {**(secret.get("data") or {}), **more}:
        secret["data"] = data


def _default(res: str, obj: Json) -> None:
    """Server-side defaults of a new object (its uid and name already set)."""
    meta, spec = obj["metadata"], obj.setdefault("spec", {}) if res in ("jobs", "pods") else {}
    if res == "secrets":
        _encode_string_data(obj)
        obj.setdefault("type", "Opaque")
    if res == "jobs":
        uid, name = meta["uid"], meta["name"]
        tmeta = spec.setdefault("template", {}).setdefault("metadata", {})
        if not meta.get("labels") and tmeta.get("labels"):
            meta["labels"] = dict(tmeta["labels"])
        tmeta["labels"] = {**(tmeta.get("labels") or {}), "batch.kubernetes.io/controller-uid": uid,
                           "batch.kubernetes.io/job-name": name, "controller-uid": uid, "job-name": name}
        spec = {"parallelism": 1, "completions": 1, "backoffLimit": 6, "completionMode": "NonIndexed",
                "suspend": False, "podReplacementPolicy": "TerminatingOrFailed",
                "selector": {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}, **spec}
        obj["spec"], obj["status"] = spec, {}
        spec = spec["template"].setdefault("spec", {})
    if res in ("jobs", "pods"):
        meta["generation"] = 1
        spec.update({"restartPolicy": "Always", "terminationGracePeriodSeconds": 30, "securityContext": {},
                     "dnsPolicy": "ClusterFirst", "schedulerName": "default-scheduler", **spec})
        for c in spec.get("containers") or []:
            image = c.get("image", "")
            tagged = "@" in image or ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest")
            c.update({"terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File",
                      "imagePullPolicy": "IfNotPresent" if tagged else "Always", "resources": {}, **c})
    if res == "pods":
        qos = "Burstable" if any(c["resources"] for c in spec.get("containers") or []) else "BestEffort"
        obj["status"] = {"phase": "Pending", "qosClass": qos}


def _validate(res: str, obj: Json) -> None:
    name, errors = obj["metadata"].get("name", ""), []
    if not name:
        errors.append(("metadata.name", "FieldValueRequired", "Required value: name or generateName is "
                       "required"))
    elif not _NAME.fullmatch(name) or len(name) > (63 if res == "jobs" else 253):
        errors.append(("metadata.name", "FieldValueInvalid", f'Invalid value: "{name}": must be a lowercase '
                       f"RFC 1123 subdomain of at most {63 if res == 'jobs' else 253} characters"))
    if res in ("jobs", "pods"):
        at = "spec.template.spec" if res == "jobs" else "spec"
        spec = obj["spec"]["template"]["spec"] if res == "jobs" else obj["spec"]
        if not spec.get("containers"):
            errors.append((f"{at}.containers", "FieldValueRequired", "Required value"))
        for i, c in enumerate(spec.get("containers") or []):
            errors += [(f"{at}.containers[{i}].{k}", "FieldValueRequired", "Required value")
                       for k in ("name", "image") if not c.get(k)]
        if res == "jobs" and spec["restartPolicy"] not in ("OnFailure", "Never"):
            errors.append((f"{at}.restartPolicy", "FieldValueNotSupported", f'Unsupported value: '
                           f'"{spec["restartPolicy"]}": supported values: "OnFailure", "Never"'))
    if errors:
        texts = [f"{f}: {msg}" for f, _, msg in errors]
        kind = RESOURCES[res][1] + (f".{_group(res)}" if _group(res) else "")
        message = f'{kind} "{name}" is invalid: ' + (texts[0] if len(texts) == 1 else f"[{', '.join(texts)}]")
        raise ApiError(422, "Invalid", message, res, name, kind=RESOURCES[res][1],
                       causes=[{"reason": reason, "message": msg, "field": f} for f, reason, msg in errors])


def _condition(type_: str, status: str = "True", reason: str = "", message: str = "") -> Json:
    return {"type": type_, "status": status, "lastProbeTime": None, "lastTransitionTime": now(),
            **({"reason": reason} if reason else {}), **({"message": message} if message else {})}


def _pod_conditions(ready: bool, reason: str | None = None) -> list[Json]:
    status = "True" if ready else "False"
    return [_condition("PodReadyToStartContainers"), _condition("Initialized"),
            _condition("Ready", status, reason), _condition("ContainersReady", status, reason),
            _condition("PodScheduled")]


def _container_status(c: Json, state: Json, *, ready: bool = False, cid: str = "") -> Json:
    image = c.get("image", "")
    image_id = f"{image}@sha256:{hashlib.sha256(image.encode()).hexdigest()}" if cid else ""
    return {"name": c["name"], "image": image, "imageID": image_id, "ready": ready, "restartCount": 0,
            "started": ready, "state": state, "lastState": {}, **({"containerID": cid} if cid else {})}


def _finished(job: Json) -> bool:
    return any(c["type"] in ("Complete", "Failed") and c["status"] == "True"
               for c in job["status"].get("conditions") or [])


def _line(type_: str, obj: Json) -> bytes:
    return (json.dumps({"type": type_, "object": obj}, separators=(",", ":")) + "\n").encode()


def _json(body: Json, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(text=json.dumps(body, separators=(",", ":")), status=status, headers=headers,
                        content_type="application/json")


# --- state ---------------------------------------------------------------------------------------

class _Change(NamedTuple):
    rv: int
    res: str
    ns: str
    type: str  # ADDED, MODIFIED, DELETED
    obj: Json  # stored objects are never changed in place, so a change keeps what it was
    prev: Json | None


def _visible(change: _Change, match: Callable[[Json], bool]) -> str | None:
    """The event a watch with this selector sees for a change, if any."""
    old = change.prev is not None and match(change.prev)
    new = change.type != "DELETED" and match(change.obj)
    return "MODIFIED" if old and new else "ADDED" if new else "DELETED" if old else None


@dataclass(eq=False)
class _Watch:
    res: str
    ns: str
    last_rv: int  # every change up to this one has been considered (what a bookmark says)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # _Change, bytes (a line) or None (the end)


class _Stuck(Exception):
    """A container that cannot start yet: its waiting reason and message, and the kubelet's Event."""


@dataclass(eq=False)
class _Pod:
    """What the kubelet knows of a pod it runs."""
    ns: str
    name: str
    uid: str
    dir: Path
    job: tuple[str, str] | None  # the controlling Job's name and uid
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    proc: asyncio.subprocess.Process | None = None
    cause: str | None = None  # why it was stopped: Evicted, DeadlineExceeded, Deleted, OOMKilled
    ended: bool = False  # the container has run, or never will

    def stop(self, cause: str) -> None:
        self.cause = self.cause or cause
        self.stopped.set()
        self.kill()

    def kill(self) -> None:
        if self.proc is not None:
            signal_group(self.proc.pid, signal.SIGKILL)


class FakeKube:
    """The fake API server on host:port (0: a free one), as an async context manager or, for sync code,
    on a daemon thread with its own event loop: `with FakeKube.in_thread() as kube`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, namespace: str = "default",
                 history: int = 1000) -> None:
        self.host, self.port, self.namespace = host, port, namespace
        self.token = secrets.token_hex(16)
        self._store: dict[str, dict[tuple[str, str], Json]] = {res: {} for res in RESOURCES}
        self._rv = 1  # an empty etcd's revision: a list never answers "0", which a watch takes for "any"
        self._compacted = 0  # a watch from a resourceVersion below this gets 410 Expired
        self._history: deque[_Change] = deque(maxlen=max(history, 1))
        self._watches: set[_Watch] = set()
        self._pods: dict[tuple[str, str], _Pod] = {}
        self._running: set[_Pod] = set()
        self._tasks: set[asyncio.Task] = set()
        self._timers: list[asyncio.TimerHandle] = []
        self._requests: Counter[tuple[str, str]] = Counter()
        self._event_ns = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._dir: Path | None = None  # the pods' directories, made by start()

    # --- running it ------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> Self:
        self._loop = asyncio.get_running_loop()
        self._dir = Path(tempfile.mkdtemp(prefix="fake-kube-"))
        app = web.Application(middlewares=[self._middleware], client_max_size=64 * 1024**2)
        for prefix, kinds in (("/apis/batch/v1", "jobs"), ("/api/v1", "pods|secrets|configmaps|events")):
            app.router.add_route("*", f"{prefix}/namespaces/{{ns}}/{{res:{kinds}}}", self._collection)
            app.router.add_route("*", f"{prefix}/namespaces/{{ns}}/{{res:{kinds}}}/{{name}}", self._item)
            app.router.add_get(f"{prefix}/namespaces/{{ns}}/{{res:{kinds}}}/{{name}}/status", self._item)
        app.router.add_get("/api/v1/namespaces/{ns}/pods/{name}/log", self._log)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def close(self) -> None:
        for timer in self._timers:
            timer.cancel()
        for w in self._watches:
            w.queue.put_nowait(None)
        for task in self._tasks:
            task.cancel()  # a kubelet task kills its process group on the way out
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @classmethod
    @contextlib.contextmanager
    def in_thread(cls, **kwargs: Any) -> Iterator[FakeKube]:
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="fake-kube", daemon=True)
        thread.start()

        async def start() -> FakeKube:
            return await cls(**kwargs).start()

        kube = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
        try:
            yield kube
        finally:
            asyncio.run_coroutine_threadsafe(kube.close(), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()

    def write_kubeconfig(self, path: str | os.PathLike[str]) -> Path:
        """A kubeconfig (JSON, which is YAML) whose current context is this server, token and namespace."""
        context = {"cluster": "fake", "user": "fake", "namespace": self.namespace}
        config = {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
                  "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                  "users": [{"name": "fake", "user": {"token": self.token}}],
                  "contexts": [{"name": "fake", "context": context}]}
        path = Path(path)
        path.write_text(json.dumps(config, indent=2))
        return path

    # --- test hooks, callable from any thread ----------------------------------------------------

    def _sync(self, fn: Callable[[], Any]) -> Any:
        """fn() run on the server's loop, where all state lives."""
        with contextlib.suppress(RuntimeError):
            if asyncio.get_running_loop() is self._loop:
                return fn()
        if self._loop is None or self._runner is None:
            return fn()

        async def call() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(30)

    def objects(self, kind: str, namespace: str | None = None) -> list[Json]:
        """Copies of the stored objects of a kind ("Job" or "jobs"), by namespace and name."""
        res = kind if kind in RESOURCES else {k: r for r, (_, k) in RESOURCES.items()}[kind]
        return self._sync(lambda: [copy.deepcopy(o) for (ns, _), o in sorted(self._store[res].items())
                                   if namespace in (None, ns)])

    @property
    def requests(self) -> Counter[tuple[str, str]]:
        """Authorised requests by (verb, resource), as RBAC names them: ("get", "pods/log")..."""
        return self._sync(lambda: Counter(self._requests))

    def processes_running(self) -> int:
        """Container processes started and not yet reaped."""
        return self._sync(lambda: len(self._running))

    def evict(self, pod_name: str, namespace: str | None = None) -> None:
        """The kubelet evicts the pod for memory pressure: its process group is killed and it fails."""
        self._sync(lambda: self._pods[namespace or self.namespace, pod_name].stop("Evicted"))

    def expire_watches(self) -> None:
        """Compacts the history past the present and ends every open watch with a 410 Expired ERROR."""
        def expire() -> None:
            self._rv += 1  # writes elsewhere in the cluster: even the newest resourceVersion seen is too old
            self._compacted = self._rv
            self._history.clear()
            for w in self._watches:
                w.queue.put_nowait(self._expired(w.last_rv))
                w.queue.put_nowait(None)
        self._sync(expire)

    # --- the store (on the loop only) ------------------------------------------------------------

    def _get(self, res: str, ns: str, name: str) -> Json:
        if (obj := self._store[res].get((ns, name))) is None:
            raise ApiError.about(404, "NotFound", res, name, "%s not found")
        return obj

    def _write(self, res: str, obj: Json, type_: str) -> Json:
        """Stores (ADDED, MODIFIED) or removes (DELETED) obj at a new resourceVersion; tells the watches."""
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        prev = self._store[res].get(key)
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        if type_ == "DELETED":
            del self._store[res][key]
        else:
            self._store[res][key] = obj
        if len(self._history) == self._history.maxlen:
            self._compacted = self._history[0].rv
        self._history.append(change := _Change(self._rv, res, key[0], type_, obj, prev))
        for w in self._watches:
            if (w.res, w.ns) == (res, key[0]):
                w.queue.put_nowait(change)
        return obj

    def _update(self, res: str, ns: str, name: str, fn: Callable[[Json], Any], uid: str = "") -> Json | None:
        """Writes fn's change to a copy of the object (MODIFIED); None when it is gone or has another uid."""
        cur = self._store[res].get((ns, name))
        if cur is None or uid and cur["metadata"]["uid"] != uid:
            return None
        fn(obj := copy.deepcopy(cur))
        return self._write(res, obj, "MODIFIED")

    def _create(self, res: str, ns: str, body: Json) -> Json:
        api_version, kind = RESOURCES[res]
        obj = {"apiVersion": api_version, "kind": kind, **copy.deepcopy(body)}
        obj["apiVersion"], obj["kind"] = api_version, kind
        meta = obj.setdefault("metadata", {})
        if meta.setdefault("namespace", ns) != ns:
            raise ApiError(400, "BadRequest", "the namespace of the provided object does not match the "
                           "namespace sent on the request")
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + "".join(random.choices(_RAND, k=5))
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now())
        _default(res, obj)
        _validate(res, obj)
        if (ns, meta["name"]) in self._store[res]:
            raise ApiError.about(409, "AlreadyExists", res, meta["name"], "%s already exists")
        self._write(res, obj, "ADDED")
        if res == "jobs":
            self._start_job(obj)
        elif res == "pods":
            self._start_pod(obj)
        return obj

    def _patch(self, res: str, ns: str, name: str, content_type: str, patch: Json) -> Json | None:
        if content_type not in _MERGE_TYPES:
            raise ApiError(415, "UnsupportedMediaType", "the body of the request was in an unknown format - "
                           "accepted media types include: " + ", ".join(_MERGE_TYPES))
        if (patch.get("metadata") or {}).get("resourceVersion") not in (
                None, self._get(res, ns, name)["metadata"]["resourceVersion"]):
            raise ApiError.about(409, "Conflict", res, name, "Operation cannot be fulfilled on %s: the "
                                 "object has been modified; please apply your changes to the latest version "
                                 "and try again")

        def apply(obj: Json) -> None:
            new = merge_patch(obj, patch)
            for key in ("uid", "name", "namespace", "creationTimestamp"):
                new["metadata"][key] = obj["metadata"][key]
            if "status" in obj:  # the status subresource is not patched through the object
                new["status"] = obj["status"]
            if res == "secrets":
                _encode_string_data(new)
            if "generation" in obj["metadata"] and new.get("spec") != obj.get("spec"):
                new["metadata"]["generation"] = obj["metadata"]["generation"] + 1
            obj.clear()
            obj.update(new)
        return self._update(res, ns, name, apply)

    def _delete(self, res: str, ns: str, name: str, policy: str) -> Json:
        uid = self._get(res, ns, name)["metadata"]["uid"]
        answer = None
        if res == "pods" or policy != "Background":
            def mark(o: Json) -> None:
                o["metadata"]["deletionTimestamp"] = now()
                if res == "pods":
                    o["metadata"]["deletionGracePeriodSeconds"] = o["spec"]["terminationGracePeriodSeconds"]
                if policy != "Background":
                    o["metadata"]["finalizers"] = ["orphan" if policy == "Orphan" else "foregroundDeletion"]
            answer = self._update(res, ns, name, mark)
        if res == "pods" and (rt := self._pods.pop((ns, name), None)):
            rt.stop("Deleted")
        if policy == "Background":
            self._remove(res, ns, name)
        self._collect(ns, uid, policy)
        if policy != "Background":
            self._remove(res, ns, name)
        return answer or {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                          "details": {"name": name, **({"group": _group(res)} if _group(res) else {}),
                                      "kind": res, "uid": uid}}

    def _remove(self, res: str, ns: str, name: str) -> None:
        obj = copy.deepcopy(self._store[res][ns, name])
        obj["metadata"].pop("finalizers", None)
        self._write(res, obj, "DELETED")

    def _collect(self, ns: str, uid: str, policy: str) -> None:
        """The garbage collector: deletes (with Orphan: releases) the dependents of the owner `uid`."""
        for res, objs in self._store.items():
            for n, name in list(objs):
                obj = objs.get((n, name))  # an earlier step of the cascade may have removed or changed it
                refs = [] if obj is None or n != ns else obj["metadata"].get("ownerReferences") or []
                if all(r.get("uid") != uid for r in refs):
                    continue
                rest = [r for r in refs if r.get("uid") != uid]
                if policy == "Orphan" or any(self._exists(r.get("uid")) for r in rest):
                    self._update(res, ns, name, lambda o, rest=rest: o["metadata"].update(
                        ownerReferences=rest) if rest else o["metadata"].pop("ownerReferences"))
                else:
                    self._delete(res, ns, name, policy)

    def _exists(self, uid: str | None) -> bool:
        return any(o["metadata"]["uid"] == uid for objs in self._store.values() for o in objs.values())

    def _event(self, res: str, obj: Json, type_: str, reason: str, message: str, component: str) -> None:
        meta, (api_version, kind) = obj["metadata"], RESOURCES[res]
        self._event_ns = max(time.time_ns(), self._event_ns + 1)
        host = NODE if component == "kubelet" else ""
        source = {"component": component, **({"host": host} if host else {})}
        self._create("events", meta["namespace"], {
            "metadata": {"name": f"{meta['name']}.{self._event_ns:x}"},
            "involvedObject": {"kind": kind, "namespace": meta["namespace"], "name": meta["name"],
                               "uid": meta["uid"], "apiVersion": api_version,
                               "resourceVersion": meta["resourceVersion"]},
            "reason": reason, "message": message, "source": source,
            "firstTimestamp": now(), "lastTimestamp": now(), "count": 1, "type": type_, "eventTime": None,
            "reportingComponent": component, "reportingInstance": host})

    def _later(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        self._timers.append(self._loop.call_later(delay, fn, *args))

    # --- HTTP ------------------------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return _json(status_body(401, "Unauthorized", "Unauthorized"), 401)
        mi, watch = request.match_info, request.query.get("watch") in ("true", "1")
        delete = "delete" if "name" in mi else "deletecollection"
        verb = {"POST": "create", "PATCH": "patch", "DELETE": delete}.get(request.method)
        verb = verb or ("watch" if watch else "get" if "name" in mi else "list")
        res = mi.get("res", "pods/log" if request.path.endswith("/log") else request.path)
        self._requests[verb, res] += 1
        try:
            return await handler(request)
        except ApiError as e:
            return _json(e.body, e.body["code"])
        except web.HTTPException as e:  # no such route
            message = "the server could not find the requested resource"
            return _json(status_body(e.status, "NotFound", message), e.status)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return _json(status_body(400, "BadRequest", str(e)), 400)

    async def _collection(self, request: web.Request) -> web.StreamResponse:
        res, ns, q = request.match_info["res"], request.match_info["ns"], request.query
        if request.method == "POST":
            return _json(self._create(res, ns, await request.json()), 201)
        if request.method not in ("GET", "DELETE"):
            raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the resource")
        policy, headers = await self._policy(request, res) if request.method == "DELETE" else ("", None)
        labels = label_selector(q.get("labelSelector", ""))
        fields = field_selector(q.get("fieldSelector", ""))

        def match(o: Json) -> bool:
            return labels(o) and fields(o)
        if q.get("watch") in ("true", "1"):
            return await self._watch(request, res, ns, match)
        items = [o for (n, _), o in sorted(self._store[res].items()) if n == ns and match(o)]
        for o in items if policy else []:  # deletecollection: answers the objects it deletes
            if (ns, o["metadata"]["name"]) in self._store[res]:
                self._delete(res, ns, o["metadata"]["name"], policy)
        items = [{k: v for k, v in o.items() if k not in ("kind", "apiVersion")} for o in items]
        return _json({"kind": f"{RESOURCES[res][1]}List", "apiVersion": RESOURCES[res][0],
                      "metadata": {"resourceVersion": str(self._rv)}, "items": items}, headers=headers)

    async def _item(self, request: web.Request) -> web.StreamResponse:
        res, ns, name = (request.match_info[k] for k in ("res", "ns", "name"))
        if request.method == "GET":
            return _json(self._get(res, ns, name))
        if request.method == "PATCH":
            return _json(self._patch(res, ns, name, request.content_type, await request.json()))
        if request.method != "DELETE":
            raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the resource")
        policy, headers = await self._policy(request, res)
        return _json(self._delete(res, ns, name, policy), headers=headers)

    async def _policy(self, request: web.Request, res: str) -> tuple[str, dict[str, str] | None]:
        """A DELETE's propagationPolicy, and the Warning header a Job's default earns."""
        options = json.loads(raw) if (raw := await request.read()).strip() else {}
        policy = request.query.get("propagationPolicy") or options.get("propagationPolicy")
        if policy is None and options.get("orphanDependents") is not None:
            policy = "Orphan" if options["orphanDependents"] else "Background"
        if policy not in (None, "Orphan", "Background", "Foreground"):
            raise ApiError(400, "BadRequest", f"propagationPolicy: Unsupported value: {policy!r}")
        if policy is None and res == "jobs":
            return "Orphan", {"Warning": _JOB_WARNING}
        return policy or "Background", None

    async def _log(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["ns"], request.match_info["name"]
        pod, rt = self._get("pods", ns, name), self._pods.get((ns, name))
        if rt is None or not (rt.dir / "log").exists():
            state = (pod["status"].get("containerStatuses") or [{}])[0].get("state", {}).get("waiting", {})
            raise ApiError(400, "BadRequest", f'container "{pod["spec"]["containers"][0]["name"]}" in pod '
                           f'"{name}" is waiting to start: {state.get("reason", "ContainerCreating")}')
        if request.query.get("follow") != "true":
            lines = (rt.dir / "log").read_text(errors="replace").splitlines(keepends=True)
            tail = int(request.query.get("tailLines", len(lines)))
            text = "".join(lines[len(lines) - tail:] if tail else [])
            return web.Response(text=text, content_type="text/plain")
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        with open(rt.dir / "log", "rb") as log:  # follow: what the process writes, until it has ended
            while True:
                ended = rt.ended
                if chunk := log.read():
                    await resp.write(chunk)
                elif ended:
                    return resp
                else:
                    await asyncio.sleep(0.05)

    def _expired(self, rv: int) -> bytes:
        message = f"too old resource version: {rv} ({self._compacted})"
        return _line("ERROR", status_body(410, "Expired", message))

    async def _watch(self, request: web.Request, res: str, ns: str, match: Callable[[Json], bool]
                     ) -> web.StreamResponse:
        q = request.query
        rv, bookmarks = q.get("resourceVersion", ""), q.get("allowWatchBookmarks") == "true"
        timeout = float(q.get("timeoutSeconds") or 0)
        end = time.monotonic() + timeout if timeout > 0 else None
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        if rv not in ("", "0") and int(rv) < self._compacted:
            await resp.prepare(request)
            await resp.write(self._expired(int(rv)))
            return resp
        if rv in ("", "0"):  # the present state first, as ADDED events
            backlog = [_line("ADDED", o) for (n, _), o in sorted(self._store[res].items())
                       if n == ns and match(o)]
        else:
            backlog = [_line(t, ch.obj) for ch in self._history
                       if ch.rv > int(rv) and (ch.res, ch.ns) == (res, ns) and (t := _visible(ch, match))]
        self._watches.add(w := _Watch(res, ns, self._rv))  # before any await: no change slips in between
        try:
            await resp.prepare(request)
            for line in backlog:
                await resp.write(line)
            while end is None or (left := end - time.monotonic()) > 0:
                wait = BOOKMARK_S if bookmarks else None
                wait = wait if end is None else min(wait or left, left)
                try:
                    item = await asyncio.wait_for(w.queue.get(), wait)
                except TimeoutError:
                    if bookmarks:
                        await resp.write(_line("BOOKMARK", {
                            "kind": RESOURCES[res][1], "apiVersion": RESOURCES[res][0],
                            "metadata": {"resourceVersion": str(w.last_rv)}}))
                    continue
                if item is None:
                    break
                if isinstance(item, bytes):
                    await resp.write(item)
                    continue
                w.last_rv = item.rv
                if type_ := _visible(item, match):
                    await resp.write(_line(type_, item.obj))
        finally:
            self._watches.discard(w)
        return resp

    # --- the job controller ----------------------------------------------------------------------

    def _start_job(self, job: Json) -> None:
        meta, spec = job["metadata"], job["spec"]
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        tmeta = spec["template"]["metadata"]
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": uid, "controller": True,
                 "blockOwnerDeletion": True}
        pod_meta = {"generateName": f"{name}-", "labels": dict(tmeta["labels"]), "ownerReferences": [owner],
                    **({"annotations": dict(tmeta["annotations"])} if tmeta.get("annotations") else {})}
        pod = self._create("pods", ns, {"metadata": pod_meta, "spec": spec["template"]["spec"]})
        self._event("jobs", job, "Normal", "SuccessfulCreate", f"Created pod: {pod['metadata']['name']}",
                    "job-controller")
        self._update("jobs", ns, name, lambda j: j["status"].update(
            startTime=now(), active=1, ready=0, terminating=0, uncountedTerminatedPods={}))
        if spec.get("activeDeadlineSeconds") is not None:
            self._later(spec["activeDeadlineSeconds"], self._deadline, ns, name, uid)

    def _deadline(self, ns: str, name: str, uid: str) -> None:
        job = self._store["jobs"].get((ns, name))
        if job is not None and job["metadata"]["uid"] == uid and not _finished(job):
            for rt in list(self._pods.values()):
                if rt.job == (name, uid):
                    rt.stop("DeadlineExceeded")

    def _job_pod_done(self, rt: _Pod, ok: bool) -> None:
        """Counts a pod that has ended (or was deleted) toward its Job, which then finishes."""
        job = self._store["jobs"].get((rt.ns, rt.job[0])) if rt.job else None
        if job is None or job["metadata"]["uid"] != rt.job[1] or _finished(job):
            return
        if ok:
            reason, message = "CompletionsReached", "Reached expected number of succeeded pods"
        elif rt.cause == "DeadlineExceeded":
            reason, message = "DeadlineExceeded", DEADLINE
        else:
            reason, message = "BackoffLimitExceeded", "Job has reached the specified backoff limit"

        def finish(j: Json) -> None:
            st = j["status"]
            st.pop("active", None)
            st.update({"ready": 0, "succeeded" if ok else "failed": 1})
            if ok:
                st["completionTime"] = now()
            types = ("SuccessCriteriaMet", "Complete") if ok else ("FailureTarget", "Failed")
            st["conditions"] = [{**_condition(t, "True", reason, message), "lastProbeTime": now()}
                                for t in types]
        job = self._update("jobs", rt.ns, rt.job[0], finish)
        self._event("jobs", job, "Normal" if ok else "Warning", "Completed" if ok else reason,
                    "Job completed" if ok else message, "job-controller")
        if (ttl := job["spec"].get("ttlSecondsAfterFinished")) is not None:
            self._later(ttl, self._ttl_expired, rt.ns, rt.job[0], rt.job[1])

    def _ttl_expired(self, ns: str, name: str, uid: str) -> None:
        job = self._store["jobs"].get((ns, name))
        if job is not None and job["metadata"]["uid"] == uid:
            self._delete("jobs", ns, name, "Foreground")

    # --- the kubelet -----------------------------------------------------------------------------

    def _start_pod(self, pod: Json) -> None:
        meta = pod["metadata"]
        owner = next((r for r in meta.get("ownerReferences") or []
                      if r.get("controller") and r["kind"] == "Job"), None)
        assert self._loop is not None and self._dir is not None, "start() first"
        work = self._dir / f"{meta['namespace']}.{meta['name']}.{meta['uid'][:8]}"
        work.mkdir()
        rt = _Pod(meta["namespace"], meta["name"], meta["uid"], work, owner and (owner["name"], owner["uid"]))
        self._pods[rt.ns, rt.name] = rt
        self._tasks.add(task := self._loop.create_task(self._kubelet(rt, pod["spec"]["containers"][0])))
        task.add_done_callback(self._tasks.discard)

    def _set_pod(self, rt: _Pod, fn: Callable[[Json], Any]) -> None:
        self._update("pods", rt.ns, rt.name, fn, rt.uid)

    def _pod_event(self, rt: _Pod, type_: str, reason: str, message: str, component: str = "kubelet") -> None:
        pod = self._store["pods"].get((rt.ns, rt.name))
        if pod is not None and pod["metadata"]["uid"] == rt.uid:
            self._event("pods", pod, type_, reason, message, component)

    def _waiting(self, rt: _Pod, c: Json, reason: str, message: str | None = None) -> None:
        state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
        self._set_pod(rt, lambda p: p["status"].update(containerStatuses=[_container_status(c, state)]))

    async def _kubelet(self, rt: _Pod, c: Json) -> None:
        try:
            terminated = await self._run_container(rt, c)
        finally:
            rt.kill()  # the container's cgroup goes with it: stray children too
            self._running.discard(rt)
            rt.ended = True
        ok = terminated is not None and terminated["exitCode"] == 0 and rt.cause is None

        def finish(p: Json) -> None:
            st = p["status"]
            st["phase"] = "Succeeded" if ok else "Failed"
            if terminated is not None:
                st["conditions"] = _pod_conditions(False, "PodCompleted" if ok else "PodFailed")
                st["containerStatuses"] = [_container_status(c, {"terminated": terminated},
                                                             cid=terminated["containerID"])]
            if rt.cause in ("Evicted", "DeadlineExceeded"):
                st["reason"], st["message"] = rt.cause, EVICTED if rt.cause == "Evicted" else DEADLINE
            if rt.cause == "Evicted":
                st.setdefault("conditions", []).append(
                    _condition("DisruptionTarget", "True", "TerminationByKubelet", EVICTED))
        self._set_pod(rt, finish)
        if rt.cause == "Evicted":
            self._pod_event(rt, "Warning", "Evicted", EVICTED)
        self._job_pod_done(rt, ok)

    async def _run_container(self, rt: _Pod, c: Json) -> Json | None:
        """Schedules, pulls and runs the container: its `terminated` state, or None if it never ran."""
        image = c.get("image", "")
        if "unschedulable" in image:
            message = "0/1 nodes are available: 1 Insufficient cpu."
            self._set_pod(rt, lambda p: p["status"].update(
                conditions=[_condition("PodScheduled", "False", "Unschedulable", message)]))
            self._pod_event(rt, "Warning", "FailedScheduling", message, "default-scheduler")
            await rt.stopped.wait()
            return None
        self._set_pod(rt, lambda p: (p["spec"].update(nodeName=NODE),
                                     p["status"].update(conditions=[_condition("PodScheduled")])))
        self._pod_event(rt, "Normal", "Scheduled", f"Successfully assigned {rt.ns}/{rt.name} to {NODE}",
                        "default-scheduler")
        ip = f"10.244.0.{self._rv % 250 + 2}"
        self._set_pod(rt, lambda p: p["status"].update(
            hostIP=HOST_IP, hostIPs=[{"ip": HOST_IP}], podIP=ip, podIPs=[{"ip": ip}], startTime=now(),
            conditions=_pod_conditions(False, "ContainersNotReady"),
            containerStatuses=[_container_status(c, {"waiting": {"reason": "ContainerCreating"}})]))
        if not _IMAGE.fullmatch(image):
            message = (f'Failed to apply default image tag "{image}": couldn\'t parse image name "{image}": '
                       "invalid reference format")
            self._waiting(rt, c, "InvalidImageName", message)
            self._pod_event(rt, "Warning", "InspectFailed", message)
            await rt.stopped.wait()
            return None
        if "pull-error" in image:
            self._waiting(rt, c, "ErrImagePull", f'failed to pull image "{image}": rpc error: code = '
                          f'NotFound desc = failed to pull and unpack image "{image}": {image}: not found')
            self._pod_event(rt, "Warning", "Failed", f'Failed to pull image "{image}": {image}: not found')
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rt.stopped.wait(), PULL_BACKOFF_S)
            if not rt.stopped.is_set():
                self._waiting(rt, c, "ImagePullBackOff", f'Back-off pulling image "{image}"')
                self._pod_event(rt, "Normal", "BackOff", f'Back-off pulling image "{image}"')
            await rt.stopped.wait()
            return None
        stuck = None
        while not rt.stopped.is_set():  # a missing Secret or ConfigMap may yet come: the kubelet tries again
            try:
                argv, env, cwd = self._container_env(rt, c)
                break
            except _Stuck as e:
                if e.args != stuck:
                    reason, message, event_reason, event_message = stuck = e.args
                    self._waiting(rt, c, reason, message)
                    self._pod_event(rt, "Warning", event_reason, event_message)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rt.stopped.wait(), RETRY_S)
        if rt.stopped.is_set():
            return None
        started, cid = now(), f"containerd://{hashlib.sha256(rt.uid.encode()).hexdigest()}"
        try:
            if not argv:
                raise FileNotFoundError("no command specified")
            with open(rt.dir / "log", "wb") as out:
                rt.proc = await asyncio.create_subprocess_exec(
                    *argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                    start_new_session=True)
        except OSError as e:
            why = "executable file not found in $PATH" if isinstance(e, FileNotFoundError) else e.strerror
            return {"exitCode": 128, "reason": "StartError", "startedAt": started, "finishedAt": now(),
                    "containerID": cid, "message": "failed to create containerd task: failed to create shim "
                    f'task: OCI runtime create failed: exec: "{argv[0] if argv else ""}": {why}: unknown'}
        self._running.add(rt)
        if rt.stopped.is_set():
            rt.kill()
        running = _container_status(c, {"running": {"startedAt": started}}, ready=True, cid=cid)
        self._set_pod(rt, lambda p: p["status"].update(phase="Running", conditions=_pod_conditions(True),
                                                       containerStatuses=[running]))
        self._pod_event(rt, "Normal", "Started", f"Started container {c['name']}")
        if rt.job is not None:
            self._update("jobs", rt.ns, rt.job[0], lambda j: j["status"].update(ready=1), rt.job[1])
        if "oom" in image:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rt.proc.wait(), OOM_AFTER_S)
            rt.stop("OOMKilled")
        code = await rt.proc.wait()
        code = 137 if rt.cause == "OOMKilled" else 128 - code if code < 0 else code
        reason = "OOMKilled" if rt.cause == "OOMKilled" else "Completed" if code == 0 else "Error"
        return {"exitCode": code, "reason": reason, "startedAt": started, "finishedAt": now(),
                "containerID": cid}

    def _container_env(self, rt: _Pod, c: Json) -> tuple[list[str], dict[str, str], str]:
        """argv, environment and cwd of the container's process; _Stuck when it cannot start yet."""
        pod = self._get("pods", rt.ns, rt.name)

        def source(res: str, ref: Json, key: str | None = None) -> dict[str, bytes]:
            """The keys of a referenced Secret/ConfigMap ({} if optional and missing)."""
            name, kind = ref.get("name", ""), RESOURCES[res][1]
            obj = self._store[res].get((rt.ns, name))
            absent = obj is not None and key is not None and key not in _data(res, obj)
            problem = (f'{kind.lower()} "{name}" not found' if obj is None else
                       f"couldn't find key {key} in {kind} {rt.ns}/{name}" if absent else None)
            if problem and not ref.get("optional"):
                raise _Stuck("CreateContainerConfigError", problem, "Failed", f"Error: {problem}")
            return {} if problem else _data(res, obj)

        env: dict[str, str] = {}
        for src in c.get("envFrom") or []:
            res, ref = _referred(src, "secretRef", "configMapRef")
            prefix = src.get("prefix", "")
            env.update({prefix + k: v.decode(errors="replace") for k, v in source(res, ref).items()})
        for e in c.get("env") or []:
            ref_from = e.get("valueFrom")
            if ref_from is None:
                env[e["name"]] = expand(e.get("value", ""), env)
            elif "fieldRef" in ref_from:
                env[e["name"]] = _dotted(pod, ref_from["fieldRef"]["fieldPath"])
            else:
                res, ref = _referred(ref_from, "secretKeyRef", "configMapKeyRef")
                if (value := source(res, ref, ref["key"]).get(ref["key"])) is not None:
                    env[e["name"]] = value.decode(errors="replace")
        mounts = self._volumes(rt, pod, c)
        argv = [_rewrite(expand(a, env), mounts) for a in (c.get("command") or []) + (c.get("args") or [])]
        cwd = _rewrite(c.get("workingDir", ""), mounts)
        base = {"PATH": os.environ.get("PATH", os.defpath), "HOME": os.environ.get("HOME", "/"),
                "HOSTNAME": rt.name}
        return argv, {**base, **{k: _rewrite(v, mounts) for k, v in env.items()}}, (
            cwd if cwd and os.path.isdir(cwd) else str(rt.dir))

    def _volumes(self, rt: _Pod, pod: Json, c: Json) -> dict[str, str]:
        """Materialises the pod's volumes as directories: mountPath -> local directory."""
        dirs = {}
        for v in pod["spec"].get("volumes") or []:
            d = dirs[v["name"]] = rt.dir / "volumes" / v["name"]
            d.mkdir(parents=True, exist_ok=True)
            if "secret" not in v and "configMap" not in v:
                continue
            res, ref = _referred(v, "secret", "configMap")
            name = ref.get("secretName") or ref.get("name", "")
            obj = self._store[res].get((rt.ns, name))
            data = _data(res, obj) if obj else {}
            items = ref.get("items") or [{"key": k, "path": k} for k in data]
            missing = (f'{RESOURCES[res][1].lower()} "{name}" not found' if obj is None else
                       next((f"{res[:-1]} references non-existent key: {i['key']}" for i in items
                             if i["key"] not in data), None))
            if missing and not ref.get("optional"):
                raise _Stuck("ContainerCreating", None, "FailedMount",
                             f'MountVolume.SetUp failed for volume "{v["name"]}" : {missing}')
            for item in items if not missing else []:
                (path := d / item["path"]).parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data[item["key"]])
                path.chmod(item.get("mode", ref.get("defaultMode", 0o644)))
        return {m["mountPath"].rstrip("/"): str(dirs[m["name"]] / m.get("subPath", "")).rstrip("/")
                for m in c.get("volumeMounts") or [] if m["name"] in dirs}
