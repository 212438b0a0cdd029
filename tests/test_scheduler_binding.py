"""The extender's Binding write (cluster/scheduler/binding.py) against a real
kube-apiserver over TLS, with the client certificate and CA of the test
cluster's kubeconfig as `config.load_kube_config` reads them: the Binding
binds the pod and its annotations land on it, a stale resourceVersion or
a bound pod answers 409, and a server certificate the CA did not sign is
refused."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import kubernetes.client
import kubernetes.config
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


def token_kubeconfig(k: KubeTest, path: Path, token: str) -> Any:
    """A kubeconfig as a pod's token and the cluster's CA file make one
    (`certificate-authority` a path, `token` the user's only credential),
    read by `config.load_kube_config` into a Configuration."""
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "test",
                "cluster": {
                    "server": k.cluster.server,
                    "certificate-authority": str(k.cluster.ca_file),
                },
            }
        ],
        "users": [{"name": "binder", "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "binder"}}],
        "current-context": "test",
    }
    path.write_text(json.dumps(doc))
    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(str(path), client_configuration=configuration)
    return configuration


def binder_token(k: KubeTest) -> str:
    """A token of a ServiceAccount allowed only to create pods/binding in
    the test's namespace (RBAC), from the TokenRequest API."""
    meta = kubernetes.client.V1ObjectMeta
    k.core.create_namespaced_service_account(
        k.namespace, kubernetes.client.V1ServiceAccount(metadata=meta(name="binder"))
    )
    rbac = kubernetes.client.RbacAuthorizationV1Api(k.core.api_client)
    rbac.create_namespaced_role(
        k.namespace,
        {
            "metadata": {"name": "binder"},
            "rules": [{"apiGroups": [""], "resources": ["pods/binding"], "verbs": ["create"]}],
        },
    )
    rbac.create_namespaced_role_binding(
        k.namespace,
        {
            "metadata": {"name": "binder"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "binder"},
            "subjects": [{"kind": "ServiceAccount", "name": "binder", "namespace": k.namespace}],
        },
    )
    request = kubernetes.client.AuthenticationV1TokenRequest(
        spec=kubernetes.client.V1TokenRequestSpec(
            audiences=["https://kubernetes.default.svc"], expiration_seconds=600
        )
    )
    out = k.core.create_namespaced_service_account_token("binder", k.namespace, request)
    return str(must(out.status, "status").token)


def test_a_bearer_token_and_the_ca_file_of_the_kubeconfig_bind(
    k8s: KubeTest, tmp_path: Path
) -> None:
    """The Binder sends the kubeconfig's bearer token and verifies the API
    server's certificate against its CA file: the Binding is written as
    the token's ServiceAccount (RBAC allows it pods/binding only).  A
    token the API server does not accept fails the bind with one line
    naming the field; a token it accepts but RBAC does not allow, with
    the API server's own reason."""
    k = k8s
    k.create_node("bind-3")
    pods = {n: must(k.create_pod(n, gpus=1).metadata, "metadata") for n in ("t", "u", "v")}
    good = token_kubeconfig(k, tmp_path / "good.kubeconfig", binder_token(k))
    assert good.ssl_ca_cert == str(k.cluster.ca_file)
    assert good.cert_file is None  # the token is its only credential

    def call(configuration: Any, name: str) -> Any:
        m = pods[name]
        (out,) = asyncio.run(
            bind_all(
                Binder(configuration, timeout=10.0),
                (
                    k.namespace,
                    name,
                    binding(name, str(m.uid), str(m.resource_version), "bind-3", "token"),
                ),
            )
        )
        return out

    assert call(good, "t") is None
    pod = k.read_pod("t")
    assert must(pod.spec, "spec").node_name == "bind-3"
    assert (must(pod.metadata, "metadata").annotations or {})["gpuvisor.io/test"] == "token"

    wrong = token_kubeconfig(k, tmp_path / "wrong.kubeconfig", "not-a-token")
    out = call(wrong, "u")
    assert isinstance(out, ApiError), out
    assert out.status == 401
    message = str(out)
    assert "\n" not in message
    assert message.startswith("401 Unauthorized: "), message
    assert "bearer token" in message, message
    assert "`token`" in message, message
    assert must(k.read_pod("u").spec, "spec").node_name is None

    # accepted, but the ServiceAccount may not bind in another namespace
    other = f"{k.namespace}-x"
    k.core.create_namespace(kubernetes.client.V1Namespace(metadata={"name": other}))
    try:
        m = pods["v"]
        (out,) = asyncio.run(
            bind_all(
                Binder(good, timeout=10.0),
                (other, "v", binding("v", str(m.uid), str(m.resource_version), "bind-3", "x")),
            )
        )
    finally:
        k.core.delete_namespace(other)
    assert isinstance(out, ApiError), out
    assert out.status == 403
    assert "\n" not in str(out)
    assert f'"system:serviceaccount:{k.namespace}:binder"' in str(out), out
    assert 'cannot create resource "pods/binding"' in str(out), out
