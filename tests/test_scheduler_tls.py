"""The extender over HTTPS with the real kube-scheduler: `gpuvisor
scheduler` given a serving certificate (GPUVISOR_SCHEDULER_TLS_CERT and
_KEY, as deploy/scheduler.yaml gives them) serves only TLS, and
kube-scheduler, configured with `enableHTTPS` and a `tlsConfig` naming the
CA, filters, prioritizes and binds a GPU pod through it.  A renewed
certificate is served from the next connection on."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
from gpuvisor.cluster.allocation import ANNOTATION
from gpuvisor.cluster.deviceplugin.publish import NODE_INVENTORY

from tests.k8s_cluster import KubeTest
from tests.test_scheduler_e2e import Extender, ExtenderTls, scheduler_config


def inventory(node: str) -> str:
    return json.dumps(
        {
            "kind": "gpuvisor.io/node-inventory",
            "version": 1,
            "node": node,
            "gpus": [
                {
                    "index": 0,
                    "uuid": f"GPU-{node}-0",
                    "model": "NVIDIA A100-SXM4-40GB",
                    "memory_mib": 40960,
                }
            ],
        }
    )


def issue(ca: trustme.CA, cert: Path, key: Path) -> None:
    """A certificate for 127.0.0.1 from `ca` and its key, into `cert` and
    `key` (written to new files and renamed, as a Secret volume updates)."""
    leaf = ca.issue_cert("127.0.0.1")
    for pem, path in ((leaf.cert_chain_pems[0], cert), (leaf.private_key_pem, key)):
        new = path.with_suffix(".new")
        pem.write_to_path(str(new))
        new.rename(path)


def ca_file(ca: trustme.CA, path: Path) -> Path:
    ca.cert_pem.write_to_path(str(path))
    return path


@pytest.fixture
def tls_extender(k8s: KubeTest, tmp_path: Path) -> Iterator[Extender]:
    ca = trustme.CA()
    tls = ExtenderTls(tmp_path / "tls.crt", tmp_path / "tls.key", ca_file(ca, tmp_path / "ca.crt"))
    issue(ca, tls.cert, tls.key)
    ext = Extender(k8s.cluster.kubeconfig, tmp_path / "extender.log", tls)
    try:
        ext.start()
        yield ext
    finally:
        ext.stop()


def handshake(port: int, ca: Path) -> bytes:
    """The DER certificate a new TLS connection to the extender gets,
    checked against `ca` (ssl.SSLCertVerificationError if it fails)."""
    ctx = ssl.create_default_context(cafile=str(ca))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as conn,
    ):
        der = conn.getpeercert(binary_form=True)
    assert der is not None
    return der


def plain_http_get(port: int, path: str) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().read()
    finally:
        conn.close()


def test_kube_scheduler_binds_through_the_extender_over_tls(
    k8s: KubeTest, tls_extender: Extender, tmp_path: Path
) -> None:
    ext = tls_extender
    tls = ext.tls
    assert tls is not None
    # plain HTTP is not served
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        plain_http_get(ext.port, "/healthz")
    k8s.start_scheduler(scheduler_config(ext.port, ca_file=tls.ca))
    k8s.create_node("tls-1", annotations={NODE_INVENTORY: inventory("tls-1")})
    k8s.create_pod("first", gpus=1, gpumem=3000, gpucores=30)
    assert k8s.wait_bound("first", timeout=60) == "tls-1"
    assert ANNOTATION in (k8s.read_pod("first").metadata.annotations or {})
    assert "serving the extender on https://127.0.0.1:" in ext.log.read_text()

    # renewed (by another CA here, to tell them apart): the next
    # connection gets the new certificate, without a restart
    before = handshake(ext.port, tls.ca)
    other = trustme.CA()
    issue(other, tls.cert, tls.key)
    after = handshake(ext.port, ca_file(other, tmp_path / "other-ca.crt"))
    assert after != before
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(ext.port, tls.ca)
