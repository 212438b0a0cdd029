"""Serving the device plugin: its socket in kubelet's device-plugins
directory, registration with kubelet, health polling, and starting over
when kubelet restarts (kubelet then removes every socket in the directory
and creates its own again)."""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from gpuvisor.cluster.deviceplugin.api import deviceplugin_v1beta1_pb2_grpc as dp_grpc

from . import defaults
from .api import deviceplugin_v1beta1_pb2 as dp
from .publish import InventoryPublisher
from .service import DevicePluginService, options

log = logging.getLogger("gpuvisor.device-plugin")

VERSION = "v1beta1"
DEFAULT_PLUGIN_DIR = defaults.PLUGIN_DIR
KUBELET_SOCKET = "kubelet.sock"
DEFAULT_ENDPOINT = defaults.ENDPOINT
GC_INTERVAL = 60.0  # seconds between collections of old container directories


class PluginRunner:
    def __init__(
        self,
        service: DevicePluginService,
        plugin_dir: Path = DEFAULT_PLUGIN_DIR,
        endpoint: str = DEFAULT_ENDPOINT,
        health_interval: float = 5.0,
        watch_interval: float = 0.2,
        publisher: InventoryPublisher | None = None,
    ) -> None:
        if "/" in endpoint or not endpoint:
            raise ValueError(f"endpoint {endpoint!r}: must be a file name (no /)")
        self.service = service
        self.plugin_dir = plugin_dir
        self.endpoint = endpoint
        self.health_interval = health_interval
        self.watch_interval = watch_interval
        self.publisher = publisher
        self.stopping = threading.Event()
        self.registrations = 0  # successful Register calls (each kubelet start)

    @property
    def socket(self) -> Path:
        return self.plugin_dir / self.endpoint

    @property
    def kubelet_socket(self) -> Path:
        return self.plugin_dir / KUBELET_SOCKET

    def _serve(self) -> grpc.Server:
        self.socket.unlink(missing_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        dp_grpc.add_DevicePluginServicer_to_server(self.service, server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        return server

    def _register(self) -> bool:
        """Register with kubelet; False if kubelet is not there (yet)."""
        req = dp.RegisterRequest(
            version=VERSION,
            endpoint=self.endpoint,
            resource_name=self.service.config.resource,
            options=options(),
        )
        try:
            with grpc.insecure_channel(f"unix://{self.kubelet_socket}") as ch:
                grpc.channel_ready_future(ch).result(timeout=5)
                dp_grpc.RegistrationStub(ch).Register(req, timeout=10)
        except (grpc.RpcError, grpc.FutureTimeoutError) as exc:
            log.warning("cannot register with kubelet at %s: %s", self.kubelet_socket, exc)
            return False
        self.registrations += 1
        log.info(
            "registered %s with kubelet (%d devices, endpoint %s)",
            self.service.config.resource,
            len(self.service.replicas.all_ids()),
            self.endpoint,
        )
        return True

    def _kubelet_id(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.kubelet_socket)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_ctime_ns

    def run(self) -> None:
        """Serve until stop(): register whenever kubelet (re)appears."""
        health = threading.Thread(target=self._health_loop, name="health", daemon=True)
        health.start()
        while not self.stopping.is_set():
            server = self._serve()
            try:
                kubelet = self._kubelet_id()
                while not self.stopping.is_set() and not (kubelet and self._register()):
                    self.stopping.wait(1.0)
                    kubelet = self._kubelet_id()
                # Serve until kubelet restarts (its socket is a new file) or
                # our socket is removed.
                while not self.stopping.wait(self.watch_interval):
                    if self._kubelet_id() != kubelet or not self.socket.exists():
                        log.info("kubelet restarted: serving and registering again")
                        break
            finally:
                server.stop(grace=1).wait()
        self.socket.unlink(missing_ok=True)

    def _health_loop(self) -> None:
        last_gc = time.monotonic()
        while not self.stopping.is_set():
            try:
                self.service.poll_health()
            except Exception:
                log.exception("health poll failed")
            if self.service.mig is not None:
                try:
                    self.service.release_mig()
                except Exception as exc:  # kubelet away: next poll
                    log.warning("cannot release the MIG instances of gone pods: %s", exc)
                try:
                    self.service.settle_mig_mode()
                except Exception as exc:  # the API away: MIG mode stays, next poll
                    log.warning("cannot tell whether idle GPUs may leave MIG mode: %s", exc)
            if self.publisher is not None:
                try:
                    self.publisher.publish(self.service.unhealthy(), reread=self.publisher.has_mig)
                except Exception as exc:  # API server away: next poll
                    log.warning("cannot publish the node's inventory: %s", exc)
            if time.monotonic() - last_gc > GC_INTERVAL:
                last_gc = time.monotonic()
                try:
                    self.service.collect_garbage()
                except Exception as exc:  # kubelet away: next time
                    log.warning("cannot collect old container directories: %s", exc)
            self.stopping.wait(self.health_interval)

    def stop(self) -> None:
        self.stopping.set()
        self.service.stop_streams()
