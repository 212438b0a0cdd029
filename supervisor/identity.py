"""Who is speaking on the node socket: peer credentials and container cgroup.

The node agent never trusts what a report says about itself: it asks the
kernel for the peer's pid and uid (SO_PEERCRED) and reads that pid's cgroup
from /proc.  Supervisors use container_cgroup() to fill in
ContainerId.cgroup, so both sides apply the same rule (docs/protocol.md,
"Identity"):

- pure cgroup v2 (only a "0::/path" line), or a v2 line whose path is not
  "/": that path;
- otherwise (cgroup v1 or hybrid with the process at the v2 root): the path
  of the v1 "memory" hierarchy, else the one holding "cpu";
- otherwise "/".
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

_UCRED = struct.Struct("3i")


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_cred(sock: socket.socket) -> PeerCred:
    """The pid, uid and gid of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return PeerCred(pid=pid, uid=uid, gid=gid)


def parse_cgroup(text: str) -> str:
    """The container's cgroup path from the text of /proc/<pid>/cgroup."""
    return _parse(text)[0]


def accepted_cgroups(text: str) -> frozenset[str]:
    """Every claim the agent accepts for a peer with this /proc/<pid>/cgroup.

    The canonical path (parse_cgroup) and, for supervisors that read the
    file differently on hybrid hosts, the v2 path and the v1 memory and cpu
    paths: each is a fact about the peer, none can name another container.
    """
    return _parse(text)[1]


def _parse(text: str) -> tuple[str, frozenset[str]]:
    v2: str | None = None
    v1: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if hier == "0" and controllers == "":
            v2 = path
        else:
            for ctrl in controllers.split(","):
                v1[ctrl] = path
    alts = {p for p in (v2, v1.get("memory"), v1.get("cpu")) if p is not None}
    if v2 is not None and (v2 != "/" or not v1):
        return v2, frozenset(alts)
    for ctrl in ("memory", "cpu"):
        if ctrl in v1:
            return v1[ctrl], frozenset(alts)
    canonical = v2 or "/"
    return canonical, frozenset(alts | {canonical})


def container_cgroup(pid: int | str = "self") -> str:
    """The cgroup path of pid (default: this process), by the rule above.

    Raises OSError when /proc/<pid>/cgroup cannot be read (the process is gone).
    """
    with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
        return parse_cgroup(f.read())


def peer_cgroups(pid: int) -> frozenset[str]:
    """accepted_cgroups() of a live pid; OSError when it is gone."""
    with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
        return accepted_cgroups(f.read())


# Where the agent looks for a cgroup's directory: the v2 (or hybrid)
# mount, and the v1 hierarchies identity's rule reads a path from.
CGROUP_ROOTS = (
    "/sys/fs/cgroup",
    "/sys/fs/cgroup/unified",
    "/sys/fs/cgroup/memory",
    "/sys/fs/cgroup/cpu,cpuacct",
    "/sys/fs/cgroup/cpu",
)


def cgroup_exists(path: str) -> bool:
    """Does the cgroup at path (as peer_cgroups reads it) still exist on the
    node: its directory under one of CGROUP_ROOTS.  A pod's cgroup exists
    for the pod's whole life, its containers' restarts included."""
    rel = path.strip("/")
    if not rel:
        return True
    return any(os.path.isdir(os.path.join(root, rel)) for root in CGROUP_ROOTS)


def claim_matches(claimed: str, accepted: frozenset[str]) -> str | None:
    """The accepted path a supervisor's claimed cgroup stands for, or None.

    A process in its own cgroup namespace (the default for containers on
    cgroup v2 nodes) sees its cgroup relative to the namespace's root: "/"
    for the root itself, "/sub" below it.  The agent, in the host's (or its
    own) namespace, reads the same cgroup as a longer path.  So a claim
    matches an accepted path when it equals it or is a whole-component
    suffix of it ("/" is a suffix of every path).  The agent keys the
    container by the path it read itself, never by the claim, so a suffix
    cannot name another container.  Several matches: the longest path.
    """
    parts = [p for p in claimed.split("/") if p]
    if not claimed.startswith("/") or ".." in parts:
        return None
    best: str | None = None
    for path in accepted:
        comps = [p for p in path.split("/") if p]
        if (not parts or comps[len(comps) - len(parts) :] == parts) and (
            best is None or len(path) > len(best)
        ):
            best = path
    return best


def is_admin(cred: PeerCred) -> bool:
    """May this peer push limit changes? root, or the agent's own uid."""
    return cred.uid == 0 or cred.uid == os.geteuid()
