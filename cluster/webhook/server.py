"""The webhook's HTTPS server: POST /mutate (review.py) and POST /validate
(guard.py) answer AdmissionReviews, GET /healthz.

The serving certificate and key are files (a Secret mounted into the pod);
when either changes on disk (cert-manager or the script renewing it), the
next connection is served with the new pair.  A pair that does not load is
logged and the previous one kept.
"""

from __future__ import annotations

import json
import logging
import socket
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..serving_tls import CertificateError, ServingCertificate
from .guard import guard
from .review import ReviewError, WebhookConfig, admit

__all__ = ["CertificateError", "ServingCertificate", "WebhookServer"]

log = logging.getLogger("gpuvisor.webhook")

MAX_BODY = 4 << 20  # an AdmissionReview of one Pod; the API server caps requests at 3 MiB
IO_TIMEOUT_S = 10.0


class _Handler(BaseHTTPRequestHandler):
    server: WebhookServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def _reply(self, status: HTTPStatus, body: dict[str, Any] | str) -> None:
        data = (json.dumps(body) if isinstance(body, dict) else body + "\n").encode()
        self.send_response(status)
        kind = "application/json" if isinstance(body, dict) else "text/plain; charset=utf-8"
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path in ("/healthz", "/readyz"):
            self._reply(HTTPStatus.OK, "ok")
        else:
            self._reply(HTTPStatus.NOT_FOUND, f"no such path {self.path}")

    def do_POST(self) -> None:
        answer_with = {"/mutate": admit, "/validate": guard}.get(self.path.split("?", 1)[0])
        if answer_with is None:
            self._reply(HTTPStatus.NOT_FOUND, f"no such path {self.path}")
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._reply(HTTPStatus.LENGTH_REQUIRED, "Content-Length: required")
            return
        if not 0 < length <= MAX_BODY:
            self._reply(HTTPStatus.BAD_REQUEST, f"Content-Length: {length} out of 1..{MAX_BODY}")
            return
        try:
            answer = answer_with(json.loads(self.rfile.read(length)), self.server.config)
        except (ValueError, ReviewError) as exc:
            self._reply(HTTPStatus.BAD_REQUEST, f"not an AdmissionReview: {exc}")
            return
        response = answer["response"]
        if not response["allowed"]:
            log.info("denied: %s", response["status"]["message"])
        self._reply(HTTPStatus.OK, answer)


class WebhookServer(ThreadingHTTPServer):
    """HTTPS on (host, port); each connection is wrapped with the current certificate."""

    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], certificate: ServingCertificate, config: WebhookConfig
    ) -> None:
        self.certificate = certificate
        self.config = config
        super().__init__(address, _Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, addr = self.socket.accept()
        conn.settimeout(IO_TIMEOUT_S)
        # The handshake happens on the handler's thread, on its first read.
        wrapped = self.certificate.context().wrap_socket(
            conn, server_side=True, do_handshake_on_connect=False
        )
        return wrapped, addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("connection from %s failed", client_address, exc_info=True)
