"""Defaults of `gpuvisor scheduler` (shared by the CLI and the docs' tests)."""

PORT = 8888  # the extender's HTTP API
METRICS_PORT = 31993  # HAMi's scheduler metrics port
