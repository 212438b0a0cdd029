"""Which containers of a pod kubelet gives the same device IDs.

kubelet's device manager allocates a pod's containers at admission, init
containers first (plain ones and sidecars, restartPolicy: Always, as the
manifest interleaves them), then app containers, each in manifest order.
A container takes from the pod's pool of reusable devices first
(devicesToReuse), then new ones.  The devices of a plain init container
go to the pool (it ends before the next container starts); a sidecar's
and an app container's leave it (they run on, and keep theirs).  So a
plain init container's devices go to the next container asking for them:
a plain init container (the pool grows by what it takes anew), or a
sidecar or an app container (the pool is then empty); a sidecar's go to
nobody.  When the pool holds exactly as many devices as a container asks,
that container gets exactly the pool's IDs, so several containers hold
the same IDs, and Allocate is called once for each, in that order.  When
the pool holds more, kubelet takes an arbitrary subset: which IDs is not
known here.

PodResources names only the sidecar or app container among them (it does
not list plain init containers); this tells the device plugin which
container each of those Allocate calls was for."""

from __future__ import annotations

from collections.abc import Sequence, Sized
from typing import Protocol, TypeVar


class KubeletContainer(Protocol):
    """What kubelet's hand-over depends on: a record's container as the
    device plugin reads it (grant.ContainerGrant) or as the allocator
    writes it (gpuvisor.cluster.allocation.ContainerGrant)."""

    @property
    def name(self) -> str: ...
    @property
    def init(self) -> bool: ...
    @property
    def plain_init(self) -> bool: ...
    @property
    def gpus(self) -> Sized: ...


C = TypeVar("C", bound=KubeletContainer)
C_co = TypeVar("C_co", bound=KubeletContainer, covariant=True)


class KubeletPod(Protocol[C_co]):
    @property
    def containers(self) -> Sequence[C_co]: ...


def kubelet_order(grant: KubeletPod[C]) -> list[C]:
    """The pod's containers with GPUs, in the order kubelet allocates them
    (the record lists init containers in the pod's order: within.py)."""
    cs = [c for c in grant.containers if c.gpus]
    return [c for c in cs if c.init] + [c for c in cs if not c.init]


def heirs(grant: KubeletPod[C]) -> dict[str, C]:
    """Each plain init container with GPUs -> the container kubelet hands
    its devices to: the next sidecar or app container with GPUs in
    kubelet's order (the plain init containers between take the pool and
    put it back); absent when none follows."""
    out: dict[str, C] = {}
    waiting: list[str] = []  # plain init containers whose devices are in the pool
    for c in kubelet_order(grant):
        if c.plain_init:
            waiting.append(c.name)
            continue
        out.update((name, c) for name in waiting)
        waiting = []
    return out


def sharing(grant: KubeletPod[C], container: str) -> list[str] | None:
    """The containers kubelet gives exactly the device IDs it gives
    container (container among them), in kubelet's order; None when the
    counts alone do not determine which IDs kubelet gives each container
    (a pool larger than a container asks), or container has no GPUs."""
    order = kubelet_order(grant)
    pool: frozenset[int] = frozenset()  # the reusable devices, as tokens
    fresh = 0
    ids: dict[str, frozenset[int]] = {}
    for c in order:
        n = len(c.gpus)
        if len(pool) > n:
            return None  # kubelet takes an arbitrary n of the pool
        take = pool | frozenset(range(fresh, fresh + n - len(pool)))
        fresh += n - len(pool)
        ids[c.name] = take
        # a plain init container's devices go (back) to the pool; a
        # sidecar's and an app container's leave it (take holds the pool)
        pool = take if c.plain_init else frozenset()
    mine = ids.get(container)
    if mine is None:
        return None
    return [c.name for c in order if ids[c.name] == mine]


def unlisted(grant: KubeletPod[C], container: str) -> bool:
    """Whether the plain init container's devices are those of no container
    kubelet's PodResources lists (no sidecar or app container after it gets
    exactly its device IDs, or which IDs is not known): the device plugin
    then knows it only by its own preference."""
    group = sharing(grant, container)
    if group is None:
        return True
    kinds = {c.name: c for c in grant.containers}
    return all(kinds[name].plain_init for name in group)
