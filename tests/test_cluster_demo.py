"""`make demo-cluster` (tests/demo_cluster.py) runs to its summary: every
pod placed by the real kube-scheduler through the extender onto the two
simulated nodes, each container running with what its pod asked, and the
pod that fits nowhere refused with the extender's reasons."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.helpers import clean_env, run_cmd
from tests.k8s_cluster import binaries

# Lines of the demo's summary: what it must say.
SUMMARY = (
    "5 of 6 pods placed; all as asked",
    # where each went, and why
    "notebook (1 GPU, 3000 MiB, 30 % cores) -> node-",
    "on-40gb (1 GPU, 8000 MiB, 25 %, only an A100 40GB) -> node-a",
    "node-b filtered out: GPU type NVIDIA RTX A6000 not in nvidia.com/use-gputype",
    # the 2-GPU pod that wants good links gets an NVLink pair (read from the simulated NVML)
    "'tier': 'NVLink', 'best_tier': 'NVLink'",
    "why: extender scores: node-",
    "allocator's terms: node_policy=",
    "too-big (1 GPU of 100000 MiB: more than any GPU has) -> not placed",
    "needs 1 GPU with 100000 MiB and 10% cores free",
    # what each got: cuMemGetInfo's total and the library's SM limit, as asked
    "got: main: asked 1 GPU x 3000 MiB, 30 %; got GPU ",
    ": 3000 MiB, SM limit 30 %",
    "got: serve: asked 1 GPU x 6000 MiB, 40 %; got GPU ",
    ": 6000 MiB, SM limit 40 %",
)


def test_the_cluster_demo_ends_with_its_summary(tmp_path: Path, build_dir: Path) -> None:
    binaries()  # skips (or fails in CI) without `make k8s`, like the other cluster tests
    demo = [sys.executable, "-m", "tests.demo_cluster", "--keep", str(tmp_path)]
    proc = run_cmd(demo, clean_env(), timeout=400)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    summary = out[out.index("=== Summary") :]
    missing = [line for line in SUMMARY if line not in summary]
    assert missing == [], summary
    assert "MISMATCH" not in out
