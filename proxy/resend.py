"""Sending a routed LLM call to the upstream again, from inside the proxy.

Used when the upstream rejects a call that carries fields the proxy injected (token ids, logprobs):
the proxy asks again without them and gives the agent that answer instead (``Capture`` in
``addons/capture.py``). One aiohttp session for the proxy's lifetime, verifying the upstream like mitmproxy
does (``--upstream-ca`` bundle, or ``--upstream-insecure``).
"""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass
from typing import Any

import aiohttp
from mitmproxy import http

# Headers that describe one hop, not the message: never copied between the two connections.
HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te",
                         "trailer", "upgrade", "host", "content-length"})


@dataclass
class Resender:
    ca_bundle: str | None = None
    insecure: bool = False
    timeout_s: float = 3600.0
    read_timeout_s: float | None = None  # the longest silence while reading (--upstream-timeout)
    _session: aiohttp.ClientSession | None = None

    def _ssl(self) -> ssl.SSLContext | bool:
        if self.insecure:
            return False
        return ssl.create_default_context(cafile=self.ca_bundle) if self.ca_bundle else True

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._ssl(), limit=0),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s, sock_read=self.read_timeout_s),
                auto_decompress=False, trust_env=False)
        return self._session

    async def send(self, request: http.Request, body: bytes) -> http.Response:
        """``request`` (already routed to the upstream) again with ``body``; the whole answer, read
        to its end (a stream too), as a mitmproxy response. aiohttp errors propagate."""
        headers = {k: v for k, v in request.headers.items(multi=True) if k.lower() not in HOP_HEADERS}
        async with self.session().request(request.method, request.url, data=body, headers=headers,
                                          allow_redirects=False) as r:
            content = await r.read()
            out = [(k, v) for k, v in r.raw_headers if k.decode("latin-1").lower() not in HOP_HEADERS]
        response = http.Response.make(r.status, b"", out)
        response.raw_content = content
        response.headers["content-length"] = str(len(content))
        return response

    async def call_json(self, method: str, url: str, payload: Any = None,
                        headers: dict[str, str] | None = None, timeout_s: float = 10.0) -> tuple[int, Any]:
        """A small JSON exchange with the upstream (e.g. its tokenizer): the status and the parsed body
        (None when it is not JSON). aiohttp errors propagate."""
        async with self.session().request(method, url, json=payload, headers=headers or {},
                                          timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            try:
                return r.status, json.loads(await r.read())
            except ValueError:
                return r.status, None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
