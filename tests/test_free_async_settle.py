"""A stream-ordered free of a cuMemAlloc block gives its charge back as soon
as a hook of the freeing process can know the free happened, and the other
processes of the container see it then, with no later call from that one.

cuMemFreeAsync of a plain block keeps its charge until the stream reaches
the free (pending_free.c): an event is recorded behind it, and a hook that
finds the event complete releases the charge.  cuStreamDestroy was no such
hook: a program that freed into a stream and destroyed it kept the block
charged until its next allocation, cuMemGetInfo or synchronisation, and
meanwhile another process of the container, reading the shared region, saw
the memory used and was refused an allocation that fits.  The process
holding the free here makes no CUDA call after its last one (it waits on
its stdin), and the other asks for 512 MiB next to its 768 MiB block under
a 1 GiB quota.
"""

from __future__ import annotations

import pytest

from tests.helpers import Holder, MiB, SimNode, run_json

SIM_CONTEXT = 32 * MiB
OOM = "CUDA_ERROR_OUT_OF_MEMORY"

# The call after which the free is known to have happened (the stream got
# there), in the process that freed; `s` is the stream, `ctx` its context.
LAST_CALLS = {
    "cuStreamDestroy": "ok(cu.cuStreamDestroy, s)",
    "cuStreamSynchronize": "ok(cu.cuStreamSynchronize, s)",
    "cuCtxSynchronize": "ok(cu.cuCtxSynchronize)",
    "cuEventSynchronize": "e = ok(cu.cuEventCreate, 0)\n"
    "ok(cu.cuEventRecord, e, s)\n"
    "ok(cu.cuEventSynchronize, e)",
    "cuCtxDestroy": "ok(cu.cuCtxDestroy, ctx)",
}

FREER = """
import ctypes, time
from tests.cuclient import *
ctx = init(create=True)
s = ok(cu.cuStreamCreate, 0)
spin = ok(cu.cuModuleGetFunction, ok(cu.cuModuleLoadData, b"any image"), b"spin")
p = ok(cu.cuMemAlloc, 768 * MiB)
if {kernel_us}:
    ok(cu.cuLaunchKernel, spin, 1, 1, 1, 32, 1, 1, 0, s, (({kernel_us},), (ctypes.c_uint32,)), 0)
ok(cu.cuMemFreeAsync, p, s)
time.sleep({sleep})
{last}
hold()
"""

OTHER = """
from tests.cuclient import *
init()
seen = used()
err, q = call(cu.cuMemAlloc, 512 * MiB)
emit(seen=seen, err=err.name)
"""


def other_process(node: SimNode) -> dict[str, object]:
    out: dict[str, object] = run_json(OTHER, node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="1g"))
    return out


# idle: nothing queued before the free; reached: a 0.2 s kernel before it,
# over by the last call (0.5 s later, no CUDA call in between).
@pytest.mark.parametrize(("kernel_us", "sleep"), [(0, 0), (200_000, 0.5)], ids=["idle", "reached"])
@pytest.mark.parametrize("last", list(LAST_CALLS))
def test_another_process_sees_the_free_once_the_stream_got_there(node, last, kernel_us, sleep):
    code = FREER.format(kernel_us=kernel_us, sleep=sleep, last=LAST_CALLS[last])
    with Holder(code, node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="1g")):
        out = other_process(node)
    # Its own context, and the freer's, or nothing of it once destroyed.
    contexts = 1 if last == "cuCtxDestroy" else 2
    assert out["seen"] == contexts * SIM_CONTEXT, out
    assert out["err"] == "CUDA_SUCCESS", out


def test_a_stream_destroyed_before_it_reaches_the_free_keeps_the_charge(node):
    """cuStreamDestroy returns at once, and the driver frees the block only
    when the stream's queued work is done: until then the block is charged,
    and the other process is refused."""
    code = FREER.format(kernel_us=5_000_000, sleep=0, last=LAST_CALLS["cuStreamDestroy"])
    with Holder(code, node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="1g")):
        out = other_process(node)
    assert out["seen"] == 2 * SIM_CONTEXT + 768 * MiB, out
    assert out["err"] == OOM, out


def test_the_freeing_process_nvml_reading_releases_a_free_reached_after_the_destroy(node):
    """The stream is destroyed while busy (1 s kernel), so the free is still
    pending then; 1.2 s later, with no CUDA call since, the process reads
    its memory through NVML.  cuMemGetInfo released the frees the streams
    had reached before reading, NVML's query did not: it showed the 768 MiB
    block used after the device had freed it."""
    code = FREER.format(kernel_us=1_000_000, sleep=0, last=LAST_CALLS["cuStreamDestroy"])
    code = (
        "import pynvml\n"
        "pynvml.nvmlInit()\n"
        "h = pynvml.nvmlDeviceGetHandleByIndex(0)\n"
        + code.replace(
            "hold()",
            "busy = pynvml.nvmlDeviceGetMemoryInfo(h).used\n"
            "time.sleep(1.2)\n"
            "emit(busy=busy, done=pynvml.nvmlDeviceGetMemoryInfo(h).used)",
        )
    )
    out = run_json(code, node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="1g"))
    assert out["busy"] == SIM_CONTEXT + 768 * MiB, out  # not freed yet: still charged
    assert out["done"] == SIM_CONTEXT, out
