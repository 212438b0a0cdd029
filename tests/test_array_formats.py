"""CUDA arrays in formats whose elements are not NumChannels x 4 bytes.

Since CUDA 11.5 an array may hold 8- and 16-bit normalized integers
(CU_AD_FORMAT_UNORM_INT8X4, ...: the channel count is in the format's
name), block-compressed texels (BC1-BC7: Width and Height count texels,
memory holds 4x4 blocks of 8 or 16 bytes, so 0.5 or 1 byte a texel) and
NV12 (a Y plane of one byte a texel and a half-height plane of
interleaved U/V bytes: 1.5 bytes a texel).  The runtime hands the driver
the NumChannels of cudaCreateChannelDesc: 4 for BC1/2/3/7, 1 for BC4, 2
for BC5, 3 for BC6H and NV12.

Later CUDA versions added video formats: semi-planar (a Y plane and an
interleaved U/V plane: NV12, P010, NV16, P210, ...), planar (three planes)
and packed YUV (YUY2, Y210, AYUV, Y410, Y416, ...), and 10-10-10-2 RGBA;
VIDEO_FORMATS below gives each one's planes.

The interposer reserved 4 bytes a channel for every format it did not
know, and an ordinary array's charge stays at that estimate: a 16384 x
16384 BC1 texture (128 MiB) was refused under a 1 GiB quota (estimated at
4 GiB), a 4096 x 4096 UNORM_INT8X4 image (64 MiB) was charged 256 MiB;
the simulated driver refused these formats altogether.
"""

from __future__ import annotations

import re

import pytest

from tests.helpers import REPO_ROOT, MiB, SimNode, run_json

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
    return int(run_json(PHYSICAL, node.env))


# Make one array (cuArrayCreate, cuArray3DCreate, or a 13-level
# cuMipmappedArrayCreate) under a 1 GiB quota; what the container, the
# region and the device held with it, and after it was destroyed.
MAKE = """
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
if "{api}" == "cuMipmappedArrayCreate":
    err, a = call(cu.cuMipmappedArrayCreate, d, 13)
    destroy = cu.cuMipmappedArrayDestroy
else:
    err, a = call(cu.{api}, d)
    destroy = cu.cuArrayDestroy
held = used()
region = Region.attach().used(0)
env = {{k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}}
phys = int(subprocess.run([sys.executable, "-c", {physical!r}], env=env,
                          capture_output=True, text=True, check=True).stdout)
if err == SUCCESS:
    ok(destroy, a)
emit(err=err.name, base=base, held=held, region=region, phys=phys, after=used())
"""


def made_and_charged(
    node: SimNode, api: str, fmt: str, channels: int, width: int, height: int, size: int
) -> None:
    """The array is charged size bytes, the region and the device hold as
    much, and it all goes back."""
    code = MAKE.format(
        api=api, fmt=fmt, channels=channels, width=width, height=height, physical=PHYSICAL
    )
    out = run_json(PRELUDE + code, node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="1g"))
    assert out["err"] == "CUDA_SUCCESS", out
    assert out["base"] == SIM_CONTEXT, out
    assert out["held"] - out["base"] == size, out
    assert out["region"] == out["held"], out
    assert out["phys"] == out["held"], out  # charged == what the device holds
    assert out["after"] == SIM_CONTEXT, out
    assert physical_used(node) == 0


@pytest.mark.parametrize(("fmt", "channels", "width", "height", "size"), FORMATS)
@pytest.mark.parametrize("api", ["cuArrayCreate", "cuArray3DCreate"])
def test_an_array_is_charged_what_its_format_takes(node, api, fmt, channels, width, height, size):
    made_and_charged(node, api, fmt, channels, width, height, size)


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


# Planes of the video and packed formats: (bytes, texels across, rows) for
# each group of texels a plane stores together.  A semi-planar format is a
# Y plane and a plane of interleaved U/V samples (one pair for every 2x2
# texels in 4:2:0, 2x1 in 4:2:2, 1x1 in 4:4:4); a planar one has separate U
# and V planes; a packed 4:2:2 one stores Y0 U Y1 V for every two texels.
# 10-bit samples are held in 16 bits (P010, Y210), as FOURCC defines them.
def semi(sample: int, across: int, down: int) -> list[tuple[int, int, int]]:
    return [(sample, 1, 1), (2 * sample, across, down)]


def planar(sample: int, across: int, down: int) -> list[tuple[int, int, int]]:
    return [(sample, 1, 1), (sample, across, down), (sample, across, down)]


