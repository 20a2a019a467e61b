"""Conversations for the sample builder's tests, made as a ChatML agent makes them: a small BPE tokenizer
(``make_tokenizer``), an ``Agent`` that turns ``Turn``s into the ``calls`` rows the proxy would record,
random sentences, and a store of whole Parquet files holding them (``write_store``, ``store_of``) with
``rollouts`` and ``rewards`` rows (``rollout``, ``reward``).
"""

from __future__ import annotations

import datetime as dt
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from lgt.store.query import connect
from lgt.store.writer import to_arrow, write_parquet_atomic

if TYPE_CHECKING:
    import duckdb
    from tokenizers import Tokenizer

WORDS = ("the a of to and in is it that for on with as was at by an be this have from or one had but "
         "not what all were we when your can said there use each which she do how their if will up "
         "other about out many then them these so some her would make like him into time has look two "
         "more write go see number no way could people my than first water been call who oil its now "
         "find long down day did get come made may part").split()
T0 = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)


# --- a tokenizer, a chat template and an agent ------------------------------------------------------

def make_tokenizer() -> Tokenizer:
    """A small byte-level BPE tokenizer trained on sentences of WORDS, with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14)))
                 + rng.choice([".", "?", "!", ", 42."]) for _ in range(400)]
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(sentences, trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<|im_start|>", "<|im_end|>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return t


def render(messages: list[tuple[str, str]]) -> str:
    """ChatML, with the assistant's turn opened (add_generation_prompt)."""
    return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in messages) \
        + "<|im_start|>assistant\n"


@dataclass
class Turn:
    user: str
    reply: str
    split: bool = False  # the model generated the reply byte by byte (BPE would merge it)
    stop: str = "<|im_end|>"  # the stop token the model generated ("</s>": the template drops it)
    status: str = "ok"
    forget: bool = False  # the agent drops the earlier turns from its context before this call
    rewrite: bool = False  # the agent rewrites the first user message before this call
    version: int = 0
    logprobs: bool = True  # False: the proxy recorded the call's tokens without logprobs


@dataclass
class Agent:
    """Makes the calls a ChatML agent makes: each prompt is the whole rendered context."""

    tok: Tokenizer
    calls: list[dict] = field(default_factory=list)

    def enc(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def generated(self, turn: Turn) -> list[int]:
        ids = ([i for ch in turn.reply for i in self.enc(ch)] if turn.split else self.enc(turn.reply))
        return ids + [self.tok.token_to_id(turn.stop)]

    def run(self, rollout_id: str, turns: list[Turn], attempt: int = 0) -> list[dict]:
        messages = [("system", "You are a careful assistant.")]
        out = []
        for seq, t in enumerate(turns):
            if t.forget:
                messages = messages[:1]
            if t.rewrite and len(messages) > 1:
                messages[1] = ("user", messages[1][1] + " again")
            messages.append(("user", t.user))
            call = {"rollout_id": rollout_id, "attempt": attempt, "seq": seq, "status": t.status,
                    "policy_version": t.version}
            if t.status == "ok":
                gen = self.generated(t)
                call |= {"prompt_token_ids": self.enc(render(messages)), "response_token_ids": gen,
                         "response_logprobs": [-0.125 * ((seq + i) % 7 + 1) for i in range(len(gen))]
                         if t.logprobs else None,
                         "finish_reason": "stop"}
            out.append(call)
            if t.status == "rejected":  # the proxy answered it: the agent sends the same turn again
                messages.pop()
                continue
            messages.append(("assistant", t.reply))
        self.calls += out
        return out


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


# --- stores ---------------------------------------------------------------------------------------

def call_row(c: dict) -> dict:
    n = c["seq"]
    return {"call_id": f"{c['rollout_id']}-{c['attempt']}-{n}", "started_at": T0 + dt.timedelta(seconds=n),
            "endpoint": "chat/completions", "streamed": False, "policy_version": 0, "status": "ok", **c}


def write_store(root: Path, calls: list[dict], rollouts: list[dict] = (), rewards: list[dict] = (),
                files: int = 1) -> Path:
    """A store of whole Parquet files, the calls spread round-robin over ``files`` files."""
    rows = [call_row(c) for c in calls]
    for i in range(files):
        part = rows[i::files]
        if part:
            (root / "calls").mkdir(parents=True, exist_ok=True)
            write_parquet_atomic(to_arrow(part, "calls"), root / "calls" / f"part-{i:03d}.parquet")
    for table, items in (("rollouts", rollouts), ("rewards", rewards)):
        if items:
            (root / table).mkdir(parents=True, exist_ok=True)
            write_parquet_atomic(to_arrow(list(items), table), root / table / "part-000.parquet")
    root.mkdir(parents=True, exist_ok=True)
    return root


def rollout(rid: str, group: str | None = None, status: str = "ok", attempt: int = 0) -> dict:
    return {"rollout_id": rid, "attempt": attempt, "task_id": (group or rid).split("/")[0],
            "group_id": group, "step": 0, "status": status, "recorded_at": T0}


def reward(rid: str, value: float, attempt: int | None = 0) -> dict:
    return {"reward_id": f"w-{rid}-{attempt}", "rollout_id": rid, "attempt": attempt, "value": value,
            "source": "cli", "recorded_at": T0}


def store_of(tmp_path: Path, calls: list[dict], **kw) -> duckdb.DuckDBPyConnection:
    """A store where every attempt of ``calls`` finished ok with reward 1 (unless given otherwise)."""
    keys = sorted({(c["rollout_id"], c["attempt"]) for c in calls})
    rollouts = kw.pop("rollouts", [rollout(r, attempt=a) for r, a in keys])
    rewards = kw.pop("rewards", [reward(r, 1.0, a) for r, a in keys])
    return connect(write_store(tmp_path / "store", calls, rollouts, rewards, **kw))
