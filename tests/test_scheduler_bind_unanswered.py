"""A Binding that gets no answer (cluster/scheduler/extender.py `_send`,
state.py `unsure`), against a real kube-apiserver reached through a proxy
that holds the answers back: the extender's client times out, whether or
not the API server wrote the Binding.

Written, the pod is bound with its allocation: its room must stay held (the
pod's watch event came before the timeout and found it held; released
then, nothing would take it back, and the next pod got the same GPU).  Not
written, the room stays held until the pod's next scheduling cycle, its
end, or 30 s, and kube-scheduler is told the bind may have happened."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import kubernetes.client
import pytest
from gpuvisor.cluster.allocation import ANNOTATION
from gpuvisor.cluster.allocator import Allocator, Config
from gpuvisor.cluster.deviceplugin.publish import NODE_INVENTORY
from gpuvisor.cluster.scheduler import state as state_mod
from gpuvisor.cluster.scheduler.binding import ApiError, Binder
from gpuvisor.cluster.scheduler.extender import Extender
from gpuvisor.cluster.scheduler.metrics import unanswered_counter
from gpuvisor.cluster.scheduler.state import ClusterState
from prometheus_client import CollectorRegistry

from tests.inventories import cluster, ctr, pcie_box, pod
from tests.k8s_cluster import KubeTest
from tests.scheduler_views import WHOLE_MIB, fits_on, held_on, wait_for
from tests.test_bind_ambiguity import Pods, v1pod

TIMEOUT = 1.0  # the extender's client waits this long for the Binding's answer


class SlowProxy:
    """A TCP proxy to the API server (TLS passes through it unopened).  At
    first it forwards both ways at once; then `delay` holds every answer
    back that many seconds, and `forward` False drops what the client sends
    (a request that never reaches the API server).  Set them once a
    connection is open, so that only requests are held, not its handshake."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.delay = 0.0
        self.forward = True
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
                server = socket.create_connection(self.upstream)
            except OSError:
                return
            self.sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            while data := src.recv(65536):
                if up and not self.forward:
                    continue
                if not up and self.delay:
                    time.sleep(self.delay)
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.close()


# slow(pod): (extender, proxy, node)
Slow = Callable[[str], tuple[Extender, SlowProxy, str]]


@pytest.fixture
def slow(k8s: KubeTest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Slow]:
    """Makes a one-GPU node, an extender on `k8s` whose Bindings go through
    a SlowProxy (its state watching the API server directly, stopped after
    the test) and a pending pod of the whole GPU: (extender, proxy, node)."""
    monkeypatch.setattr(state_mod, "WATCH_SECONDS", 2)
    made: list[tuple[ClusterState, list[threading.Thread], SlowProxy]] = []

    def make(pod: str) -> tuple[Extender, SlowProxy, str]:
        node = f"{pod}-{k8s.namespace}"
        k8s.create_node(node, annotations={NODE_INVENTORY: json.dumps(pcie_box(node, n=1))})
        config = k8s.core.api_client.configuration
        url = urlsplit(config.host)
        proxy = SlowProxy((url.hostname or "127.0.0.1", url.port or 443))
        through = copy.copy(config)
        through.host = f"https://127.0.0.1:{proxy.port}"
        state = ClusterState(k8s.core)
        made.append((state, state.start(), proxy))
        counter = unanswered_counter(CollectorRegistry())
        ext = Extender(state, core=k8s.core, binder=Binder(through, TIMEOUT), unanswered=counter)
        wait_for(lambda: node in state.inventories, what=f"{node}'s inventory")
        k8s.create_pod(pod, gpus=1, gpumem=WHOLE_MIB)
        return ext, proxy, node

    yield make
    for state, threads, proxy in made:
        state.stopping.set()
        proxy.close()
        for t in threads:
            t.join(timeout=10)


