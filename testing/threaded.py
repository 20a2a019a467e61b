"""An aiohttp app served for sync test code: its own event loop in a daemon thread, on a free loopback
port, cleaned up on exit (``with serve_app(app) as port: ...``)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
from collections.abc import Iterator

from aiohttp import web


@contextlib.contextmanager
def serve_app(app: web.Application, *, ssl_context: ssl.SSLContext | None = None) -> Iterator[int]:
    """Serve ``app`` on 127.0.0.1 (TLS with ``ssl_context``); yields the port."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> web.AppRunner:
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context).start()
        return runner

    runner = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield runner.addresses[0][1]
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
