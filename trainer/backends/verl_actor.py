"""verl's FSDP actor behind lgt's samples: one policy update, logprobs, weights, and verl's own state.

verl (0.9) trains through ``TrainingWorker`` + an engine (FSDP/FSDP2 here) with the loss
``verl.workers.utils.losses.ppo_loss``; its trainer feeds it a left/right padded ``DataProto``
(``prompts | responses``) converted to verl's no-padding ``TensorDict``. :class:`VerlActor` turns lgt's
samples into that batch (:mod:`~lgt.trainer.backends.verl_batch`) and runs verl's update on it, the way
verl's own ``RayPPOTrainer._update_actor`` drives its worker group; :class:`VerlInProcessActor` is one
``TrainingWorker`` in this process (world size 1, no Ray), :class:`~.verl_ray.VerlRayActor` verl's Ray
worker groups. :class:`~lgt.trainer.backends.verl_backend.VerlBackend` puts either behind lgt's backend
interface.

On a machine without CUDA the engine runs FSDP2 over a gloo process group of one rank
(:mod:`~lgt.trainer.backends.verl_platform`). That is for tests and small checks, not for speed.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from lgt.trainer.backends import verl_platform  # first: verl's CPU platform, before verl

# isort: split
from verl import DataProto
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from lgt.trainer.backends.base import BackendError, VerlConfig
from lgt.trainer.backends.checkpoints import CheckpointError
from lgt.trainer.backends.samples import SampleError
from lgt.trainer.backends.verl_batch import (
    fill_missing_behaviour,
    pad_batch,
    rank_major_order,
    recompute_old_logprobs,
    samples_to_dataproto,
)

STATE_FILE = "lgt_verl.json"  # in a checkpoint's verl/ folder: the step count and world size, written last

VerlConfigError = BackendError  # a verl backend setting is invalid (one sentence naming it)


def _init_single_process_group() -> bool:
    """A world of one rank for verl's engine (gloo on CPU; NCCL + gloo with CUDA), rendezvous by file.
    Returns whether it made one (False: the caller's process group is used)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    fd, path = tempfile.mkstemp(prefix="lgt-verl-pg-")
    os.close(fd)
    os.unlink(path)  # the FileStore creates it; a stale one would hold an old rendezvous
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    # verl's Worker records these (informational here: the rendezvous is the file above)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "0")
    dist.init_process_group(backend=backend, init_method=f"file://{path}", rank=0, world_size=1)
    return True


def _mean(value: Any) -> float:
    """A metric from verl (a float, a tensor, or a list of them per micro/mini batch) as one float."""
    if isinstance(value, list | tuple):
        items = [_mean(v) for v in value]
        return float(np.mean(items)) if items else float("nan")
    if isinstance(value, torch.Tensor):
        return float(value.float().mean())
    if hasattr(value, "value"):  # verl's Metric
        return _mean(value.value)
    return float(value)


# -- pieces both actors use (in this process, and on Ray's ranks: lgt.trainer.backends.verl_ray) ---


def training_worker_config(config: VerlConfig):
    """``(TrainingWorkerConfig, actor config, model config)`` for ``config``: what
    ``VerlInProcessActor`` builds its worker from, built the same way for the ranks."""
    from verl.workers.config import TrainingWorkerConfig

    model_config = config.to_verl_model()
    actor_config = config.to_verl()
    engine = actor_config.engine
    engine.use_dynamic_bsz = config.use_dynamic_bsz
    engine.micro_batch_size_per_gpu = config.ppo_micro_batch_size_per_gpu
    engine.infer_micro_batch_size_per_gpu = config.ppo_micro_batch_size_per_gpu
    engine.max_token_len_per_gpu = config.ppo_max_token_len_per_gpu
    engine.infer_max_token_len_per_gpu = config.ppo_max_token_len_per_gpu
    worker_config = TrainingWorkerConfig(
        model_type="language_model", model_config=model_config, engine_config=engine,
        optimizer_config=actor_config.optim, checkpoint_config=actor_config.checkpoint)
    return worker_config, actor_config, model_config


def pad_token_of(model_config, model_path: str) -> int:
    """The tokenizer's pad token (else its eos token); VerlConfigError when it has neither."""
    tokenizer = model_config.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise VerlConfigError(f"the tokenizer of {model_path} has no pad or eos token; pass pad_token_id.")
    return int(pad)


def metrics_of(raw: dict[str, Any], samples: int, tokens: float) -> dict[str, float]:
    """verl's training metrics under lgt's names (as ``VerlInProcessActor.train_step`` reports them)."""
    metrics = {f"actor/{k}" if not k.startswith("actor/") else k: _mean(v) for k, v in raw.items()
               if not k.startswith("perf/") and k != "mfu"}
    metrics["loss/pg"] = metrics.pop("actor/pg_loss", float("nan"))
    metrics["batch/samples"] = float(samples)
    metrics["batch/tokens"] = float(tokens)
    return metrics


# -- checkpoints ------------------------------------------------------------------------------------
# verl's own sharded state (+ lgt_verl.json, written last) in one directory: a checkpoint's ``verl/``
# part, written inside ``checkpoints.write_checkpoint`` (temporary directory, rename, DONE).


def _save_state(path: str | Path, save, steps: int, world_size: int) -> Path:
    path = Path(path)
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} is not empty: verl's state is written into a fresh directory.")
    path.mkdir(parents=True, exist_ok=True)
    save(str(path.resolve()))
    (path / STATE_FILE).write_text(json.dumps({"steps": steps, "world_size": world_size}) + "\n")
    return path


