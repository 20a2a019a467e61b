"""The embedded training backend: one policy-gradient update of a Hugging Face causal LM per batch of samples.

``TorchBackend`` trains any ``AutoModelForCausalLM`` on CPU or one GPU from rows of the store's samples
(:data:`lgt.store.samples.SAMPLES`); the RL math (log-probs, PPO clip, importance weights, KL, loss
aggregation) is :mod:`lgt.trainer.rl.loss`. One ``train_step`` is one optimizer step over the whole batch:

* the batch is split into micro-batches by a padded-token budget (:func:`pack_micro_batches`,
  first-fit decreasing: ``rows x longest <= micro_batch_tokens``); each is right-padded, run forward and
  backward with the loss normalised by the WHOLE batch's token and sample counts, so the accumulated
  gradient equals the gradient of the whole batch in one piece;
* gradients are clipped to ``grad_clip`` (global norm) and AdamW steps once.

Departures from a textbook loop, each on purpose:

* Logits are computed only where the loss needs them: at positions whose next token is trained in
  some row of the micro-batch (transformers' ``logits_to_keep``), so long prompts and tool outputs
  cost the decoder's forward and backward but no (T, V) logits, log-softmax or its gradient.
* No attention mask is passed. Padding is on the right and attention is causal, so no real token can
  see a pad; a mask would only make the attention kernels take the slower masked path. Pad positions
  carry ``loss_mask`` 0 and are multiplied out of the loss (tests hold a sample alone equal to the same
  sample padded in a batch).
* Samples with no trainable token (``loss_mask`` all 0) still count in the sample total but are not run
  (they would add exactly zero gradient); a batch with none at all skips the update (no NaN).
* Dropout is switched off in the model's config at load: the log-probs being trained must be the ones
  the engine sampled from.
* A ``token_advantage`` column (list<float32> aligned with ``input_ids``: on-policy distillation's
  per-token advantages, :mod:`lgt.trainer.distill.opd`) replaces the per-sample ``advantage`` in the
  loss: the advantages become (B, T) like the log-probs. With ``teacher_top_k_ids`` and
  ``teacher_top_k_logprobs`` (k per token, flattened) the student's log-probs of the teacher's top k
  are gathered from the same logits and the loss adds the top-k KL term (:func:`rl.policy_loss`).
* ``dtype="bfloat16"`` keeps float32 master weights and AdamW state and runs the forward under autocast;
  ``dtype="auto"`` is bfloat16 where the device computes in bf16 natively, else float32
  (:mod:`lgt.trainer.serving.hardware`). ``summary`` says in one line which it chose and why.
* ``train_layers=N`` trains the top N decoder layers and the final norm only (:func:`freeze_below`):
  the rest keeps ``requires_grad`` off, so AdamW holds no state for it and backward stops below the
  lowest trained layer. Checkpoints and the weights pushed to the engine are still the whole model
  (the engine takes a full state dict).
* ``lora`` (:mod:`lgt.trainer.backends.lora`) puts a PEFT LoRA adapter on the attention and MLP
  projections and freezes every base weight: AdamW holds the adapter only. The KL reference is the
  same model with the adapter switched off (no second copy). ``named_weights`` gives the merged
  weights; ``save_adapter`` the adapter's PEFT folder; a checkpoint is that folder (the base is the
  run's model, recorded in ``trainer_state.json``).

Samples are read and checked by :func:`lgt.trainer.backends.samples.read_samples` (numpy views over the
Arrow list buffers, never Python lists of tokens). Checkpoints are Hugging Face directories (weights,
config, tokenizer files; with ``lora`` the adapter's PEFT folder and the tokenizer files) plus
``optimizer.pt``, ``rng.pt`` (torch's random state: LoRA dropout draws from it) and
``trainer_state.json``, written to a temporary directory, renamed into place, and marked finished by a
``DONE`` file written last.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import shutil
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from lgt.trainer.backends import lora as loras
from lgt.trainer.backends.base import BackendError, LoraConfig, TorchConfig
from lgt.trainer.backends.checkpoints import (
    STATE_FILE,
    CheckpointError,
    latest_checkpoint,
    read_state,
    tokenizer_files,
    write_checkpoint,
)
from lgt.trainer.backends.samples import SampleError, TokenBatch, read_samples
from lgt.trainer.model_dir import ModelError, check_model_dir
from lgt.trainer.rl import loss as rl
from lgt.trainer.serving.hardware import resolve_dtype

__all__ = ["CheckpointError", "SampleTooLongError", "TorchBackend", "TorchConfig", "freeze_below",
           "latest_checkpoint", "pack_micro_batches"]

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"
ENTROPY_CHUNK_ROWS = 1024  # token rows of logits per chunk when computing the entropy metric


class SampleTooLongError(SampleError):
    """A sample has more tokens than ``max_seq_len``."""


# ----------------------------------------------------------------------------------------------------
# Samples: a TokenBatch (numpy views over the Arrow columns, lgt.trainer.backends.samples) -> padded
# micro-batch tensors


def pack_micro_batches(lengths: Sequence[int] | np.ndarray, budget: int) -> list[list[int]]:
    """Group sample indices into micro-batches whose padded cost ``rows x longest`` stays within ``budget``.

    First-fit decreasing: samples sorted by length (longest first, ties by index), each put into the
    first micro-batch it fits. A sample longer than ``budget`` gets a micro-batch of its own.
    Deterministic; every index appears exactly once; within a micro-batch, longest first.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    bins: list[list[int]] = []
    longest: list[int] = []
    for i in order.tolist():
        n = int(lengths[i])
        for b, rows in enumerate(bins):
            if (len(rows) + 1) * max(longest[b], n) <= budget:
                rows.append(i)
                longest[b] = max(longest[b], n)
                break
        else:
            bins.append([i])
            longest.append(n)
    return bins


