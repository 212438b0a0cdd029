"""What one /metrics scrape of the extender costs (docs/benchmarks.md,
"The extender's /metrics scrape").

The extender's state as `make bench-cluster` builds it: 1,000 nodes of 8
GPUs, their inventories delivered as the node watch delivers them
(`ClusterState.node_event`), and pods of 1 GPU, 1000 MiB and 10 % cores
placed by the allocator.  For each number of pods: one scrape's wall and
CPU time (what the metrics port answers, formatted by
prometheus-client), its size and series, and what it costs the decision
path: a filter (420 nodes offered, as kube-scheduler offers at 1,000)
sent to the extender's real HTTP server while a scrape is being answered,
against the same filter alone; and the CPU of the first scrape (every
node read) and of a scrape after 100 more pods were placed.  No Kubernetes
needed:

    .venv/bin/python -m tests.bench.metrics_bench [--pods 0,1000,8000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
from aiohttp import web
from gpuvisor.cluster.deviceplugin.publish import NODE_INVENTORY
from gpuvisor.cluster.request import pod_request
from gpuvisor.cluster.scheduler.api_view import view
from gpuvisor.cluster.scheduler.extender import Extender
from gpuvisor.cluster.scheduler.metrics import Metrics
from gpuvisor.cluster.scheduler.server import make_app, metrics_app
from gpuvisor.cluster.scheduler.state import ClusterState
from prometheus_client import Metric, generate_latest

from tests.bench.cluster_bench import POD_CORES, POD_MIB, inventory

NODES = 1000
OFFERED = 420  # the nodes kube-scheduler offers a filter at 1,000 (its 42 %)
REPEAT = 5
BINDS = 100  # pods placed between two scrapes


def pod_doc(i: int) -> dict[str, Any]:
    limits = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(POD_MIB)}
    limits["nvidia.com/gpucores"] = str(POD_CORES)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"p-{i:05d}", "namespace": "bench", "uid": f"uid-{i}"},
        "spec": {"containers": [{"name": "main", "resources": {"limits": limits}}]},
    }


def build(pods: int) -> ClusterState:
    """1,000 nodes of 8 GPUs as the node watch delivers them, `pods` placed."""
    state = ClusterState(core=None)
    for n in range(NODES):
        name = f"bench-{n:04d}"
        meta = {"name": name, "annotations": {NODE_INVENTORY: inventory(name)}}
        state.node_event(view({"metadata": meta}))
    for i in range(pods):
        d = state.allocator.place(pod_request(pod_doc(i)))
        assert d.allocation is not None, "the cluster is full"
    state.ready.set()  # as after the first sync: the verbs are answered
    return state


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(wall s, CPU s of this thread, result), the best of REPEAT."""
    best: tuple[float, float, Any] | None = None
    for _ in range(REPEAT):
        w, c = time.perf_counter(), time.thread_time()
        out = fn()
        row = (time.perf_counter() - w, time.thread_time() - c, out)
        if best is None or row[0] < best[0]:
            best = row
    assert best is not None
    return best


class NoBinder:
    """The extender's Binder, for a bench that sends no bind."""

    async def close(self) -> None:
        pass


class Server:
    """The extender's two aiohttp apps on loopback, on their own event loop
    in a thread, as `gpuvisor scheduler` runs them (the client below is in
    another thread, so a blocked server loop shows as a slow answer)."""

    def __init__(self, state: ClusterState, metrics: Metrics) -> None:
        self.ext = Extender(state, core=None, binder=NoBinder())
        self.metrics = metrics
        self.ports: list[int] = []
        self.up = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.stop = asyncio.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._run(),))
        self.thread.start()
        self.up.wait()

    async def _run(self) -> None:
        runners = []
        for app in (make_app(self.ext, self.metrics), metrics_app(self.metrics)):
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            self.ports.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        self.up.set()
        try:
            await self.stop.wait()
        finally:
            for runner in runners:
                await runner.cleanup()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join()
        self.loop.close()


