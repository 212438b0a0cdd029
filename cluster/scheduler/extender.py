"""The extender's three verbs, as kube-scheduler's HTTP extender protocol
(k8s.io/kube-scheduler/extender/v1) carries them, over the allocator.

- filter: the nodes (`NodeNames`, nodeCacheCapable) where the pod fits,
  with one line per node that cannot take it (`FailedNodes`), a node whose
  bind would wait for another pod to start (below) among them;
- prioritize: 0..10 per node: 10 for the allocator's choice, 1..9 by the
  node's usage for the others (binpack: fuller is better; spread: emptier);
- bind: take the room prioritize assumed (or decide again on the chosen
  node and commit the reservation), then create the Binding, which carries
  the pod's `gpuvisor.io/allocation` annotation (the API server copies it
  onto the pod as it binds it) and a resourceVersion precondition.
  Anything failing releases the
  reservation and answers an error, so kube-scheduler tries again.  A
  placement the device plugin could mistake for that of another pod on the
  node that has not started yet (a container with as many GPUs, on other
  GPUs: `ClusterState.ambiguity`) is decided again on that pod's GPUs, and
  refused if it does not fit there: the pod waits for the other to start.

filter and prioritize are plain functions, bind a coroutine; the server
runs them all on its event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
from gpuvisor.cluster.allocation import ANNOTATION, Allocation
from gpuvisor.cluster.allocator import Allocator, Conflict, Decision, NodeState
from gpuvisor.cluster.deviceplugin.publish import NODE_INVENTORY
from gpuvisor.cluster.inventory_model import DocumentError
from gpuvisor.cluster.request import PodRequest, pod_request
from prometheus_client import Counter

from .binding import ApiError
from .state import ASSUME_SECONDS, Ambiguous, ClusterState

log = logging.getLogger("gpuvisor.scheduler")

MAX_PRIORITY = 10  # kube-scheduler's MaxExtenderPriority
COMMIT_ATTEMPTS = 5
CACHE_SIZE = 1024  # filter's decisions kept for prioritize
CACHE_SECONDS = 30.0
# filter's waiting verdicts kept: request shapes (the oldest dropped), nodes
# per shape (all dropped past it)
VERDICT_SHAPES = 16
VERDICTS_PER_SHAPE = 8192
API_TIMEOUT = 10.0
# Offered more nodes than this, filter plans in full only the allocator's
# finalists: planning every node to explain it cost 87 ms at 1,000 nodes
# (34.8 ms at the 420 kube-scheduler offers), inside kube-scheduler's
# one-pod-at-a-time cycle, which took its throughput from 45.6 to 6.3
# pods/s (make bench-cluster).
EXPLAINED_NODES = 64
NOT_EXPLAINED = (
    f"no room for the pod (a quick check; the extender explains up to {EXPLAINED_NODES} "
    "of the nodes offered)"
)
NO_INVENTORY = f"no GPU inventory (the node has no {NODE_INVENTORY} annotation)"


# a node's waiting verdict for a request shape: the NodeState, its version
# and epoch it holds for, why the pod would wait (None: it would not) and
# the (pod, container) it would wait for
Verdict = tuple[NodeState, int, int, str | None, tuple[str, str] | None]


class Unanswered(RuntimeError):
    """A Binding sent that got no answer; the pod's room is kept (`_send`)."""


class BadRequest(ValueError):
    """The extender's arguments are not what kube-scheduler sends."""


def fields(args: Any) -> dict[str, Any]:
    """The arguments by lower-cased name: kube-scheduler's types carry no
    JSON tags, so it sends Go's field names (`Pod`, `NodeNames`, `PodName`)."""
    if not isinstance(args, Mapping):
        raise BadRequest("body: expected a JSON object")
    return {str(k).lower(): v for k, v in args.items()}


