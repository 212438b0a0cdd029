"""The node agent's HTTP server: /metrics (Prometheus,
metrics.py), /status (JSON) and /healthz, served from a thread of
its own, each client cut off --http-timeout seconds after it connected.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol


class Pages(Protocol):
    """What the server asks of the agent that starts it (server.Agent)."""

    def metrics_payload(self, accept: str | None) -> tuple[bytes, str]: ...

    def status_payload(self) -> bytes: ...


log = logging.getLogger("gpuvisor.agent")


class HttpHandler(BaseHTTPRequestHandler):
    agent: Pages  # the agent, set on the subclass made per agent
    # Seconds a client may stall a read or write (StreamRequestHandler sets
    # it on the socket); the subclass made per agent sets --http-timeout.
    timeout = 10.0
    # /status to clients beyond the node too (--status-public); by default to
    # loopback clients only (gpuvisor top on the node)
    status_public = False

    def do_GET(self) -> None:
        self._answer(with_body=True)

    def do_HEAD(self) -> None:
        """What GET would answer, without the body (load balancers' and
        uptime probes' health checks use HEAD)."""
        self._answer(with_body=False)

    def _answer(self, with_body: bool) -> None:
        # A trailing slash names the same page ("/metrics/" as "/metrics").
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        try:
            page = self._page(path)
        except TimeoutError as exc:
            self.send_error(503, str(exc))
            return
        if page is None:
            self.send_error(404, "try /metrics or /status")
            return
        body, ctype = page
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def _page(self, path: str) -> tuple[bytes, str] | None:
        """The page's body and content type; None: no such page."""
        if path == "/metrics":
            body, ctype = self.agent.metrics_payload(self.headers.get("Accept"))
        elif path == "/status":
            if not (self.status_public or _is_local(self.client_address)):
                return None  # every container's labels, cgroups, PIDs, uids: the node's only
            body, ctype = self.agent.status_payload(), "application/json"
        elif path == "/healthz":
            body, ctype = b"ok\n", "text/plain"
        else:
            return None
        return body, ctype

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http: " + format, *args)


class HttpServer(ThreadingHTTPServer):
    """One thread per connection, at most MAX_HANDLERS at once (more are
    closed at once), each cut off `deadline` seconds after it was accepted
    however slowly its client trickles the request or reads the reply."""

    daemon_threads = True
    request_queue_size = 128  # listen backlog
    MAX_HANDLERS = 32

    # Of which one client address holds at most this many: 64 idle clients
    # of one address that reconnect when cut off failed every scrape when
    # they could take all MAX_HANDLERS.
    MAX_PER_CLIENT = 4

    def __init__(self, address: tuple[str, int], handler: Any, deadline: float) -> None:
        self.deadline = deadline
        self.slots = threading.BoundedSemaphore(self.MAX_HANDLERS)
        self.per_client: dict[str, int] = {}
        self.per_client_lock = threading.Lock()
        super().__init__(address, handler)

    def _take_client_slot(self, client: str) -> bool:
        with self.per_client_lock:
            held = self.per_client.get(client, 0)
            if held >= self.MAX_PER_CLIENT:
                return False
            self.per_client[client] = held + 1
            return True

    def _give_client_slot(self, client: str) -> None:
        with self.per_client_lock:
            held = self.per_client.pop(client, 1) - 1
            if held > 0:
                self.per_client[client] = held

    def process_request(self, request: Any, client_address: Any) -> None:
        client = str(client_address[0]) if client_address else ""
        if not self._take_client_slot(client):
            self.shutdown_request(request)  # that client has its share: closed unanswered
            return
        if not self.slots.acquire(blocking=False):
            self._give_client_slot(client)
            self.shutdown_request(request)  # too many at once: closed unanswered
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        timer = threading.Timer(self.deadline, _cut_off, (request,))
        timer.daemon = True
        timer.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            timer.cancel()
            self.slots.release()
            self._give_client_slot(str(client_address[0]) if client_address else "")

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away mid-reply (BrokenPipeError, reset): not
        # worth a traceback on stderr.
        log.debug("http: request from %s failed", client_address, exc_info=True)


def _is_local(address: Any) -> bool:
    """Is a client's address a loopback one (the node itself)?"""
    try:
        return ipaddress.ip_address(str(address[0]).split("%", 1)[0]).is_loopback
    except (ValueError, IndexError, TypeError):
        return False


def _cut_off(sock: socket.socket) -> None:
    """End a request past its deadline: its handler's blocked read or write fails."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
