"""The node agent serves the node inventory (docs/inventory.md) on /status
and exports gpuvisor_gpu_info and one series per MIG instance
(docs/metrics.md), read through the simulated NVML."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import Holder, missing_build_outputs
from tests.test_agent import AgentProc
from tests.topohelp import make_3g_instance, topo_node

pytestmark = pytest.mark.skipif(bool(missing_build_outputs()), reason="run make first")

TOPOLOGY = {
    "gpus": [
        {"model": "NVIDIA A100-SXM4-80GB", "mig": True, "numa": 0, "pcie_switch": 0},
        {"model": "NVIDIA H100 80GB HBM3", "numa": 1, "pcie_switch": 1},
    ]
}


@pytest.fixture
def sock() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="gvi-", dir="/tmp")  # short: sun_path holds 108 bytes
    yield os.path.join(d, "run", "node.sock")
    shutil.rmtree(d, ignore_errors=True)


def series(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def wait_for(get: Any, check: Any, seconds: float = 10.0) -> Any:
    """get() until check(value) holds (the agent rereads the inventory every 2 s)."""
    deadline = time.monotonic() + seconds
    while True:
        value = get()
        if check(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def test_status_and_metrics_show_the_inventory(tmp_path: Path, sock: str) -> None:
    node = topo_node(tmp_path, TOPOLOGY)
    made = make_3g_instance(
        node, 0, "print(n.nvmlDeviceGetUUID(n.nvmlDeviceGetMigDeviceHandleByIndex(d, 0)))"
    )
    mig_uuid = made.strip()
    with AgentProc(sock, "--node-name", "n7", env=node.env) as agent:
        status = json.loads(agent.get("/status"))
        inv = status["inventory"]
        assert inv["kind"] == "gpuvisor.io/node-inventory"
        assert inv["node"] == "n7"
        assert [g["model"] for g in inv["gpus"]] == [
            "NVIDIA A100-SXM4-80GB",
            "NVIDIA H100 80GB HBM3",
        ]
        assert inv["links"] == [["X", "SYS"], ["SYS", "X"]]
        [inst] = inv["gpus"][0]["mig"]["instances"]
        assert inst["uuid"] == mig_uuid
        assert inst["in_use"] is False
        got = series(agent.get("/metrics"))
        gpus = {labels["deviceidx"]: labels for labels, _ in got["gpuvisor_gpu_info"]}
        assert gpus["0"]["model"] == "NVIDIA A100-SXM4-80GB"
        assert gpus["1"]["numa"] == "1"
        assert gpus["1"]["deviceuuid"] == inv["gpus"][1]["uuid"]
        [(labels, memory)] = got["gpuvisor_mig_instance_memory_bytes"]
        assert labels == {
            "deviceuuid": inv["gpus"][0]["uuid"],
            "deviceidx": "0",
            "gi_id": "1",
            "profile": "3g.40gb",
            "placement": "0:4",
            "miguuid": mig_uuid,
        }
        assert memory == 40192 * (1 << 20)
        assert got["gpuvisor_mig_instance_in_use"] == [(labels, 0.0)]

        # a process on the instance: in use, on /status and in the series
        client = "from tests.cuclient import *\ninit(0)\nhold()\n"
        with Holder(client, dict(node.env, CUDA_VISIBLE_DEVICES=mig_uuid)):
            busy = wait_for(
                lambda: series(agent.get("/metrics"))["gpuvisor_mig_instance_in_use"],
                lambda v: v[0][1] == 1.0,
            )
            assert busy == [(labels, 1.0)]
            status = json.loads(agent.get("/status"))
            assert status["inventory"]["gpus"][0]["mig"]["instances"][0]["in_use"] is True


def test_no_nvml_leaves_the_inventory_out(tmp_path: Path, sock: str) -> None:
    node = topo_node(tmp_path, TOPOLOGY)
    env = dict(node.env, GPUVISOR_SIM_NVML_FAIL="nvmlInit")
    with AgentProc(sock, env=env) as agent:
        assert json.loads(agent.get("/status"))["inventory"] is None
        assert "gpuvisor_gpu_info" not in agent.get("/metrics")