def _read_state(path: str | Path, world_size: int) -> int:
    """The step count saved in ``path``; CheckpointError when it is no finished state of this world."""
    path = Path(path)
    try:
        state = json.loads((path / STATE_FILE).read_text())
        steps, saved_world = int(state["steps"]), int(state["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} holds no finished verl state ({e.__class__.__name__}: {e}).") from None
    if saved_world != world_size:
        raise CheckpointError(f"{path} holds verl shards of {saved_world} rank(s), not {world_size}: "
                              f"resume with world_size {saved_world}.")
    return steps


class VerlActor:
    """What both verl actors share: lgt's samples as verl's batch, one PPO update, logprobs. A subclass
    sets ``config``, ``pad_token_id``, ``world_size``, ``rows_multiple`` (world size x micro-batch
    rows: verl splits each rank's rows into whole micro-batches) and ``steps``, and runs verl's worker
    calls: :meth:`_train` and :meth:`_infer` on a no-padding TensorDict."""

    config: VerlConfig
    pad_token_id: int
    world_size: int
    rows_multiple: int
    steps: int

    def _train(self, td: Any) -> Any:
        raise NotImplementedError

    def _infer(self, td: Any) -> Any:
        raise NotImplementedError

    def to_dataproto(self, samples: pa.Table) -> DataProto:
        cfg = self.config
        return samples_to_dataproto(
            samples, max_prompt_len=cfg.max_prompt_len, max_response_len=cfg.max_response_len,
            pad_token_id=self.pad_token_id, temperature=cfg.temperature,
            fold_loss_weight=cfg.loss.agg == "rollout")

    def train_step(self, samples: pa.Table) -> dict[str, float]:
        """One PPO update on ``samples`` (``ppo_epochs`` passes; batch/mini optimizer steps each).

        Returns metrics as floats (means over micro/mini batches): ``loss/pg``, ``actor/pg_clipfrac``,
        ``actor/ppo_kl`` (mean old - current logprob), ``actor/grad_norm``, ``actor/lr``,
        ``batch/samples``, ``batch/tokens`` (trained tokens), ``actor/behaviour_recomputed_frac``; with
        ``old_logprobs="recompute"`` also ``actor/behaviour_kl`` (mean old - behaviour logprob) and
        ``actor/is_weight_mean``. The batch is padded to whole micro-batches on every rank with rows that
        train on nothing (none with a ``ppo_mini_batch_size``, a multiple of them); with several
        mini-batches the rows are ordered so each rank's k-th mini-batch is its share of the k-th.
        """
        batch = self.to_dataproto(samples)
        size = len(batch)
        tokens = batch.batch["response_mask"].sum()
        mini = self.config.ppo_mini_batch_size or size
        if size % mini:
            raise SampleError(
                f"the batch of {size} samples is not a multiple of ppo_mini_batch_size ({mini}).")
        batch, pad = pad_batch(batch, self.rows_multiple)
        extra = fill_missing_behaviour(batch, self._logprobs)
        if self.config.old_logprobs == "recompute":
            extra |= recompute_old_logprobs(batch, self._logprobs, self.config)
        if mini < size and self.world_size > 1:
            batch.reorder(torch.from_numpy(rank_major_order(size, mini, self.world_size)))
        td = left_right_2_no_padding(batch.to_tensordict())
        tu.assign_non_tensor(
            td, calculate_entropy=self.config.entropy_coeff != 0, global_batch_size=mini,
            mini_batch_size=mini + pad, epochs=self.config.ppo_epochs, seed=self.config.seed + self.steps,
            dataloader_kwargs={"shuffle": self.config.shuffle}, compute_loss=True)
        raw = tu.get(self._train(td), "metrics")
        self.steps += 1
        return metrics_of(raw, size, float(tokens)) | extra

    @torch.no_grad()
    def _logprobs(self, batch: DataProto) -> torch.Tensor:
        """(B, R) logprobs of ``batch`` (rows a multiple of ``rows_multiple``)."""
        td = left_right_2_no_padding(batch.to_tensordict())
        tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False)
        return no_padding_2_padding(tu.get(self._infer(td), "log_probs"), td).float().cpu()

    def logprobs(self, samples: pa.Table) -> torch.Tensor:
        """The current policy's logprobs of each sample's response tokens: (B, R) float32, aligned with
        ``samples_to_dataproto(...).batch["responses"]`` (0 past each response's end)."""
        batch = self.to_dataproto(samples)
        padded, _ = pad_batch(batch, self.rows_multiple)
        return self._logprobs(padded)[:len(batch)]

    def sample_logprobs(self, samples: pa.Table) -> list[np.ndarray]:
        """The policy's log-prob of each sample's tokens (float32 arrays aligned with ``input_ids``),
        from the first generated token on (verl scores the response part only; 0 before it)."""
        batch = self.to_dataproto(samples)
        padded, _ = pad_batch(batch, self.rows_multiple)
        response = self._logprobs(padded)[:len(batch)].numpy()
        attention = batch.batch["attention_mask"].numpy()
        width_p = batch.batch["prompts"].shape[1]
        prompt_lens, response_lens = attention[:, :width_p].sum(1), attention[:, width_p:].sum(1)
        return [np.concatenate([np.zeros(p, np.float32), response[i, :r]])
                for i, (p, r) in enumerate(zip(prompt_lens, response_lens, strict=True))]


