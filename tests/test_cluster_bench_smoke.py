"""The scheduling benchmark (make bench-cluster, tests/bench/cluster_bench.py)
on a few nodes and pods, so it cannot rot: both runs bind every pod through
the real kube-scheduler, the run with the extender binds through it (its
counters), and the section has its table and verdict."""

from __future__ import annotations

from pathlib import Path

from tests.bench.cluster_bench import TITLE, bench, section
from tests.k8s_cluster import KubeTest


def test_the_cluster_benchmark_runs_small(k8s: KubeTest, tmp_path: Path) -> None:
    runs = bench(k8s, nodes=3, pods=8, workdir=tmp_path, timeout=120)
    assert [r.name for r in runs] == ["without", "with-extender"]
    assert [r.bound for r in runs] == [8, 8]
    assert all(r.per_second > 0 for r in runs)
    verbs = runs[1].verbs
    assert verbs is not None
    assert verbs["bind"][0] >= 8  # every pod was bound by the extender
    assert verbs["filter"][0] >= 8
    assert runs[0].verbs is None
    text = section(runs)
    assert text.startswith(TITLE)
    assert "| without | 3 x 8 | 8 | 8 |" in text
    assert "| with-extender | 3 x 8 | 8 | 8 |" in text
    assert "Goal: the extender costs kube-scheduler less than half its throughput" in text
