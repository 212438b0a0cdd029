"""Waking the pods the extender's filter refused to wait for another pod.

A pod refused by the bind rule (`ClusterState.ambiguity`: its node has a
not-started pod with a same-sized container on other GPUs) is Unschedulable
in kube-scheduler, which tries it again on an update of the pod itself, on
events of its own plugins' kinds, or when it flushes pods unschedulable for
5 minutes: not when the pod it waits for starts.  So the extender remembers
the pods it refused for that reason (`ClusterState.wait_for`) and, when the
pod they wait for starts a container, ends, or goes (`ClusterState` sees it
in its pod watch), `Waker` updates each of them: a merge patch of its
`gpuvisor.io/woken` annotation, which moves it back to kube-scheduler's
queue.

Only pods the extender refused are patched, each only while it is the same
pod (uid), not bound and not being deleted, with its resourceVersion as a
precondition; at most RATE patches a second, one at a time, in a thread of
its own (never in a verb).

What became of each pod handed to it is counted (`WakeCounters`, on the
extender's metrics port): woken, not patched and why (`SKIPPED`), or
failed (an API error; kube-scheduler's 5-minute flush still comes)."""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger("gpuvisor.scheduler")

WOKEN = "gpuvisor.io/woken"
RATE = 20.0  # patches a second at most
ATTEMPTS = 3  # reads and patches of one pod that lost to another update
API_TIMEOUT = 10.0
# why a pod handed to the waker was not patched (the `reason` label)
SKIPPED = {
    "gone": "the pod no longer exists",
    "replaced": "a pod of another uid has its name",
    "bound": "the pod is bound to a node by now",
    "deleting": "the pod is being deleted",
    "changed": f"the pod changed {ATTEMPTS} times while being woken",
}


@dataclass(frozen=True)
class WakeCounters:
    """The waker's Prometheus counters."""

    woken: Counter
    skipped: Counter  # label reason: a key of SKIPPED
    failed: Counter

    @classmethod
    def register(cls, registry: CollectorRegistry) -> WakeCounters:
        counters = cls(
            woken=Counter(
                "gpuvisor_scheduler_pods_woken",
                "Pods filter refused until another pod started, woken (their "
                f"{WOKEN} annotation patched) when it did",
                registry=registry,
            ),
            skipped=Counter(
                "gpuvisor_scheduler_wakes_skipped",
                "Pods to wake left unpatched, by reason (gone, replaced, bound, deleting, changed)",
                ["reason"],
                registry=registry,
            ),
            failed=Counter(
                "gpuvisor_scheduler_wakes_failed",
                "Pods to wake whose read or patch failed (an API error)",
                registry=registry,
            ),
        )
        for reason in SKIPPED:
            counters.skipped.labels(reason)  # each reason shows from the start, at 0
        return counters


@dataclass(frozen=True)
class Wake:
    """Wake the pod `key` (uid `uid`): the pod it waited for did `why`."""

    key: str
    uid: str
    why: str


class Waker:
    """Patches the pods handed to `wake`, in a daemon thread, RATE a second."""

    def __init__(self, core: Any, counters: WakeCounters | None = None, rate: float = RATE) -> None:
        self.core = core  # kubernetes.client.CoreV1Api
        self.counters = counters
        self.interval = 1.0 / rate
        self._queue: queue.SimpleQueue[Wake | None] = queue.SimpleQueue()
        self._pending: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self.woken = 0  # pods patched
        self._thread = threading.Thread(target=self._run, name="wake", daemon=True)
        self._thread.start()

    def wake(self, w: Wake) -> None:
        """Queue a pod to wake (no I/O: callable with ClusterState's lock held)."""
        with self._lock:
            if (w.key, w.uid) in self._pending:
                return
            self._pending.add((w.key, w.uid))
        self._queue.put(w)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(5.0)

    def _run(self) -> None:
        last = 0.0
        while True:
            w = self._queue.get()
            if w is None:
                return
            with self._lock:
                self._pending.discard((w.key, w.uid))
            pause = last + self.interval - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            last = time.monotonic()
            try:
                skipped = self._patch(w)
            except Exception as exc:  # the 5-minute flush still comes
                log.warning("pod %s: cannot wake it: %s", w.key, exc)
                if self.counters is not None:
                    self.counters.failed.inc()
                continue
            if skipped is None:
                self.woken += 1
                if self.counters is not None:
                    self.counters.woken.inc()
            elif self.counters is not None:
                self.counters.skipped.labels(skipped).inc()

    def _patch(self, w: Wake) -> str | None:
        """Patch the pod: None once woken, else why not (a key of SKIPPED)."""
        from kubernetes.client.exceptions import ApiException

        namespace, name = w.key.split("/", 1)
        for _ in range(ATTEMPTS):
            try:
                raw = self.core.read_namespaced_pod(
                    name, namespace, _preload_content=False, _request_timeout=API_TIMEOUT
                )
            except ApiException as exc:
                if exc.status == 404:
                    return "gone"
                raise
            pod = json.loads(raw.data)
            meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
            if meta.get("uid") != w.uid:
                return "replaced"
            if spec.get("nodeName"):
                return "bound"
            if meta.get("deletionTimestamp"):
                return "deleting"
            stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            try:
                self.core.patch_namespaced_pod(
                    name,
                    namespace,
                    {
                        "metadata": {
                            "uid": w.uid,
                            "resourceVersion": meta["resourceVersion"],
                            "annotations": {WOKEN: f"{stamp} {w.why}"},
                        }
                    },
                    _preload_content=False,
                    _request_timeout=API_TIMEOUT,
                )
            except ApiException as exc:
                if exc.status == 409:  # updated meanwhile: read it again
                    continue
                if exc.status == 404:
                    return "gone"
                raise
            log.info("pod %s: woken (%s)", w.key, w.why)
            return None
        log.warning(
            "pod %s: changed %d times while being woken; left to kube-scheduler", w.key, ATTEMPTS
        )
        return "changed"
