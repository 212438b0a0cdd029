"""The DevicePlugin gRPC service kubelet calls (v1beta1).

Allocate hands each container the library, the node socket, the GPUs and a
fresh directory of its own, and sets no limit: kubelet does not say whose
container it is.  PreStartContainer, which kubelet calls right before it
starts the container, asks kubelet's PodResources API which pod and
container hold the device IDs, reads that pod's allocation annotation and
writes the container's limits file into its directory.  So a container gets
its own pod's limits, and nothing serialises pods on a node.  Whatever goes
wrong there fails the container's start with one clear line; it never
starts without limits (the library refuses a missing limits file)."""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from gpuvisor.cluster.allocation import ANNOTATION
from gpuvisor.cluster.deviceplugin.api import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from gpuvisor.cluster.inventory_model import DocumentError
from gpuvisor.cluster.request import pod_request

from . import defaults, limits_file
from .api import deviceplugin_v1beta1_pb2 as dp
from .gpus import Gpu, GpuSource
from .grant import ContainerGrant, GrantError, PodGrant, parse_grant
from .handover import heirs as heirs_of
from .handover import kubelet_order, sharing
from .kube import PodNotHere, PodSource, allocation_of, api_error
from .migrealise import Made, MigRealiser, MigRefused
from .owners import Owner, OwnerLookup
from .preferred import preferred
from .replicas import Replicas, UnknownDevice
from .within import beyond_request

log = logging.getLogger("gpuvisor.device-plugin")

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"

# Where a container sees what Allocate mounts (docs/kubernetes.md).
CONTAINER_LIB_DIR = "/usr/local/gpuvisor/lib"
CONTAINER_REGION_DIR = "/var/lib/gpuvisor"
CONTAINER_LIMITS_DIR = "/etc/gpuvisor"
CONTAINER_NODE_DIR = "/run/gpuvisor"
LIBRARY = "libgpuvisor.so"
REGION_FILE = "region.shr"
DEVICES_FILE = "devices.json"  # the replica IDs a directory was allocated for
OWNER_FILE = "owner.json"  # the pod/container whose limits it holds
STEERED_FILE = "steered.json"  # the container GetPreferredAllocation chose these IDs for
MIG_FILE = "mig.json"  # the MIG instances Allocate made or reused, and for which container
ORDER_FILE = "allocated.ns"  # when Allocate made it (ns since the epoch): kubelet's order
GC_GRACE_SECONDS = 600.0  # a directory younger than this is never collected
CLAIM_SECONDS = 120.0  # a preference not followed by a container start by then lapses


@dataclass(frozen=True)
class PluginConfig:
    resource: str = defaults.RESOURCE
    split_count: int = defaults.SPLIT_COUNT
    node_name: str = ""
    # host paths (the plugin sees them at the same paths)
    state_dir: Path = defaults.STATE_DIR
    lib_dir: Path = defaults.LIB_DIR
    node_dir: Path = defaults.NODE_DIR


class PreStartRefused(Exception):
    """PreStartContainer cannot give the container its limits: the message
    says why, and kubelet fails the container's start with it."""


