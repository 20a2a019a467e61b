"""The live run page served: :func:`make_app` serves a :class:`~lgt.trainer.report.run_view.RunView`
read-only over HTTP — ``live.html``, JSON under ``/api/``, and ``/api/events``, a server-sent event
each time the run wrote something new; :func:`serve` runs it (``lgt-train serve``), :class:`Background`
beside a run (``lgt-train run --serve PORT``). Requests whose Host is not the address served are
refused (a web page elsewhere cannot read the run through DNS rebinding).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from lgt.trainer.report import run_view
from lgt.trainer.report.run_view import RunView, query_int

log = logging.getLogger("lgt.live")

PAGE = "live.html"


def page_html() -> str:
    return resources.files("lgt.trainer.report").joinpath(PAGE).read_text()


def make_app(view: RunView, *, allowed_hosts: tuple[str, ...] = ()) -> Any:
    """The aiohttp application serving ``view``: GET only. ``allowed_hosts``: Host header values
    accepted besides loopback names (the address served)."""
    from aiohttp import web

    loopback = {"127.0.0.1", "localhost", "[::1]", "::1"}

    @web.middleware
    async def guard(request: web.Request, handler: Callable) -> web.StreamResponse:
        host = (request.host or "").rsplit(":", 1)[0] if not (request.host or "").startswith("[") else \
            (request.host or "").split("]")[0] + "]"
        if host not in loopback and host not in allowed_hosts:
            return web.Response(status=403, text=f"this page answers on {', '.join(sorted(loopback))} only")
        if request.method not in ("GET", "HEAD"):
            return web.Response(status=405, text="the run page is read-only")
        resp = await handler(request)
        resp.headers["X-Content-Type-Options"] = "nosniff"
        resp.headers["Cache-Control"] = "no-store"
        return resp

    async def call(fn: Callable[..., Any], *args: Any) -> web.Response:
        try:
            out = await asyncio.to_thread(fn, *args)
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response(out, dumps=_dumps)

    async def index(request: web.Request) -> web.Response:
        return web.Response(text=page_html(), content_type="text/html",
                            headers={"Content-Security-Policy": "default-src 'self'; "
                                     "script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:"})

    async def overview(request: web.Request) -> web.Response:
        return await call(view.overview)

    async def metrics(request: web.Request) -> web.Response:
        try:
            since = query_int(dict(request.query), "since", 0)
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        return await call(view.metric_rows, since)

    async def evals(request: web.Request) -> web.Response:
        return await call(view.eval_rows)

    async def charts(request: web.Request) -> web.Response:
        return await call(view.charts)

    async def rollouts(request: web.Request) -> web.Response:
        return await call(view.rollouts, dict(request.query))

    async def trajectory(request: web.Request) -> web.Response:
        try:
            n = query_int(dict(request.query), "attempt", None)
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        try:
            out = await asyncio.to_thread(view.trajectory, request.match_info["rollout_id"], n)
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=404)
        return web.json_response(out, dumps=_dumps)

    async def events(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store"})
        await resp.prepare(request)
        last = None
        try:
            while True:
                try:
                    state = await asyncio.to_thread(view.locked_state)
                except Exception:  # a read that failed (a file mid-write, the store moved): say, go on
                    log.exception("the run page could not read %s", view.run_dir)
                    state = last
                if state != last:
                    await resp.write(f"data: {json.dumps(state)}\n\n".encode())
                    last = state
                else:
                    await resp.write(b": idle\n\n")  # a comment: notices a closed page
                await asyncio.sleep(run_view.REFRESH_S)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return resp

    app = web.Application(middlewares=[guard])
    app.router.add_get("/", index)
    app.router.add_get("/api/overview", overview)
    app.router.add_get("/api/metrics", metrics)
    app.router.add_get("/api/evals", evals)
    app.router.add_get("/api/charts", charts)
    app.router.add_get("/api/rollouts", rollouts)
    app.router.add_get("/api/rollouts/{rollout_id}", trajectory)
    app.router.add_get("/api/events", events)
    app.on_cleanup.append(lambda app: asyncio.to_thread(view.close))
    return app


def _dumps(obj: Any) -> str:
    return json.dumps(obj, default=str, allow_nan=False)


def check_port(host: str, port: int) -> None:
    """ValueError (one sentence) when ``host:port`` cannot be listened on."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot serve the run page on {host}:{port}: {e.strerror or e}") from None


def serve(view: RunView, host: str = "127.0.0.1", port: int = 8765, *,
          ready: Callable[[str], None] | None = None) -> None:
    """Serve ``view`` until interrupted (the ``lgt-train serve`` command)."""
    asyncio.run(_serve(view, host, port, ready=ready))


async def _serve(view: RunView, host: str, port: int, *, ready: Callable[[str], None] | None = None,
                 stop: asyncio.Event | None = None) -> None:
    from aiohttp import web

    runner = web.AppRunner(make_app(view, allowed_hosts=(host,)), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    if ready is not None:
        ready(f"http://{host if ':' not in host else f'[{host}]'}:{bound}/")
    try:
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        await runner.cleanup()


class Background:
    """The page served from a thread beside a run (``lgt-train run --serve PORT``)."""

    def __init__(self, run_dir: Path, host: str, port: int, store: Path | None = None) -> None:
        self.view = RunView(run_dir, store)
        self.url: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(host, port), name="lgt-live-page",
                                        daemon=True)

    def start(self) -> str:
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise ValueError(f"the run page could not start: {self._error}")
        return self.url or ""

    def _main(self, host: str, port: int) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()

            def ready(url: str) -> None:
                self.url = url
                self._ready.set()

            await _serve(self.view, host, port, ready=ready, stop=self._stop)

        try:
            asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e
            self._ready.set()

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
