"""Where the node's shared files lie: the node agent's reporting socket and
the context lock beside it.

`gpuvisor run` (entrypoint/config.py) and `gpuvisor node-agent`
(agent/config.py) find them from these same defaults, so both sides agree
without either importing the other.
"""

from __future__ import annotations

import os

DEFAULT_SOCKET = "/run/gpuvisor/node.sock"
SOCKET_ENV = "GPUVISOR_NODE_SOCKET"


def default_socket() -> str:
    return os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET


SUN_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1

# The file the agent keeps beside its socket, for the library to serialise
# context creations across the node with flock (native/shim/node_lock.c):
# containers that mount the socket's directory share it.
CONTEXT_LOCK_NAME = "context.lock"
NODE_LOCK_ENV = "GPUVISOR_NODE_LOCK"
# The library's default (native/shim/node_lock.c): in the directory HAMi's
# device plugin mounts from the host into every container it shares a GPU with.
HAMI_LOCK_DIR = "/tmp/vgpulock"


def context_lock_path(socket_path: str) -> str:
    return os.path.join(os.path.dirname(socket_path), CONTEXT_LOCK_NAME)