class DevicePluginService(dp_grpc.DevicePluginServicer):  # type: ignore[misc]
    def __init__(
        self,
        config: PluginConfig,
        gpus: GpuSource,
        pods: PodSource,
        owners: OwnerLookup,
        mig: MigRealiser | None = None,
    ) -> None:
        self.config = config
        self.mig = mig
        self.source = gpus
        self.replicas = Replicas(tuple(gpus.gpus()), config.split_count)
        self.pods = pods
        self.owners = owners
        self._cond = threading.Condition()
        self._unhealthy: dict[str, str] = {}
        self._generation = 0
        self._stopping = False
        self._lock = threading.Lock()  # _dirs, _realised
        self._dirs: dict[frozenset[str], list[Path]] = {}
        self._realised: set[tuple[str, str]] = set()
        # the UID of the pod of each name last seen bound here: a pod created
        # again under a name (new UID) starts with nothing realised or claimed
        self._uids: dict[str, str] = {}
        # placements GetPreferredAllocation steered a request to, until
        # their container starts: (pod, container) -> when
        self._claimed: dict[tuple[str, str], float] = {}
        # the IDs GetPreferredAllocation answered, for which container; the
        # next Allocate of exactly those IDs records it in its directory
        self._steered: dict[frozenset[str], tuple[str, str]] = {}
        config.state_dir.mkdir(parents=True, exist_ok=True)
        self._load_dirs()

    # ---- health --------------------------------------------------------

    def set_unhealthy(self, unhealthy: dict[str, str]) -> None:
        """The GPUs unhealthy now (uuid -> why); ListAndWatch streams the change."""
        with self._cond:
            if unhealthy == self._unhealthy:
                return
            for uuid, why in unhealthy.items():
                if uuid not in self._unhealthy:
                    log.warning("GPU %s unhealthy: %s", uuid, why)
            for uuid in self._unhealthy.keys() - unhealthy.keys():
                log.info("GPU %s healthy again", uuid)
            self._unhealthy = dict(unhealthy)
            self._generation += 1
            self._cond.notify_all()

    def unhealthy(self) -> dict[str, str]:
        """The GPUs unhealthy now (uuid -> why)."""
        with self._cond:
            return dict(self._unhealthy)

    def poll_health(self) -> None:
        self.set_unhealthy(self.source.unhealthy())

    def stop_streams(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def devices(self) -> list[dp.Device]:
        out = []
        with self._cond:
            bad = set(self._unhealthy)
        for g in self.replicas.gpus:
            topo = None
            if g.numa_node is not None:
                topo = dp.TopologyInfo(nodes=[dp.NUMANode(ID=g.numa_node)])
            health = UNHEALTHY if g.uuid in bad else HEALTHY
            out += [dp.Device(ID=d, health=health, topology=topo) for d in self.replicas.ids(g)]
        return out

    # ---- the gRPC methods ---------------------------------------------

    def GetDevicePluginOptions(self, request: dp.Empty, context: Any) -> dp.DevicePluginOptions:
        return options()

    def ListAndWatch(self, request: dp.Empty, context: Any) -> Iterator[dp.ListAndWatchResponse]:
        seen = -1
        while context.is_active():
            with self._cond:
                if self._stopping:
                    return
                if seen == self._generation:
                    self._cond.wait(timeout=1.0)
                    continue
                seen = self._generation
            yield dp.ListAndWatchResponse(devices=self.devices())

    def GetPreferredAllocation(
        self, request: dp.PreferredAllocationRequest, context: Any
    ) -> dp.PreferredAllocationResponse:
        heirs: dict[tuple[str, str], ContainerGrant] = {}
        try:
            candidates = self._unrealised(heirs)
        except Exception as exc:  # the API may be away: spread instead
            log.warning("GetPreferredAllocation: cannot list this node's pods: %s", exc)
            candidates = []
        out = []
        with self._lock:
            now = time.monotonic()
            self._claimed = {k: t for k, t in self._claimed.items() if now - t < CLAIM_SECONDS}
            for r in request.container_requests:
                open_ = [(k, c) for k, c in candidates if k not in self._claimed]
                ids, n = preferred(
                    self.replicas,
                    list(r.available_deviceIDs),
                    list(r.must_include_deviceIDs),
                    r.allocation_size,
                    [c for _, c in open_],
                )
                if n is not None:
                    key, chosen = open_[n]
                    self._claimed[key] = now
                    self._steered[frozenset(ids)] = key
                    log.info("GetPreferredAllocation: %s for %s/%s", ids, *key)
                    heir = heirs.get(key)  # none for a sidecar or an app container
                    if heir is not None and len(heir.gpus) <= len(chosen.gpus):
                        # kubelet hands it these devices without asking: it
                        # must not take the preference of another container
                        self._claimed[(key[0], heir.name)] = now
                out.append(dp.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return dp.PreferredAllocationResponse(container_responses=out)

    def Allocate(self, request: dp.AllocateRequest, context: Any) -> dp.AllocateResponse:
        out = []
        done: list[Path] = []
        for r in request.container_requests:
            try:
                gpus = self.replicas.physical(r.devices_ids)
                resp, top = self._allocate(list(r.devices_ids), gpus)
            except UnknownDevice as exc:
                self._undo(done)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                raise  # abort raises
            except MigRefused as exc:
                self._undo(done)
                log.error("Allocate: %s", exc)
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"gpuvisor: {exc}")
                raise  # abort raises
            out.append(resp)
            done.append(top)
        return dp.AllocateResponse(container_responses=out)

    def _undo(self, tops: list[Path]) -> None:
        """Allocate failed for a later container of the same request: the
        directories (and MIG instances) made for the earlier ones go."""
        for top in tops:
            self._drop_dir(top)

    def _drop_dir(self, top: Path) -> bool:
        """Remove a container's directory, after the MIG instances it made
        (False, and the directory kept, while one of them is in use)."""
        made = _read_mig(top)
        if made is not None and made[1] and self.mig is not None:
            who = "/".join(made[0])
            try:
                left = self.mig.release(who, made[1], self._reused())
            except _ApiAway as exc:
                log.warning("%s: MIG instances kept until the API answers: %s", who, exc)
                return False
            if left:
                _write_mig(top, made[0], left)
                return False
        shutil.rmtree(top, ignore_errors=True)
        with self._lock:
            for key in [k for k, v in self._dirs.items() if top in v]:
                self._dirs[key] = [d for d in self._dirs[key] if d != top]
                if not self._dirs[key]:
                    del self._dirs[key]
        return True

    def PreStartContainer(
        self, request: dp.PreStartContainerRequest, context: Any
    ) -> dp.PreStartContainerResponse:
        try:
            self.prestart(list(request.devices_ids))
        except PreStartRefused as exc:
            log.error("PreStartContainer: %s", exc)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"gpuvisor: {exc}")
            raise  # abort raises
        return dp.PreStartContainerResponse()

    # ---- Allocate ----------------------------------------------------

    def _allocate(
        self, ids: list[str], gpus: list[Gpu]
    ) -> tuple[dp.ContainerAllocateResponse, Path]:
        cfg = self.config
        with self._lock:
            steer = self._steered.pop(frozenset(ids), None)
        if steer is None:
            steer = self._reused_for_mig(ids, gpus)
        made = self._realise_mig(steer, gpus) if steer is not None else []
        top = cfg.state_dir / secrets.token_hex(8)
        (top / "region").mkdir(parents=True)
        (top / "limits").mkdir()
        # The container may run as any user: its region directory is its own.
        os.chmod(top / "region", 0o1777)
        os.chmod(top / "limits", 0o755)
        (top / DEVICES_FILE).write_text(json.dumps(sorted(ids)))
        (top / ORDER_FILE).write_text(str(time.time_ns()))
        if steer is not None:
            (top / STEERED_FILE).write_text(json.dumps(list(steer)))
        if made:
            assert steer is not None
            _write_mig(top, steer, made)
        with self._lock:
            self._dirs.setdefault(frozenset(ids), []).append(top)
        mig_of = {m.gpu: m.uuid for m in made}
        visible = ",".join(mig_of.get(g.uuid, g.uuid) for g in gpus)
        envs = {
            "NVIDIA_VISIBLE_DEVICES": visible,
            "CUDA_VISIBLE_DEVICES": visible,
            "LD_PRELOAD": f"{CONTAINER_LIB_DIR}/{LIBRARY}",
            "CUDA_DEVICE_MEMORY_SHARED_CACHE": f"{CONTAINER_REGION_DIR}/{REGION_FILE}",
            "GPUVISOR_LIMITS_FILE": f"{CONTAINER_LIMITS_DIR}/{limits_file.FILE_NAME}",
            "GPUVISOR_NODE_SOCKET": f"{CONTAINER_NODE_DIR}/node.sock",
            "GPUVISOR_NODE_LOCK": f"{CONTAINER_NODE_DIR}/context.lock",
        }
        mounts = [
            dp.Mount(container_path=CONTAINER_LIB_DIR, host_path=str(cfg.lib_dir), read_only=True),
            dp.Mount(
                container_path=CONTAINER_REGION_DIR, host_path=str(top / "region"), read_only=False
            ),
            dp.Mount(
                container_path=CONTAINER_LIMITS_DIR, host_path=str(top / "limits"), read_only=True
            ),
            dp.Mount(
                container_path=CONTAINER_NODE_DIR, host_path=str(cfg.node_dir), read_only=False
            ),
        ]
        log.info("Allocate %s -> %s (%s)", ids, top.name, visible)
        return dp.ContainerAllocateResponse(envs=envs, mounts=mounts), top

    def _reused_for_mig(self, ids: list[str], gpus: list[Gpu]) -> tuple[str, str] | None:
        """The sidecar or app container that kubelet gives exactly the
        devices of its pod's plain init container, when its placement is
        MIG: kubelet reuses a plain init container's devices for the next
        sidecar or app container (handover.py) without asking
        GetPreferredAllocation, so the preference that chose these IDs for
        the init container names the pod.  Its first sidecar or app
        container after it in kubelet's order on exactly these GPUs, with a
        MIG placement and no directory of these IDs yet, is the one
        (PreStartContainer then checks it against kubelet's PodResources
        API, as for any other)."""
        if self.mig is None:
            return None
        with self._lock:
            tops = list(self._dirs.get(frozenset(ids), []))
        steers = {s for s in (_read_steer(t) for t in tops) if s is not None}
        for pod, init in sorted(steers):
            ns, _, name = pod.partition("/")
            try:
                grant = self._grant(ns, name, init)
            except PreStartRefused:
                continue
            first = grant.container(init)
            if first is None or not first.plain_init:
                continue  # a sidecar's devices go to no other container
            want = sorted(g.uuid for g in gpus)
            order = kubelet_order(grant)
            later = order[order.index(first) + 1 :] if first in order else []
            for c in later:
                if c.plain_init or (pod, c.name) in steers:
                    continue
                if sorted(g.uuid for g in c.gpus) == want:
                    if any(g.mig is not None for g in c.gpus):
                        log.info("Allocate: %s reused for %s/%s", ids, pod, c.name)
                        return pod, c.name
                    return None
        return None

    def _realise_mig(self, steer: tuple[str, str], gpus: list[Gpu]) -> list[Made]:
        """The MIG instances of the container GetPreferredAllocation chose
        these devices for, when its placement has any: made now, since the
        container's environment names them (PreStartContainer then checks
        that kubelet's PodResources API names that same container)."""
        if self.mig is None:
            return []
        pod, container = steer
        ns, _, name = pod.partition("/")
        try:
            c = self._grant(ns, name, container).container(container)
        except PreStartRefused as exc:
            log.warning("Allocate: no MIG plan read for %s/%s: %s", pod, container, exc)
            return []
        if c is None or not any(g.mig is not None for g in c.gpus):
            return []
        if sorted(g.uuid for g in c.gpus) != sorted(g.uuid for g in gpus):
            return []  # not the GPUs planned: PreStartContainer refuses the start
        return self.mig.realise(f"pod {pod} container {container}", c.gpus, self._held())

    def _held(self) -> set[str]:
        """The MIG UUIDs the containers of this plugin's directories hold."""
        with self._lock:
            tops = [top for dirs in self._dirs.values() for top in dirs]
        out: set[str] = set()
        for top in tops:
            made = _read_mig(top)
            if made is not None:
                out |= {m.uuid for m in made[1]}
        return out

    def _reused(self) -> set[str]:
        """The MIG instances the pods bound to this node plan to reuse."""
        if not self.config.node_name:
            return set()
        try:
            bound = self.pods.bound(self.config.node_name)
        except Exception as exc:  # the API away: hand nothing over, destroy nothing yet
            raise _ApiAway(str(exc)) from None
        return {
            g.mig.instance
            for p in bound
            for c in p.containers
            for g in c.gpus
            if g.mig is not None and g.mig.instance is not None
        }

    def _load_dirs(self) -> None:
        """The directories of earlier runs (a plugin restart between a
        container's Allocate and its PreStartContainer)."""
        for top in sorted(self.config.state_dir.iterdir(), key=lambda p: p.stat().st_mtime):
            try:
                ids = json.loads((top / DEVICES_FILE).read_text())
            except (OSError, ValueError):
                continue
            if isinstance(ids, list) and all(isinstance(i, str) for i in ids):
                self._dirs.setdefault(frozenset(ids), []).append(top)

    # ---- PreStartContainer --------------------------------------------

    def prestart(self, ids: list[str]) -> None:
        """Write the limits of the container(s) that hold ids into the
        directories Allocate made for ids; PreStartRefused says why not.

        The owner is the container kubelet's PodResources API names (app
        and sidecar containers).  PodResources does not list plain init
        containers: a directory whose Allocate followed this plugin's
        preference for a plain init container (GetPreferredAllocation
        answered exactly these IDs for it) gets that init container's
        limits, when its pod is the one kubelet lists (with these IDs reused
        by a sidecar or an app container, or holding none listed).  A
        preference naming a sidecar or an app container never overrides
        the owner PodResources names."""
        cfg = self.config
        key = frozenset(ids)
        try:
            gpus = self.replicas.physical(ids)
        except UnknownDevice as exc:
            raise PreStartRefused(str(exc)) from None
        with self._lock:
            dirs = list(self._dirs.get(key, []))
        if not dirs:
            raise PreStartRefused(f"devices {sorted(ids)}: no Allocate was seen for them")
        try:
            holders = self.owners.holders(cfg.resource, ids)
        except grpc.RpcError as exc:
            raise PreStartRefused(
                f"devices {sorted(ids)}: kubelet's PodResources API did not answer "
                f"({exc.code().name}: {exc.details()})"
            ) from None
        owners = holders.owners
        for key_ in sorted({o.pod_key for o in owners} & holders.twice):
            raise PreStartRefused(_twice(key_))
        app: tuple[str, str] | None = None  # (pod key, limits text)
        if owners:
            texts = {self._limits_text(o.namespace, o.pod, o.container, gpus) for o in owners}
            if len(texts) != 1 or len({o.pod_key for o in owners}) != 1:
                who = ", ".join(f"{o.pod_key}/{o.container}" for o in owners)
                raise PreStartRefused(
                    f"devices {sorted(ids)}: held by {who}, whose allocations give different limits"
                )
            app = (owners[0].pod_key, texts.pop())
        handed = self._handed_over(owners, dirs) if app is not None else {}
        written: list[str] = []
        for top in dirs:
            if not top.is_dir():
                continue
            steer = _read_steer(top)
            target: tuple[str, str] | None = app
            who = "/".join(o.container for o in owners)
            if app is not None and top in handed:
                # the container kubelet allocated this directory for
                ns, _, name = app[0].partition("/")
                who = handed[top]
                target = (app[0], self._limits_text(ns, name, who, gpus))
            elif steer is not None and (
                steer[0] == (app[0] if app else None) or (app is None and steer[0] in holders.pods)
            ):
                if steer[0] in holders.twice:
                    raise PreStartRefused(_twice(steer[0]))
                ns, _, name = steer[0].partition("/")
                init = self._init_limits(ns, name, steer[1], gpus)
                if init is not None and app is None:
                    self._no_rival(steer, init, holders.pods, ids, gpus)
                if init is not None:
                    target, who = (steer[0], init), steer[1]
            if target is None:
                continue
            stamp = json.dumps(target[0])
            mark = top / OWNER_FILE
            if mark.exists() and mark.read_text() != stamp:
                # A pod that held these IDs before and is gone: not this one.
                self._drop_dir(top)
                continue
            self._check_mig(top, target[0], who.split("/")[0])
            limits_file.write(top / "limits", target[1])
            mark.write_text(stamp)
            os.utime(top)
            written.append(f"{target[0]}/{who}")
            with self._lock:
                for c in who.split("/"):
                    self._realised.add((target[0], c))
                    self._claimed.pop((target[0], c), None)
                if steer is not None:
                    # The preference for these IDs is used up, whoever took
                    # it: kubelet may have admitted another pod than the one
                    # it was steered by (the same GPUs: the extender binds
                    # no other), and that one must find its placement open.
                    self._claimed.pop(steer, None)
        if not written:
            raise PreStartRefused(
                f"devices {sorted(ids)}: kubelet's PodResources API names no container "
                "that holds exactly these devices"
            )
        log.info("PreStartContainer %s: limits of %s", sorted(ids), ", ".join(written))

    def _no_rival(
        self, steer: tuple[str, str], text: str, listed: set[str], ids: list[str], gpus: list[Gpu]
    ) -> None:
        """PreStartRefused unless the plain init container steer names is the
        only one these devices can be for.  Only the preference names it
        (kubelet lists no plain init container's IDs), and kubelet may admit
        pods in another order than preferred: another pod kubelet lists,
        bound here, with a plain init container not started yet on these
        GPUs, as many, and other limits, may be the one kubelet gave them
        (a sidecar is no rival: PodResources would name it)."""
        want = sorted(g.uuid for g in gpus)
        try:
            bound = self.pods.bound(self.config.node_name) if self.config.node_name else []
        except Exception as exc:
            raise PreStartRefused(
                f"devices {sorted(ids)}: cannot list this node's pods from the API to tell "
                f"whose init container they are for: {api_error(exc)}"
            ) from None
        with self._lock:
            done = set(self._realised)
        mine = _limit_lines(text)
        for p in bound:
            if p.pod == steer[0] or p.pod not in listed:
                continue
            for c in p.containers:
                if not c.plain_init or (p.pod, c.name) in done:
                    continue
                if sorted(g.uuid for g in c.gpus) != want:
                    continue
                ns, _, name = p.pod.partition("/")
                if _limit_lines(self._limits_text(ns, name, c.name, gpus)) != mine:
                    raise PreStartRefused(
                        f"devices {sorted(ids)}: the init container {c.name} of pod {p.pod} or "
                        f"{steer[1]} of pod {steer[0]} (kubelet lists neither, and may have "
                        "admitted the pods in another order than preferred), whose limits "
                        "differ: not started"
                    )

    def _handed_over(self, owners: list[Owner], dirs: list[Path]) -> dict[Path, str]:
        """The container each of dirs was allocated for, where kubelet
        handed the same IDs from plain init containers to the sidecar or app
        container PodResources names (handover.sharing): its pod's containers
        of these IDs, in kubelet's order, took the newest of these
        directories, in the order Allocate made them.  Empty when that is
        not known (an order left open, fewer directories, or one without
        its Allocate time)."""
        if len(owners) != 1:
            return {}
        o = owners[0]
        grant = self._grant(o.namespace, o.pod, o.container)
        c = grant.container(o.container)
        if c is None or c.plain_init:
            return {}  # (PodResources lists no plain init container)
        group = sharing(grant, o.container)
        if group is None or len(group) < 2:
            return {}
        made = {top: _read_order(top) for top in dirs}
        if len(dirs) < len(group) or any(t is None for t in made.values()):
            return {}
        newest = sorted(dirs, key=lambda top: made[top] or 0)[-len(group) :]
        return dict(zip(newest, group, strict=True))

    def _check_mig(self, top: Path, pod: str, container: str) -> None:
        """The MIG instances Allocate made in top are those the container's
        placement plans, made for this very container; PreStartRefused if
        not (instances made for another container are destroyed: it never
        runs in this directory)."""
        made = _read_mig(top)
        ns, _, name = pod.partition("/")
        c = self._grant(ns, name, container).container(container)
        planned = [g for g in (c.gpus if c is not None else ()) if g.mig is not None]
        if made is not None and made[0] != (pod, container):
            uuids = [m.uuid for m in made[1]]
            self._drop_mig(top, made)
            raise PreStartRefused(
                f"pod {pod} container {container}: Allocate made MIG instances {uuids} for "
                f"{made[0][0]}/{made[0][1]} (the container GetPreferredAllocation chose these "
                "devices for), but kubelet gave the devices to this container: not started"
            )
        if not planned:
            return
        g0 = planned[0]
        if made is None:
            raise PreStartRefused(
                f"pod {pod} container {container}: GPU {g0.uuid}: a MIG placement, but no MIG "
                "instance was made for it at Allocate (kubelet did not allocate the devices "
                "GetPreferredAllocation chose for this container): not started"
            )
        have = sorted((m.gpu, m.start, m.size) for m in made[1])
        want = sorted(
            (g.uuid, g.mig.placement.start, g.mig.placement.size)
            for g in planned
            if g.mig is not None
        )
        if have != want:
            raise PreStartRefused(
                f"pod {pod} container {container}: its MIG instances {have} are not "
                f"the planned {want}: not started"
            )

    def _drop_mig(self, top: Path, made: tuple[tuple[str, str], list[Made]]) -> None:
        """Destroy the instances made in top (for a container that will not run there)."""
        if self.mig is None:
            return
        try:
            left = self.mig.release("/".join(made[0]), made[1], self._reused())
        except _ApiAway:
            left = list(made[1])
        if left:
            _write_mig(top, made[0], left)
        else:
            (top / MIG_FILE).unlink(missing_ok=True)

    def release_mig(self) -> int:
        """Destroy the MIG instances of started containers whose pod kubelet
        no longer lists (their directories go too); returns how many
        directories went.  A container that never started is left to
        collect_garbage, after its grace."""
        if self.mig is None:
            return 0
        with self._lock:
            tops = [top for dirs in self._dirs.values() for top in dirs]
        tops = [t for t in tops if (t / MIG_FILE).exists() and (t / OWNER_FILE).exists()]
        if not tops:
            return 0
        pods = self.owners.holders(self.config.resource, []).pods
        gone = 0
        for top in tops:
            try:
                owner = json.loads((top / OWNER_FILE).read_text())
            except (OSError, ValueError):
                continue
            if owner not in pods and self._drop_dir(top):
                gone += 1
        return gone

    def settle_mig_mode(self) -> list[str]:
        """Turn MIG mode off on this plugin's GPUs idle in MIG mode for the
        grace (MigRealiser.settle): never on a GPU that a pod bound to this
        node (not started yet) has a MIG grant on, nor while the API does
        not say which those are.  Returns the GPUs turned off."""
        if self.mig is None or not self.config.node_name or not self.mig.idle():
            return []  # (the API is asked only when a GPU waits to go off)
        bound = self.pods.bound(self.config.node_name)  # the API away: raises, nothing done
        planned = {g.uuid for p in bound for c in p.containers for g in c.gpus if g.mig is not None}
        return self.mig.settle(planned, time.monotonic())

    def _grant(self, namespace: str, pod: str, container: str) -> PodGrant:
        """The pod's allocation record, checked against the pod's own
        requests: the annotation is writable by whoever may edit the pod,
        its requests are not (`within.beyond_request`)."""
        key = f"{namespace}/{pod}"
        try:
            doc = self.pods.pod(namespace, pod)
        except PodNotHere as exc:
            raise PreStartRefused(f"pod {key}{exc}: container {container} is not started") from None
        except Exception as exc:
            raise PreStartRefused(
                f"pod {key}: cannot read its allocation from the API: {api_error(exc)}"
            ) from None
        text = allocation_of(doc)
        if text is None:
            raise PreStartRefused(
                f"pod {key} has no gpuvisor.io/allocation annotation (it was not placed by "
                f"gpuvisor's scheduler): container {container} is not started without limits"
            )
        try:
            grant = parse_grant(text)
        except GrantError as exc:
            raise PreStartRefused(f"pod {key}: {exc}") from None
        if grant.pod != key:
            raise PreStartRefused(
                f"pod {key}: {ANNOTATION}: pod={json.dumps(grant.pod)}: the record of another pod"
            )
        node = self.config.node_name
        if node and grant.node != node:
            # a placement made for another node (a stale or copied one):
            # its GPUs are not these, whatever their UUIDs say
            raise PreStartRefused(
                f"pod {key}: {ANNOTATION}: allocation.node={json.dumps(grant.node)}: not this "
                f"node ({node}): container {container} is not started with it"
            )
        try:
            request = pod_request(doc)
        except DocumentError as exc:
            raise PreStartRefused(f"pod {key}: {exc}") from None
        memory = {g.uuid: g.memory_mib for g in self.replicas.gpus}
        why = beyond_request(grant.containers, request, memory.get)
        if why is not None:
            raise PreStartRefused(f"pod {key}: {why}: container {container} is not started")
        return grant

    def _limits_text(self, namespace: str, pod: str, container: str, gpus: list[Gpu]) -> str:
        grant = self._grant(namespace, pod, container)
        c = grant.container(container)
        if c is None:
            raise PreStartRefused(
                f"pod {namespace}/{pod}: its allocation has no container {container}"
            )
        try:
            return limits_file.render(f"{namespace}/{pod}", c, gpus)
        except GrantError as exc:
            raise PreStartRefused(str(exc)) from None

    def _init_limits(self, namespace: str, pod: str, container: str, gpus: list[Gpu]) -> str | None:
        """The limits of plain init container container; None if it is not
        one (PodResources names a sidecar or an app container itself)."""
        c = self._grant(namespace, pod, container).container(container)
        if c is None or not c.plain_init:
            return None
        return self._limits_text(namespace, pod, container, gpus)

    def collect_garbage(self, grace: float = GC_GRACE_SECONDS) -> list[Path]:
        """Remove the directories of containers that are gone: of a pod
        kubelet no longer lists, or (never started) of IDs no listed
        container holds and no preference for a listed pod chose (an init
        container's); only those older than grace seconds, so a container
        between Allocate and its start keeps its own."""
        holders = self.owners.holders(self.config.resource, [])
        now = time.time()
        removed = []
        with self._lock:
            tops = [(key, top) for key, dirs in self._dirs.items() for top in dirs]
            # pods kubelet no longer lists: what they realised goes
            for pod in {k[0] for k in self._realised} - holders.pods:
                self._forget(pod)
        for key, top in tops:
            try:
                age = now - top.stat().st_mtime
                stamp = (top / OWNER_FILE).read_text() if (top / OWNER_FILE).exists() else None
            except OSError:
                age, stamp = grace + 1, None
            if age <= grace:
                continue
            if stamp is not None:
                gone = json.loads(stamp) not in holders.pods
            else:
                # not started: gone when no listed container holds its IDs,
                # unless a preference named a listed pod for them (PodResources
                # lists no plain init container's IDs: one whose image pull
                # outlasts the grace still starts in its directory)
                steer = _read_steer(top)
                gone = not (key & holders.devices) and (
                    steer is None or steer[0] not in holders.pods
                )
            if gone and self._drop_dir(top):
                removed.append(top)
        if removed:
            log.info("removed %d directories of containers that are gone", len(removed))
        return removed

    def _forget(self, pod: str) -> None:
        """What was realised and claimed for an earlier pod of this name
        (under _lock)."""
        self._realised = {k for k in self._realised if k[0] != pod}
        self._claimed = {k: t for k, t in self._claimed.items() if k[0] != pod}
        self._uids.pop(pod, None)

    def _unrealised(
        self, heirs: dict[tuple[str, str], ContainerGrant] | None = None
    ) -> list[tuple[tuple[str, str], ContainerGrant]]:
        """The containers of the pods bound here that have not started yet;
        heirs gets, per plain init container with GPUs ((pod, container)),
        the container kubelet hands its devices to: the next sidecar or app
        container with GPUs (handover.heirs)."""
        if not self.config.node_name:
            return []
        bound = self.pods.bound(self.config.node_name)
        with self._lock:
            for pod in bound:
                if pod.uid and self._uids.get(pod.pod, pod.uid) != pod.uid:
                    self._forget(pod.pod)
                if pod.uid:
                    self._uids[pod.pod] = pod.uid
            done = set(self._realised)
        out = []
        for pod in bound:
            if heirs is not None:
                heirs.update(((pod.pod, k), c) for k, c in heirs_of(pod).items())
            for c in pod.containers:
                if c.gpus and (pod.pod, c.name) not in done:
                    out.append(((pod.pod, c.name), c))
        return out


