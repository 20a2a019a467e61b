"""The verl backend: store samples -> verl ``DataProto`` -> one policy update by verl's FSDP actor.

verl (0.9) trains through ``TrainingWorker`` + an engine (FSDP/FSDP2 here) with the loss
``verl.workers.utils.losses.ppo_loss``; its trainer feeds it a left/right padded ``DataProto``
(``prompts | responses``) converted to verl's no-padding ``TensorDict``. This module builds that
``DataProto`` from the store's samples and drives one ``TrainingWorker`` in this process (world size 1,
no Ray), the way verl's own ``RayPPOTrainer._update_actor`` drives its worker group.

How a store sample maps onto verl's row (``samples_to_dataproto``):

* A sample is one merged multi-turn token sequence: prompt, generated tokens, tool/environment tokens,
  generated tokens, ... with ``loss_mask`` 1 on the generated ones. verl splits a row into
  ``prompt | response``; the split is the FIRST generated token. ``prompts`` = the tokens before it
  (left-padded), ``responses`` = every token from it on (right-padded); tool tokens inside the response
  get ``response_mask`` 0, so ``response_mask`` selects exactly the sample's ``loss_mask`` tokens.
* ``old_log_probs`` = the recorded ``behaviour_logprobs`` of the response tokens (verl's "bypass" mode:
  the PPO ratio is taken against the engine's behaviour policy, so clipping bounds the step from the
  policy that generated the tokens; no separate old-policy forward pass and no extra IS weight).
  ``VerlConfig(old_logprobs="recompute")`` instead takes them from a forward pass of the policy being
  trained (before the update) and corrects for the behaviour/old mismatch with importance weights
  (``lgt.trainer.rl.loss.importance_weights``: truncated or masked IS) passed as verl's
  ``rollout_is_weights``, which verl's PPO loss multiplies into the per-token loss.
* ``advantages`` = the sample's (rollout's) advantage broadcast over ``response_mask``; with a
  ``token_advantage`` column (on-policy distillation's per-token advantages,
  :mod:`lgt.trainer.distill.opd`) each response token's own instead.
* Loss weights: lgt's ``rollout`` aggregation (each rollout counts once: ``Σ_i w_i Σ_t l_it`` with
  ``w_i = loss_weight``) maps EXACTLY onto verl's ``token-sum`` aggregation with ``w_i`` folded into
  the advantages: every term of verl's (dual-)clipped PPO loss is linear in the advantage and its
  branch depends only on the advantage's sign, so for ``w > 0``
  ``pg_loss(w·A) = w·pg_loss(A)`` token by token. What this does not carry: verl's entropy and KL
  terms are aggregated with the same mode, unweighted, so ``VerlConfig`` refuses them with
  ``loss_agg_mode="rollout"``; the ``actor/pg_clipfrac``-style metrics are unweighted token means.
  verl's own modes (``token-mean``, ``seq-mean-token-mean``, ...) pass through with plain advantages.
  When ``ppo_mini_batch_size`` splits a batch into several optimizer steps, each step's loss is its
  mini-batch's share of the weighted sum (the weights are not renormalised per mini-batch).

On a machine without CUDA, importing this module installs a CPU platform for verl (verl only ships
CUDA/NPU platforms) and ``VerlInProcessActor`` registers verl's FSDP engine for it; the engine then runs
FSDP2 over a gloo process group of one rank. That is for tests and small checks, not for speed.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import types
from collections.abc import Iterator
from functools import cache, partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

# -- verl's platform on CPU (must precede any import of verl's engines) -----------------------------


def _install_cpu_platform() -> None:
    """Make verl's device layer answer "cpu" (gloo, no memory stats) when this machine has no CUDA."""
    from verl.plugin.platform import PlatformBase, platform_manager, set_platform

    if platform_manager._current_platform is not None:  # already chosen (e.g. by the caller)
        return

    def _zero(*_a: Any, **_k: Any) -> int:
        return 0

    def _nothing(*_a: Any, **_k: Any) -> None:
        return None

    cpu_module = types.SimpleNamespace(
        is_available=lambda: True, is_initialized=lambda: True, current_device=lambda: "cpu",
        device_count=lambda: 1, set_device=_nothing, synchronize=_nothing, empty_cache=_nothing,
        max_memory_allocated=_zero, max_memory_reserved=_zero, memory_allocated=_zero,
        memory_reserved=_zero, reset_peak_memory_stats=_nothing, mem_get_info=lambda *_a: (0, 0),
        manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed,
        get_rng_state=lambda *_a, **_k: torch.get_rng_state(),
        set_rng_state=lambda state, *_a, **_k: torch.set_rng_state(state),
        current_stream=torch.cpu.current_stream, Stream=torch.cpu.Stream, Event=torch.cpu.Event,
        stream=torch.cpu.stream, get_device_name=lambda *_a: "CPU",
    )

    class CpuPlatform(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = cpu_module

        def is_available(self) -> bool:
            return True

        def current_device(self) -> str:  # a str, so `tensor.to(get_device_id())` stays on the CPU
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: int | None = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> None:
            return None

    set_platform(CpuPlatform())


if not torch.cuda.is_available():
    _install_cpu_platform()

from verl import DataProto  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

from lgt.trainer.backends.base import VERL_STRATEGIES, BackendError, VerlConfig  # noqa: E402
from lgt.trainer.backends.checkpoints import CheckpointError  # noqa: E402
from lgt.trainer.backends.samples import SampleError, TokenBatch, read_samples  # noqa: E402
from lgt.trainer.rl.loss import fill_behaviour, importance_weights  # noqa: E402

STATE_FILE = "lgt_verl.json"  # in a checkpoint's verl/ folder: the step count and world size, written last

# -- errors ------------------------------------------------------------------------------------------


VerlConfigError = BackendError  # a verl backend setting is invalid (one sentence naming it)


# -- samples -> DataProto ---------------------------------------------------------------------------


def samples_to_dataproto(
    samples: pa.Table,
    *,
    max_prompt_len: int | None = None,
    max_response_len: int | None = None,
    pad_token_id: int,
    temperature: float = 1.0,
    fold_loss_weight: bool = False,
) -> DataProto:
    """Turn store samples (``SAMPLES`` schema, B rows) into verl's padded actor batch: read and checked
    by :func:`~lgt.trainer.backends.samples.read_samples` as for every backend, split into prompt and
    response (:func:`split_points`), padded (:func:`widths`, :func:`padded_rows`), the advantages put on
    the response tokens (:func:`response_advantages`).

    Widths: P = ``max_prompt_len`` (or the longest prompt), R = ``max_response_len`` (or the longest
    response); a sample longer than a given cap is an error (it is never cut: cutting a prompt would
    change what the recorded logprobs were conditioned on).

    Returns a ``DataProto`` whose batch holds
      ``prompts`` (B, P) int64, left-padded with ``pad_token_id``;
      ``responses`` (B, R) int64, right-padded;
      ``input_ids`` (B, P+R) = prompts | responses;  ``attention_mask`` (B, P+R) int64, 1 on real tokens;
      ``position_ids`` (B, P+R) int64, 0.. over the real tokens (verl's ``cumsum(mask) - 1`` clipped at
      0: left padding at 0, right padding repeating the last position);
      ``response_mask`` (B, R) int64 = the sample's ``loss_mask`` over the response part;
      ``old_log_probs`` (B, R) float32 = ``behaviour_logprobs`` there (0 off the mask; NaN where the
      proxy recorded none: ``VerlInProcessActor.train_step`` recomputes those);
      ``advantages`` (B, R) float32 = advantage (× ``loss_weight`` when ``fold_loss_weight``) on the
      mask, 0 elsewhere; with a ``token_advantage`` column (list<float32> aligned with ``input_ids``)
      each token's own advantage in place of the sample's;
    ``non_tensor_batch["uid"]`` the sample ids; ``meta_info``: ``temperature`` (the sampling temperature
    the behaviour logprobs were recorded at; verl divides the logits by it).
    """
    batch = read_samples(samples)
    if not (temperature > 0 and math.isfinite(temperature)):
        raise SampleError(f"temperature must be a positive number, got {temperature!r}.")
    prompt_lens = split_points(batch, fold_loss_weight=fold_loss_weight)
    width_p, width_r = widths(batch, prompt_lens, max_prompt_len, max_response_len)
    rows = padded_rows(batch, prompt_lens, width_p, width_r, pad_token_id)
    advantages = response_advantages(batch, rows.pop("token_advantages", None), rows["response_mask"],
                                     fold_loss_weight=fold_loss_weight)
    tensors = {key: torch.from_numpy(value) for key, value in rows.items()} | {
        "advantages": torch.from_numpy(advantages)}
    return DataProto.from_dict(tensors=tensors,
                               non_tensors={"uid": np.array(batch.sample_ids.to_pylist(), dtype=object)},
                               meta_info={"temperature": float(temperature)})


def split_points(batch: TokenBatch, *, fold_loss_weight: bool = False) -> np.ndarray:
    """Each sample's prompt length (N,): the index of its first generated token, where verl's row splits
    into ``prompt | response``. SampleError for a sample without a generated token or without a
    prompt, and (``fold_loss_weight``) one whose ``loss_weight`` is not > 0."""
    no_generated = np.flatnonzero(batch.masked == 0)
    if len(no_generated):
        sid = batch.sample_id(int(no_generated[0]))
        raise SampleError(f"sample {sid!r} has no generated token (loss_mask is all 0).")
    generated = np.flatnonzero(batch.loss_mask)
    firsts = generated[np.searchsorted(generated, batch.starts)] - batch.starts  # each row has one
    no_prompt = np.flatnonzero(firsts == 0)
    if len(no_prompt):
        sid = batch.sample_id(int(no_prompt[0]))
        raise SampleError(f"sample {sid!r} starts with a generated token: it has no prompt.")
    unweighted = np.flatnonzero(batch.loss_weight <= 0) if fold_loss_weight else []
    if len(unweighted):
        i = int(unweighted[0])
        raise SampleError(f"sample {batch.sample_id(i)!r} has loss_weight {batch.loss_weight[i]}, not > 0.")
    return firsts


def widths(batch: TokenBatch, prompt_lens: np.ndarray, max_prompt_len: int | None,
           max_response_len: int | None) -> tuple[int, int]:
    """``(P, R)``: the caps, or the longest prompt and response; SampleError for a sample over a cap (it
    is never cut: cutting a prompt would change what the recorded logprobs were conditioned on)."""
    response_lens = batch.lengths - prompt_lens
    width_p = int(prompt_lens.max()) if max_prompt_len is None else max_prompt_len
    width_r = int(response_lens.max()) if max_response_len is None else max_response_len
    for name, lens, cap in (("prompt", prompt_lens, width_p), ("response", response_lens, width_r)):
        if lens.max() > cap:
            i = int(lens.argmax())
            raise SampleError(
                f"sample {batch.sample_id(i)!r} has a {name} of {int(lens[i])} tokens, over the {name} "
                f"length limit of {cap}.")
    return width_p, width_r


def padded_rows(batch: TokenBatch, prompt_lens: np.ndarray, width_p: int, width_r: int,
                pad_token_id: int) -> dict[str, np.ndarray]:
    """The batch's tokens in verl's padded layout (:func:`samples_to_dataproto`'s keys but
    ``advantages``; ``token_advantages`` (B, R) float64 too when the samples carry them): each token
    put in place at once by its (row, column), prompts right-aligned in (B, P), responses left-aligned
    in (B, R)."""
    n, lengths = len(batch), batch.lengths
    row = np.repeat(np.arange(n), lengths)
    first = np.repeat(prompt_lens, lengths)
    pos = np.arange(len(batch.input_ids)) - np.repeat(batch.starts, lengths)  # within its sample
    prompt = pos < first
    response = ~prompt
    r_row, r_col = row[response], pos[response] - first[response]

    prompts = np.full((n, width_p), pad_token_id, dtype=np.int64)
    prompts[row[prompt], width_p - first[prompt] + pos[prompt]] = batch.input_ids[prompt]
    responses = np.full((n, width_r), pad_token_id, dtype=np.int64)
    responses[r_row, r_col] = batch.input_ids[response]
    response_mask = np.zeros((n, width_r), dtype=np.int64)
    response_mask[r_row, r_col] = batch.loss_mask[response]
    old_lp = np.zeros((n, width_r), dtype=np.float32)
    old_lp[r_row, r_col] = batch.behaviour_logprobs[response]
    old_lp = np.where(response_mask != 0, old_lp, np.float32(0))  # 0 off the mask, whatever was there
    columns = np.arange(width_p + width_r)
    attention = ((columns >= width_p - prompt_lens[:, None])
                 & (columns < width_p + (lengths - prompt_lens)[:, None])).astype(np.int64)
    rows = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": np.concatenate([prompts, responses], axis=1),
        "attention_mask": attention,
        "position_ids": np.clip(np.cumsum(attention, axis=1) - 1, 0, None),
        "response_mask": response_mask,
        "old_log_probs": old_lp,
    }
    if batch.token_advantage is not None:
        token_adv = np.zeros((n, width_r), dtype=np.float64)
        token_adv[r_row, r_col] = batch.token_advantage[response]
        rows["token_advantages"] = token_adv
    return rows


