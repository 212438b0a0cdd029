"""`gpuvisor demo` (make demo): a node agent and three `gpuvisor run`
containers sharing a (simulated) node, shown live and summed up.

cli.py is the command and runs the demo; scenario.py names the three
containers; workload.py is the program each one runs; sampler.py watches
NVML and the agent; report.py draws the tables and the plot.

Imports: anything in gpuvisor.shim and gpuvisor.supervisor; nothing imports
the demo but the CLI group (../cli.py).
"""