def node_names(args: Mapping[str, Any]) -> list[str]:
    names = args.get("nodenames")
    if isinstance(names, list):
        return [str(n) for n in names]
    nodes = args.get("nodes")
    if isinstance(nodes, Mapping) and isinstance(nodes.get("items"), list):
        return [str(n["metadata"]["name"]) for n in nodes["items"]]
    raise BadRequest("NodeNames: expected a list of node names (nodeCacheCapable: true)")


def the_pod(args: Mapping[str, Any]) -> Mapping[str, Any]:
    pod = args.get("pod")
    if not isinstance(pod, Mapping):
        raise BadRequest("Pod: expected a Pod object")
    return pod


def on_the_same_gpus(req: PodRequest, sets: set[frozenset[str]]) -> PodRequest | None:
    """req restricted to the GPUs of the containers it clashes with, when
    they are one set and the pod's own UUID filters allow them all; None
    otherwise (then the bind is refused)."""
    if len(sets) != 1:
        return None
    (gpus,) = sets
    if (req.use_uuids and not gpus <= set(req.use_uuids)) or gpus & set(req.nouse_uuids):
        return None
    return dataclasses.replace(req, use_uuids=tuple(sorted(gpus)))


class Extender:
    def __init__(
        self, state: ClusterState, core: Any, binder: Any, unanswered: Counter | None = None
    ) -> None:
        self.state = state
        # binds whose Binding got no answer, by outcome (metrics.py)
        self.unanswered = unanswered
        self.core = core  # kubernetes.client.CoreV1Api, for the pods bind reads
        self.binder = binder  # a Binder (binding.py), which writes the Bindings
        self._cache: OrderedDict[tuple[str, tuple[str, ...]], tuple[float, Decision]] = (
            OrderedDict()
        )
        self._cache_lock = threading.Lock()
        # request shape -> node -> (its state, version, epoch, why it waits
        # or None, for what)
        self._verdicts: dict[PodRequest, dict[str, Verdict]] = {}
        # the pods prioritize assumed room for, as kube-scheduler sent them:
        # key -> (uid, resourceVersion, request), for their binds
        self._sent: OrderedDict[str, tuple[str, str, PodRequest]] = OrderedDict()

    @property
    def allocator(self) -> Allocator:
        return self.state.allocator

    def _reason(self, why: str) -> str:
        return NO_INVENTORY if why == "unknown node" else why

    def _decide(self, req: PodRequest, names: Sequence[str], explain: bool) -> Decision:
        return self.allocator.decide(req, explain=explain, nodes=names)

    def _remember(self, uid: str, names: Sequence[str], d: Decision) -> None:
        with self._cache_lock:
            self._cache[(uid, tuple(names))] = (time.monotonic(), d)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)

    def _recall(self, uid: str, names: Sequence[str]) -> Decision | None:
        with self._cache_lock:
            hit = self._cache.get((uid, tuple(names)))
        if hit is None or time.monotonic() - hit[0] > CACHE_SECONDS:
            return None
        return hit[1]

    # ---- filter -----------------------------------------------------------

    def filter(self, body: Any) -> dict[str, Any]:
        args = fields(body)
        names = node_names(args)
        try:
            req = pod_request(the_pod(args))
        except DocumentError as exc:
            # the same for every node: nothing another node could resolve
            return {"NodeNames": [], "FailedAndUnresolvableNodes": {n: str(exc) for n in names}}
        # this pod's room assumed by an earlier cycle is decided again
        self.state.unassume(req.name)
        waits: list[tuple[str, str]] = []
        if len(names) <= EXPLAINED_NODES:
            d = self._decide(req, names, explain=True)
            fitting = [n for n in names if n not in d.reasons]
            failed = {n: self._reason(d.reasons[n]) for n in names if n in d.reasons}
            fitting = self._not_waiting(req, fitting, failed, waits)
            if d.node is not None and d.node not in fitting and fitting:
                # the choice waits: prioritize ranks (and assumes) another
                d = self._decide(req, fitting, explain=False)
        else:
            # The nodes where the bind would wait for another pod to start
            # are left out first (each node's verdict is kept until its
            # pods change, so this is a lookup per node), then the pod is
            # decided once among the others.  Binpack ranks the waiting
            # nodes (the fullest) first: leaving them out round by round,
            # planning each, cost 40 ms per filter once 1,000 pods were
            # bound and none started (make bench-cluster).
            failed = {}
            fitting = self._not_waiting(req, names, failed, waits)
            # The nodes the allocator planned in full (its finalists, the
            # chosen one among them), not every node the pod fits on: kube-
            # scheduler chooses among those, and prioritize ranks the
            # allocator's choice first.  The others are left out unnamed.
            d = self._decide(req, fitting, explain=False)
            failed.update((n, self._reason(why)) for n, why in d.reasons.items())
            fitting = list(d.score.get("finalists", [])) if d.node else []
            if d.node is None:
                # fits nowhere: the reasons of the first nodes, a quick
                # check's verdict for the rest
                shown = self._decide(req, names[:EXPLAINED_NODES], explain=True)
                failed.update((n, self._reason(why)) for n, why in shown.reasons.items())
                failed.update((n, NOT_EXPLAINED) for n in names if n not in failed)
        self._remember(req.uid, fitting, d)
        if waits and not fitting and req.uid:
            # Unschedulable for now: kube-scheduler would not try it again
            # when the pods it waits for start
            self.state.wait_for(req.name, req.uid, waits)
        return {"NodeNames": fitting, "FailedNodes": failed, "Error": ""}

    def _not_waiting(
        self,
        req: PodRequest,
        fitting: Sequence[str],
        failed: dict[str, str],
        waits: list[tuple[str, str]],
    ) -> list[str]:
        """The nodes of `fitting` where bind would not refuse the pod for
        now (the bind rule: `ClusterState.ambiguity`); the others go to
        `failed` with the pod they wait for, and that (pod, container) to
        `waits`.  A node counts as waiting if a
        not-started pod there has a container with as many GPUs as one of
        this pod's and this pod does not fit on exactly its GPUs."""
        counts = frozenset(c.count for c in req.containers if c.count)
        if not counts:
            return list(fitting)
        # the verdicts of a pod that holds room itself are its own (it is
        # no other pod's obstacle), the others' hold for any pod of the shape
        shape = None if req.name in self.state.held else dataclasses.replace(req, name="", uid="")
        nodes, epochs = self.allocator.nodes, self.state.epochs
        verdicts = self._verdicts_of(shape)
        out = []
        for n in fitting:
            st = nodes.get(n)
            if st is None or not st.pods:
                out.append(n)  # an unknown node (decide says so), or nothing on it to wait for
                continue
            hit = verdicts.get(n)
            if (
                hit is not None
                and hit[0] is st
                and hit[1] == st.version
                and hit[2] == epochs.get(n, 0)
            ):
                why, blocker = hit[3], hit[4]
            else:
                why, blocker = self._waits(req, verdicts, counts, n, st)
            if why is None:
                out.append(n)
            else:
                failed[n] = why
                if blocker is not None:
                    waits.append(blocker)
        return out

    def _verdicts_of(self, shape: PodRequest | None) -> dict[str, Verdict]:
        """The waiting verdicts kept for pods of this shape, by node (a
        throwaway dict for no shape)."""
        if shape is None:
            return {}
        with self._cache_lock:
            verdicts = self._verdicts.get(shape)
            if verdicts is None:
                if len(self._verdicts) >= VERDICT_SHAPES:
                    del self._verdicts[next(iter(self._verdicts))]
                verdicts = self._verdicts[shape] = {}
            return verdicts

    def _waits(
        self,
        req: PodRequest,
        verdicts: dict[str, Verdict],
        counts: frozenset[int],
        n: str,
        st: NodeState,
    ) -> tuple[str | None, tuple[str, str] | None]:
        """Why the pod's bind on n (its allocator state st, with pods) would
        wait for another pod to start, or None, and the (pod, container) it
        waits for.  Kept in `verdicts`
        (those of the pod's shape) while the node's allocator state (the
        same NodeState, its version) and its pods' starts
        (`ClusterState.epoch`) stay as they were: read before the verdict
        is, so a change meanwhile only makes it look stale."""
        version, epoch = st.version, self.state.epoch(n)
        why, blocker = None, None
        others = self.state.unstarted(n, set(counts), req.name)
        narrowed = on_the_same_gpus(req, {g for _, _, g in others}) if others else None
        if others and (narrowed is None or not self._fits_on(req, narrowed, n)):
            pod, container, gpus = others[0]
            blocker = (pod, container)
            why = (
                f"waits for pod {pod} on {n} to start its container {container}: it has a "
                f"{len(gpus)}-GPU container on GPUs this pod cannot get, and the device "
                "plugin cannot tell which of the two kubelet admits first"
            )
        inits = {c.count for c in req.containers if c.plain_init and c.count}
        if why is None and inits and self.state.unlisted_inits_on(n, inits, req.name):
            # an init container the device plugin could not tell from
            # another pod's (ClusterState._init_rival)
            own = self._decide(req, [n], False)
            if own.node == n and own.allocation is not None:
                rival = self.state.init_rival(own.allocation)
                if rival is not None:
                    why, blocker = str(rival), rival.blocker
        if len(verdicts) >= VERDICTS_PER_SHAPE:
            verdicts.clear()  # nodes gone, or more than a cluster's worth
        verdicts[n] = (st, version, epoch, why, blocker)
        return why, blocker

    def _fits_on(self, req: PodRequest, narrowed: PodRequest, n: str) -> bool:
        """Whether `narrowed` (the pod restricted to the GPUs of the pods it
        would wait for) fits on node n.  The pod's own plan for n answers
        when it is on those GPUs already; decide keeps that plan (per
        request shape and node state) for the decision among the offered
        nodes that follows, so the node the last bind changed is planned
        once per filter: planning it for the narrowed pod too cost a
        second plan per filter (make bench-cluster)."""
        own = self._decide(req, [n], False)
        allowed = set(narrowed.use_uuids)
        if (
            own.node == n
            and own.allocation is not None
            and all({g.uuid for g in c.gpus} <= allowed for c in own.allocation.containers)
        ):
            return True
        return bool(self._decide(narrowed, [n], False).node == n)

    # ---- prioritize -------------------------------------------------------

    def prioritize(self, body: Any) -> list[dict[str, Any]]:
        args = fields(body)
        names = node_names(args)
        pod = the_pod(args)
        # filter's decision for these nodes, found by the pod's uid without
        # reading the pod again
        uid = (pod.get("metadata") or {}).get("uid")
        d = self._recall(uid, names) if isinstance(uid, str) and uid else None
        if d is None:
            try:
                d = self._decide(pod_request(pod), names, explain=False)
            except DocumentError:
                return [{"Host": n, "Score": 0} for n in names]
        req = d.pod
        binpack = (req.node_policy or self.allocator.config.node_policy) == "binpack"
        out = []
        for n in names:
            st = self.allocator.nodes.get(n)
            if n == d.node:
                score = MAX_PRIORITY
            elif st is None or n in d.reasons:
                score = 0
            else:
                usage = min(max(st.usage, 0.0), 1.0)
                score = 1 + round(8 * (usage if binpack else 1.0 - usage))
            out.append({"Host": n, "Score": score})
        # The last verb of kube-scheduler's cycle for this pod: hold the room
        # until its bind (the next pods' filters no longer see it free).
        if d.node is not None and d.node in names and self.state.assume(req.name, req.uid, d):
            version = (pod.get("metadata") or {}).get("resourceVersion")
            if req.uid and isinstance(version, str) and version:
                with self._cache_lock:
                    self._sent[req.name] = (req.uid, version, req)
                    self._sent.move_to_end(req.name)
                    while len(self._sent) > CACHE_SIZE:
                        self._sent.popitem(last=False)
        return out

    # ---- bind -------------------------------------------------------------

    async def bind(self, body: Any) -> dict[str, Any]:
        """Runs on the server's event loop: the Binding is written there
        (`Binder`); only a bind that must read the pod first does that in
        a worker thread."""
        args = fields(body)
        missing = [k for k in ("PodName", "PodNamespace", "Node") if not args.get(k.lower())]
        if missing:
            raise BadRequest(f"{missing[0]}: missing from the binding arguments")
        name = str(args["podname"])
        namespace = str(args["podnamespace"])
        uid = str(args.get("poduid") or "")
        node = str(args["node"])
        key = f"{namespace}/{name}"
        try:
            await self._bind(key, name, namespace, uid, node)
        except Exception as exc:  # kube-scheduler retries the pod
            log.warning("bind %s to %s: %s", key, node, exc)
            return {"Error": f"gpuvisor: bind {key} to {node}: {exc}"}
        return {"Error": ""}

    def _commit(self, key: str, uid: str, req: PodRequest, node: str) -> Allocation:
        """Decide again on node and commit.  A placement the device plugin
        could mistake for another pod's (`Ambiguous`) is decided once more
        on exactly that pod's GPUs, where the pod's own filters allow; if it
        does not fit there, or is still ambiguous, the bind is refused."""
        narrowed = False
        ambiguous = ""
        for _ in range(COMMIT_ATTEMPTS):
            d = self._decide(req, [node], explain=True)
            if d.node != node or d.allocation is None:
                why = self._reason(d.reasons.get(node, "the pod no longer fits"))
                if narrowed:
                    raise RuntimeError(f"{ambiguous} (and on its GPUs: {why})")
                raise RuntimeError(why)
            try:
                return self.state.took(key, uid, node, d)
            except Conflict:
                continue
            except Ambiguous as exc:
                ambiguous = str(exc)
                gpus = on_the_same_gpus(req, exc.gpus) if not narrowed else None
                if gpus is None:
                    raise RuntimeError(ambiguous) from None
                req, narrowed = gpus, True
        raise RuntimeError(f"lost {COMMIT_ATTEMPTS} races for node {node} in a row")

    async def _bind(self, key: str, name: str, namespace: str, uid: str, node: str) -> None:
        # The room prioritize assumed, bound with the pod as kube-scheduler
        # sent it there: no read of the pod first.  Its uid and
        # resourceVersion are the Binding's preconditions, so a pod changed
        # or bound since gets a 409, and then the bind reads the pod and
        # goes the long way.  The read (a quorum read, and the client's
        # request in the extender) doubled the API calls per bind, beside
        # the next pods' filters (make bench-cluster).
        with self._cache_lock:
            sent = self._sent.pop(key, None)
        if sent is not None and uid and sent[0] == uid:
            _, version, req = sent
            allocation = self.state.claim(key, uid, node, req)
            if allocation is not None:
                try:
                    await self._send(key, name, namespace, uid, version, node, req, allocation)
                    return
                except Unanswered:
                    raise
                except ApiError as exc:
                    self.state.drop(key, settle=False)  # the pods waiting for it go on waiting
                    if exc.status != 409:
                        raise RuntimeError(str(exc)) from None
                except BaseException:
                    self.state.drop(key)
                    raise
        loop = asyncio.get_running_loop()
        uid, version, req, allocation = await loop.run_in_executor(
            None, self._bind_read, key, name, namespace, uid, node
        )
        try:
            await self._send(key, name, namespace, uid, version, node, req, allocation)
        except Unanswered:
            raise
        except ApiError as exc:
            self.state.drop(key)
            raise RuntimeError(
                "the pod changed meanwhile" if exc.status == 409 else str(exc)
            ) from None
        except BaseException:
            self.state.drop(key)
            raise

    def _bind_read(
        self, key: str, name: str, namespace: str, uid: str, node: str
    ) -> tuple[str, str, PodRequest, Allocation]:
        """Read the pod (in a worker thread) and take its room on node:
        the room prioritize assumed if it is still this request's, else
        decided again.  Its uid, resourceVersion and allocation, for the
        Binding."""
        from .api_view import view

        # Raw JSON, not the client's models: decoding a Pod into them cost
        # milliseconds of the interpreter per bind, which the filters of the
        # next pods waited for (make bench-cluster).
        raw = self.core.read_namespaced_pod(
            name, namespace, _preload_content=False, _request_timeout=API_TIMEOUT
        )
        pod = json.loads(raw.data)
        meta = pod.get("metadata") or {}
        if uid and meta.get("uid") != uid:
            raise RuntimeError(f"the pod is now another one (uid {meta.get('uid')}, not {uid})")
        if (pod.get("spec") or {}).get("nodeName"):
            # what it holds is what its annotation says (a bind of ours
            # that kube-scheduler gave up waiting for), not what was assumed
            self.state.pod_event(view(pod))
            raise RuntimeError(f"already bound to {pod['spec']['nodeName']}")
        req = pod_request(pod)
        # the room prioritize assumed for exactly this request on this node
        # is the bind's; any other reservation (a failed bind's, one
        # restored from its annotation, another node's) is void and the pod
        # is placed again
        allocation = self.state.claim(key, meta["uid"], node, req)
        if allocation is None:
            self.state.drop(key, settle=False)  # the pods waiting for it go on waiting
            allocation = self._commit(key, meta["uid"], req, node)
        return str(meta["uid"]), str(meta["resourceVersion"]), req, allocation

    async def _send(
        self,
        key: str,
        name: str,
        namespace: str,
        uid: str,
        version: str,
        node: str,
        req: PodRequest,
        allocation: Allocation,
    ) -> None:
        """Create the Binding.  When no answer comes (a timeout, a
        connection lost, the API server's 504 "may still be processing"),
        the pod may be bound all the same: done if its watch showed it bound
        to node already, else Unanswered with its room kept
        (`ClusterState.unsure`).  Releasing it there left a pod that was
        bound after all on GPUs the allocator then gave to the next pod."""
        try:
            await self._create_binding(name, namespace, uid, version, node, allocation)
            return
        except ApiError as exc:
            if exc.status != 504:
                raise
            why = str(exc)
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            why = str(exc) or type(exc).__name__
        bound = self.state.unsure(key, uid, node, req, allocation)
        if self.unanswered is not None:
            self.unanswered.labels("bound" if bound else "kept").inc()
        if bound:
            log.info("bind %s to %s: no answer (%s), but the pod is bound there", key, node, why)
            return
        raise Unanswered(
            f"no answer from the API server ({why}); the pod may be bound all the same: its "
            "room stays held until its watch says so, its next scheduling cycle, or "
            f"{ASSUME_SECONDS:.0f} s"
        )

    async def _create_binding(
        self, name: str, namespace: str, uid: str, version: str, node: str, allocation: Allocation
    ) -> None:
        # One write: the API server copies a Binding's annotations onto
        # the pod as it binds it, under the Binding's preconditions (uid,
        # resourceVersion: 409 if the pod changed since it was read).  A
        # patch of the annotation before the Binding doubled the
        # writes per bind, and the binds fell behind (make bench-cluster).
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {
                "name": name,
                "uid": uid,
                "resourceVersion": version,
                "annotations": {ANNOTATION: allocation.annotation()},
            },
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        await self.binder.bind(namespace, name, body)
