"""`gpuvisor scheduler`: the kube-scheduler extender."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from ..cli_options import (
    file_option,
    host_option,
    log_server_lines,
    port_option,
    split_count_option,
)
from . import defaults


@click.command("scheduler")
@host_option(
    "--host",
    "Address of the extender (filter, prioritize, bind): 127.0.0.1 beside kube-scheduler.",
)
@host_option("--metrics-host", "Address of the cluster metrics (a Service exposes them).")
@port_option(
    "--port", defaults.PORT, "The extender's port (kube-scheduler's urlPrefix points here)."
)
@port_option(
    "--metrics-port",
    defaults.METRICS_PORT,
    "Port of the cluster metrics (GET /metrics; HAMi's port).",
)
@file_option(
    "--kubeconfig",
    "Kubeconfig to reach the API server (default: in-cluster, else ~/.kube/config).",
)
@file_option(
    "--tls-cert",
    "Serve the extender over HTTPS with this certificate (PEM, with its chain); needs "
    "--tls-key; reloaded when it changes on disk (kube-scheduler: enableHTTPS, tlsConfig).",
    envvar="GPUVISOR_SCHEDULER_TLS_CERT",
    show_envvar=True,
)
@file_option(
    "--tls-key",
    "The certificate's private key (PEM); reloaded with it.",
    envvar="GPUVISOR_SCHEDULER_TLS_KEY",
    show_envvar=True,
)
@split_count_option(10, "vGPUs per GPU at most (the device plugin's --split-count).")
@click.option(
    "--node-policy",
    type=click.Choice(["binpack", "spread"]),
    default="binpack",
    show_default=True,
    help="Node policy of pods that name none (hami.io/node-scheduler-policy).",
)
@click.option(
    "--gpu-policy",
    type=click.Choice(["binpack", "spread", "topology-aware"]),
    default="binpack",
    show_default=True,
    help="GPU policy of pods that name none (hami.io/gpu-scheduler-policy).",
)
@file_option("--mig-geometries", "HAMi's knownMigGeometries (YAML) to keep MIG layouts within.")
def scheduler(
    host: str,
    metrics_host: str,
    port: int,
    metrics_port: int,
    kubeconfig: Path | None,
    tls_cert: Path | None,
    tls_key: Path | None,
    split_count: int,
    node_policy: str,
    gpu_policy: str,
    mig_geometries: Path | None,
) -> None:
    """Serve kube-scheduler's extender API (filter, prioritize, bind).

    Node inventories come from their gpuvisor.io/node-inventory annotation
    (the device plugin publishes it); each bound pod's GPUs are written to
    its gpuvisor.io/allocation annotation, from which a restarted extender
    rebuilds its reservations.  See docs/kubernetes.md.
    """
    # aiohttp, the Kubernetes client and the allocator load only when it runs
    import asyncio
    import signal
    import threading

    from gpuvisor.cluster.allocator import Config
    from gpuvisor.cluster.inventory_model import DocumentError
    from gpuvisor.cluster.mig import read_geometries
    from kubernetes import client, config

    from ..serving_tls import CertificateError, ServingCertificate
    from .binding import Binder
    from .extender import API_TIMEOUT, Extender
    from .metrics import Metrics
    from .server import serve
    from .state import ClusterState
    from .wake import Waker

    log_server_lines()
    if (tls_cert is None) != (tls_key is None):
        raise click.BadParameter(
            "give both --tls-cert and --tls-key, or neither", param_hint="--tls-cert"
        )
    geometries = ()
    if mig_geometries is not None:
        try:
            geometries = read_geometries(mig_geometries)
        except DocumentError as exc:
            raise click.BadParameter(str(exc), param_hint="--mig-geometries") from None
    cfg = Config(
        split_count=split_count,
        geometries=geometries,
        node_policy=node_policy,
        gpu_policy=gpu_policy,
    )
    try:
        if kubeconfig is not None:
            config.load_kube_config(str(kubeconfig))
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
    except Exception as exc:
        raise click.ClickException(f"cannot configure the Kubernetes client: {exc}") from None
    api_client = client.ApiClient()
    # the binds' reads of pods, the waker and the watches share the client's connection pool
    api_client.rest_client.pool_manager.connection_pool_kw["maxsize"] = 48
    core = client.CoreV1Api(api_client)
    state = ClusterState(core, cfg)
    metrics = Metrics(state)
    state.wake = Waker(core, metrics.wake).wake
    tls = None
    if tls_cert is not None and tls_key is not None:
        try:
            tls = ServingCertificate(tls_cert, tls_key, ("--tls-cert", "--tls-key"))
        except CertificateError as exc:
            raise click.ClickException(str(exc)) from None
    extender = Extender(
        state, core, Binder(api_client.configuration, API_TIMEOUT), metrics.unanswered
    )

    def start_state() -> None:
        while not state.stopping.is_set():
            try:
                state.start()
                return
            except Exception as exc:
                logging.getLogger("gpuvisor.scheduler").warning("cannot sync: %s", exc)
                state.stopping.wait(2.0)

    threading.Thread(target=start_state, name="sync", daemon=True).start()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        context = tls.server_context() if tls is not None else None
        await serve(extender, metrics, host, port, metrics_host, metrics_port, context, stop)

    asyncio.run(main())
    state.stopping.set()
