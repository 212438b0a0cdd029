"""The webhook's HTTPS server: POST /mutate answers AdmissionReviews, GET /healthz.

The serving certificate and key are files (a Secret mounted into the pod);
when either changes on disk (cert-manager or the script renewing it), the
next connection is served with the new pair.  A pair that does not load is
logged and the previous one kept.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import ssl
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from .review import ReviewError, WebhookConfig, admit

log = logging.getLogger("gpuvisor.webhook")

MAX_BODY = 4 << 20  # an AdmissionReview of one Pod; the API server caps requests at 3 MiB
IO_TIMEOUT_S = 10.0


class CertificateError(ValueError):
    """The serving certificate or key cannot be loaded (one line naming the file)."""


class ServingCertificate:
    """An SSL context for a certificate/key pair, rebuilt when either file changes."""

    def __init__(self, cert_file: Path, key_file: Path) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self._lock = threading.Lock()
        self._stamp = self._read_stamp()
        self._context = self._load()

    def _read_stamp(self) -> tuple[tuple[int, int, int], ...]:
        stamps = []
        for path in (self.cert_file, self.key_file):
            try:
                st = os.stat(path)
            except OSError as exc:
                raise CertificateError(f"{path}: {exc.strerror}") from None
            stamps.append((st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(stamps)

    def _load(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise CertificateError(
                f"--tls-cert-file {self.cert_file} / --tls-key-file {self.key_file}: {exc}"
            ) from None
        return ctx

    def context(self) -> ssl.SSLContext:
        """The current context, reloaded first if a file changed since the last load."""
        with self._lock:
            try:
                stamp = self._read_stamp()
                if stamp != self._stamp:
                    self._context = self._load()
                    self._stamp = stamp
                    log.info("reloaded the serving certificate %s", self.cert_file)
            except CertificateError as exc:
                # Half-written during a renewal, most likely: keep serving the old pair.
                log.warning("keeping the previous serving certificate: %s", exc)
            return self._context


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
        if self.path.split("?", 1)[0] != "/mutate":
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
            answer = admit(json.loads(self.rfile.read(length)), self.server.config)
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
