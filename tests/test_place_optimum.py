"""The benchmark's exact-optimum baseline (tests/bench/place_bench.py) obeys the allocator's rules.

The optimum is only a fair yardstick if it allows exactly what the
allocator allows: a rule it forgets makes the optimum too generous (the
allocator then looks worse than it is), a rule it adds makes it too strict
(the allocator could beat it).  Each case is a tiny trace where the answer
is known by hand, checked against both.
"""

from __future__ import annotations

from typing import Any

import pytest
from gpuvisor.cluster.allocator import Allocator, Config
from gpuvisor.cluster.request import pod_request

from tests.bench.place_bench import optimum, run_trace, small_cluster, trace
from tests.inventories import A100_40GB_PROFILES, cluster, ctr, gpu, inventory, mig_state, pod

MIG = {"nvidia.com/vgpu-mode": "mig"}


def one_a100(instances: list[tuple[str, int, bool]] | None = None) -> dict[str, Any]:
    """One A100-40GB in MIG mode (7 compute slices: a 1g instance gives 15 % of the cores)."""
    mig = mig_state(A100_40GB_PROFILES, True, instances or [])
    return cluster(inventory("a", [gpu("a", 0, "NVIDIA A100-SXM4-40GB", 40960, 0, mig)], [["X"]]))


@pytest.mark.parametrize(
    ("pods", "expected"),
    [
        # 1 GPU with 1000 MiB and 30 % cores: no 1g (15 %) or 2g (29 %) instance
        # is enough, a 3g (43 %) is; seven such pods do not fit, two do (3g at 0 and 4)
        ([ctr(gpu=1, gpumem=1000, gpucores=30)] * 3, 2),
        # 15 % cores fit a 1g instance: seven of them
        ([ctr(gpu=1, gpumem=1000, gpucores=15)] * 8, 7),
        # an exclusive request asks for the whole GPU's memory: no instance is that big
        ([ctr(gpu=1)], 0),
        # 9000 MiB: a 1g.10gb (two memory slices, at 0, 2, 4 or 6) each
        ([ctr(gpu=1, gpumem=9000)] * 5, 4),
    ],
)
def test_optimum_counts_what_the_allocator_allows(pods: list[Any], expected: int) -> None:
    doc = one_a100()
    reqs = [pod_request(pod(f"p{i}", c, annotations=MIG)) for i, c in enumerate(pods)]
    assert optimum(doc, reqs, 10) == expected
    assert run_trace(Allocator.from_cluster(doc, Config()), reqs).placed == expected


def test_allocator_never_beats_the_optimum() -> None:
    """On the benchmark's small instances (short traces, so it stays fast)."""
    doc = small_cluster()
    for seed in range(100, 106):
        reqs = [pod_request(p) for p in trace(seed, 6, scale=0.5)]
        reqs = [r for r in reqs if max(c.count for c in r.containers) <= 4]
        ours = run_trace(Allocator.from_cluster(doc, Config()), reqs).placed
        assert ours <= optimum(doc, reqs, 10), seed
