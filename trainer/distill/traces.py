"""A teacher's recorded traces as training samples for the student (``lgt-train sft``): which rollouts
(:func:`choose_rollouts`: failed and held-out ones never, then the reward filter), each ok call read as the
chat conversation it stands for (``lgt.proxy.dialects.as_chat``), re-tokenised with the student's chat
template and checked against it (:func:`render_call`), the calls of a rollout merged the way policy
samples are (:func:`build_samples`; what could not be represented counted by reason, never dropped
silently), and the samples in the table the backends train on (:func:`samples_table`)."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class SftConfig:
    """The ``sft:`` section of a run config (``lgt-train sft``)."""

    traces: Path | None = None  # the store holding the teacher's recorded calls
    min_reward: float | None = None  # keep rollouts whose reward is at least this
    best_k: int | None = None  # keep the best k rollouts of each task (ties: the earlier rollout id)
    unrewarded: bool = False  # also train on rollouts without a reward (else: refused)
    epochs: int = 1
    batch_rollouts: int = 8  # rollouts per optimizer step
    lr: float | None = None  # else the backend's
    max_seq_len: int = 4096  # a longer conversation is a bad trace ("too_long")


class SftError(ValueError):
    """Bad input to ``lgt-train sft``: one sentence saying what was wrong."""


# Why a call could not be trained on (bad_traces), and why a call starts a new sample (merge_breaks).
UNREADABLE = "unreadable"  # the request or response is not a chat conversation as_chat can read
NOT_PREFIX = "prompt_not_prefix"  # the rendered prompt is not a prefix of the rendered conversation
NOT_DETERMINISTIC = "render_differs"  # rendering the same messages twice gave different ids
TOOLS_DROPPED = "tool_calls_dropped"  # the reply's tool calls do not appear in the rendered reply
REASONING_DROPPED = "reasoning_dropped"  # the reply's reasoning does not appear in the rendered reply
CONTENT_PARTS = "content_parts"  # a message holds content parts other than text
TOO_LONG = "too_long"  # the conversation is longer than sft.max_seq_len tokens
TEMPLATE_ERROR = "template_error"  # the template raised on the conversation
NEW_ATTEMPT = "excluded_call"  # the call before it was a bad trace or not ok
TEXT_CHANGE = "text_change"  # its prompt does not extend the held conversation: history rewritten


@dataclass
class Built:
    """Samples (one dict per merged sample) and the counts of what could not be merged or trained."""

    samples: list[dict[str, Any]] = field(default_factory=list)
    bad_traces: Counter = field(default_factory=Counter)
    merge_breaks: Counter = field(default_factory=Counter)
    calls: int = 0


def _text_parts(messages: list[dict]) -> bool:
    """Every message's content is a string, null, or a list of text parts (flattened in place)."""
    for m in messages:
        c = m.get("content")
        if isinstance(c, list):
            if any(not isinstance(p, dict) or p.get("type") not in ("text", "input_text", "output_text")
                   for p in c):
                return False
            m["content"] = "".join(p.get("text") or "" for p in c)
    return True


