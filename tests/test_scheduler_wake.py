"""The extender's waker (cluster/scheduler/wake.py) against a real
kube-apiserver: it patches the `gpuvisor.io/woken` annotation of the pod
it is handed, and of no other: not one of another uid (deleted and made
again under its name), not a bound one, not a missing one."""

from __future__ import annotations

import time

from gpuvisor.cluster.scheduler.wake import WOKEN, Wake, Waker

from tests.k8s_cluster import KubeTest, must


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
    waker = Waker(k.core)
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
