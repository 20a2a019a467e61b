"""The merge: the calls of rollout attempts become samples in one streaming pass over the token lists.

The prefix check is a memcmp (``pyarrow.Buffer.equals``) on zero-copy slices of the Arrow buffers of
the calls files, and samples are assembled by joining byte ranges (:func:`merge_calls`). Which calls
are taken, and in which order, is SQL's (:func:`lgt.store.samples.call_order`); what the merge makes is
turned into the samples table by :mod:`lgt.store.samples`.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from .realign import TRUNCATION, realign_offset
from .schema import DEFAULT_POLICY

# Why a call starts a new sample (merge_breaks.reason).
EXCLUDED_CALL = "excluded_call"  # the call before it was excluded (failed, no token ids, ...)
# TRUNCATION, TEXT_CHANGE, BOUNDARY_RESPLIT: the prompt does not continue the held text (realign.py)
RETOKENIZED = "retokenized"  # exact mode: the text extends at a clean boundary; realign would merge
NO_TOKENIZER = "no_tokenizer"  # exact mode without a tokenizer: the tokens differ, reason unknown

# The finish reasons of a reply that ended on a stop token, which realign may find left out of the next
# prompt: vLLM reports tool_calls, not stop, for a reply its tool parser read calls from.
STOPPED = ("stop", "tool_calls")

# rollout_id, attempt, sample_index, n_calls, masked, policy
SampleScalars = tuple[str, int, int, int, int, str]
Key = tuple[str, int, str]  # rollout_id, attempt, policy: the calls merged into samples together


_ZEROS = pa.py_buffer(bytes(4 << 16))  # logprob 0.0 for up to 64k context tokens at a time
_EMPTY = pa.py_buffer(b"")


@dataclass(slots=True)
class _Call:
    """One call of the stream. Its token lists are zero-copy slices of its batch's Arrow buffers:
    comparing two (``Buffer.equals``) is a memcmp, and joining them copies each byte once."""

    key: Key
    seq: int
    prev_seq: int | None
    next_seq: int | None
    excluded: str | None
    policy_version: int
    stop: bool
    prompt: pa.Buffer = field(default_factory=lambda: _EMPTY)  # little-endian int32 ids
    response: pa.Buffer = field(default_factory=lambda: _EMPTY)  # int32 ids
    logprobs: pa.Buffer = field(default_factory=lambda: _EMPTY)  # float32 (NaN: not recorded)
    missing_logprobs: bool = False  # recorded without logprobs: the trainer recomputes them
    # (version, tokens) runs of a call that lived through an update (calls.response_policy_versions);
    # None: every generated token is policy_version's
    spans: list[tuple[int, int]] | None = None

    def detach(self) -> _Call:
        """A copy holding its own bytes (it waits for its predecessor, past its batch)."""
        own = lambda b: pa.py_buffer(b.to_pybytes())  # noqa: E731
        return _Call(self.key, self.seq, self.prev_seq, self.next_seq, self.excluded,
                     self.policy_version, self.stop, own(self.prompt), own(self.response),
                     own(self.logprobs), self.missing_logprobs, self.spans)


@dataclass(slots=True)
class _Sample:
    """A sample being assembled: references to byte ranges, copied once when its chunk is built."""

    index: int
    ids: list = field(default_factory=list)  # byte ranges of int32 token ids
    logprobs: list = field(default_factory=list)  # byte ranges of float32 logprobs
    runs: array = field(default_factory=lambda: array("q"))  # n_context, n_generated of each call
    versions: array = field(default_factory=lambda: array("i"))  # -1, policy version of each call
    masked: int = 0
    owned: int = 0  # pieces before this index hold their own bytes
    n_calls: int = 0

    def own(self) -> None:
        """Copy the pieces that still point into a batch (small: new tokens only), so the sample
        does not keep whole batches alive while its attempt waits for its next call."""
        for pieces in (self.ids, self.logprobs):
            for i in range(self.owned, len(pieces)):
                pieces[i] = bytes(pieces[i])
        self.owned = len(self.ids)

    def add(self, c: _Call, context_from: int) -> None:
        """Append ``c``'s prompt tokens from ``context_from`` on (context) and its generated tokens."""
        n_ctx, n_gen = (c.prompt.size >> 2) - context_from, c.response.size >> 2
        self.ids.append(c.prompt.slice(4 * context_from))
        self.ids.append(c.response)
        self.logprobs.append(_ZEROS.slice(0, 4 * n_ctx) if n_ctx <= 1 << 16 else bytes(4 * n_ctx))
        self.logprobs.append(c.logprobs)
        spans = c.spans or [(c.policy_version, n_gen)]
        self.runs.extend((n_ctx, spans[0][1]))
        self.versions.extend((-1, spans[0][0]))
        for version, n in spans[1:]:  # a call that lived through an update: a run per version
            self.runs.extend((0, n))
            self.versions.extend((-1, version))
        self.masked += n_gen
        self.n_calls += 1


