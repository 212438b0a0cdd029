"""A real Kubernetes control plane for the cluster half's tests.

etcd, kube-apiserver and kube-scheduler are the upstream programs, built by
`make k8s` from their published Go modules (tests/k8s/, one multi-call binary
with a link per component in build/k8s/).  Nothing here imitates the API.

- `KubeCluster.start(workdir, apiserver_args=())`: etcd + kube-apiserver on
  127.0.0.1 (secure port, a throwaway CA, an admin client certificate in
  group system:masters, the default admission plugins with both admission
  webhooks, then `apiserver_args`), ready when /readyz answers 200; `stop()`
  ends both.
- `KubeCluster.start_scheduler(config)`: a kube-scheduler with the given
  KubeSchedulerConfiguration (our kubeconfig and no leader election filled in),
  ready when its /readyz answers 200 (caches synced).
- `KubeTest`: one test's view (the `k8s` fixture in conftest.py): its own
  namespace, Node and Pod helpers, and teardown of what it created.
- `gpu_node` / `gpu_pod`: Node and Pod manifests with HAMi's extended
  resources (nvidia.com/gpu, nvidia.com/gpumem, nvidia.com/gpucores).

Every process gets its own free ports and a directory under the caller's
workdir (so xdist workers never share one), dies with the test process
(PR_SET_PDEATHSIG) and is stopped by the fixtures even when a test fails.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import json
import os
import re
import secrets
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import kubernetes.client
import kubernetes.config
import pytest
import trustme
from kubernetes.client.exceptions import ApiException

from tests.helpers import BUILD_DIR, REPO_ROOT, stop_process

K8S_BUILD = BUILD_DIR / "k8s"
COMPONENTS = ("etcd", "kube-apiserver", "kube-scheduler")
GO_MOD = REPO_ROOT / "tests" / "k8s" / "go.mod"

GPU = "nvidia.com/gpu"
GPUMEM = "nvidia.com/gpumem"
GPUCORES = "nvidia.com/gpucores"

NOT_READY_TAINT = "node.kubernetes.io/not-ready"

START_TIMEOUT = 120.0  # seconds; kube-apiserver on a loaded 2-core machine

T = TypeVar("T")


def must(value: T | None, what: str) -> T:
    """`value`, which the API left optional but the test needs (fails naming `what`)."""
    if value is None:
        pytest.fail(f"{what} is missing", pytrace=False)
    return value


def kubernetes_version() -> str:
    """The Kubernetes version `make k8s` builds (the one truth is tests/k8s/go.mod)."""
    match = re.search(r"^\s*k8s\.io/kubernetes (v\S+)", GO_MOD.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{GO_MOD}: no k8s.io/kubernetes requirement")
    return match.group(1)


def binaries() -> dict[str, Path]:
    """Paths of etcd, kube-apiserver and kube-scheduler in build/k8s/.

    When one is missing the test fails in CI (CI set: `make test` builds them)
    and is skipped elsewhere, naming `make k8s`.
    """
    paths = {name: K8S_BUILD / name for name in COMPONENTS}
    missing = [name for name, path in paths.items() if not os.access(path, os.X_OK)]
    if missing:
        message = (
            f"{', '.join(missing)} not built in {K8S_BUILD}: run `make k8s` "
            f"(builds Kubernetes {kubernetes_version()} from its Go modules)"
        )
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return paths


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG = 1: killed when the test process dies, however it dies.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def _component_env() -> dict[str, str]:
    # A proxy in the environment would carry the apiserver's calls to a
    # webhook or the scheduler's to an extender on 127.0.0.1 away.
    return {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}


class Component:
    """One control-plane process, its output in `log`."""

    def __init__(self, name: str, argv: Sequence[str], log: Path) -> None:
        self.name = name
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=_component_env(),
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, probe: Callable[[], bool], timeout: float = START_TIMEOUT) -> float:
        """Polls `probe` until it returns True; raises when the process exits or time runs out.

        Returns the seconds it took.
        """
        start = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} before it was ready; "
                    f"{self.log}:\n{self.log_tail()}"
                )
            if probe():
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise TimeoutError(
                    f"{self.name} not ready after {timeout:.0f}s; {self.log}:\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def stop(self, timeout: float = 15.0) -> None:
        stop_process(self.proc, timeout)


def _import_client_apis() -> None:
    for name in ("CoreV1Api", "AdmissionregistrationV1Api"):
        getattr(kubernetes.client, name)


def start_on_free_ports(
    name: str,
    count: int,
    argv: Callable[[list[int]], list[str]],
    log: Path,
    probe: Callable[[list[int]], Callable[[], bool]],
    attempts: int = 3,
) -> tuple[Component, list[int]]:
    """Starts `argv(ports)` on `count` free ports and waits until `probe(ports)()`.

    A port found free can be taken by another process (another xdist worker)
    before the component binds it: then it starts again on other ports, with
    a log of its own per attempt.  Returns the ready component and its ports.
    """
    for attempt in range(attempts):
        ports = [free_port() for _ in range(count)]
        path = log if attempt == 0 else log.with_suffix(f".retry{attempt}{log.suffix}")
        component = Component(name, argv(ports), path)
        try:
            component.wait_ready(probe(ports))
            return component, ports
        except RuntimeError as error:
            component.stop()
            if "address already in use" not in str(error) or attempt == attempts - 1:
                raise
        except BaseException:
            component.stop()
            raise
    raise AssertionError("unreachable")


def _https_ok(url: str, context: ssl.SSLContext) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5, context=context) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def _etcd_healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
            return bool(json.load(response).get("health") == "true")
    except (OSError, ValueError):
        return False


@dataclass
class KubeScheduler:
    """A running kube-scheduler; `config` is the KubeSchedulerConfiguration it got."""

    component: Component
    config: dict[str, Any]
    port: int

    def stop(self) -> None:
        self.component.stop()

    @property
    def log(self) -> Path:
        return self.component.log


@dataclass
class KubeCluster:
    """etcd + kube-apiserver, started by `start`; attributes for clients of it.

    - server: https://127.0.0.1:<port>
    - kubeconfig: an admin kubeconfig (client certificate, group system:masters)
    - ca: the CA that signed the apiserver's serving and client certificates;
      tests issue webhook serving certificates from it (`ca.issue_cert("127.0.0.1")`)
    - ca_file: its certificate (PEM), for caBundle or ssl_ca_cert
    - api: a kubernetes.client.ApiClient configured from `kubeconfig`
    """

    workdir: Path
    server: str
    kubeconfig: Path
    ca: trustme.CA
    ca_file: Path
    api: kubernetes.client.ApiClient
    components: list[Component]
    startup_s: float
    _schedulers: list[KubeScheduler] = field(default_factory=list)

    @classmethod
    def start(cls, workdir: Path, apiserver_args: Sequence[str] = ()) -> KubeCluster:
        bins = binaries()
        workdir.mkdir(parents=True, exist_ok=True)
        began = time.monotonic()
        ca = trustme.CA(organization_name="gpuvisor tests")
        ca_file = workdir / "ca.pem"
        ca.cert_pem.write_to_path(str(ca_file))
        serving = ca.issue_cert(
            "127.0.0.1", "localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"
        )
        serving_file = workdir / "apiserver.pem"
        serving.private_key_and_cert_chain_pem.write_to_path(str(serving_file))
        admin = ca.issue_cert("admin", common_name="admin", organization_name="system:masters")
        # Service-account tokens are signed with a key of their own.
        sa_file = workdir / "service-accounts.key"
        ca.issue_cert("service-accounts").private_key_pem.write_to_path(str(sa_file))

        # Importing the client's API classes takes seconds: do it while the
        # control plane starts.
        warm = threading.Thread(target=_import_client_apis, daemon=True)
        warm.start()
        components: list[Component] = []
        try:

            def etcd_argv(ports: list[int]) -> list[str]:
                client, peer = (f"http://127.0.0.1:{p}" for p in ports)
                return [
                    str(bins["etcd"]),
                    "--name=test",
                    f"--data-dir={workdir / f'etcd-{ports[0]}'}",
                    f"--listen-client-urls={client}",
                    f"--advertise-client-urls={client}",
                    f"--listen-peer-urls={peer}",
                    f"--initial-advertise-peer-urls={peer}",
                    f"--initial-cluster=test={peer}",
                    "--log-level=warn",
                    # A test cluster's data dies with it: no fsync per write.
                    "--unsafe-no-fsync",
                ]

            etcd, (etcd_port, _) = start_on_free_ports(
                "etcd",
                2,
                etcd_argv,
                workdir / "etcd.log",
                lambda ports: lambda: _etcd_healthy(ports[0]),
            )
            components.append(etcd)

            def apiserver_argv(ports: list[int]) -> list[str]:
                return [
                    str(bins["kube-apiserver"]),
                    f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                    "--bind-address=127.0.0.1",
                    "--advertise-address=127.0.0.1",
                    f"--secure-port={ports[0]}",
                    f"--tls-cert-file={serving_file}",
                    f"--tls-private-key-file={serving_file}",
                    f"--client-ca-file={ca_file}",
                    f"--cert-dir={workdir / 'apiserver-certs'}",
                    "--service-account-issuer=https://kubernetes.default.svc",
                    f"--service-account-key-file={sa_file}",
                    f"--service-account-signing-key-file={sa_file}",
                    "--service-cluster-ip-range=10.96.0.0/24",
                    "--authorization-mode=Node,RBAC",
                    # On by default; named so that a change of defaults cannot
                    # silently stop the webhook tests from meaning anything.
                    "--enable-admission-plugins=MutatingAdmissionWebhook,ValidatingAdmissionWebhook",
                    # The Endpoints of the `kubernetes` Service may not be loopback
                    # addresses, and nothing here needs them.
                    "--endpoint-reconciler-type=none",
                    "--profiling=false",
                    *apiserver_args,
                ]

            probe_ctx = ssl.create_default_context(cafile=str(ca_file))
            admin.configure_cert(probe_ctx)
            apiserver, (api_port,) = start_on_free_ports(
                "kube-apiserver",
                1,
                apiserver_argv,
                workdir / "kube-apiserver.log",
                lambda ports: lambda: _https_ok(f"https://127.0.0.1:{ports[0]}/readyz", probe_ctx),
            )
            components.append(apiserver)
            server = f"https://127.0.0.1:{api_port}"
            kubeconfig = workdir / "admin.kubeconfig"
            _write_kubeconfig(kubeconfig, server, ca_file, admin)
            api = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
            warm.join()
        except BaseException:
            for component in reversed(components):
                component.stop()
            raise
        return cls(
            workdir=workdir,
            server=server,
            kubeconfig=kubeconfig,
            ca=ca,
            ca_file=ca_file,
            api=api,
            components=components,
            startup_s=time.monotonic() - began,
        )

    @property
    def core(self) -> kubernetes.client.CoreV1Api:
        return kubernetes.client.CoreV1Api(self.api)

    def start_scheduler(self, config: Mapping[str, Any] | None = None) -> KubeScheduler:
        """Starts kube-scheduler with `config` (a KubeSchedulerConfiguration as a dict).

        apiVersion/kind, clientConnection.kubeconfig and leaderElection
        (off) are filled in when absent; a config the scheduler rejects makes
        this raise with the scheduler's own message.
        """
        full: dict[str, Any] = {
            "apiVersion": "kubescheduler.config.k8s.io/v1",
            "kind": "KubeSchedulerConfiguration",
            **(config or {}),
        }
        full.setdefault("clientConnection", {}).setdefault("kubeconfig", str(self.kubeconfig))
        full.setdefault("leaderElection", {"leaderElect": False})
        directory = Path(tempfile.mkdtemp(prefix="scheduler-", dir=self.workdir))
        config_file = directory / "config.json"  # JSON is YAML
        config_file.write_text(json.dumps(full, indent=1))

        def argv(ports: list[int]) -> list[str]:
            return [
                str(binaries()["kube-scheduler"]),
                f"--config={config_file}",
                "--bind-address=127.0.0.1",
                f"--secure-port={ports[0]}",
                f"--cert-dir={directory}",
                f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}",
            ]

        # The scheduler serves a certificate of its own making; /readyz turns
        # 200 once its informers have synced.
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE
        component, (port,) = start_on_free_ports(
            "kube-scheduler",
            1,
            argv,
            directory / "kube-scheduler.log",
            lambda ports: lambda: _https_ok(f"https://127.0.0.1:{ports[0]}/readyz", insecure),
        )
        scheduler = KubeScheduler(component, full, port)
        self._schedulers.append(scheduler)
        return scheduler

    def stop(self) -> None:
        for scheduler in self._schedulers:
            scheduler.stop()
        for component in reversed(self.components):
            component.stop()
        self.api.close()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _write_kubeconfig(path: Path, server: str, ca_file: Path, user: trustme.LeafCert) -> None:
    key_pem = user.private_key_pem.bytes()
    cert_pem = b"".join(blob.bytes() for blob in user.cert_chain_pems)
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "test",
                "cluster": {
                    "server": server,
                    "certificate-authority-data": _b64(ca_file.read_bytes()),
                },
            }
        ],
        "users": [
            {
                "name": "admin",
                "user": {
                    "client-certificate-data": _b64(cert_pem),
                    "client-key-data": _b64(key_pem),
                },
            }
        ],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "admin"}}],
        "current-context": "test",
    }
    path.write_text(json.dumps(config, indent=1))


def gpu_node(
    name: str,
    *,
    gpus: int = 0,
    gpumem: int = 0,
    gpucores: int = 0,
    cpu: str = "16",
    memory: str = "64Gi",
    pods: int = 110,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A Node manifest (no kubelet behind it) whose capacity and allocatable
    carry the given extended resources; one left at 0 is not advertised."""
    resources: dict[str, str] = {"cpu": cpu, "memory": memory, "pods": str(pods)}
    for resource, amount in ((GPU, gpus), (GPUMEM, gpumem), (GPUCORES, gpucores)):
        if amount:
            resources[resource] = str(amount)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, **(labels or {})},
            "annotations": dict(annotations or {}),
        },
        "status": {
            "capacity": dict(resources),
            "allocatable": dict(resources),
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "test"}
            ],
        },
    }


