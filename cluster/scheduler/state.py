"""The extender's view of the cluster: the allocator fed from the Kubernetes API.

Nodes come from their `gpuvisor.io/node-inventory` annotation (published by
the device plugin); reservations from pods' `gpuvisor.io/allocation`
annotations (`Allocator.restore`), so a restarted extender rebuilds them.  A
pod's reservation is released when the pod is deleted or has finished.
Two watches (Nodes, Pods) keep this current; a watch that expires (410
Gone) is replaced by a fresh list of its kind that reconciles what it
missed, in the watch's own thread.

The pods' status tells which containers kubelet has started; `took` uses it
to refuse a placement that the device plugin could confuse with another
pod's (`Ambiguous`, see `ambiguity`).  The pods filter refused for that
reason (`wait_for`) are handed to `wake` when the pod they wait for starts
the container, ends or holds its GPUs no more (cluster/scheduler/wake.py).

`lock` guards only the bookkeeping of which pods are accounted (a dict
update next to an allocator call that itself takes one node's lock); it is
never held across a decision or any I/O.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gpuvisor.cluster.allocation import ANNOTATION, Allocation, ContainerGrant, load_allocation
from gpuvisor.cluster.allocator import Allocator, Config, Conflict, Decision
from gpuvisor.cluster.deviceplugin.handover import unlisted
from gpuvisor.cluster.deviceplugin.publish import NODE_INVENTORY
from gpuvisor.cluster.deviceplugin.within import beyond_request
from gpuvisor.cluster.inventory_model import DocumentError, Inventory, load_inventory
from gpuvisor.cluster.request import PodRequest, pod_request

from .wake import Wake

log = logging.getLogger("gpuvisor.scheduler")

FINISHED = ("Succeeded", "Failed")
# A pod's room assumed at prioritize is released if no bind comes by then
# (kube-scheduler chose a node no extender verb saw, or gave the pod up).
ASSUME_SECONDS = 30.0
WATCH_SECONDS = 300  # a watch is renewed (from its resourceVersion) this often
# A pod refused to wait for another is forgotten after this long unwoken
# (kube-scheduler flushes it back to its queue after 5 minutes anyway, and
# filter remembers it again if it still waits).
WAIT_SECONDS = 600.0


@dataclass(frozen=True)
class Waiter:
    """A pod filter refused until another pod's `container` starts."""

    uid: str
    container: str
    since: float  # monotonic


@dataclass
class Held:
    uid: str
    node: str


@dataclass(frozen=True)
class Seen:
    """A pod's status, as the last event showed it."""

    uid: str
    pending: bool  # phase Pending: the device plugin steers by its placement
    started: frozenset[str]  # the containers kubelet reports started
    node: str = ""  # spec.nodeName: "" while not bound


