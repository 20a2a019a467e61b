"""``lgt-train show``: one trajectory as readable turns.

:func:`load_trajectory` reads a rollout attempt, its calls and rewards from the store's views;
:func:`render` turns that into lines of text (styled with ``click.style``; ``click.echo`` drops the
styles where the output is not a terminal). Per call: seq, policy version, status, latency, token
counts, the messages the agent added since the previous call, the reply, and what the trainer learns
from, decided as the sample builder's exact mode decides it (``sql/samples.sql``: which calls and
rollouts are left out, where a rollout's calls split into samples): generated tokens have loss mask
1, prompts are context. With a tokenizer the tokens themselves are decoded under ``masked │`` /
``trained │`` gutters (dim / bold), each prompt from the first token new to its sample.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import duckdb

from .schema import DEFAULT_POLICY

TRUNCATE = 1200  # characters of one message or token span shown before eliding its middle


@dataclass(frozen=True)
class Trajectory:
    rollout: dict[str, Any]  # the rollouts view's row
    calls: list[dict[str, Any]]  # ordered by seq
    rewards: list[dict[str, Any]]  # the rewards view's rows of this attempt (call_id None: rollout)
    attempts: list[int]  # every attempt of the rollout
    egress: list[dict[str, Any]] = ()  # the egress view's rows of this attempt, in time order


def load_trajectory(con: duckdb.DuckDBPyConnection, rollout_id: str,
                    attempt: int | None = None) -> Trajectory:
    """A rollout attempt (its latest unless ``attempt``); ValueError naming what is missing."""
    attempts = [a for (a,) in con.execute(
        "SELECT DISTINCT attempt FROM rollouts WHERE rollout_id = ? ORDER BY 1", [rollout_id]).fetchall()]
    if not attempts:
        raise ValueError(f"rollout {rollout_id!r} is not in the store")
    if attempt is None:
        attempt = attempts[-1]
    elif attempt not in attempts:
        raise ValueError(f"rollout {rollout_id!r} has no attempt {attempt} (it has "
                         f"{', '.join(map(str, attempts))})")
    params = [rollout_id, attempt]
    (rollout,) = _dicts(con, "SELECT * FROM rollouts WHERE rollout_id = ? AND attempt = ?", params)
    calls = _dicts(con, "SELECT * FROM calls WHERE rollout_id = ? AND attempt = ? ORDER BY seq", params)
    rewards = _dicts(con, "SELECT * FROM rewards WHERE rollout_id = ? AND attempt = ? "
                          "ORDER BY call_id NULLS FIRST", params)
    egress = _dicts(con, "SELECT * FROM egress WHERE rollout_id = ? AND attempt = ? ORDER BY started_at",
                    params)
    return Trajectory(rollout, calls, rewards, attempts, egress)


def _dicts(con: duckdb.DuckDBPyConnection, sql: str, params: list) -> list[dict[str, Any]]:
    cur = con.execute(sql, params)
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, row)) for row in cur.fetchall()]


def load_tokenizer(path: str | Path) -> Any:
    """A ``tokenizers.Tokenizer`` from a tokenizer.json or a model directory holding one."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ValueError(f"no tokenizer at {path}: give a tokenizer.json or a model directory "
                         "holding one")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("decoding tokens needs the tokenizers package (pip install "
                         "'lgt[inspect]')") from None
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # the library raises plain Exception for a malformed file
        raise ValueError(f"{p} is not a tokenizer the tokenizers library can read "
                         f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


# --- rendering (pure) ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Verdict:
    """What the sample builder (exact mode, ``sql/samples.sql``) makes of one call."""

    excluded: str | None  # why the call's tokens are not trained on (None: they are)
    link: str | None  # first | extends | excluded_call | truncation | differs (None: call excluded)
    context_from: int  # the first prompt token new to the sample
    sample: int | None  # which of the attempt's samples of the call's policy it is in
    policy: str = DEFAULT_POLICY  # the call's policy (calls.policy)

    @property
    def label(self) -> str | None:
        """The sample as its id ends (``0``; ``planner.0`` for a policy other than the default)."""
        if self.sample is None:
            return None
        return str(self.sample) if self.policy == DEFAULT_POLICY else f"{self.policy}.{self.sample}"


def call_excluded(call: dict[str, Any]) -> str | None:
    """Why the builder leaves a call out (``sample_calls.excluded``), or None."""
    if call["status"] != "ok":
        return call["status"]
    if call.get("prompt_token_ids") is None or call.get("response_token_ids") is None:
        return "no_token_ids"
    return None  # a call without logprobs is trained: the trainer recomputes them


def logprobs_recorded(call: dict[str, Any]) -> bool:
    lp = call.get("response_logprobs")
    return lp is not None and len(lp) == len(call.get("response_token_ids") or ())


def rollout_excluded(rollout: dict[str, Any], rewarded: bool) -> str | None:
    """Why no call of the attempt is trained (``sample_candidates``), or None."""
    if rollout["status"] != "ok":
        return f"the rollout's status is {rollout['status']}"
    if rollout.get("split") == "eval":
        return "a held-out evaluation rollout (recorded, never trained)"
    if not rewarded:
        return "the rollout has no reward yet"
    return None


def verdicts(calls: list[dict[str, Any]], rollout_reason: str | None) -> list[Verdict]:
    """Per call, in seq order, as ``sample_links`` decides: a call joins the sample of its policy's call
    before it when that call was trained and this prompt starts with its prompt + generated tokens
    (``sample`` counts within the call's policy: each policy's calls make its own samples)."""
    out: list[Verdict] = []
    prevs: dict[str, dict[str, Any]] = {}
    samples: dict[str, int] = {}
    for c in calls:
        policy = c.get("policy") or DEFAULT_POLICY
        prev, sample = prevs.get(policy), samples.get(policy, -1)
        own = call_excluded(c)
        if c["status"] == "rejected":  # answered by the proxy: passed over, the next call links past it
            out.append(Verdict(own, None, 0, None, policy))
            continue
        if own is not None:
            out.append(Verdict(own, None, 0, None, policy))
        else:
            held: list[int] = []
            if sample < 0:
                link = "first"
            elif prev is None or call_excluded(prev) is not None:
                link = "excluded_call"
            elif len(c["prompt_token_ids"]) < len(held := prev["prompt_token_ids"]
                                                  + prev["response_token_ids"]):
                link = "truncation"
            elif c["prompt_token_ids"][:len(held)] == held:
                link = "extends"
            else:
                link = "differs"
            sample += link != "extends"
            samples[policy] = sample
            out.append(Verdict(rollout_reason, link, len(held) if link == "extends" else 0, sample, policy))
        prevs[policy] = c
    return out


LINKS = {
    "first": "",
    "extends": "+{new} new, extends the previous call",
    "excluded_call": "a new sample: the call before is not trained",
    "truncation": "a new sample: shorter than the previous prompt + reply (context trimmed)",
    "differs": "a new sample: does not extend the previous call token by token",
}
CALL_EXCLUDED = {"no_token_ids": "no token ids recorded (observe-only upstream?)",
                 "rejected": "the proxy answered it itself; it never reached the policy"}


def render(traj: Trajectory, tokenizer: Any | None = None, *, truncate: int | None = TRUNCATE,
           as_chat: Callable[[str, Any, Any], tuple[Any, Any]] | None = None) -> list[str]:
    """The trajectory as lines of (styled) text. ``as_chat(api, request, response)``, when given (the
    proxy's dialects: ``lgt.proxy.dialects.as_chat``), shows a translated call as the chat call it
    became; without it the agent's own request is shown."""
    r = traj.rollout
    per_call = {w["call_id"]: w for w in traj.rewards if w["call_id"] is not None}
    whole = next((w for w in traj.rewards if w["call_id"] is None), None)
    head = [f"rollout {r['rollout_id']}", f"attempt {r['attempt']}"
            + (f" of {len(traj.attempts)}" if len(traj.attempts) > 1 else "")]
    for key, label in (("task_id", "task"), ("group_id", "group"), ("step", "step")):
        if r.get(key) is not None:
            head.append(f"{label} {r[key]}")
    head.append(f"status {r['status']}" + (f" (exit {r['exit_code']})" if r.get("exit_code") is not None
                                           else ""))
    lines = [click.style(" · ".join(head), bold=True)]
    lines.append("reward " + (_reward(whole) if whole else click.style("none recorded yet", fg="yellow")))

    why_not = rollout_excluded(r, whole is not None)
    marks = verdicts(traj.calls, why_not)
    n_gen = sum(len(c.get("response_token_ids") or []) for c in traj.calls)
    n_trained = sum(len(c["response_token_ids"]) for c, v in zip(traj.calls, marks) if v.excluded is None)
    n_samples = len({v.label for v in marks if v.label is not None})
    summary = (f"{plural(len(traj.calls), 'call')} · {n_gen} generated tokens, {n_trained} trained · "
               f"{'' if why_not is None else 'would be '}{plural(n_samples, 'sample')}")
    lines.append(summary + (click.style(f" · nothing trained: {why_not}", fg="yellow") if why_not else ""))
    if tokenizer is not None:
        lines.append(click.style("masked │", dim=True) + " context (loss mask 0)   "
                     + click.style("trained │", bold=True) + " generated tokens (loss mask 1)")

    prev_msgs: list[Any] | None = None
    for c, v in zip(traj.calls, marks):
        lines.append("")
        lines += _call_header(c)
        for note in c.get("translation") or ():
            lines.append(click.style(f"  approximated: {note}", fg="yellow"))
        req, resp = _json(c.get("request_json")), _json(c.get("response_json"))
        if as_chat is not None and c.get("api") not in (None, c["endpoint"]):  # as the chat call it became
            req, resp = as_chat(c["api"], req, resp)
        msgs = req.get("messages") if isinstance(req, dict) else None
        prompt = c.get("prompt_token_ids") or []
        gen = c.get("response_token_ids") or []
        tok = [f"prompt {len(prompt)} tokens"]
        if v.link and v.link != "first":
            tok.append(LINKS[v.link].format(new=len(prompt) - v.context_from))
        trained = v.excluded is None
        if trained:
            tok.append(f"generated {len(gen)} · trained (sample {v.label})")
            if not logprobs_recorded(c):
                tok.append(click.style("logprobs recomputed by the trainer", fg="yellow"))
        elif v.link is not None:  # a good call of a rollout that is not trained
            tok.append(f"generated {len(gen)} · not trained")
        else:
            tok.append(f"generated {len(gen)} · not trained: "
                       + CALL_EXCLUDED.get(v.excluded, f"call status {v.excluded}"))
        if c.get("finish_reason"):
            tok.append(f"finish {c['finish_reason']}")
        lines.append("  " + " · ".join(tok))

        if isinstance(msgs, list):
            new, skipped = _new_messages(msgs, prev_msgs)
            if skipped:
                lines.append(click.style(f"  ({skipped} earlier message(s) unchanged)", dim=True))
            for m in new:
                lines += _message(m, truncate)
            reply = _reply_message(resp)
            prev_msgs = msgs + [reply] if reply else msgs
        elif isinstance(req, dict) and "prompt" in req:
            lines += _block("prompt", str(req["prompt"]), truncate)
        if c["status"] != "ok":
            detail = c.get("error") or (f"HTTP {c['http_status']}" if c.get("http_status") else "")
            lines.append(click.style(f"  error: {detail}", fg="red"))
        else:
            lines += _reply(resp, truncate)
        n_extra = len(c.get("extra_choices") or [])
        if n_extra:
            lines.append(click.style(f"  (+{n_extra} more choice(s) recorded)", dim=True))

        if tokenizer is not None and (prompt or gen):
            if prompt[v.context_from:]:
                lines += _gutter("masked", _decode(tokenizer, prompt[v.context_from:]), truncate,
                                 dim=True)
            if gen:
                lines += _gutter("trained" if trained else "masked", _decode(tokenizer, gen),
                                 truncate, bold=trained, dim=not trained)
        if c["call_id"] in per_call:
            lines.append("  reward for this call " + _reward(per_call[c["call_id"]]))
    if traj.egress:
        lines.append("")
        lines += egress_lines(traj.egress)
    return lines


def egress_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The attempt's non-LLM traffic: a header, then one line per request or connection."""
    blocked = sum(not r["allowed"] and r["kind"] != "tls_failed" for r in rows)
    head = f"── egress · {plural(len(rows), 'request')} besides LLM calls"
    lines = [click.style(head, dim=True)
             + (click.style(f" · {blocked} blocked", fg="red") if blocked else "")]
    for r in rows:
        where = egress_target(r)
        if r["kind"] == "tls_failed":  # never got as far as the policy: the agent refused the TLS
            outcome = ""
        elif r["allowed"]:
            outcome = (f"{r['status']}" if r.get("status") is not None else "") + (
                f" · {r['response_bytes']} B" if r.get("response_bytes") is not None else "")
        else:
            outcome = click.style(f"blocked ({r['policy']})", fg="red")
        if r.get("error"):
            outcome += click.style(f" · {r['error']}", fg="yellow")
        lines.append(f"  {where} · {outcome.lstrip(' ·')}")
    return lines


def egress_target(r: dict[str, Any]) -> str:
    """What an egress row reached: ``GET https://host/path`` for a request, ``tcp host:port`` else."""
    if r["kind"] == "http":
        return f"{r['method']} {r['scheme']}://{r['host']}{r['path'] or ''}"
    return f"{r['kind']} {r['host']}:{r['port']}"


def render_build(report: dict[str, Any]) -> list[str]:
    """What ``build_samples`` made of the store, from its ``report`` (of one build, or the chunks'
    reports merged)."""
    rep = dict(report)
    hist = sorted((int(k), n) for k, n in rep.pop("samples_per_rollout", {}).items())
    mode = rep.pop("mode", None)
    lines = [click.style(f"{plural(sum(k * n for k, n in hist), 'sample')} from "
                         f"{plural(sum(n for _, n in hist), 'rollout attempt')}"
                         + (f" ({mode} mode)" if mode else ""), bold=True)]
    lines.append("samples per rollout: " + (", ".join(
        f"{plural(k, 'sample')}: {plural(n, 'rollout')}" for k, n in hist) or "none"))
    reasons = rep.pop("merge_breaks", {})
    lines.append("merge breaks: " + (", ".join(
        f"{r} {n}" for r, n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))) or "none"))
    for key in ("rollouts", "calls"):
        part = rep.pop(key, None)
        if isinstance(part, dict):
            used = part.get("trained", part.get("used"))
            excluded = sorted((part.get("excluded") or {}).items(), key=lambda kv: (-kv[1], kv[0]))
            lines.append(f"{key}: {used} {'trained' if 'trained' in part else 'used'}; excluded: "
                         + (", ".join(f"{r} {n}" for r, n in excluded) or "none"))
    groups = rep.pop("groups", None)
    if isinstance(groups, dict):
        lines.append(f"groups: {groups.get('trained')} trained, {groups.get('zero_variance')} with zero "
                     f"variance (advantage 0), {groups.get('single_rollout')} of a single rollout")
    for key, value in rep.items():  # anything newer, as it comes
        lines += _report_item(key.replace("_", " "), value, 0)
    return lines


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _report_item(key: str, value: Any, depth: int) -> list[str]:
    pad = "  " * depth
    if isinstance(value, dict):
        if all(not isinstance(v, (dict, list)) for v in value.values()):
            return [f"{pad}{key}: " + (", ".join(f"{k} {_num(v)}" for k, v in value.items()) or "none")]
        return [f"{pad}{key}:"] + [l for k, v in value.items() for l in _report_item(str(k), v, depth + 1)]
    return [f"{pad}{key}: {_num(value)}"]


