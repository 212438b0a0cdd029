"""CUDA arrays in formats whose elements are not NumChannels x 4 bytes.

Since CUDA 11.5 an array may hold 8- and 16-bit normalized integers
(CU_AD_FORMAT_UNORM_INT8X4, ...: the channel count is in the format's
name), block-compressed texels (BC1-BC7: Width and Height count texels,
memory holds 4x4 blocks of 8 or 16 bytes, so 0.5 or 1 byte a texel) and
NV12 (a Y plane of one byte a texel and a half-height plane of
interleaved U/V bytes: 1.5 bytes a texel).  The runtime hands the driver
the NumChannels of cudaCreateChannelDesc: 4 for BC1/2/3/7, 1 for BC4, 2
for BC5, 3 for BC6H and NV12.

The interposer reserved 4 bytes a channel for every format it did not
know, and an ordinary array's charge stays at that estimate: a 16384 x
16384 BC1 texture (128 MiB) was refused under a 1 GiB quota (estimated at
4 GiB), a 4096 x 4096 UNORM_INT8X4 image (64 MiB) was charged 256 MiB;
the simulated driver refused these formats altogether.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import MiB, SimNode, run_json

SIM_CONTEXT = 32 * MiB
PRELUDE = "from tests.cuclient import *\n"

PHYSICAL = """
import pynvml
pynvml.nvmlInit()
print(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
"""

# (format, NumChannels, width, height, bytes the texels take)
FORMATS = [
    ("UNORM_INT8X4", 4, 4096, 4096, 64 * MiB),
    ("SNORM_INT8X1", 1, 8192, 8192, 64 * MiB),
    ("UNORM_INT16X2", 2, 4096, 4096, 64 * MiB),
    ("SNORM_INT16X4", 4, 4096, 2048, 64 * MiB),
    ("BC1_UNORM", 4, 16384, 16384, 128 * MiB),  # 8 bytes a 4x4 block
    ("BC4_UNORM", 1, 8192, 8192, 32 * MiB),
    ("BC5_SNORM", 2, 8192, 8192, 64 * MiB),  # 16 bytes a 4x4 block
    ("BC6H_UF16", 3, 4096, 4096, 16 * MiB),
    ("BC7_UNORM_SRGB", 4, 8192, 8192, 64 * MiB),
    ("NV12", 3, 4096, 4096, 24 * MiB),
]


def physical_used(node: SimNode) -> int:
    """The simulated device's own figure (NVML, no interposer)."""
    out = subprocess.run(
        [sys.executable, "-c", PHYSICAL],
        env=node.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return int(out.stdout)


@pytest.mark.parametrize(("fmt", "channels", "width", "height", "size"), FORMATS)
@pytest.mark.parametrize("api", ["cuArrayCreate", "cuArray3DCreate"])
def test_an_array_is_charged_what_its_format_takes(node, api, fmt, channels, width, height, size):
    code = f"""
import os, subprocess, sys
from gpuvisor.shim.region import Region
init()
if "{api}" == "cuArrayCreate":
    d = cu.CUDA_ARRAY_DESCRIPTOR()
else:
    d = cu.CUDA_ARRAY3D_DESCRIPTOR()
    d.Depth = 0
    d.Flags = 0
d.Width, d.Height = {width}, {height}
d.Format = cu.CUarray_format.CU_AD_FORMAT_{fmt}
d.NumChannels = {channels}
base = used()
err, a = call(cu.{api}, d)
held = used()
region = Region.attach().used(0)
env = {{k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}}
phys = int(subprocess.run([sys.executable, "-c", {PHYSICAL!r}], env=env,
                          capture_output=True, text=True, check=True).stdout)
if err == SUCCESS:
    ok(cu.cuArrayDestroy, a)
emit(err=err.name, base=base, held=held, region=region, phys=phys, after=used())
"""
    out = run_json(PRELUDE + code, node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="1g"))
    assert out["err"] == "CUDA_SUCCESS", out
    assert out["base"] == SIM_CONTEXT, out
    assert out["held"] - out["base"] == size, out
    assert out["region"] == out["held"], out
    assert out["phys"] == out["held"], out  # charged == what the device holds
    assert out["after"] == SIM_CONTEXT, out
    assert physical_used(node) == 0


def test_a_block_compressed_mipmapped_array_is_charged_what_the_device_holds(node):
    """Each level of a BC1 mipmapped array holds ceil(w/4) x ceil(h/4)
    blocks of 8 bytes; the level count is clamped as for any format."""
    code = f"""
import os, subprocess, sys
init()
d = cu.CUDA_ARRAY3D_DESCRIPTOR()
d.Width, d.Height, d.Depth = 16384, 16384, 0
d.Format = cu.CUarray_format.CU_AD_FORMAT_BC1_UNORM
d.NumChannels = 4
d.Flags = 0
base = used()
m = ok(cu.cuMipmappedArrayCreate, d, 20)
held = used()
env = {{k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}}
phys = int(subprocess.run([sys.executable, "-c", {PHYSICAL!r}], env=env,
                          capture_output=True, text=True, check=True).stdout)
ok(cu.cuMipmappedArrayDestroy, m)
emit(base=base, held=held, phys=phys, after=used())
"""
    out = run_json(PRELUDE + code, node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="1g"))
    # 15 levels (16384 down to 1 texel), each rows of blocks padded to
    # 512 bytes, the whole rounded up to 2 MiB: 172 MiB, 128 of them level 0.
    size = 0
    for level in range(15):
        blocks = -(-max(16384 >> level, 1) // 4)
        size += -(-blocks * 8 // 512) * 512 * blocks
    assert out["held"] - out["base"] == -(-size // (2 * MiB)) * 2 * MiB == 172 * MiB, out
    assert out["phys"] == out["held"], out
    assert out["after"] == SIM_CONTEXT, out


def test_an_unknown_format_is_still_refused_by_the_driver(node):
    """A format value CUDA does not define is the driver's to refuse
    (CUDA_ERROR_INVALID_VALUE), and it charges nothing."""
    code = """
import ctypes
lib = ctypes.CDLL("libcuda.so.1")
init()
class Desc(ctypes.Structure):
    _fields_ = [("Width", ctypes.c_size_t), ("Height", ctypes.c_size_t),
                ("Format", ctypes.c_int), ("NumChannels", ctypes.c_uint)]
a = ctypes.c_void_p()
base = used()
rc = lib.cuArrayCreate_v2(ctypes.byref(a), ctypes.byref(Desc(1024, 1024, 0x77, 4)))
emit(rc=rc, base=base, after=used())
"""
    out = run_json(PRELUDE + code, node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="1g"))
    assert out["rc"] == 1, out
    assert out["after"] == out["base"], out
