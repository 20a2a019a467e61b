"""A client of the control API (:mod:`lgt.proxy.control`): the one every caller uses.

    from lgt.proxy.client import ControlClient, resolve_token

    ctl = ControlClient("http://127.0.0.1:8081", resolve_token(store="runs/store"))
    ctl.pause(timeout=60)        # {"drained": true, "drain_seconds": ..., ...}
    ctl.resume(policy_version=3)

Standard library only (urllib), so the trainer's environment and scripts use it without aiohttp or
mitmproxy. Every call bypasses the HTTP(S)_PROXY the machine sets: the control API is reached
directly, never through a proxy (least of all lgt-proxy itself). A call that is not answered 200 raises
:class:`ControlError`, one sentence naming the method, path, status and body; ``request`` returns the
raw status for callers that want it.
"""

from __future__ import annotations

import http.client
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from .auth import CONTROL_TOKEN_ENV, control_token, load_secret

TIMEOUT = 120.0  # seconds for one call (a pause waits its own drain timeout longer)
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy from the environment


class ControlError(RuntimeError):
    """A control API call that was not answered 200; ``status`` is None when nothing answered."""

    def __init__(self, url: str, method: str, path: str, status: int | None, body: Any) -> None:
        self.url, self.method, self.path, self.status, self.body = url, method, path, status, body
        if status is None:
            message = f"no lgt-proxy control API answers at {url} ({method} {path}: {body})"
        else:
            message = f"lgt-proxy at {url} answered {method} {path} with {status}: {_detail(body)}"
        super().__init__(message)


def _detail(body: Any, limit: int = 500) -> str:
    """The server's ``{"error": ...}`` message, else the body itself, shortened."""
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return body["error"]
    text = body if isinstance(body, str) else json.dumps(body)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def resolve_token(token: str | None = None, store: str | os.PathLike | None = None,
                  secret_file: str | os.PathLike | None = None) -> str:
    """The control API's bearer token: ``token`` when given, else ``$LGT_CONTROL_TOKEN``, else derived
    from the proxy's secret (``$LGT_PROXY_SECRET``, ``secret_file`` or ``<store>/_proxy/secret``: see
    :func:`lgt.proxy.auth.load_secret`). The same rule the proxy uses to choose its own."""
    return token or os.environ.get(CONTROL_TOKEN_ENV) or control_token(load_secret(store, secret_file))


@dataclass(frozen=True)
class ControlClient:
    """The control API at ``url`` (``http://host:control_port``) with bearer ``token``."""

    url: str
    token: str = field(repr=False)  # kept out of reprs, tracebacks and logs

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", self.url.rstrip("/"))

    def request(self, method: str, path: str, body: Any = None, *, auth: bool = True,
                timeout: float = TIMEOUT) -> tuple[int, Any]:
        """One call: (status, the answer as JSON, or text when it is not JSON). ControlError (status
        None) when nothing answers."""
        headers = {"Content-Type": "application/json"}
        if auth:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with _OPENER.open(req, timeout=timeout) as r:
                raw, status = r.read(), r.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        except urllib.error.URLError as e:
            raise ControlError(self.url, method, path, None, str(e.reason)) from None
        except (OSError, http.client.HTTPException) as e:
            raise ControlError(self.url, method, path, None, str(e) or type(e).__name__) from None
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def call(self, method: str, path: str, body: Any = None, *, timeout: float = TIMEOUT) -> Any:
        """``request``, and the answer unless it is not 200 (ControlError)."""
        status, out = self.request(method, path, body, timeout=timeout)
        if status != 200:
            raise ControlError(self.url, method, path, status, out)
        return out

    def pause(self, timeout: float = 60, on_update: str | None = None) -> dict[str, Any]:
        """Hold new calls and wait up to ``timeout`` s until none is in flight: the state with
        ``drained``, ``in_flight_at_pause``, ``drain_seconds``. ControlError (504) when calls were
        still running at the timeout (the proxy stays paused). ``on_update``: ``continue`` stops the
        calls that can be continued instead of waiting for them (``parked``), ``drain`` waits for
        all; None: the proxy's ``--on-update``."""
        body: dict[str, Any] = {"timeout": timeout}
        if on_update is not None:
            body["on_update"] = on_update
        return self.call("POST", "/pause", body, timeout=timeout + 10)

    def resume(self, policy_version: int | None = None, served_model: str | None = None,
               served: dict[str, str | None] | None = None) -> dict[str, Any]:
        """Release held calls; later ones are recorded under ``policy_version`` (unchanged if None) and
        sent to the upstream's model ``served_model`` (unchanged if None: a proxy older than that field
        is never sent it); ``served``: each named policy's served model, changed before a held call
        goes on (docs/policies.md)."""
        body: dict[str, Any] = {} if policy_version is None else {"policy_version": policy_version}
        if served_model is not None:
            body["served_model"] = served_model
        if served:
            body["served"] = served
        return self.call("POST", "/resume", body)

    def set_served(self, served: dict[str, str | None]) -> dict[str, Any]:
        """The model each named policy's next calls are sent upstream as (None: the proxy's own):
        the policies' state (``GET /state``'s ``policies``)."""
        return self.call("POST", "/policies", {"served": served})

    def state(self) -> dict[str, Any]:
        return self.call("GET", "/state")

    def metrics(self) -> str:
        """Prometheus text."""
        return self.call("GET", "/metrics")

    def flush(self) -> dict[str, Any]:
        """Make every recorded call, reward and egress row visible as Parquet: ``{"rows_written"}``."""
        return self.call("POST", "/flush", {})

    def add_reward(self, rollout_id: str, value: float, *, attempt: int | None = None,
                   call_id: str | None = None) -> dict[str, Any]:
        """Record a reward for a rollout that made calls through this proxy (``attempt``: its latest
        when None; ``call_id``: a per-call reward): ``{"reward_id", "rollout_id", "attempt", "value"}``."""
        body: dict[str, Any] = {"rollout_id": rollout_id, "value": value}
        if attempt is not None:
            body["attempt"] = attempt
        if call_id is not None:
            body["call_id"] = call_id
        return self.call("POST", "/rewards", body)

    def reward(self, rollout_id: str, attempt: int = 0) -> float | None:
        """The latest whole-rollout reward recorded for this attempt since the proxy started (from
        its memory, no store query), or None."""
        q = urllib.parse.urlencode({"rollout_id": rollout_id, "attempt": attempt})
        value = self.call("GET", f"/rewards?{q}").get("value")
        return None if value is None else float(value)

    def deliver(self, rollout_id: str, attempt: int, substitutions: list[dict[str, Any]]) -> dict[str, Any]:
        """Register what this attempt's requests carry instead of the agent's prompt
        (:mod:`lgt.proxy.resources`); before the attempt starts."""
        return self.call("POST", "/resources", {"rollout_id": rollout_id, "attempt": attempt,
                                                "substitutions": substitutions})

    def healthz(self, timeout: float = 5) -> bool:
        """Whether the proxy answers (no token needed): False while nothing listens yet."""
        try:
            return self.request("GET", "/healthz", auth=False, timeout=timeout)[0] == 200
        except ControlError:
            return False
