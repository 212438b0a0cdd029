"""GPUVISOR_SIM_TOPOLOGY: the simulated NVML's topology answers, through
nvidia-ml-py, on three kinds of node; and bad topology files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import missing_build_outputs, run_json, run_py
from tests.topohelp import (
    PCIE_LINKS,
    dgx,
    nvlink_pairs,
    pcie_two_switches,
    topo_node,
)

pytestmark = pytest.mark.skipif(bool(missing_build_outputs()), reason="run make first")

# Every topology call, as nvidia-ml-py makes it, for every GPU (and pair).
QUERY = """
import ctypes, json
import pynvml as n

def err(f, *a):
    try:
        return f(*a)
    except n.NVMLError as e:
        return "error: " + type(e).__name__

n.nvmlInit()
hs = [n.nvmlDeviceGetHandleByIndex(i) for i in range(n.nvmlDeviceGetCount())]
bus = [n.nvmlDeviceGetPciInfo(h).busId for h in hs]
bus = [b.decode() if isinstance(b, bytes) else b for b in bus]
index_of = {b: i for i, b in enumerate(bus)}
links = []
for h in hs:
    mine = []
    for link in range(n.NVML_NVLINK_MAX_LINKS):
        state = err(n.nvmlDeviceGetNvLinkState, h, link)
        if isinstance(state, str):
            mine.append(state)
            break
        if not state:
            mine.append(None)
            continue
        kind = n.nvmlDeviceGetNvLinkRemoteDeviceType(h, link)
        remote = n.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId
        remote = remote.decode() if isinstance(remote, bytes) else remote
        mine.append([kind, index_of.get(remote, remote)])
    links.append(mine)
level = [[n.nvmlDeviceGetTopologyCommonAncestor(a, b) for b in hs] for a in hs]
nearest = {
    str(lv): [[index_of[n.nvmlDeviceGetPciInfo(d).busId] for d in
               n.nvmlDeviceGetTopologyNearestGpus(h, lv)] for h in hs]
    for lv in (10, 20, 30, 40, 50)
}
p2p = {
    str(idx): [[n.nvmlDeviceGetP2PStatus(a, b, idx) for b in hs] for a in hs]
    for idx in (0, 1, 2, 3, 4)
}
by_bus = [index_of[n.nvmlDeviceGetPciInfo(n.nvmlDeviceGetHandleByPciBusId(b)).busId]
          for b in bus]
