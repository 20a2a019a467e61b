"""A batch of training samples, read from the Arrow table once and checked, for any backend. No torch here.

The recipe hands a backend a pyarrow table of the store's samples (:data:`lgt.store.samples.SAMPLES`
plus the trainer's ``advantage`` and ``loss_weight``, :func:`lgt.trainer.rl.algorithm.assign`; on-policy
distillation adds ``token_advantage`` and the teacher's top k, :mod:`lgt.trainer.distill.opd`).
:func:`read_samples` turns it into a :class:`TokenBatch`: flat numpy arrays over the Arrow list buffers
(no per-token Python objects) and the per-sample scalars, every column checked, so a backend only adds
what its own model refuses (a sample too long, a token outside the vocabulary, a sample verl cannot
split into prompt and response). Each refusal is a :class:`SampleError` of one sentence naming the sample.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

REQUIRED_COLUMNS = ("sample_id", "input_ids", "loss_mask", "behaviour_logprobs", "advantage", "loss_weight")


class SampleError(ValueError):
    """A batch of samples a backend cannot train on; the message names the sample and the problem."""


@dataclass(frozen=True)
class TokenBatch:
    """A batch of samples as flat numpy arrays over the Arrow buffers (no per-token Python objects).

    Sample ``i``'s tokens are ``input_ids[starts[i]:starts[i] + lengths[i]]`` (same for ``loss_mask``,
    ``behaviour_logprobs`` and ``token_advantage``); the samples lie one after the other, so ``starts``
    is the running sum of ``lengths``. ``advantage``, ``loss_weight`` are per sample (N,), as the table
    holds them (float64), each finite as a float32. ``token_advantage`` (total tokens,) float32 when the
    samples carry per-token advantages (then the loss uses it instead of ``advantage``): finite on the
    loss mask, 0 off it.
    """

    sample_ids: pa.Array
    input_ids: np.ndarray  # (total tokens,) int32
    loss_mask: np.ndarray  # (total tokens,) int8, 0 or 1
    behaviour_logprobs: np.ndarray  # (total tokens,) float32; NaN where the proxy recorded none
    starts: np.ndarray  # (N,) int64
    lengths: np.ndarray  # (N,) int64, each >= 1
    masked: np.ndarray  # (N,) int64: loss_mask tokens per sample
    advantage: np.ndarray  # (N,) float64
    loss_weight: np.ndarray  # (N,) float64
    token_advantage: np.ndarray | None = None  # (total tokens,) float32: per-token advantages (OPD)
    top_k_ids: np.ndarray | None = None  # (total tokens, k) int64: the teacher's top k (OPD, top_k > 0)
    top_k_logprobs: np.ndarray | None = None  # (total tokens, k) float32: their teacher log-probs

    def __len__(self) -> int:
        return len(self.lengths)

    def sample_id(self, i: int) -> str:
        return str(self.sample_ids[i].as_py())

    def sample_at(self, token: int) -> int:
        """The sample that flat token index ``token`` belongs to."""
        return int(np.searchsorted(self.starts, token, side="right") - 1)


def _as_table(samples: pa.Table | pa.RecordBatch | Iterable[pa.RecordBatch]) -> pa.Table:
    """``samples`` as one table (an iterator of record batches is read here, once)."""
    if isinstance(samples, pa.Table):
        return samples
    if isinstance(samples, pa.RecordBatch):
        return pa.Table.from_batches([samples])
    batches = list(samples)
    if not batches:
        raise SampleError("the batch of samples is empty: give at least one sample row")
    return pa.Table.from_batches(batches)


def _list_column(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(values, offsets)`` of a list column: row i is ``values[offsets[i]:offsets[i + 1]]`` (zero-copy)."""
    arr = table.column(name).combine_chunks()
    if arr.null_count:
        row = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
        raise SampleError(f"sample {table.column('sample_id')[row].as_py()} has no {name} (null)")
    offsets = arr.offsets.to_numpy().astype(np.int64, copy=False)
    values = arr.values.to_numpy(zero_copy_only=False)
    return values, offsets


def _scalar_column(table: pa.Table, name: str) -> np.ndarray:
    """A per-sample number column (float64), each value finite as a float32."""
    col = table.column(name)
    if col.null_count:
        row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
        raise SampleError(f"sample {table.column('sample_id')[row].as_py()} has no {name} (null)")
    values = col.to_numpy().astype(np.float64, copy=False)
    narrow = values.astype(np.float32)
    bad = np.flatnonzero(~np.isfinite(narrow))
    if len(bad):
        raise SampleError(f"sample {table.column('sample_id')[int(bad[0])].as_py()} has a non-finite "
                          f"{name} ({narrow[bad[0]]})")
    return values


