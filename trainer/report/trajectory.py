"""One rollout attempt as the live page draws it (:func:`trajectory_json`): per call the messages new
since the previous call, the reply, the sample builder's verdict and each generated token with its
behaviour logprob; values made JSON-safe (:func:`finite`, :func:`jsonable`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from lgt.store import show

TOKENS_MAX = 4000  # generated tokens of one call sent one by one; past it, the rest as text
TEXT_MAX = 20000  # characters of one message or context shown before eliding its middle


def trajectory_json(traj: show.Trajectory, tokenizer: Any, trained: tuple | None, *,
                    as_chat: Callable[[str, Any, Any], tuple[Any, Any]] | None = None) -> dict[str, Any]:
    """``traj`` as the page draws it: per call the messages new since the previous call, the reply,
    the verdict of the sample builder (trained or why not, the sample it is in, where the merge
    broke and why) and each generated token with its behaviour logprob; the rollout's advantage and
    loss weight when a step trained it."""
    r = traj.rollout
    whole = next((w for w in traj.rewards if w["call_id"] is None), None)
    per_call = {w["call_id"]: w for w in traj.rewards if w["call_id"] is not None}
    why_not = show.rollout_excluded(r, whole is not None)
    marks = show.verdicts(traj.calls, why_not)
    advantage = finite(trained[1]) if trained else None
    calls, prev_msgs = [], None
    for c, v in zip(traj.calls, marks):
        req, resp = show._json(c.get("request_json")), show._json(c.get("response_json"))
        if as_chat is not None and c.get("api") not in (None, c["endpoint"]):
            try:
                req, resp = as_chat(c["api"], req, resp)
            except Exception:  # a call the reader cannot translate is shown as the agent sent it
                pass
        msgs = req.get("messages") if isinstance(req, dict) else None
        shown, skipped = [], 0
        if isinstance(msgs, list):
            new, skipped = show._new_messages(msgs, prev_msgs)
            shown = [_message(m) for m in new]
            reply = show._reply_message(resp)
            prev_msgs = msgs + [reply] if reply else msgs
        elif isinstance(req, dict) and "prompt" in req:
            shown = [{"role": "prompt", "text": _elide(str(req["prompt"]))}]
        prompt = c.get("prompt_token_ids") or []
        gen = list(c.get("response_token_ids") or [])
        lps = c.get("response_logprobs")
        lps = list(lps) if lps is not None and len(lps) == len(gen) else None
        is_trained = v.excluded is None
        if v.link and v.link != "first":
            link_text = show.LINKS[v.link].format(new=len(prompt) - v.context_from)
        else:
            link_text = ""
        excluded_text = None
        if v.excluded is not None:
            excluded_text = (v.excluded if v.link is not None
                             else show.CALL_EXCLUDED.get(v.excluded, f"call status {v.excluded}"))
        call = {
            "seq": c["seq"], "call_id": c["call_id"], "policy_version": c["policy_version"],
            "policy": c.get("policy"),
            "status": c["status"], "http_status": c.get("http_status"), "error": c.get("error"),
            "latency_ms": finite(c.get("latency_ms")), "ttfb_ms": finite(c.get("ttfb_ms")),
            "streamed": c.get("streamed"), "api": c.get("api") or c["endpoint"], "endpoint": c["endpoint"],
            "model": c.get("requested_model"), "served_model": c.get("served_model"),
            "capture": c.get("capture"), "capture_reason": c.get("capture_reason"),
            "translation": list(c.get("translation") or ()), "finish_reason": c.get("finish_reason"),
            "link": v.link, "link_text": link_text, "sample": v.label, "trained": is_trained,
            "excluded": excluded_text, "messages": shown, "skipped": skipped, "reply": _reply(resp),
            "prompt_tokens": len(prompt), "context_from": v.context_from,
            "context_text": _elide(_decode(tokenizer, prompt[v.context_from:])) if tokenizer else None,
            "generated": len(gen), "logprobs_recorded": lps is not None,
            "tokens": _tokens(tokenizer, gen, lps),
            "reward": _reward(per_call.get(c["call_id"])),
        }
        calls.append(call)
    return {
        "rollout": jsonable(dict(r)), "attempts": traj.attempts, "reward": _reward(whole),
        "excluded": why_not, "samples": len({v.label for v in marks if v.label is not None}),
        "trained": ({"step": trained[0], "advantage": advantage, "loss_weight": finite(trained[2])}
                    if trained else None),
        "decoded": tokenizer is not None, "calls": calls,
        "egress": [_egress(e) for e in traj.egress],
    }


def _tokens(tokenizer: Any, ids: list[int], lps: list[float] | None) -> list[list[Any]]:
    """[text, logprob] per generated token (the id as text without a tokenizer); past
    :data:`TOKENS_MAX`, the rest as one piece without a logprob."""
    out: list[list[Any]] = []
    head = ids[:TOKENS_MAX]
    texts = [_decode(tokenizer, [t]) for t in head] if tokenizer else [f"‹{t}›" for t in head]
    for i, text in enumerate(texts):
        out.append([text, finite(lps[i]) if lps is not None else None])
    if len(ids) > TOKENS_MAX:
        rest = _decode(tokenizer, ids[TOKENS_MAX:]) if tokenizer else f"… {len(ids) - TOKENS_MAX} more"
        out.append([rest, None])
    return out


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return show._decode(tokenizer, ids) if ids else ""


def _message(m: Any) -> dict[str, Any]:
    if not isinstance(m, dict):
        return {"role": "?", "text": _elide(str(m))}
    out: dict[str, Any] = {"role": str(m.get("role", "?")), "text": _elide(show._content(m.get("content")))}
    if m.get("tool_call_id"):
        out["tool_call_id"] = str(m["tool_call_id"])
    if m.get("tool_calls"):
        out["tool_calls"] = [show._tool_call(tc) for tc in m["tool_calls"]]
    return out


def _reply(resp: Any) -> dict[str, Any] | None:
    if not isinstance(resp, dict) or not resp.get("choices"):
        return None
    choice = resp["choices"][0]
    if "message" in choice:
        m = choice["message"] or {}
        return {"text": _elide(show._content(m.get("content"))),
                "reasoning": _elide(str(m.get("reasoning_content") or m.get("reasoning") or "")) or None,
                "tool_calls": [show._tool_call(tc) for tc in m.get("tool_calls") or []]}
    return {"text": _elide(str(choice.get("text", ""))), "reasoning": None, "tool_calls": []}


def _egress(e: dict[str, Any]) -> dict[str, Any]:
    return {"where": show.egress_target(e), "allowed": bool(e["allowed"]), "policy": e["policy"],
            "status": e.get("status"), "bytes": e.get("response_bytes"), "error": e.get("error"),
            "kind": e["kind"]}


def _reward(w: dict[str, Any] | None) -> dict[str, Any] | None:
    if not w:
        return None
    return {"value": finite(w["value"]), "source": w["source"],
            "recorded_at": w["recorded_at"].isoformat() if w.get("recorded_at") else None}


def _elide(text: str, limit: int = TEXT_MAX) -> str:
    return show._elide(text, limit)


def finite(v: Any) -> Any:
    """JSON has no NaN or infinity: those become null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def jsonable(row: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in row.items():
        if hasattr(v, "isoformat"):
            v = v.isoformat()
        out[k] = finite(v)
    return out

