"""Every interception path, from a C program linked with -lcuda -lnvidia-ml.

The program (native/tests/t_link_intercept.c) checks exported symbols,
dlsym on dlopen'ed driver handles (RTLD_NEXT included) and
cuGetProcAddress(_v2) with ABI versions and per-thread-stream flags.
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers import SimNode, run_cmd


def test_all_three_layers(node: SimNode, build_dir: Path) -> None:
    env = node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="1g")
    proc = run_cmd([str(build_dir / "tests" / "t_link_intercept")], env, 60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "OK"


def test_linked_program_without_shim_sees_physical(node: SimNode, build_dir: Path) -> None:
    """Control: without the preload the same program sees the physical 16 GiB
    and its quota checks fail, so the test above really measures the shim."""
    proc = run_cmd(
        [str(build_dir / "tests" / "t_link_intercept")],
        dict(node.env, CUDA_DEVICE_MEMORY_LIMIT="1g"),
        60,
    )
    assert proc.returncode == 1
    assert "needs LD_PRELOAD" in proc.stderr