def _render(tokenizer: Any, messages: list[dict], tools: Any, gen: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=gen,
                                        tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def conversation(api: str | None, request_json: str, response_json: str) -> tuple[list[dict], Any, dict]:
    """A recorded call as (prompt messages, tools, the teacher's reply as an assistant message)."""
    from lgt.proxy.dialects import as_chat

    req, resp = json.loads(request_json), json.loads(response_json)
    if api:
        req, resp = as_chat(api, req, resp)
    if not isinstance(req, dict) or not isinstance(resp, dict) or not resp.get("choices"):
        raise ValueError(UNREADABLE)
    msg = dict(resp["choices"][0].get("message") or {})
    reply = {"role": "assistant", "content": msg.get("content")}
    for k in ("tool_calls", "reasoning_content"):
        if msg.get(k):
            reply[k] = msg[k]
    messages = [dict(m) for m in req.get("messages") or []]
    if not messages:
        raise ValueError(UNREADABLE)
    return messages, req.get("tools"), reply


def render_call(tokenizer: Any, messages: list[dict], tools: Any, reply: dict, max_seq_len: int
                ) -> tuple[list[int], list[int]] | str:
    """(prompt ids, conversation ids) of one call under the student's template, or why it cannot be
    trained on: the checks of docs/distill.md ("The checks against the template")."""
    if not _text_parts(messages) or not _text_parts([reply]):
        return CONTENT_PARTS
    try:
        prompt = _render(tokenizer, messages, tools, True)
        full = _render(tokenizer, messages + [reply], tools, False)
        again = _render(tokenizer, messages + [reply], tools, False)
    except Exception:  # noqa: BLE001 - any template error is a reason, counted
        return TEMPLATE_ERROR
    if full != again:
        return NOT_DETERMINISTIC
    if full[:len(prompt)] != prompt or len(full) == len(prompt):
        return NOT_PREFIX
    if len(full) > max_seq_len:
        return TOO_LONG
    text = tokenizer.decode(full[len(prompt):])
    for c in reply.get("tool_calls") or []:
        fn = c.get("function") or {}
        if fn.get("name", "") not in text or _args_text(fn.get("arguments")) not in _squash(text):
            return TOOLS_DROPPED
    if reply.get("reasoning_content") and _squash(reply["reasoning_content"]) not in _squash(text):
        return REASONING_DROPPED
    return prompt, full


def _squash(s: str) -> str:
    return "".join(s.split())


def _args_text(args: Any) -> str:
    """A tool call's arguments as a template may render them (JSON, whitespace ignored)."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return _squash(args)
    if isinstance(args, dict):  # templates render the values; check those
        return _squash("".join(str(v) for v in args.values())) if args else ""
    return _squash(json.dumps(args))


def build_samples(tokenizer: Any, calls: list[dict], rollouts: dict[str, dict], max_seq_len: int) -> Built:
    """Merged SFT samples of the calls (rows with rollout_id, attempt, seq, status, api, request_json,
    response_json) of the rollouts kept (rollout_id → task_id, group_id, reward)."""
    out = Built()
    calls = sorted((c for c in calls if c["rollout_id"] in rollouts),
                   key=lambda c: (c["rollout_id"], c["attempt"], c["seq"]))
    held: dict[str, Any] | None = None
    prev_key: tuple | None = None

    def flush() -> None:
        nonlocal held
        if held is not None and any(held["loss_mask"]):
            out.samples.append(held)
        held = None

    for c in calls:
        key = (c["rollout_id"], c["attempt"])
        if key != prev_key:
            flush()
            prev_key = key
        if c["status"] != "ok" or not c.get("response_json"):
            if held is not None:
                out.merge_breaks[NEW_ATTEMPT] += 1
            flush()
            continue
        out.calls += 1
        try:
            rendered = render_call(tokenizer, *conversation(c.get("api"), c["request_json"],
                                                            c["response_json"]), max_seq_len)
        except (ValueError, KeyError, TypeError, AttributeError):
            rendered = UNREADABLE
        if isinstance(rendered, str):
            out.bad_traces[rendered] += 1
            if held is not None:
                out.merge_breaks[NEW_ATTEMPT] += 1
            flush()
            continue
        prompt, full = rendered
        if held is not None and prompt[:len(held["input_ids"])] == held["input_ids"]:
            n = len(held["input_ids"])
            held["loss_mask"] += [0] * (len(prompt) - n) + [1] * (len(full) - len(prompt))
            held["input_ids"] = full
            held["n_calls"] += 1
            continue
        if held is not None:
            out.merge_breaks[TEXT_CHANGE] += 1
        flush()
        r = rollouts[c["rollout_id"]]
        held = {"sample_id": f"{c['rollout_id']}.{c['attempt']}.{c['seq']}", "rollout_id": c["rollout_id"],
                "attempt": c["attempt"], "group_id": r.get("group_id"), "task_id": r.get("task_id"),
                "reward": r.get("reward"), "input_ids": full,
                "loss_mask": [0] * len(prompt) + [1] * (len(full) - len(prompt)), "n_calls": 1}
    flush()
    return out


def choose_rollouts(rows: list[dict], cfg: SftConfig) -> dict[str, dict]:
    """The rollouts to learn from (rollout_id → row): ok, not held out (split 'eval'), rewarded unless
    ``unrewarded``, then the reward filter (``min_reward``, ``best_k`` per task)."""
    ok = [r for r in rows if r.get("status") in (None, "ok") and r.get("split") != "eval"]
    unrewarded = [r for r in ok if r.get("reward") is None]
    if unrewarded and not cfg.unrewarded:
        raise SftError(f"{len(unrewarded)} of the {len(ok)} usable rollouts have no reward: score them "
                       "(lgt-train score) or set sft.unrewarded: true to train on them too")
    kept = [r for r in ok if r.get("reward") is not None or cfg.unrewarded]
    if cfg.min_reward is not None:
        kept = [r for r in kept if r.get("reward") is not None and r["reward"] >= cfg.min_reward]
    if cfg.best_k is not None:
        by_task: dict[Any, list[dict]] = {}
        for r in kept:
            by_task.setdefault(r.get("task_id"), []).append(r)
        kept = [r for rs in by_task.values()
                for r in sorted(rs, key=lambda r: (-(r["reward"] if r.get("reward") is not None
                                                     else float("-inf")), r["rollout_id"]))[:cfg.best_k]]
    return {r["rollout_id"]: r for r in kept}


def read_traces(store: Path) -> tuple[list[dict], list[dict]]:
    """(calls, rollouts) of a store: each rollout's latest attempt (the store's ``rollouts`` view) with
    its rollout-level reward (the ``rewards`` view: the latest recorded), and that attempt's calls."""
    from lgt.store.query import connect

    if not Path(store).is_dir():
        raise SftError(f"sft.traces {store} is not a store directory")
    con = connect(store)
    try:
        cols = {r[0] for r in con.execute("DESCRIBE calls").fetchall()}
        api = "c.api" if "api" in cols else "NULL AS api"
        con.execute(_LATEST_SQL)
        fields = ["rollout_id", "attempt", "seq", "status", "api", "request_json", "response_json"]
        calls = [dict(zip(fields, r)) for r in con.execute(
            f"SELECT c.rollout_id, c.attempt, c.seq, c.status, {api}, c.request_json, c.response_json "
            "FROM calls c SEMI JOIN _lgt_latest USING (rollout_id, attempt)").fetchall()]
        if not calls:
            raise SftError(f"the store {store} holds no recorded calls")
        rollouts = [dict(zip(["rollout_id", "task_id", "group_id", "status", "split", "reward"], r))
                    for r in con.execute("SELECT rollout_id, task_id, group_id, status, split, reward "
                                         "FROM _lgt_latest").fetchall()]
    finally:
        con.close()
    return calls, rollouts


