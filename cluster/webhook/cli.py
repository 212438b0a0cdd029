"""`gpuvisor webhook`: the mutating admission webhook for GPU pods."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from types import FrameType

import click

from ..cli_options import host_option, log_server_lines, port_option

DEFAULT_PORT = 9443


@click.command("webhook")
@click.option(
    "--tls-cert-file",
    type=click.Path(path_type=Path, dir_okay=False),
    required=True,
    help="Serving certificate (PEM, with its chain); reloaded when it changes on disk.",
)
@click.option(
    "--tls-key-file",
    type=click.Path(path_type=Path, dir_okay=False),
    required=True,
    help="The certificate's private key (PEM); reloaded with it.",
)
@host_option("--bind-address", "Address to listen on.")
@port_option("--port", DEFAULT_PORT, "HTTPS port (0: any free port, logged).", any_port=True)
@click.option(
    "--scheduler-name",
    default="gpuvisor-scheduler",
    show_default=True,
    help="The scheduler GPU pods are given (the kube-scheduler running the extender).",
)
def webhook(
    tls_cert_file: Path, tls_key_file: Path, bind_address: str, port: int, scheduler_name: str
) -> None:
    """Serve the mutating admission webhook for GPU pods over HTTPS (POST /mutate).

    A pod asking for nvidia.com/gpu, gpumem, gpumem-percentage or gpucores
    gets --scheduler-name and HAMi's defaults (one GPU when only memory or
    cores are asked; gpucores 100 for a whole GPU), or is refused with one
    line naming the field and the value, by the same parser the scheduler
    extender uses.  Other pods pass unchanged.  See docs/kubernetes.md.
    """
    from .review import WebhookConfig
    from .server import CertificateError, ServingCertificate, WebhookServer

    log_server_lines()
    if not scheduler_name:
        raise click.BadParameter("must not be empty", param_hint="--scheduler-name")
    try:
        certificate = ServingCertificate(tls_cert_file, tls_key_file)
    except CertificateError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        server = WebhookServer((bind_address, port), certificate, WebhookConfig(scheduler_name))
    except OSError as exc:
        raise click.ClickException(f"--port {port}: {exc.strerror}") from None
    host, bound = server.server_address[:2]
    logging.getLogger("gpuvisor.webhook").info(
        "serving https://%s:%d/mutate for scheduler %s", host, bound, scheduler_name
    )

    def stop(signum: int, frame: FrameType | None) -> None:
        # shutdown() waits for serve_forever, so not from its own thread
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    with server:
        server.serve_forever(poll_interval=0.5)
