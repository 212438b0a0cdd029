"""The extender's Binding write (cluster/scheduler/binding.py) against a real
kube-apiserver over TLS, with the client certificate and CA of the test
cluster's kubeconfig as `config.load_kube_config` reads them: the Binding
binds the pod and its annotations land on it, a stale resourceVersion or
a bound pod answers 409, and a server certificate the CA did not sign is
refused."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import trustme
from gpuvisor.cluster.scheduler.binding import ApiError, Binder

from tests.k8s_cluster import KubeTest, must


def binding(name: str, uid: str, version: str, node: str, note: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {
            "name": name,
            "uid": uid,
            "resourceVersion": version,
            "annotations": {"gpuvisor.io/test": note},
        },
        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
    }


async def bind_all(binder: Binder, *calls: tuple[str, str, dict[str, Any]]) -> list[Any]:
    """Each call's outcome (None, or the exception), then the session closed."""
    try:
        return await asyncio.gather(*(binder.bind(*c) for c in calls), return_exceptions=True)
    finally:
        await binder.close()


def test_the_binding_binds_the_pod_with_its_annotations(k8s: KubeTest) -> None:
    k = k8s
    k.create_node("bind-1")
    pods = {n: k.create_pod(n, gpus=1) for n in ("a", "b", "stale")}
    meta = {n: must(p.metadata, "metadata") for n, p in pods.items()}
    binder = Binder(k.core.api_client.configuration, timeout=10.0)
    # the pod changes after it was read: its old resourceVersion is stale
    k.core.patch_namespaced_pod("stale", k.namespace, {"metadata": {"labels": {"x": "y"}}})
    out = asyncio.run(
        bind_all(
            binder,
            *(
                (
                    k.namespace,
                    n,
                    binding(n, str(m.uid), str(m.resource_version), "bind-1", f"note-{n}"),
                )
                for n, m in meta.items()
            ),
        )
    )
    assert out[:2] == [None, None]
    assert isinstance(out[2], ApiError), out[2]
    assert out[2].status == 409
    for n in ("a", "b"):
        pod = k.read_pod(n)
        assert must(pod.spec, "spec").node_name == "bind-1"
        assert (must(pod.metadata, "metadata").annotations or {})["gpuvisor.io/test"] == f"note-{n}"
    assert must(k.read_pod("stale").spec, "spec").node_name is None
    # bound already: 409 again, however fresh the resourceVersion
    again = must(k.read_pod("a").metadata, "metadata")
    (out2,) = asyncio.run(
        bind_all(
            Binder(k.core.api_client.configuration, timeout=10.0),
            (
                k.namespace,
                "a",
                binding("a", str(again.uid), str(again.resource_version), "bind-1", "x"),
            ),
        )
    )
    assert isinstance(out2, ApiError), out2
    assert out2.status == 409


def test_a_server_the_ca_did_not_sign_is_refused(k8s: KubeTest, tmp_path: Path) -> None:
    """The Binder checks the API server's certificate against the
    kubeconfig's CA: with another CA the bind fails before any request."""
    k = k8s
    k.create_node("bind-2")
    pod = must(k.create_pod("c", gpus=1).metadata, "metadata")
    config = copy.copy(k.core.api_client.configuration)
    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    config.ssl_ca_cert = str(other)
    config.ca_cert_data = None
    (out,) = asyncio.run(
        bind_all(
            Binder(config, timeout=10.0),
            (
                k.namespace,
                "c",
                binding("c", str(pod.uid), str(pod.resource_version), "bind-2", "x"),
            ),
        )
    )
    assert isinstance(out, Exception), out
    assert not isinstance(out, ApiError), out
    assert "certificate" in str(out).lower() or "ssl" in str(out).lower(), out
    assert must(k.read_pod("c").spec, "spec").node_name is None
