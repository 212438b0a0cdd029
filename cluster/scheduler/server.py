"""The extender's HTTP server (aiohttp): POST /filter, /prioritize, /bind,
GET /healthz (200 once the first sync with the API server is done), and
the metrics on their own port (GET /metrics).

All three verbs run on the event loop; bind awaits its write to the API
server there (cluster/scheduler/binding.py), so many binds proceed at once
(the allocator's per-node optimistic commit keeps concurrent binds
correct), and only a bind that must read the pod first hands that to a
worker thread.
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
from prometheus_client import CONTENT_TYPE_LATEST

from .extender import BadRequest, Extender
from .metrics import Metrics

log = logging.getLogger("gpuvisor.scheduler")

MAX_BODY = 64 << 20  # a filter for thousands of nodes with full Node objects

# Until the first list of Nodes and Pods is done (a restarted extender), the
# allocator knows the Nodes' GPUs before the pods that hold them: a verb
# answered then could pass or commit room those pods hold.  kube-scheduler
# retries a pod whose filter or bind answers an error; it ignores a failed
# prioritize (which would otherwise assume room for the pod).
NOT_READY = "gpuvisor: not ready: still listing the cluster's nodes and pods"


def make_app(extender: Extender, metrics: Metrics) -> web.Application:
    # filter and prioritize run inside kube-scheduler's one-pod-at-a-time
    # cycle.  Queued in one thread pool with the binds, the cycle's verbs
    # waited behind hundreds of them (filter: 36 ms mean under make
    # bench-cluster); they run on the loop, and so do the binds, whose
    # worker threads' hand-offs of the GIL the verbs waited on too.

    def verb(name: str, fn: Callable[[Any], Any]) -> Any:
        ok_count = metrics.requests.labels(name, "ok")
        error_count = metrics.requests.labels(name, "error")
        seconds = metrics.seconds.labels(name)

        async def handle(request: web.Request) -> web.Response:
            start = time.perf_counter()
            try:
                args = await request.json()
            except json.JSONDecodeError as exc:
                log.warning("%s: body: not JSON: %s", name, exc)
                error_count.inc()
                return web.json_response({"Error": f"body: not JSON: {exc}"}, status=400)
            if not extender.state.ready.is_set():
                error_count.inc()
                status = 503 if name == "prioritize" else 200  # its answer is a list
                return web.json_response({"Error": NOT_READY}, status=status)
            try:
                out = fn(args)
                if asyncio.iscoroutine(out):
                    out = await out
            except BadRequest as exc:
                log.warning("%s: %s", name, exc)
                error_count.inc()
                return web.json_response({"Error": str(exc)}, status=400)
            ok = not (isinstance(out, dict) and out.get("Error"))
            (ok_count if ok else error_count).inc()
            seconds.observe(time.perf_counter() - start)
            return web.json_response(out)

        return handle

    async def healthz(request: web.Request) -> web.Response:
        if not extender.state.ready.is_set():
            return web.Response(status=503, text="syncing with the API server\n")
        return web.Response(text="ok\n")

    async def shutdown(app: web.Application) -> None:
        await extender.binder.close()

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
    # A scrape is formatted in a thread of its own, one at a time: on the
    # loop, a scrape at 1,000 nodes x 8 GPUs (64,000 series with 8,000
    # pods) held every filter, prioritize and bind for 0.4-0.9 s
    # (tests/bench/metrics_bench.py); the thread only shares the GIL.
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metrics")

    async def scrape(request: web.Request) -> web.Response:
        loop = asyncio.get_running_loop()
        body = await loop.run_in_executor(pool, metrics.exposition)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def shutdown(app: web.Application) -> None:
        pool.shutdown(wait=False, cancel_futures=True)

    app = web.Application()
    app.add_routes([web.get("/metrics", scrape)])
    app.on_cleanup.append(shutdown)
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
