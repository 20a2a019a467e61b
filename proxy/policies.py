"""Several policies behind one proxy: which policy each LLM call belongs to, and what it is served as.

A run names its policies in order; each may have rules (``match``), a served model name, and another
engine to be sent to (``upstream``, its base URL; default: the proxy's ``--upstream``)::

    [{"name": "coder", "served": "coder"},                        # the first: the default
     {"name": "planner", "match": {"model": "planner*"}, "served": "planner"},
     {"name": "side", "match": [{"kind": "side"}, {"system": "title generator"}]},
     {"name": "judge", "match": {"model": "judge"}, "served": "qwen-7b", "upstream": "http://gpu2:8000/v1"}]

A rule is a mapping of conditions that must all hold; a policy's ``match`` is one rule or a list of
rules, any of which places a call on it. The conditions (:data:`CONDITIONS`):

- ``model``: a shell-style pattern (``planner``, ``claude-*-haiku*``) on the model the agent asked for;
- ``system``: a regular expression searched for in the call's system prompt (its system and developer
  messages, after translation to chat/completions: every dialect the proxy speaks reads the same);
- ``kind``: ``main`` or ``side``. A side call is a harness's own call beside the conversation (a title,
  a routing question): :data:`SIDE_CALLS` says what one looks like, as data.

A call is assigned to the first policy, in the order given, with a rule it satisfies; a call no rule
places goes to the first policy. What can be seen before any call is refused by :func:`parse` with one
sentence (an unknown condition, a bad pattern, a policy no call could reach); a call that satisfies the
rules of several policies goes to the first of them and is counted (``GET /state``'s ``policies``).

Pure functions over the parsed request: no mitmproxy.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any
from urllib.parse import urlsplit

from .dialects.common import plain_text

DEFAULT = "default"  # the one policy of a run that names none (lgt.store.schema.DEFAULT_POLICY)
KINDS = ("main", "side")
CONDITIONS = ("model", "system", "kind")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

# What makes a call a side call, read from the recorded harnesses (tests/fixtures/harnesses): each entry
# is a set of facts about the call that all hold. opencode's title call and Gemini CLI's model router
# offer the model no tools and go on from no earlier answer; every main call of the recorded harnesses
# offers tools, or continues a conversation (Codex's follow-ups over WebSocket name
# ``previous_response_id`` and repeat no tools).
SIDE_CALLS: tuple[dict[str, bool], ...] = (
    {"offers_tools": False, "continues": False},
)


class PolicyError(ValueError):
    """A policies section that cannot work; the message names what is wrong."""


class UnknownPolicy(PolicyError):
    """A name that is not one of the proxy's policies."""


@dataclass(frozen=True)
class Rule:
    model: str | None = None
    system: re.Pattern[str] | None = None
    kind: str | None = None

    def matches(self, facts: Facts) -> bool:
        return ((self.model is None or (facts.model is not None and fnmatchcase(facts.model, self.model)))
                and (self.system is None or self.system.search(facts.system) is not None)
                and (self.kind is None or self.kind == facts.kind))

    def key(self) -> tuple[Any, ...]:
        return (self.model, self.system.pattern if self.system else None, self.kind)


@dataclass(frozen=True)
class Policy:
    name: str
    rules: tuple[Rule, ...] = ()
    served: str | None = None  # the model name the upstream is asked for (None: the proxy's own)
    upstream: str | None = None  # another engine's base URL (None: the proxy's --upstream)


@dataclass(frozen=True)
class Facts:
    """What the rules look at in one call."""

    model: str | None
    system: str
    kind: str


def facts(chat: dict[str, Any], agent: dict[str, Any] | None, requested_model: Any) -> Facts:
    """The facts of a call: ``chat`` the chat/completions request the proxy built (or the agent's own),
    ``agent`` the agent's request in its API when it was translated (None otherwise)."""
    messages = chat.get("messages") if isinstance(chat.get("messages"), list) else []
    system = "\n".join(plain_text(m.get("content")) for m in messages
                       if isinstance(m, dict) and m.get("role") in ("system", "developer"))
    seen = {
        "offers_tools": bool(chat.get("tools") or chat.get("functions")),
        "continues": bool(agent and agent.get("previous_response_id")) or any(
            isinstance(m, dict) and m.get("role") in ("tool", "function") for m in messages),
    }
    side = any(all(seen[k] == v for k, v in sign.items()) for sign in SIDE_CALLS)
    return Facts(requested_model if isinstance(requested_model, str) else None, system,
                 "side" if side else "main")