class _ApiAway(Exception):
    """The Kubernetes API did not answer."""


def _read_mig(top: Path) -> tuple[tuple[str, str], list[Made]] | None:
    """The container a directory's MIG instances were made for, and them."""
    try:
        v = json.loads((top / MIG_FILE).read_text())
        who = v["for"]
        if not (isinstance(who, list) and len(who) == 2 and all(isinstance(x, str) for x in who)):
            raise ValueError(f"for: {who!r}")
        return (who[0], who[1]), [Made.from_json(m) for m in v["instances"]]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.error("%s: unreadable (%s)", top / MIG_FILE, exc)
        return None


def _write_mig(top: Path, who: tuple[str, str], made: list[Made]) -> None:
    tmp = top / f".{MIG_FILE}.tmp"
    tmp.write_text(json.dumps({"for": list(who), "instances": [m.to_json() for m in made]}))
    os.replace(tmp, top / MIG_FILE)


def _twice(pod: str) -> str:
    return (
        f"pod {pod}: kubelet lists two pods of this name (one deleted and created again): "
        "the API's is not known to be the one starting; not started until the old one is gone"
    )


def _limit_lines(text: str) -> list[str]:
    """A limits file's settings, without its comment naming the pod."""
    return [line for line in text.splitlines() if not line.startswith("#")]


def _read_order(top: Path) -> int | None:
    try:
        return int((top / ORDER_FILE).read_text())
    except (OSError, ValueError):
        return None


def _read_steer(top: Path) -> tuple[str, str] | None:
    try:
        v = json.loads((top / STEERED_FILE).read_text())
    except (OSError, ValueError):
        return None
    if isinstance(v, list) and len(v) == 2 and all(isinstance(x, str) for x in v):
        return v[0], v[1]
    return None


def options() -> dp.DevicePluginOptions:
    return dp.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=True)
