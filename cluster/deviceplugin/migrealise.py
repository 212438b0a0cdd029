"""Realising a container's MIG plan on this node, and undoing it.

The allocator plans (cluster/mig.py): a profile at a placement on a GPU,
either an existing idle instance to reuse or one to create, possibly with
MIG mode to turn on and idle instances to destroy first, these two only on
a GPU with nothing running.  The plan was made from the inventory the
extender saw; the node may have moved on since, so every step is checked
against NVML again here:

- MIG mode is turned on only when the plan says so and no process runs on
  the GPU;
- an instance is destroyed only when the plan names it, no process uses
  it, no other container of this plugin holds it, and nothing runs on the
  GPU;
- a reused instance must exist, be idle, held by no other container, and
  sit at the planned placement;
- a container's instances are made all or nothing: when one step fails,
  the instances made for it so far are destroyed again before the error
  goes back to kubelet (the driver destroys a GPU instance whose compute
  instance could not be made).

`release` destroys the instances the plugin created for a container that is
gone, except one a process still uses (kept, tried again later) and one
another pod's plan reuses (handed over: destroyed when that pod is gone).
The plugin's own instances are remembered in a file (`mine`), so an
instance made by someone else is never destroyed as the plugin's, and
neither is forgotten across restarts.

`settle` turns MIG mode off again on a GPU whose mode is the plugin's (it
turned it on, or an operator handed it over), once it has been idle in MIG
mode for `off_after` seconds: no instance, no process, no bound pod's MIG
grant on it.  Those GPUs are remembered in a file (`modes`) too; a plan
made while such a GPU was in MIG mode finds it turned on again."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .grant import GpuGrant
from .migdriver import MigDriver, MigDriverError

log = logging.getLogger("gpuvisor.device-plugin")

MIG_MINE = ".mig-instances.json"  # in the state directory: the instances the plugin made
MIG_MODE = ".mig-mode.json"  # in the state directory: the GPUs whose MIG mode is the plugin's
MIG_OFF_AFTER = 60.0  # seconds a GPU of the plugin's waits idle in MIG mode before it goes off


class MigRefused(Exception):
    """A MIG plan cannot be realised; the message says why in one line."""


@dataclass(frozen=True)
class Made:
    """A MIG instance a container holds."""

    gpu: str  # the GPU's UUID
    gi_id: int
    uuid: str  # the MIG device's UUID
    profile_id: int
    start: int
    size: int
    created: bool  # made by this plugin (destroyed when the container is gone)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(v: Any) -> Made:
        if not isinstance(v, dict):
            raise ValueError(f"expected an object, got {v!r}")
        return Made(
            gpu=str(v["gpu"]),
            gi_id=int(v["gi_id"]),
            uuid=str(v["uuid"]),
            profile_id=int(v["profile_id"]),
            start=int(v["start"]),
            size=int(v["size"]),
            created=bool(v["created"]),
        )


class MigRealiser:
    """Makes and removes MIG instances through a MigDriver, one change at a
    time on the node; calls on_change after any change (the plugin then
    republishes the node's inventory)."""

    def __init__(
        self,
        driver: MigDriver,
        on_change: Callable[[], object] | None = None,
        mine: Path | None = None,
        mode: Path | None = None,
        off_after: float | None = MIG_OFF_AFTER,
        manage: Collection[str] = (),
    ) -> None:
        """mine: where the instances made are remembered; mode: where the
        GPUs whose MIG mode is the plugin's are (those it turned on, and
        manage: those an operator hands it); off_after: seconds such a GPU
        stays in MIG mode with nothing on it and nothing planned before
        settle turns MIG mode off (None: never)."""
        self.driver = driver
        self.on_change = on_change
        self.mine_file = mine
        self.mode_file = mode
        self.off_after = off_after
        self._lock = threading.Lock()
        self._mine = _read_set(mine, "no instance is taken as this plugin's")
        self._modes = _read_set(mode, "no GPU's MIG mode is taken as this plugin's")
        self._idle_since: dict[str, float] = {}
        # MIG mode could not be read or turned off: logged once, not tried
        # again until the plugin turns it on
        self._stuck: set[str] = set()
        if set(manage) - self._modes:
            self._modes |= set(manage)
            self._save_modes()

    def modes(self) -> set[str]:
        """The GPUs whose MIG mode this plugin turns on and off."""
        with self._lock:
            return set(self._modes)

    def _save_modes(self) -> None:
        if self.mode_file is not None:
            _write_set(self.mode_file, self._modes)

    def mine(self) -> set[str]:
        """The MIG UUIDs of the instances this plugin made that still exist (as it knows)."""
        with self._lock:
            return set(self._mine)

    def _remember(self, add: str | None = None, drop: str | None = None) -> None:
        if add is not None:
            self._mine.add(add)
        if drop is not None:
            self._mine.discard(drop)
        if self.mine_file is not None:
            _write_set(self.mine_file, self._mine)

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception as exc:  # the API server away: the next poll publishes
                log.warning("after a MIG change: %s", exc)

    def realise(self, who: str, grants: Sequence[GpuGrant], held: Collection[str]) -> list[Made]:
        """The MIG instances of grants (those with a MIG plan), made or
        reused; held: the MIG UUIDs other containers hold.  MigRefused,
        with nothing this call made left behind, when one cannot be had."""
        made: list[Made] = []
        fresh: list[Made] = []  # created by this call
        changed = False
        with self._lock:
            try:
                for g in grants:
                    if g.mig is not None:
                        got, new, did = self._one(g, held)
                        made.append(got)
                        if new:
                            fresh.append(got)
                        changed = changed or did
            except (MigRefused, MigDriverError) as exc:
                for m in reversed(fresh):
                    try:
                        self.driver.destroy(m.gpu, m.gi_id)
                        self._remember(drop=m.uuid)
                        changed = True
                    except MigDriverError as undo:
                        log.error("%s: cannot undo MIG instance %s: %s", who, m.uuid, undo)
                raise MigRefused(f"{who}: {exc}") from None
            finally:
                if changed:
                    self._changed()
        for m in made:
            verb = "created" if m in fresh else "reuses"
            log.info(
                "%s: %s MIG instance %s on GPU %s (%d+%d)",
                *(who, verb, m.uuid, m.gpu, m.start, m.size),
            )
        return made

    def _one(self, g: GpuGrant, held: Collection[str]) -> tuple[Made, bool, bool]:
        """The instance of one grant: (it, made now, anything changed)."""
        plan = g.mig
        assert plan is not None
        d = self.driver
        gpu = g.uuid
        changed = False
        self._idle_since.pop(gpu, None)  # a wait for MIG mode off starts over
        if not d.enabled(gpu):
            if not plan.enable and gpu not in self._modes:
                raise MigRefused(f"GPU {gpu}: MIG mode is off and the plan does not turn it on")
            if d.busy(gpu):
                raise MigRefused(f"GPU {gpu}: work is running on it: MIG mode not turned on")
            if not plan.enable:
                # a plan made before this plugin turned the idle GPU's MIG
                # mode off, counting on it being on: on again
                log.info("GPU %s: MIG mode on again for a plan made while it was on", gpu)
            d.enable(gpu)
            self._stuck.discard(gpu)
            if gpu not in self._modes:
                self._modes.add(gpu)
                self._save_modes()
            changed = True
        if plan.destroy:
            present = {i.uuid: i for i in d.instances(gpu) if i.uuid is not None}
            for u in plan.destroy:
                inst = present.get(u)
                if inst is None:
                    continue  # gone already
                if inst.in_use or u in held:
                    raise MigRefused(f"GPU {gpu}: MIG instance {u} is in use: not destroyed")
                if d.busy(gpu):
                    raise MigRefused(
                        f"GPU {gpu}: work is running on it: its idle MIG instance {u} is not "
                        "destroyed (only an idle GPU is reconfigured)"
                    )
                d.destroy(gpu, inst.gi_id)
                self._remember(drop=u)
                changed = True
        start, size = plan.placement.start, plan.placement.size
        if plan.instance is not None:
            for inst in d.instances(gpu):
                if inst.uuid != plan.instance:
                    continue
                if inst.in_use or inst.uuid in held:
                    raise MigRefused(f"GPU {gpu}: MIG instance {inst.uuid} is in use")
                if (inst.start, inst.size, inst.profile_id) != (start, size, plan.profile_id):
                    raise MigRefused(
                        f"GPU {gpu}: MIG instance {inst.uuid} is profile {inst.profile_id} at "
                        f"{inst.start}+{inst.size}, not the planned {plan.profile} "
                        f"at {start}+{size}"
                    )
                ours = plan.instance in self._mine
                kept = Made(gpu, inst.gi_id, plan.instance, inst.profile_id, start, size, ours)
                return kept, False, changed
            raise MigRefused(f"GPU {gpu}: MIG instance {plan.instance} is gone")
        mask = ((1 << size) - 1) << start
        for inst in d.instances(gpu):
            if (((1 << inst.size) - 1) << inst.start) & mask:
                raise MigRefused(
                    f"GPU {gpu}: the planned {plan.profile} at {start}+{size} overlaps MIG "
                    f"instance {inst.uuid or inst.gi_id} at {inst.start}+{inst.size}"
                )
        inst = d.create(gpu, plan.profile_id, start, size)
        assert inst.uuid is not None  # create returns an instance with its MIG device
        self._remember(add=inst.uuid)
        return Made(gpu, inst.gi_id, inst.uuid, plan.profile_id, start, size, True), True, True

    def release(self, who: str, made: Sequence[Made], reused: Collection[str]) -> list[Made]:
        """Destroy the instances this plugin made that a container that is
        gone held; returns those still held: in use (tried again later).
        An instance in reused (a bound pod's plan names it) is left for that
        pod, and one the plugin did not make is left as it is."""
        left: list[Made] = []
        changed = False
        with self._lock:
            for m in made:
                if m.uuid not in self._mine or m.uuid in reused:
                    continue
                try:
                    now = {i.gi_id: i for i in self.driver.instances(m.gpu)}
                    inst = now.get(m.gi_id)
                    if inst is None or inst.uuid != m.uuid:
                        self._remember(drop=m.uuid)
                        continue  # gone already
                    if inst.in_use:
                        log.info("%s: MIG instance %s still in use: kept for now", who, m.uuid)
                        left.append(m)
                        continue
                    self.driver.destroy(m.gpu, m.gi_id)
                    self._remember(drop=m.uuid)
                    changed = True
                    log.info("%s is gone: destroyed MIG instance %s on GPU %s", who, m.uuid, m.gpu)
                except MigDriverError as exc:
                    log.warning("%s: cannot destroy MIG instance %s: %s", who, m.uuid, exc)
                    left.append(m)
            if changed:
                self._changed()
        return left

    def idle(self) -> list[str]:
        """The GPUs of this plugin's in MIG mode with no instance and no
        process (those settle may turn off); the others' waits start over."""
        if self.off_after is None:
            return []
        out = []
        with self._lock:
            for gpu in sorted(self._modes - self._stuck):
                try:
                    if self._idle(gpu):
                        out.append(gpu)
                        continue
                except MigDriverError as exc:
                    log.warning("GPU %s: MIG mode left as it is: %s", gpu, exc)
                    self._stuck.add(gpu)
                self._idle_since.pop(gpu, None)
        return out

    def _idle(self, gpu: str) -> bool:
        d = self.driver
        return d.enabled(gpu) and not d.instances(gpu) and not d.busy(gpu)

    def settle(self, planned: Collection[str], now: float) -> list[str]:
        """Turn MIG mode off on the GPUs of this plugin's (modes) that have
        been idle in MIG mode for off_after seconds: no MIG instance on
        them, no process, and none in planned (the GPUs a bound pod's plan
        has a MIG grant on).  now: a monotonic clock.  Returns the GPUs
        turned off; the inventory is republished after."""
        if self.off_after is None:
            return []
        off: list[str] = []
        with self._lock:
            for gpu in sorted(self._modes):
                try:
                    idle = gpu not in planned and gpu not in self._stuck and self._idle(gpu)
                    if not idle:
                        self._idle_since.pop(gpu, None)
                        continue
                    since = self._idle_since.setdefault(gpu, now)
                    if now - since < self.off_after:
                        continue
                    self.driver.disable(gpu)
                except MigDriverError as exc:
                    log.warning("GPU %s: MIG mode left on: %s", gpu, exc)
                    self._stuck.add(gpu)
                    continue
                self._idle_since.pop(gpu, None)
                off.append(gpu)
                log.info(
                    "GPU %s: MIG mode turned off (no instance, nothing running, nothing "
                    "planned for %.0f s)",
                    gpu,
                    now - since,
                )
            if off:
                self._changed()
        return off


def _read_set(path: Path | None, otherwise: str) -> set[str]:
    """A JSON list of strings in path; empty if there is none."""
    if path is None:
        return set()
    try:
        v = json.loads(path.read_text())
        return {u for u in v if isinstance(u, str)}
    except FileNotFoundError:
        return set()
    except (OSError, ValueError, TypeError) as exc:
        log.error("%s: unreadable (%s): %s", path, exc, otherwise)
        return set()


def _write_set(path: Path, items: set[str]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(sorted(items)))
    os.replace(tmp, path)
