"""The docs match the code.

- every environment variable the C library, the simulator and the Python
  package read (found in their sources) is documented in docs/environment.md,
  and every variable listed there is read;
- every `gpuvisor` command and every (non-hidden) option of each is in
  docs/cli.md, under the command's own heading, and has a help text;
- every metric the node agent exports (from its collector, fed with a
  report and a host GPU) is in docs/metrics.md, with its type and labels,
  every metric listed there is exported, and every key of its /status
  document is in the /status section;
- the version numbers and region size that quoted messages give are the
  code's;
- every relative link in docs/*.md and README.md points to a file that
  exists, and every #anchor to a heading of that file.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from gpuvisor.supervisor.agent.config import AgentConfig
from gpuvisor.supervisor.agent.metrics import AgentCollector, HostGpu
from gpuvisor.supervisor.agent.state import AgentState
from gpuvisor.supervisor.cli import main as cli_main
from gpuvisor.supervisor.identity import PeerCred
from gpuvisor.supervisor.protocol import PROTOCOL_VERSION, ContainerId, DeviceReport, Report
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import REPO_ROOT, clean_env

DOCS = REPO_ROOT / "docs"
C_SOURCE_DIRS = (REPO_ROOT / "native" / "shim", REPO_ROOT / "native" / "sim")
# Each folder and its subpackages.
PY_SOURCE_DIRS = (REPO_ROOT / "shim", REPO_ROOT / "supervisor", REPO_ROOT / "cluster")


# ---- markdown helpers ----------------------------------------------------------

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)


def _strip_code(text: str) -> str:
    """Markdown without fenced code blocks and inline code spans."""
    text = _FENCE.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)


@dataclass(frozen=True)
class Heading:
    level: int
    text: str  # as written, inline markup included
    start: int  # offset of the heading line
    body: int  # offset just after the heading line


def headings(text: str) -> list[Heading]:
    """ATX headings outside fenced code blocks."""
    fenced = [(m.start(), m.end()) for m in _FENCE.finditer(text)]
    out = []
    for m in re.finditer(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", text, re.M):
        if any(a <= m.start() < b for a, b in fenced):
            continue
        out.append(Heading(len(m.group(1)), m.group(2), m.start(), m.end()))
    return out


def plain(heading_text: str) -> str:
    """A heading's text as rendered: link text instead of links, no backticks."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading_text)
    return text.replace("`", "").strip()


