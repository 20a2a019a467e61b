"""The Kubernetes runner (``agent.runner: kubernetes``): each attempt a Job from the agent's template
(:mod:`lgt.trainer.rollout.kube` speaks to the cluster), its pod reaching the proxy at ``agent.proxy_host``.

A pod gets the same variables as a local process, minus the machine's own; what carries the rollout's
token goes in the attempt's Secret, with the proxy's CA, the task and the resource files (mounted at
:data:`~lgt.trainer.rollout.kube.MOUNT`). The evaluator is a Job too, from the same template.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path

from lgt.proxy import auth
from lgt.trainer.rollout import kube
from lgt.trainer.rollout.agent import AgentSpec, RolloutError, check_env_refs, expand
from lgt.trainer.rollout.kube import MOUNT, KubeError, load_template
from lgt.trainer.rollout.runners.base import Attempt, Outcome
from lgt.trainer.serving.proxy import PROXY_VARS


class KubernetesRunner:
    """Attempts as Kubernetes Jobs. The cluster's client (``jobs``: a
    :class:`~lgt.trainer.rollout.kube.KubeRunner`, looked up in its module then) starts on first use."""

    def __init__(self, agent: AgentSpec, *, run_dir: Path, kill_grace_s: float = 5.0,
                 hidden: Sequence[Path] = ()) -> None:
        self.agent, self.run_dir = agent, run_dir
        self.jobs: kube.KubeRunner | None = None
        self._lock = asyncio.Lock()

    @staticmethod
    def check(agent: AgentSpec, environ: Mapping[str, str]) -> None:
        """RolloutError when the Job template is unusable or ``env`` names a variable no pod has (a pod
        has only the rollout's variables)."""
        try:
            load_template(agent.job_template)
        except RuntimeError as e:
            raise RolloutError(str(e)) from None
        check_env_refs(agent, {})

    async def _start(self) -> str | None:
        """Start the cluster's client on first use; the reason when it cannot start."""
        async with self._lock:
            if self.jobs is None:
                jobs = kube.KubeRunner(template=self.agent.job_template, namespace=self.agent.namespace,
                                       run_dir=self.run_dir, run_name=self.run_dir.name,
                                       kubeconfig=self.agent.kubeconfig, jobs_per_s=self.agent.jobs_per_s,
                                       ttl_s=self.agent.job_ttl_s)
                try:
                    await jobs.start()
                except KubeError as e:
                    return str(e)
                self.jobs = jobs
        return None

    # -- an attempt --------------------------------------------------------------------------------
    def place(self, a: Attempt, filename: str, data: bytes) -> str:
        a.files[filename] = data
        return f"{MOUNT}/{filename}"

    def prepare(self, a: Attempt) -> None:
        """Nothing before it starts: its variables are made with its Job."""

    async def run(self, a: Attempt) -> Outcome:
        error = await self._start()
        if error is not None:
            return Outcome(None, False, error)
        assert self.jobs is not None
        proxy_env = a.proxy.rollout_env(a.rollout_id, a.attempt, self.agent.proxy_mode, greedy=a.greedy,
                                        host=self.agent.proxy_host)
        ca = Path(proxy_env["SSL_CERT_FILE"]).read_bytes()
        plain = {k: f"{MOUNT}/ca.pem" if k in auth.CA_VARS else v for k, v in proxy_env.items()}
        plain.update(a.fields)
        plain.update(TASK_JSON=f"{MOUNT}/task.json", TASK_ID=a.task_id, **a.extra_env)
        plain.update({k: expand(v, plain, k) for k, v in self.agent.env.items()})
        secret = {k: plain.pop(k) for k in list(plain)
                  if k in PROXY_VARS or k == "LGT_PROXY_BASE_URL" or _carries_token(plain[k], proxy_env)}
        return Outcome(*await self.jobs.execute(
            rollout_id=a.rollout_id, attempt=a.attempt, group_id=a.group_id, task_id=a.task_id, step=a.step,
            plain_env=plain, secret_env=secret, files={"ca.pem": ca, "task.json": a.agent_json, **a.files},
            timeout_s=self.agent.timeout_s, stdout=a.paths.stdout, stderr=a.paths.stderr))

    def collect(self, a: Attempt) -> None:
        """The pod's output is in ``a.paths`` already."""

    async def evaluate(self, a: Attempt, env: Mapping[str, str]) -> Outcome:
        """An evaluator Job from the agent's template (its image, the task and the agent's output
        mounted), given ``TASK_JSON AGENT_OUTPUT`` like a local evaluator."""
        assert self.jobs is not None and self.agent.evaluator is not None
        plain = {k: v for k, v in env.items() if k.startswith(self.agent.task_env_prefix)
                 or k in ("TASK_ID", "LGT_ROLLOUT_ID", "LGT_ATTEMPT")}
        plain["TASK_JSON"] = f"{MOUNT}/task.json"
        task_json = a.paths.task_json.read_bytes()
        return Outcome(*await self.jobs.execute(
            rollout_id=env["LGT_ROLLOUT_ID"], attempt=int(env["LGT_ATTEMPT"]), group_id=None,
            task_id=env.get("TASK_ID", ""), step=None, plain_env=plain, secret_env={},
            files={"task.json": task_json, "agent-output.txt": a.paths.stdout.read_bytes()},
            timeout_s=self.agent.timeout_s, stdout=a.paths.eval_out, stderr=a.paths.eval_err,
            role="evaluator",
            command=[*self.agent.evaluator, f"{MOUNT}/task.json", f"{MOUNT}/agent-output.txt"]))

    async def release(self, a: Attempt) -> None:
        """A finished Job is removed by the cluster (``agent.job_ttl_s``)."""

    async def existing(self) -> list[dict[str, str]]:
        error = await self._start()
        if error is not None:
            raise RolloutError(error)
        assert self.jobs is not None
        return self.jobs.existing()

    async def aclose(self) -> None:
        if self.jobs is not None:
            await self.jobs.aclose(delete=True)


def _carries_token(value: str, proxy_env: Mapping[str, str]) -> bool:
    """Whether ``value`` holds the rollout's proxy token (it is in the proxy URL's user info)."""
    url = proxy_env.get("LGT_PROXY_BASE_URL", "")
    token = url.split("/r/", 1)[-1].split("/")[1] if "/r/" in url else ""
    return bool(token) and token in value