def gpu_container(
    name: str = "main",
    *,
    gpus: int = 0,
    gpumem: int = 0,
    gpucores: int = 0,
    image: str = "registry.invalid/gpuvisor-test:1",
    command: Sequence[str] = ("sleep", "infinity"),
) -> dict[str, Any]:
    """A container asking for the given GPU resources (as limits, as HAMi's
    users write them; Kubernetes copies them to requests)."""
    limits = {
        resource: str(amount)
        for resource, amount in ((GPU, gpus), (GPUMEM, gpumem), (GPUCORES, gpucores))
        if amount
    }
    container: dict[str, Any] = {"name": name, "image": image, "command": list(command)}
    if limits:
        container["resources"] = {"limits": limits}
    return container


def gpu_pod(
    name: str,
    *,
    gpus: int = 0,
    gpumem: int = 0,
    gpucores: int = 0,
    containers: Sequence[Mapping[str, Any]] | None = None,
    init_containers: Sequence[Mapping[str, Any]] = (),
    annotations: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
    scheduler_name: str | None = None,
    node_selector: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A Pod manifest: one container with the given GPU resources, or `containers`."""
    spec: dict[str, Any] = {
        "containers": [dict(c) for c in containers]
        if containers is not None
        else [gpu_container(gpus=gpus, gpumem=gpumem, gpucores=gpucores)],
        "terminationGracePeriodSeconds": 0,
    }
    if init_containers:
        spec["initContainers"] = [dict(c) for c in init_containers]
    if scheduler_name:
        spec["schedulerName"] = scheduler_name
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": dict(labels or {}),
            "annotations": dict(annotations or {}),
        },
        "spec": spec,
    }


class KubeTest:
    """One test's part of a shared `KubeCluster` (the `k8s` fixture).

    It has its own namespace (with its `default` ServiceAccount: no
    controller-manager runs to make one) and removes at teardown the Nodes,
    Pods, webhook configurations and schedulers it created, so the next test
    on the same cluster starts from an empty cluster again.
    """

    def __init__(self, cluster: KubeCluster) -> None:
        self.cluster = cluster
        self.core = kubernetes.client.CoreV1Api(cluster.api)
        self.admission = kubernetes.client.AdmissionregistrationV1Api(cluster.api)
        self.namespace = f"t-{secrets.token_hex(4)}"
        self._nodes: list[str] = []
        self._webhooks: list[str] = []
        self._validating: list[str] = []
        self._schedulers: list[KubeScheduler] = []
        meta = kubernetes.client.V1ObjectMeta
        self.core.create_namespace(
            kubernetes.client.V1Namespace(metadata=meta(name=self.namespace))
        )
        self.core.create_namespaced_service_account(
            self.namespace, kubernetes.client.V1ServiceAccount(metadata=meta(name="default"))
        )

    def create_node(self, name: str, **kwargs: Any) -> kubernetes.client.V1Node:
        """Creates `gpu_node(name, **kwargs)` with its status; returns the stored Node."""
        manifest = gpu_node(name, **kwargs)
        node = self.core.create_node(must(kubernetes.client.V1Node.from_dict(manifest), "node"))
        self._nodes.append(name)
        # Status sent with a create is kept for Nodes (kubelet registers so);
        # check rather than trust it.
        allocatable = must(node.status, f"node {name} status").allocatable
        if allocatable != manifest["status"]["allocatable"]:
            pytest.fail(f"node {name}: allocatable {allocatable} was not stored", pytrace=False)
        # The TaintNodesByCondition admission plugin taints a new Node
        # not-ready; the node lifecycle controller (no controller-manager runs
        # here) lifts the taint once the Node reports Ready, as ours does.
        taints = must(node.spec, f"node {name} spec").taints or []
        kept = [t.to_dict(serialize=True) for t in taints if t.key != NOT_READY_TAINT]
        if len(kept) != len(taints):
            node = self.core.patch_node(name, {"spec": {"taints": kept or None}})
        return node

    def create_pod(self, name: str, **kwargs: Any) -> kubernetes.client.V1Pod:
        """Creates `gpu_pod(name, **kwargs)` in this test's namespace; returns the stored Pod."""
        pod = kubernetes.client.V1Pod.from_dict(gpu_pod(name, **kwargs))
        return self.core.create_namespaced_pod(self.namespace, must(pod, "pod"))

    def read_pod(self, name: str) -> kubernetes.client.V1Pod:
        return self.core.read_namespaced_pod(name, self.namespace)

    def wait_pod(
        self,
        name: str,
        until: Callable[[kubernetes.client.V1Pod], bool],
        timeout: float = 30.0,
        what: str = "condition",
    ) -> kubernetes.client.V1Pod:
        """Polls the Pod until `until(pod)`; returns it, or fails naming `what` and the Pod."""
        deadline = time.monotonic() + timeout
        while True:
            pod = self.read_pod(name)
            if until(pod):
                return pod
            if time.monotonic() > deadline:
                pytest.fail(
                    f"pod {self.namespace}/{name}: no {what} after {timeout:.0f}s; "
                    f"status: {pod.status.to_dict() if pod.status else None}",
                    pytrace=False,
                )
            time.sleep(0.05)

    def wait_bound(self, name: str, timeout: float = 30.0) -> str:
        """Waits until the Pod is bound to a node; returns the node's name."""
        pod = self.wait_pod(name, lambda p: bool(p.spec and p.spec.node_name), timeout, "binding")
        return str(must(must(pod.spec, "spec").node_name, "spec.nodeName"))

    def wait_unschedulable(self, name: str, timeout: float = 30.0) -> str:
        """Waits for the scheduler to mark the Pod Unschedulable; returns its message."""

        def message(pod: kubernetes.client.V1Pod) -> str | None:
            for c in (pod.status and pod.status.conditions) or []:
                if c.type == "PodScheduled" and c.reason == "Unschedulable":
                    return str(c.message)
            return None

        pod = self.wait_pod(name, lambda p: message(p) is not None, timeout, "Unschedulable")
        return must(message(pod), "Unschedulable message")

    def bind(self, pod: str, node: str) -> None:
        """Binds a Pod of this namespace as a scheduler (or its extender) does."""
        binding = kubernetes.client.V1Binding(
            metadata=kubernetes.client.V1ObjectMeta(name=pod),
            target=kubernetes.client.V1ObjectReference(kind="Node", name=node),
        )
        self.core.create_namespaced_pod_binding(
            pod,
            self.namespace,
            binding,
            # The client cannot decode the Status the server answers with.
            _preload_content=False,
        )

    def start_scheduler(self, config: Mapping[str, Any] | None = None) -> KubeScheduler:
        """kube-scheduler with `config` (see KubeCluster.start_scheduler), stopped at teardown."""
        scheduler = self.cluster.start_scheduler(config)
        self._schedulers.append(scheduler)
        return scheduler

    def create_mutating_webhook(
        self, body: Mapping[str, Any]
    ) -> kubernetes.client.V1MutatingWebhookConfiguration:
        """Creates a MutatingWebhookConfiguration, deleted at teardown."""
        config = kubernetes.client.V1MutatingWebhookConfiguration.from_dict(dict(body))
        created = self.admission.create_mutating_webhook_configuration(must(config, "body"))
        self._webhooks.append(must(must(created.metadata, "metadata").name, "name"))
        return created

    def create_validating_webhook(
        self, body: Mapping[str, Any]
    ) -> kubernetes.client.V1ValidatingWebhookConfiguration:
        """Creates a ValidatingWebhookConfiguration, deleted at teardown."""
        config = kubernetes.client.V1ValidatingWebhookConfiguration.from_dict(dict(body))
        created = self.admission.create_validating_webhook_configuration(must(config, "body"))
        self._validating.append(must(must(created.metadata, "metadata").name, "name"))
        return created

    def teardown(self) -> None:
        for scheduler in self._schedulers:
            scheduler.stop()
        for name in self._webhooks:
            with contextlib.suppress(ApiException):
                self.admission.delete_mutating_webhook_configuration(name)
        for name in self._validating:
            with contextlib.suppress(ApiException):
                self.admission.delete_validating_webhook_configuration(name)
        # No kubelet confirms a deletion here: delete at once.
        with contextlib.suppress(ApiException):
            self.core.delete_collection_namespaced_pod(self.namespace, grace_period_seconds=0)
        for name in self._nodes:
            with contextlib.suppress(ApiException):
                self.core.delete_node(name)
        with contextlib.suppress(ApiException):
            self.core.delete_namespace(self.namespace)


@contextlib.contextmanager
def running_cluster(workdir: Path) -> Iterator[KubeCluster]:
    """A `KubeCluster` for the duration of the block, stopped however it ends."""
    cluster = KubeCluster.start(workdir)
    try:
        yield cluster
    finally:
        cluster.stop()
