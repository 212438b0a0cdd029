"""The extender's waker (cluster/scheduler/wake.py) against a real
kube-apiserver: it patches the `gpuvisor.io/woken` annotation of the pod
it is handed, and of no other: not one of another uid (deleted and made
again under its name), not a bound one, not a missing one; and its
counters (on the extender's metrics) say which was which."""

from __future__ import annotations

import time

import kubernetes.client
from gpuvisor.cluster.scheduler.metrics import Metrics
from gpuvisor.cluster.scheduler.state import ClusterState
from gpuvisor.cluster.scheduler.wake import SKIPPED, WOKEN, Wake, Waker
from prometheus_client import CollectorRegistry

from tests.k8s_cluster import KubeTest, free_port, must


def annotations_of(k: KubeTest, name: str) -> dict[str, str]:
    return dict(must(k.read_pod(name).metadata, "metadata").annotations or {})


def test_the_waker_patches_only_the_pod_it_was_handed(k8s: KubeTest) -> None:
    k = k8s
    k.create_node("wake-1")
    uid = {n: str(k.create_pod(n, gpus=1).metadata.uid) for n in ("waits", "bound", "again")}
    k.bind("bound", "wake-1")
    k.core.delete_namespaced_pod("again", k.namespace, grace_period_seconds=0)
    for _ in range(100):
        try:
            k.read_pod("again")
        except Exception:
            break
        time.sleep(0.05)
    k.create_pod("again", gpus=1)
    metrics = Metrics(ClusterState(k.core))
    waker = Waker(k.core, metrics.wake)
    try:
        key = f"{k.namespace}/%s"
        # one by one, in this order: the pod to wake comes last
        waker.wake(Wake(key % "bound", uid["bound"], "x/a started its container main"))
        waker.wake(Wake(key % "again", uid["again"], "x/a started its container main"))
        waker.wake(Wake(key % "gone", "no-such-uid", "x/a started its container main"))
        waker.wake(Wake(key % "waits", uid["waits"], "x/a started its container main"))
        k.wait_pod("waits", lambda p: WOKEN in (p.metadata.annotations or {}), what=WOKEN)
    finally:
        waker.stop()
    assert annotations_of(k, "waits")[WOKEN].endswith(" x/a started its container main")
    assert WOKEN not in annotations_of(k, "bound")
    assert WOKEN not in annotations_of(k, "again")
    assert waker.woken == 1
    counted = counters(metrics.registry)
    assert counted == {
        "woken": 1,
        "failed": 0,
        "skipped": {"gone": 1, "replaced": 1, "bound": 1, "deleting": 0, "changed": 0},
    }


def counters(registry: CollectorRegistry) -> dict[str, object]:
    """The waker's counters as a scrape reads them."""

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    return {
        "woken": value("gpuvisor_scheduler_pods_woken_total"),
        "failed": value("gpuvisor_scheduler_wakes_failed_total"),
        "skipped": {r: value("gpuvisor_scheduler_wakes_skipped_total", reason=r) for r in SKIPPED},
    }


def test_a_wake_the_api_server_does_not_answer_counts_as_failed() -> None:
    """A pod the waker cannot read (no API server there) is counted as a
    failed wake, not as woken nor skipped."""
    config = kubernetes.client.Configuration()
    config.host = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    config.retries = 0
    core = kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(config))
    metrics = Metrics(ClusterState(core))
    waker = Waker(core, metrics.wake)
    try:
        waker.wake(Wake("default/p", "some-uid", "x/a started its container main"))
        deadline = time.monotonic() + 30
        while counters(metrics.registry)["failed"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        waker.stop()
    assert counters(metrics.registry) == {
        "woken": 0,
        "failed": 1,
        "skipped": dict.fromkeys(SKIPPED, 0.0),
    }
