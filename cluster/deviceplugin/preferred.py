"""GetPreferredAllocation: which of kubelet's available replica IDs a
container should get.

kubelet does not say which pod it is allocating for, so the plugin prefers
the GPUs of a placement that is bound to this node and not started yet
(its pod Pending, the container not through PreStartContainer), with as
many GPUs as asked, the oldest pod first (by creation time, then name) and
not already preferred for an earlier request (a claim held until a
container starts on the IDs preferred, or CLAIM_SECONDS).  kubelet admits
pods in the order their bindings reach it, which may differ; the scheduler
extender's bind makes that harmless: it never binds a pod beside a
not-started pod that has a container with as many GPUs on other GPUs
(cluster/scheduler/state.py `ambiguity`), so the candidates of one size from
different pods share their GPUs and whichever is preferred is right.  Without a matching
placement it spreads: distinct GPUs, the least shared first.  Either way
kubelet gets exactly `size` IDs, all from `available`, including
`must_include`; PreStartContainer then checks the GPUs against the pod's
own placement and refuses a mismatch, so a wrong preference (pods bound by
another scheduler) can fail a start but never give a container another
pod's limits."""

from __future__ import annotations

from collections.abc import Sequence

from .grant import ContainerGrant
from .replicas import Replicas, UnknownDevice


def preferred(
    replicas: Replicas,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    candidates: Sequence[ContainerGrant],
) -> tuple[list[str], int | None]:
    """The IDs, and the index of the candidate they realise (None: spread)."""
    try:
        free = replicas.by_gpu(sorted(set(available), key=available.index))
        must = replicas.by_gpu(list(dict.fromkeys(must_include)))
    except UnknownDevice:
        return list(available)[:size], None  # kubelet's own choice stands
    chosen = [d for ids in must.values() for d in ids]
    if len(chosen) >= size:
        return chosen[:size], None
    for n, grant in enumerate(candidates):
        uuids = [g.uuid for g in grant.gpus]
        if (
            len(uuids) == size
            and len(set(uuids)) == size
            and set(must) <= set(uuids)
            and all(free.get(u) for u in uuids)
        ):
            return [must[u][0] if u in must else free[u][0] for u in uuids], n
    # Spread: one replica of each GPU, the GPUs with the most free replicas
    # (the least shared) first, by index; then more replicas if it must.
    index = {g.uuid: g.index for g in replicas.gpus}
    order = sorted(free, key=lambda u: (-len(free[u]), index[u]))
    used = set(chosen)
    for u in order:
        if len(chosen) == size:
            break
        if u not in must:
            chosen.append(free[u][0])
            used.add(free[u][0])
    for u in order:
        for d in free[u]:
            if len(chosen) == size:
                break
            if d not in used:
                chosen.append(d)
                used.add(d)
    return chosen, None
