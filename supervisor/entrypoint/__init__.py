"""`gpuvisor run`: the container's entrypoint and PID 1.

run.py is the command; config.py checks its options and the environment
into a RunConfig; pid1.py runs the workload as PID 1 (signals, orphans);
tuner.py applies the node agent's instructions to the region; reporter.py
reports the container's usage to the node agent (../protocol.py).

Imports: gpuvisor.shim and the shared modules beside this package
(protocol, identity, paths, cli_types); never the agent or the demo.
"""
