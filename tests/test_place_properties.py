"""Allocator properties (hypothesis): no decision over-commits; MIG plans never overlap."""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

from gpuvisor.cluster.allocator import Allocator, Config, Conflict
from gpuvisor.cluster.request import pod_request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.inventories import cluster, ctr, dgx, mig_box, pairs_box, pcie_box, pod

NODES = {
    "dgx": lambda n: dgx(n),
    "pairs-mig": lambda n: pairs_box(n, mig=True),
    "pcie": lambda n: pcie_box(n, 4, memory_mib=24000),
    "mig": lambda n: mig_box(n, 2, instances=[("3g.40gb", 4, True), ("1g.10gb", 0, False)]),
}

containers = st.one_of(
    st.builds(
        lambda m, c: ctr(gpu=1, gpumem=m, gpucores=c),
        st.integers(500, 30000),
        st.integers(0, 100),
    ),
    st.builds(lambda p: ctr(gpu=1, gpumem_percentage=p), st.integers(1, 100)),
    st.builds(lambda n: ctr(gpu=n), st.sampled_from([1, 2, 4])),
    st.builds(
        lambda m, n: ctr(gpu=n, gpumem=m, gpucores=10), st.integers(500, 20000), st.integers(1, 3)
    ),
)
pod_annotations = st.fixed_dictionaries(
    {},
    optional={
        "nvidia.com/vgpu-mode": st.sampled_from(["mig", "hami-core"]),
        "hami.io/gpu-scheduler-policy": st.sampled_from(["binpack", "spread", "topology-aware"]),
        "hami.io/node-scheduler-policy": st.sampled_from(["binpack", "spread"]),
    },
)
# init containers: (container, whether it is a sidecar: restartPolicy Always)
pods = st.lists(
    st.tuples(
        st.lists(containers, min_size=1, max_size=2),
        st.lists(st.tuples(containers, st.booleans()), max_size=2),
        pod_annotations,
    ),
    min_size=1,
    max_size=25,
)


def manifest(
    k: int,
    spec: tuple[list[dict[str, Any]], list[tuple[dict[str, Any], bool]], dict[str, str]],
):
    apps, inits, ann = spec
    for i, c in enumerate(apps):
        c["name"] = f"c{i}"
    for i, (c, sidecar) in enumerate(inits):
        c["name"] = f"i{i}"
        if sidecar:
            c["restartPolicy"] = "Always"
    return pod(f"p{k}", *apps, annotations=ann, init=[c for c, _ in inits])


def plus(a: tuple[int, int, int], b: tuple[int, int, int]) -> tuple[int, int, int]:
    return a[0] + b[0], a[1] + b[1], a[2] + b[2]


def check_invariants(a: Allocator) -> None:
    split = a.config.split_count
    for st_ in a.nodes.values():
        # recompute usage from the allocations alone: it must match the state
        slots: Counter[int] = Counter()
        mem: Counter[int] = Counter()
        cores: Counter[int] = Counter()
        masks: dict[int, list[int]] = {}
        for alloc, _charge in st_.pods.values():
            # Kubernetes' count, per GPU and dimension: what runs at once at
            # each step of the pod's start (each plain init container beside
            # the sidecars before it), and at the end (the sidecars and the
            # app containers), whichever is most
            steps: list[dict[int, tuple[int, int, int]]] = []
            up: dict[int, tuple[int, int, int]] = {}  # the sidecars started so far
            last: dict[int, list[tuple[int, int, int]]] = {}
            for c in alloc.containers:
                mine: dict[int, tuple[int, int, int]] = {}
                for g in c.gpus:
                    if g.mig is not None:
                        masks.setdefault(g.index, []).append(g.mig.placement.mask)
                        continue
                    s0, m0, c0 = mine.get(g.index, (0, 0, 0))
                    mine[g.index] = (s0 + 1, m0 + g.memory_mib, c0 + g.cores)
                    # one container's vGPUs are on distinct GPUs
                    assert s0 == 0
                if c.init and not c.sidecar:
                    step = dict(up)
                    for i, v in mine.items():
                        step[i] = plus(step.get(i, (0, 0, 0)), v)
                    steps.append(step)
                    continue
                if c.sidecar:
                    for i, v in mine.items():
                        up[i] = plus(up.get(i, (0, 0, 0)), v)
                for i, v in mine.items():
                    last.setdefault(i, []).append(v)
            for i in set(last) | {i for m in steps for i in m}:
                app = [sum(x) for x in zip(*last.get(i, [(0, 0, 0)]), strict=True)]
                top = [max([app[d]] + [m[i][d] for m in steps if i in m]) for d in range(3)]
                slots[i] += top[0]
                mem[i] += top[1]
                cores[i] += top[2]
        for i, g in enumerate(st_.inv.gpus):
            assert st_.slots[i] == slots[i] <= split
            assert st_.mem[i] == mem[i] <= g.memory_mib
            assert st_.cores[i] == cores[i] <= 100
            if slots[i] and st_.mig_on[i]:
                raise AssertionError(f"shared grant on GPU {i} in MIG mode")
            # MIG: placements pairwise disjoint, legal, clear of instances in use
            taken = st_.fixed[i]
            for mask in masks.get(i, []):
                assert not taken & mask, "MIG placements overlap"
                taken |= mask
            assert taken & st_.mig_used[i] == st_.mig_used[i]
        for alloc, _charge in st_.pods.values():
            for c in alloc.containers:
                for g in c.gpus:
                    if g.mig is None:
                        continue
                    mig = st_.inv.gpus[g.index].mig
                    assert mig is not None
                    prof = next(p for p in mig.profiles if p.id == g.mig.profile_id)
                    assert g.mig.placement in prof.placements
                    assert g.memory_mib == prof.memory_mib


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kinds=st.lists(st.sampled_from(sorted(NODES)), min_size=1, max_size=3),
    specs=pods,
    hami=st.booleans(),
    releases=st.lists(st.integers(0, 30), max_size=5),
)
def test_no_decision_overcommits(kinds, specs, hami, releases):
    doc = cluster(*(NODES[k](f"n{i}") for i, k in enumerate(kinds)))
    cfg = Config(rules="hami", gpu_policy="spread") if hami else Config(split_count=4)
    a = Allocator.from_cluster(doc, cfg)
    placed = []
    for k, spec in enumerate(specs):
        d = a.place(pod_request(manifest(k, spec)))
        if d.node:
            placed.append(d.pod.name)
        check_invariants(a)
        if k in releases and placed:
            assert a.release(placed.pop(0))
            check_invariants(a)
    for name in placed:
        assert a.release(name)
    for st_ in a.nodes.values():
        assert not any(st_.slots)
        assert not any(st_.mem)
        assert not any(st_.mig_used)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=pods)
def test_back_to_back_decisions_on_one_state_never_overcommit(specs):
    """Decide every pod on the same state (as racing threads would), then commit all."""
    a = Allocator.from_cluster(cluster(pcie_box("a", 2, memory_mib=24000), mig_box("m", 1)))
    decisions = [a.decide(pod_request(manifest(k, s))) for k, s in enumerate(specs)]
    for d in decisions:
        if d.node:
            with contextlib.suppress(Conflict):  # a lost race is refused, never applied
                a.commit(d)
        check_invariants(a)