def slugs(text: str) -> set[str]:
    """GitHub's anchors for the headings of a markdown document."""
    seen: dict[str, int] = {}
    out = set()
    for h in headings(text):
        slug = re.sub(r"[^\w\- ]", "", plain(h.text).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def section(text: str, heading: Heading, exclude: list[Heading]) -> str:
    """The text under heading, up to the next heading of its level or higher,
    leaving out the subsections listed in exclude."""
    all_h = headings(text)
    end = len(text)
    for h in all_h:
        if h.start > heading.start and h.level <= heading.level:
            end = h.start
            break
    parts = []
    pos = heading.body
    for sub in sorted(exclude, key=lambda h: h.start):
        if not heading.start < sub.start < end:
            continue
        parts.append(text[pos : sub.start])
        pos = end
        for h in all_h:
            if h.start > sub.start and h.level <= sub.level:
                pos = min(h.start, end)
                break
    parts.append(text[pos:end])
    return "".join(parts)


def code_mentions(text: str, word: str) -> bool:
    """word appears as (the start of) a code span: `word`, `word ARG`, `word{...}`."""
    return re.search("`" + re.escape(word) + r"(?![\w-])", text) is not None


# ---- environment variables: the C sources ---------------------------------------

_C_TOKENS = re.compile(r'//[^\n]*|/\*.*?\*/|("(?:\\.|[^"\\\n])*")|(\'(?:\\.|[^\'\\\n])*\')', re.S)


def _strip_c_comments(src: str) -> str:
    return _C_TOKENS.sub(lambda m: m.group(1) or m.group(2) or " ", src)


def _balanced(src: str, open_at: int, pair: str = "()") -> int:
    """Index just past the bracket that closes the one at open_at."""
    depth = 0
    i = open_at
    while i < len(src):
        c = src[i]
        if c == '"':
            i = src.index('"', i + 1)
            while src[i - 1] == "\\":
                i = src.index('"', i + 1)
        elif c == pair[0]:
            depth += 1
        elif c == pair[1]:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError(f"unbalanced {pair} at {open_at}")


def _split_args(args: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for c in args:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += c
    if cur.strip():
        out.append(cur.strip())
    return out


def _calls(src: str, name: str) -> Iterator[tuple[int, list[str]]]:
    """(offset, arguments) of every call name(...) in src."""
    for m in re.finditer(r"\b" + re.escape(name) + r"\s*\(", src):
        open_at = m.end() - 1
        yield m.start(), _split_args(src[open_at + 1 : _balanced(src, open_at) - 1])


@dataclass
class CFunction:
    name: str
    params: list[str]
    body: str
    path: Path


def _c_functions(path: Path, src: str) -> list[CFunction]:
    out = []
    for m in re.finditer(r"^[A-Za-z_][^\n;{}#=]*?\b(\w+)\s*\(", src, re.M):
        open_at = m.end() - 1
        close = _balanced(src, open_at)
        rest = src[close:].lstrip()
        if not rest.startswith("{"):
            continue
        body_at = close + (len(src) - close - len(rest))
        params = []
        for p in _split_args(src[open_at + 1 : close - 1]):
            ids = re.findall(r"\w+", re.sub(r"\[.*?\]", "", p))
            params.append(ids[-1] if ids else "")
        body = src[body_at : _balanced(src, body_at, "{}")]
        out.append(CFunction(m.group(1), params, body, path))
    return out


class CEnvScan:
    """Environment variable names read by the C sources, found by following
    getenv/secure_getenv arguments to string literals, string macros, the
    parameters of wrapper functions (and their callers' arguments), and
    names built with snprintf (a "_%d" suffix is an ordinal: NAME_<i>)."""

    def __init__(self, dirs: tuple[Path, ...]) -> None:
        self.sources = {
            p: _strip_c_comments(p.read_text())
            for d in dirs
            for p in sorted([*d.glob("*.c"), *d.glob("*.h")])
        }
        self.macros: dict[str, str] = {}
        for src in self.sources.values():
            for m in re.finditer(r'^\s*#\s*define\s+(\w+)\s+((?:"[^"\n]*"\s*)+)$', src, re.M):
                self.macros[m.group(1)] = "".join(re.findall(r'"([^"]*)"', m.group(2)))
        self.functions = [f for p, s in self.sources.items() for f in _c_functions(p, s)]
        self.names: set[str] = set()
        self.unresolved: list[str] = []
        # env-name constants by the project's naming convention
        self.names |= {v for k, v in self.macros.items() if "_ENV_" in f"_{k}_"}
        wrappers: list[tuple[str, int]] = []
        for f in self.functions:
            for fn in ("getenv", "secure_getenv"):
                for _, args in _calls(f.body, fn):
                    self._resolve_arg(args[0], f, wrappers)
        for fname, index in wrappers:  # grows: a wrapper may call another one
            for f in self.functions:  # calls inside function bodies, not prototypes
                for _, args in _calls(f.body, fname):
                    arg = args[index] if index < len(args) else ""
                    name = self._constant(arg) if arg else None
                    built = self._built(arg, f) if arg else None
                    if name is not None:
                        self.names.add(name)
                    elif built is not None:
                        self.names |= built
                    elif re.fullmatch(r"\w+", arg) and arg in f.params:
                        if (f.name, f.params.index(arg)) not in wrappers:
                            wrappers.append((f.name, f.params.index(arg)))
                    else:
                        self.unresolved.append(f"{f.path.name}: {fname}({', '.join(args)})")

    def _constant(self, expr: str) -> str | None:
        """The string an expression of literals and string macros spells."""
        parts = re.findall(r'"((?:\\.|[^"\\])*)"|(\w+)', expr)
        if not parts:
            return None
        out = ""
        for literal, ident in parts:
            if ident:
                if ident not in self.macros:
                    return None
                out += self.macros[ident]
            else:
                out += literal
        if out.endswith("_%d"):
            out = out[: -len("_%d")] + "_<i>"
        return out if re.fullmatch(r"[A-Z][A-Z0-9_]*(_<i>)?", out) else None

    def _resolve_arg(self, arg: str, f: CFunction, wrappers: list[tuple[str, int]]) -> None:
        name = self._constant(arg)
        if name is not None:
            self.names.add(name)
            return
        if re.fullmatch(r"\w+", arg) and arg in f.params:
            wrappers.append((f.name, f.params.index(arg)))
            return
        built = self._built(arg, f)
        if built is not None:
            self.names |= built
            return
        self.unresolved.append(f"{f.path.name}: {f.name}: getenv({arg})")

    def _built(self, arg: str, f: CFunction) -> set[str] | None:
        """The names f builds in the buffer arg with snprintf, if every
        such call spells one (None otherwise)."""
        built = [
            self._constant(args[2])
            for _, args in _calls(f.body, "snprintf")
            if len(args) >= 3 and args[0] == arg
        ]
        if built and all(b is not None for b in built):
            return {b for b in built if b is not None}
        return None


# ---- environment variables: the Python sources -----------------------------------


def _py_constants(trees: dict[Path, ast.Module]) -> dict[str, set[str]]:
    """Module-level NAME = "str" / ("str", ...) assignments, from every module."""
    consts: dict[str, set[str]] = {}
    for tree in trees.values():
        for node in tree.body:
            if not isinstance(node, ast.Assign):
                continue
            value = node.value
            strings: list[str] = []
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                strings = [value.value]
            elif isinstance(value, (ast.Tuple, ast.List)) and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts
            ):
                strings = [
                    e.value
                    for e in value.elts
                    if isinstance(e, ast.Constant) and isinstance(e.value, str)
                ]
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id.isupper() and strings:
                    consts.setdefault(target.id, set()).update(strings)
    return consts


def _envish(node: ast.expr) -> bool:
    """An expression that denotes an environment (os.environ, env, base_env, cfg.env)."""
    last = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return re.search(r"(^|_)env(iron)?$", last, re.I) is not None


class PyEnvScan(ast.NodeVisitor):
    """Environment variable names the Python sources read: keys of get /
    setdefault / pop / [] / `in` on an environment, os.getenv, click's
    envvar=, and name tuples passed along with an environment."""

    def __init__(self, dirs: tuple[Path, ...]) -> None:
        trees = {p: ast.parse(p.read_text(), str(p)) for d in dirs for p in sorted(d.rglob("*.py"))}
        self.consts = _py_constants(trees)
        self.names: set[str] = set()
        for tree in trees.values():
            self.visit(tree)

    def _strings(self, node: ast.expr | None) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, ast.Name):
            return set(self.consts.get(node.id, set()))
        if isinstance(node, ast.Attribute):
            return set(self.consts.get(node.attr, set()))
        if isinstance(node, (ast.Tuple, ast.List)):
            return {s for e in node.elts for s in self._strings(e)}
        return set()

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute):
            if func.attr in ("get", "setdefault", "pop") and _envish(func.value) and node.args:
                self.names |= self._strings(node.args[0])
            if func.attr == "getenv" and node.args:
                self.names |= self._strings(node.args[0])
        for kw in node.keywords:
            if kw.arg == "envvar":
                self.names |= self._strings(kw.value)
        if any(_envish(a) for a in node.args):
            # A name, or a tuple of names, passed along with an environment
            # (helper(env, NAME), helper(env, NAMES)).
            for a in node.args:
                if isinstance(a, ast.Name):
                    self.names |= {
                        s for s in self.consts.get(a.id, ()) if re.fullmatch(r"[A-Z][A-Z0-9_]*", s)
                    }
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.ctx, ast.Load) and _envish(node.value):
            self.names |= self._strings(node.slice)
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        for op, right in zip(node.ops, node.comparators, strict=True):
            if isinstance(op, (ast.In, ast.NotIn)) and _envish(right):
                self.names |= self._strings(node.left)
        self.generic_visit(node)