def bind(ext: Extender, proxy: SlowProxy, k: KubeTest, name: str, node: str, lose: bool) -> str:
    """The extender's bind of pod `name` to `node`, its answer held back
    (and with `lose`, its request dropped) by the proxy; the bind's Error.
    First a Binding of a pod that does not exist is answered 404, which
    opens the connection the bind then uses."""
    uid = k.read_pod(name).metadata.uid
    args = {"PodName": name, "PodNamespace": k.namespace, "PodUID": uid, "Node": node}
    absent = {"metadata": {"name": "absent"}, "target": {"kind": "Node", "name": node}}

    async def once() -> dict[str, Any]:
        binder: Binder = ext.binder
        try:
            with pytest.raises(ApiError) as no_such_pod:
                await binder.bind(k.namespace, "absent", absent)
            assert no_such_pod.value.status == 404
            proxy.delay = 3 * TIMEOUT
            proxy.forward = not lose
            answer: dict[str, Any] = await ext.bind(args)
            return answer
        finally:
            await binder.close()

    return str(asyncio.run(once())["Error"])


def counted(ext: Extender) -> dict[str, int]:
    """gpuvisor_scheduler_binds_unanswered_total by outcome."""
    assert ext.unanswered is not None
    return {
        s.labels["outcome"]: int(s.value)
        for m in ext.unanswered.collect()
        for s in m.samples
        if s.name.endswith("_total")
    }


def test_a_binding_written_but_not_answered_keeps_its_room(k8s: KubeTest, slow: Slow) -> None:
    k = k8s
    ext, proxy, node = slow("first")

    error = bind(ext, proxy, k, "first", node, lose=False)
    pod = k.read_pod("first")
    assert pod.spec.node_name == node, "the API server did not write the Binding"
    assert ANNOTATION in (pod.metadata.annotations or {})
    key = f"{k.namespace}/first"
    assert held_on(ext.state, node) == [key], "the bound pod's GPU was free for the next pod"
    assert not fits_on(ext.state, k, node)
    assert error == "", f"a pod bound as asked was answered {error!r}"
    assert counted(ext) == {"bound": 1, "kept": 0}
    # No longer an assumption that times out: still held after ASSUME_SECONDS.
    assert key not in ext.state.assumed


def test_a_binding_lost_keeps_its_room_until_the_pods_next_cycle(k8s: KubeTest, slow: Slow) -> None:
    ext, proxy, node = slow("lost")
    error = bind(ext, proxy, k8s, "lost", node, lose=True)
    assert not k8s.read_pod("lost").spec.node_name
    assert "may be bound all the same" in error, error
    assert counted(ext) == {"bound": 0, "kept": 1}
    key = f"{k8s.namespace}/lost"
    assert held_on(ext.state, node) == [key]
    assert not fits_on(ext.state, k8s, node)

    # kube-scheduler tries the pod again: its filter decides it afresh.
    doc = kubernetes.client.ApiClient().sanitize_for_serialization(k8s.read_pod("lost"))
    out = ext.filter({"Pod": doc, "NodeNames": [node]})
    assert out["NodeNames"] == [node], out
    assert held_on(ext.state, node) == []


class WrittenUnanswered:
    """A binder whose Binding the API server writes, and whose answer never
    comes (the in-memory API server of tests/test_bind_ambiguity.py)."""

    def __init__(self, pods: Pods) -> None:
        self.pods = pods

    async def bind(self, namespace: str, name: str, b: dict[str, Any]) -> None:
        await self.pods.bind(namespace, name, b)
        raise asyncio.TimeoutError


def test_a_bind_seen_after_its_timeout_keeps_its_room(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pod's watch event comes only after the bind gave up: the room,
    kept as an assumption, becomes the pod's, and does not expire."""
    state = ClusterState(core=None)
    state.allocator = Allocator.from_cluster(cluster(pcie_box("n0", n=1)), Config())
    pods = Pods()
    ext = Extender(state, core=pods, binder=WrittenUnanswered(pods))
    pods.add(pod("p", ctr(gpu=1, gpumem=WHOLE_MIB)))
    args = {"PodName": "p", "PodNamespace": "default", "PodUID": "uid-p", "Node": "n0"}
    error = str(asyncio.run(ext.bind(args))["Error"])
    assert "may be bound all the same" in error, error
    assert held_on(state, "n0") == ["default/p"]
    assert "default/p" in state.assumed

    state.pod_event(v1pod(pods.docs["p"]))  # bound, with its allocation
    assert "default/p" not in state.assumed
    monkeypatch.setattr(state_mod, "ASSUME_SECONDS", 0.0)
    state._swept = 0.0
    state.unassume("default/other")  # sweeps the assumptions past ASSUME_SECONDS
    assert held_on(state, "n0") == ["default/p"]