async def filter_latency(server: Server, begun: threading.Event) -> tuple[float, float, float]:
    """A filter alone (median ms), a filter sent once a scrape's collection
    has begun (median ms), and that scrape's wall time (median ms)."""
    names = [f"bench-{n:04d}" for n in range(0, NODES, NODES // OFFERED + 1)][:OFFERED]
    body = json.dumps({"Pod": pod_doc(99999), "NodeNames": names})
    alone: list[float] = []
    during: list[float] = []
    scrapes: list[float] = []
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as s:
        ext_url = f"http://127.0.0.1:{server.ports[0]}/filter"
        met_url = f"http://127.0.0.1:{server.ports[1]}/metrics"

        async def one_filter() -> float:
            t = time.perf_counter()
            async with s.post(ext_url, data=body) as r:
                assert r.status == 200, await r.text()
                await r.read()
            return time.perf_counter() - t

        async def one_scrape() -> float:
            t = time.perf_counter()
            async with s.get(met_url) as r:
                assert r.status == 200
                await r.read()
            return time.perf_counter() - t

        await one_filter()  # connections, the allocator's kept plans
        await one_scrape()
        for _ in range(REPEAT):
            alone.append(await one_filter())
            begun.clear()
            scrape = asyncio.create_task(one_scrape())
            await loop.run_in_executor(None, begun.wait)
            during.append(await one_filter())
            scrapes.append(await scrape)
    ms = 1000.0
    return (
        statistics.median(alone) * ms,
        statistics.median(during) * ms,
        statistics.median(scrapes) * ms,
    )


def scraper(metrics: Metrics) -> Callable[[], bytes]:
    """What the metrics port answers: `Metrics.exposition`, or before it
    (commit 96fa496 and older) `generate_latest` over the registry."""
    exposition: Callable[[], bytes] | None = getattr(metrics, "exposition", None)
    if exposition is not None:
        return exposition
    return lambda: generate_latest(metrics.registry)


def watched(metrics: Metrics, begun: threading.Event) -> None:
    """Sets `begun` as a scrape begins (before `Metrics.exposition`: as it
    starts collecting from the registry)."""
    exposition: Callable[[], bytes] | None = getattr(metrics, "exposition", None)
    if exposition is not None:
        scrape = exposition

        def beginning() -> bytes:
            begun.set()
            return scrape()

        setattr(metrics, "exposition", beginning)  # noqa: B010 (a method replaced)
        return
    collect = metrics.registry.collect

    def collecting() -> Iterator[Metric]:
        begun.set()
        yield from collect()

    setattr(metrics.registry, "collect", collecting)  # noqa: B010 (a method replaced)


def measure(pods: int) -> dict[str, Any]:
    state = build(pods)
    metrics = Metrics(state)
    first = time.thread_time()
    scraper(metrics)()
    first = time.thread_time() - first
    wall, cpu, body = timed(scraper(metrics))
    series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    begun = threading.Event()
    watched(metrics, begun)
    server = Server(state, metrics)
    try:
        alone, during, scrape = asyncio.run(filter_latency(server, begun))
    finally:
        server.close()
    for i in range(pods, pods + BINDS):
        assert state.allocator.place(pod_request(pod_doc(i))).allocation is not None
    after = time.thread_time()
    scraper(metrics)()
    after = time.thread_time() - after
    return {
        "pods": pods,
        "series": series,
        "bytes": len(body),
        "wall_ms": wall * 1000,
        "cpu_ms": cpu * 1000,
        "first_cpu_ms": first * 1000,
        "after_binds_cpu_ms": after * 1000,
        "filter_ms": alone,
        "filter_during_ms": during,
        "scrape_http_ms": scrape,
    }


def table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| pods | series | exposition | scrape wall | scrape CPU | first scrape CPU "
        f"| CPU after {BINDS} binds | filter alone | filter during a scrape "
        "| the scrape over HTTP then |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['pods']:,} | {r['series']:,} | {r['bytes'] / 1e6:.1f} MB "
            f"| {r['wall_ms']:.0f} ms | {r['cpu_ms']:.0f} ms | {r['first_cpu_ms']:.0f} ms "
            f"| {r['after_binds_cpu_ms']:.0f} ms | {r['filter_ms']:.1f} ms "
            f"| {r['filter_during_ms']:.1f} ms | {r['scrape_http_ms']:.0f} ms |"
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pods", default="0,1000,8000", help="pod counts, comma-separated")
    args = p.parse_args()
    rows = [measure(int(n)) for n in args.pods.split(",")]
    print(f"{NODES:,} nodes x 8 GPUs; best of {REPEAT} scrapes, median of {REPEAT} filters")
    print("\n".join(table(rows)))


if __name__ == "__main__":
    main()
