"""Prompt resources: text the run delivers to every rollout, the agent unchanged.

A run config names them::

    resources:
      system_prompt: {template: prompt.txt, deliver: proxy}            # the system message
      hint: {template: hint.txt, deliver: proxy, span: ["<<H>>", "<</H>>"]}   # a marked span
      notes: {template: notes.txt, deliver: env}                       # $LGT_RESOURCE_NOTES
      guide: {template: guide.txt, deliver: file}                      # $LGT_RESOURCE_GUIDE_FILE

A template's ``{field}`` placeholders are filled from each task's fields (``{question}``); other
braces are left alone. ``deliver: proxy`` has the proxy substitute the text in every request of the
rollout (:mod:`lgt.proxy.resources`): the system message, or the span between two markers the agent's
own prompt holds. ``env`` and ``file`` are for agents that read their prompt. Every rollout records
the version of the resources it ran with (``rollouts.resource_version``: a hash of the texts), so
``SELECT resource_version, avg(reward) …`` compares prompts; ``<run>/resources/<version>.json`` holds
the texts of each version.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DELIVERIES = ("proxy", "env", "file")
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class ResourceSpec:
    template: Path
    deliver: str = "proxy"
    span: tuple[str, str] | None = None  # deliver: proxy — replace this marked span, not the system message

    def __post_init__(self) -> None:
        if self.deliver not in DELIVERIES:
            raise ValueError(f"deliver must be one of {', '.join(DELIVERIES)}, not {self.deliver!r}")
        if self.span is not None and (self.deliver != "proxy" or not all(self.span)):
            raise ValueError("span is two non-empty markers, for deliver: proxy")


def placeholders(text: str) -> set[str]:
    return set(_PLACEHOLDER.findall(text))


def fill(template: str, task: Mapping[str, Any]) -> str:
    """``template`` with each ``{field}`` that names a task field replaced by its value (strings as they
    are, anything else as JSON)."""
    def sub(m: re.Match[str]) -> str:
        if m[1] not in task:
            return m[0]
        v = task[m[1]]
        return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
    return _PLACEHOLDER.sub(sub, template)


def check_rewrite(old: str, new: str) -> None:
    """A rewritten template keeps every placeholder of the old one (ValueError names those it lost)."""
    lost = sorted(placeholders(old) - placeholders(new))
    if lost:
        raise ValueError(f"the rewrite drops the placeholder(s) {', '.join('{' + p + '}' for p in lost)}")


def version(texts: Mapping[str, str]) -> str:
    """The version of a set of resource texts: a short hash of them."""
    blob = json.dumps(dict(sorted(texts.items())), ensure_ascii=False).encode()
    return hashlib.sha1(blob).hexdigest()[:12]


class Resources:
    """The run's resources at one version: their specs and current texts."""

    def __init__(self, specs: Mapping[str, ResourceSpec], texts: Mapping[str, str] | None = None) -> None:
        self.specs = dict(specs)
        if texts is None:
            texts = {}
            for name, spec in self.specs.items():
                try:
                    texts[name] = Path(spec.template).read_text()
                except OSError as e:
                    raise ValueError(f"resources.{name}.template {spec.template}: "
                                     f"{e.strerror or e}") from None
        self.texts = dict(texts)
        self.version = version(self.texts)

    def with_texts(self, texts: Mapping[str, str]) -> Resources:
        """Another version (APO's candidates): the same specs, these texts."""
        for name in self.specs:
            check_rewrite(self.texts[name], texts[name])
        return Resources(self.specs, texts)

    def save(self, run_dir: Path) -> Path:
        """``<run_dir>/resources/<version>.json``: this version's texts (written once)."""
        path = Path(run_dir) / "resources" / f"{self.version}.json"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"version": self.version, "texts": self.texts}, indent=2,
                                       ensure_ascii=False))
        return path

    def for_task(self, task: Mapping[str, Any]) -> dict[str, str]:
        return {name: fill(text, task) for name, text in self.texts.items()}

    def substitutions(self, filled: Mapping[str, str]) -> list[dict[str, Any]]:
        """What the proxy substitutes (``deliver: proxy``) in an attempt's requests."""
        out: list[dict[str, Any]] = []
        for name, spec in self.specs.items():
            if spec.deliver == "proxy":
                out.append({"text": filled[name], "span": list(spec.span)} if spec.span
                           else {"text": filled[name], "target": "system"})
        return out


def env_name(name: str) -> str:
    return "LGT_RESOURCE_" + re.sub(r"[^A-Za-z0-9]", "_", name).upper()