def _documented(doc: str, name: str) -> bool:
    if name.endswith("_<i>"):
        return f"`{name}`" in doc
    return code_mentions(doc, name)


def test_c_environment_variables_are_documented() -> None:
    scan = CEnvScan(C_SOURCE_DIRS)
    assert not scan.unresolved, f"getenv arguments the scan cannot follow: {scan.unresolved}"
    # The scan must see the variables of every kind of read: literal, macro,
    # ordinal-suffixed snprintf name, wrapper parameter.
    for expected in (
        "CUDA_VISIBLE_DEVICES",
        "GPU_CORE_UTILIZATION_POLICY",
        "CUDA_DEVICE_MEMORY_LIMIT_<i>",
        "GPUVISOR_REAL_LIBNVML",
        "GPUVISOR_SIM_FAIL_ALLOC_EVERY",
    ):
        assert expected in scan.names, f"the C scan missed {expected}: {sorted(scan.names)}"
    doc = (DOCS / "environment.md").read_text()
    missing = sorted(n for n in scan.names if not _documented(doc, n))
    assert not missing, (
        f"read by native/shim or native/sim, missing in docs/environment.md: {missing}"
    )


def test_python_environment_variables_are_documented() -> None:
    names = PyEnvScan(PY_SOURCE_DIRS).names
    for expected in (
        "GPUVISOR_NODE_SOCKET",
        "GPUVISOR_NATIVE_DIR",
        "POD_NAME",
        "LD_PRELOAD",
        "GPUVISOR_REPORT_INTERVAL",  # through a helper: _env(env, NAME)
    ):
        assert expected in names, f"the Python scan missed {expected}: {sorted(names)}"
    doc = (DOCS / "environment.md").read_text()
    missing = sorted(n for n in names if not _documented(doc, n))
    assert not missing, (
        f"read by shim/, supervisor/ or cluster/, missing in docs/environment.md: {missing}"
    )


