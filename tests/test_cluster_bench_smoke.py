"""The scheduling benchmark (make bench-cluster, tests/bench/cluster_bench.py)
on a few nodes and pods, so it cannot rot: both runs bind every pod through
the real kube-scheduler, the run with the extender binds through it (its
counters), each of two rounds against a fresh kube-scheduler, and the section
has its per-round table and its verdict on the median ratio."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from tests.bench.cluster_bench import TITLE, BindWatch, bench, create_pods, pairs, ratio, section
from tests.k8s_cluster import KubeTest


def test_the_cluster_benchmark_runs_small(k8s: KubeTest, tmp_path: Path) -> None:
    runs = bench(k8s, nodes=3, pods=8, workdir=tmp_path, timeout=120, rounds=2)
    assert [(r.round, r.name) for r in runs] == [
        (1, "without"),
        (1, "with-extender"),
        (2, "without"),
        (2, "with-extender"),
    ]
    assert [r.bound for r in runs] == [8, 8, 8, 8]
    assert all(r.per_second > 0 for r in runs)
    for r in runs[1::2]:
        # each round's extender is fresh: its counters are that round's alone
        verbs = r.verbs
        assert verbs is not None
        assert 8 <= verbs["bind"][0] < 16  # every pod was bound by the extender
        assert verbs["filter"][0] >= 8
    assert runs[0].verbs is None
    assert runs[2].verbs is None
    ratios = [ratio(p) for p in pairs(runs)]
    assert len(ratios) == 2
    assert all(x > 0 for x in ratios)
    text = section(runs)
    assert text.startswith(TITLE)
    for n in (1, 2):
        assert f"| {n} | without | 3 x 8 | 8 | 8 |" in text
        assert f"| {n} | with-extender | 3 x 8 | 8 | 8 |" in text
    assert "Goal: the extender costs kube-scheduler less than half its throughput" in text
    assert f"{statistics.median(ratios):.0%} of the rate without, median (the 2 rounds:" in text


def test_the_bind_watch_resumes_when_the_apiserver_ends_its_stream(k8s: KubeTest) -> None:
    # Under make bench-cluster the apiserver's watch cache closes the bench's
    # pod watch when its buffer stays full (apiserver_terminated_watchers_total,
    # docs/benchmarks.md): the stream just ends, as it does at timeoutSeconds.
    # Here timeoutSeconds 1 ends it several times while the pods are bound one
    # by one: every bind is still counted, when it happened, with no list.
    k8s.create_node("resume-node", gpus=80)
    create_pods(k8s, 6, "nobody-schedules-these", "resume")
    watch = BindWatch(k8s, "resume", 6, watch_seconds=1)
    bound_at: dict[str, tuple[float, float]] = {}
    try:
        for i in range(6):
            time.sleep(0.7)  # the stream ends between binds
            name = f"resume-{i:05d}"
            began = time.monotonic()
            k8s.bind(name, "resume-node")
            bound_at[name] = (began, time.monotonic())
        assert watch.done.wait(30), f"seen bound: {sorted(watch.bound)}; ends: {watch.ends}"
    finally:
        watch.stop()
    assert sorted(watch.bound) == sorted(bound_at)
    assert len(watch.ends) >= 2, watch.ends  # the stream did end mid-run
    assert all(e.startswith("closed by the apiserver after") for e in watch.ends), watch.ends
    assert (watch.relists, watch.late) == (0, 0)
    names = sorted(bound_at)
    for name, next_name in zip(names, [*names[1:], None], strict=True):
        # seen after its bind began, and before the next pod's bind
        assert watch.bound[name] >= bound_at[name][0], name
        if next_name is not None:
            assert watch.bound[name] < bound_at[next_name][0], name
