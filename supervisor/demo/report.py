"""How `gpuvisor demo` shows what it watched: the live table, the summary
(target against achieved) and the PNG plot (matplotlib, optional)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

from .sampler import Series

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .scenario import Workload

GiB = float(1 << 30)
SPARK = " ▁▂▃▄▅▆▇█"


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f} GiB"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} %"


def sparkline(values: list[float], width: int = 24) -> str:
    """The last `width` shares (0-100 %) as block characters."""
    tail = values[-width:]
    return "".join(SPARK[min(8, max(0, round(v / 100 * 8)))] for v in tail)


def live_table(workloads: list[Workload], series: dict[str, Series], t: float) -> Table:
    table = Table(title=f"gpuvisor demo  t = {t:4.1f} s   (SM share as NVML sees it)")
    for col in ("container", "GPU", "policy", "memory used / quota", "refused", "SM quota"):
        table.add_column(col)
    table.add_column("SM now", justify="right")
    table.add_column("SM over time")
    for w in workloads:
        s = series.get(w.name)
        last = s.last if s is not None else None
        if last is None:
            state = "starts at" if t < w.start else "starting"
            table.add_row(w.name, str(w.gpu), w.policy, f"{state} {w.start:.0f} s", "", f"{w.sm} %")
            continue
        recent = [p.sm for p in s.points[-2:] if p.sm is not None] if s else []
        now = sum(recent) / len(recent) if recent else last.sm_reported
        spark = sparkline([p.sm if p.sm is not None else 0.0 for p in s.points]) if s else ""
        refused = str(last.refusals)
        if last.refusals:
            refused = f"[bold red]{refused}[/]"
        table.add_row(
            w.name,
            str(w.gpu),
            w.policy,
            f"{_gib(last.memory_used)} / {_gib(last.memory_limit)}",
            refused,
            f"{w.sm} %",
            _pct(now),
            spark,
        )
    return table


@dataclass
class Verdict:
    name: str
    gpu: int
    policy: str
    phase: str
    window: tuple[float, float]
    target: str
    achieved: float | None
    ok: bool
    settled: float | None  # seconds from the phase's start until the share got there


def _reached(s: Series | None, since: float, lo: float, hi: float) -> float | None:
    """Seconds after `since` of the first NVML share within [lo, hi]."""
    for p in s.points if s is not None else []:
        if p.t >= since and p.sm is not None and lo <= p.sm <= hi:
            return round(p.t - since, 2)
    return None


def first_use(s: Series | None, since: float) -> float | None:
    """When NVML first saw the container use its GPU at or after `since` (its
    launch), None if it has not."""
    for p in s.points if s is not None else []:
        if p.t >= since and p.sm:
            return p.t
    return None


def first_use_or(s: Series | None, since: float) -> float:
    """first_use, or `since` when it never did: a container needs its share
    from its first use, not while its processes are still starting."""
    t = first_use(s, since)
    return since if t is None else t


def stops(
    workloads: list[Workload],
    series: dict[str, Series],
    began: Mapping[str, float],
    seconds: float,
) -> dict[str, float]:
    """When each container stopped: it computes for its share of the schedule
    (`seconds` less its start) from its first GPU use, after its process
    started (at `began`), made a context and took its memory, which took 8 s
    on a machine at load 19."""
    return {
        w.name: first_use_or(series.get(w.name), began.get(w.name, w.start)) + seconds - w.start
        for w in workloads
    }


def verdicts(
    workloads: list[Workload],
    series: dict[str, Series],
    end: float,
    stopped: Mapping[str, float] | None = None,
) -> list[Verdict]:
    """Target against achieved, per container and phase, each phase timed from
    the first GPU use of the container that opens it (1.5 s settling left out),
    until `end`, or the container's own stop in `stopped` (one started late on
    a loaded machine also ends late); a phase with neighbours ends when the
    first of them stops."""
    out: list[Verdict] = []
    starts = {w.name: first_use_or(series.get(w.name), w.start) for w in workloads}
    stop = {w.name: (stopped or {}).get(w.name, end) for w in workloads}
    for w in workloads:
        s = series.get(w.name)
        neighbours = [o for o in workloads if o.gpu == w.gpu and o is not w]
        phases: list[tuple[str, float, float, float]] = []  # name, since, t0, t1
        began = starts[w.name]
        if w.policy == "fixed-share" or not neighbours:
            # a cap holds whoever is beside it: measured over the whole run
            phases.append(("whole run", began, began + 1.5, stop[w.name] - 0.5))
        else:
            joined = min(starts[o.name] for o in neighbours)
            together = min(stop[o.name] for o in [w, *neighbours])
            if joined > began + 2.5:
                phases.append(("alone", began, began + 1.5, joined))
            phases.append(("with neighbour", joined, joined + 1.5, together - 0.5))
        room = 100.0 - sum(o.sm for o in neighbours)  # what the neighbours' quotas leave
        quota = float(w.sm)
        for phase, since, t0, t1 in phases:
            got = s.mean_sm(t0, t1) if s is not None else None
            if w.policy == "fixed-share":
                target, ok = f"{w.sm} % cap", got is not None and abs(got - quota) <= 2.0
                settled = _reached(s, since, quota - 5.0, quota + 5.0)
            elif phase == "alone":
                target, ok = f"> {w.sm} % (lent)", got is not None and got > quota + 2.0
                settled = _reached(s, since, quota + 5.0, 100.0)
            else:
                target = f"{w.sm}-{room:.0f} % (gives back)"
                ok = got is not None and quota - 2.0 <= got <= room + 2.0
                settled = _reached(s, since, 0.0, room + 5.0)
            out.append(Verdict(w.name, w.gpu, w.policy, phase, (t0, t1), target, got, ok, settled))
    return out


def summary_table(
    workloads: list[Workload], series: dict[str, Series], results: list[Verdict]
) -> Table:
    table = Table(title="gpuvisor demo: target against achieved")
    for col in ("container", "GPU", "policy", "phase", "SM target"):
        table.add_column(col)
    table.add_column("SM achieved (NVML)", justify="right")
    table.add_column("got there in", justify="right")
    table.add_column("memory peak / quota")
    table.add_column("refused", justify="right")
    table.add_column("holds")
    quotas = {w.name: w for w in workloads}
    for v in results:
        s = series.get(v.name)
        w = quotas[v.name]
        peak = s.peak_memory() if s is not None else 0
        mem_ok = peak <= w.memory_bytes
        table.add_row(
            v.name,
            str(v.gpu),
            v.policy,
            v.phase,
            v.target,
            _pct(v.achieved),
            "-" if v.settled is None else f"{v.settled:.1f} s",
            f"{peak / GiB:.2f} / {_gib(w.memory_bytes)}",
            str(s.refusals() if s is not None else 0),
            "[green]yes[/]" if v.ok and mem_ok else "[red]no[/]",
        )
    return table


def plot(
    workloads: list[Workload], series: dict[str, Series], path: Path, where: str
) -> Path | None:
    """Each container's SM share over time, one panel per GPU; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    gpus = sorted({w.gpu for w in workloads})
    fig, axes = plt.subplots(len(gpus) + 1, 1, figsize=(9, 3.2 * (len(gpus) + 1)), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, w in enumerate(workloads):
        colour = colours[k % len(colours)]
        s = series.get(w.name)
        pts = [p for p in s.points if p.sm is not None] if s is not None else []
        ax = axes[gpus.index(w.gpu)][0]
        ax.plot(
            [p.t for p in pts], [p.sm for p in pts], color=colour, label=f"{w.name} ({w.policy})"
        )
        ax.axhline(
            w.sm, color=colour, linestyle="--", linewidth=0.8, label=f"{w.name} quota {w.sm} %"
        )
        mem = axes[-1][0]
        all_pts = s.points if s is not None else []
        mem.plot(
            [p.t for p in all_pts],
            [p.memory_used / GiB for p in all_pts],
            color=colour,
            label=w.name,
        )
        mem.axhline(w.memory_bytes / GiB, color=colour, linestyle="--", linewidth=0.8)
        refused = [b for a, b in itertools.pairwise(all_pts) if b.refusals > a.refusals]
        if refused:
            mem.scatter(
                [p.t for p in refused],
                [p.memory_used / GiB for p in refused],
                marker="x",
                color="red",
                zorder=3,
                label=f"{w.name}: allocation refused",
            )
    for gi, gpu in enumerate(gpus):
        ax = axes[gi][0]
        ax.set_title(f"GPU {gpu}: SM share per container (NVML per-process utilisation)")
        ax.set_ylabel("% of GPU time")
        ax.set_ylim(0, 105)
        ax.legend(loc="upper right", fontsize="small")
    mem = axes[-1][0]
    mem.set_title("device memory used (dashed: quota; x: CUDA_ERROR_OUT_OF_MEMORY)")
    mem.set_ylabel("GiB")
    mem.set_xlabel("seconds")
    mem.legend(loc="upper right", fontsize="small")
    fig.suptitle(f"gpuvisor demo on {where}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