def test_every_documented_variable_is_read() -> None:
    """Each variable a table of docs/environment.md lists is read by the C
    library, the simulator or the Python package (no stale entries)."""
    read = CEnvScan(C_SOURCE_DIRS).names | PyEnvScan(PY_SOURCE_DIRS).names
    documented = set()
    for _, cells in _table_rows((DOCS / "environment.md").read_text()):
        documented |= set(re.findall(r"`([A-Z][A-Z0-9_]*(?:_<i>)?)`", cells[0]))
    assert len(documented) > 30, sorted(documented)
    stale = sorted(documented - read)
    assert not stale, f"in docs/environment.md but read by no source: {stale}"


# ---- the command line -------------------------------------------------------------


def _commands(cmd: click.Command, path: tuple[str, ...]) -> Iterator[tuple[str, click.Command]]:
    yield " ".join(path), cmd
    if isinstance(cmd, click.Group):
        for name in sorted(cmd.commands):
            yield from _commands(cmd.commands[name], (*path, name))


def test_every_command_and_option_is_in_cli_md() -> None:
    doc = (DOCS / "cli.md").read_text()
    commands = dict(_commands(cli_main, ("gpuvisor",)))
    assert {"gpuvisor run", "gpuvisor node-agent set-limit"} <= set(commands)
    by_path = {plain(h.text): h for h in headings(doc)}
    command_headings = [h for t, h in by_path.items() if t in commands]
    problems = []
    for path, cmd in commands.items():
        if path == "gpuvisor":
            text = doc
        elif path not in by_path:
            problems.append(f"no heading `{path}`")
            continue
        else:
            here = by_path[path]
            text = section(doc, here, [h for h in command_headings if h is not here])
        for param in cmd.params:
            if not isinstance(param, click.Option) or param.hidden:
                continue
            for opt in [*param.opts, *param.secondary_opts]:
                if not code_mentions(text, opt):
                    problems.append(f"{path}: option {opt} not documented in its section")
    # and the other way round: a command heading names a real command
    for h in headings(doc):
        title = plain(h.text)
        if title.startswith("gpuvisor") and h.level in (2, 3) and title not in commands:
            problems.append(f"heading `{title}` is not a gpuvisor command")
    assert not problems, "\n".join(problems)