def _num(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _call_header(c: dict[str, Any]) -> list[str]:
    status = c["status"]
    policy = c.get("policy") or DEFAULT_POLICY
    parts = [f"call {c['seq']}",
             f"policy {'' if policy == DEFAULT_POLICY else policy + ' '}v{c['policy_version']}",
             click.style(status, fg="green" if status == "ok" else "red")]
    if c.get("latency_ms") is not None:
        parts.append(f"{c['latency_ms']:.0f} ms" + (f" (first byte {c['ttfb_ms']:.0f} ms)"
                                                     if c.get("ttfb_ms") is not None and c["streamed"]
                                                     else ""))
    parts.append("streamed" if c["streamed"] else "not streamed")
    model = c.get("requested_model") or "?"
    if c.get("served_model") and c["served_model"] != model:
        model += f" → {c['served_model']}"
    api = c.get("api") or c["endpoint"]
    parts += [api if api == c["endpoint"] else f"{api} → {c['endpoint']}", model]
    if c.get("capture") not in (None, "full"):
        why = f" ({c['capture_reason']})" if c.get("capture_reason") else ""
        parts.append(click.style(f"capture {c['capture']}{why}", fg="yellow"))
    parts.append(click.style(c["call_id"], dim=True))
    return [click.style("── ", dim=True) + " · ".join(parts)]


def _new_messages(msgs: list[Any], prev: list[Any] | None) -> tuple[list[Any], int]:
    """The messages added since the previous call (all of them when the history was rewritten)."""
    if prev is None:
        return msgs, 0
    n = 0
    for a, b in zip(msgs, prev):
        if not _same_message(a, b):
            break
        n += 1
    if n < len(prev) and n < len(msgs):  # the agent edited its history: show every message
        return msgs, 0
    return msgs[n:], n


def _same_message(a: Any, b: Any) -> bool:
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return a == b
    keep = ("role", "content", "tool_calls", "tool_call_id", "name")
    norm = [{k: _plain(x.get(k)) for k in keep if x.get(k) not in (None, "", [])} for x in (a, b)]
    return norm[0] == norm[1]


def _plain(v: Any) -> Any:
    # the SDK echoes an assistant turn with its own field order and extras; compare what matters
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        if "function" in v:
            return {"id": v.get("id"), "name": v["function"].get("name"),
                    "arguments": v["function"].get("arguments")}
        return {k: _plain(x) for k, x in v.items() if x is not None}
    return v


def _reply_message(resp: Any) -> dict[str, Any] | None:
    try:
        return resp["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        return None


def _message(m: Any, truncate: int | None) -> list[str]:
    if not isinstance(m, dict):
        return _block("?", str(m), truncate)
    role = str(m.get("role", "?"))
    if role == "tool" and m.get("tool_call_id"):
        role = f"tool [{m['tool_call_id']}]"
    out = []
    text = _content(m.get("content"))
    if text or not m.get("tool_calls"):
        out += _block(role, text, truncate)
    for tc in m.get("tool_calls") or []:
        out.append(f"  {click.style(role, bold=True)} → {_tool_call(tc)}")
    return out


def _reply(resp: Any, truncate: int | None) -> list[str]:
    if not isinstance(resp, dict) or not resp.get("choices"):
        return [click.style("  (no reply recorded)", dim=True)]
    choice = resp["choices"][0]
    if "message" in choice:
        m = choice["message"] or {}
        out = []
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        if reasoning:
            out += _block("reasoning", str(reasoning), truncate, label_style={"fg": "magenta"})
        text = _content(m.get("content"))
        if text or not m.get("tool_calls"):
            out += _block("reply", text, truncate, label_style={"fg": "cyan", "bold": True})
        for tc in m.get("tool_calls") or []:
            out.append(f"  {click.style('reply', fg='cyan', bold=True)} → {_tool_call(tc)}")
        return out
    return _block("reply", str(choice.get("text", "")), truncate, label_style={"fg": "cyan", "bold": True})


def _tool_call(tc: Any) -> str:
    fn = tc.get("function", {}) if isinstance(tc, dict) else {}
    return f"{fn.get('name', '?')}({fn.get('arguments', '')})"


def _content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") == "text":
                parts.append(str(p.get("text", "")))
            elif isinstance(p, dict):
                parts.append(f"[{p.get('type', 'part')}]")
            else:
                parts.append(str(p))
        return "\n".join(parts)
    return str(content)


def _block(label: str, text: str, truncate: int | None,
           label_style: dict[str, Any] | None = None) -> list[str]:
    text = _elide(text, truncate)
    first, *rest = text.split("\n") if text else [""]
    pad = " " * (len(label) + 4)
    return ([f"  {click.style(label, **(label_style or {'bold': True}))}: {first}"]
            + [pad + line for line in rest])


def _gutter(kind: str, text: str, truncate: int | None, **style: Any) -> list[str]:
    text = _elide(text, truncate)
    gutter = click.style(f"{kind:>9} │ ", **style)
    return [gutter + click.style(line, **style) for line in text.split("\n")]


def _elide(text: str, truncate: int | None) -> str:
    if truncate is None or len(text) <= truncate:
        return text
    half = truncate // 2
    return f"{text[:half]} … [{len(text) - 2 * half} characters] … {text[-half:]}"


def _decode(tokenizer: Any, ids: list[int]) -> str:
    try:
        return tokenizer.decode(list(ids), skip_special_tokens=False)
    except TypeError:  # a decoder without the keyword
        return tokenizer.decode(list(ids))


def _reward(w: dict[str, Any]) -> str:
    when = w["recorded_at"].strftime("%Y-%m-%d %H:%M:%S") if w.get("recorded_at") else ""
    return click.style(f"{w['value']:g}", bold=True) + click.style(f" ({w['source']}, {when})", dim=True)


def _json(text: str | None) -> Any:
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None
