"""The workload of `gpuvisor demo`: hold some memory, keep the GPU busy, and
optionally try to grow past the memory quota.

    python -m gpuvisor.supervisor.demo.workload --seconds 20 --hold 1g \
        [--grow-to 6g --step 512m --every 1] [--backend driver|torch]

It runs on device 0 of what CUDA_VISIBLE_DEVICES leaves visible.  It
allocates --hold in --step chunks, then launches kernels back to back for
--seconds; every --every seconds, until it holds --grow-to, it asks for one
more --step and counts a refusal when the driver answers out of memory.
Nothing it does knows about gpuvisor: the quota is whatever the interposer
enforces.  The last line of its output is a JSON summary.

Backends: `driver` (ctypes, the simulated GPU's `spin` kernel, which runs
for as many microseconds as its parameter) and `torch` (a real GPU: float16
matmuls, allocations through PyTorch's caching allocator).
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import click
from gpuvisor.shim.driver import CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, CudaError, Driver
from gpuvisor.shim.limits import parse_memory_limit


@dataclass
class Tally:
    total: int = 0  # the device's total memory as the workload sees it
    held: int = 0
    refused: int = 0
    launches: int = 0


class DriverBackend:
    """The simulated GPU through the driver API (ctypes)."""

    def __init__(self) -> None:
        self.drv = Driver()
        self.drv.init()
        self.fn = self.drv.function(b"gpuvisor-demo", "spin")
        self.stream = self.drv.stream()
        self.rng = random.Random(7)
        self.ptrs: list[int] = []

    def total(self) -> int:
        return int(self.drv.mem_get_info()[1])

    def alloc(self, nbytes: int) -> bool:
        rc, ptr = self.drv.mem_alloc(nbytes)
        if rc == CUDA_SUCCESS:
            self.ptrs.append(ptr)
            return True
        if rc == CUDA_ERROR_OUT_OF_MEMORY:
            return False
        raise CudaError("cuMemAlloc_v2", rc)

    def launch(self) -> None:
        # 0.2 .. 3 ms kernels; the grid size says nothing about the duration.
        self.drv.launch_u32(
            self.fn, self.stream, self.rng.randint(200, 3000), self.rng.randint(1, 64)
        )

    def finish(self) -> None:
        self.drv.synchronize(self.stream)
        for ptr in self.ptrs:
            self.drv.mem_free(ptr)


class TorchBackend:
    """A real GPU through PyTorch."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
        self.b = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
        self.blocks: list[object] = []
        self.n = 0

    def total(self) -> int:
        return int(self.torch.cuda.mem_get_info()[1])

    def alloc(self, nbytes: int) -> bool:
        try:
            self.blocks.append(self.torch.empty(nbytes, dtype=self.torch.uint8, device="cuda"))
        except self.torch.cuda.OutOfMemoryError:
            return False
        return True

    def launch(self) -> None:
        self.torch.matmul(self.a, self.b)
        self.n += 1
        if self.n % 16 == 0:  # keep the queue short, like a training step
            self.torch.cuda.synchronize()

    def finish(self) -> None:
        self.torch.cuda.synchronize()
        self.blocks.clear()


def _size(text: str | None) -> int:
    return 0 if text is None else int(parse_memory_limit(text, 1 << 40))


def run(
    backend: DriverBackend | TorchBackend,
    seconds: float,
    hold: int,
    grow_to: int,
    step: int,
    every: float,
    say: Callable[[str], None],
) -> Tally:
    tally = Tally(total=backend.total())
    say(f"the device's total memory, as this process sees it: {tally.total >> 20} MiB")

    def grow() -> bool:
        if backend.alloc(step):
            tally.held += step
            return True
        tally.refused += 1
        say(f"allocation of {step >> 20} MiB refused (holding {tally.held >> 20} MiB)")
        return False

    while tally.held + step <= hold and grow():
        pass
    say(f"holding {tally.held >> 20} MiB; computing for {seconds:g} s")
    end = time.monotonic() + seconds
    next_grow = time.monotonic() + every
    while (now := time.monotonic()) < end:
        if grow_to > tally.held and now >= next_grow:
            grow()
            next_grow = now + every
        backend.launch()
        tally.launches += 1
    backend.finish()
    return tally


@click.command()
@click.option("--seconds", type=float, default=20.0, show_default=True)
@click.option("--hold", default="1g", show_default=True, help="Memory taken at the start.")
@click.option("--grow-to", default=None, help="Keep asking for more memory, up to this.")
@click.option("--step", default="512m", show_default=True, help="Size of each allocation.")
@click.option("--every", type=float, default=1.0, show_default=True, help="Seconds between asks.")
@click.option("--backend", type=click.Choice(["driver", "torch"]), default="driver")
def main(
    seconds: float, hold: str, grow_to: str | None, step: str, every: float, backend: str
) -> None:
    """A demo workload: hold memory, compute, and try to grow past the quota."""

    def say(text: str) -> None:
        click.echo(text)
        sys.stdout.flush()

    impl: DriverBackend | TorchBackend = TorchBackend() if backend == "torch" else DriverBackend()
    tally = run(impl, seconds, _size(hold), _size(grow_to), _size(step), every, say)
    say(json.dumps(asdict(tally)))


if __name__ == "__main__":
    main()