def read_samples(samples: pa.Table | pa.RecordBatch | Iterable[pa.RecordBatch]) -> TokenBatch:
    """The token lists and per-sample scalars of rows with the SAMPLES schema, checked for consistency:
    the required columns, no nulls, one token per entry of every per-token list, at least one token a
    sample, ``loss_mask`` 0 or 1, finite advantages and loss weights, a finite ``token_advantage`` on
    every trained token, the same k of teacher top-k ids and logprobs per token."""
    table = _as_table(samples)
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise SampleError(f"the samples lack column(s) {', '.join(missing)}: give rows with the store's "
                          "SAMPLES schema (lgt.store.samples.SAMPLES)")
    if table.num_rows == 0:
        raise SampleError("the batch of samples is empty: give at least one sample row")
    ids, ids_off = _list_column(table, "input_ids")
    mask, mask_off = _list_column(table, "loss_mask")
    blp, blp_off = _list_column(table, "behaviour_logprobs")
    lists = [("loss_mask", mask_off), ("behaviour_logprobs", blp_off)]
    per_token = "token_advantage" in table.column_names
    if per_token:
        tadv, tadv_off = _list_column(table, "token_advantage")
        lists.append(("token_advantage", tadv_off))
    lengths = np.diff(ids_off)
    for name, off in lists:
        bad = np.flatnonzero(np.diff(off) != lengths)
        if len(bad):
            i = int(bad[0])
            raise SampleError(f"sample {table.column('sample_id')[i].as_py()} has {lengths[i]} input_ids but "
                              f"{off[i + 1] - off[i]} {name}: the token lists must have equal lengths")
    if len(lengths) and lengths.min() < 1:
        i = int(np.argmin(lengths))
        raise SampleError(f"sample {table.column('sample_id')[i].as_py()} has no tokens")
    # Rebase the lists onto offsets from 0 (zero-copy views; the lengths match row by row).
    ids = ids[ids_off[0]:ids_off[-1]]
    mask = mask[mask_off[0]:mask_off[-1]]
    blp = blp[blp_off[0]:blp_off[-1]]
    starts = ids_off[:-1] - ids_off[0]
    sample_ids = table.column("sample_id").combine_chunks()
    if len(mask) and (mask.min() < 0 or mask.max() > 1):
        bad = int(np.flatnonzero((mask < 0) | (mask > 1))[0])
        i = int(np.searchsorted(starts, bad, side="right") - 1)
        raise SampleError(f"sample {sample_ids[i].as_py()} has loss_mask value {mask[bad]}: "
                          "loss_mask holds 0 or 1 per token")
    token_advantage = None
    if per_token:
        token_advantage = _token_advantage(tadv[tadv_off[0]:tadv_off[-1]], mask, starts, sample_ids)
    top_ids = top_lps = None
    if "teacher_top_k_ids" in table.column_names:
        top_ids, top_lps = _top_k_columns(table, lengths, len(ids))
    cum = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
    masked = cum[starts + lengths] - cum[starts]
    return TokenBatch(sample_ids=sample_ids, input_ids=ids, loss_mask=mask, behaviour_logprobs=blp,
                      starts=starts, lengths=lengths, masked=masked,
                      advantage=_scalar_column(table, "advantage"),
                      loss_weight=_scalar_column(table, "loss_weight"), token_advantage=token_advantage,
                      top_k_ids=top_ids, top_k_logprobs=top_lps)


def _token_advantage(values: np.ndarray, mask: np.ndarray, starts: np.ndarray,
                     sample_ids: pa.Array) -> np.ndarray:
    """Per-token advantages as float32, finite on the loss mask (SampleError otherwise), 0 off it."""
    values = values.astype(np.float32, copy=False)
    on = mask != 0
    bad = np.flatnonzero(on & ~np.isfinite(values))
    if len(bad):
        i = int(np.searchsorted(starts, bad[0], side="right") - 1)
        raise SampleError(f"sample {sample_ids[i].as_py()} has a non-finite token_advantage on a "
                          "generated token")
    return np.where(on, values, np.float32(0))


def _top_k_columns(table: pa.Table, lengths: np.ndarray, total: int) -> tuple[np.ndarray, np.ndarray]:
    """``teacher_top_k_ids`` / ``teacher_top_k_logprobs`` as (total tokens, k) arrays: each row holds k
    entries per token, the same k in every row."""
    if "teacher_top_k_logprobs" not in table.column_names:
        raise SampleError("the samples have teacher_top_k_ids but no teacher_top_k_logprobs")
    ids, ids_off = _list_column(table, "teacher_top_k_ids")
    lps, lps_off = _list_column(table, "teacher_top_k_logprobs")
    per_row = np.diff(ids_off)
    k = int(per_row[0] // lengths[0])  # every sample has a token (checked before)
    bad = np.flatnonzero((per_row != k * lengths) | (np.diff(lps_off) != per_row))
    if k < 1 or len(bad):
        i = int(bad[0]) if len(bad) else 0
        raise SampleError(f"sample {table.column('sample_id')[i].as_py()} has {np.diff(ids_off)[i]} teacher "
                          f"top-k ids and {np.diff(lps_off)[i]} logprobs for {lengths[i]} tokens: each "
                          "token needs the same k of both")
    ids = ids[ids_off[0]:ids_off[-1]].astype(np.int64).reshape(total, k)
    lps = lps[lps_off[0]:lps_off[-1]].astype(np.float32, copy=False).reshape(total, k)
    return ids, lps
