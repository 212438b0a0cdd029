"""gpuvisor.supervisor: the programs that run on a node, one subpackage each.

- entrypoint/: `gpuvisor run`, the container's entrypoint and PID 1;
- agent/: `gpuvisor node-agent`, one per node;
- demo/: `gpuvisor demo`.

Beside them, what they share: protocol.py (the socket protocol between the
supervisor and the agent), identity.py (peer credentials and cgroups),
paths.py (where the node's socket and lock lie), cli_types.py (click
parameter types), views.py (`gpuvisor status` and `top`) and cli.py, the
CLI group that assembles every `gpuvisor` command.  The shared modules
import nothing from the subpackages; docs/architecture.md has the map.
"""