class Ambiguous(RuntimeError):
    """A placement the device plugin could not tell from another pod's.

    `gpus`: the GPU sets (UUIDs) of the other pods' containers it clashes
    with, so that bind may try again on exactly those."""

    def __init__(
        self, message: str, gpus: set[frozenset[str]], blocker: tuple[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.gpus = gpus
        self.blocker = blocker  # the (pod, container) it waits for, where one


def started_containers(pod: Any) -> frozenset[str]:
    """The names of the containers (init ones too) kubelet reports as
    started: running, terminated, or restarted at least once."""
    status = pod.status
    if status is None:
        return frozenset()
    out = set()
    for cs in (status.init_container_statuses or []) + (status.container_statuses or []):
        state, last = cs.state, cs.last_state
        if (
            (state is not None and (state.running is not None or state.terminated is not None))
            or (cs.restart_count or 0) > 0
            or (last is not None and last.terminated is not None)
        ):
            out.add(str(cs.name))
    return frozenset(out)


def _signature(c: ContainerGrant) -> tuple[int, frozenset[str]]:
    return len(c.gpus), frozenset(g.uuid for g in c.gpus)


def _limits(c: ContainerGrant) -> tuple[object, ...]:
    """What the device plugin writes into the limits file of a container
    on these GPUs, beside its pod's and its own name."""
    gpus = sorted(((g.uuid, g.memory_mib, g.cores, g.mig) for g in c.gpus), key=lambda t: t[0])
    return tuple(gpus), c.sm_policy, c.priority


def _unlisted_inits(allocation: Allocation) -> list[ContainerGrant]:
    """The plain init containers with GPUs whose devices kubelet lists for
    no container in PodResources (handover.unlisted)."""
    return [
        c for c in allocation.containers if c.gpus and c.plain_init and unlisted(allocation, c.name)
    ]


class ClusterState:
    def __init__(self, core: Any, config: Config | None = None) -> None:
        self.core = core  # kubernetes.client.CoreV1Api
        self.allocator = Allocator(config=config)
        self.lock = threading.Lock()
        self.inventories: dict[str, str] = {}  # node -> annotation text accounted
        self.held: dict[str, Held] = {}  # pod key -> whose reservation the allocator holds
        # pods held by assume() and not bound yet: pod key -> when (monotonic)
        self.assumed: dict[str, float] = {}
        # the request, the room, and the node's inventory it was planned on
        self.assumed_for: dict[str, tuple[PodRequest, Allocation, Inventory | None]] = {}
        self._swept = 0.0
        # allocations of pods whose node has no inventory yet: node -> pod -> allocation
        self.waiting: dict[str, dict[str, Allocation]] = {}
        # what the pods' status says of the pods with an allocation
        self.pods: dict[str, Seen] = {}
        # pods refused until another starts: its key -> waiting pod key -> Waiter
        self.blocked: dict[str, dict[str, Waiter]] = {}
        self._waiters_swept = 0.0
        # called (with `lock` held: it must not block) for each waiting pod to wake
        self.wake: Callable[[Wake], None] | None = None
        # node -> a count that moves whenever what `pods` says of a pod held
        # there changes (a container started): with the node's allocator
        # version (which moves whenever a pod is held or released there),
        # it dates what `_unstarted` answers for the node
        self.epochs: dict[str, int] = {}
        self.ready = threading.Event()
        self.stopping = threading.Event()

    # ---- nodes ----------------------------------------------------------

    def node_event(self, node: Any, deleted: bool = False) -> None:
        name = node.metadata.name
        text = (node.metadata.annotations or {}).get(NODE_INVENTORY)
        with self.lock:
            if deleted or text is None:
                self._forget_node(name)
                return
            if self.inventories.get(name) == text:
                return
            try:
                inv = load_inventory(json.loads(text), f"node {name}: {NODE_INVENTORY}")
                if inv.node != name:
                    raise DocumentError(f"node {name}: {NODE_INVENTORY}: names node {inv.node!r}")
            except (ValueError, DocumentError) as exc:
                log.warning("%s", exc)  # json errors are ValueErrors too
                return
            dropped = self.allocator.replace_node(inv)
            for key in dropped:
                self.held.pop(key, None)
                log.warning("pod %s: its allocation names GPUs node %s no longer has", key, name)
            self.inventories[name] = text
            for key, allocation in self.waiting.pop(name, {}).items():
                self._restore(key, allocation)
            log.info("node %s: inventory of %d GPUs", name, len(inv.gpus))

    def _forget_node(self, name: str) -> None:
        """Node `name` was deleted or lost its inventory (with `lock` held):
        its reservations leave the allocator, and those of its pods wait for
        its inventory again (`waiting`, as a pod bound to a node not seen
        yet does).  A node that comes back (kubelet registers it again, its
        device plugin publishes again) then holds its pods' GPUs before it
        takes another pod; forgotten, they would be taken again only at
        their pods' next event, and a pod that changes no more would have
        its GPUs handed out twice."""
        if name in self.allocator.nodes:
            pods = self.waiting.setdefault(name, {})
            for allocation in self.allocator.allocations(name):
                if allocation.pod in self.held:
                    pods[allocation.pod] = allocation
            if not pods:
                del self.waiting[name]
        if self.allocator.remove_node(name):
            log.info("node %s: gone or without an inventory; forgotten", name)
        self.inventories.pop(name, None)
        for key in [k for k, h in self.held.items() if h.node == name]:
            del self.held[key]

    # ---- pods -----------------------------------------------------------

    def pod_event(self, pod: Any, deleted: bool = False) -> None:
        meta = pod.metadata
        key = f"{meta.namespace}/{meta.name}"
        with self.lock:
            self._pod_event(pod, key, deleted)
            if key in self.blocked:
                self._settle(key)

    def _pod_event(self, pod: Any, key: str, deleted: bool) -> None:
        meta = pod.metadata
        phase = pod.status.phase if pod.status else None
        text = (meta.annotations or {}).get(ANNOTATION)
        held = self.held.get(key)
        if deleted or phase in FINISHED:
            if held is not None and held.uid == meta.uid:
                self._release(key)
            for pods in self.waiting.values():
                pods.pop(key, None)
            self._see(key, None)
            return
        if held is not None and held.uid != meta.uid:
            self._release(key)  # a pod of the same name replaced one we missed the end of
            held = None
        spec = pod.spec
        node = str((spec.node_name if spec is not None else None) or "")
        if held is not None or text is not None:
            pending = phase in (None, "Pending")
            self._see(key, Seen(meta.uid, pending, started_containers(pod), node))
        if held is not None and node and node == held.node and key in self.assumed:
            # bound where its room is, by a bind whose answer never came
            # (`unsure`): the room is the pod's now, not an assumption
            del self.assumed[key]
            self.assumed_for.pop(key, None)
        if held is not None or text is None:
            return
        try:
            allocation = load_allocation(text, f"pod {key}: {ANNOTATION}")
        except DocumentError as exc:
            log.warning("%s", exc)
            return
        if allocation.pod != key or (allocation.uid and allocation.uid != meta.uid):
            log.warning("pod %s: %s belongs to %s; ignored", key, ANNOTATION, allocation.pod)
            return
        # The annotation is writable by whoever may edit the pod: only a
        # bound pod's record on its own node, within its own requests, is
        # a reservation (the Binding writes the record and the node at once)
        if node != allocation.node:
            if node:
                log.warning(
                    "pod %s: %s places it on %s, but it is bound to %s; ignored",
                    key,
                    ANNOTATION,
                    allocation.node,
                    node,
                )
            return
        why = self._beyond(pod, key, allocation)
        if why is not None:
            log.warning("pod %s: %s; not taken as a reservation", key, why)
            return
        if allocation.node not in self.inventories:
            self.waiting.setdefault(allocation.node, {})[key] = allocation
            return
        self._restore(key, allocation)

    def _see(self, key: str, seen: Seen | None) -> None:
        """Record (None: forget) what the pod's status says.  With `lock` held."""
        if self.pods.get(key) == seen:
            return
        if seen is None:
            del self.pods[key]
        else:
            self.pods[key] = seen
        held = self.held.get(key)
        if held is not None:
            self.epochs[held.node] = self.epochs.get(held.node, 0) + 1

    def epoch(self, node: str) -> int:
        """`epochs[node]`: moves when a pod held there starts a container."""
        return self.epochs.get(node, 0)

    def _beyond(self, pod: Any, key: str, allocation: Allocation) -> str | None:
        """Why the pod's record grants more than the pod asks for, or None
        (`within.beyond_request`).  With `lock` held."""
        from kubernetes.client import ApiClient

        from .api_view import ApiView

        manifest: Any = (
            pod.raw if isinstance(pod, ApiView) else ApiClient().sanitize_for_serialization(pod)
        )
        try:
            request = pod_request(manifest)
        except DocumentError as exc:
            return str(exc)
        node = self.allocator.nodes.get(allocation.node)
        memory = {g.uuid: g.memory_mib for g in node.inv.gpus} if node is not None else {}
        why: str | None = beyond_request(
            allocation.containers, request, memory.get, node is not None
        )
        return why

    def _restore(self, key: str, allocation: Allocation) -> None:
        try:
            self.allocator.restore(allocation, f"pod {key}: {ANNOTATION}")
        except DocumentError as exc:
            log.warning("%s", exc)
            return
        self.held[key] = Held(allocation.uid, allocation.node)

    def _release(self, key: str, settle: bool = True) -> None:
        self.assumed.pop(key, None)
        self.assumed_for.pop(key, None)
        self.held.pop(key, None)
        self.pods.pop(key, None)
        self.allocator.release(key)
        if settle and key in self.blocked:
            self._settle(key)

    # ---- pods waiting for others to start ----------------------------------

    def _blocks(self, key: str, container: str) -> bool:
        """Whether pod `key` still holds GPUs with `container` not started
        (as `_unstarted` counts it).  With `lock` held."""
        held = self.held.get(key)
        if held is None:
            return False
        seen = self.pods.get(key)
        if seen is not None and held.uid and seen.uid != held.uid:
            seen = None
        return seen is None or (seen.pending and container not in seen.started)

    def wait_for(self, key: str, uid: str, blockers: Iterable[tuple[str, str]]) -> None:
        """Remember that filter refused pod `key` (uid) until each of the
        (pod, container) `blockers` starts; one that started meanwhile
        wakes it at once."""
        now = time.monotonic()
        with self.lock:
            if now - self._waiters_swept > 60.0:
                self._waiters_swept = now
                for blocker in list(self.blocked):
                    waiters = self.blocked[blocker]
                    for k in [k for k, w in waiters.items() if now - w.since > WAIT_SECONDS]:
                        del waiters[k]
                    if not waiters:
                        del self.blocked[blocker]
            for blocker, container in blockers:
                if self._blocks(blocker, container):
                    self.blocked.setdefault(blocker, {})[key] = Waiter(uid, container, now)
                elif self.wake is not None:
                    self.wake(Wake(key, uid, self._why(blocker, container)))

    def _settle(self, key: str) -> None:
        """Wake the pods waiting for pod `key` that it no longer holds back.
        With `lock` held."""
        waiters = self.blocked.get(key, {})
        for waiter, w in list(waiters.items()):
            if self._blocks(key, w.container):
                continue
            del waiters[waiter]
            if self.wake is not None:
                self.wake(Wake(waiter, w.uid, self._why(key, w.container)))
        if not waiters:
            self.blocked.pop(key, None)

    def _why(self, key: str, container: str) -> str:
        """Why pod `key` no longer holds back pods waiting for `container`."""
        seen = self.pods.get(key)
        if key not in self.held:
            return f"{key} holds no GPUs any more"
        if seen is not None and container in seen.started:
            return f"{key} started its container {container}"
        return f"{key} is running"

    # ---- bind's bookkeeping ------------------------------------------------

    def ambiguity(self, allocation: Allocation) -> Ambiguous | None:
        """Whether the device plugin could mistake this placement for another's.

        kubelet does not tell the device plugin which pod it admits, so the
        plugin's GetPreferredAllocation steers a container to the GPUs of a
        pod bound to the node and not started yet, with as many GPUs as
        asked, the oldest first (cluster/deviceplugin/preferred.py); kubelet
        may admit them in another order.  Two such containers of different
        pods with the same GPU count on different GPUs are then ambiguous:
        the pod admitted first may get the other's GPUs, and its start is
        refused.  The placement is ambiguous if one of its containers has as
        many GPUs as a container of another pod held on the node whose
        containers kubelet has not started (phase Pending, that container
        not running), but not the same GPUs.  Call with `lock` held.

        It is also ambiguous if it has a plain init container that kubelet
        lists for no container (`_init_rival`) on the GPUs of such an init
        container of another pod, not started, with other limits: that is
        not decided again elsewhere (the pod waits)."""
        rival = self._init_rival(allocation)
        if rival is not None:
            return rival
        mine = {_signature(c) for c in allocation.containers if c.gpus}
        counts = {n for n, _ in mine}
        clashes = [
            (other, c)
            for other, c in self._unstarted(allocation.node, counts, allocation.pod)
            if _signature(c) not in mine
        ]
        if not clashes:
            return None
        other, c = clashes[0]
        n = len(c.gpus)
        theirs = ",".join(sorted(g.uuid for g in c.gpus))
        ours = " or ".join(sorted(",".join(sorted(gpus)) for k, gpus in mine if k == n))
        message = (
            f"waits for pod {other.pod} on {allocation.node} to start its container {c.name}: "
            f"both pods have a {n}-GPU container, on different GPUs ({theirs}; this pod {ours}), "
            "and the device plugin cannot tell which of the two kubelet admits first"
        )
        return Ambiguous(message, {_signature(c)[1] for _, c in clashes})

    def _init_rival(self, allocation: Allocation) -> Ambiguous | None:
        """kubelet's PodResources lists no plain init container, so the
        device plugin knows one whose devices go to no listed container
        only by its own preference, and kubelet may admit pods in another
        order than it preferred.  With two such init containers of
        different pods bound to the node, on the same GPUs, with other
        limits, and neither started, it cannot tell whose limits a start is
        for and refuses both starts, again at every retry: neither pod ever
        started.  So such a placement waits for the other pod's init
        container to start.  With `lock` held."""
        mine = _unlisted_inits(allocation)
        if not mine:
            return None
        counts = {len(c.gpus) for c in mine}
        for other, c in self._unstarted(allocation.node, counts, allocation.pod):
            if not c.plain_init or not unlisted(other, c.name):
                continue
            for m in mine:
                if _signature(m) != _signature(c) or _limits(m) == _limits(c):
                    continue
                gpus = ",".join(sorted(_signature(c)[1]))
                message = (
                    f"waits for pod {other.pod} on {allocation.node} to start its container "
                    f"{c.name}: both pods have an init container on {gpus} with other limits "
                    "that kubelet's PodResources lists for neither, so the device plugin "
                    "cannot tell whose start kubelet asks for"
                )
                return Ambiguous(message, set(), (other.pod, c.name))
        return None

    def init_rival(self, allocation: Allocation) -> Ambiguous | None:
        """`_init_rival`, taking `lock`."""
        with self.lock:
            return self._init_rival(allocation)

    def unlisted_inits_on(self, node: str, counts: set[int], pod: str) -> bool:
        """Whether a pod other than `pod` held on node has a plain init
        container with a GPU count in `counts`, not started, that
        `_init_rival` could clash with (a look without a decision)."""
        with self.lock:
            return any(
                c.plain_init and unlisted(other, c.name)
                for other, c in self._unstarted(node, counts, pod)
            )

    def _unstarted(
        self, node: str, counts: set[int], pod: str
    ) -> list[tuple[Allocation, ContainerGrant]]:
        """The containers with a GPU count in `counts` of the pods other than
        `pod` held on node that kubelet has not started.  With `lock` held."""
        try:
            others = self.allocator.allocations(node)
        except KeyError:
            return []
        out: list[tuple[Allocation, ContainerGrant]] = []
        for other in others:
            held = self.held.get(other.pod)
            if other.pod == pod or held is None:
                continue
            seen = self.pods.get(other.pod)
            if seen is not None and held.uid and seen.uid != held.uid:
                seen = None
            if seen is not None and not seen.pending:
                continue  # Running: the device plugin no longer steers by it
            # not seen yet (bound a moment ago): nothing started
            started = seen.started if seen is not None else frozenset()
            out.extend(
                (other, c)
                for c in other.containers
                if len(c.gpus) in counts and c.name not in started
            )
        return out

    def unstarted(
        self, node: str, counts: set[int], pod: str
    ) -> list[tuple[str, str, frozenset[str]]]:
        """`_unstarted` as (pod, container, GPU UUIDs), taking `lock`."""
        with self.lock:
            return [
                (other.pod, c.name, _signature(c)[1])
                for other, c in self._unstarted(node, counts, pod)
            ]

    def took(self, key: str, uid: str, node: str, decision: Decision) -> Allocation:
        """Commit the decision (Conflict if it lost a race, Ambiguous if the
        device plugin could mistake it for another pod's) and account the pod."""
        with self.lock:
            if decision.allocation is not None:
                clash = self.ambiguity(decision.allocation)
                if clash is not None:
                    raise clash
            allocation = self.allocator.commit(decision)
            self.held[key] = Held(uid, node)
            return allocation

    def claim(self, key: str, uid: str, node: str, req: PodRequest) -> Allocation | None:
        """The room prioritize assumed for the pod, now its bind's: if it is
        this pod's (uid), on node, for the same request, on the node's
        inventory as it was then (not on a GPU turned unhealthy since, nor
        on a MIG slice since in use by something else), and still not
        ambiguous; None otherwise (bind then decides again).  Dropping it
        to decide again let the next pod's filter take its room meanwhile,
        and the bind then failed (make bench-cluster)."""
        with self.lock:
            held = self.held.get(key)
            if key not in self.assumed or held is None or held.uid != uid or held.node != node:
                return None
            placed = self.assumed_for.get(key)
            if placed is None or placed[0] != req:
                return None
            now = self.allocator.nodes.get(node)
            if now is None or (now.inv is not placed[2] and now.inv != placed[2]):
                return None
            allocation = placed[1]
            if self.ambiguity(allocation) is not None:
                return None
            del self.assumed[key]
            del self.assumed_for[key]
            return allocation

    def unsure(
        self, key: str, uid: str, node: str, req: PodRequest, allocation: Allocation
    ) -> bool:
        """The pod's Binding to node was sent and no answer came (a timeout,
        a connection lost, the API server's 504): it may have been written.
        True if the pod's watch showed it bound there already; else its room
        stays held as if prioritize had assumed it (`assume`): the pod's
        watch showing it bound makes the room the pod's, and its next
        scheduling cycle (filter), its end or ASSUME_SECONDS release it.
        Released at once, a Binding written after all left the pod on its
        GPUs with nothing reserved: its event, come before the answer's
        timeout, had found the room held and changed nothing."""
        with self.lock:
            held = self.held.get(key)
            if held is None or held.uid != uid or held.node != node:
                return False  # not this bind's room any more: nothing to keep
            seen = self.pods.get(key)
            if seen is not None and seen.uid == uid and seen.node == node:
                self.assumed.pop(key, None)
                self.assumed_for.pop(key, None)
                return True
            now = self.allocator.nodes.get(node)
            self.assumed[key] = time.monotonic()
            self.assumed_for[key] = (req, allocation, now.inv if now is not None else None)
            return False

    def drop(self, key: str, settle: bool = True) -> None:
        """Forget a pod's reservation (its bind failed, or is done again:
        `settle` False, the pods waiting for it keep waiting)."""
        with self.lock:
            self.assumed.pop(key, None)
            self.assumed_for.pop(key, None)
            if key in self.held:
                self._release(key, settle)

    def assume(self, key: str, uid: str, decision: Decision) -> bool:
        """Hold the room a decision takes before kube-scheduler binds the pod
        (its binds run after its cycle, so the next pods' filters would find
        the room free and their binds fail).  Not for a pod that holds
        anything already, nor for an ambiguous placement (`ambiguity`: bind
        places it on the other pod's GPUs or refuses it); a lost race holds
        nothing.  Released by the bind
        (which decides again), by filter deciding the pod again, by the
        pod's end, or after ASSUME_SECONDS."""
        now = time.monotonic()
        with self.lock:
            self._expire(now)
            if key in self.held or decision.allocation is None:
                return False
            if self.ambiguity(decision.allocation) is not None:
                return False  # bind places it elsewhere, or refuses it
            try:
                self.allocator.commit(decision)
            except Conflict:
                return False
            self.held[key] = Held(uid, decision.allocation.node)
            self.assumed[key] = now
            self.assumed_for[key] = (decision.pod, decision.allocation, decision.inventory)
            return True

    def unassume(self, key: str) -> None:
        """Release the pod's assumed room, if that is what it holds (and
        any pod's assumed longer than ASSUME_SECONDS)."""
        with self.lock:
            self._expire(time.monotonic())
            self.assumed_for.pop(key, None)
            if self.assumed.pop(key, None) is not None and key in self.held:
                self._release(key)

    def _expire(self, now: float) -> None:
        if now - self._swept < 1.0:
            return
        self._swept = now
        for key in [k for k, t in self.assumed.items() if now - t > ASSUME_SECONDS]:
            del self.assumed[key]
            self.assumed_for.pop(key, None)
            if key in self.held:
                log.info(
                    "pod %s: assumed for %.0f s and never bound; released", key, ASSUME_SECONDS
                )
                self._release(key)

    # ---- syncing with the API server -----------------------------------

    def sync(self) -> tuple[str, str]:
        """List Nodes and Pods and reconcile; returns their resourceVersions."""
        return self.sync_nodes(), self.sync_pods()

    def sync_nodes(self) -> str:
        """List Nodes and reconcile (a node not listed is gone); returns the
        list's resourceVersion."""
        from .api_view import listed

        nodes = listed(self.core.list_node)
        names = set()
        for node in nodes.items:
            names.add(node.metadata.name)
            self.node_event(node)
        for gone in set(self.inventories) - names:
            with self.lock:
                self._forget_node(gone)
        return str(nodes.metadata.resource_version)

    def sync_pods(self) -> str:
        """List Pods and reconcile (a pod not listed is gone); returns the
        list's resourceVersion.  Only the pods' watch calls it once watching
        began: applied beside that watch's events, the list (older than
        they are) could take back a pod deleted meanwhile, or the end of its
        reconciling release one bound meanwhile."""
        from .api_view import listed

        # What was known before the list: only that can be missing from it
        # because it is gone (a pod bound by the extender while the list
        # was read is not in it, and is no less alive).
        with self.lock:
            held = dict(self.held)
            waiting = {n: dict(pods) for n, pods in self.waiting.items()}
        pods = listed(self.core.list_pod_for_all_namespaces)
        live = set()
        for pod in pods.items:
            live.add(f"{pod.metadata.namespace}/{pod.metadata.name}")
            self.pod_event(pod)
        with self.lock:
            for key in set(held) - live:
                if self.held.get(key) is held[key]:
                    self._release(key)
            for key in set(self.pods) - live - set(self.held):
                del self.pods[key]
            # Bound to a node without an inventory, and gone meanwhile.
            for node, was in waiting.items():
                now = self.waiting.get(node, {})
                for key in set(was) - live:
                    if now.get(key) is was[key]:
                        del now[key]
                if not now:
                    self.waiting.pop(node, None)
        return str(pods.metadata.resource_version)

    def start(self) -> list[threading.Thread]:
        """Sync once (ready after), then keep watching in two daemon threads."""
        node_rv, pod_rv = self.sync()
        self.ready.set()
        log.info(
            "synced: %d nodes with an inventory, %d pods holding GPUs",
            len(self.inventories),
            len(self.held),
        )
        return self.watch(node_rv, pod_rv)

    def watch(self, node_rv: str, pod_rv: str) -> list[threading.Thread]:
        """Watch Nodes and Pods from these resourceVersions (what `sync`
        returned) in two daemon threads, until `stopping` is set (a watch
        ends within WATCH_SECONDS of it)."""
        threads = [
            threading.Thread(
                target=self._watch,
                args=(self.core.list_node, self.node_event, node_rv),
                name="watch-nodes",
                daemon=True,
            ),
            threading.Thread(
                target=self._watch,
                args=(self.core.list_pod_for_all_namespaces, self.pod_event, pod_rv),
                name="watch-pods",
                daemon=True,
            ),
        ]
        for t in threads:
            t.start()
        return threads

    def _watch(self, lister: Any, handle: Callable[..., None], rv: str) -> None:
        from kubernetes.client.exceptions import ApiException

        from .api_view import RawWatch, view

        while not self.stopping.is_set():
            w = RawWatch()
            try:
                for event in w.stream(lister, resource_version=rv, timeout_seconds=WATCH_SECONDS):
                    obj = view(event["object"])
                    if event["type"] == "ERROR":
                        raise ApiException(status=getattr(obj, "code", 410) or 410)
                    rv = obj.metadata.resource_version
                    handle(obj, deleted=event["type"] == "DELETED")
                    if self.stopping.is_set():
                        break
            except ApiException as exc:
                if exc.status == 410:  # expired: list again
                    log.info("watch expired; listing again")
                    rv = self._relist(lister)
                else:
                    log.warning("watch failed: %s", exc)
                    self.stopping.wait(1.0)
            except Exception as exc:
                log.warning("watch failed: %s", exc)
                self.stopping.wait(1.0)
            finally:
                w.stop()

    def _relist(self, lister: Any) -> str:
        """The watch of `lister`'s kind expired: that kind is listed again
        (by its own watch's thread, so that list and events come in order)."""
        return self.sync_nodes() if lister == self.core.list_node else self.sync_pods()