def test_every_command_and_option_has_help_text() -> None:
    """`gpuvisor ... --help` describes every command and (non-hidden) option."""
    problems = []
    for path, cmd in _commands(cli_main, ("gpuvisor",)):
        if not (cmd.help or "").strip():
            problems.append(f"{path}: no help text")
        for param in cmd.params:
            if isinstance(param, click.Option) and not param.hidden and not param.help:
                problems.append(f"{path} {'/'.join(param.opts)}: no help text")
    assert not problems, "\n".join(problems)


# ---- metrics ------------------------------------------------------------------------


class _FakeGpus:
    """HostGpus with one device, so the host series are exported too."""

    available = True

    def read(self, max_age: float = 1.0) -> list[Any]:
        return [HostGpu(0, "GPU-00000000-0000-4000-8000-000000000000", "Test GPU", 1, 2, 50.0)]

    def inventory(self, max_age: float = 2.0) -> dict[str, Any]:
        """A one-GPU inventory (docs/inventory.md) with one MIG instance."""
        instance = {
            "gi_id": 2,
            "profile": "3g.40gb",
            "placement": {"start": 4, "size": 4},
            "uuid": "MIG-00000000-0000-4000-8000-000000000000",
            "memory_mib": 40192,
            "in_use": True,
        }
        gpu = {
            "index": 0,
            "uuid": "GPU-00000000-0000-4000-8000-000000000000",
            "model": "Test GPU",
            "numa": 0,
            "mig": {"instances": [instance]},
        }
        return {"gpus": [gpu]}

    def close(self) -> None:
        pass


def _fed_state() -> AgentState:
    """An agent's state with two containers' reports (high and low priority)."""
    state = AgentState(AgentConfig(legacy_metrics=True))
    device = DeviceReport(
        uuid="GPU-00000000-0000-4000-8000-000000000000",
        index=0,
        memory_used=1 << 30,
        memory_limit=4 << 30,
        memory_physical=16 << 30,
        oom_refusals=1,
        sm_share=12.5,
        sm_limit=30,
        sm_enforced=30.0,
        throttled=True,
    )
    for priority, cgroup in ((0, "/high"), (1, "/low")):
        report = Report(
            seq=1,
            ts=time.time(),
            container=ContainerId(cgroup=cgroup, pod="p", namespace="ns", container=cgroup[1:]),
            policy="fixed-share",
            priority=priority,
            pids=[4242],
            devices=[device],
        )
        state.accept_report(report, PeerCred(4242, 0, 0), time.monotonic())
    # An NVML reading with a process no container reports (unmanaged.py).
    state.unmanaged.note(
        {device.uuid: {4343: 50.0}},
        state.containers,
        lambda pid: frozenset({"/elsewhere"}),
        time.monotonic(),
        lambda pid: frozenset({pid}),
    )
    return state


def _exported_families() -> list[Any]:
    collector = AgentCollector(_fed_state(), _FakeGpus(), legacy=True)
    text = generate_latest(collector.registry).decode()
    return list(text_string_to_metric_families(text))