def response_advantages(batch: TokenBatch, token_advantages: np.ndarray | None, response_mask: np.ndarray,
                        *, fold_loss_weight: bool = False) -> np.ndarray:
    """(B, R) float32: each sample's advantage (or its tokens' own, ``token_advantages``) on the response
    mask, × its ``loss_weight`` when ``fold_loss_weight``, 0 elsewhere."""
    per_token = token_advantages if token_advantages is not None else batch.advantage[:, None]
    if fold_loss_weight:
        per_token = per_token * batch.loss_weight[:, None]
    return np.where(response_mask != 0, per_token, 0.0).astype(np.float32)


# -- the backend -------------------------------------------------------------------------------------


@cache
def _register_cpu_engine() -> None:
    """Let verl's FSDP engine run on the CPU platform (verl registers it for CUDA and NPU only); once."""
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    EngineRegistry.register(model_type="language_model", backend=list(VERL_STRATEGIES),
                            device=["cpu"])(FSDPEngineWithLMHead)


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


# -- pieces both actors use (in this process, and on Ray's ranks: lgt.trainer.backends.verl_ray) ----------


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


def pad_batch(batch: DataProto, multiple: int) -> tuple[DataProto, int]:
    """``batch`` grown to a multiple of ``multiple`` rows with copies of its first rows that train on
    nothing (``response_mask``, ``advantages`` and ``old_log_probs`` 0); returns it and the rows added."""
    size = len(batch)
    pad = -size % multiple
    if pad == 0:
        return batch, 0
    filler = batch.select_idxs(np.arange(pad) % size)
    for key in ("response_mask", "advantages", "old_log_probs"):
        filler.batch[key] = torch.zeros_like(filler.batch[key])
    filler.non_tensor_batch["uid"] = np.array([f"{u}#pad" for u in filler.non_tensor_batch["uid"]],
                                              dtype=object)
    return DataProto.concat([batch, filler]), pad