_LATEST_SQL = """
CREATE OR REPLACE TEMP VIEW _lgt_latest AS
SELECT r.rollout_id, r.attempt, r.task_id, r.group_id, r.status, r.split, w.value AS reward
FROM rollouts r
LEFT JOIN rewards w ON w.rollout_id = r.rollout_id AND w.attempt = r.attempt AND w.call_id IS NULL
QUALIFY r.attempt = max(r.attempt) OVER (PARTITION BY r.rollout_id)
"""


def samples_table(samples: list[dict[str, Any]]) -> Any:
    """A batch of samples in the shape the backends take: advantage 1; behaviour logprobs NaN (a hosted
    model gives none: the backend recomputes them, so with one update per batch the ratio is 1 and the
    policy loss's gradient is the NLL's); ``loss_weight = 1 / (R · trained tokens of its rollout)`` for
    the batch's R rollouts, as policy samples have, so under ``agg: rollout`` each rollout counts once
    (under ``token-mean`` every trained token counts alike and the weight is not read)."""
    import pyarrow as pa

    tokens: Counter = Counter()
    for s in samples:
        tokens[s["rollout_id"]] += sum(s["loss_mask"])
    n = max(len(tokens), 1)
    cols = ["sample_id", "rollout_id", "attempt", "group_id", "task_id", "reward", "input_ids", "loss_mask"]
    rows = [{k: s[k] for k in cols} | {"behaviour_logprobs": [math.nan] * len(s["input_ids"]),
                                       "advantage": 1.0,
                                       "loss_weight": 1.0 / (n * max(tokens[s["rollout_id"]], 1))}
            for s in samples]
    schema = pa.schema([("sample_id", pa.string()), ("rollout_id", pa.string()), ("attempt", pa.int32()),
                        ("group_id", pa.string()), ("task_id", pa.string()), ("reward", pa.float64()),
                        ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
                        ("behaviour_logprobs", pa.list_(pa.float32())), ("advantage", pa.float64()),
                        ("loss_weight", pa.float64())])
    return pa.Table.from_pylist(rows, schema=schema)


def batches(samples: list[dict[str, Any]], batch_rollouts: int, epochs: int, seed: int) -> list[list[dict]]:
    """Steps of ``batch_rollouts`` rollouts each (all of a rollout's samples together), shuffled per epoch
    with the run's seed."""
    by_rollout: dict[str, list[dict]] = {}
    for s in samples:
        by_rollout.setdefault(s["rollout_id"], []).append(s)
    ids, rng, out = sorted(by_rollout), random.Random(seed), []
    for _ in range(epochs):
        rng.shuffle(ids)
        for i in range(0, len(ids), batch_rollouts):
            out.append([s for r in ids[i:i + batch_rollouts] for s in by_rollout[r]])
    return out
