"""A store like the proxy's, built in tests: ``calls`` rows of tool-calling rollouts whose token ids are
bytes + 3 (``call_row``, ``tool_rollout``), a small store of three rollouts with rewards (``make_store``),
the ``tokenizers`` tokenizer that decodes those ids (``byte_tokenizer``), and a store's files (``files``).
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from lgt.store.ingest import add_reward, add_rollout
from lgt.store.writer import TableWriter

T0 = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]


# --- a store like the proxy's ---------------------------------------------------------------------

def tokenize(text: str) -> list[int]:
    return [b + 3 for b in text.encode()]


def template(messages: list[dict]) -> str:
    parts = []
    for m in messages:
        calls = "".join(f"<tool_call>{c['function']['arguments']}</tool_call>"
                        for c in m.get("tool_calls") or [])
        parts.append(f"<|im_start|>{m['role']}\n{m.get('content') or ''}{calls}<|im_end|>\n")
    return "".join(parts) + "<|im_start|>assistant\n"


def call_row(rollout: str, seq: int, messages: list[dict], reply: dict, *, attempt: int = 0,
             status: str = "ok", version: int = 0, streamed: bool = False) -> dict:
    """One ``calls`` row: the request, the reply, and token ids that extend the previous turn."""
    generated = (reply.get("content") or "") + "".join(
        f"<tool_call>{c['function']['arguments']}</tool_call>" for c in reply.get("tool_calls") or [])
    ok = status == "ok"
    resp_ids = tokenize(generated) if ok else None
    return {
        "call_id": f"{rollout}.{attempt}.{seq}", "rollout_id": rollout, "attempt": attempt,
        "seq": seq, "started_at": T0 + dt.timedelta(seconds=seq), "ended_at": T0,
        "latency_ms": 12.5 + seq, "ttfb_ms": 3.0 if streamed else None,
        "endpoint": "chat/completions", "original_host": "api.openai.invalid",
        "requested_model": "gpt-4o", "served_model": "policy", "policy_version": version,
        "streamed": streamed, "status": status, "http_status": 200 if ok else 500,
        "error": None if ok else "upstream answered 500",
        "request_json": json.dumps({"model": "gpt-4o", "messages": messages, "tools": TOOLS}),
        "response_json": json.dumps({"choices": [{"index": 0, "message": reply,
                                                  "finish_reason": "stop"}]}) if ok else None,
        "prompt_token_ids": tokenize(template(messages)) if ok else None,
        "response_token_ids": resp_ids,
        "response_logprobs": [-0.25] * len(resp_ids) if ok else None,
        "finish_reason": ("tool_calls" if reply.get("tool_calls") else "stop") if ok else None,
        "usage_prompt_tokens": len(template(messages).encode()),
        "usage_completion_tokens": len(resp_ids or []),
    }


def tool_rollout(rollout: str, question: str, answer: str, **kw) -> list[dict]:
    """Two calls: a tool call, then (with the tool's result) the final answer."""
    msgs = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": question}]
    tc = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "tc1", "type": "function",
         "function": {"name": "calculator", "arguments": json.dumps({"expression": question})}}]}
    first = call_row(rollout, 0, msgs, tc, **kw)
    msgs2 = msgs + [{"role": "assistant", "tool_calls": tc["tool_calls"]},
                    {"role": "tool", "tool_call_id": "tc1", "content": answer}]
    second = call_row(rollout, 1, msgs2, {"role": "assistant", "content": f"It is {answer}."},
                      streamed=True, **kw)
    return [first, second]


def make_store(root: Path) -> Path:
    """r-ok: two calls, a reward and a per-call reward; r-fail: a failed rollout; r-err: an ok call
    and an http_error call, no reward."""
    with TableWriter(root, "calls") as w:
        for row in [*tool_rollout("r-ok", "6*7", "42"), *tool_rollout("r-fail", "1+1", "2"),
                    tool_rollout("r-err", "2*3", "6")[0],
                    call_row("r-err", 1, [{"role": "user", "content": "again"}], {},
                             status="http_error")]:
            w.append(row)
    add_rollout(root, "r-ok", task_id="mult", group_id="g0", step=0)
    add_rollout(root, "r-fail", task_id="add", group_id="g0", step=0, status="failed", exit_code=3)
    add_reward(root, "r-ok", 0.5)
    add_reward(root, "r-ok", 1.0)  # the latest counts
    add_reward(root, "r-ok", "0.25", call_id="r-ok.0.1")
    return root


def byte_tokenizer(path: Path) -> Path:
    """A real `tokenizers` tokenizer for the byte ids above (byte-level BPE without merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {b: chr(b) for b in printable}, 0
    for b in range(256):  # GPT-2's byte → unicode map
        if b not in chars:
            chars[b], n = chr(256 + n), n + 1
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: b + 3 for b, c in chars.items()}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path))
    return path


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
