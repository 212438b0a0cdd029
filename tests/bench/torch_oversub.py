"""Memory oversubscription on a real GPU with PyTorch (make bench-gpu).

Under CUDA_OVERSUBSCRIBE=true a container is guaranteed G = quota / S of
device memory and whatever it allocates beyond is served from host memory
(docs/oversubscription.md).  The loop holds float32 tensors that total
1.5 x G (--guarantee-gib; S = 2, so the quota is 2 x G and holds them all),
with no node directory, so that the container never borrows beyond its
guarantee: a third of the tensors, or more with PyTorch's own memory, are
spilled whatever the GPU's size.  Each step adds 1 to every tensor (reads
and writes all of it) and synchronises, so the rate is the memory traffic
the loop sustains; at the end every element is checked to hold the number
of steps taken.

Cases, each with PyTorch's native caching allocator (cuMemAlloc) and with
its cudaMallocAsync backend (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync,
the stream-ordered path):
- oversubscribed: the interposer, quota 2 x G, CUDA_OVERSUBSCRIBE=true, S = 2;
- on the device: the interposer, the same quota, no oversubscription (the
  GPU must have room for 1.5 x G: the default G, 8 GiB, needs 12 GiB);
- no interposer.

Columns: whether the loop ran to the end (or the error it raised), steps/s
and GB/s (bytes read and written) over the measured window, the
oversubscribed rate as a percentage of the on-device one, what
torch.cuda.mem_get_info() said inside the container, and the bytes the
interposer spilled (gv_device_get_spilled).

Run as `python3 -m tests.bench.torch_oversub [--lib build/libgpuvisor.so]
[--out DIR]` with a Python that has PyTorch and nvidia-ml-py.  Without an
NVIDIA GPU it says so in one line and exits 0 (nothing measured).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pynvml

GiB = 1 << 30
MiB = 1 << 20
CHUNK = 256 * MiB  # one tensor
SCALING = "2"

WORKER = r"""
import ctypes, json, os, sys, time
import torch
total, chunk = int(sys.argv[1]), int(sys.argv[2])
warm, seconds = float(sys.argv[3]), float(sys.argv[4])
out = {"pid": os.getpid()}
def spilled():
    try:
        f = ctypes.CDLL(None).gv_device_get_spilled
    except AttributeError:
        return None
    v = ctypes.c_uint64()
    return v.value if f(0, ctypes.byref(v)) == 0 else None