def _table_rows(text: str) -> Iterator[tuple[list[str], list[str]]]:
    """(header cells, row cells) of every markdown table row."""
    header: list[str] | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not all(re.fullmatch(r":?-+:?", c) for c in cells):
            yield header, cells


def test_every_exported_metric_is_in_metrics_md() -> None:
    doc = (DOCS / "metrics.md").read_text()
    families = _exported_families()
    assert len(families) > 20, [f.name for f in families]
    sections = headings(doc)
    problems = []
    for fam in families:
        exposed = {s.name for s in fam.samples} or {
            fam.name + ("_total" if fam.type == "counter" else "")
        }
        for name in sorted(exposed):
            rows = [
                (hdr, cells)
                for hdr, cells in _table_rows(doc)
                if re.match("`" + re.escape(name) + r"(`|\{)", cells[0])
            ]
            if not rows:
                problems.append(f"{name}: no table row in docs/metrics.md")
                continue
            hdr, cells = rows[0]
            if "Type" in hdr and cells[hdr.index("Type")] != fam.type:
                problems.append(f"{name}: documented as {cells[hdr.index('Type')]}, is {fam.type}")
            at = doc.index(cells[0])
            sec = max((h for h in sections if h.start < at and h.level == 2), key=lambda h: h.start)
            text = section(doc, sec, [])
            labels = {k for s in fam.samples for k in s.labels}
            problems += [
                f"{name}: label {label} not in its section ({plain(sec.text)})"
                for label in sorted(labels)
                if not code_mentions(text, label)
            ]
        if fam.name in ("gpuvisor_agent_rejected_reports", "gpuvisor_agent_disconnects"):
            for s in fam.samples:
                if not code_mentions(doc, s.labels["reason"]):
                    problems.append(f"{fam.name}: reason {s.labels['reason']} not documented")
    assert not problems, "\n".join(problems)


def test_every_documented_metric_is_exported() -> None:
    """Each metric a table of docs/metrics.md lists is exported (no stale rows)."""
    exported = {s.name for fam in _exported_families() for s in fam.samples}
    documented = set()
    for hdr, cells in _table_rows((DOCS / "metrics.md").read_text()):
        m = re.match(r"`(\w+)(`|\{)", cells[0])
        if hdr[0] == "Metric" and m:
            documented.add(m.group(1))
    assert len(documented) > 20, sorted(documented)
    stale = sorted(documented - exported)
    assert not stale, f"in docs/metrics.md but not exported: {stale}"


def test_every_status_key_is_in_metrics_md() -> None:
    """The keys of /status (the agent's, a container's, a device's beyond the
    report's own fields) are named in the /status section."""
    doc = (DOCS / "metrics.md").read_text()
    here = next(h for h in headings(doc) if plain(h.text) == "/status")
    text = section(doc, here, [])
    status = _fed_state().status()
    container = status["containers"][0]
    report_fields = set(DeviceReport.__dataclass_fields__)
    keys = {
        *status,
        *status["agent"],
        *container,
        *(set(container["devices"][0]) - report_fields),
    }
    missing = sorted(k for k in keys if not code_mentions(text, k))
    assert not missing, f"/status keys not in docs/metrics.md's /status section: {missing}"


# ---- versions and sizes quoted in messages ------------------------------------------


def _c_define(path: Path, name: str) -> int:
    m = re.search(r"^#define " + name + r" (\d+)u?\b", path.read_text(), re.M)
    assert m is not None, f"no #define {name} in {path}"
    return int(m.group(1))


def _quoted(pattern: str) -> list[tuple[str, int]]:
    """(document, number) for every match of pattern (one group) in the docs."""
    return [
        (md.name, int(m.group(1)))
        for md in _markdown_files()
        for m in re.finditer(pattern, md.read_text())
    ]


