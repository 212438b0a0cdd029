"""`make demo`: show a container's GPU memory quota at work.

Two processes of one "container" (one region file) share a 4 GiB quota on
a 16 GiB simulated GPU, or on the real GPU when one is present:

  A  cuMemGetInfo reports the quota as the total, then A takes 3 GiB;
  B  sees A's usage, is refused 2 GiB with CUDA_ERROR_OUT_OF_MEMORY, gets
     512 MiB, and NVML (nvidia-ml-py) reports the quota too;
  finally the region's accounting, read through the C API.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import click

from .driver import CUDA_SUCCESS, Driver, result_name
from .hardware import real_gpu_present
from .loader import preload_env
from .region import Region

GiB = 1 << 30
MiB = 1 << 20
LIMIT = "4g"


def _gib(n: int) -> str:
    return f"{n / GiB:6.2f} GiB"


def _say(role: str, text: str) -> None:
    click.echo(f"  [{role}] {text}")


def _mem_line(role: str, drv: Driver, note: str = "") -> None:
    free, total = drv.mem_get_info()
    _say(role, f"cuMemGetInfo: free {_gib(free)} / total {_gib(total)}{note}")


def _alloc(role: str, drv: Driver, nbytes: int) -> int | None:
    rc, ptr = drv.mem_alloc(nbytes)
    size = f"{nbytes // GiB} GiB" if nbytes >= GiB else f"{nbytes // MiB} MiB"
    _say(role, f"cuMemAlloc({size}) -> {result_name(rc)}")
    return ptr if rc == CUDA_SUCCESS else None


def _nvml_line(role: str, uuid: str) -> None:
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        _say(role, f"NVML memory info:  used {_gib(mem.used)} / total {_gib(mem.total)}")
    finally:
        pynvml.nvmlShutdown()


def _role_plain() -> None:
    drv = Driver()
    drv.init()
    _mem_line("-", drv, "   (no shim: the whole GPU)")


def _role_a() -> None:
    drv = Driver()
    drv.init()
    _mem_line("A", drv, "   (total = the quota)")
    ptr = _alloc("A", drv, 3 * GiB)
    _mem_line("A", drv)
    click.echo("READY", nl=True)
    sys.stdout.flush()
    sys.stdin.readline()  # hold the memory until the parent is done
    if ptr is not None:
        drv.mem_free(ptr)


def _role_b() -> None:
    drv = Driver()
    dev = drv.init()
    _mem_line("B", drv, "   (sees A's 3 GiB)")
    _alloc("B", drv, 2 * GiB)
    small = _alloc("B", drv, 512 * MiB)
    _mem_line("B", drv)
    _nvml_line("B", drv.uuid(dev))
    if small is not None:
        drv.mem_free(small)


def _child(role: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "gpuvisor.shim.demo", "--role", role],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _run(role: str, env: dict[str, str]) -> None:
    proc = _child(role, env)
    out, _ = proc.communicate(timeout=60)
    click.echo(out, nl=False)
    if proc.returncode != 0:
        raise click.ClickException(f"demo process {role} failed (exit {proc.returncode})")


def _region_table(path: Path, pids: dict[int, str]) -> None:
    region = Region.attach(path)
    reclaimed = region.reclaim_dead()
    click.echo(f"region {path} (read through the C API):")
    if reclaimed:
        click.echo(f"  ({reclaimed} slot(s) of exited processes reclaimed)")
    for dev in region.devices():
        limit = "unlimited" if dev.limit is None else _gib(dev.limit)
        click.echo(
            f"  device {dev.index} {dev.uuid}: limit {limit}, used {_gib(dev.used)}, "
            f"physical {_gib(dev.physical_total)}, refused allocations {dev.oom_count}"
        )
        for pid in region.processes():
            used = region.process_used(pid, dev.index)
            click.echo(f"    pid {pid} ({pids.get(pid, '?')}): {_gib(used)}")


def _demo(simulate: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="gpuvisor-demo-") as tmp:
        base = dict(os.environ)
        for key in ("CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DISABLE_CONTROL", "CUDA_VISIBLE_DEVICES"):
            base.pop(key, None)
        base["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(Path(tmp) / "region.shr")
        if simulate:
            base["GPUVISOR_SIM_STATE"] = str(Path(tmp) / "sim.state")
            base["GPUVISOR_SIM_DEVICES"] = "16g"
            where = "a simulated 16 GiB GPU"
        else:
            where = "the real GPU 0"
        plain = preload_env(base, simulate=simulate)
        plain.pop("LD_PRELOAD")  # the simulator, without the shim
        shimmed = preload_env(base, simulate=simulate)
        shimmed["CUDA_DEVICE_MEMORY_LIMIT"] = LIMIT

        click.echo(f"gpuvisor demo on {where}")
        click.echo("before: a process without gpuvisor")
        _run("plain", plain)
        click.echo(f"after: two processes of one container, CUDA_DEVICE_MEMORY_LIMIT={LIMIT}")
        a = _child("a", shimmed)
        if a.stdout is None or a.stdin is None:
            raise click.ClickException("demo process A has no pipes")
        try:
            for line in a.stdout:
                if line.strip() == "READY":
                    break
                click.echo(line, nl=False)
            else:
                raise click.ClickException("demo process A failed before allocating")
            _run("b", shimmed)
            _region_table(Path(shimmed["CUDA_DEVICE_MEMORY_SHARED_CACHE"]), {a.pid: "A"})
        finally:
            a.stdin.write("\n")
            a.stdin.flush()
            a.wait(timeout=60)


@click.command()
@click.option("--role", type=click.Choice(["plain", "a", "b"]), hidden=True)
@click.option(
    "--simulate/--real",
    default=None,
    help="Use the simulated GPU / the real one (default: the real GPU when present).",
)
def main(role: str | None, simulate: bool | None) -> None:
    """Show CUDA_DEVICE_MEMORY_LIMIT at work on two processes."""
    if role is not None:
        {"plain": _role_plain, "a": _role_a, "b": _role_b}[role]()
        return
    if simulate is None:
        simulate = not real_gpu_present()
    _demo(simulate)


if __name__ == "__main__":
    main()
