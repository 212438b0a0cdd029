"""Which containers of a pod kubelet gives the same device IDs.

kubelet's device manager allocates a pod's containers at admission, init
containers first, then app containers, each in manifest order.  The
devices of (plain) init containers go to a pool: the next init container
takes from the pool first (the pool grows by what it takes anew), and so
does the next app container (the pool shrinks by what it takes).  When the
pool holds exactly as many devices as a container asks, that container
gets exactly the pool's IDs, so several containers hold the same IDs, and
Allocate is called once for each, in that order.  When the pool holds more,
kubelet takes an arbitrary subset: which IDs is not known here.

PodResources names only the app container among them; this tells the
device plugin which container each of those Allocate calls was for."""

from __future__ import annotations

from .grant import ContainerGrant, PodGrant


def kubelet_order(grant: PodGrant) -> list[ContainerGrant]:
    """The pod's containers with GPUs, in the order kubelet allocates them."""
    cs = [c for c in grant.containers if c.gpus]
    return [c for c in cs if c.init] + [c for c in cs if not c.init]


def sharing(grant: PodGrant, container: str) -> list[str] | None:
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
        pool = take if c.init else frozenset()
    mine = ids.get(container)
    if mine is None:
        return None
    return [c.name for c in order if ids[c.name] == mine]