@dataclass
class Policies:
    """The run's policies, in order (the first is the default), and each one's served model now."""

    policies: tuple[Policy, ...] = (Policy(DEFAULT),)
    served: dict[str, str | None] = field(default_factory=dict)
    calls: Counter = field(default_factory=Counter)  # calls assigned, by policy
    overlaps: Counter = field(default_factory=Counter)  # calls more than one policy's rules took

    def __post_init__(self) -> None:
        for p in self.policies:
            self.served.setdefault(p.name, p.served)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.policies]

    @property
    def default(self) -> str:
        return self.policies[0].name

    def assign(self, f: Facts) -> str:
        """The policy of a call with these facts: the first whose rules it satisfies, else the first."""
        taken = [p.name for p in self.policies if any(r.matches(f) for r in p.rules)]
        if len(taken) > 1:
            self.overlaps[tuple(taken)] += 1
        name = taken[0] if taken else self.default
        self.calls[name] += 1
        return name

    def upstream_of(self, name: str) -> str | None:
        """The base URL a policy's calls go to when it is not the proxy's ``--upstream`` (else None)."""
        return next((p.upstream for p in self.policies if p.name == name), None)

    def served_as(self, name: str, fallback: str | None) -> str | None:
        """The model name a call of policy ``name`` is sent upstream as (``fallback``: the proxy's own
        served model, for a policy that names none)."""
        return self.served.get(name) or fallback

    def set_served(self, served: Any) -> None:
        """Change served models: ``{"planner": "planner-v3"}`` (null: back to the proxy's own).
        PolicyError, and nothing changed, when a name is not a policy's or a value not a name."""
        if not isinstance(served, dict):
            raise PolicyError('served must be a JSON object like {"planner": "planner-v3"}')
        for name, model in served.items():
            if name not in self.served:
                raise UnknownPolicy(f"{name!r} is not one of this proxy's policies ({', '.join(self.names)})")
            if model is not None and (not isinstance(model, str) or not model):
                raise PolicyError(f"the served model of policy {name!r} must be a model name, not {model!r}")
        self.served.update(served)

    def state(self) -> dict[str, Any]:
        return {"default": self.default,
                "served": dict(self.served),
                "upstreams": {p.name: p.upstream for p in self.policies if p.upstream},
                "calls": {n: self.calls[n] for n in self.names},
                "overlaps": {" > ".join(k): n for k, n in self.overlaps.items()}}


    def prometheus(self) -> str:
        """The calls assigned per policy and those several policies' rules took, as Prometheus text."""
        lines = ["# HELP lgt_proxy_policy_calls_total LLM calls assigned to each policy.",
                 "# TYPE lgt_proxy_policy_calls_total counter"]
        lines += [f'lgt_proxy_policy_calls_total{{policy="{n}"}} {self.calls[n]}' for n in self.names]
        lines += ["# HELP lgt_proxy_policy_overlaps_total LLM calls the rules of more than one policy took "
                  "(the first of them answered).",
                  "# TYPE lgt_proxy_policy_overlaps_total counter",
                  f"lgt_proxy_policy_overlaps_total {sum(self.overlaps.values())}"]
        return "\n".join(lines) + "\n"