def pad_micro_batch(batch: TokenBatch, rows: Sequence[int], device: torch.device, *,
                    trained_only: bool = False) -> dict[str, torch.Tensor]:
    """Right-padded tensors for samples ``rows`` (pad id 0, mask 0, behaviour log-prob 0).

    ``input_ids`` (B, T) int64: the model's input, T the longest row. The loss is computed at K
    positions: ``target_ids`` (B, K) int64, ``loss_mask``, ``behaviour_logprobs`` (B, K) float32 are
    aligned like :func:`rl.token_logprobs`'s output for logits taken at ``positions`` (K,) int64
    (``target_ids[:, j]`` is the token predicted from position ``positions[j - 1]``; column 0 is
    unused). Without ``trained_only`` K = T and these are the padded lists themselves
    (``positions`` = 0..T-1). With it, only positions whose next token is trained in some row are
    kept (plus the last, which predicts nothing): prompt-only stretches get no logits at all.
    ``advantages`` (B,) float32, or (B, K) aligned like ``loss_mask`` when the batch has per-token
    advantages (0 on padding); ``loss_weight`` (B,) float32.
    """
    idx = np.asarray(rows, dtype=np.int64)
    lens = batch.lengths[idx]
    b, width = len(idx), int(lens.max())
    # Flat gather indices of every real token, and where each lands in the (B, T) block.
    row_of = np.repeat(np.arange(b), lens)
    col = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    src = np.repeat(batch.starts[idx], lens) + col
    flat = row_of * width + col

    def spread(values: np.ndarray, dtype: type) -> np.ndarray:
        """Per-token ``values`` (total tokens, ...) of the rows as a zero-padded (B, T, ...) block."""
        out = np.zeros((b * width, *values.shape[1:]), dtype)
        out[flat] = values[src]
        return out.reshape(b, width, *values.shape[1:])

    ids = spread(batch.input_ids, np.int64)
    # what the loss reads per token, aligned with the targets
    per_token = {"loss_mask": spread(batch.loss_mask, np.float32),
                 "behaviour_logprobs": spread(batch.behaviour_logprobs, np.float32)}
    if batch.token_advantage is not None:
        per_token["advantages"] = spread(batch.token_advantage, np.float32)
    if batch.top_k_ids is not None and batch.top_k_logprobs is not None:
        per_token["teacher_top_k_ids"] = spread(batch.top_k_ids, np.int64)
        per_token["teacher_top_k_logprobs"] = spread(batch.top_k_logprobs, np.float32)
    positions = np.arange(width)
    targets = ids
    if trained_only:
        predicting = np.flatnonzero(per_token["loss_mask"][:, 1:].any(0))  # position p predicts token p + 1
        positions = np.append(predicting, width - 1)
        pick = np.concatenate([[0], predicting + 1])
        for name, a in [("target_ids", ids), *per_token.items()]:
            a = a[:, pick]  # a copy: the column cleared below is the picked one
            a[:, 0] = 0
            if name == "target_ids":
                targets = a
            else:
                per_token[name] = a

    def put(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    # per-token advantages, when the batch has them, replace the per-sample ones
    return {"input_ids": put(ids), "positions": put(positions), "target_ids": put(targets),
            "advantages": put(batch.advantage[idx].astype(np.float32)),
            "loss_weight": put(batch.loss_weight[idx].astype(np.float32)),
            **{name: put(a) for name, a in per_token.items()}}


def _entropy_sum(logits: torch.Tensor, mask: torch.Tensor) -> float:
    """Σ over positions t with ``mask[:, t] == 1`` of the entropy of the distribution predicting token t."""
    with torch.no_grad():
        rows = logits[:, :-1][mask[:, 1:] > 0]
        total = 0.0
        for chunk in rows.split(ENTROPY_CHUNK_ROWS):
            chunk = chunk.float()
            lse = torch.logsumexp(chunk, -1, keepdim=True)
            total += float((lse.squeeze(-1) - (torch.softmax(chunk, -1) * chunk).sum(-1)).sum())
        return total


def _top_k_logprobs(logits: torch.Tensor, top_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, K, k) float32 log-probs, with gradient, of the tokens ``top_ids`` names at each target
    column (aligned like :func:`rl.token_logprobs`: column j from the logits at column j - 1), computed
    on trained columns only (0 elsewhere)."""
    out = torch.zeros(top_ids.shape, dtype=torch.float32, device=logits.device)
    on = mask[:, 1:] > 0
    rows = logits[:, :-1][on].float()  # (M, V): the distributions predicting trained tokens
    out[:, 1:][on] = rows.gather(-1, top_ids[:, 1:][on]) - torch.logsumexp(rows, -1, keepdim=True)
    return out


def _merge_metrics(parts: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    """Micro-batch metrics as whole-batch ones: ``loss/*`` are contributions (summed), the rest are
    means over the micro-batch's trained tokens (averaged weighted by those token counts)."""
    out: dict[str, float] = {}
    weight = sum(w for _, w in parts) or 1.0
    for metrics, w in parts:
        for k, v in metrics.items():
            out[k] = out.get(k, 0.0) + (v if k.startswith("loss/") else v * w / weight)
    return out


# ----------------------------------------------------------------------------------------------------
# The backend


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name} was asked for but torch sees no CUDA device "
                         "(use device=cpu or auto)")
    return torch.device(name)


def _load_model(model_dir: Path, device: torch.device) -> torch.nn.Module:
    """The causal LM in ``model_dir`` in float32 on ``device``, with every dropout probability set to 0."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    for sub in [config, *(getattr(config, k) for k in ("text_config",) if hasattr(config, k))]:
        for key, value in list(vars(sub).items()):
            if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
                setattr(sub, key, 0.0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32,
                                                 local_files_only=True)
    return model.to(device)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a causal LM laid out as llama, qwen2, mistral … are (``model.model.layers``);
    BackendError (one sentence) for any other layout."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise BackendError(f"backend.train_layers needs a model whose decoder layers are model.model.layers "
                           f"(llama, qwen2, mistral …), and this {type(model).__name__} has none: leave "
                           "train_layers unset to train the whole model")
    return layers


def freeze_below(model: torch.nn.Module, train_layers: int, train_embeddings: bool = False) -> str:
    """Leave ``requires_grad`` on for the top ``train_layers`` decoder layers and the final norm
    (``model.model.norm``) only, plus the input embedding and output head with ``train_embeddings``
    (one tensor when they are tied); return what is trained, in words. BackendError for a model laid
    out otherwise or with fewer layers."""
    layers = decoder_layers(model)
    if train_layers > len(layers):
        raise BackendError(f"backend.train_layers is {train_layers} but the model has {len(layers)} decoder "
                           f"layers: give at most {len(layers)}, or leave it unset to train every one")
    model.requires_grad_(False)
    for layer in layers[len(layers) - train_layers:]:
        layer.requires_grad_(True)
    what = f"the top {train_layers} of {len(layers)} layers"
    norm = getattr(model.model, "norm", None)
    if isinstance(norm, torch.nn.Module):
        norm.requires_grad_(True)
        what += " + final norm"
    if train_embeddings:
        model.get_input_embeddings().requires_grad_(True)
        head = model.get_output_embeddings()
        if head is not None:
            head.requires_grad_(True)
        what += " + embeddings"
    return what


class TorchBackend:
    """A policy (HF causal LM) and its AdamW optimizer; ``train_step`` applies one update per batch.

    Build with :meth:`load` (from a model directory) or :meth:`resume` (from a checkpoint).
    ``step`` counts the updates made (restored by ``resume``).
    """

    summary: str  # the device, what it computes in and why, what it trains (set in __init__)
    lora: LoraConfig | None  # the adapter trained on the frozen base, or None (every weight)

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: TorchConfig, *,
                 model_dir: Path, base_model_dir: Path, max_seq_len: int, vocab_size: int,
                 ref: torch.nn.Module | None, device: torch.device) -> None:
        self.model = model
        self.optimizer = optimizer
        self.cfg = cfg
        self.model_dir = model_dir  # where the tokenizer files are read from
        self.base_model_dir = base_model_dir  # the starting weights (the KL reference)
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.ref = ref
        self.device = device
        self.lora = cfg.lora
        self.step = 0
        inner = model.get_base_model() if cfg.lora is not None else model  # PEFT passes the keywords on
        self._keeps_positions = "logits_to_keep" in inspect.signature(inner.forward).parameters
        self.dtype, why = resolve_dtype(cfg.dtype, str(device), key="backend.dtype")
        self._autocast = (torch.autocast(device.type, dtype=DTYPES[self.dtype])
                          if self.dtype != "float32" else contextlib.nullcontext())
        every = list(model.parameters())  # a tied embedding once
        total, trained = sum(p.numel() for p in every), sum(p.numel() for p in every if p.requires_grad)
        what = "every parameter" if trained == total else f"{trained:,} of {total:,} parameters"
        if cfg.lora is not None:
            targets = ", ".join(sorted(model.peft_config[loras.ADAPTER].target_modules))
            what += f" (a LoRA adapter of rank {cfg.lora.rank} on {targets}; the base frozen)"
        compute = "float32" if self.dtype == "float32" else f"{self.dtype} autocast, float32 weights"
        self.summary = f"torch backend on {device}: {compute} ({why}); training {what}"

    @classmethod
    def load(cls, model_dir: str | Path, cfg: TorchConfig, *, ref_model_dir: str | Path | None = None
             ) -> TorchBackend:
        """Load the model in ``model_dir`` (checked with ``check_model_dir``: ModelError) for training.

        ``ref_model_dir``: the KL reference's weights when they differ from ``model_dir`` (resume).
        """
        model_dir = Path(model_dir)
        info = check_model_dir(model_dir)
        base = Path(ref_model_dir) if ref_model_dir is not None else model_dir
        limit = info.max_position_embeddings
        if cfg.max_seq_len is not None and limit is not None and cfg.max_seq_len > limit:
            raise ValueError(f"max_seq_len {cfg.max_seq_len} exceeds the model's max_position_embeddings "
                             f"{limit} ({model_dir})")
        max_seq_len = cfg.max_seq_len or limit or 2**31 - 1
        device = _resolve_device(cfg.device)
        torch.manual_seed(cfg.seed)
        model = _load_model(model_dir, device)
        trained = None
        if cfg.train_layers is not None:
            trained = freeze_below(model, cfg.train_layers, cfg.train_embeddings)
        if cfg.lora is not None:
            model = loras.apply(model, cfg.lora, model_dir)
        if cfg.grad_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        ref = None
        if cfg.wants_ref_model and cfg.lora is None:  # with lora: the model with its adapter off
            check_model_dir(base)
            ref = _load_model(base, device).eval().requires_grad_(False)
        params = [p for p in model.parameters() if p.requires_grad]  # frozen ones get no AdamW state
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                      weight_decay=cfg.weight_decay, fused=device.type == "cuda" or None)
        backend = cls(model, optimizer, cfg, model_dir=model_dir, base_model_dir=base,
                      max_seq_len=max_seq_len, vocab_size=int(model.get_input_embeddings().weight.shape[0]),
                      ref=ref, device=device)
        if trained is not None:
            backend.summary += f" ({trained})"
        log.info("%s", backend.summary)
        return backend

    # ------------------------------------------------------------------------------ training

    def check_samples(self, batch: TokenBatch) -> None:
        """SampleTooLongError / SampleError for samples this model cannot train on (before any compute)."""
        too_long = np.flatnonzero(batch.lengths > self.max_seq_len)
        if len(too_long):
            i = int(too_long[np.argmax(batch.lengths[too_long])])
            raise SampleTooLongError(f"sample {batch.sample_id(i)} has {batch.lengths[i]} tokens, more than "
                                     f"max_seq_len {self.max_seq_len}: raise max_seq_len or drop the sample")
        if len(batch.input_ids) and (batch.input_ids.min() < 0 or batch.input_ids.max() >= self.vocab_size):
            bad = np.flatnonzero((batch.input_ids < 0) | (batch.input_ids >= self.vocab_size))[0]
            i = batch.sample_at(bad)
            raise SampleError(f"sample {batch.sample_id(i)} holds token id {batch.input_ids[bad]}, outside "
                              f"the model's vocabulary of {self.vocab_size}: was it built with another "
                              "tokenizer?")

    def _forward_logprobs(self, model: torch.nn.Module, mb: dict[str, torch.Tensor]
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits (B, K, V), log-probs (B, K) float32 of ``target_ids``) of ``model`` on a padded
        micro-batch, the logits computed at ``positions`` only (see :func:`pad_micro_batch`)."""
        positions = mb["positions"]
        keep: int | torch.Tensor = positions
        if len(positions) == mb["input_ids"].shape[1] or not self._keeps_positions:
            keep = 0  # all positions (transformers' default)
        with self._autocast:
            logits = model(input_ids=mb["input_ids"], use_cache=False, logits_to_keep=keep).logits
        if logits.shape[1] != len(positions):  # the model ignored logits_to_keep
            logits = logits[:, positions]
        return logits, rl.token_logprobs(logits, mb["target_ids"])

    def accumulate(self, samples: pa.Table | pa.RecordBatch | Iterable[pa.RecordBatch],
                   old: list[torch.Tensor] | None = None) -> dict[str, float]:
        """Forward and backward over every micro-batch, adding the whole batch's loss gradient to ``.grad``.

        Does not zero the gradients, clip or step (that is :meth:`train_step`). Metrics as train_step's,
        without grad_norm. Raises SampleTooLongError / SampleError before computing anything.
        ``old``: the old policy's log-probs of the PPO ratio, one tensor per micro-batch — an empty list
        is filled with this pass's own (the weights before the update); a filled one is used.
        """
        return self._accumulate(read_samples(samples), old)

    def _accumulate(self, batch: TokenBatch, old: list[torch.Tensor] | None) -> dict[str, float]:
        started = time.perf_counter()
        self.check_samples(batch)
        num_tokens = float(batch.masked.sum())
        trained = np.flatnonzero(batch.masked > 0)
        num_samples = float(len(trained))  # rows with a trained token, as rl.aggregate_loss counts them
        micro = [[int(trained[j]) for j in mb]
                 for mb in pack_micro_batches(batch.lengths[trained], self.cfg.micro_batch_tokens)]
        parts: list[tuple[dict[str, float], float]] = []
        loss_total = 0.0
        entropy_total = 0.0
        neg_logp_total = 0.0
        padded = 0
        for k, rows in enumerate(micro):
            mb = pad_micro_batch(batch, rows, self.device, trained_only=True)
            padded += mb["input_ids"].numel()
            if self.ref is not None:
                with torch.no_grad():
                    mb["ref_logprobs"] = self._forward_logprobs(self.ref, mb)[1]
            elif self.lora is not None and self.cfg.wants_ref_model:
                with torch.no_grad(), self.model.disable_adapter():
                    mb["ref_logprobs"] = self._forward_logprobs(self.model, mb)[1]
            logits, logp = self._forward_logprobs(self.model, mb)
            if old is not None:
                if k < len(old):
                    mb["old_logprobs"] = old[k]
                else:
                    old.append(logp.detach())
            if self.cfg.entropy:
                entropy_total += _entropy_sum(logits.detach(), mb["loss_mask"])
            if "teacher_top_k_ids" in mb:
                mb["student_top_k_logprobs"] = _top_k_logprobs(logits, mb["teacher_top_k_ids"],
                                                               mb["loss_mask"])
            del logits
            neg_logp_total -= float((logp.detach() * mb["loss_mask"]).sum())
            loss, metrics = rl.policy_loss(logp, mb, self.cfg.loss, num_tokens=num_tokens,
                                           num_samples=num_samples)
            loss.backward()
            loss_total += float(loss.detach())
            parts.append((metrics, float(batch.masked[rows].sum())))
        out = _merge_metrics(parts)
        out.update({"loss": loss_total, "tokens": float(batch.lengths.sum()), "trained_tokens": num_tokens,
                    "padded_tokens": float(padded), "samples": float(len(batch)),
                    "trained_samples": num_samples, "micro_batches": float(len(micro))})
        out["actor/neg_logprob"] = neg_logp_total / max(num_tokens, 1.0)
        if self.cfg.entropy:
            out["actor/entropy"] = entropy_total / max(num_tokens, 1.0)
        out["seconds"] = time.perf_counter() - started
        return out

    def train_step(self, samples: pa.Table | pa.RecordBatch | Iterable[pa.RecordBatch]) -> dict[str, float]:
        """``epochs`` optimizer updates over the whole batch of SAMPLES rows (one by default); returns
        float metrics (of the last pass; ``seconds`` of all).

        Metrics: ``loss`` (total), ``loss/*`` and ``actor/*`` (from :func:`rl.policy_loss`; ``actor/*``
        are means over trained tokens; ``actor/neg_logprob``; ``actor/entropy`` when enabled),
        ``grad_norm`` (before clipping),
        ``tokens`` (all tokens), ``trained_tokens`` (loss_mask 1), ``padded_tokens``, ``samples``,
        ``micro_batches``, ``seconds``, ``tokens_per_s`` (tokens / seconds), ``skipped`` (1 when no sample
        had a trained token: no update is made, the step still counts).
        """
        started = time.perf_counter()
        batch = read_samples(samples)  # read and checked once, for every pass
        old: list[torch.Tensor] | None = [] if self.cfg.epochs > 1 else None
        for _ in range(self.cfg.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            out = self._accumulate(batch, old)
            skipped = out["trained_tokens"] == 0
            if skipped:
                out["grad_norm"] = 0.0
                break
            params = [p for p in self.model.parameters() if p.grad is not None]
            max_norm = self.cfg.grad_clip if self.cfg.grad_clip is not None else math.inf
            out["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        out["skipped"] = float(skipped)
        out["seconds"] = time.perf_counter() - started
        out["tokens_per_s"] = out["tokens"] / out["seconds"] if out["seconds"] > 0 else 0.0
        return out

    @torch.no_grad()
    def sample_logprobs(self, samples: pa.Table | pa.RecordBatch | Iterable[pa.RecordBatch]
                        ) -> list[np.ndarray]:
        """The policy's log-prob of every token of every sample (float32 arrays, aligned with input_ids;
        entry 0 is 0), in row order; micro-batched like training."""
        batch = read_samples(samples)
        self.check_samples(batch)
        out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(batch)
        for rows in pack_micro_batches(batch.lengths, self.cfg.micro_batch_tokens):
            _, logp = self._forward_logprobs(self.model, pad_micro_batch(batch, rows, self.device))
            logp = logp.float().cpu().numpy()
            for j, i in enumerate(rows):
                out[i] = logp[j, : batch.lengths[i]].copy()
        return out

    # ------------------------------------------------------------------------------ weights

    @property
    def tied_lm_head(self) -> bool:
        """Whether the output projection shares its tensor with the input embeddings (then only the
        embedding is yielded by :meth:`named_weights`; the engine re-ties ``lm_head``)."""
        out = self.model.get_output_embeddings()
        return out is not None and out.weight is self.model.get_input_embeddings().weight

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(Hugging Face parameter name, detached tensor)`` for every parameter, a tied tensor once
        (under its first name, e.g. ``model.embed_tokens.weight``), frozen ones too (``train_layers``):
        the engine takes a whole state dict. Tensors live on the training device
        in float32; they are views of the live weights: copy them before the next ``train_step``.
        With ``lora``: the base model's names, each adapted weight merged with the adapter's update
        (new tensors; the live model keeps base and adapter apart)."""
        if self.lora is not None:
            yield from loras.merged_weights(self.model)
            return
        for name, p in self.model.named_parameters():
            yield name, p.detach()

    def save_adapter(self, path: str | Path) -> Path:
        """The current adapter as a PEFT folder at ``path`` (``adapter_config.json`` +
        ``adapter_model.safetensors``, which vLLM's ``--enable-lora`` loads); BackendError without
        ``lora``."""
        if self.lora is None:
            raise BackendError("this torch backend trains every weight (backend.lora is not set): there is "
                               "no adapter to save")
        return loras.save(self.model, path)

    # ------------------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, root: str | Path, extra: dict[str, Any] | None = None, *,
                        name: int | None = None) -> Path:
        """Write ``root/step-<name:08d>`` (``name``: the run's step, default this backend's update count;
        HF weights + config + tokenizer files, optimizer.pt, trainer_state.json holding ``step`` and
        ``extra``; see :mod:`lgt.trainer.backends.checkpoints`) and return it. ``extra`` must be
        JSON-serialisable (TypeError otherwise, before anything is written)."""
        def write(tmp: Path) -> None:
            if self.lora is not None:
                loras.save(self.model, tmp)
            else:
                self.model.save_pretrained(tmp)
            for src in tokenizer_files(self.model_dir):
                shutil.copy2(src, tmp / src.name)
            torch.save(self.optimizer.state_dict(), tmp / OPTIMIZER_FILE)
            torch.save(torch.get_rng_state(), tmp / RNG_FILE)

        return write_checkpoint(root, self.step, extra, self.base_model_dir, write, name=name)

    @classmethod
    def resume(cls, ckpt_dir: str | Path, cfg: TorchConfig) -> tuple[TorchBackend, dict[str, Any]]:
        """A backend restored from a finished checkpoint (model, optimizer, step) and the ``extra`` it
        was saved with. CheckpointError when ``ckpt_dir`` is not a finished checkpoint."""
        ckpt = Path(ckpt_dir)
        step, extra, base = read_state(ckpt)
        adapter = (ckpt / loras.ADAPTER_CONFIG).is_file()
        if adapter != (cfg.lora is not None):
            raise CheckpointError(f"{ckpt} holds {'a LoRA adapter' if adapter else 'a full model'} but "
                                  f"backend.lora is {'not set' if adapter else 'set'}: resume with the "
                                  "backend.lora it was saved with")
        try:
            if adapter:  # the base from the run's model, the adapter from the checkpoint
                if base == ckpt:
                    raise CheckpointError(f"{ckpt} holds a LoRA adapter whose base model (base_model in its "
                                          f"{STATE_FILE}) is gone: the adapter cannot be resumed without it")
                backend = cls.load(base, cfg)
                loras.load_weights(backend.model, ckpt)
            else:
                backend = cls.load(ckpt, cfg, ref_model_dir=base)
        except ModelError as e:
            raise CheckpointError(f"{ckpt} does not hold a loadable model ({e})") from None
        opt_state = torch.load(ckpt / OPTIMIZER_FILE, map_location=backend.device, weights_only=True)
        try:
            backend.optimizer.load_state_dict(opt_state)
        except ValueError:  # another number of trained parameters
            raise CheckpointError(f"{ckpt}'s optimizer state is for another set of trained parameters than "
                                  "this config trains: resume with the backend.train_layers and "
                                  "train_embeddings it was saved with") from None
        if (ckpt / RNG_FILE).is_file():
            torch.set_rng_state(torch.load(ckpt / RNG_FILE, weights_only=True))
        backend.step = step
        return backend, extra

    def close(self) -> None:
        """Free the model, its optimizer and the reference copy."""
        self.model = self.optimizer = self.ref = None  # type: ignore[assignment]


