"""The node usage socket protocol, version 1 (documented in docs/protocol.md).

Newline-delimited JSON over a Unix stream socket.  The supervisor of each
container sends `report` messages; the node agent answers each with an `ack`
(which may carry instructions: yield flags and limit changes) or an
`error`.  Every message is one JSON object on one line of at most
MAX_MESSAGE_BYTES bytes, with "v" (the protocol version) and "type".
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, TypeGuard

from gpuvisor.shim.region import SM_POLICIES

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024
MAX_DEVICES = 16
MAX_PIDS = 1024
# A report's `visible` lists at most this many devices (the library maps at
# most GV_MAX_ORDINALS CUDA ordinals).
MAX_VISIBLE = 64
MAX_INTERVAL_S = 3600.0  # the longest report interval a report may declare
MAX_ERROR_CHARS = 1024  # an error's text is cut to this (a field's value may be long)
POLICIES = SM_POLICIES  # the names the library gives its policies 0, 1, 2
# A device UUID as NVML and the library write it (nvmlDeviceGetUUID,
# gv_uuid_format): "GPU-" and 32 lowercase hex digits in groups 8-4-4-4-12.
# Only this form is taken, so one device has one spelling (one set of
# metric series) and a report cannot make up label values.
UUID_FORM = "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
_UUID_RE = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class ProtocolError(ValueError):
    """A message that breaks the protocol; the text names the field."""


@dataclass(frozen=True)
class ContainerId:
    cgroup: str  # the container's cgroup path, as /proc/<pid>/cgroup shows it
    pod: str | None = None
    namespace: str | None = None
    container: str | None = None

    @property
    def labels(self) -> tuple[str, str, str]:
        """(namespace, pod, container) as /metrics labels the container: a
        container that gives neither pod nor namespace nor container name
        (or only empty ones) is named by its cgroup.  No two containers of
        different cgroups may hold the same (docs/protocol.md, Identity)."""
        ns, pod = self.namespace or "", self.pod or ""
        return (ns, pod, self.container or ("" if ns or pod else self.cgroup))

    @property
    def named_by_cgroup(self) -> bool:
        """Does the container give no pod, namespace or container name (so
        its labels name it by its cgroup)?"""
        return not (self.pod or self.namespace or self.container)

    @property
    def key(self) -> str:
        """Stable key of the container on the node."""
        return "|".join([self.cgroup, self.namespace or "", self.pod or "", self.container or ""])


@dataclass(frozen=True)
class DeviceReport:
    uuid: str
    index: int
    memory_used: int
    memory_limit: int | None  # None: no limit
    memory_physical: int
    oom_refusals: int
    sm_share: float  # achieved percent of the GPU's time since the last report
    sm_limit: int | None  # percent; None: no limit
    sm_enforced: float  # percent the launch gate enforces now
    throttled: bool  # launches waited at the gate since the last report
    # Of memory_used, the bytes served from host memory under
    # CUDA_OVERSUBSCRIBE (optional: a supervisor that predates it sends none).
    memory_spilled: int = 0


@dataclass(frozen=True)
class Report:
    seq: int
    ts: float
    container: ContainerId
    policy: str
    priority: int
    pids: list[int] = field(default_factory=list)
    devices: list[DeviceReport] = field(default_factory=list)
    final: bool = False
    # Seconds between the sender's reports (optional; None: not declared).
    # The agent keeps the container at least 3 intervals from the first report.
    interval: float | None = None
    # Device UUIDs the container can see (its CUDA_VISIBLE_DEVICES through
    # NVML's list, by the library's map), used or not; None: not known (or
    # a supervisor that predates the field).  The agent keeps an
    # administrator's limits on them for the container's life.
    visible: list[str] | None = None


@dataclass(frozen=True)
class Instructions:
    """What the agent asks a container to change (in an ack)."""

    yield_devices: dict[str, bool] = field(default_factory=dict)  # uuid -> pause launches
    memory_limits: dict[str, int | None] = field(default_factory=dict)  # uuid -> bytes
    sm_limits: dict[str, int | None] = field(default_factory=dict)  # uuid -> percent
    # uuid -> percent of the device the OTHER containers used recently (the
    # node-wide view that burst-share and best-effort lend from)
    others_share: dict[str, float] = field(default_factory=dict)
    # uuid -> the kinds ("memory", "sm") an administrator cleared there
    # (set-limit "env"): the container's own limit of that kind is put back
    restore: dict[str, tuple[str, ...]] = field(default_factory=dict)


# What `restore` names, and set-limit's value that asks for it.
LIMIT_KINDS = ("memory", "sm")
OWN_LIMIT = "env"


def _spilled(d: dict[str, Any], w: str) -> int:
    """devices[i].memory_spilled: optional, at most memory_used."""
    spilled = _int(d.get("memory_spilled", 0), w + "memory_spilled")
    used = d.get("memory_used")
    if isinstance(used, int) and spilled > used:
        raise ProtocolError(f"{w}memory_spilled={spilled}: more than memory_used={used}")
    return spilled


def encode(obj: dict[str, Any]) -> bytes:
    line = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode() + b"\n"
    if len(line) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(line)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return line


def report_message(report: Report) -> dict[str, Any]:
    body = asdict(report)
    if body["interval"] is None:
        del body["interval"]  # optional: not declared
    if body["visible"] is None:
        del body["visible"]  # optional: not known
    body.update(v=PROTOCOL_VERSION, type="report")
    return body


def ack_message(seq: int, instructions: Instructions | None = None) -> dict[str, Any]:
    msg: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": "ack", "seq": seq}
    if instructions is not None:
        msg["yield"] = dict(instructions.yield_devices)
        # Only the limits being changed: a missing "memory" or "sm" key means
        # "leave it", while null means "no limit" (parse_ack reads it so).
        limits: dict[str, dict[str, int | None]] = {}
        for uuid, mem in instructions.memory_limits.items():
            limits.setdefault(uuid, {})["memory"] = mem
        for uuid, sm in instructions.sm_limits.items():
            limits.setdefault(uuid, {})["sm"] = sm
        msg["limits"] = limits
        if instructions.restore:
            msg["restore"] = {u: list(kinds) for u, kinds in instructions.restore.items()}
        if instructions.others_share:
            msg["others"] = {u: round(v, 2) for u, v in instructions.others_share.items()}
    return msg


def error_message(seq: int | None, error: str) -> dict[str, Any]:
    if len(error) > MAX_ERROR_CHARS:
        error = error[: MAX_ERROR_CHARS - 3] + "..."
    return {"v": PROTOCOL_VERSION, "type": "error", "seq": seq, "error": error}


# ---- validation --------------------------------------------------------------


def _get(obj: dict[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise ProtocolError(f"{where}{key}: missing")
    return obj[key]


def is_int(value: Any) -> TypeGuard[int]:
    """A real JSON integer: not true/false, not a float."""
    return isinstance(value, int) and not isinstance(value, bool)


def _int(value: Any, name: str, lo: int = 0, hi: int = 2**64 - 1) -> int:
    if not is_int(value) or not lo <= value <= hi:
        raise ProtocolError(f"{name}={value!r}: expected an integer in [{lo}, {hi}]")
    return int(value)


def _opt_int(value: Any, name: str, lo: int = 0, hi: int = 2**64 - 1) -> int | None:
    return None if value is None else _int(value, name, lo, hi)


def _num(value: Any, name: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"{name}={value!r}: expected a number")
    try:
        v = float(value)
    except OverflowError:  # an integer beyond any float
        v = math.inf
    if not math.isfinite(v) or not lo <= v <= hi:
        raise ProtocolError(f"{name}={value!r}: expected a number in [{lo}, {hi}]")
    return v


def _str(value: Any, name: str, maxlen: int = 1024, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > maxlen:
        raise ProtocolError(f"{name}={value!r}: expected a string of at most {maxlen} characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        # JSON's \ud800 escapes decode to lone surrogates, which no text
        # output can carry: one in a label emptied /metrics for every
        # container of the node while its sender reported.
        raise ProtocolError(f"{name}={value!r}: not valid Unicode (a lone surrogate)") from None
    return value


def _name(value: Any, name: str) -> str | None:
    """A pod, namespace or container name: at most 253 printable characters.
    Control characters, line and paragraph separators and bidi overrides
    (no Kubernetes name holds one) would reach /metrics as label values,
    which line-based tools split or a terminal obeys."""
    text = _str(value, name, 253, optional=True)
    if text is not None and not text.isprintable():
        raise ProtocolError(f"{name}={text!r}: holds characters that are not printable")
    return text


def is_uuid(value: Any) -> bool:
    """Is value a device UUID in NVML's form (UUID_FORM, lowercase hex)?"""
    return isinstance(value, str) and _UUID_RE.fullmatch(value) is not None


