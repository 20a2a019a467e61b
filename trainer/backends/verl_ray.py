"""verl's own Ray worker groups for the verl backend: one policy update over N ranks.

``VerlRayActor(config, world_size=N)`` runs verl's ``TrainingWorker`` (FSDP2 engine) on N ranks through
verl's ``RayResourcePool`` + ``RayWorkerGroup``, the way verl's ``RayPPOTrainer`` drives its actor: the
driver converts samples to verl's batch (``samples_to_dataproto``, loss weights folded exactly as the
in-process ``VerlInProcessActor`` does), verl's dispatch splits it across the ranks, FSDP reduces the
gradients, and rank 0's metrics come back. Nothing here distributes anything itself.

Departures from verl's own trainer, on purpose:

* On a machine without CUDA (tests, small checks) the ranks are CPU processes over gloo. verl ships no
  CPU platform, and its ``initialize_global_process_group_ray`` asks torch for ``"cpu:gloo,cpu:gloo"``,
  which torch rejects; so each actor imports this module (which installs the CPU platform of
  :mod:`~lgt.trainer.backends.verl_platform` before any verl engine is imported), registers verl's
  FSDP engine for CPU and creates the gloo process group itself from the ``MASTER_ADDR``/``MASTER_PORT``
  verl gives each worker, before ``TrainingWorker.__init__``. With CUDA none of that happens: verl's
  own path (NCCL + gloo) runs.
* The resource pool is built directly (``RayResourcePool(use_gpu=..., max_colocate_count=1)``): verl's
  ``ResourcePoolManager`` hard-codes ``use_gpu=True`` and its default colocate count asks 10 CPUs a
  bundle.
* verl needs every rank's rows to split into whole micro-batches (``ppo_micro_batch_size_per_gpu``,
  unless ``use_dynamic_bsz``). A batch that does not (no ``ppo_mini_batch_size``) is padded to a
  multiple of ``world_size x micro`` rows with copies of its first rows whose ``response_mask``,
  advantages and old logprobs are 0: they add nothing to any loss or gradient, and verl's
  ``global_batch_size`` (the divisor of the ``seq-mean-*`` modes) stays the real number of samples.
  Token-mean metrics such as ``actor/pg_clipfrac`` may average in a micro-batch of padding only (a 0).
  A ``ppo_mini_batch_size`` must itself be such a multiple (checked before anything starts).
* With several mini-batches the rows are reordered before dispatch so that each rank's k-th mini-batch
  holds its share of the in-process k-th mini-batch: the optimizer steps see the same samples as
  ``VerlInProcessActor`` (verl would otherwise give each optimizer step a different mix).
* The ranks' own output (verl's warnings, its checkpoint log lines) stays in Ray's session logs
  (``/tmp/ray/session_latest/logs``) instead of the trainer's terminal; their errors still reach the
  driver as exceptions.
* ``named_weights`` gathers the full tensors on every rank (verl's ``get_per_tensor_param``) and ships
  rank 0's copy through Ray's object store to the driver as CPU tensors: fine for small models; big
  models want verl's checkpoint engines instead.

Checkpoints: ``save_state(dir)`` / ``load_state(dir)`` (and the methods of the same names of
``VerlInProcessActor``) write and read verl's own FSDP checkpoint (model, optimizer, lr scheduler
and RNG state; one shard file per rank, so resume with the same world size) plus ``lgt_verl.json`` (the
step count that seeds verl's data loader, the world size), written last. They fill one directory, the
``verl/`` part of a checkpoint that ``lgt.trainer.backends.checkpoints.write_checkpoint`` writes (temporary
directory, rename, ``DONE``). On several nodes the directory must be on storage every node sees.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lgt.trainer.backends import verl_platform  # before verl's engines are imported, here and in every rank
from lgt.trainer.backends.verl_actor import (
    VerlActor,
    VerlConfig,
    VerlConfigError,
    _read_state,
    _save_state,
    pad_token_of,
    training_worker_config,
)

# isort: split
import ray
from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.engine_workers import TrainingWorker

OBJECT_STORE_BYTES = 100 * 2**20  # a local Ray's shared memory; bigger objects spill to disk

# The environment a local Ray's processes start with (set only while ray.init runs): no usage reports,
# no metrics agent, no ~/.ray/auth_token. (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is left out on purpose:
# this process reads it when ray is imported, too early to matter here, and a Ray started later by a
# child process that inherited it would listen on 127.0.0.1 while its clients dial the node's address.)
LOCAL_RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_enable_metrics_collection": "0",
    "RAY_AUTH_MODE": "disabled",
}


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    """``values`` in ``os.environ`` (where not already set) for the block, then the old environment."""
    saved = {key: os.environ.get(key) for key in values}
    for key, value in values.items():
        os.environ.setdefault(key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# -- the ranks --------------------------------------------------------------------------------------


def _init_gloo_from_env() -> None:
    """This rank's gloo process group, rendezvous at the ``MASTER_ADDR``/``MASTER_PORT`` verl set."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="gloo", init_method="env://", rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))


