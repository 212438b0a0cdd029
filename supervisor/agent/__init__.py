"""`gpuvisor node-agent`: one per node, with the host's PID view.

cli.py is the command and its `set-limit` subcommand (an admin client); server.py
accepts the supervisors' and administrators' connections (connection.py)
and serves HTTP (http.py); state.py is what the agent knows (records.py,
shares.py), persist.py keeps the administrators' limits across a restart,
metrics.py renders Prometheus metrics, config.py holds AgentConfig.

Imports: gpuvisor.shim, the shared modules beside this package, and
entrypoint.config alone of the entrypoint (a limit is checked by the same
parser as `gpuvisor run`'s); never the demo.
"""
