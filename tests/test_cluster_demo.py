"""`make demo-cluster` (tests/demo_cluster.py) runs to its summary: every
pod placed by the real kube-scheduler through the extender onto the two
simulated nodes, each container running with what its pod asked, and the
pod that fits nowhere refused with the extender's reasons."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.helpers import clean_env, run_cmd
from tests.k8s_cluster import binaries


def test_the_cluster_demo_ends_with_its_summary(tmp_path: Path, build_dir: Path) -> None:
    binaries()  # skips (or fails in CI) without `make k8s`, like the other cluster tests
    demo = [sys.executable, "-m", "tests.demo_cluster", "--keep", str(tmp_path)]
    proc = run_cmd(demo, clean_env(), timeout=400)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    summary = out[out.index("=== Summary") :]
    assert "5 of 6 pods placed; all as asked" in summary
    # where each went, and why
    assert "notebook (1 GPU, 3000 MiB, 30 % cores) -> node-" in summary
    assert "on-40gb (1 GPU, 8000 MiB, 25 %, only an A100 40GB) -> node-a" in summary
    assert "node-b filtered out: GPU type NVIDIA RTX A6000 not in nvidia.com/use-gputype" in summary
    # the 2-GPU pod that wants good links gets an NVLink pair (read from the simulated NVML)
    assert "'tier': 'NVLink', 'best_tier': 'NVLink'" in summary
    assert "why: extender scores: node-" in summary
    assert "allocator's terms: node_policy=" in summary
    assert "too-big (1 GPU of 100000 MiB: more than any GPU has) -> not placed" in summary
    assert "needs 1 GPU with 100000 MiB and 10% cores free" in summary
    # what each got: cuMemGetInfo's total and the library's SM limit, as asked
    assert "got: main: asked 1 GPU x 3000 MiB, 30 %; got GPU " in summary
    assert ": 3000 MiB, SM limit 30 %" in summary
    assert "got: serve: asked 1 GPU x 6000 MiB, 40 %; got GPU " in summary
    assert ": 6000 MiB, SM limit 40 %" in summary
    assert "MISMATCH" not in out
