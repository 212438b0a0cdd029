"""What the benchmarks' reports say about the machine they ran on."""

from __future__ import annotations

from pathlib import Path


def cpu_model(fallback: str) -> str:
    """The CPU's model name (/proc/cpuinfo), or fallback where there is none."""
    try:
        return next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        return fallback
