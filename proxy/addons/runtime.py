"""What the addons and the control API share: one :class:`Runtime`, built once by ``server.py``.

Settings that only one addon reads are that addon's mitmproxy options (declared in its ``load``);
what is here is shared state — the store's writers, the gate, the upstream, per-rollout memory.
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

from mitmproxy import http

from lgt.store.writer import TableWriter

from .. import policies, resources
from ..auth import Identity
from ..gate import Gate
from ..metrics import Metrics
from ..resend import Resender
from .state import agent_gone, now_us

log = logging.getLogger("lgt.proxy")
STORE_HEADROOM = 1 << 20  # free bytes the store needs before a full one takes calls again


@dataclass
class Runtime:
    """What the addons and the control API share; built once by ``server.py``."""

    secret: bytes
    writer: TableWriter
    gate: Gate
    rewards: TableWriter | None = None
    egress_log: TableWriter | None = None  # the egress table: non-LLM traffic, allowed or blocked
    metrics: Metrics = field(default_factory=Metrics)
    upstream: str | None = None  # base URL, e.g. http://127.0.0.1:8000/v1
    served_model: str | None = None
    # the run's policies: which one each call belongs to, and the model each is served as (policies.py)
    policies: policies.Policies = field(default_factory=lambda: policies.Policies())
    upstream_api_key: str | None = None
    listen: tuple[str, int] | None = None  # where agents reach this proxy (GET /state says it)
    remote: Any = None  # lgt.store.remote.RemoteStore when the store is on S3
    # why the store cannot be written (a full disk, a read-only one): new LLM calls are refused with
    # it until a probe finds the store writable again (store_writable)
    store_error: str | None = None
    store_probed: float = 0.0
    # prompts the trainer delivers per rollout attempt, substituted in its requests (resources.py)
    resources: resources.Registry = field(default_factory=lambda: resources.Registry())
    resender: Resender = field(default_factory=Resender)  # asks the upstream again (see Capture)
    relay: Any = None  # continuation.Relay with --on-update continue: calls continued after an update
    max_body_bytes: int = 32 << 20
    seqs: dict[tuple[str, int], int] = field(default_factory=dict)
    # the latest whole-rollout reward per (rollout, attempt) recorded since start, for GET /rewards
    recent_rewards: dict[tuple[str, int], float] = field(default_factory=dict)
    # who opened each authenticated CONNECT tunnel (client connection -> identity)
    tunnels: weakref.WeakKeyDictionary[Any, Identity] = field(default_factory=weakref.WeakKeyDictionary)
    # each rollout's recent Responses conversations, for previous_response_id (see Conversations)
    conversations: Conversations = field(default_factory=lambda: Conversations())
    # model names agents asked for (the latest 100), listed by GET …/v1/models with the served model
    model_names: dict[str, None] = field(default_factory=dict)
    # LLM calls under way (forwarded, not yet recorded), by call id: (Call, its flow); GET /state
    # names the oldest, and a pause does not wait for those whose agent has gone (orphaned)
    live: dict[str, tuple[Any, http.HTTPFlow]] = field(default_factory=dict)
    # the served model's context (max_model_len on the upstream's model card), read once; None: unknown
    max_model_len: int | None = None
    context_probed: float = -math.inf

    def orphaned(self) -> int:
        """In-flight calls whose agent has closed its connection: nobody waits for their answer."""
        return sum(1 for _, flow in self.live.values() if agent_gone(flow))

    def store_writable(self) -> bool:
        """False while the store cannot be written; re-checked at most once a second (free space and
        a writable filesystem), so the proxy takes calls again by itself when space returns."""
        if self.store_error is None:
            return True
        now = time.monotonic()
        if now - self.store_probed < 1.0:
            return False
        self.store_probed = now
        try:
            st = os.statvfs(self.writer.root)
        except OSError:
            return False
        if st.f_flag & os.ST_RDONLY or st.f_bavail * st.f_frsize < STORE_HEADROOM:
            return False
        log.info("the store is writable again: taking LLM calls")
        self.store_error = None
        return True

    async def engine_context(self) -> int | None:
        """The served model's context length, from the upstream's ``GET …/models`` (vLLM's model cards
        carry ``max_model_len``): read once; after a failure asked again at most every 30 s."""
        if self.max_model_len is not None or self.upstream is None:
            return self.max_model_len
        now = time.monotonic()
        if now - self.context_probed < 30:
            return None
        self.context_probed = now
        headers = {"authorization": f"Bearer {self.upstream_api_key}"} if self.upstream_api_key else {}
        try:
            status, body = await self.resender.call_json("GET", f"{self.upstream}/models", headers=headers)
        except Exception as e:  # the upstream is down or not vLLM: calls go on unchanged
            log.info("could not read the upstream's model cards (%s): output limits are sent as asked", e)
            return None
        cards = body.get("data") if isinstance(body, dict) and status == 200 else None
        cards = [c for c in cards if isinstance(c, dict)] if isinstance(cards, list) else []
        card = next((c for c in cards if c.get("id") == self.served_model), cards[0] if cards else None)
        if card is not None and card.get("max_model_len") is None and card.get("parent"):
            # a LoRA adapter's card (vLLM gives it no length): its base model's
            card = next((c for c in cards if c.get("id") == card["parent"]), card)
        n = card.get("max_model_len") if card else None
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            self.max_model_len = n
        return self.max_model_len

    def saw_model(self, name: Any) -> None:
        if isinstance(name, str) and name and name not in self.model_names:
            self.model_names[name] = None
            while len(self.model_names) > 100:
                self.model_names.pop(next(iter(self.model_names)))

    def add_reward(self, identity: Identity, body: Any, source: str) -> dict[str, Any]:
        """Validate and durably record one reward; ValueError (one sentence) for bad input."""
        if self.rewards is None:
            raise ValueError("this proxy records no rewards")
        row = reward_row(identity, body, source)
        self.rewards.append(row)
        if row["call_id"] is None:
            self.recent_rewards.pop((row["rollout_id"], row["attempt"]), None)  # keep insertion order
            self.recent_rewards[(row["rollout_id"], row["attempt"])] = row["value"]
            while len(self.recent_rewards) > RECENT_REWARDS:
                self.recent_rewards.pop(next(iter(self.recent_rewards)))
        return {"reward_id": row["reward_id"], "rollout_id": row["rollout_id"],
                "attempt": row["attempt"], "value": row["value"]}

    def next_seq(self, identity: Identity) -> int:
        key = (identity.rollout_id, identity.attempt)
        n = self.seqs.get(key, -1) + 1
        self.seqs[key] = n
        return n


class Conversations:
    """The chat messages behind each recent Responses answer, for a later ``previous_response_id``:
    keyed by (rollout, attempt, response id), so one rollout cannot continue another's; bounded by
    count and by size (the oldest are forgotten first; a forgotten id is answered with a clear 400).
    ``size`` is what the caller measured (the request's and the response's bytes): a conversation's
    messages are shared with the request that carried them, so this over-counts, never under."""

    def __init__(self, limit: int = 20_000, max_bytes: int = 256 << 20) -> None:
        self.limit, self.max_bytes = limit, max_bytes
        self.bytes = 0
        self._items: dict[tuple[str, int, str], tuple[list[dict[str, Any]], int]] = {}

    def put(self, identity: Identity, response_id: str, messages: list[dict[str, Any]], size: int) -> None:
        key = (identity.rollout_id, identity.attempt, response_id)
        old = self._items.pop(key, None)
        self.bytes += size - (old[1] if old else 0)
        self._items[key] = (messages, size)
        while len(self._items) > 1 and (len(self._items) > self.limit or self.bytes > self.max_bytes):
            _, freed = self._items.pop(next(iter(self._items)))
            self.bytes -= freed

    def get(self, identity: Identity, response_id: str) -> list[dict[str, Any]] | None:
        item = self._items.get((identity.rollout_id, identity.attempt, response_id))
        return item[0] if item else None

    def __len__(self) -> int:
        return len(self._items)


RECENT_REWARDS = 200_000  # rewards GET /rewards answers from memory (older ones: query the store)


def reward_row(identity: Identity, body: Any, source: str) -> dict[str, Any]:
    """A ``rewards`` row from a JSON body ``{"value": 1.0, "call_id": optional}``."""
    if not isinstance(body, dict):
        raise ValueError("a reward must be a JSON object like {\"value\": 1.0}")
    value = body.get("value")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"reward value must be a finite number, not {value!r}")
    call_id = body.get("call_id")
    if call_id is not None and not isinstance(call_id, str):
        raise ValueError("call_id must be a string")
    return {"reward_id": uuid.uuid4().hex, "rollout_id": identity.rollout_id,
            "attempt": identity.attempt, "call_id": call_id, "value": float(value),
            "source": source, "recorded_at": now_us()}
