"""The node agent's state file: administrators' limits (set-limit) kept
across an agent restart (docs/cli.md, `--state-file`).

The file holds every container's administrator's limits (and cleared
kinds) with the labels and pod cgroup that take them back, as JSON:

    {"version": 1, "written": 1700000000.0, "limits": [
      {"labels": ["ns", "pod", "main"], "scope": "/kubepods/pod<uid>",
       "until": null, "memory": {"GPU-…": 4294967296}, "sm": {"GPU-…": null},
       "restore": {"GPU-…": ["sm"]}}]}

`until` is the wall-clock time (Unix seconds) at which a parked entry
(its container had left) is forgotten, or null for a container that was
reporting when the file was written: the restarted agent waits for it
(restore_window) from its own start.

Beside them, what binds a container's identity to what the agent verified
(issue 36, 3 and 4), so that an agent restart does not open a race for it:

    "bindings": [{"labels": ["ns", "pod", "main"], "scope": "/kubepods/pod<uid>"}],
    "terms": [{"cgroup": "/kubepods/pod<uid>/<id>", "labels": ["ns", "pod", "main"],
               "priority": 1, "policy": "burst-share"}]

(labels bound to the pod cgroup that first reported them; the priority and
policy a container first reported).  Both are optional (a file written
before them has none) and taken back only while their cgroup still exists.

Written atomically (a temporary file in the same directory, fsync, rename,
fsync of the directory), so a reader sees the old file or the new one.
Read once at start: a file that cannot be read or does not hold that
shape stops the agent (fail closed: an administrator's limit may be a
safety limit, and starting without it would silently lift it); deleting
the file is the way to start without its limits.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import tempfile
from dataclasses import dataclass
from typing import Any

from ..protocol import LIMIT_KINDS, MAX_DEVICES, POLICIES, is_uuid

STATE_VERSION = 1
STATE_FILE_NAME = "limits.json"
# Far more than any node's containers' limits take (an entry is < 4 KiB):
# a larger file is not one this agent wrote.
MAX_STATE_BYTES = 64 * 1024 * 1024
_MAX_MEMORY = 2**64 - 1


def state_file_for(admin_socket: str) -> str:
    """The default state file of an agent whose admin socket is
    admin_socket: limits.json beside it, in the admin directory (mode 0700,
    never mounted into containers: /run/gpuvisor-admin/limits.json)."""
    return os.path.join(os.path.dirname(os.path.abspath(admin_socket)), STATE_FILE_NAME)


def state_file_problem(socket_path: str, state_file: str, admin_socket: str) -> str | None:
    """Why state_file cannot hold an agent's admin limits (None: it can):
    not in, or below, the reporting socket's directory, which is mounted
    into workloads (a workload could rewrite its own limits there); not
    the admin socket's own path (the file would take the socket's place)."""
    # Resolved, so that a link into the socket's directory is seen for what it is.
    shared = os.path.realpath(os.path.dirname(os.path.abspath(socket_path)))
    path = os.path.realpath(state_file)
    if path == shared or path.startswith(shared.rstrip("/") + "/"):
        return f"{state_file}: must not be in {shared}, the reporting socket's directory"
    if path == os.path.realpath(admin_socket):
        return f"{state_file}: the admin socket's path"
    return None


@dataclass(frozen=True)
class SavedBinding:
    """Labels bound to the scope (pod cgroup) that first reported them."""

    labels: tuple[str, str, str]
    scope: str

    def to_json(self) -> dict[str, Any]:
        return {"labels": list(self.labels), "scope": self.scope}


@dataclass(frozen=True)
class SavedTerms:
    """The priority and policy a container (cgroup and labels) first reported."""

    cgroup: str
    labels: tuple[str, str, str]
    priority: int
    policy: str

    def to_json(self) -> dict[str, Any]:
        return {
            "cgroup": self.cgroup,
            "labels": list(self.labels),
            "priority": self.priority,
            "policy": self.policy,
        }


@dataclass
class SavedState:
    """What a state file holds."""

    limits: list[SavedLimits]
    bindings: list[SavedBinding]
    terms: list[SavedTerms]


class StateFileError(RuntimeError):
    """A state file that cannot be read or used; the text is one line
    naming the file, the problem and the way out."""


@dataclass
class SavedLimits:
    """One container's administrator's limits, as the file holds them."""

    labels: tuple[str, str, str]  # (namespace, pod, container), ContainerId.labels
    scope: str  # the parent of its cgroup (records.cgroup_scope)
    until: float | None  # wall clock; None: the container was reporting
    memory: dict[str, int | None]
    sm: dict[str, int | None]
    restore: dict[str, tuple[str, ...]]

    def to_json(self) -> dict[str, Any]:
        return {
            "labels": list(self.labels),
            "scope": self.scope,
            "until": self.until,
            "memory": dict(sorted(self.memory.items())),
            "sm": dict(sorted(self.sm.items())),
            "restore": {u: list(k) for u, k in sorted(self.restore.items())},
        }


def encode_state(
    entries: list[SavedLimits],
    written: float,
    bindings: list[SavedBinding] | None = None,
    terms: list[SavedTerms] | None = None,
) -> bytes:
    doc: dict[str, Any] = {
        "version": STATE_VERSION,
        "written": round(written, 3),
        "limits": [e.to_json() for e in entries],
    }
    if bindings:
        doc["bindings"] = [b.to_json() for b in bindings]
    if terms:
        doc["terms"] = [t.to_json() for t in terms]
    return (json.dumps(doc, indent=1, allow_nan=False) + "\n").encode()


def write_state(path: str, data: bytes) -> None:
    """Replace path with data atomically: a temporary file beside it
    (mode 0600), written and fsynced, renamed over it, and the directory
    fsynced so the rename survives a crash of the node.  OSError: it could
    not be written (the old file is left as it was)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _fail(path: str, problem: str) -> StateFileError:
    return StateFileError(
        f"state file {path}: {problem}; the administrators' limits it holds cannot be "
        "restored, so the agent does not start without them: repair the file, or delete "
        "it to start with none"
    )


