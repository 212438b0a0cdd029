"""The demo's three containers (scenario) and what each one asks for
(Workload): read by the demo's runner (cli.py) and its report (report.py)."""

from __future__ import annotations

from dataclasses import dataclass

from gpuvisor.shim.limits import parse_memory_limit


@dataclass(frozen=True)
class Workload:
    name: str
    gpu: int
    policy: str
    sm: int
    memory: str
    start: float  # seconds after the demo starts
    hold: str
    grow_to: str | None = None

    @property
    def memory_bytes(self) -> int:
        return int(parse_memory_limit(self.memory, 1 << 40))


def scenario(seconds: float, gpus: int) -> list[Workload]:
    """The three containers; with one GPU they all share GPU 0."""
    late = round(seconds / 3, 1)
    second = 1 if gpus > 1 else 0
    trainer_sm = 60 if gpus > 1 else 50
    return [
        Workload("notebook", 0, "burst-share", 20, "4g", 0.0, "1g", grow_to="6g"),
        Workload("trainer", 0, "fixed-share", trainer_sm, "8g", late, "6g"),
        Workload("batch", second, "fixed-share", 25, "2g", 0.0, "1g"),
    ]
