"""The Binding write of the extender's bind, on the event loop (aiohttp).

Made through the Kubernetes client (`create_namespaced_pod_binding`, in a
worker thread), a bind cost the extender about 1.4 ms of CPU per pod under
make bench-cluster, a quarter of its CPU: the client's validation and
models, urllib3's and http.client's request and response handling in
Python, and a worker thread's hand-offs of the GIL with the event loop,
which kube-scheduler's filter and prioritize calls wait on.  Here the same
POST goes through aiohttp's client on the loop that serves the verbs: no
thread, responses parsed in C, the connections kept open.

What the request is made with comes from the client's Configuration (as
`config.load_kube_config` or `load_incluster_config` filled it), so it is
the same as the client's own calls: the API server's address, its TLS
(the CA, the client certificate and key, `verify_ssl`, `assert_hostname`,
`tls_server_name`), the proxy, and the bearer token, read per request
through `Configuration.auth_settings` (which refreshes an expiring one as
the client does).
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import aiohttp

CONNECTIONS = 48  # the client's pool size for the verbs (cli.py)


class ApiError(RuntimeError):
    """The API server answered the write with `status` (not 2xx); the
    message is one line: the status, and `detail` (why) when known."""

    def __init__(self, status: int, reason: str, body: bytes, detail: str = "") -> None:
        super().__init__(f"{status} {reason}: {detail}" if detail else f"{status} {reason}")
        self.status = status
        self.reason = reason
        self.body = body


def status_message(body: bytes) -> str:
    """The `message` of the API server's Status answer, on one line ("" if none)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return ""
    message = doc.get("message") if isinstance(doc, dict) else None
    return " ".join(str(message).split()) if message else ""


def tls_context(configuration: Any) -> ssl.SSLContext:
    """The TLS the Kubernetes client's urllib3 pool uses, as an SSLContext."""
    cfg = configuration
    if cfg.verify_ssl:
        ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert, cadata=cfg.ca_cert_data)
        if cfg.assert_hostname is False:
            ctx.check_hostname = False
    else:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if cfg.cert_file:
        ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
    return ctx


class Binder:
    """POSTs pods' Bindings to the API server on the running event loop."""

    def __init__(self, configuration: Any, timeout: float) -> None:
        self.configuration = configuration
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        host = str(configuration.host).rstrip("/")
        self.host = host
        self._tls: ssl.SSLContext | None = (
            tls_context(configuration) if host.startswith("https:") else None
        )
        asserted = configuration.assert_hostname
        name = configuration.tls_server_name or (asserted if isinstance(asserted, str) else None)
        self._server_hostname: str | None = name or None
        self._session: aiohttp.ClientSession | None = None

    def credentials(self) -> str:
        """What the requests authenticate with, named as the kubeconfig's
        (or a pod's) field holding it, for a 401's message."""
        if any(k.lower() == "authorization" for k in self._headers()):
            return (
                "the bearer token (the kubeconfig user's `token`, or in a pod its "
                "service account's token file)"
            )
        if self.configuration.cert_file:
            return "the client certificate (the kubeconfig user's `client-certificate`)"
        return "no credentials (the kubeconfig user has no `token` or `client-certificate`)"

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        for auth in self.configuration.auth_settings().values():
            if auth.get("in") == "header" and auth.get("value"):
                headers[str(auth["key"])] = str(auth["value"])
        return headers

    def _session_now(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                ssl=self._tls if self._tls is not None else False, limit=CONNECTIONS
            )
            # trust_env False: the client's Configuration says where to go
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False)
        return self._session

    async def bind(self, namespace: str, name: str, body: Mapping[str, Any]) -> None:
        """Create the Binding `body` of pod namespace/name; ApiError if the
        API server refuses it."""
        cfg = self.configuration
        path = f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}/binding"
        extra: dict[str, Any] = {}
        if self._server_hostname is not None:
            extra["server_hostname"] = self._server_hostname
        if cfg.proxy:
            extra["proxy"] = cfg.proxy
            if cfg.proxy_headers:
                extra["proxy_headers"] = cfg.proxy_headers
        async with self._session_now().post(
            self.host + path,
            data=json.dumps(body, separators=(",", ":")).encode(),
            headers=self._headers(),
            timeout=self.timeout,
            **extra,
        ) as response:
            data = await response.read()  # read to the end: the connection is kept
            if not 200 <= response.status <= 299:
                if response.status == 401:
                    # the API server's Status says only "Unauthorized"
                    detail = f"the API server did not accept {self.credentials()}"
                else:
                    detail = status_message(data)
                raise ApiError(response.status, str(response.reason or ""), data, detail)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