class LgtTrainingWorker(TrainingWorker):
    """verl's ``TrainingWorker`` on one rank, plus the full weights and the process's peak memory."""

    def __init__(self, config):
        if not torch.cuda.is_available():
            verl_platform.register_cpu_engine()
            _init_gloo_from_env()
        super().__init__(config)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """Every rank takes part in the gathers; rank 0 returns ``{HF name: full CPU tensor}``."""
        params, _ = self.engine.get_per_tensor_param()
        out = {}
        for name, tensor in params:
            full = tensor.detach().to("cpu", copy=True)
            if self.rank == 0:
                out[name] = full
        return out if self.rank == 0 else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def cpu_seconds(self) -> float:
        """CPU time this rank's process has used (all its threads)."""
        return time.process_time()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def peak_rss_mib(self) -> float:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- the driver -------------------------------------------------------------------------------------


class VerlRayActor(VerlActor):
    """verl's FSDP actor on ``world_size`` ranks of a Ray cluster; the calls of ``VerlInProcessActor``.

    ``world_size`` and ``ray_address`` default to the config's. No ``ray_address``: a local Ray starts
    in this process (``num_cpus`` CPUs, default this machine's; on CPU each rank runs
    ``num_cpus // world_size`` torch threads; Ray's default elsewhere) and ``close()`` stops it; an address
    (``auto`` or ``host:port``) joins that cluster and ``close()`` removes this actor's workers and
    disconnects. A process already connected to Ray keeps its connection. ``timings`` holds the
    startup's ``ray_init_s``, ``worker_group_s`` (actors up, process group made) and ``reset_s``
    (model, FSDP wrapping, optimizer built on every rank).
    """

    def __init__(self, config: VerlConfig, *, world_size: int | None = None, ray_address: str | None = None,
                 num_cpus: int | None = None, pad_token_id: int | None = None):
        from functools import partial

        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
        from verl.workers.utils.losses import ppo_loss

        world_size = config.world_size if world_size is None else world_size
        ray_address = ray_address or config.ray_address
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise VerlConfigError(f"world_size must be a positive integer, got {world_size!r}.")
        mini = config.ppo_mini_batch_size
        # each rank's rows of a mini-batch split into whole micro-batches (unless sized by tokens)
        micro = 1 if config.use_dynamic_bsz else config.ppo_micro_batch_size_per_gpu
        self.rows_multiple = world_size * micro
        if mini is not None and mini % self.rows_multiple:
            raise VerlConfigError(
                f"ppo_mini_batch_size ({mini}) must be a multiple of world_size x "
                f"ppo_micro_batch_size_per_gpu ({self.rows_multiple}): verl splits each mini-batch evenly "
                "over the ranks' micro-batches.")
        if ray_address is not None and num_cpus is not None:
            raise VerlConfigError("num_cpus is for a local Ray only; a joined cluster has its own CPUs.")
        if num_cpus is not None and num_cpus < world_size:
            raise VerlConfigError(f"num_cpus ({num_cpus}) must be at least world_size ({world_size}): each "
                                  "rank holds one CPU.")
        self.config = config
        self.world_size = world_size
        self.use_gpu = torch.cuda.is_available()
        self.worker_config, self.actor_config, self.model_config = training_worker_config(config)
        self.pad_token_id = int(pad_token_id) if pad_token_id is not None else pad_token_of(
            self.model_config, config.model_path)
        self.steps = 0
        self.timings: dict[str, float] = {}
        self._owns_ray = False
        self._pool = None
        self.group = None

        # a local Ray gets this machine's CPUs, shared out as torch threads of the CPU ranks
        cpus = num_cpus or max(world_size, os.cpu_count() or 1)
        t0 = time.perf_counter()
        if not ray.is_initialized():
            if ray_address is None:
                env = LOCAL_RAY_ENV if self.use_gpu else LOCAL_RAY_ENV | {"CUDA_VISIBLE_DEVICES": ""}
                with _environ(env):
                    ray.init(address="local", num_cpus=cpus,
                             num_gpus=None if self.use_gpu else 0, include_dashboard=False,
                             object_store_memory=OBJECT_STORE_BYTES, log_to_driver=False)
            else:
                ray.init(address=ray_address, log_to_driver=False)
            self._owns_ray = True
        self.timings["ray_init_s"] = time.perf_counter() - t0
        try:
            t0 = time.perf_counter()
            self._pool = RayResourcePool(process_on_nodes=[world_size], use_gpu=self.use_gpu,
                                         max_colocate_count=1)
            local_cpu = self._owns_ray and ray_address is None and not self.use_gpu
            env = {"OMP_NUM_THREADS": str(cpus // world_size)} if local_cpu else {}
            self.group = RayWorkerGroup(
                resource_pool=self._pool,
                ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(LgtTrainingWorker),
                                                       config=self.worker_config),
                device_name="cuda" if self.use_gpu else "cpu", worker_env=env)
            ray.get([worker.__ray_ready__.remote() for worker in self.group.workers])
            self.timings["worker_group_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            self.group.reset()  # builds the model, FSDP wrapping, optimizer, scheduler on every rank
            self.group.set_loss_fn(partial(ppo_loss, config=self.actor_config))
            self.timings["reset_s"] = time.perf_counter() - t0
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> VerlRayActor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _train(self, td):
        return self.group.train_mini_batch(td).get()

    def _infer(self, td):
        return self.group.infer_batch(td).get()

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(Hugging Face parameter name, full CPU tensor)`` for every weight, gathered from the ranks
        (copies: they stay valid after the next ``train_step``)."""
        full = next(w for w in self.group.full_weights() if w is not None)
        yield from full.items()

    def cpu_seconds(self) -> float:
        """CPU time the ranks' processes have used so far, summed (for benchmarks)."""
        return float(sum(self.group.cpu_seconds()))

    def peak_rss_mib(self) -> list[float]:
        """Each rank's peak resident memory so far (MiB)."""
        return list(self.group.peak_rss_mib())

    def save_state(self, path: str | Path) -> Path:
        """Write every rank's verl checkpoint (model, optimizer, lr scheduler, RNG) and the step count
        into the fresh directory ``path``."""
        return _save_state(path, lambda d: self.group.save_checkpoint(d, global_step=self.steps),
                           self.steps, self.world_size)

    def load_state(self, path: str | Path) -> None:
        """Continue exactly from ``save_state``'s directory (saved with the same world size)."""
        steps = _read_state(path, self.world_size)
        self.group.load_checkpoint(str(Path(path).resolve()), del_local_after_load=False)
        self.steps = steps

    def close(self) -> None:
        """Kill this actor's workers and placement group; stop (or disconnect from) Ray when this actor
        started (or joined) it. Idempotent."""
        from ray.util.placement_group import remove_placement_group

        group, pool, self.group, self._pool = self.group, self._pool, None, None
        if ray.is_initialized():
            for worker in getattr(group, "workers", None) or []:
                ray.kill(worker, no_restart=True)
            for pg in getattr(pool, "pgs", None) or []:
                remove_placement_group(pg)
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        self._owns_ray = False


__all__ = ["LgtTrainingWorker", "VerlRayActor"]
