"""The Kubernetes manifests and the Grafana dashboard (deploy/).

Every core manifest is validated offline against the Kubernetes OpenAPI
schemas (kubernetes-validate, strict: unknown fields are errors); the
ServiceMonitor (a CRD) is checked field by field.  Then the manifests are
held to what the code does: the agent's default socket directory and
metrics port, the names the shim and `gpuvisor run` accept (checked by the
library's own validator), the images the README documents.  The HAMi
installer's script runs against a scratch directory.  The dashboard's
PromQL may name only series a running node agent exports: one is started
on a simulated node with a container supervised by `gpuvisor run` under the
example Pod's environment, and scraped.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml
from gpuvisor.shim.limits import parse_memory_limit
from gpuvisor.supervisor.agent.cli import node_agent
from gpuvisor.supervisor.agent.config import admin_socket_for, admin_socket_problem
from gpuvisor.supervisor.entrypoint import config as run_config
from gpuvisor.supervisor.entrypoint.reporter import CONTAINER_VARS, NAMESPACE_VARS, POD_VARS
from gpuvisor.supervisor.entrypoint.run import ENV_LOG_LEVEL
from gpuvisor.supervisor.protocol import MAX_MESSAGE_BYTES

from tests.helpers import (
    CLI,
    LIBRARY,
    REPO_ROOT,
    SimNode,
    clean_env,
    missing_build_outputs,
    run_cmd,
    start_cmd,
)
from tests.test_agent import AgentProc, find, wait_for
from tests.test_images import (
    AGENT,
    RUNTIME,
    documented_images,
    image_uid,
    install_path,
    stage,
    stages,
)

DEPLOY = REPO_ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana-dashboard.json"
GiB = 1 << 30
# Kubernetes versions the manifests must be valid for: the oldest the install
# guide supports (docs/kubernetes.md: 1.30, where the webhook's
# matchConditions are GA) and the newest schema kubernetes-validate bundles.
K8S_VERSIONS = ["1.30", kubernetes_validate.latest_version()]
# HAMi's host directory for its interposer (Helm devicePlugin.libPath, and
# global.gpuHookPath=/usr/local + "/vgpu" in the device plugin's mounts).
HAMI_LIB_DIR = "/usr/local/vgpu"
CRD_GROUPS = ("monitoring.coreos.com/",)


# ---- loading -------------------------------------------------------------------------


def manifests() -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((path, doc))
    return out


def one(kind: str, name: str | None = None, path: Path | None = None) -> dict[str, Any]:
    found = [
        d
        for p, d in manifests()
        if d["kind"] == kind
        and (name is None or d["metadata"]["name"] == name)
        and (path is None or p == path)
    ]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    result: dict[str, Any] = found[0]
    return result


def agent_ds() -> dict[str, Any]:
    return one("DaemonSet", "gpuvisor-node-agent")


def container(pod_spec: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    ctrs = [c for c in pod_spec["containers"] if name is None or c["name"] == name]
    assert len(ctrs) == 1
    found: dict[str, Any] = ctrs[0]
    return found


def host_path_mount(pod_spec: dict[str, Any], ctr: dict[str, Any], host: str) -> dict[str, Any]:
    """The container's mount of the pod's hostPath volume for `host`."""
    (vol,) = [v for v in pod_spec["volumes"] if v.get("hostPath", {}).get("path") == host]
    (mount,) = [m for m in ctr["volumeMounts"] if m["name"] == vol["name"]]
    return dict(mount)


def agent_defaults() -> dict[str, Any]:
    saved = os.environ.pop("GPUVISOR_NODE_SOCKET", None)
    try:
        return dict(node_agent.make_context("node-agent", []).params)
    finally:
        if saved is not None:
            os.environ["GPUVISOR_NODE_SOCKET"] = saved


# ---- schemas ---------------------------------------------------------------------------


def test_core_manifests_validate_strictly():
    kinds = set()
    for path, doc in manifests():
        if doc["apiVersion"].startswith(CRD_GROUPS):
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(p) for p in exc.path)
                pytest.fail(f"{path.name}: {doc['kind']} at {where}: {exc.message} (k8s {version})")
        kinds.add((path.name, doc["kind"]))
    # every manifest issue 34 names is among them: the scheduler Deployment
    # (with its configuration), RBAC, the webhook configuration, the node
    # DaemonSets
    assert {
        ("node-agent-daemonset.yaml", "Namespace"),
        ("node-agent-daemonset.yaml", "DaemonSet"),
        ("node-agent-service.yaml", "Service"),
        ("example-pod.yaml", "Pod"),
        ("scheduler.yaml", "Deployment"),
        ("scheduler.yaml", "ConfigMap"),
        ("scheduler.yaml", "Service"),
        ("rbac.yaml", "ServiceAccount"),
        ("rbac.yaml", "ClusterRole"),
        ("rbac.yaml", "ClusterRoleBinding"),
        ("webhook.yaml", "MutatingWebhookConfiguration"),
        ("device-plugin-daemonset.yaml", "DaemonSet"),
    } <= kinds


def test_strict_validation_rejects_an_unknown_field():
    pod = copy.deepcopy(one("Pod", "gpuvisor-example"))
    pod["spec"]["containers"][0]["volumeMount"] = []  # misspelt volumeMounts
    kubernetes_validate.validate(pod, K8S_VERSIONS[-1], strict=False)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, K8S_VERSIONS[-1], strict=True)


# ---- node agent: DaemonSet, Service, ServiceMonitor -------------------------------------


def test_daemonset_matches_the_agents_defaults():
    ds = agent_ds()
    spec = ds["spec"]["template"]["spec"]
    ctr = container(spec, "agent")
    defaults = agent_defaults()
    sock_dir = str(PurePosixPath(defaults["socket_path"]).parent)
    assert sock_dir == str(PurePosixPath(run_config.DEFAULT_SOCKET).parent)  # both sides agree
    # The socket directory: the node's /run/gpuvisor at the same path inside.
    mount = host_path_mount(spec, ctr, sock_dir)
    assert mount["mountPath"] == sock_dir
    assert not mount.get("readOnly", False)  # the agent creates the socket there
    # Its arguments parse with the real command and keep socket and port.
    params = node_agent.make_context("node-agent", list(ctr["args"])).params
    assert params["socket_path"] == defaults["socket_path"]
    # The admin socket: its own hostPath, the default beside the socket's,
    # never the directory workloads mount.
    admin_dir = str(PurePosixPath(params["admin_socket"]).parent)
    assert params["admin_socket"] == admin_socket_for(defaults["socket_path"])
    assert admin_socket_problem(params["socket_path"], params["admin_socket"]) is None
    assert host_path_mount(spec, ctr, admin_dir)["mountPath"] == admin_dir
    assert params["metrics_port"] == defaults["metrics_port"]
    (port,) = ctr["ports"]
    assert port["name"] == "metrics"
    assert port["containerPort"] == defaults["metrics_port"]
    # Probes use the named port.
    for probe in ("readinessProbe", "livenessProbe"):
        assert ctr[probe]["httpGet"]["port"] == "metrics"
    # The host series' node label comes from the node's name (--node-name).
    env = {e["name"]: e for e in ctr["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    # SO_PEERCRED pids must be the node's (supervisor/identity.py).
    assert spec["hostPID"] is True
    # Unprivileged, as the image's user; the init container hands it the dir.
    uid = image_uid(stages(AGENT))
    assert ctr["securityContext"]["runAsUser"] == uid
    assert ctr["securityContext"]["runAsNonRoot"] is True
    (init,) = spec["initContainers"]
    assert init["command"] == ["chown", f"{uid}:{uid}", sock_dir, admin_dir]
    assert host_path_mount(spec, init, sock_dir)["mountPath"] == sock_dir
    assert host_path_mount(spec, init, admin_dir)["mountPath"] == admin_dir
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    # Selectors select the template.
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for c in (ctr, init):
        assert c["image"] == documented_images()["images/agent/Dockerfile"]


def test_service_targets_the_daemonsets_named_port():
    ds, svc = agent_ds(), one("Service", "gpuvisor-node-agent")
    assert svc["metadata"]["namespace"] == ds["metadata"]["namespace"]
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    ports = {p["name"]: p for p in container(ds["spec"]["template"]["spec"], "agent")["ports"]}
    (sport,) = svc["spec"]["ports"]
    target = sport["targetPort"]
    assert target in ports, f"targetPort {target!r} is not a named port of the agent"
    assert sport["port"] == ports[target]["containerPort"]


def test_servicemonitor_scrapes_the_service():
    svc = one("Service", "gpuvisor-node-agent")
    sm = one("ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert svc["metadata"]["namespace"] in sm["spec"]["namespaceSelector"]["matchNames"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert set(endpoint) <= {
        "port",
        "path",
        "scheme",
        "interval",
        "scrapeTimeout",
        "relabelings",
        "honorLabels",
    }
    # The dashboard's node label.
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"}.items() <= (
        endpoint["relabelings"][0].items()
    )


# ---- the example workload ---------------------------------------------------------------

ACCEPTED_ENV = {
    run_config.ENV_MEMORY,
    run_config.ENV_SM,
    run_config.ENV_POLICY,
    run_config.ENV_HAMI_POLICY,
    run_config.ENV_PRIORITY,
    run_config.ENV_REGION,
    run_config.ENV_SOCKET,
    run_config.ENV_INTERVAL,
    run_config.ENV_GRACE,
    ENV_LOG_LEVEL,
    *POD_VARS,
    *NAMESPACE_VARS,
    *CONTAINER_VARS,
}
PER_DEVICE_ENV = re.compile(r"(CUDA_DEVICE_MEMORY_LIMIT|CUDA_DEVICE_SM_LIMIT)_[0-9]+\Z")


def example_env(pod: dict[str, Any], **overrides: str) -> dict[str, str]:
    """The example container's environment as the kubelet would set it."""
    ctr = container(pod["spec"])
    env: dict[str, str] = {}
    for var in ctr["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            field = var["valueFrom"]["fieldRef"]["fieldPath"]
            env[var["name"]] = {
                "metadata.name": pod["metadata"]["name"],
                "metadata.namespace": pod["metadata"]["namespace"],
            }[field]
    env.update(overrides)
    return env


def test_example_pod_environment_is_what_gpuvisor_run_accepts():
    pod = one("Pod", "gpuvisor-example")
    spec = pod["spec"]
    ctr = container(spec)
    env = example_env(pod)
    for name in env:
        assert name in ACCEPTED_ENV or PER_DEVICE_ENV.match(name), f"{name}: not read by gpuvisor"
    # Validated by the library's own parser (gv_validate_env) and the
    # supervisor's checks, exactly as `gpuvisor run` does before starting.
    cfg = run_config.build(run_config.RunOptions(), ["true"], env)
    assert cfg.policy == env["GPUVISOR_SM_POLICY"] == "burst-share"
    assert cfg.priority == int(env["CUDA_TASK_PRIORITY"]) == 1
    assert cfg.socket == env["GPUVISOR_NODE_SOCKET"]
    assert cfg.region == env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]
    assert cfg.grace < spec["terminationGracePeriodSeconds"]
    assert parse_memory_limit(env["CUDA_DEVICE_MEMORY_LIMIT"]) == 4 * GiB
    # ...and that validator does refuse a bad value.
    with pytest.raises(run_config.ConfigError, match="CUDA_DEVICE_SM_LIMIT"):
        run_config.build(run_config.RunOptions(), ["true"], {**env, "CUDA_DEVICE_SM_LIMIT": "300"})
    # Labels: the downward API for the pod, the container's own name.
    by_name = {v["name"]: v for v in ctr["env"]}
    assert by_name["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert by_name["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["CONTAINER_NAME"] == ctr["name"]
    # The node socket: the agent DaemonSet's hostPath, at the path the env names.
    ds_spec = agent_ds()["spec"]["template"]["spec"]
    sock_dir = str(PurePosixPath(cfg.socket).parent)
    ds_mount = host_path_mount(ds_spec, container(ds_spec, "agent"), sock_dir)
    assert host_path_mount(spec, ctr, sock_dir)["mountPath"] == ds_mount["mountPath"] == sock_dir
    # ...and not the admin socket's directory.
    admin_dir = str(PurePosixPath(admin_socket_for(cfg.socket)).parent)
    mounted = {v.get("hostPath", {}).get("path") for v in spec["volumes"]}
    assert admin_dir not in mounted
    assert all(not m["mountPath"].startswith(admin_dir) for m in ctr["volumeMounts"])
    # The region on a volume of the pod's own (shared by the container's processes).
    region_dir = str(PurePosixPath(cfg.region).parent)
    (mount,) = [m for m in ctr["volumeMounts"] if m["mountPath"] == region_dir]
    (vol,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert "emptyDir" in vol
    # A GPU, the runtime image, its entrypoint (`gpuvisor run --`) and user.
    assert ctr["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert ctr["image"] == documented_images()["images/runtime/Dockerfile"]
    assert "command" not in ctr
    assert stages(RUNTIME)[-1].exec_form("ENTRYPOINT") == ["gpuvisor", "run", "--"]
    assert spec["securityContext"]["runAsUser"] == image_uid(stages(RUNTIME))


# ---- HAMi drop-in ----------------------------------------------------------------------

HAMI = DEPLOY / "hami" / "libgpuvisor-installer.yaml"


def installer_script() -> str:
    cm = one("ConfigMap", "gpuvisor-hami-installer", HAMI)
    return str(cm["data"]["install.sh"])


def run_installer(tmp_path: Path, vgpu: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "install.sh"
    script.write_text(installer_script())
    return run_cmd(
        ["sh", str(script), *args],
        {"PATH": os.environ["PATH"], "GPUVISOR_LIB": str(LIBRARY), "HAMI_VGPU_DIR": str(vgpu)},
        30,
    )


def test_hami_installer_manifest():
    ds = one("DaemonSet", "gpuvisor-hami-installer", HAMI)
    spec = ds["spec"]["template"]["spec"]
    (vol,) = [v for v in spec["volumes"] if "hostPath" in v]
    assert vol["hostPath"]["path"] == HAMI_LIB_DIR
    (scripts,) = [v for v in spec["volumes"] if "configMap" in v]
    assert scripts["configMap"]["name"] == "gpuvisor-hami-installer"
    runtime_image = documented_images()["images/runtime/Dockerfile"]
    lib = install_path(stages(RUNTIME))
    ctrs = [*spec["initContainers"], *spec["containers"]]
    assert len(ctrs) == 2
    for ctr in ctrs:
        assert ctr["image"] == runtime_image
        env = {e["name"]: e["value"] for e in ctr["env"]}
        assert env["GPUVISOR_LIB"] == lib  # the runtime image's library
        (host_mount,) = [m for m in ctr["volumeMounts"] if m["name"] == vol["name"]]
        assert env["HAMI_VGPU_DIR"] == host_mount["mountPath"]
        (script_mount,) = [m for m in ctr["volumeMounts"] if m["name"] == scripts["name"]]
        assert ctr["command"][:2] == ["/bin/sh", f"{script_mount['mountPath']}/install.sh"]
    assert spec["initContainers"][0]["command"][2:] == []
    assert spec["containers"][0]["command"][2:3] == ["--watch"]


def test_hami_installer_replaces_every_libvgpu_by_rename(tmp_path):
    vgpu = tmp_path / "vgpu"
    vgpu.mkdir()
    versioned, plain, preload = (
        vgpu / "libvgpu.so.v2.10.0",
        vgpu / "libvgpu.so",
        vgpu / "ld.so.preload",
    )
    versioned.write_bytes(b"hami-core versioned")
    plain.write_bytes(b"hami-core")
    preload.write_text("/usr/local/vgpu/libvgpu.so\n")
    old_inode = versioned.stat().st_ino
    with versioned.open("rb") as held:  # a running container's mapping
        proc = run_installer(tmp_path, vgpu)
        assert proc.returncode == 0, proc.stderr
        assert held.read() == b"hami-core versioned"  # never rewritten in place
    ours = LIBRARY.read_bytes()
    assert versioned.read_bytes() == plain.read_bytes() == ours
    assert versioned.stat().st_ino != old_inode
    assert preload.read_text() == "/usr/local/vgpu/libvgpu.so\n"  # HAMi's, kept
    assert sorted(p.name for p in vgpu.iterdir()) == [
        "ld.so.preload",
        *sorted([plain.name, versioned.name]),
    ]
    # Idempotent: nothing to do the second time.
    inode = versioned.stat().st_ino
    again = run_installer(tmp_path, vgpu)
    assert again.returncode == 0, again.stderr
    assert again.stdout == ""
    assert versioned.stat().st_ino == inode


def test_hami_installer_on_a_fresh_node_and_watch_mode(tmp_path):
    vgpu = tmp_path / "fresh" / "vgpu"
    proc = run_installer(tmp_path, vgpu)
    assert proc.returncode == 0, proc.stderr
    assert (vgpu / "libvgpu.so").read_bytes() == LIBRARY.read_bytes()
    assert (vgpu / "ld.so.preload").read_text() == "/usr/local/vgpu/libvgpu.so\n"
    # --watch puts the library back when HAMi's plugin restores its own.
    script = tmp_path / "install.sh"
    watcher = subprocess.Popen(
        ["sh", str(script), "--watch", "0.1"],
        env={"PATH": os.environ["PATH"], "GPUVISOR_LIB": str(LIBRARY), "HAMI_VGPU_DIR": str(vgpu)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        (vgpu / "libvgpu.so.v2.10.0").write_bytes(b"hami-core")  # the plugin's postStart
        assert wait_for(
            lambda: (vgpu / "libvgpu.so.v2.10.0").read_bytes() == LIBRARY.read_bytes(), timeout=5
        )
    finally:
        os.killpg(watcher.pid, signal.SIGTERM)
        watcher.wait(10)


PLUGIN_DOCKERFILE = DEPLOY / "hami" / "device-plugin.Dockerfile"
# Where HAMi's image keeps what its postStart hook installs (HAMi docker/Dockerfile).
HAMI_IMAGE_LIB_DIR = "/k8s-vgpu/lib/nvidia"


def test_hami_device_plugin_image_carries_libgpuvisor(tmp_path):
    st = stages(PLUGIN_DOCKERFILE)
    gpuvisor, plugin = stage(st, "gpuvisor"), st[-1]
    for s in st:  # pinned bases
        assert re.search(r":v?\d+\.\d+", s.base), s.base
    assert gpuvisor.base == documented_images()["images/runtime/Dockerfile"]
    assert plugin.base.startswith("projecthami/hami:v")
    (copy_,) = plugin.copies()
    assert copy_.from_stage == "gpuvisor"
    assert copy_.sources == [install_path(stages(RUNTIME))]
    (script,) = plugin.values("RUN")
    assert HAMI_IMAGE_LIB_DIR in script
    # Run the step against a copy of the HAMi image's directory.
    lib_dir = tmp_path / "nvidia"
    lib_dir.mkdir()
    (lib_dir / "libvgpu.so.v2.10.0").write_bytes(b"hami-core")
    (lib_dir / "ld.so.preload").write_text("/usr/local/vgpu/libvgpu.so\n")
    staged = tmp_path / "libgpuvisor.so"

    def build() -> subprocess.CompletedProcess[str]:
        shutil.copy(LIBRARY, staged)
        local = script.replace(HAMI_IMAGE_LIB_DIR, str(lib_dir)).replace(copy_.dest, str(staged))
        return subprocess.run(
            ["sh", "-c", local], capture_output=True, text=True, timeout=30, check=False
        )

    proc = build()
    assert proc.returncode == 0, proc.stderr
    assert (lib_dir / "libvgpu.so.v2.10.0").read_bytes() == LIBRARY.read_bytes()
    assert (lib_dir / "ld.so.preload").read_text() == "/usr/local/vgpu/libvgpu.so\n"
    assert not staged.exists()
    # An image without HAMi-core's library fails the build.
    for f in lib_dir.glob("libvgpu.so*"):
        f.unlink()
    proc = build()
    assert proc.returncode != 0
    assert "no libvgpu.so" in proc.stderr


def test_hami_installer_refuses_a_missing_library(tmp_path):
    script = tmp_path / "install.sh"
    script.write_text(installer_script())
    proc = subprocess.run(
        ["sh", str(script)],
        env={
            "PATH": os.environ["PATH"],
            "GPUVISOR_LIB": str(tmp_path / "nope.so"),
            "HAMI_VGPU_DIR": str(tmp_path / "vgpu"),
        },
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode != 0
    assert "nope.so" in proc.stderr
    assert not (tmp_path / "vgpu").exists()


# ---- Grafana dashboard ------------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from all_panels(p.get("panels", []))


def exprs() -> list[str]:
    out = []
    for p in all_panels(dashboard()["panels"]):
        out += [t["expr"] for t in p.get("targets", [])]
    return out


def variable_queries() -> dict[str, tuple[str, str]]:
    """Query variable name -> (series selector, label) of its label_values()."""
    out = {}
    for var in dashboard()["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query.strip())
        assert m, f"${var['name']}: {query!r}"
        out[var["name"]] = (m.group(1), m.group(2))
    return out


PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
PROMQL_WORDS |= {"and", "or", "unless", "bool", "offset"}


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects."""
    e = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][\w:]*", e):
        if e[m.end() :].lstrip().startswith("(") or m.group(0) in PROMQL_WORDS:
            continue
        names.add(m.group(0))
    return names


def matcher_labels(expr: str) -> dict[str, set[str]]:
    """Series name -> label names its {...} matchers use."""
    out: dict[str, set[str]] = {}
    for m in re.finditer(r"([A-Za-z_:][\w:]*)\{([^}]*)\}", expr):
        out.setdefault(m.group(1), set()).update(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", m.group(2)))
    return out


def test_promql_name_extraction():
    assert metric_names(
        'sum by (node, reason) (rate(gpuvisor_agent_x_total{node=~"$node"}[$__rate_interval]))'
    ) == {"gpuvisor_agent_x_total"}
    assert metric_names('time() - a_seconds{x="1"} / b') == {"a_seconds", "b"}
    assert metric_names("a and on (x) b offset 5m") == {"a", "b"}
    assert matcher_labels('a{x=~"1", y!="2"} / b{z="3"}') == {"a": {"x", "y"}, "b": {"z"}}


def test_dashboard_structure():
    d = dashboard()
    assert d["schemaVersion"] >= 36
    assert d["uid"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    ds_var = variables["DS_PROMETHEUS"]
    assert ds_var["type"] == "datasource"
    assert ds_var["query"] == "prometheus"
    assert {"node", "namespace", "pod"} <= set(variable_queries())
    ds_ref = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    panels = list(all_panels(d["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    graphs = [p for p in panels if p["type"] != "row"]
    assert len(graphs) >= 8
    for p in graphs:
        assert p["title"]
        assert set(p["gridPos"]) == {"h", "w", "x", "y"}
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        assert p["datasource"] == ds_ref, p["title"]
        assert p["targets"], p["title"]
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip(), p["title"]
            assert t["datasource"] == ds_ref, p["title"]
    for name in ("node", "namespace", "pod"):
        assert variables[name]["datasource"] == ds_ref
    # Each panel filters on the variables it can: per-container panels on all three.
    for p in graphs:
        for t in p["targets"]:
            if "gpuvisor_container_" in t["expr"]:
                for var in ("$node", "$namespace", "$pod"):
                    assert var in t["expr"], (p["title"], t["expr"])
            else:
                assert "$node" in t["expr"], (p["title"], t["expr"])


WORKLOAD = """
import sys
from cuda.bindings import driver as cu
def ok(res):
    assert res[0] == cu.CUresult.CUDA_SUCCESS, res[0]
    return res[1] if len(res) > 1 else None
ok(cu.cuInit(0))
ok(cu.cuCtxSetCurrent(ok(cu.cuDevicePrimaryCtxRetain(0))))
held = ok(cu.cuMemAlloc(1 << 30))
assert cu.cuMemAlloc(8 << 30)[0] == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY
print("ready", flush=True)
sys.stdin.read()
"""


def _send_raw(path: str, data: bytes) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        with contextlib.suppress(OSError):  # the agent may close before we finish
            s.sendall(data)
            s.recv(65536)  # the error reply


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A node agent on a simulated node with the example Pod's container
    (under `gpuvisor run`) reporting to it, a rejected message and a
    disconnect; yields its samples and the container's labels."""
    missing = missing_build_outputs()
    if missing:
        pytest.fail(f"run make first: missing {missing}", pytrace=False)
    node = SimNode.create(tmp_path_factory.mktemp("node"))
    short = tempfile.mkdtemp(prefix="gvd-", dir="/tmp")  # sun_path is short
    sock = os.path.join(short, "node.sock")
    pod = one("Pod", "gpuvisor-example")
    env = dict(node.env)
    env.update(
        example_env(
            pod,
            # The container's paths, moved to this machine's scratch space.
            GPUVISOR_NODE_SOCKET=sock,
            CUDA_DEVICE_MEMORY_SHARED_CACHE=str(node.dir / "region.shr"),
            GPUVISOR_REPORT_INTERVAL="0.2",
        )
    )
    try:
        with AgentProc(sock, env=node.env) as agent:
            workload = start_cmd(
                [*CLI, "run", "--", sys.executable, "-c", textwrap.dedent(WORKLOAD)],
                env,
                stdin=True,
            )
            try:
                assert workload.stdout is not None
                line = workload.stdout.readline()
                assert line.strip() == "ready", line  # else stderr comes below
                who = {
                    "podname": env["POD_NAME"],
                    "podnamespace": env["POD_NAMESPACE"],
                    "ctrname": env["CONTAINER_NAME"],
                }
                assert wait_for(
                    lambda: (
                        find(agent.metrics(), "gpuvisor_container_oom_refusals_total", **who)
                        == [1.0]
                    ),
                    timeout=5,
                ), agent.get("/metrics")
                # NVML's per-process reading beside a known container (the
                # agent reads it every 0.5 s): the unmanaged-process gauge of
                # both GPUs
                assert wait_for(
                    lambda: (
                        find(agent.metrics(), "gpuvisor_device_unmanaged_processes") == [0.0, 0.0]
                    ),
                    timeout=10,
                ), agent.get("/metrics")
                _send_raw(sock, b"not json\n")  # rejected, reason malformed
                _send_raw(sock, b"x" * (MAX_MESSAGE_BYTES + 1))  # disconnect, oversize
                assert wait_for(
                    lambda: find(agent.metrics(), "gpuvisor_agent_disconnects_total"), timeout=5
                )
                probes = {path: agent.get(path) for path in ("/status", "/healthz", "/metrics")}
                yield {"samples": agent.metrics(), "who": who, "probes": probes, "env": env}
            finally:
                _, err = workload.communicate(input="", timeout=30)
                assert workload.returncode == 0, err
    finally:
        shutil.rmtree(short, ignore_errors=True)


def test_example_pod_container_reports_under_its_labels(scraped):
    samples, who, env = scraped["samples"], scraped["who"], scraped["env"]
    limit = parse_memory_limit(env["CUDA_DEVICE_MEMORY_LIMIT"])
    assert find(samples, "gpuvisor_container_memory_limit_bytes", **who) == [float(limit)]
    (used,) = find(samples, "gpuvisor_container_memory_used_bytes", **who)
    assert GiB <= used < limit
    sm = int(env["CUDA_DEVICE_SM_LIMIT"]) / 100
    assert find(samples, "gpuvisor_container_sm_limit_ratio", **who) == [sm]
    assert find(samples, "gpuvisor_container_priority", **who) == [float(env["CUDA_TASK_PRIORITY"])]


def test_daemonset_probe_paths_answer(scraped):
    spec = agent_ds()["spec"]["template"]["spec"]
    ctr = container(spec, "agent")
    for probe in ("readinessProbe", "livenessProbe"):
        assert ctr[probe]["httpGet"]["path"] in scraped["probes"]
    assert scraped["probes"]["/healthz"].strip() == "ok"


def test_dashboard_uses_only_exported_series_and_labels(scraped):
    samples = scraped["samples"]
    labels_of: dict[str, set[str]] = {}
    for name, labels, _ in samples:
        labels_of.setdefault(name, set()).update(labels)
    # The node label is added by the ServiceMonitor's relabeling, not the agent.
    (endpoint,) = one("ServiceMonitor")["spec"]["endpoints"]
    added = {r["targetLabel"] for r in endpoint["relabelings"]}
    assert "node" in added
    queries = [(e, "panel") for e in exprs()]
    queries += [(sel, f"${name}") for name, (sel, _) in variable_queries().items()]
    used = set()
    for expr, where in queries:
        names = metric_names(expr)
        assert names, (where, expr)
        for name in names:
            assert name.startswith("gpuvisor_"), (where, name)
            assert name in labels_of, f"{where}: {name} is not exported ({expr})"
            used.add(name)
        for name, matchers in matcher_labels(expr).items():
            assert matchers <= labels_of[name] | added, (where, name, matchers - labels_of[name])
    for name, (sel, label) in variable_queries().items():
        for series in metric_names(sel):
            assert label in labels_of[series] | added, (name, series, label)
    # Legends name labels those series have.
    for p in all_panels(dashboard()["panels"]):
        for t in p.get("targets", []):
            have = set().union(*(labels_of[n] for n in metric_names(t["expr"]))) | added
            for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")):
                assert label in have, (p["title"], label)
    # Every gpuvisor_* family the agent exports has a panel.
    exported = {n for n in labels_of if n.startswith("gpuvisor_")}
    assert exported - used == set(), f"not on the dashboard: {sorted(exported - used)}"
    # The scrape really carried the per-container and host series.
    assert find(samples, "gpuvisor_device_memory_total_bytes")
    assert find(samples, "gpuvisor_agent_rejected_reports_total", reason="malformed") == [1.0]
    assert find(samples, "gpuvisor_agent_disconnects_total", reason="oversize") == [1.0]


# ---- cluster half: scheduler, webhook, device plugin, RBAC ------------------------------
# (applied to the real kube-apiserver in tests/test_webhook_k8s.py)


def gpuvisor_containers() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(workload name, pod spec, container) for every container running `gpuvisor`."""
    out = []
    for _, doc in manifests():
        if doc["kind"] not in ("Deployment", "DaemonSet"):
            continue
        spec = doc["spec"]["template"]["spec"]
        for ctr in spec["containers"]:
            if ctr.get("command") == ["gpuvisor"]:
                out.append((doc["metadata"]["name"], spec, ctr))
    return out


def test_every_gpuvisor_container_runs_a_command_that_accepts_its_arguments():
    from gpuvisor.supervisor.cli import main

    found = {}
    for workload, _, ctr in gpuvisor_containers():
        name, *args = ctr["args"]
        found[workload, ctr["name"]] = name
        if name not in main.commands:
            # The scheduler extender (`gpuvisor scheduler`) lands separately.
            assert name == "scheduler", f"{workload}/{ctr['name']}: no gpuvisor {name}"
            continue
        main.commands[name].make_context(name, list(args))
        assert ctr["image"] == documented_images()["images/agent/Dockerfile"]
    assert found == {
        ("gpuvisor-scheduler", "extender"): "scheduler",
        ("gpuvisor-scheduler", "webhook"): "webhook",
        ("gpuvisor-device-plugin", "device-plugin"): "device-plugin",
    }


def test_scheduler_pod_wires_extender_webhook_and_metrics():
    from gpuvisor.cluster.webhook.cli import webhook

    deployment = one("Deployment", "gpuvisor-scheduler")
    spec = deployment["spec"]["template"]["spec"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    config = yaml.safe_load(one("ConfigMap", "gpuvisor-scheduler")["data"]["config.yaml"])
    (profile,) = config["profiles"]
    (extender,) = config["extenders"]
    assert extender["nodeCacheCapable"] is True
    assert (extender["filterVerb"], extender["prioritizeVerb"], extender["bindVerb"]) == (
        "filter",
        "prioritize",
        "bind",
    )
    assert all(r["ignoredByScheduler"] for r in extender["managedResources"])
    assert extender["urlPrefix"].startswith("https://127.0.0.1:")
    extender_port = extender["urlPrefix"].rsplit(":", 1)[1]
    ext = container(spec, "extender")
    assert f"--port={extender_port}" in ext["args"]
    # over HTTPS: the extender serves the Secret's pair (from its
    # environment), kube-scheduler trusts the same Secret's CA
    assert extender["enableHTTPS"] is True
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    sched_mounts = {
        m["mountPath"]: m["name"] for m in container(spec, "kube-scheduler")["volumeMounts"]
    }
    ext_mounts = {m["mountPath"]: m["name"] for m in ext["volumeMounts"]}
    ca = PurePosixPath(extender["tlsConfig"]["caFile"])
    assert secrets[sched_mounts[str(ca.parent)]] == "gpuvisor-scheduler-tls"
    env = {e["name"]: e["value"] for e in ext["env"]}
    for var, file in (
        ("GPUVISOR_SCHEDULER_TLS_CERT", "tls.crt"),
        ("GPUVISOR_SCHEDULER_TLS_KEY", "tls.key"),
    ):
        path = PurePosixPath(env[var])
        assert path.name == file
        assert secrets[ext_mounts[str(path.parent)]] == "gpuvisor-scheduler-tls"

    # The webhook gives pods the scheduler this profile is, serves the
    # Secret's pair, and gets no service account token.
    hook = container(spec, "webhook")
    params = webhook.make_context("webhook", list(hook["args"][1:])).params
    assert params["scheduler_name"] == profile["schedulerName"]
    mounts = {m["name"]: m["mountPath"] for m in hook["volumeMounts"]}
    assert set(mounts) == {"webhook-tls"}
    for option in ("tls_cert_file", "tls_key_file"):
        assert str(PurePosixPath(params[option]).parent) == mounts["webhook-tls"]
    assert spec["automountServiceAccountToken"] is False
    for name in ("kube-scheduler", "extender"):
        assert "token" in {m["name"] for m in container(spec, name)["volumeMounts"]}
    (port,) = hook["ports"]
    assert port["containerPort"] == params["port"]

    svc = one("Service", "gpuvisor-webhook")
    assert svc["spec"]["selector"].items() <= labels.items()
    (svc_port,) = svc["spec"]["ports"]
    assert svc_port["targetPort"] == port["name"]
    config_hook = one("MutatingWebhookConfiguration", "gpuvisor-webhook")["webhooks"][0]
    service_ref = config_hook["clientConfig"]["service"]
    assert (service_ref["name"], service_ref["namespace"], service_ref["port"]) == (
        "gpuvisor-webhook",
        svc["metadata"]["namespace"],
        svc_port["port"],
    )
    assert service_ref["path"] == "/mutate"
    assert config_hook["failurePolicy"] == "Fail"

    metrics = one("Service", "gpuvisor-scheduler")
    (metrics_port,) = metrics["spec"]["ports"]
    assert metrics_port["port"] == 31993  # HAMi's scheduler metrics port
    (ext_port,) = ext["ports"]
    assert metrics_port["targetPort"] == ext_port["name"]
    assert ext_port["containerPort"] == 31993
    # ... where the extender serves its metrics
    from gpuvisor.cluster.scheduler.cli import scheduler

    ext_params = scheduler.make_context("scheduler", list(ext["args"][1:])).params
    assert ext_params["metrics_port"] == 31993
    assert ext_params["metrics_host"] == "0.0.0.0"  # the pod's address, for the Service
    assert ext_params["port"] == int(extender_port)
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "gpuvisor-scheduler"


def test_device_plugin_daemonset_matches_the_plugins_defaults():
    from gpuvisor.cluster.deviceplugin import defaults
    from gpuvisor.cluster.deviceplugin.cli import device_plugin

    ds = one("DaemonSet", "gpuvisor-device-plugin")
    spec = ds["spec"]["template"]["spec"]
    ctr = container(spec, "device-plugin")
    params = device_plugin.make_context("device-plugin", list(ctr["args"][1:])).params
    assert params["plugin_dir"] == defaults.PLUGIN_DIR
    assert str(params["pod_resources_socket"]) == defaults.POD_RESOURCES_SOCKET
    # kubelet's directories and the plugin's own, each at its host path.
    for host in (
        str(defaults.PLUGIN_DIR),
        str(PurePosixPath(defaults.POD_RESOURCES_SOCKET).parent),
        str(params["state_dir"]),
        str(params["lib_dir"]),
        str(params["node_dir"]),
    ):
        assert host_path_mount(spec, ctr, host)["mountPath"] == host
    # The node agent's socket directory, beside it on the same nodes.
    agent = agent_ds()["spec"]["template"]["spec"]
    assert str(params["node_dir"]) == str(PurePosixPath(agent_defaults()["socket_path"]).parent)
    assert spec["nodeSelector"] == agent["nodeSelector"]
    env = {e["name"]: e for e in ctr["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert spec["serviceAccountName"] == "gpuvisor-device-plugin"
    # The library is installed where --lib-dir says, from the runtime image.
    (init,) = spec["initContainers"]
    assert init["image"] == documented_images()["images/runtime/Dockerfile"]
    assert host_path_mount(spec, init, str(params["lib_dir"]))["mountPath"] == "/host-lib"
    assert "/host-lib/libgpuvisor.so" in init["command"][-1]


def issued_pair(script: str, out: Path) -> Any:
    """Runs a certificate script with --out and checks what every such pair
    must be: a leaf the CA signed, the CA's key gone (it signs once), the
    key private, and the key the certificate's (load_cert_chain refuses a
    mismatched pair); the leaf's subject alternative names."""
    from cryptography import x509

    subprocess.run(["sh", str(DEPLOY / script), "--out", str(out)], check=True, capture_output=True)
    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    leaf = x509.load_pem_x509_certificate((out / "tls.crt").read_bytes())
    leaf.verify_directly_issued_by(ca)
    assert not (out / "ca.key").exists()
    assert (out / "tls.key").stat().st_mode & 0o077 == 0
    ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(out / "tls.crt", out / "tls.key")
    return leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value


def test_scheduler_certificate_script_issues_a_pair_for_loopback(tmp_path):
    import ipaddress

    from cryptography import x509

    names = issued_pair("scheduler-certificate.sh", tmp_path)
    assert ipaddress.ip_address("127.0.0.1") in names.get_values_for_type(x509.IPAddress)


def test_webhook_certificate_script_issues_a_pair_for_the_service(tmp_path):
    from cryptography import x509

    names = issued_pair("webhook-certificate.sh", tmp_path)
    assert "gpuvisor-webhook.gpuvisor.svc" in names.get_values_for_type(x509.DNSName)


# ---- the node socket's directory: read-write, for any uid ------------------------------

OTHER_UID = 10001  # the example Pod's runAsUser, not the agent's (root here)

CONTEXT = """
from gpuvisor.shim.driver import Driver
d = Driver()
d.init()
assert d.mem_alloc(1 << 20)[0] == 0
print("ok")
"""


def _as_other_uid() -> list[str]:
    """Run as the example Pod's uid; reading and searching stay allowed (the
    interpreter lives under /root here), writing is checked as that uid."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("unshare") is None:
        pytest.skip("needs root, setpriv and unshare")
    caps = "+dac_read_search"
    return [
        "setpriv",
        f"--reuid={OTHER_UID}",
        f"--regid={OTHER_UID}",
        "--clear-groups",
        f"--inh-caps={caps}",
        f"--ambient-caps={caps}",
    ]


def test_example_pod_node_directory_works_for_another_uid_and_a_read_only_mount_is_told():
    pod = one("Pod", "gpuvisor-example")
    ctr = container(pod["spec"])
    # The library writes node-wide files beside the socket (launch order,
    # context costs): a read-only mount turns them off.
    assert not host_path_mount(pod["spec"], ctr, "/run/gpuvisor").get("readOnly", False)
    prefix = _as_other_uid()
    top = Path(tempfile.mkdtemp(prefix="gvro-", dir="/tmp"))
    try:
        top.chmod(0o777)
        run_dir = top / "run"  # the hostPath both the agent and the Pod mount
        env = clean_env()
        env.update(
            GPUVISOR_SIM_STATE=str(top / "sim.state"),
            LD_LIBRARY_PATH=str(LIBRARY.parent / "sim"),
            LD_PRELOAD=str(LIBRARY),
            CUDA_DEVICE_MEMORY_LIMIT="1g",
            CUDA_DEVICE_MEMORY_SHARED_CACHE=str(top / "region.shr"),
            GPUVISOR_NODE_LOCK=str(run_dir / "context.lock"),
        )
        with AgentProc(str(run_dir / "node.sock")):
            mode = run_dir.stat().st_mode
            assert mode & 0o1777 == 0o1777, oct(mode)  # any uid creates; nobody removes others'
            code = textwrap.dedent(CONTEXT)
            ok = subprocess.run(
                [*prefix, sys.executable, "-c", code],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert ok.stdout == "ok\n", ok.stderr
            assert "node-wide file" not in ok.stderr
            (made,) = run_dir.glob("gpuvisor-sm-GPU-*")
            assert made.stat().st_uid == OTHER_UID
            assert made.stat().st_mode & 0o666 == 0o666
            made.unlink()  # the next run would find it and need no write
            ro = (
                f"mount --bind {run_dir} {run_dir} && mount -o remount,bind,ro {run_dir} && "
                f'exec {" ".join(prefix)} {sys.executable} -c "$0"'
            )
            told = subprocess.run(
                ["unshare", "--mount", "sh", "-c", ro, code],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            print(told.stderr)
            assert told.stdout == "ok\n", (
                told.stderr
            )  # the limits still hold; it says what it costs
            assert told.stderr.count("node-wide file") == 1
            assert "Read-only file system" in told.stderr
            assert "unreserved" in told.stderr
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_kubectl_recipes_name_the_agents_daemonset():
    """docs/kubernetes.md's recipes (top, set-limit, a port-forward to
    /status) use the DaemonSet's namespace, pod label, container and port."""
    text = (REPO_ROOT / "docs" / "kubernetes.md").read_text()
    ds = agent_ds()
    ns = ds["metadata"]["namespace"]
    label = ds["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
    spec = ds["spec"]["template"]["spec"]
    agent = container(spec, "agent")
    (port,) = [p["containerPort"] for p in agent["ports"] if p["name"] == "metrics"]
    assert f"-l app.kubernetes.io/name={label}" in text
    assert f'kubectl -n {ns} exec -it "$POD" -c {agent["name"]} -- gpuvisor top' in text
    assert (
        f'kubectl -n {ns} exec "$POD" -c {agent["name"]} -- \\\n  gpuvisor node-agent set-limit'
        in text
    )
    assert f'kubectl -n {ns} port-forward "pod/$POD" {port}:{port}' in text
    assert f"curl -s http://127.0.0.1:{port}/status" in text


def test_the_network_policy_admits_only_the_monitoring_namespace_to_the_agents_port():
    (policy,) = yaml.safe_load_all((DEPLOY / "node-agent-networkpolicy.yaml").read_text())
    daemonset = next(
        d
        for d in yaml.safe_load_all((DEPLOY / "node-agent-daemonset.yaml").read_text())
        if d and d["kind"] == "DaemonSet"
    )
    assert policy["kind"] == "NetworkPolicy"
    assert policy["metadata"]["namespace"] == daemonset["metadata"]["namespace"]
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    ports = {
        p["name"] for c in daemonset["spec"]["template"]["spec"]["containers"] for p in c["ports"]
    }
    assert [p["port"] for p in rule["ports"]] == ["metrics"]
    assert "metrics" in ports
    # The agent does not hand /status to the pod network.
    args = daemonset["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--status-public" not in args


def test_the_install_guide_applies_every_component_in_an_order_that_works():
    """docs/kubernetes.md's guide from an empty cluster: its commands apply
    every manifest of the cluster half (the namespace first, the webhook
    configuration after the Deployment that serves it) and run both
    certificate scripts before the scheduler that mounts their Secrets;
    the kube-scheduler image it names is the manifest's."""
    text = (REPO_ROOT / "docs" / "kubernetes.md").read_text()
    guide = text[text.index("## Installing: from an empty cluster") :]
    guide = guide[: guide.index("\n## ", 1)]
    (commands,) = re.findall(r"```sh\n(kubectl apply -f deploy/.*?)```", guide, re.S)
    used = re.findall(r"deploy/[\w.-]+\.(?:yaml|sh)", commands)
    for path in used:
        assert (REPO_ROOT / path).is_file(), path
    order = {p: used.index(p) for p in used}
    for doc in (
        "node-agent-daemonset.yaml",  # the gpuvisor namespace
        "rbac.yaml",
        "device-plugin-daemonset.yaml",
        "webhook-certificate.sh",
        "scheduler-certificate.sh",
        "scheduler.yaml",
        "webhook.yaml",
    ):
        assert f"deploy/{doc}" in order, doc
    assert order["deploy/node-agent-daemonset.yaml"] == 0
    for script in ("webhook-certificate.sh", "scheduler-certificate.sh"):
        assert order[f"deploy/{script}"] < order["deploy/scheduler.yaml"]
    assert order["deploy/scheduler.yaml"] < order["deploy/webhook.yaml"]
    (image,) = [
        c["image"]
        for c in one("Deployment", "gpuvisor-scheduler")["spec"]["template"]["spec"]["containers"]
        if c["name"] == "kube-scheduler"
    ]
    assert f"(`{image}` in the manifest)" in guide
