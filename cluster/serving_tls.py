"""Serving certificates of the cluster's HTTPS servers (`gpuvisor webhook`,
`gpuvisor scheduler` with --tls-cert): a certificate/key pair from files (a
Secret mounted into the pod); when either changes on disk (cert-manager or
a script renewing it), the next connection is served with the new pair.  A
pair that does not load is logged and the previous one kept.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from pathlib import Path

log = logging.getLogger("gpuvisor.tls")


class CertificateError(ValueError):
    """The serving certificate or key cannot be loaded (one line naming the file)."""


class ServingCertificate:
    """An SSL context for a certificate/key pair, rebuilt when either file changes."""

    def __init__(
        self,
        cert_file: Path,
        key_file: Path,
        options: tuple[str, str] = ("--tls-cert-file", "--tls-key-file"),
    ) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.options = options  # the command's names for the two files, for errors
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
                f"{self.options[0]} {self.cert_file} / {self.options[1]} {self.key_file}: {exc}"
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

    def server_context(self) -> ssl.SSLContext:
        """A context for a server that wraps its own sockets (aiohttp):
        each handshake switches to `context()`, so a renewed pair serves the
        next connection.  (OpenSSL calls the SNI callback on every
        ClientHello, with or without a server name: Go sends none to an IP.)"""
        ctx = self._load()

        def pick(sock: ssl.SSLObject | ssl.SSLSocket, name: str | None, _: ssl.SSLContext) -> None:
            sock.context = self.context()

        ctx.sni_callback = pick
        return ctx