def test_quoted_layout_versions_are_current() -> None:
    """The region's, the simulator's and the protocol's version numbers in
    quoted messages and layout descriptions are the ones the code has."""
    region = _c_define(REPO_ROOT / "native" / "shim" / "region.h", "GV_REGION_VERSION")
    sim = _c_define(REPO_ROOT / "native" / "sim" / "sim.h", "SIM_VERSION")
    checks = [
        (r"this library speaks (\d+)", region),
        (r"## Layout \(version (\d+)\)", region),
        (r'magic "GVPVSH1" \([^)]*\), version (\d+)', region),
        (r"[Ii]ts layout version is (\d+)", sim),  # the simulator's state file
        (r"this agent speaks version (\d+)", PROTOCOL_VERSION),
        (r"protocol \(version (\d+)\)", PROTOCOL_VERSION),
    ]
    problems = []
    for pattern, actual in checks:
        found = _quoted(pattern)
        assert found, f"no match for {pattern!r} in the docs"
        problems += [
            f"{doc}: {pattern!r} gives {n}, the code {actual}" for doc, n in found if n != actual
        ]
    assert not problems, "\n".join(problems)


def test_quoted_region_size_is_current(tmp_path: Path) -> None:
    """The size in the quoted `file is N bytes, expected M` message is a region's size."""
    path = tmp_path / "r.shr"
    code = "import sys; from gpuvisor.shim import Region; Region.attach(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(path)], env=clean_env(), check=True)
    actual = path.stat().st_size
    found = _quoted(r"expected (\d+) \(too (?:small|large)\)")
    assert found, "no quoted region size in the docs"
    wrong = [f"{doc}: expected {n}" for doc, n in found if n != actual]
    assert not wrong, f"a region is {actual} bytes; the docs say {wrong}"


# ---- links -----------------------------------------------------------------------------

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _markdown_files() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def test_relative_links_resolve() -> None:
    problems = []
    for md in _markdown_files():
        for target in _LINK.findall(_strip_code(md.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            path_part, _, anchor = target.partition("#")
            dest = (md.parent / path_part).resolve() if path_part else md
            where = f"{md.parent.name}/{md.name}: ({target})"
            if not dest.exists():
                problems.append(f"{where}: {path_part} does not exist")
                continue
            if anchor and dest.suffix == ".md" and anchor not in slugs(dest.read_text()):
                problems.append(f"{where}: no heading #{anchor} in {dest.name}")
    assert not problems, "\n".join(problems)


def test_docs_index_lists_every_document() -> None:
    index = (DOCS / "README.md").read_text()
    linked = set(_LINK.findall(index))
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.name != "README.md"]
    missing = [name for name in missing if name not in linked]
    assert not missing, f"docs/README.md does not link to {missing}"


def test_link_checker_sees_anchors() -> None:
    """The slug rule matches GitHub's on the headings the docs link to."""
    text = "# A\n## `error` (agent \u2192 sender)\n## SM-time quota\n## Dup\n## Dup\n"
    assert slugs(text) == {"a", "error-agent--sender", "sm-time-quota", "dup", "dup-1"}


def test_troubleshooting_quotes_what_run_prints_for_a_bad_option(tmp_path: Path) -> None:
    """The first example of 'gpuvisor run exits with status 2' is the line
    `gpuvisor run --cores 101` prints (it quoted click's range message,
    which --cores no longer gives: the library's parser checks it)."""
    proc = subprocess.run(
        [sys.executable, "-m", "gpuvisor.supervisor", "run", "--cores", "101", "--", "true"],
        env={**clean_env(), "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp_path / "r.shr")},
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.splitlines()
    text = (REPO_ROOT / "docs" / "troubleshooting.md").read_text()
    section = text.split("## `gpuvisor run` exits with status 2", 1)[1].split("\n## ", 1)[0]
    assert line in section.splitlines(), line
    assert "is not in the range 0<=x<=100" not in section
