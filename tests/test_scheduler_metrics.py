"""The extender's cluster metrics (cluster/scheduler/metrics.py,
docs/kubernetes.md "Cluster metrics"): each node's samples are kept from
scrape to scrape and made again only when its state moved, so a scrape
after binds, releases, a republished inventory or a node gone must still
say what the allocator's state says; and a scrape is formatted off the
extender's event loop (server.py), so a filter sent while one is being
collected is answered before it ends.  And (server.py) no verb is answered
before the first sync: a restarted extender would place pods on GPUs whose
pods it has not listed yet."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import aiohttp
from aiohttp import web
from gpuvisor.cluster.deviceplugin.publish import NODE_INVENTORY
from gpuvisor.cluster.request import pod_request
from gpuvisor.cluster.scheduler.api_view import view
from gpuvisor.cluster.scheduler.extender import Extender
from gpuvisor.cluster.scheduler.metrics import FAMILIES, MIB, Families, Metrics, node_samples
from gpuvisor.cluster.scheduler.server import make_app, metrics_app
from gpuvisor.cluster.scheduler.state import ClusterState
from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from tests.inventories import ctr, mig_box, pcie_box, pod

MIG = {"nvidia.com/vgpu-mode": "mig"}
Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def publish(state: ClusterState, doc: dict[str, Any]) -> None:
    """The node watch delivers a Node with this inventory."""
    meta = {"name": doc["node"], "annotations": {NODE_INVENTORY: json.dumps(doc)}}
    state.node_event(view({"metadata": meta}))


def parsed(text: str) -> Series:
    out: Series = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in out, f"{key} exposed twice"
            out[key] = s.value
    return out


def cluster_part(series: Series) -> Series:
    return {k: v for k, v in series.items() if not k[0].startswith("gpuvisor_")}


def said_by_state(state: ClusterState) -> Series:
    """The device and container families, straight from the allocator."""
    out: Series = {}

    def put(name: str, value: float, **labels: str) -> None:
        out[(name, tuple(sorted(labels.items())))] = value

    for node, st in state.allocator.nodes.items():
        for i, g in enumerate(st.inv.gpus):
            dev = {"nodeid": node, "deviceuuid": g.uuid, "deviceidx": str(i), "zone": "vGPU"}
            put("GPUDeviceMemoryLimit", g.memory_mib * MIB, **dev)
            put("GPUDeviceCoreLimit", 100, **dev)
            put("GPUDeviceMemoryAllocated", st.mem[i] * MIB, devicecores=str(st.cores[i]), **dev)
            put("GPUDeviceCoreAllocated", st.cores[i], **dev)
            put("GPUDeviceSharedNum", st.slots[i], **dev)
        for a, _charge in st.pods.values():
            ns, name = a.pod.split("/", 1)
            for c in a.containers:
                for g in c.gpus:
                    who = {"podnamespace": ns, "podname": name, "containeridx": c.name}
                    who |= {"nodename": node, "deviceuuid": g.uuid, "zone": "vGPU"}
                    put("vGPUMemoryAllocated", g.memory_mib * MIB, **who)
                    put("vGPUCoreAllocated", g.cores, **who)
                    put(
                        "vGPUPodsDeviceAllocated",
                        g.memory_mib * MIB,
                        deviceusedcore=str(g.cores),
                        **who,
                    )
    return out


def without_mig(series: Series) -> Series:
    """The families `said_by_state` computes (MIG instances apart: checked
    against a fresh collector)."""
    return {k: v for k, v in series.items() if k[0] != "nodeGPUMigInstance"}


def fresh(state: ClusterState, metrics: Metrics) -> bytes:
    """prometheus-client's exposition of every node's samples made anew,
    then the extender's own metrics."""
    fams = {n: GaugeMetricFamily(n, text, labels=list(ls)) for n, text, ls in FAMILIES}
    for name, st in state.allocator.nodes.items():
        for fname, samples in node_samples(name, st)[2].items():
            fams[fname].samples.extend(samples)
    return generate_latest(Families(list(fams.values()))) + generate_latest(metrics.registry)


def check(state: ClusterState, metrics: Metrics) -> Series:
    text = metrics.exposition()
    assert text == fresh(state, metrics)
    got = cluster_part(parsed(text.decode()))
    assert without_mig(got) == said_by_state(state)
    return got


