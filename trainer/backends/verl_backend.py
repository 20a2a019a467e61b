"""The verl backend as ``lgt-train`` runs it (``backend.name: verl``): one verl actor — in this process
(:class:`~lgt.trainer.backends.verl_actor.VerlInProcessActor`) or on Ray's ranks
(:class:`~lgt.trainer.backends.verl_ray.VerlRayActor`) — behind lgt's backend interface, with checkpoints
in lgt's layout. verl itself is imported when an actor is made: this module imports without it."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from lgt.trainer.backends.base import BackendError, LoraConfig, VerlConfig
from lgt.trainer.backends.checkpoints import CheckpointError, read_state, tokenizer_files, write_checkpoint

VERL_STATE_DIR = "verl"  # a checkpoint's folder for verl's own sharded state (resume)
HF_WEIGHTS = "model.safetensors"
MODEL_FILES = ("config.json", "generation_config.json")


class VerlBackend:
    """The verl backend behind lgt's backend interface (:mod:`lgt.trainer.backends.base`): one verl actor —
    :class:`~.verl_actor.VerlInProcessActor` in this process for ``world_size: 1``, verl's own Ray worker
    groups (:class:`~.verl_ray.VerlRayActor`) for more or with ``ray_address`` — plus checkpoints in
    lgt's layout: a Hugging Face model directory (the weights gathered from the ranks, the starting
    model's config and tokenizer files) that vLLM serves on ``--resume``, and verl's own state under
    ``verl/`` (model, optimizer, scheduler, RNG; one shard per rank: resume with the same world size).
    """

    summary = ""  # nothing beyond the config to say in the run's log
    lora: LoraConfig | None  # verl's own LoRA (VerlConfig.to_verl_model); named_weights are merged

    def __init__(self, actor: Any, config: VerlConfig, base_model: Path) -> None:
        self.actor = actor
        self.config = config
        self.base_model = base_model  # config and tokenizer files come from here
        self.lora = config.lora

    @classmethod
    def load(cls, model_dir: str | Path, cfg: VerlConfig) -> VerlBackend:
        config = dataclasses.replace(cfg, model_path=str(model_dir))
        if config.world_size > 1 or config.ray_address:
            from lgt.trainer.backends.verl_ray import VerlRayActor

            return cls(VerlRayActor(config), config, Path(model_dir))
        from lgt.trainer.backends.verl_actor import VerlInProcessActor

        return cls(VerlInProcessActor(config), config, Path(model_dir))

    @classmethod
    def resume(cls, ckpt_dir: str | Path, cfg: VerlConfig) -> tuple[VerlBackend, dict[str, Any]]:
        """The actor rebuilt on the checkpoint's weights, verl's state loaded; and the run's ``extra``."""
        ckpt = Path(ckpt_dir)
        _, extra, base = read_state(ckpt)
        if not (ckpt / VERL_STATE_DIR).is_dir():
            raise CheckpointError(f"{ckpt} holds no verl state ({VERL_STATE_DIR}/): it was not written by "
                                  "the verl backend")
        backend = cls.load(ckpt, cfg)
        backend.base_model = base
        try:
            backend.actor.load_state(ckpt / VERL_STATE_DIR)
        except BaseException:
            backend.close()
            raise
        return backend, extra

    @property
    def step(self) -> int:
        return self.actor.steps

    def train_step(self, samples: pa.Table) -> dict[str, float]:
        return self.actor.train_step(samples)

    def sample_logprobs(self, samples: pa.Table) -> list[np.ndarray]:
        """The policy's log-prob of each sample's tokens (float32 arrays aligned with ``input_ids``), as
        the torch backend's :meth:`~lgt.trainer.backends.torch_backend.TorchBackend.sample_logprobs`,
        from the first generated token on (verl scores the response part only; 0 before it)."""
        return self.actor.sample_logprobs(samples)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.actor.named_weights()

    def save_adapter(self, path: str | Path) -> Path:
        """Not on verl: its adapter lives inside its FSDP engine and reaches the engine and checkpoints
        merged (``named_weights``); BackendError."""
        what = "keeps its LoRA adapter inside its FSDP engine" if self.lora else "trains no LoRA adapter"
        raise BackendError(f"the verl backend {what}: save_adapter is the torch backend's (its weights go "
                           "to the engine merged, through named_weights)")

    def save_checkpoint(self, root: str | Path, extra: dict[str, Any] | None = None, *,
                        name: int | None = None) -> Path:
        """``root/step-<name:08d>`` (``name``: the run's step; default verl's update count): the HF weights
        + config + tokenizer, verl's state, the run's state."""
        from safetensors.torch import save_file

        from lgt.trainer.serving.weights import collect_tensors

        def write(tmp: Path) -> None:
            # CPU copies, each with its own storage (tied weights: safetensors wants that)
            save_file(collect_tensors(self.named_weights()), tmp / HF_WEIGHTS, metadata={"format": "pt"})
            for src in [*(self.base_model / f for f in MODEL_FILES), *tokenizer_files(self.base_model)]:
                if src.is_file():
                    shutil.copy2(src, tmp / src.name)
            self.actor.save_state(tmp / VERL_STATE_DIR)

        return write_checkpoint(root, self.step, extra, self.base_model, write, name=name)

    def close(self) -> None:
        self.actor.close()
