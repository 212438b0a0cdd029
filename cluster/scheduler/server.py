"""The extender's HTTP server (aiohttp): POST /filter, /prioritize, /bind,
GET /healthz (200 once the first sync with the API server is done), and
the metrics on their own port (GET /metrics).

filter and prioritize run on the event loop; bind, which waits on the API
server, runs in a thread pool, so many binds proceed at once (the
allocator's per-node optimistic commit keeps concurrent binds correct).
kube-scheduler calls filter and prioritize one pod at a time, inside its
scheduling cycle, so their latency bounds its rate; a decision is CPU work
of a millisecond or two that no thread could run beside it (the GIL), and
handing it to a worker thread and back cost two thread wake-ups per request,
each also waiting for the GIL that the bind threads and the watches hold
turn by turn (make bench-cluster)."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .extender import BadRequest, Extender
from .metrics import Metrics

log = logging.getLogger("gpuvisor.scheduler")

MAX_BODY = 64 << 20  # a filter for thousands of nodes with full Node objects


def make_app(extender: Extender, metrics: Metrics, workers: int = 32) -> web.Application:
    # Binds wait on the API server; filter and prioritize run inside kube-
    # scheduler's one-pod-at-a-time cycle.  Queued in one pool with the
    # binds, the cycle's verbs waited behind hundreds of them (filter: 36 ms
    # mean under make bench-cluster); they now run on the loop.
    binds = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bind")

    def verb(name: str, fn: Callable[[Any], Any]) -> Any:
        pool = binds if name == "bind" else None

        async def handle(request: web.Request) -> web.Response:
            start = time.perf_counter()
            try:
                args = await request.json()
            except json.JSONDecodeError as exc:
                log.warning("%s: body: not JSON: %s", name, exc)
                metrics.requests.labels(name, "error").inc()
                return web.json_response({"Error": f"body: not JSON: {exc}"}, status=400)
            try:
                if pool is None:
                    out = fn(args)
                else:
                    out = await asyncio.get_running_loop().run_in_executor(pool, fn, args)
            except BadRequest as exc:
                log.warning("%s: %s", name, exc)
                metrics.requests.labels(name, "error").inc()
                return web.json_response({"Error": str(exc)}, status=400)
            ok = not (isinstance(out, dict) and out.get("Error"))
            metrics.requests.labels(name, "ok" if ok else "error").inc()
            metrics.seconds.labels(name).observe(time.perf_counter() - start)
            return web.json_response(out)

        return handle

    async def healthz(request: web.Request) -> web.Response:
        if not extender.state.ready.is_set():
            return web.Response(status=503, text="syncing with the API server\n")
        return web.Response(text="ok\n")

    async def shutdown(app: web.Application) -> None:
        binds.shutdown(wait=False, cancel_futures=True)

    app = web.Application(client_max_size=MAX_BODY)
    app.add_routes(
        [
            web.post("/filter", verb("filter", extender.filter)),
            web.post("/prioritize", verb("prioritize", extender.prioritize)),
            web.post("/bind", verb("bind", extender.bind)),
            web.get("/healthz", healthz),
        ]
    )
    app.on_shutdown.append(shutdown)
    return app


def metrics_app(metrics: Metrics) -> web.Application:
    async def scrape(request: web.Request) -> web.Response:
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.add_routes([web.get("/metrics", scrape)])
    return app


async def serve(
    extender: Extender,
    metrics: Metrics,
    host: str,
    port: int,
    metrics_host: str,
    metrics_port: int,
    tls: ssl.SSLContext | None,
    stop: asyncio.Event,
) -> None:
    runners = []
    for app, h, p, ctx in (
        (make_app(extender, metrics), host, port, tls),
        (metrics_app(metrics), metrics_host, metrics_port, None),
    ):
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, h, p, ssl_context=ctx).start()
        runners.append(runner)
    log.info(
        "serving the extender on %s://%s:%d, metrics on http://%s:%d",
        "https" if tls is not None else "http",
        host,
        port,
        metrics_host,
        metrics_port,
    )
    try:
        await stop.wait()
    finally:
        for runner in runners:
            await runner.cleanup()