def parse(spec: Any) -> Policies:
    """The policies of a section ``[{name, match?, served?, upstream?}, …]``; PolicyError (one
    sentence) when it cannot work: not a list of at least one policy, a name given twice or not a
    plain name, an unknown key or condition, a pattern that is not a regular expression, a kind that
    is not main or side, an upstream that is not an http(s) URL, a rule given twice, or a policy no
    call could reach (a later policy without rules, or one after a policy whose rule takes every
    call)."""
    if not isinstance(spec, list) or not spec:
        raise PolicyError("policies must be a list of at least one policy, each {name, match, served}")
    keys = ("name", "match", "served", "upstream")
    out: list[Policy] = []
    seen_rules: dict[tuple[Any, ...], str] = {}
    catch_all: str | None = None
    for i, item in enumerate(spec):
        where = f"policies[{i}]"
        if not isinstance(item, dict):
            raise PolicyError(f"{where} must be a mapping with a name, not {item!r}")
        unknown = sorted(set(item) - set(keys))
        if unknown:
            raise PolicyError(f"{where} has unknown key(s) {', '.join(map(str, unknown))} (known: "
                              f"{', '.join(keys)})")
        name = item.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise PolicyError(f"{where}.name must be a plain name (letters, digits, '.', '_', '-'), "
                              f"not {name!r}")
        if name in (p.name for p in out):
            raise PolicyError(f"two policies are named {name!r}")
        where = f"policy {name!r}"
        served = item.get("served")
        if served is not None and (not isinstance(served, str) or not served):
            raise PolicyError(f"{where}: served must be a model name, not {served!r}")
        upstream = item.get("upstream")
        if upstream is not None:
            u = urlsplit(upstream) if isinstance(upstream, str) else None
            if u is None or u.scheme not in ("http", "https") or not u.hostname:
                raise PolicyError(f"{where}: upstream must be an engine's http(s) base URL like "
                                  f"http://127.0.0.1:8001/v1, not {upstream!r}")
            upstream = upstream.rstrip("/")
        rules = _rules(item.get("match"), where)
        if i > 0 and not rules:
            raise PolicyError(f"{where} has no match rule, so no call would reach it (only the first "
                              "policy takes the calls no rule places)")
        if catch_all is not None and rules:
            raise PolicyError(f"{where} comes after policy {catch_all!r}, whose empty rule takes every "
                              "call, so no call would reach it")
        for r in rules:
            if r.key() in seen_rules:
                raise PolicyError(f"{where} and policy {seen_rules[r.key()]!r} have the same rule "
                                  f"{_show(r)}: a call cannot belong to both")
            seen_rules[r.key()] = name
            if r.key() == (None, None, None):
                catch_all = name
        out.append(Policy(name, tuple(rules), served, upstream))
    return Policies(tuple(out))


def _rules(match: Any, where: str) -> list[Rule]:
    if match is None:
        return []
    items = match if isinstance(match, list) else [match]
    if not items:
        raise PolicyError(f"{where}: match must be a rule or a list of rules, not an empty list")
    return [_rule(m, f"{where}'s rule") for m in items]


def _rule(m: Any, where: str) -> Rule:
    if not isinstance(m, dict):
        raise PolicyError(f"{where} must be a mapping of {', '.join(CONDITIONS)}, not {m!r}")
    unknown = sorted(set(m) - set(CONDITIONS))
    if unknown:
        raise PolicyError(f"{where} has unknown condition(s) {', '.join(map(str, unknown))} (known: "
                          f"{', '.join(CONDITIONS)}), so it would match nothing it could")
    model, system, kind = m.get("model"), m.get("system"), m.get("kind")
    if model is not None and (not isinstance(model, str) or not model):
        raise PolicyError(f"{where}: model must be a model name or a pattern like 'planner*', not {model!r}")
    if kind is not None and kind not in KINDS:
        raise PolicyError(f"{where}: kind must be main or side, not {kind!r}")
    pattern = None
    if system is not None:
        if not isinstance(system, str) or not system:
            raise PolicyError(f"{where}: system must be a regular expression, not {system!r}")
        try:
            pattern = re.compile(system)
        except re.error as e:
            raise PolicyError(f"{where}: system {system!r} is not a regular expression ({e})") from None
    return Rule(model, pattern, kind)


def _show(r: Rule) -> str:
    parts = {"model": r.model, "system": r.system.pattern if r.system else None, "kind": r.kind}
    return "{" + ", ".join(f"{k}: {v!r}" for k, v in parts.items() if v is not None) + "}"
