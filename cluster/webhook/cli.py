"""`gpuvisor webhook`: the mutating admission webhook for GPU pods."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from types import FrameType

import click

from ..cli_options import host_option, log_server_lines, port_option
from .review import DEFAULT_ALLOCATION_WRITER

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
@click.option(
    "--allocation-writer",
    "allocation_writers",
    multiple=True,
    default=(DEFAULT_ALLOCATION_WRITER,),
    show_default=True,
    help="A user (as the API server names it) who may write a pod's gpuvisor.io/allocation "
    "annotation: the scheduler extender's identity.  Repeat for several.",
)
def webhook(
    tls_cert_file: Path,
    tls_key_file: Path,
    bind_address: str,
    port: int,
    scheduler_name: str,
    allocation_writers: tuple[str, ...],
) -> None:
    """Serve the admission webhooks for GPU pods over HTTPS.

    POST /mutate: a pod asking for nvidia.com/gpu, gpumem, gpumem-percentage
    or gpucores gets --scheduler-name and HAMi's defaults (one GPU when only
    memory or cores are asked; gpucores 100 for a whole GPU), or is refused
    with one line naming the field and the value, by the same parser the
    scheduler extender uses.  Other pods pass unchanged.

    POST /validate: a pod created with the gpuvisor.io/allocation
    annotation, or an update that sets, changes or removes it, is refused
    unless it comes from an --allocation-writer.  See docs/kubernetes.md.
    """
    from .review import WebhookConfig
    from .server import CertificateError, ServingCertificate, WebhookServer

    log_server_lines()
    if not scheduler_name:
        raise click.BadParameter("must not be empty", param_hint="--scheduler-name")
    for writer in allocation_writers:
        if not writer.strip():
            raise click.BadParameter(
                f"{writer!r}: must not be empty", param_hint="--allocation-writer"
            )
    try:
        certificate = ServingCertificate(tls_cert_file, tls_key_file)
    except CertificateError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        config = WebhookConfig(scheduler_name, tuple(allocation_writers))
        server = WebhookServer((bind_address, port), certificate, config)
    except OSError as exc:
        raise click.ClickException(f"--port {port}: {exc.strerror}") from None
    host, bound = server.server_address[:2]
    logging.getLogger("gpuvisor.webhook").info(
        "serving https://%s:%d/mutate for scheduler %s, /validate for allocation writers %s",
        host,
        bound,
        scheduler_name,
        ", ".join(allocation_writers),
    )

    def stop(signum: int, frame: FrameType | None) -> None:
        # shutdown() waits for serve_forever, so not from its own thread
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    with server:
        server.serve_forever(poll_interval=0.5)