class VerlInProcessActor(VerlActor):
    """One verl FSDP actor in this process: ``train_step(samples)`` runs verl's PPO update on them.

    Built once (``setup`` in the constructor): the process group (one rank), verl's ``TrainingWorker``
    with the FSDP engine (model + AdamW), and verl's ``ppo_loss`` bound to the actor config.
    """

    def __init__(self, config: VerlConfig, *, pad_token_id: int | None = None):
        from verl.workers.engine_workers import TrainingWorker
        from verl.workers.utils.losses import ppo_loss

        if not torch.cuda.is_available():
            verl_platform.register_cpu_engine()
        self._owns_process_group = _init_single_process_group()
        self.config = config
        worker_config, self.actor_config, self.model_config = training_worker_config(config)
        self.pad_token_id = int(pad_token_id) if pad_token_id is not None else pad_token_of(
            self.model_config, config.model_path)
        self.world_size = 1
        self.rows_multiple = 1 if config.use_dynamic_bsz else config.ppo_micro_batch_size_per_gpu
        self.worker = TrainingWorker(config=worker_config)
        self.worker.reset()  # builds the model, FSDP wrapping, optimizer, scheduler
        self.worker.set_loss_fn(partial(ppo_loss, config=self.actor_config))
        self.steps = 0

    def _train(self, td: Any) -> Any:
        return self.worker.train_mini_batch(td)

    def _infer(self, td: Any) -> Any:
        return self.worker.infer_batch(td)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(Hugging Face parameter name, full tensor)`` for every weight, as verl hands them to its
        rollout engines (FSDP shards gathered one tensor at a time, on the training device; with tied
        embeddings verl may yield both names). Copy them before the next ``train_step``."""
        params, _ = self.worker.engine.get_per_tensor_param()
        for name, tensor in params:
            yield name, tensor.detach()

    def save_state(self, path: str | Path) -> Path:
        """Write verl's checkpoint (model, optimizer, lr scheduler, RNG) and the step count into the fresh
        directory ``path`` (like ``VerlRayActor.save_state``, world size 1)."""
        return _save_state(path, lambda d: self.worker.save_checkpoint(d, global_step=self.steps),
                           self.steps, 1)

    def load_state(self, path: str | Path) -> None:
        """Continue exactly from ``save_state``'s directory."""
        steps = _read_state(path, 1)
        self.worker.load_checkpoint(str(Path(path).resolve()), del_local_after_load=False)
        self.steps = steps

    def close(self) -> None:
        """Free the model, and the process group when this backend made it."""
        import torch.distributed as dist

        self.worker = None
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_process_group = False
