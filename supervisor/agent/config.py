"""The node agent's configuration (AgentConfig) and where its files lie:
the reporting socket, the admin socket beside it, the context lock.

Read by `gpuvisor node-agent` (agent/server.py, agent/cli.py).  Where the
socket and the node lock lie by default is in ../paths.py, which `gpuvisor
run` reads too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..paths import CONTEXT_LOCK_NAME, DEFAULT_SOCKET, SUN_PATH_MAX
from .persist import STATE_FILE_NAME, state_file_for


def socket_path_problem(path: str) -> str | None:
    """Why path cannot be a Unix socket's (None: it can): bind and connect
    take at most SUN_PATH_MAX bytes, and an empty one names no file (the
    admin socket's default beside it would be '<cwd's parent>-admin')."""
    if not path:
        return f"{path!r}: not a usable path"
    if len(os.fsencode(path)) > SUN_PATH_MAX:
        return f"{path}: longer than {SUN_PATH_MAX} bytes (a Unix socket path)"
    return None


# The admin socket (set-limit) lives in a directory of its own, beside the
# reporting socket's directory and never inside it: that one is mounted into
# every workload, this one must not be (docs/protocol.md, "Admin").
ADMIN_SOCKET_ENV = "GPUVISOR_ADMIN_SOCKET"
ADMIN_SOCKET_NAME = "admin.sock"


def admin_socket_for(socket_path: str) -> str:
    """The default admin socket of an agent on socket_path: admin.sock in
    the sibling directory "<socket's directory>-admin"
    (/run/gpuvisor/node.sock -> /run/gpuvisor-admin/admin.sock)."""
    parent = os.path.dirname(os.path.abspath(socket_path)).rstrip("/") or "/gpuvisor"
    return os.path.join(parent + "-admin", ADMIN_SOCKET_NAME)


def admin_socket_problem(socket_path: str, admin_path: str) -> str | None:
    """Why admin_path cannot be the admin socket of an agent on socket_path
    (None: it can): its directory must not be the reporting socket's
    directory or lie below it, since that one is mounted into workloads."""
    shared = os.path.dirname(os.path.abspath(socket_path))
    admin_dir = os.path.dirname(os.path.abspath(admin_path))
    # Resolved too, so that a directory linked into the socket's is seen for
    # what it is (before the state file beside it, which would be blamed).
    real_shared = os.path.realpath(shared).rstrip("/")
    real_admin = os.path.realpath(admin_dir)
    if real_admin == real_shared or real_admin.startswith(real_shared + "/"):
        return f"{admin_path}: must not be in {shared}, the reporting socket's directory"
    if admin_dir == shared or admin_dir.startswith(shared.rstrip("/") + "/"):
        return f"{admin_path}: must not be in {shared}, the reporting socket's directory"
    return None


# The library's per-GPU launch-order files, in the node lock's directory
# (native/shim/sm_arbiter.c): the socket's, where gpuvisor run points it.
SM_FILE_PREFIX = "gpuvisor-sm-"


def _foreign(directory: str, own: set[str], own_prefixes: tuple[str, ...]) -> list[str]:
    """The entries of directory that are none of the agent's files, sorted
    ([] when it does not exist yet).  OSError: it cannot be listed."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n not in own and not n.startswith(own_prefixes))


def socket_dir_is_own(socket_path: str) -> bool:
    """Whether the reporting socket's directory holds nothing but the
    agent's files (or does not exist yet): the agent opens only such a
    directory to containers of every uid, never one shared with other files
    (--socket /root/node.sock must not open /root to every user)."""
    directory = os.path.dirname(os.path.abspath(socket_path))
    own = {os.path.basename(socket_path), CONTEXT_LOCK_NAME}
    try:
        return not _foreign(directory, own, (SM_FILE_PREFIX,))
    except OSError:
        return False


def admin_dir_problem(admin_path: str, state_file: str) -> str | None:
    """Why the admin socket's directory cannot be made the agent's alone,
    mode 0700 (None: it can): it holds other files than the agent's (admin
    socket, state file): /tmp or /run made 0700 would lock every other user
    out of them."""
    directory = os.path.dirname(os.path.abspath(admin_path))
    names = {STATE_FILE_NAME}
    if os.path.dirname(os.path.abspath(state_file)) == directory:
        names.add(os.path.basename(state_file))
    # write_state's temporary files: ".<name>.<random>"
    prefixes = tuple(f".{name}." for name in names)
    try:
        foreign = _foreign(directory, names | {os.path.basename(admin_path)}, prefixes)
    except OSError as exc:
        return f"{admin_path}: cannot list {directory} ({exc.strerror or exc})"
    if not foreign:
        return None
    shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
    return (
        f"{admin_path}: {directory} holds other files ({shown}): the admin socket needs "
        "a directory of its own, which the agent makes mode 0700"
    )


@dataclass
class AgentConfig:
    socket_path: str = DEFAULT_SOCKET
    admin_socket: str = ""  # "": admin_socket_for(socket_path)
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 9400  # 0: any free port (printed in the ready line)
    expire_after: float = 10.0  # seconds without a report before a container expires
    read_timeout: float = 5.0  # a partial line or unread replies older than this: disconnect
    idle_timeout: float = 120.0  # no message at all for this long: disconnect
    http_timeout: float = 10.0  # an HTTP client stalled this long (read or write): disconnect
    rate: float = 50.0  # messages/s per connection (0: unlimited)
    burst: float = 100.0
    max_connections: int = 4096
    # Connections one peer cgroup may hold at once (a greedy container locks
    # only itself out; the rest of max_connections stays for the others)
    max_connections_per_cgroup: int = 64
    active_threshold: float = 1.0  # sm_share percent above which a container is active
    active_window: float = 3.0  # seconds an active report keeps a device "busy"
    legacy_metrics: bool = False
    status_public: bool = False  # /status to clients beyond the node (default: loopback only)
    node_name: str = ""  # the host series' node label ("": the host name)
    cpu: int | None = None  # pin the agent to this CPU
    # Containers (label sets) one verified cgroup may hold; a new one
    # replaces the one that reported least recently.
    max_per_cgroup: int = 16
    max_expire: float = 300.0  # cap on 3 x a container's report interval
    # Bad messages in a row after which a connection is closed (0: never)
    max_errors: int = 10
    # Seconds an administrator's limits outlive a container that left, for
    # the container that replaces it in the same pod (0: forgotten at once)
    limit_grace: float = 300.0
    # Where the administrators' limits are kept across an agent restart
    # ("": state_file_for(admin_socket_path), beside the admin socket)
    state_file: str = ""
    # Read the region files of the containers under this directory
    # (region_dir.py; "": none) every region_scan_interval seconds
    region_dir: str = ""
    region_scan_interval: float = 1.0

    @property
    def admin_socket_path(self) -> str:
        return self.admin_socket or admin_socket_for(self.socket_path)

    @property
    def state_file_path(self) -> str:
        return self.state_file or state_file_for(self.admin_socket_path)

    @property
    def restore_window(self) -> float:
        """Seconds a restarted agent waits for the containers that were
        reporting when it stopped to take their administrators' limits
        back: as long as it would have kept them had it stayed up (the
        longest expiry, then --limit-grace)."""
        return max(self.expire_after, self.max_expire) + self.limit_grace
