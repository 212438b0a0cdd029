"""`gpuvisor inventory`: the JSON document (docs/inventory.md) and the human
view, read through NVML from simulated nodes of each kind."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import missing_build_outputs, run_cli, run_py
from tests.topohelp import (
    DGX_LINKS,
    NVLINK_PAIRS_LINKS,
    PCIE_LINKS,
    dgx,
    make_3g_instance,
    nvlink_pairs,
    pcie_two_switches,
    topo_node,
)

pytestmark = pytest.mark.skipif(bool(missing_build_outputs()), reason="run make first")


def inventory_json(env: dict[str, str]) -> Any:
    cp = run_cli("inventory", "--simulate", "--json", "--node", "n1", env=env)
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout)


@pytest.mark.parametrize(
    ("topology", "links"),
    [(nvlink_pairs, NVLINK_PAIRS_LINKS), (dgx, DGX_LINKS), (pcie_two_switches, PCIE_LINKS)],
)
def test_document_per_topology(tmp_path: Path, topology: Any, links: list[list[str]]) -> None:
    topo = topology()
    doc = inventory_json(topo_node(tmp_path, topo).env)
    assert doc["kind"] == "gpuvisor.io/node-inventory"
    assert doc["version"] == 1
    assert doc["node"] == "n1"
    assert doc["driver_version"] == "580.65.06"
    assert doc["links"] == links
    assert [g["index"] for g in doc["gpus"]] == list(range(len(topo["gpus"])))
    for i, (g, spec) in enumerate(zip(doc["gpus"], topo["gpus"], strict=True)):
        assert g["model"] == spec["model"]
        assert g["numa"] == spec["numa"]
        assert g["pci_bus_id"] == f"00000000:{i:02X}:00.0"
        assert g["uuid"].startswith("GPU-")
        assert g["healthy"] is True
        assert g["mig"]["capable"] is True
        assert g["mig"]["mode"] == "disabled"
        assert g["mig"]["instances"] == []
        assert g["mig"]["remaining"] == {}


def test_mig_state_in_the_document_and_the_table(tmp_path: Path) -> None:
    topo = {
        "gpus": [
            {"model": "NVIDIA A100-SXM4-80GB", "mig": True, "numa": 0},
            {"model": "Some GPU", "memory": "24g", "numa": 1},
        ]
    }
    node = topo_node(tmp_path, topo)
    make_3g_instance(
        node, 4, "n.nvmlDeviceCreateGpuInstance(d, 19)  # a 1g.10gb with no compute instance"
    )
    doc = inventory_json(node.env)
    gpu, plain = doc["gpus"]
    assert plain["mig"] is None
    assert plain["memory_mib"] == 24576
    mig = gpu["mig"]
    assert mig["mode"] == "enabled"
    assert (mig["memory_slices"], mig["compute_slices"]) == (8, 7)
    by_name = {p["name"]: p for p in mig["profiles"]}
    assert by_name["3g.40gb"] == {
        "id": 9,
        "name": "3g.40gb",
        "memory_mib": 40192,
        "memory_slices": 4,
        "compute_slices": 3,
        "max_count": 2,
        "placements": [{"start": 0, "size": 4}, {"start": 4, "size": 4}],
    }
    assert sorted(by_name) == sorted(
        ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]
    )
    big, small = sorted(mig["instances"], key=lambda i: -i["memory_mib"])
    assert big["gi_id"] == 2
    assert big["profile"] == "3g.40gb"
    assert big["placement"] == {"start": 4, "size": 4}
    assert big["uuid"].startswith("MIG-")
    assert big["in_use"] is False
    assert big["compute_instances"] == [
        {
            "ci_id": 0,
            "profile_id": 2,
            "profile": "3g.40gb",
            "placement": {"start": 0, "size": 3},
            "uuid": big["uuid"],
        }
    ]
    assert small["gi_id"] == 7  # the first free eighth: slice 0
    assert small["placement"] == {"start": 0, "size": 1}
    assert small["uuid"] is None
    assert small["compute_instances"] == []
    # slices 1-3 and 3 compute slices are left
    assert mig["remaining"] == {
        "1g.10gb": 3,
        "1g.10gb+me": 1,
        "1g.20gb": 1,
        "2g.20gb": 1,
        "3g.40gb": 0,
        "4g.40gb": 0,
        "7g.80gb": 0,
    }
    cp = run_cli("inventory", "--simulate", env=node.env)
    assert cp.returncode == 0, cp.stderr
    text = cp.stdout
    assert "GPU0  X     SYS   0" in text
    assert "GPU 0: MIG enabled, 8 memory and 7 compute slices; still fits 1g.10gb x3" in text
    assert f"2   3g.40gb  4:4        39.2 GiB  {big['uuid']}  free" in text
    assert "7   1g.10gb  0:1        9.5 GiB   -" in text
    assert "Some GPU               24.0 GiB  1     00000000:01:00.0  -" in text


def test_table_of_a_dgx(tmp_path: Path) -> None:
    cp = run_cli("inventory", "--simulate", env=topo_node(tmp_path, dgx()).env)
    assert cp.returncode == 0, cp.stderr
    lines = cp.stdout.splitlines()
    assert lines[0].endswith("driver 580.65.06, 8 GPUs")
    header = next(line for line in lines if line.strip().startswith("GPU0  GPU1"))
    assert header.split() == [*(f"GPU{i}" for i in range(8)), "NUMA", "Affinity"]
    row = next(line for line in lines if line.startswith("GPU3 "))
    assert row.split() == ["GPU3", "NV18", "NV18", "NV18", "X", *["NV18"] * 4, "0"]
    assert "GPU 7: MIG disabled, 8 memory and 7 compute slices; once enabled it fits" in cp.stdout


def test_a_gpu_that_fails_is_unhealthy(tmp_path: Path) -> None:
    node = topo_node(tmp_path, nvlink_pairs())
    node.env["GPUVISOR_SIM_NVML_FAIL"] = "nvmlDeviceGetMemoryInfo"
    doc = inventory_json(node.env)
    assert [g["healthy"] for g in doc["gpus"]] == [False] * 4
    assert doc["gpus"][0]["uuid"].startswith("GPU-")
    assert doc["gpus"][0]["memory_mib"] is None


def test_no_nvml_is_one_line(tmp_path: Path) -> None:
    node = topo_node(tmp_path, "{}")  # a malformed topology: NVML cannot start
    cp = run_cli("inventory", "--simulate", env=node.env)
    assert cp.returncode == 1
    errors = [line for line in cp.stderr.splitlines() if line.startswith("Error:")]
    assert errors == ["Error: cannot read the simulated NVML: Unknown Error"]
    assert "gpus: missing" in cp.stderr


def test_devices_spec_node(tmp_path: Path) -> None:
    """Without a topology file: plain GPUs, no MIG, each pair NODE."""
    node = topo_node(tmp_path, "{}")
    del node.env["GPUVISOR_SIM_TOPOLOGY"]
    node.env["GPUVISOR_SIM_DEVICES"] = "2x16g"
    doc = inventory_json(node.env)
    assert [g["memory_mib"] for g in doc["gpus"]] == [16384, 16384]
    assert [g["mig"] for g in doc["gpus"]] == [None, None]
    assert doc["links"] == [["X", "NODE"], ["NODE", "X"]]


def test_help_names_the_options() -> None:
    cp = run_cli("inventory", "--help")
    assert cp.returncode == 0
    for option in ("--simulate", "--json", "--node"):
        assert option in cp.stdout


def test_instances_without_permission_to_list_them(tmp_path: Path) -> None:
    """A real driver lets only root list GPU instances: the MIG devices still show them."""
    node = topo_node(tmp_path, {"gpus": [{"model": "NVIDIA A100-SXM4-80GB", "mig": True}]})
    made = run_py(
        """
        import pynvml as n
        n.nvmlInit()
        gi = n.nvmlDeviceCreateGpuInstance(n.nvmlDeviceGetHandleByIndex(0), 14)
        n.nvmlGpuInstanceCreateComputeInstance(gi, n.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE)
        """,
        node.env,
    )
    assert made.returncode == 0, made.stderr
    env = dict(
        node.env,
        GPUVISOR_SIM_NVML_FAIL="nvmlDeviceGetGpuInstances,nvmlDeviceGetGpuInstanceRemainingCapacity",
        GPUVISOR_SIM_NVML_FAIL_CODE="4",  # NVML_ERROR_NO_PERMISSION
    )
    gpu = inventory_json(env)["gpus"][0]
    assert gpu["healthy"] is True
    [inst] = gpu["mig"]["instances"]
    assert inst["gi_id"] == 3
    assert inst["profile"] == "2g.20gb"
    assert inst["profile_id"] == 14
    assert inst["placement"] == {"start": 0, "size": 2}  # from GI id 3: the first quarter
    assert inst["uuid"].startswith("MIG-")
    assert inst["memory_mib"] == 19968
    assert gpu["mig"]["remaining"] == {}


@pytest.mark.parametrize("topology", [nvlink_pairs, dgx, pcie_two_switches])
def test_the_allocator_reads_the_document(tmp_path: Path, topology: Any) -> None:
    """The document is the allocator's input: its reader takes it as written."""
    from gpuvisor.cluster.inventory_model import load_inventory

    topo = topology()
    topo["gpus"][0]["mig"] = True
    node = topo_node(tmp_path, topo)
    made = run_py(
        """
        import pynvml as n
        n.nvmlInit()
        gi = n.nvmlDeviceCreateGpuInstance(n.nvmlDeviceGetHandleByIndex(0), 9)
        n.nvmlGpuInstanceCreateComputeInstance(gi, n.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
        """,
        node.env,
    )
    # the A30s of the PCIe box have no 3g profile
    assert made.returncode == 0 or "NVMLError_InvalidArgument" in made.stderr, made.stderr
    doc = inventory_json(node.env)
    inventory = load_inventory(doc)
    assert len(inventory.gpus) == len(topo["gpus"])