print(json.dumps({
    "bus": bus, "by_bus": by_bus, "links": links, "level": level, "nearest": nearest,
    "p2p": p2p, "numa": [n.nvmlDeviceGetNumaNodeId(h) for h in hs],
    "names": [n.nvmlDeviceGetName(h) for h in hs],
    "memory": [n.nvmlDeviceGetMemoryInfo(h).total >> 20 for h in hs],
}))
"""

NAMES = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


def query(tmp_path: Path, topology: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = run_json(QUERY, topo_node(tmp_path, topology).env)
    return result


def pcie_names(level: list[list[int]]) -> list[list[str]]:
    return [[NAMES[v] for v in row] for row in level]


def check_nearest(r: dict[str, Any]) -> None:
    """NearestGpus(level) is every other GPU whose common ancestor is at that level or nearer."""
    n = len(r["level"])
    for lv, per_gpu in r["nearest"].items():
        for a in range(n):
            want = [b for b in range(n) if b != a and r["level"][a][b] <= int(lv)]
            assert sorted(per_gpu[a]) == want, (lv, a)


def test_nvlink_pairs(tmp_path: Path) -> None:
    r = query(tmp_path, nvlink_pairs())
    assert r["names"] == ["NVIDIA A100-SXM4-80GB"] * 4
    assert r["memory"] == [81920] * 4
    assert r["numa"] == [0, 0, 1, 1]
    assert r["by_bus"] == [0, 1, 2, 3]
    # the PCIe path alone: the pairs share a switch, the sockets do not
    assert pcie_names(r["level"]) == [
        ["X", "PIX", "SYS", "SYS"],
        ["PIX", "X", "SYS", "SYS"],
        ["SYS", "SYS", "X", "PIX"],
        ["SYS", "SYS", "PIX", "X"],
    ]
    peer = {0: 1, 1: 0, 2: 3, 3: 2}
    for g, links in enumerate(r["links"]):
        # all 12 links active, each to the pair's other GPU; link 12 is past the last
        assert links[:12] == [[0, peer[g]]] * 12  # NVML_NVLINK_DEVICE_TYPE_GPU
        assert links[12] == "error: NVMLError_InvalidArgument"
    nvlink, read, atomics, pci = r["p2p"]["2"], r["p2p"]["0"], r["p2p"]["3"], r["p2p"]["4"]
    assert nvlink[0][1] == nvlink[2][3] == 0  # NVML_P2P_STATUS_OK
    assert nvlink[0][2] == 5  # NVML_P2P_STATUS_NOT_SUPPORTED
    assert atomics[0][1] == 0
    assert atomics[1][2] == 5
    assert read[0][1] == 0
    assert read[1][3] == 1
    assert pci[0][1] == 0
    assert pci[0][3] == 1
    check_nearest(r)


def test_nvswitch(tmp_path: Path) -> None:
    r = query(tmp_path, dgx())
    assert r["names"] == ["NVIDIA H100 80GB HBM3"] * 8
    assert r["memory"] == [81559] * 8
    assert r["numa"] == [0, 0, 0, 0, 1, 1, 1, 1]
    for links in r["links"]:
        assert len(links) == 19  # 18 links, then InvalidArgument
        assert all(kind == 2 for kind, _ in links[:18])  # NVML_NVLINK_DEVICE_TYPE_SWITCH
        # the other end is an NVSwitch: a bus that is no GPU's
        assert all(isinstance(bus, str) for _, bus in links[:18])
    assert all(r["p2p"]["2"][a][b] == 0 for a in range(8) for b in range(8) if a != b)
    assert pcie_names(r["level"])[0] == ["X", "PIX", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS"]
    check_nearest(r)


def test_pcie_two_switches_per_socket(tmp_path: Path) -> None:
    r = query(tmp_path, pcie_two_switches())
    assert pcie_names(r["level"]) == PCIE_LINKS
    # A30s have NVLink (4 links) but no bridge: every link inactive
    for links in r["links"]:
        assert links == [None, None, None, None, "error: NVMLError_InvalidArgument"]
    assert all(r["p2p"]["2"][a][b] == 5 for a in range(8) for b in range(8) if a != b)
    assert r["p2p"]["0"][4][5] == 0
    assert r["p2p"]["0"][0][4] == 1
    assert r["memory"] == [24576] * 8
    check_nearest(r)


def test_without_nvlink_the_calls_say_not_supported(tmp_path: Path) -> None:
    topo = {
        "gpus": [{"model": "Some GPU", "memory": "24g"}, {"model": "Some GPU", "memory": "24g"}]
    }
    r = query(tmp_path, topo)
    assert r["links"] == [["error: NVMLError_NotSupported"]] * 2
    assert pcie_names(r["level"]) == [["X", "NODE"], ["NODE", "X"]]
    assert r["memory"] == [24576, 24576]


def test_devices_spec_node_has_defaults(tmp_path: Path) -> None:
    """Without a topology file: NUMA node 0, a host bridge each, no NVLink."""
    node = topo_node(tmp_path, "{}")
    del node.env["GPUVISOR_SIM_TOPOLOGY"]
    node.env["GPUVISOR_SIM_DEVICES"] = "2x16g"
    r = run_json(QUERY, node.env)
    assert r["numa"] == [0, 0]
    assert pcie_names(r["level"]) == [["X", "NODE"], ["NODE", "X"]]
    assert r["links"] == [["error: NVMLError_NotSupported"]] * 2


# ---- bad topology files -------------------------------------------------------------------

GOOD_GPU = {"model": "NVIDIA A100-SXM4-80GB"}

BAD: list[tuple[str, str]] = [
    ('{"gpus": [', "not valid JSON at line 1 column 11: unexpected end of file"),
    (
        '{"gpus": [{"model": "NVIDIA A30",}]}',
        "not valid JSON at line 1 column 34: expected a key string",
    ),
    ('{"gpus": [{"model": "x", "memory": 1.5}]}', "numbers must be integers"),
    ("[]", "the document is an array, not an object"),
    ("{}", "gpus: missing"),
    ('{"gpus": []}', "gpus: must be a list of 1 to 16 GPUs"),
    (
        json.dumps({"gpus": [GOOD_GPU], "nvswich": True}),
        ": nvswich: unknown field (known: gpus, nvlink, nvswitch)",
    ),
    (json.dumps({"gpus": [{"model": "NVIDIA A30", "numa": "0"}]}), "gpus[0].numa: is a string"),
    (json.dumps({"gpus": [{"model": "NVIDIA A30", "numa": -1}]}), "gpus[0].numa: -1 is not"),
    (json.dumps({"gpus": [{"memory": "8g"}]}), "gpus[0].model: missing"),
    (json.dumps({"gpus": [GOOD_GPU, {"model": "X"}]}), "gpus[1].memory: missing, and model"),
    (json.dumps({"gpus": [{"model": "X", "memory": "8q"}]}), 'gpus[0].memory: "8q" is not'),
    (json.dumps({"gpus": [{"model": "X", "memory": "8g", "mig": True}]}), "gpus[0].mig:"),
    (json.dumps({"gpus": [{"model": "NVIDIA A30", "color": 1}]}), "gpus[0].color: unknown"),
    (json.dumps({"gpus": [{**GOOD_GPU, "uuid": "MIG-1"}]}), "gpus[0].uuid: must be"),
    (json.dumps({"gpus": [GOOD_GPU], "nvlink": [[0, 1, 2]]}), "nvlink[0]: GPU 0 or 1 is not"),
    (json.dumps({"gpus": [GOOD_GPU] * 2, "nvlink": [[0, 1]]}), "nvlink[0]: must be [gpu, gpu"),
    (json.dumps({"gpus": [GOOD_GPU] * 2, "nvlink": [[0, 0, 2]]}), "nvlink[0]: links GPU 0 to"),
    (
        json.dumps({"gpus": [GOOD_GPU] * 3, "nvlink": [[0, 1, 8], [0, 2, 8]]}),
        "nvlink[1]: GPU 0 would have 16 NVLinks, more than its 12",
    ),
    (
        json.dumps({"gpus": [GOOD_GPU] * 2, "nvswitch": True, "nvlink": [[0, 1, 2]]}),
        "nvlink: every NVLink goes to the NVSwitches",
    ),
    (
        json.dumps({"gpus": [{"model": "X", "memory": "8g"}], "nvswitch": True}),
        "nvswitch: GPU 0 (X) has no NVLinks",
    ),
    (json.dumps({"gpus": [GOOD_GPU], "nvswitch": 1}), "nvswitch: is an integer, not true"),
]


@pytest.mark.parametrize(("text", "message"), BAD)
def test_bad_topology_file_fails_with_one_line(tmp_path: Path, text: str, message: str) -> None:
    node = topo_node(tmp_path, text)
    code = """
        import pynvml
        from cuda.bindings import driver
        print(driver.cuInit(0)[0].name)
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            print("nvml:", type(e).__name__)
    """
    cp = run_py(code, node.env)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.split() == ["CUDA_ERROR_INVALID_VALUE", "nvml:", "NVMLError_Unknown"]
    lines = [line for line in cp.stderr.splitlines() if line.startswith("gpuvisor-sim:")]
    path = node.env["GPUVISOR_SIM_TOPOLOGY"]
    # one line (each library says it once), naming the file and the field
    assert len(set(lines)) == 1, cp.stderr
    assert lines[0].startswith(f"gpuvisor-sim: GPUVISOR_SIM_TOPOLOGY={path}: "), lines[0]
    assert message in lines[0], lines[0]
    assert not Path(node.env["GPUVISOR_SIM_STATE"]).exists()


def test_missing_topology_file(tmp_path: Path) -> None:
    node = topo_node(tmp_path, "{}")
    node.env["GPUVISOR_SIM_TOPOLOGY"] = str(tmp_path / "nope.json")
    cp = run_py("import pynvml\npynvml.nvmlInit()", node.env)
    assert cp.returncode != 0
    assert f"GPUVISOR_SIM_TOPOLOGY={tmp_path / 'nope.json'}: cannot open" in cp.stderr


def test_topology_takes_the_place_of_devices(tmp_path: Path) -> None:
    node = topo_node(tmp_path, nvlink_pairs())
    node.env["GPUVISOR_SIM_DEVICES"] = "1x16g"
    r = run_json(
        """
        import json
        from cuda.bindings import driver as d
        d.cuInit(0)
        n = d.cuDeviceGetCount()[1]
        print(json.dumps([d.cuDeviceTotalMem(i)[1] >> 20 for i in range(n)]))
        """,
        node.env,
    )
    assert r == [81920] * 4