def read_state(path: str) -> list[SavedLimits]:
    """The administrators' limits of the state file at path (read_state_file)."""
    return read_state_file(path).limits


def read_state_file(path: str) -> SavedState:
    """What the state file at path holds; nothing when there is none (a
    first start).  StateFileError: it cannot be read, or is not a state
    file of this version (one line naming path and the problem)."""
    try:
        # O_NONBLOCK: a FIFO put there must not hang the agent's start.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return SavedState([], [], [])
    except OSError as exc:
        raise _fail(path, f"cannot read it ({exc.strerror or exc})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _fail(path, "not a regular file")
        with os.fdopen(fd, "rb") as f:
            fd = -1
            data = f.read(MAX_STATE_BYTES + 1)
    except OSError as exc:
        raise _fail(path, f"cannot read it ({exc.strerror or exc})") from None
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > MAX_STATE_BYTES:
        raise _fail(path, f"larger than {MAX_STATE_BYTES} bytes")
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise _fail(path, "not UTF-8 text") from None
    except (ValueError, RecursionError) as exc:
        raise _fail(path, f"not valid JSON ({str(exc).splitlines()[0]})") from None
    try:
        return _parse(doc)
    except ValueError as exc:
        raise _fail(path, str(exc)) from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse(doc: Any) -> SavedState:
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    version = doc.get("version")
    if version != STATE_VERSION or not _is_int(version):
        raise ValueError(f"version={version!r}: this agent reads version {STATE_VERSION}")
    entries = doc.get("limits")
    if not isinstance(entries, list):
        raise ValueError(f"limits={_short(entries)}: expected a list")
    bindings = doc.get("bindings", [])
    if not isinstance(bindings, list):
        raise ValueError(f"bindings={_short(bindings)}: expected a list")
    terms = doc.get("terms", [])
    if not isinstance(terms, list):
        raise ValueError(f"terms={_short(terms)}: expected a list")
    return SavedState(
        limits=[_entry(e, f"limits[{i}]") for i, e in enumerate(entries)],
        bindings=[_binding(b, f"bindings[{i}]") for i, b in enumerate(bindings)],
        terms=[_terms(t, f"terms[{i}]") for i, t in enumerate(terms)],
    )


def _labels(e: dict[str, Any], where: str) -> tuple[str, str, str]:
    labels = e.get("labels")
    if not (
        isinstance(labels, list) and len(labels) == 3 and all(isinstance(s, str) for s in labels)
    ):
        raise ValueError(f"{where}.labels={_short(labels)}: expected 3 strings")
    return (labels[0], labels[1], labels[2])


def _cgroup(e: dict[str, Any], name: str, where: str) -> str:
    value = e.get(name)
    if not isinstance(value, str) or not value.startswith("/"):
        raise ValueError(f"{where}.{name}={_short(value)}: expected a cgroup path")
    return value


def _binding(e: Any, where: str) -> SavedBinding:
    if not isinstance(e, dict):
        raise ValueError(f"{where}={_short(e)}: expected an object")
    return SavedBinding(labels=_labels(e, where), scope=_cgroup(e, "scope", where))


def _terms(e: Any, where: str) -> SavedTerms:
    if not isinstance(e, dict):
        raise ValueError(f"{where}={_short(e)}: expected an object")
    priority = e.get("priority")
    if not _is_int(priority) or priority not in (0, 1):
        raise ValueError(f"{where}.priority={_short(priority)}: expected 0 or 1")
    policy = e.get("policy")
    if policy not in POLICIES:
        raise ValueError(f"{where}.policy={_short(policy)}: expected one of {', '.join(POLICIES)}")
    return SavedTerms(
        cgroup=_cgroup(e, "cgroup", where),
        labels=_labels(e, where),
        priority=priority,
        policy=str(policy),
    )


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _entry(e: Any, where: str) -> SavedLimits:
    if not isinstance(e, dict):
        raise ValueError(f"{where}={_short(e)}: expected an object")
    labels = e.get("labels")
    if not (
        isinstance(labels, list) and len(labels) == 3 and all(isinstance(s, str) for s in labels)
    ):
        raise ValueError(f"{where}.labels={_short(labels)}: expected 3 strings")
    scope = e.get("scope")
    if not isinstance(scope, str):
        raise ValueError(f"{where}.scope={_short(scope)}: expected a cgroup path (a string)")
    until = e.get("until")
    if until is not None and (
        isinstance(until, bool) or not isinstance(until, int | float) or not math.isfinite(until)
    ):
        raise ValueError(f"{where}.until={_short(until)}: expected a Unix time or null")
    memory = _table(e.get("memory"), f"{where}.memory", 1, _MAX_MEMORY)
    sm = _table(e.get("sm"), f"{where}.sm", 1, 100)
    restore: dict[str, tuple[str, ...]] = {}
    raw = e.get("restore")
    if not isinstance(raw, dict):
        raise ValueError(f"{where}.restore={_short(raw)}: expected an object")
    for uuid, kinds in raw.items():
        w = f"{where}.restore.{uuid}"
        if not is_uuid(uuid):
            raise ValueError(f"{w}: not a device UUID")
        if not (
            isinstance(kinds, list)
            and kinds
            and all(k in LIMIT_KINDS for k in kinds)
            and len(set(kinds)) == len(kinds)
        ):
            raise ValueError(f"{w}={_short(kinds)}: expected a list of {list(LIMIT_KINDS)}")
        restore[uuid] = tuple(k for k in LIMIT_KINDS if k in kinds)
    for uuid, kinds in restore.items():
        for kind, table in (("memory", memory), ("sm", sm)):
            if kind in kinds and uuid in table:
                raise ValueError(f"{where}.{kind}.{uuid}: both set and cleared (restore)")
    if len(memory.keys() | sm.keys() | restore.keys()) > MAX_DEVICES:
        raise ValueError(f"{where}: limits on more than {MAX_DEVICES} devices")
    return SavedLimits(
        labels=(labels[0], labels[1], labels[2]),
        scope=scope,
        until=None if until is None else float(until),
        memory=memory,
        sm=sm,
        restore=restore,
    )


def _table(raw: Any, where: str, lo: int, hi: int) -> dict[str, int | None]:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}={_short(raw)}: expected an object")
    out: dict[str, int | None] = {}
    for uuid, v in raw.items():
        if not is_uuid(uuid):
            raise ValueError(f"{where}.{_short(uuid)}: not a device UUID")
        if v is not None and not (_is_int(v) and lo <= v <= hi):
            raise ValueError(
                f"{where}.{uuid}={_short(v)}: expected null or an integer in [{lo}, {hi}]"
            )
        out[uuid] = v
    return out
