"""The Kubernetes test environment itself (tests/k8s_cluster.py) against the
real etcd, kube-apiserver and kube-scheduler that `make k8s` builds: the
apiserver serves and authenticates, the scheduler binds Pods asking for
extended resources, an HTTP extender configuration is accepted and called,
and a mutating webhook is called over TLS.
"""

from __future__ import annotations

import base64
import json
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import kubernetes.client
import pytest
from kubernetes.utils import parse_quantity

from tests import k8s_cluster
from tests.k8s_cluster import (
    GPU,
    GPUMEM,
    KubeCluster,
    KubeTest,
    free_port,
    gpu_pod,
    kubernetes_version,
    must,
)

Handler = Callable[[str, Any], Any]


class JsonServer:
    """A tiny HTTP(S) server on 127.0.0.1: POSTed JSON to `handler(path, body)`,
    whose result is the JSON answer; every request is kept in `calls`."""

    def __init__(self, handler: Handler, tls: ssl.SSLContext | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        outer = self

        class _Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                path = urllib.parse.urlsplit(self.path).path  # the apiserver adds ?timeout=
                outer.calls.append((path, body))
                answer = json.dumps(handler(path, body)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve() -> Iterator[Callable[..., JsonServer]]:
    servers: list[JsonServer] = []

    def start(handler: Handler, tls: ssl.SSLContext | None = None) -> JsonServer:
        servers.append(JsonServer(handler, tls))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def test_apiserver_serves_its_version_and_authenticates(k8s_cluster: KubeCluster) -> None:
    version = kubernetes_version()
    info = kubernetes.client.VersionApi(k8s_cluster.api).get_code()
    assert info.git_version == version
    # The secure port turns away a client without credentials.
    context = ssl.create_default_context(cafile=str(k8s_cluster.ca_file))
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(f"{k8s_cluster.server}/api/v1/nodes", context=context, timeout=10)
    assert denied.value.code in (401, 403)
    print(f"\ncluster {version} ready in {k8s_cluster.startup_s:.1f}s")


def test_scheduler_binds_pods_by_extended_resources(k8s: KubeTest) -> None:
    k8s.create_node("plain")
    k8s.create_node("gpus", gpus=4, gpumem=4 * 16384, gpucores=400)
    k8s.start_scheduler()
    k8s.create_pod("fits", gpus=2, gpumem=3000)
    k8s.create_pod("too-big", gpus=8)
    assert k8s.wait_bound("fits") == "gpus"
    message = k8s.wait_unschedulable("too-big")
    assert f"Insufficient {GPU}" in message, message
    spec = must(k8s.read_pod("fits").spec, "spec")
    # Limits alone were given; the apiserver copies them to requests, in
    # canonical form: gpumem 3000 comes back as "3k".
    requests = must(must(spec.containers[0].resources, "resources").requests, "requests")
    assert requests == {GPU: "2", GPUMEM: "3k"}
    assert parse_quantity(requests[GPUMEM]) == 3000


def test_extender_filters_and_binds_resources_the_scheduler_ignores(
    k8s: KubeTest, serve: Callable[..., JsonServer]
) -> None:
    def extender(path: str, body: Any) -> Any:
        if path == "/filter":
            names = body["NodeNames"]
            return {
                "NodeNames": [n for n in names if n != "refused"],
                "FailedNodes": {"refused": "the extender says no"},
                "Error": "",
            }
        assert path == "/bind", path
        k8s.bind(body["PodName"], body["Node"])
        return {"Error": ""}

    server = serve(extender)
    # Neither node advertises nvidia.com/gpu: only the extender, which
    # manages it, can let the pod through.
    k8s.create_node("refused")
    k8s.create_node("chosen")
    k8s.start_scheduler(
        {
            "extenders": [
                {
                    "urlPrefix": f"http://127.0.0.1:{server.port}",
                    "filterVerb": "filter",
                    "bindVerb": "bind",
                    "nodeCacheCapable": True,
                    "httpTimeout": "10s",
                    "managedResources": [{"name": GPU, "ignoredByScheduler": True}],
                }
            ]
        }
    )
    k8s.create_pod("managed", gpus=1)
    k8s.create_pod("unmanaged")  # asks for no managed resource: not sent to the extender
    assert k8s.wait_bound("managed") == "chosen"
    k8s.wait_bound("unmanaged")
    filters = [body for path, body in server.calls if path == "/filter"]
    binds = [body for path, body in server.calls if path == "/bind"]
    assert len(filters) == 1, server.calls
    assert sorted(filters[0]["NodeNames"]) == ["chosen", "refused"]
    assert filters[0]["Nodes"] is None  # nodeCacheCapable: names only
    assert filters[0]["Pod"]["metadata"]["name"] == "managed"
    pod = k8s.read_pod("managed")
    assert binds == [
        {
            "PodName": "managed",
            "PodNamespace": k8s.namespace,
            "PodUID": must(pod.metadata, "metadata").uid,
            "Node": "chosen",
        }
    ]


def test_scheduler_configuration_errors_are_reported(k8s: KubeTest) -> None:
    # "gpu" is no extended resource name (those have a domain): the
    # scheduler's own validation refuses it, and the fixture says so.
    extender = {
        "urlPrefix": "http://127.0.0.1:1",
        "filterVerb": "filter",
        "managedResources": [{"name": "gpu", "ignoredByScheduler": True}],
    }
    with pytest.raises(RuntimeError, match="kube-scheduler exited") as error:
        k8s.start_scheduler({"extenders": [extender]})
    assert "extenders[0].managedResources[0].name" in str(error.value), error.value


def test_mutating_webhook_is_called_over_tls(
    k8s: KubeTest, serve: Callable[..., JsonServer]
) -> None:
    def mutate(path: str, review: Any) -> Any:
        assert path == "/mutate", path
        meta = review["request"]["object"]["metadata"]
        patch: list[dict[str, Any]] = (
            [{"op": "add", "path": "/metadata/annotations/mutated-by", "value": "test"}]
            if "annotations" in meta
            else [{"op": "add", "path": "/metadata/annotations", "value": {"mutated-by": "test"}}]
        )
        return {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": {
                "uid": review["request"]["uid"],
                "allowed": True,
                "patchType": "JSONPatch",
                "patch": base64.b64encode(json.dumps(patch).encode()).decode(),
            },
        }

    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    k8s.cluster.ca.issue_cert("127.0.0.1").configure_cert(tls)
    server = serve(mutate, tls)
    k8s.create_mutating_webhook(
        {
            "metadata": {"name": f"mutate-{k8s.namespace}"},
            "webhooks": [
                {
                    "name": "mutate.gpuvisor.test",
                    "clientConfig": {
                        "url": f"https://127.0.0.1:{server.port}/mutate",
                        "caBundle": base64.b64encode(k8s.cluster.ca_file.read_bytes()).decode(),
                    },
                    "rules": [
                        {
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE"],
                            "resources": ["pods"],
                        }
                    ],
                    # Only this test's pods.
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": k8s.namespace}
                    },
                    "admissionReviewVersions": ["v1"],
                    "sideEffects": "None",
                    "failurePolicy": "Fail",
                    "timeoutSeconds": 10,
                }
            ],
        }
    )
    # The apiserver picks the configuration up asynchronously: create until it
    # calls (dry runs, which webhooks with sideEffects None also see).
    probe = must(kubernetes.client.V1Pod.from_dict(gpu_pod("probe")), "probe")
    for _ in range(100):
        answer = k8s.core.create_namespaced_pod(k8s.namespace, probe, dry_run="All")
        if must(answer.metadata, "metadata").annotations:
            break
        time.sleep(0.1)
    pod = k8s.create_pod("mutated")
    assert must(pod.metadata, "metadata").annotations == {"mutated-by": "test"}
    review = server.calls[-1][1]
    assert review["kind"] == "AdmissionReview"
    assert review["request"]["object"]["metadata"]["name"] == "mutated"
    assert review["request"]["dryRun"] is False


def test_a_port_taken_before_the_component_binds_it_is_tried_again(
    k8s: KubeTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another process (another xdist worker) takes the port that was found
    # free: the component fails to bind and is started again on another.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = iter([port])
        monkeypatch.setattr(k8s_cluster, "free_port", lambda: next(ports, None) or free_port())
        scheduler = k8s.start_scheduler()
    assert scheduler.port != port
    first = scheduler.log.with_name("kube-scheduler.log").read_text()
    assert "address already in use" in first
    assert scheduler.log.name == "kube-scheduler.retry1.log"
