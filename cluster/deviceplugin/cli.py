"""`gpuvisor device-plugin`: kubelet's device plugin for shared GPUs."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from types import FrameType
from typing import Any

import click

from ..cli_options import log_server_lines, path_option, split_count_option
from . import defaults


@click.command("device-plugin")
@click.option(
    "--resource",
    default=defaults.RESOURCE,
    show_default=True,
    help="The extended resource the GPUs are advertised as.",
)
@split_count_option(
    defaults.SPLIT_COUNT,
    "Replicas per GPU (HAMi's deviceSplitCount): how many containers may share one.",
)
@click.option(
    "--node-name",
    envvar="NODE_NAME",
    default="",
    show_default="$NODE_NAME",
    help="This node's name: GetPreferredAllocation prefers the GPUs of the pods bound to it.",
)
@path_option(
    "--plugin-dir",
    defaults.PLUGIN_DIR,
    "kubelet's device-plugins directory (kubelet.sock).",
)
@click.option(
    "--endpoint",
    default=defaults.ENDPOINT,
    show_default=True,
    help="This plugin's socket, a file name in --plugin-dir.",
)
@path_option(
    "--pod-resources-socket",
    Path(defaults.POD_RESOURCES_SOCKET),
    "kubelet's PodResources API socket.",
)
@path_option(
    "--state-dir",
    defaults.STATE_DIR,
    "Host directory of the per-container directories (region, limits file); "
    "the plugin must see it at the same path.",
)
@path_option(
    "--lib-dir",
    defaults.LIB_DIR,
    "Host directory holding libgpuvisor.so, mounted read-only into containers.",
)
@path_option(
    "--node-dir",
    defaults.NODE_DIR,
    "Host directory of the node agent's socket, mounted into containers.",
)
@click.option(
    "--health-interval",
    type=click.FloatRange(0.1),
    default=5.0,
    show_default=True,
    help="Seconds between NVML health checks.",
)
@click.option(
    "--mig-mode-off-after",
    type=click.FloatRange(0),
    default=60.0,
    show_default=True,
    help="Seconds a GPU whose MIG mode the plugin turned on waits in MIG mode with no "
    "instance, no process and no bound pod's MIG grant on it before the plugin turns "
    "MIG mode off; 0: never turn it off.",
)
@click.option(
    "--manage-mig-mode",
    "manage_mig_mode",
    multiple=True,
    metavar="GPU-UUID",
    help="A GPU an operator put in MIG mode whose mode the plugin may turn off (and on) "
    "like those it turned on itself.  Repeatable; remembered in the state directory.",
)
@click.option(
    "--publish-inventory/--no-publish-inventory",
    default=True,
    show_default=True,
    help="Write the node's inventory into its Node's gpuvisor.io/node-inventory "
    "annotation (needs --node-name), where gpuvisor scheduler reads it.",
)
def device_plugin(
    resource: str,
    split_count: int,
    node_name: str,
    plugin_dir: Path,
    endpoint: str,
    pod_resources_socket: Path,
    state_dir: Path,
    lib_dir: Path,
    node_dir: Path,
    health_interval: float,
    mig_mode_off_after: float,
    manage_mig_mode: tuple[str, ...],
    publish_inventory: bool,
) -> None:
    """Serve kubelet's device plugin API for RESOURCE on this node.

    Each GPU is advertised SPLIT-COUNT times.  Allocate gives a container
    the library, the node socket and a directory of its own; just before
    the container starts (PreStartContainer), the plugin asks kubelet's
    PodResources API whose container it is and writes that pod's limits
    (its gpuvisor.io/allocation annotation) into the container's limits
    file.  For a MIG placement, Allocate makes the planned MIG instance
    (NVML) and the container sees its MIG device; instances made for a pod
    are destroyed once it is gone (never while in use), MIG mode the plugin
    turned on is turned off again once the GPU is idle in MIG mode with
    nothing planned on it (--mig-mode-off-after), and the node's inventory
    is republished after each MIG change.  Re-registers whenever
    kubelet restarts.  See docs/kubernetes.md.
    """
    # gRPC, NVML and the Kubernetes client load only when the plugin runs
    from .gpus import NvmlGpus
    from .kube import KubePods
    from .owners import PodResourcesOwners
    from .publish import InventoryPublisher, KubeNodes, inventory_document
    from .runner import PluginRunner
    from .service import DevicePluginService, PluginConfig

    log_server_lines()
    if "/" in endpoint or not endpoint:
        raise click.BadParameter(f"{endpoint!r}: must be a file name", param_hint="--endpoint")
    config = PluginConfig(
        resource=resource,
        split_count=split_count,
        node_name=node_name,
        state_dir=state_dir,
        lib_dir=lib_dir,
        node_dir=node_dir,
    )
    try:
        gpus = NvmlGpus()
    except Exception as exc:
        raise click.ClickException(f"cannot read the GPUs through NVML: {exc}") from None
    try:
        pods = KubePods(node=node_name)
    except Exception as exc:
        raise click.ClickException(f"cannot configure the Kubernetes client: {exc}") from None
    from .migdriver import NvmlMig
    from .migrealise import MIG_MINE, MIG_MODE, MigRealiser

    for uuid in manage_mig_mode:
        if not uuid.startswith("GPU-"):
            raise click.BadParameter(
                f"{uuid!r}: not a GPU UUID (GPU-...)", param_hint="--manage-mig-mode"
            )
    state_dir.mkdir(parents=True, exist_ok=True)
    mig = MigRealiser(
        NvmlMig(),
        mine=state_dir / MIG_MINE,
        mode=state_dir / MIG_MODE,
        off_after=mig_mode_off_after or None,
        manage=manage_mig_mode,
    )
    service = DevicePluginService(
        config, gpus, pods, PodResourcesOwners(str(pod_resources_socket)), mig
    )
    publisher = None
    if publish_inventory:
        if not node_name:
            raise click.BadParameter(
                "the node's name is needed to publish its inventory (or --no-publish-inventory)",
                param_hint="--node-name",
            )
        from gpuvisor.cluster.inventory import read_inventory

        def reader() -> dict[str, Any]:
            doc: dict[str, Any] = read_inventory(node_name)  # NVML is initialised (NvmlGpus)
            return doc

        try:
            document = reader()
        except Exception as exc:
            logging.getLogger("gpuvisor.device-plugin").warning(
                "cannot read the full inventory (%s): publishing one without links or MIG", exc
            )
            publisher = InventoryPublisher(
                node_name, inventory_document(node_name, gpus.gpus(), {}), KubeNodes(pods.api)
            )
        else:
            publisher = InventoryPublisher(node_name, document, KubeNodes(pods.api), reader)
        pub = publisher
        mig.on_change = lambda: pub.publish(service.unhealthy(), reread=True)
    runner = PluginRunner(service, plugin_dir, endpoint, health_interval, publisher=publisher)

    def stop(signum: int, frame: FrameType | None) -> None:
        runner.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    runner.run()