# (format, NumChannels, planes, MiB a 4096 x 4096 array takes).  The
# channel counts are those CUDA documents for the format (its runtime's
# cudaChannelFormatKind where it has one); P010/P016/NV16/P210/P216 take 3,
# as NV12 does, Y410 (A, Y, U, V) 4.
VIDEO_FORMATS = [
    ("UNORM_INT_101010_2", 4, [(4, 1, 1)], 64),
    ("UINT8_PACKED_422", 4, [(4, 2, 1)], 32),
    ("UINT8_PACKED_444", 4, [(4, 1, 1)], 64),
    ("UINT8_SEMIPLANAR_420", 3, semi(1, 2, 2), 24),
    ("UINT16_SEMIPLANAR_420", 3, semi(2, 2, 2), 48),
    ("UINT8_SEMIPLANAR_422", 3, semi(1, 2, 1), 32),
    ("UINT16_SEMIPLANAR_422", 3, semi(2, 2, 1), 64),
    ("UINT8_SEMIPLANAR_444", 3, semi(1, 1, 1), 48),
    ("UINT16_SEMIPLANAR_444", 3, semi(2, 1, 1), 96),
    ("UINT8_PLANAR_420", 3, planar(1, 2, 2), 24),
    ("UINT16_PLANAR_420", 3, planar(2, 2, 2), 48),
    ("UINT8_PLANAR_422", 3, planar(1, 2, 1), 32),
    ("UINT16_PLANAR_422", 3, planar(2, 2, 1), 64),
    ("UINT8_PLANAR_444", 3, planar(1, 1, 1), 48),
    ("UINT16_PLANAR_444", 3, planar(2, 1, 1), 96),
    ("NV12", 3, semi(1, 2, 2), 24),
    ("P010", 3, semi(2, 2, 2), 48),
    ("P016", 3, semi(2, 2, 2), 48),
    ("NV16", 3, semi(1, 2, 1), 32),
    ("P210", 3, semi(2, 2, 1), 64),
    ("P216", 3, semi(2, 2, 1), 64),
    ("YUY2", 2, [(4, 2, 1)], 32),
    ("Y210", 2, [(8, 2, 1)], 64),
    ("Y216", 2, [(8, 2, 1)], 64),
    ("AYUV", 4, [(4, 1, 1)], 64),
    ("Y410", 4, [(4, 1, 1)], 64),
    ("Y416", 4, [(8, 1, 1)], 128),
    ("Y444_PLANAR8", 3, planar(1, 1, 1), 48),
    ("Y444_PLANAR10", 3, planar(2, 1, 1), 96),
    ("YUV444_8bit_SemiPlanar", 3, semi(1, 1, 1), 48),
    ("YUV444_16bit_SemiPlanar", 3, semi(2, 1, 1), 96),
]


def level_bytes(planes: list[tuple[int, int, int]], width: int, height: int) -> int:
    """One level: each plane's rows padded to 512 bytes."""
    total = 0
    for nbytes, across, down in planes:
        row = -(-width // across) * nbytes
        total += -(-row // 512) * 512 * -(-height // down)
    return total


def mipmap_bytes(planes: list[tuple[int, int, int]], width: int, height: int) -> int:
    """Every level down to 1 x 1, rounded up to 2 MiB once."""
    total = 0
    while True:
        total += level_bytes(planes, width, height)
        if width == height == 1:
            return -(-total // (2 * MiB)) * 2 * MiB
        width, height = max(width // 2, 1), max(height // 2, 1)


# The formats the project's own header declares: the ones both drivers size.
DECLARED = set(
    re.findall(r"\b(CU_AD_FORMAT_\w+)\s*=", (REPO_ROOT / "native/include/gv_cuda.h").read_text())
)


def test_every_format_the_bindings_define_is_charged_what_the_device_takes(node):
    """Every CUarray_format value the installed cuda-bindings define
    (CU_AD_FORMAT_MAX aside) is made, 4096 x 4096, with the first channel
    count the simulated driver takes: the interposer's charge is the size
    the device gives the same array made for deferred mapping (the only kind
    cuArrayGetMemoryRequirements answers).  A format that native/include/
    gv_cuda.h does not declare (from a later cuda-bindings 13.x) and the
    simulated driver refuses is skipped with a note, so that a release of
    the bindings cannot fail CI on its own; a declared one refused fails."""
    code = """
init()
dev = ok(cu.cuDeviceGet, 0)
def desc(fmt, ch, flags):
    d = cu.CUDA_ARRAY3D_DESCRIPTOR()
    d.Width, d.Height, d.Depth = 4096, 4096, 0
    d.Format, d.NumChannels, d.Flags = fmt, ch, flags
    return d
out = {}
for fmt in cu.CUarray_format:
    if fmt.name == "CU_AD_FORMAT_MAX":
        continue
    for ch in (1, 2, 3, 4):
        err, a = call(cu.cuArray3DCreate, desc(fmt, ch, cu.CUDA_ARRAY3D_DEFERRED_MAPPING))
        if err == SUCCESS:
            break
    if err != SUCCESS:
        out[fmt.name] = [err.name]
        continue
    size = int(ok(cu.cuArrayGetMemoryRequirements, a, dev).size)
    ok(cu.cuArrayDestroy, a)
    base = used()
    a = ok(cu.cuArray3DCreate, desc(fmt, ch, 0))
    charged = used() - base
    ok(cu.cuArrayDestroy, a)
    out[fmt.name] = [ch, size, charged]
emit(**out)
"""
    out = run_json(PRELUDE + code, node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="1g"))
    assert len(out) > len(FORMATS) + len(VIDEO_FORMATS), out
    for name, got in out.items():
        if isinstance(got[0], str):  # the simulated driver refused it
            assert name not in DECLARED, (name, got)
            print(f"{name} is not in gv_cuda.h: declare it and size it in both drivers")
            continue
        ch, size, charged = got
        assert size > 0, (name, ch)
        assert charged == size, (name, ch, size, charged)


@pytest.mark.parametrize(
    ("fmt", "channels", "planes", "mib"), VIDEO_FORMATS, ids=[f for f, *_ in VIDEO_FORMATS]
)
@pytest.mark.parametrize("api", ["cuArrayCreate", "cuArray3DCreate", "cuMipmappedArrayCreate"])
def test_a_video_format_is_charged_what_its_planes_take(node, api, fmt, channels, planes, mib):
    """Multi-planar and packed YUV formats, and 10-10-10-2 RGBA, made under
    a quota: the charge is what their planes take (as the simulated device
    lays them out), the device holds as much, and it all goes back.  The
    interposer took every one of them at 4 bytes a channel: a 4096 x 4096
    P010 frame (48 MiB) was charged 192 MiB, a YUY2 one (32 MiB) 128."""
    assert level_bytes(planes, 4096, 4096) == mib * MiB
    size = mipmap_bytes(planes, 4096, 4096) if api == "cuMipmappedArrayCreate" else mib * MiB
    made_and_charged(node, api, fmt, channels, 4096, 4096, size)