@dataclass(slots=True)
class _Attempt:
    """A rollout attempt while its calls go by in seq order."""

    last_seq: int | None = None
    sample: _Sample | None = None
    held: _Call | None = None  # the last trainable call: the sample holds its prompt + generated tokens
    after_excluded: bool = False
    n_samples: int = 0

    def own(self) -> None:
        """Hold no reference into the current batch (it is about to be released)."""
        if self.held is not None:
            self.held = self.held.detach()
        if self.sample is not None:
            self.sample.own()


@dataclass
class Merged:
    """The merge's output: token-list chunks, per-sample scalars, splits and counts."""

    chunks: list[list[pa.Array]]  # [input_ids, loss_mask, behaviour_logprobs, policy_versions] a chunk
    scalars: list[SampleScalars]  # per sample, in chunk order
    breaks: list[dict[str, Any]]
    excluded_calls: Counter
    used_calls: int = 0
    realigned: int = 0
    missing_logprobs: int = 0  # used calls without logprobs (NaN in behaviour_logprobs)


class _Output:
    """Finished samples, joined into chunks of list arrays, each byte copied once."""

    CHUNK_TOKENS = 1 << 24  # also bounds how many input batches finished samples keep alive

    def __init__(self) -> None:
        self.chunks: list[list[pa.Array]] = []
        self.scalars: list[SampleScalars] = []
        self._reset()

    def _reset(self) -> None:
        self.ids: list = []
        self.logprobs: list = []
        self.runs = array("q")
        self.versions = array("i")
        self.offsets = array("i", [0])

    def add(self, key: Key, s: _Sample) -> None:
        self.ids += s.ids
        self.logprobs += s.logprobs
        self.runs += s.runs
        self.versions += s.versions
        self.offsets.append(self.offsets[-1] + sum(s.runs))
        self.scalars.append((key[0], key[1], s.index, s.n_calls, s.masked, key[2]))
        if self.offsets[-1] >= self.CHUNK_TOKENS:
            self.flush()

    def flush(self) -> None:
        """Build the chunk's four list arrays: token ids and logprobs by joining the byte ranges,
        mask and policy versions by decoding runs (context: 0 / -1, generated: 1 / version)."""
        if len(self.offsets) == 1:
            return
        n = self.offsets[-1]
        offsets = pa.Array.from_buffers(pa.int32(), len(self.offsets), [None, pa.py_buffer(self.offsets)])
        lengths = _flat(pa.int64(), len(self.runs), self.runs)
        mask_values = _flat(pa.int8(), len(self.runs), b"\0\1" * (len(self.runs) // 2))
        version_values = _flat(pa.int32(), len(self.versions), self.versions)
        self.chunks.append([
            pa.ListArray.from_arrays(offsets, _flat(pa.int32(), n, b"".join(self.ids))),
            pa.ListArray.from_arrays(offsets, _run_decode(lengths, mask_values)),
            pa.ListArray.from_arrays(offsets, _flat(pa.float32(), n, b"".join(self.logprobs))),
            pa.ListArray.from_arrays(offsets, _run_decode(lengths, version_values)),
        ])
        self._reset()


def _flat(t: pa.DataType, n: int, data: bytes | bytearray | array) -> pa.Array:
    """An array of ``n`` values of fixed-width type ``t`` over ``data`` (no copy)."""
    return pa.Array.from_buffers(t, n, [None, pa.py_buffer(data)])


def _run_decode(lengths: pa.Array, values: pa.Array) -> pa.Array:
    """``values[i]`` repeated ``lengths[i]`` times, one after another."""
    nonzero = pc.greater(lengths, 0)
    ends = pc.cumulative_sum(lengths.filter(nonzero))
    if len(ends) == 0:
        return pa.array([], values.type)
    return pc.run_end_decode(pa.RunEndEncodedArray.from_arrays(ends, values.filter(nonzero)))


def merge_calls(batches: Iterable[pa.RecordBatch], order: dict, mode: str,
                decode: Callable[[list[int]], str] | None) -> Merged:
    """Merge the calls in ``batches`` (rows of the calls table, any order) into samples, one pass.

    Only the calls in ``order`` (:func:`call_order`: candidate attempts) are taken, each attempt's
    calls of one policy in seq order (``calls.policy``: each policy's calls are merged among
    themselves, a planner's call extending the planner's call before it, not the coder's in between):
    a call whose predecessor has not come by yet waits (with its own copy of its bytes) until it
    has. Guarantees: every generated token of a trainable call lands in exactly one
    sample, unchanged, with its logprob and policy version, and mask 1; every other token has mask
    0, logprob 0 and policy version -1.
    """
    attempts: dict[Key, _Attempt] = {}
    waiting: dict[tuple[Key, int], _Call] = {}
    out = _Output()
    state = Merged([], [], [], Counter())
    seen = 0
    for batch in batches:
        touched = set()
        for call in _calls(batch, order):
            seen += 1
            touched.add(call.key)
            att = attempts.get(call.key)
            if att is None:
                att = attempts[call.key] = _Attempt()
            while call is not None:
                if call.prev_seq != att.last_seq:  # its predecessor is still to come
                    waiting[(call.key, call.prev_seq)] = call.detach()
                    break
                _take(att, call, mode, decode, state, out)
                if call.next_seq is None:
                    if att.sample is not None:
                        out.add(call.key, att.sample)
                    del attempts[call.key]
                    break
                call = waiting.pop((call.key, call.seq), None) if waiting else None
        for key in touched & attempts.keys():  # attempts that go on in a later batch
            attempts[key].own()
    out.flush()
    if seen != len(order):
        raise RuntimeError(f"the calls view lists {len(order)} calls of trainable rollout attempts, the "
                           f"calls files hold {seen}; was the store written to during the build?")
    if waiting:  # a predecessor never came: the store changed under the query
        (key, seq), call = next(iter(waiting.items()))
        raise RuntimeError(f"rollout {key[0]!r} attempt {key[1]}: call {call.seq} came without call "
                           f"{seq}; was the store written to during the build?")
    state.chunks, state.scalars = out.chunks, out.scalars
    return state


def _take(att: _Attempt, c: _Call, mode: str, decode: Callable[[list[int]], str] | None,
          state: Merged, out: _Output) -> None:
    """Add call ``c`` (the next in seq order) to its attempt: extend the sample or start one."""
    att.last_seq = c.seq
    if c.excluded is not None:
        state.excluded_calls[c.excluded] += 1
        att.after_excluded = att.sample is not None
        return
    state.used_calls += 1
    state.missing_logprobs += c.missing_logprobs
    context_from, reason = 0, None
    if att.sample is not None:
        if att.after_excluded:
            reason = EXCLUDED_CALL
        else:
            context_from, reason = _link(att.held, c, mode, decode)
            if reason is None and mode == "realign":
                state.realigned += context_from != (att.held.prompt.size + att.held.response.size) >> 2
    if att.sample is None or reason is not None:
        if att.sample is not None:
            out.add(c.key, att.sample)
            state.breaks.append({"rollout_id": c.key[0], "attempt": c.key[1], "seq": c.seq, "reason": reason})
        att.sample = _Sample(att.n_samples)
        att.n_samples += 1
    att.sample.add(c, context_from)
    att.held, att.after_excluded = c, False


def _link(held: _Call, c: _Call, mode: str,
          decode: Callable[[list[int]], str] | None) -> tuple[int, str | None]:
    """(context_from, None) when ``c`` continues ``held``'s prompt + generated tokens, else (0, why not)."""
    n_prompt, n_held = held.prompt.size, held.prompt.size + held.response.size
    if (c.prompt.size >= n_held and c.prompt.slice(0, n_prompt).equals(held.prompt)
            and c.prompt.slice(n_prompt, held.response.size).equals(held.response)):
        return n_held >> 2, None
    if decode is None:
        return 0, TRUNCATION if c.prompt.size < n_held else NO_TOKENIZER
    held_ids = _ints(held.prompt) + _ints(held.response)
    offset, reason = realign_offset(decode, held_ids, n_prompt >> 2, held.stop, _ints(c.prompt))
    if offset is None:
        return 0, reason
    return (offset, None) if mode == "realign" else (0, RETOKENIZED)


def _ints(b: pa.Buffer) -> list[int]:
    a = array("i")
    a.frombytes(b)
    return a.tolist()


def _calls(batch: pa.RecordBatch, order: dict) -> Iterator[_Call]:
    """The batch's rows that are in ``order``, as :class:`_Call` views over its buffers (no copies).

    A call is excluded (the ``sample_calls`` view says the same in SQL) when its status is not ok or
    it lacks prompt or generated token ids. A call without one logprob per generated token is kept,
    its logprobs NaN (the trainer recomputes them; ``Merged.missing_logprobs`` counts such calls)."""
    col = batch.column
    p, r, lp = col("prompt_token_ids"), col("response_token_ids"), col("response_logprobs")
    prompt, response, logprobs = _values(p), _values(r), _values(lp)
    po, ro, lpo = p.offsets.to_pylist(), r.offsets.to_pylist(), lp.offsets.to_pylist()
    pb, rb, lb = 4 * p.values.offset, 4 * r.values.offset, 4 * lp.values.offset
    tokens_ok = pc.and_(p.is_valid(), r.is_valid()).to_pylist()
    versions = col("response_policy_versions").to_pylist()
    logprobs_ok = lp.is_valid().to_pylist()
    rows = zip(col("rollout_id").to_pylist(), col("attempt").to_pylist(), col("seq").to_pylist(),
               col("status").to_pylist(), col("policy_version").to_pylist(),
               col("finish_reason").to_pylist(), col("policy").to_pylist())
    for i, (rid, attempt, seq, status, version, finish, policy) in enumerate(rows):
        neighbours = order.get((rid, attempt, seq))
        if neighbours is None:
            continue
        prev, nxt = neighbours
        n_gen = ro[i + 1] - ro[i]
        excluded = status if status != "ok" else "no_token_ids" if not tokens_ok[i] else None
        if excluded is None:
            has_logprobs = logprobs_ok[i] and lpo[i + 1] - lpo[i] == n_gen
            yield _Call((rid, attempt, policy or DEFAULT_POLICY), seq, prev, nxt, None, version,
                        finish in STOPPED,
                        prompt.slice(pb + 4 * po[i], 4 * (po[i + 1] - po[i])),
                        response.slice(rb + 4 * ro[i], 4 * n_gen),
                        logprobs.slice(lb + 4 * lpo[i], 4 * n_gen) if has_logprobs else _nans(n_gen),
                        not has_logprobs, _spans(versions[i], n_gen))
        else:
            yield _Call((rid, attempt, policy or DEFAULT_POLICY), seq, prev, nxt, excluded, version, False)


def _spans(versions: list[int] | None, n_gen: int) -> list[tuple[int, int]] | None:
    """Per-token versions as (version, tokens) runs; None when there are none (or not one per token,
    as the samples view reads them too)."""
    if versions is None or len(versions) != n_gen or not versions:
        return None
    spans: list[tuple[int, int]] = []
    for v in versions:
        if spans and spans[-1][0] == v:
            spans[-1] = (v, spans[-1][1] + 1)
        else:
            spans.append((v, 1))
    return spans


_NAN = b"\x00\x00\xc0\x7f"  # float32 quiet NaN, little-endian


def _nans(n: int) -> pa.Buffer:
    """``n`` float32 NaNs: the logprobs of a call recorded without them."""
    return pa.py_buffer(_NAN * n)


def _values(a: pa.ListArray) -> pa.Buffer:
    """The data buffer under a list array's values (offsets index into it past ``values.offset``)."""
    return a.values.buffers()[1] or pa.py_buffer(b"")