def check_uuid(value: Any, name: str) -> str:
    if not is_uuid(value):
        raise ProtocolError(
            f"{name}={value!r}: expected a device UUID, {UUID_FORM} (lowercase hex)"
        )
    return str(value)


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError(f"{name}={value!r}: expected true or false")
    return value


_BOM = b"\xef\xbb\xbf"


def _no_constant(name: str) -> Any:
    """json.loads's hook for NaN, Infinity and -Infinity, which JSON lacks."""
    raise ProtocolError(f"not JSON: {name} is not a JSON value")


def decode(line: bytes) -> dict[str, Any]:
    """Parse one line; checks size, JSON, object-ness, version and type."""
    if len(line) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(line)} bytes exceeds {MAX_MESSAGE_BYTES}")
    if line.startswith(_BOM):
        # json.loads would take the bytes as UTF-8-SIG; a report is plain UTF-8.
        raise ProtocolError("not JSON: a UTF-8 byte-order mark before the message")
    try:
        obj = json.loads(line, parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"not JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError("not JSON: nested too deeply") from None
    except ValueError:  # an integer of more digits than int() converts
        raise ProtocolError("not JSON: a number with too many digits") from None
    if not isinstance(obj, dict):
        raise ProtocolError("message: expected a JSON object")
    version = _get(obj, "v", "")
    if not is_int(version) or version != PROTOCOL_VERSION:
        raise ProtocolError(f"v={version!r}: this agent speaks version {PROTOCOL_VERSION}")
    _str(_get(obj, "type", ""), "type", 32)
    return obj


def parse_report(obj: dict[str, Any]) -> Report:
    """Validate a decoded `report` message; ProtocolError names the bad field."""
    if obj.get("type") != "report":
        raise ProtocolError(f"type={obj.get('type')!r}: expected 'report'")
    c = _get(obj, "container", "")
    if not isinstance(c, dict):
        raise ProtocolError(f"container={c!r}: expected an object")
    container = ContainerId(
        cgroup=str(_str(_get(c, "cgroup", "container."), "container.cgroup", 4096)),
        pod=_name(c.get("pod"), "container.pod"),
        namespace=_name(c.get("namespace"), "container.namespace"),
        container=_name(c.get("container"), "container.container"),
    )
    policy = _str(_get(obj, "policy", ""), "policy", 32)
    if policy is None or policy not in POLICIES:
        raise ProtocolError(f"policy={policy!r}: expected one of {', '.join(POLICIES)}")
    pids = _get(obj, "pids", "")
    if not isinstance(pids, list) or len(pids) > MAX_PIDS:
        raise ProtocolError(f"pids: expected a list of at most {MAX_PIDS} PIDs")
    devices_raw = _get(obj, "devices", "")
    if not isinstance(devices_raw, list) or len(devices_raw) > MAX_DEVICES:
        raise ProtocolError(f"devices: expected a list of at most {MAX_DEVICES} devices")
    devices = []
    for i, d in enumerate(devices_raw):
        w = f"devices[{i}]."
        if not isinstance(d, dict):
            raise ProtocolError(f"devices[{i}]: expected an object")
        devices.append(
            DeviceReport(
                uuid=check_uuid(_get(d, "uuid", w), w + "uuid"),
                index=_int(_get(d, "index", w), w + "index", 0, 1023),
                memory_used=_int(_get(d, "memory_used", w), w + "memory_used"),
                memory_limit=_opt_int(_get(d, "memory_limit", w), w + "memory_limit"),
                memory_physical=_int(_get(d, "memory_physical", w), w + "memory_physical"),
                oom_refusals=_int(_get(d, "oom_refusals", w), w + "oom_refusals"),
                sm_share=_num(_get(d, "sm_share", w), w + "sm_share", 0.0, 100.0),
                sm_limit=_opt_int(_get(d, "sm_limit", w), w + "sm_limit", 1, 100),
                sm_enforced=_num(_get(d, "sm_enforced", w), w + "sm_enforced", 0.0, 100.0),
                throttled=_bool(_get(d, "throttled", w), w + "throttled"),
                memory_spilled=_spilled(d, w),
            )
        )
    _no_duplicate_uuids(devices)
    return Report(
        seq=_int(_get(obj, "seq", ""), "seq"),
        ts=_num(_get(obj, "ts", ""), "ts", 0.0, 1e12),
        container=container,
        policy=policy,
        priority=_int(_get(obj, "priority", ""), "priority", 0, 1),
        pids=[_int(p, f"pids[{i}]", 1, 2**31 - 1) for i, p in enumerate(pids)],
        devices=devices,
        final=_bool(obj.get("final", False), "final"),
        interval=_opt_interval(obj.get("interval")),
        visible=_opt_visible(obj.get("visible")),
    )


def _no_duplicate_uuids(devices: list[DeviceReport]) -> None:
    first: dict[str, int] = {}
    for i, d in enumerate(devices):
        j = first.setdefault(d.uuid, i)
        if j != i:
            raise ProtocolError(f"devices[{i}].uuid={d.uuid!r}: the same device as devices[{j}]")


def _opt_interval(value: Any) -> float | None:
    """The optional `interval` of a report: seconds, 0 or null: not declared."""
    if value is None:
        return None
    v = _num(value, "interval", 0.0, MAX_INTERVAL_S)
    return v if v > 0 else None


def _opt_visible(value: Any) -> list[str] | None:
    """The optional `visible` of a report: device UUIDs, each at most once,
    at most MAX_VISIBLE; null or missing: not known."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > MAX_VISIBLE:
        raise ProtocolError(f"visible: expected a list of at most {MAX_VISIBLE} device UUIDs")
    first: dict[str, int] = {}
    for i, uuid in enumerate(value):
        check_uuid(uuid, f"visible[{i}]")
        j = first.setdefault(uuid, i)
        if j != i:
            raise ProtocolError(f"visible[{i}]={uuid!r}: the same device as visible[{j}]")
    return [str(u) for u in value]


def _opt_limit(value: Any, name: str, lo: int, hi: int) -> int | None:
    """A pushed limit: an integer in [lo, hi], or null for "no limit"."""
    if value is not None and (not is_int(value) or not lo <= value <= hi):
        raise ProtocolError(
            f"{name}={value!r}: expected an integer in [{lo}, {hi}] or null (no limit)"
        )
    return None if value is None else int(value)


def parse_ack(obj: dict[str, Any]) -> Instructions:
    """Validate an `ack` (supervisor side)."""
    if obj.get("type") != "ack":
        raise ProtocolError(f"type={obj.get('type')!r}: expected 'ack'")
    y = obj.get("yield", {})
    limits = obj.get("limits", {})
    if not isinstance(y, dict) or not isinstance(limits, dict):
        raise ProtocolError("yield/limits: expected objects")
    mem: dict[str, int | None] = {}
    sm: dict[str, int | None] = {}
    for uuid, lim in limits.items():
        if not isinstance(lim, dict):
            raise ProtocolError(f"limits.{uuid}: expected an object")
        # "No limit" is null alone: 0 is what CUDA_DEVICE_SM_LIMIT and the
        # region use for it, but in an ack it would be a second spelling
        # that set-limit never sends (it takes 1-100 or null, as reports'
        # sm_limit): an agent sending it is broken, and its ack is refused.
        if "memory" in lim:
            mem[uuid] = _opt_limit(lim["memory"], f"limits.{uuid}.memory", 1, 2**64 - 1)
        if "sm" in lim:
            sm[uuid] = _opt_limit(lim["sm"], f"limits.{uuid}.sm", 1, 100)
    others = obj.get("others", {})
    if not isinstance(others, dict):
        raise ProtocolError("others: expected an object")
    restore = _restore(obj.get("restore", {}))
    for uuid, kinds in restore.items():
        for kind in kinds:
            if uuid in (mem if kind == "memory" else sm):
                raise ProtocolError(f"restore.{uuid}={list(kinds)!r}: {kind} is in limits too")
    return Instructions(
        yield_devices={str(k): _bool(v, f"yield.{k}") for k, v in y.items()},
        memory_limits=mem,
        sm_limits=sm,
        others_share={str(k): _num(v, f"others.{k}", 0.0, 100.0) for k, v in others.items()},
        restore=restore,
    )


def _restore(value: Any) -> dict[str, tuple[str, ...]]:
    """An ack's `restore`: uuid -> a list of limit kinds.  A kind this
    supervisor does not know is skipped (a later agent may add some); a
    kind that is also in `limits` for the device is refused, as the agent
    never sends both."""
    if not isinstance(value, dict):
        raise ProtocolError(f"restore={value!r}: expected an object")
    out: dict[str, tuple[str, ...]] = {}
    for uuid, kinds in value.items():
        if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
            raise ProtocolError(f"restore.{uuid}={kinds!r}: expected a list of limit kinds")
        known = tuple(k for k in LIMIT_KINDS if k in kinds)
        if known:
            out[str(uuid)] = known
    return out


def describe_unmanaged(pids: tuple[int, ...] | list[int]) -> str:
    """How the agent (log) and top name the processes NVML lists on a GPU that
    no container reports (/status: gpus[].unmanaged_pids):
    '1 process not under gpuvisor (PID 1234)', plural as needed."""
    n = len(pids)
    shown_pids = ", ".join(str(p) for p in pids[:8]) + (", ..." if n > 8 else "")
    return (
        f"{n} process{'es' if n != 1 else ''} not under gpuvisor "
        f"(PID{'s' if n != 1 else ''} {shown_pids})"
    )