try:
    ts = [torch.zeros(chunk // 4, device="cuda", dtype=torch.float32)
          for _ in range(total // chunk)]
    free, tot = torch.cuda.mem_get_info()
    out["mem_get_info"] = [free, tot]
    out["spilled"] = spilled()
    steps, t0, start = 0, time.monotonic(), None
    while True:
        for t in ts:
            t.add_(1)
        torch.cuda.synchronize()
        steps += 1
        now = time.monotonic()
        if start is None and now - t0 >= warm:
            start, counted = now, steps
        elif start is not None and now - start >= seconds:
            break
    out["rate"] = (steps - counted) / (now - start)
    out["correct"] = all(bool((t == steps).all()) for t in ts)
    out["tensor_bytes"] = len(ts) * chunk
except torch.cuda.OutOfMemoryError as e:
    out["error"] = "OutOfMemoryError: " + str(e).splitlines()[0][:160]
print(json.dumps(out), flush=True)
"""

CASES = (
    ("oversubscribed", True, True),
    ("on the device", True, False),
    ("no interposer", False, False),
)
ALLOCATORS = (("native", None), ("cudaMallocAsync", "backend:cudaMallocAsync"))


def case_env(
    base: dict[str, str],
    lib: Path,
    region: Path,
    guarantee: int,
    interposer: bool,
    oversubscribe: bool,
    alloc_conf: str | None,
) -> dict[str, str]:
    """A worker's environment: the interposer with a quota of twice the
    guarantee (oversubscribed: S = 2, no node directory), or none."""
    env = {
        k: v
        for k, v in base.items()
        if not k.startswith(("CUDA_DEVICE_", "GPUVISOR_", "GPU_CORE_", "CUDA_OVERSUBSCRIBE"))
        and k not in {"LD_PRELOAD", "PYTORCH_CUDA_ALLOC_CONF"}
    }
    env["CUDA_VISIBLE_DEVICES"] = "0"
    if alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    if not interposer:
        return env
    env["LD_PRELOAD"] = str(lib)
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(region)
    env["CUDA_DEVICE_MEMORY_LIMIT"] = f"{2 * guarantee // MiB}m"
    env["GPUVISOR_NODE_LOCK"] = ""
    if oversubscribe:
        env["CUDA_OVERSUBSCRIBE"] = "true"
        env["GPUVISOR_MEMORY_SCALING"] = SCALING
    return env


def tensor_total(guarantee: int) -> int:
    """1.5 x the guarantee, in whole tensors."""
    return (3 * guarantee // 2) // CHUNK * CHUNK


def run_case(env: dict[str, str], total: int, warm: float, seconds: float) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, str(total), str(CHUNK), str(warm), str(seconds)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {proc.returncode}: {tail[:200]}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def row(allocator: str, case: str, r: dict[str, Any], on_device: float | None) -> str:
    """One table row; on_device: the on-device case's steps/s, if known."""
    if "error" in r:
        return f"| {allocator} | {case} | no: {r['error']} | - | - | - | - | - |"
    rate = float(r["rate"])
    gbs = rate * 2 * int(r["tensor_bytes"]) / 1e9
    share = f"{100 * rate / on_device:.1f}" if on_device else "-"
    free, total = r["mem_get_info"]
    spilled = "-" if r.get("spilled") is None else f"{int(r['spilled']) / GiB:.2f}"
    ran = "yes" if r.get("correct") else "yes, but wrong sums"
    return (
        f"| {allocator} | {case} | {ran} | {rate:.2f} | {gbs:.0f} | {share} "
        f"| {free / GiB:.2f} / {total / GiB:.2f} | {spilled} |"
    )


HEADER = (
    "| allocator | case | ran to the end | steps/s | GB/s | % of on the device "
    "| mem_get_info free / total GiB | spilled GiB |\n|---|---|---|---:|---:|---:|---|---:|"
)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", type=Path, default=Path("build/libgpuvisor.so"))
    ap.add_argument("--out", type=Path, default=None, help="write torch_oversub.json, .md here")
    ap.add_argument("--guarantee-gib", type=float, default=8.0)
    ap.add_argument("--warm", type=float, default=2.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    a = ap.parse_args(argv)
    if not a.lib.is_file():
        print(f"torch_oversub: --lib {a.lib}: no such file (run make first)", file=sys.stderr)
        return 2
    try:
        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
    except pynvml.NVMLError as e:
        print(f"torch_oversub: skipped: NVML: {e} (needs an NVIDIA GPU)", file=sys.stderr)
        return 0
    guarantee = int(a.guarantee_gib * GiB)
    total = tensor_total(guarantee)
    lines = [
        f"GPU: {name}; tensors {total / GiB:.1f} GiB = 1.5 x a guarantee of "
        f"{guarantee / GiB:.1f} GiB (quota {2 * guarantee / GiB:.1f} GiB, S = {SCALING}); "
        f"{a.seconds:g} s measured after {a.warm:g} s",
        "",
        HEADER,
    ]
    print("\n".join(lines), flush=True)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gv-oversub-") as tmp:
        for allocator, conf in ALLOCATORS:
            got: dict[str, dict[str, Any]] = {}
            for i, (case, interposer, over) in enumerate(CASES):
                region = Path(tmp) / f"{allocator}-{i}.shr"
                env = case_env(dict(os.environ), a.lib, region, guarantee, interposer, over, conf)
                got[case] = run_case(env, total, a.warm, a.seconds)
            base = got["on the device"].get("rate")
            for case, *_ in CASES:
                text = row(allocator, case, got[case], float(base) if base else None)
                print(text, flush=True)
                lines.append(text)
                results.append({"allocator": allocator, "case": case, **got[case]})
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "torch_oversub.json").write_text(json.dumps(results, indent=1))
        (a.out / "torch_oversub.md").write_text("\n".join(lines) + "\n")
    failed = [r for r in results if r["case"] == "oversubscribed" and "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