def rank_major_order(size: int, mini: int, world_size: int) -> np.ndarray:
    """Row order for dispatch (rank r gets the r-th contiguous 1/N of the rows) such that rank r's k-th
    mini-batch of ``mini / N`` rows is its share of rows ``[k*mini, (k+1)*mini)``.

    e.g. size 8, mini 4, N 2 -> [0, 1, 4, 5, 2, 3, 6, 7]: rank 0 trains (0, 1) then (4, 5)."""
    per = mini // world_size
    return np.array([k * mini + r * per + i for r in range(world_size) for k in range(size // mini)
                     for i in range(per)], dtype=np.int64)


def fill_missing_behaviour(batch: DataProto, logprobs) -> dict[str, float]:
    """Behaviour logprobs the proxy could not record (NaN) become the current policy's (``logprobs``:
    a ``DataProto -> (B, R)`` forward pass before the update; IS weight 1 there), in place."""
    mask = batch.batch["response_mask"]
    behaviour = batch.batch["old_log_probs"]
    missing = torch.isnan(behaviour) & mask.bool()
    if missing.any():
        filled, _ = fill_behaviour(behaviour, logprobs(batch) * mask)
        batch.batch["old_log_probs"] = torch.where(mask.bool(), filled, torch.zeros_like(filled))
    return {"actor/behaviour_recomputed_frac": float(missing.sum() / mask.sum().clamp_min(1))}


def recompute_old_logprobs(batch: DataProto, logprobs, config: VerlConfig) -> dict[str, float]:
    """``old_log_probs`` become the current policy's and verl's ``rollout_is_weights`` correct for the
    behaviour mismatch (``VerlConfig(old_logprobs="recompute")``), in place."""
    mask = batch.batch["response_mask"]
    behaviour = batch.batch["old_log_probs"]
    old = logprobs(batch) * mask
    weights = importance_weights(old, behaviour, mask, mode=config.loss.is_mode, cap=config.loss.is_cap)
    batch.batch["old_log_probs"] = old
    batch.batch["rollout_is_weights"] = weights
    on = mask.bool()
    return {"actor/behaviour_kl": float((old - behaviour)[on].mean()),
            "actor/is_weight_mean": float(weights[on].mean())}


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
            _register_cpu_engine()
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