def test_the_metrics_follow_binds_releases_and_inventory_changes() -> None:
    state = ClusterState(core=None)
    metrics = Metrics(state)
    publish(state, pcie_box("n0", n=2))
    check(state, metrics)  # n0's samples kept from here on
    for i in range(3):
        d = state.allocator.place(pod_request(pod(f"p{i}", ctr(gpu=1, gpumem=1000, gpucores=20))))
        assert d.node == "n0", d.reasons
    check(state, metrics)
    publish(state, mig_box("m0", n=1, instances=[("1g.10gb", 6, True)]))
    check(state, metrics)
    mig = state.allocator.place(pod_request(pod("g", ctr(gpu=1, gpumem=9000), annotations=MIG)))
    assert mig.node == "m0", mig.reasons
    got = check(state, metrics)
    assert sum(v for k, v in got.items() if k[0] == "GPUDeviceSharedNum") == 3
    used = [k for k, v in got.items() if k[0] == "nodeGPUMigInstance" and v == 1]
    assert [dict(k[1])["nodeid"] for k in used] == ["m0"]

    assert state.allocator.release("default/p1")
    assert state.allocator.release("default/g")
    got = check(state, metrics)
    assert sum(v for k, v in got.items() if k[0] == "GPUDeviceSharedNum") == 2
    assert not any(dict(k[1]).get("podname") == "p1" for k in got)
    assert not any(k[0] == "nodeGPUMigInstance" and v == 1 for k, v in got.items())

    # republished with a third GPU: another NodeState, its pods charged again
    publish(state, pcie_box("n0", n=3))
    got = check(state, metrics)
    assert ("GPUDeviceSharedNum", (("deviceidx", "2"),)) not in got
    assert sum(1 for k in got if k[0] == "GPUDeviceCoreLimit") == 4

    state.node_event(view({"metadata": {"name": "m0", "annotations": {}}}), deleted=True)
    got = check(state, metrics)
    assert not any(dict(k[1]).get("nodeid") == "m0" for k in got)


class Stalled:
    """A collector that holds the scrape that reaches it until released."""

    def __init__(self) -> None:
        self.collecting = threading.Event()
        self.release = threading.Event()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        self.collecting.set()
        self.release.wait(20)
        yield GaugeMetricFamily("stalled", "held until released", value=1)


class NoBinder:
    async def close(self) -> None:
        pass


def test_a_filter_is_answered_while_a_scrape_is_being_collected() -> None:
    state = ClusterState(core=None)
    publish(state, pcie_box("n0", n=2))
    state.ready.set()  # synced
    metrics = Metrics(state)
    stalled = Stalled()
    metrics.registry.register(stalled)
    ext = Extender(state, core=None, binder=NoBinder())
    doc = pod("x", ctr(gpu=1, gpumem=1000, gpucores=20))
    doc["metadata"]["uid"] = "uid-x"

    async def run() -> None:
        runners, urls = [], []
        for app, path in ((make_app(ext, metrics), "filter"), (metrics_app(metrics), "metrics")):
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            urls.append(f"http://127.0.0.1:{port}/{path}")
        loop = asyncio.get_running_loop()
        try:
            async with aiohttp.ClientSession() as s:

                async def scrape() -> str:
                    async with s.get(urls[1]) as r:
                        assert r.status == 200
                        return await r.text()

                pending = asyncio.create_task(scrape())
                await loop.run_in_executor(None, stalled.collecting.wait)
                async with s.post(urls[0], json={"Pod": doc, "NodeNames": ["n0"]}) as r:
                    assert r.status == 200
                    assert (await r.json())["NodeNames"] == ["n0"]
                # answered while the scrape is still held in the collector
                assert not pending.done()
                assert not stalled.release.is_set()
                stalled.release.set()
                text = await pending
                assert "stalled 1.0" in text
                assert 'GPUDeviceCoreLimit{deviceidx="1"' in text
        finally:
            stalled.release.set()
            for runner in runners:
                await runner.cleanup()

    asyncio.run(run())


def test_the_verbs_wait_for_the_first_sync() -> None:
    """Started again, the extender serves its port before it has listed the
    pods that hold GPUs (and, mid-sync, with the Nodes' inventories but not
    yet their pods' reservations): a filter answered then would pass a GPU
    those pods hold, and a bind or prioritize would commit room on it.  Until
    the first sync is done every verb is refused with one line (kube-scheduler
    retries the pod); after it, the same filter is answered."""
    state = ClusterState(core=None)
    publish(state, pcie_box("n0", n=2))  # the Nodes listed, the pods not yet
    ext = Extender(state, core=None, binder=NoBinder())
    doc = pod("x", ctr(gpu=1, gpumem=1000, gpucores=20))
    doc["metadata"]["uid"] = "uid-x"
    bind = {"PodName": "x", "PodNamespace": "default", "PodUID": "uid-x", "Node": "n0"}
    not_ready = "gpuvisor: not ready: still listing the cluster's nodes and pods"

    async def run() -> None:
        runner = web.AppRunner(make_app(ext, Metrics(state)), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}"
        filter_args = {"Pod": doc, "NodeNames": ["n0"]}
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(f"{url}/filter", json=filter_args) as r:
                    assert r.status == 200
                    assert (await r.json())["Error"] == not_ready
                async with s.post(f"{url}/prioritize", json=filter_args) as r:
                    assert r.status == 503
                    assert (await r.json())["Error"] == not_ready
                async with s.post(f"{url}/bind", json=bind) as r:
                    assert r.status == 200
                    assert (await r.json())["Error"] == not_ready
                assert state.allocator.nodes["n0"].pods == {}  # nothing committed
                state.ready.set()
                async with s.post(f"{url}/filter", json=filter_args) as r:
                    assert r.status == 200
                    got = await r.json()
                    assert (got["NodeNames"], got["Error"]) == (["n0"], "")
        finally:
            await runner.cleanup()

    asyncio.run(run())
