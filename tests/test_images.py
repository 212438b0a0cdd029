"""The container images (images/): their Dockerfiles against the real build.

No Docker engine is needed: the Dockerfiles are parsed (dockerfile-parse)
and checked against what the repository actually builds and installs:
make's output paths, the package's console script and CLI defaults, the
loader's search rules, the build context's ignore files.  The image layout
is rebuilt in a scratch directory from the local build and driven through
`gpuvisor run`, the way the image's documented smoke test drives it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import pytest
from dockerfile_parse import DockerfileParser
from gpuvisor.shim import loader
from gpuvisor.supervisor.agent.cli import node_agent
from gpuvisor.supervisor.cli import main as cli_main

from tests.helpers import BUILD_DIR, CLI, REPO_ROOT, SimNode, clean_env, repo_files, run_cmd

IMAGES = REPO_ROOT / "images"
RUNTIME = IMAGES / "runtime" / "Dockerfile"
AGENT = IMAGES / "agent" / "Dockerfile"
DOCKERFILES = [RUNTIME, AGENT]
README = IMAGES / "README.md"
PYPROJECT = (REPO_ROOT / "pyproject.toml").read_text()
GiB = 1 << 30


# ---- parsing -------------------------------------------------------------------------


@dataclass
class Copy:
    sources: list[str]
    dest: str
    from_stage: str | None


@dataclass
class Stage:
    name: str | None
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def values(self, instruction: str) -> list[str]:
        return [v for i, v in self.instructions if i == instruction]

    @property
    def workdir(self) -> str:
        workdirs = self.values("WORKDIR")
        return workdirs[-1] if workdirs else "/"

    def copies(self) -> list[Copy]:
        out = []
        for value in self.values("COPY"):
            words = shlex.split(value)
            flags = [w for w in words if w.startswith("--")]
            args = [w for w in words if not w.startswith("--")]
            from_stage = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
            out.append(Copy(sources=args[:-1], dest=args[-1], from_stage=from_stage))
        return out

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for value in self.values("ENV"):
            for word in shlex.split(value):
                key, _, val = word.partition("=")
                out[key] = val
        return out

    def exec_form(self, instruction: str) -> list[str]:
        (value,) = self.values(instruction)[-1:]
        parsed = json.loads(value)
        assert isinstance(parsed, list), f"{instruction} {value}: not the exec (JSON) form"
        return [str(x) for x in parsed]


def stages(dockerfile: Path) -> list[Stage]:
    parser = DockerfileParser(path=str(dockerfile), env_replace=False)
    bases = iter(parser.parent_images)  # FROM lines with ARG defaults substituted
    out: list[Stage] = []
    for ins in parser.structure:
        if ins["instruction"] == "FROM":
            words = ins["value"].split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            out.append(Stage(name=name, base=next(bases)))
        elif out and ins["instruction"] != "COMMENT":
            out[-1].instructions.append((ins["instruction"], ins["value"]))
    return out


def stage(stages_: list[Stage], name: str) -> Stage:
    (found,) = [s for s in stages_ if s.name == name]
    return found


def make_outputs() -> dict[str, str]:
    """File name -> path relative to the repo, of what `make lib sim` builds."""
    proc = subprocess.run(
        ["make", "-n", "-B", "lib", "sim"],
        cwd=REPO_ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("MAKE")},
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    outs = re.findall(r"-o (\S+)", proc.stdout)
    return {PurePosixPath(p).name: p for p in outs}


def pyproject_value(table: str, key: str) -> str:
    """A string value of pyproject.toml (tomllib needs Python 3.11)."""
    section = re.search(rf"^\[{re.escape(table)}\]\n(.*?)(?=^\[|\Z)", PYPROJECT, re.M | re.S)
    assert section, f"[{table}] missing from pyproject.toml"
    value = re.search(rf'^{re.escape(key)}\s*=\s*"([^"]*)"', section.group(1), re.M)
    assert value, f"{table}.{key} missing from pyproject.toml"
    return value.group(1)


def package_dirs() -> list[str]:
    """The source folders pyproject.toml installs packages from."""
    section = re.search(
        r"^\[tool\.setuptools\.package-dir\]\n(.*?)(?=^\[|\Z)", PYPROJECT, re.M | re.S
    )
    assert section, "[tool.setuptools.package-dir] missing from pyproject.toml"
    folders = re.findall(r'^"[^"]+"\s*=\s*"([^"]+)"', section.group(1), re.M)
    assert folders, "no package-dir entries in pyproject.toml"
    return folders


def license_files() -> list[str]:
    """The files pyproject.toml's project.license-files names."""
    found = re.search(r"^license-files\s*=\s*\[(.*?)\]", PYPROJECT, re.M)
    return re.findall(r'"([^"]+)"', found.group(1)) if found else []


def documented_images() -> dict[str, str]:
    """Dockerfile path (relative to the repo) -> image name, from the README's build commands."""
    found = re.findall(r"docker build -f (images/\S+/Dockerfile) -t (\S+) \.", README.read_text())
    return dict(found)


def dockerignore_rules(dockerfile: Path) -> list[tuple[bool, re.Pattern[str]]]:
    """(is_exception, pattern) per line of the Dockerfile's own ignore file (BuildKit rules)."""
    rules = []
    for raw in dockerfile.with_name(dockerfile.name + ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pat = os.path.normpath(line.lstrip("!").strip().lstrip("/"))
        rx, i = "", 0
        while i < len(pat):
            if pat.startswith("**/", i):
                rx, i = rx + "(?:.*/)?", i + 3
            elif pat.startswith("**", i):
                rx, i = rx + ".*", i + 2
            elif pat[i] == "*":
                rx, i = rx + "[^/]*", i + 1
            elif pat[i] == "?":
                rx, i = rx + "[^/]", i + 1
            else:
                rx, i = rx + re.escape(pat[i]), i + 1
        rules.append((negate, re.compile(rx + r"\Z")))
    return rules


def in_context(rules: list[tuple[bool, re.Pattern[str]]], path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = PurePosixPath(path).parts
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for negate, rx in rules:
        if any(rx.match(c) for c in candidates):
            excluded = not negate
    return not excluded


@pytest.fixture(scope="module")
def runtime() -> list[Stage]:
    return stages(RUNTIME)


@pytest.fixture(scope="module")
def agent() -> list[Stage]:
    return stages(AGENT)


def install_path(runtime: list[Stage]) -> str:
    """Where the runtime image installs the library make builds."""
    lib = make_outputs()[loader.LIBRARY_NAME]
    native = stage(runtime, "native")
    built = str(PurePosixPath(native.workdir) / lib)
    (copy,) = [c for c in runtime[-1].copies() if c.from_stage == "native" and built in c.sources]
    assert copy.sources == [built]
    return copy.dest


# ---- structure ---------------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_multistage_with_pinned_bases(dockerfile: Path) -> None:
    st = stages(dockerfile)
    assert len(st) >= 2, "multi-stage: build stage(s) and a final stage"
    names = [s.name for s in st]
    assert all(names), names
    assert len(set(names)) == len(names), names
    for s in st:
        repo, _, tag = s.base.rpartition(":")
        assert repo, f"{s.name}: base {s.base!r} has no tag"
        assert "/" not in tag, f"{s.name}: base {s.base!r} has no tag"
        assert tag not in ("latest", ""), f"{s.name}: base {s.base!r} is not pinned"
        assert re.search(r"\d", tag), f"{s.name}: base {s.base!r}: tag names no version"
    # The final stage is a slim Python image (the CLI runs there); nothing is
    # compiled in it.
    final = st[-1]
    assert final.base.startswith("python:")
    assert "slim" in final.base
    assert not any("make" in shlex.split(v)[:1] for v in final.values("RUN"))
    # COPY --from names an earlier stage.
    for i, s in enumerate(st):
        for c in s.copies():
            if c.from_stage is not None:
                assert c.from_stage in names[:i], f"{s.name}: COPY --from={c.from_stage}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_copy_sources_exist_and_are_in_the_build_context(dockerfile: Path) -> None:
    rules = dockerignore_rules(dockerfile)
    files = repo_files()
    copied = []
    for s in stages(dockerfile):
        for c in s.copies():
            if c.from_stage is not None:
                continue
            for src in c.sources:
                path = REPO_ROOT / src
                assert path.exists(), f"COPY {src}: not in the repository"
                top = src.rstrip("/")
                under = [f for f in files if f == top or f.startswith(top + "/")]
                assert under, f"COPY {src}: no files"
                left_out = [f for f in under if not in_context(rules, f)]
                assert not left_out, f"COPY {src}: excluded by the ignore file: {left_out[:5]}"
                copied += under
    # Everything `pip wheel .` and `make lib` read is copied.
    for needed in ("pyproject.toml", "setup.py", "Makefile", "README.md", "native/shim/core.c"):
        assert needed in copied, needed
    # ... and the files pyproject.toml's license-files names (setuptools fails without them).
    for needed in license_files():
        assert needed in copied, f"{needed} (project.license-files) is not copied"
    # ... and every package's folder (pyproject.toml's package-dir).
    for folder in package_dirs():
        assert f"{folder}/__init__.py" in copied, f"{folder}/ (a package) is not copied"
    # Host build outputs and environments never reach the context.
    for outside in (
        "build/libgpuvisor.so",
        "build/sim/libcuda.so.1",
        "build-asan/libgpuvisor.so",
        ".venv/bin/python",
        ".git/HEAD",
        "native/shim/__pycache__/x.pyc",
        "tests/test_agent.py",
        "gpuvisor.egg-info/PKG-INFO",
    ):
        assert not in_context(rules, outside), outside


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_final_stage_installs_the_wheel_the_wheel_stage_builds(dockerfile: Path) -> None:
    st = stages(dockerfile)
    wheel = stage(st, "wheel")
    (build,) = [v for v in wheel.values("RUN") if "pip wheel" in v]
    words = shlex.split(build)
    assert words[-1] == "."  # the package in WORKDIR, where pyproject.toml was copied
    assert any("pyproject.toml" in c.sources for c in wheel.copies())
    wheel_dir = words[words.index("--wheel-dir") + 1]
    (copy,) = [c for c in st[-1].copies() if c.from_stage == "wheel"]
    assert [s.rstrip("/") for s in copy.sources] == [wheel_dir.rstrip("/")]
    name = pyproject_value("project", "name")
    installs = [v for v in st[-1].values("RUN") if "pip install" in v]
    assert any(f"{copy.dest.rstrip('/')}/{name}-*.whl" in v for v in installs), installs


def test_dockerignore_matcher_follows_docker_rules() -> None:
    rules = dockerignore_rules(RUNTIME)
    assert in_context(rules, "native/shim/core.c")  # re-included directory
    assert not in_context(rules, "docs/cli.md")  # "*" excludes the rest
    assert not in_context(rules, "shim/__pycache__/loader.cpython-311.pyc")  # "**/" pattern


# ---- the runtime image ---------------------------------------------------------------------


def test_native_stage_builds_and_the_final_stage_installs_makes_library(runtime):
    native = stage(runtime, "native")
    assert any(shlex.split(v)[:2] == ["make", "lib"] for v in native.values("RUN"))
    outs = make_outputs()
    assert outs[loader.LIBRARY_NAME] == "build/libgpuvisor.so"
    final_copies = [c for c in runtime[-1].copies() if c.from_stage == "native"]
    copied = {src for c in final_copies for src in c.sources}
    want = {str(PurePosixPath(native.workdir) / outs[n]) for n in outs}
    assert copied == want, (copied, want)
    # The native stage links against an old glibc (Debian 11, glibc 2.31):
    # the library is loaded into other images (images/README.md).
    assert re.match(r"debian:(11[.-]|bullseye)", native.base), native.base


def test_install_path_is_the_documented_one_everywhere(runtime):
    path = install_path(runtime)
    assert path == "/usr/local/lib/gpuvisor/libgpuvisor.so"
    final = runtime[-1]
    # The Python loader's override points at the same file...
    env = final.env()
    assert loader.NATIVE_DIR_ENV == "GPUVISOR_NATIVE_DIR"
    assert str(PurePosixPath(env[loader.NATIVE_DIR_ENV]) / loader.LIBRARY_NAME) == path
    # ...as the build-time check and the ld.so.preload option.
    runs = final.values("RUN")
    assert any(f"== '{path}'" in r for r in runs)
    (preload,) = [r for r in runs if "/etc/ld.so.preload" in r]
    assert f"echo {path} >> /etc/ld.so.preload" in preload
    readme = README.read_text()
    assert f"`{path}`" in readme
    assert "LD_SO_PRELOAD=1" in readme


def test_ld_so_preload_option(runtime, tmp_path):
    final = runtime[-1]
    assert "LD_SO_PRELOAD=0" in final.values("ARG"), "off by default"
    (script,) = [r for r in final.values("RUN") if "/etc/ld.so.preload" in r]
    # Last RUN: no later build step runs with the shim preloaded.
    assert final.values("RUN")[-1] == script
    target = tmp_path / "ld.so.preload"
    local = script.replace("/etc/ld.so.preload", str(target))
    path = install_path(runtime)

    def build(value: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["sh", "-c", local],
            env=dict(clean_env(), LD_SO_PRELOAD=value),
            capture_output=True,
            text=True,
            check=False,
        )

    assert build("0").returncode == 0
    assert not target.exists()
    assert build("1").returncode == 0
    assert target.read_text() == path + "\n"
    bad = build("yes")
    assert bad.returncode != 0
    assert "LD_SO_PRELOAD" in bad.stderr


def test_image_layout_drives_gpuvisor_run(runtime, tmp_path, build_dir):
    """Lay the runtime image's /usr/local/lib/gpuvisor out from the local build
    (COPY by COPY) and run the README's smoke test against it."""
    native = stage(runtime, "native")
    root = tmp_path / "image"
    for c in runtime[-1].copies():
        if c.from_stage != "native":
            continue
        for src in c.sources:
            local = BUILD_DIR.parent / PurePosixPath(src).relative_to(native.workdir)
            dest = root / (
                c.dest.lstrip("/") + PurePosixPath(src).name
                if c.dest.endswith("/")
                else c.dest.lstrip("/")
            )
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(local, dest)
    native_dir = root / runtime[-1].env()[loader.NATIVE_DIR_ENV].lstrip("/")
    node = SimNode.create(tmp_path)
    env = dict(node.env)
    env.pop("LD_LIBRARY_PATH")  # --simulate finds the simulator through the native dir
    env[loader.NATIVE_DIR_ENV] = str(native_dir)
    env["GPUVISOR_NODE_SOCKET"] = str(tmp_path / "no-agent.sock")
    code = (
        "import json, os;"
        "from cuda.bindings import driver as cu;"
        "cu.cuInit(0); ctx = cu.cuDevicePrimaryCtxRetain(0)[1]; cu.cuCtxSetCurrent(ctx);"
        "print(json.dumps([os.environ['LD_PRELOAD'].split(':')[0], cu.cuMemGetInfo()[2]]))"
    )
    cmd = [*CLI, "run", "--simulate", "--memory", "1g", "--", sys.executable, "-c", code]
    proc = run_cmd(cmd, env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    preloaded, total = json.loads(proc.stdout.splitlines()[-1])
    assert preloaded == str(native_dir / loader.LIBRARY_NAME)
    assert total == GiB


def test_runtime_entrypoint_is_gpuvisor_run(runtime):
    final = runtime[-1]
    assert final.exec_form("ENTRYPOINT") == ["gpuvisor", "run", "--"]
    assert pyproject_value("project.scripts", "gpuvisor") == "gpuvisor.supervisor.cli:main"
    assert "run" in cli_main.commands
    cmd = final.exec_form("CMD")
    assert cmd[0] == "gpuvisor"
    assert cmd[1] in cli_main.commands


# ---- the agent image -----------------------------------------------------------------------


def test_agent_exposes_the_default_metrics_port(agent, monkeypatch):
    monkeypatch.delenv("GPUVISOR_NODE_SOCKET", raising=False)
    final = agent[-1]
    assert final.exec_form("ENTRYPOINT") == ["gpuvisor", "node-agent"]
    assert "node-agent" in cli_main.commands
    defaults = node_agent.make_context("node-agent", []).params
    assert final.values("EXPOSE") == [str(defaults["metrics_port"])]
    # The default arguments parse and are the defaults.
    args = node_agent.make_context("node-agent", final.exec_form("CMD")).params
    assert args["metrics_port"] == defaults["metrics_port"]
    assert args["socket_path"] == defaults["socket_path"] == "/run/gpuvisor/node.sock"
    # The image has the socket directory, owned by the user it runs as.
    sock_dir = str(PurePosixPath(defaults["socket_path"]).parent)
    uid = image_uid(agent)
    (mkdir,) = [r for r in final.values("RUN") if "install -d" in r]
    assert re.search(rf"install -d -o {uid} -g {uid} -m 0755 {re.escape(sock_dir)}(\s|$)", mkdir)


def image_uid(st: list[Stage]) -> int:
    (user,) = st[-1].values("USER")[-1:]
    return int(user.split(":")[0])


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_final_stage_runs_as_a_created_non_root_user(dockerfile):
    st = stages(dockerfile)
    uid = image_uid(st)
    assert uid != 0
    assert any(f"useradd --uid {uid}" in r for r in st[-1].values("RUN"))
    # The user is set after every RUN that needs root.
    last_user = max(i for i, (ins, _) in enumerate(st[-1].instructions) if ins == "USER")
    last_run = max(i for i, (ins, _) in enumerate(st[-1].instructions) if ins == "RUN")
    assert last_run < last_user


# ---- README --------------------------------------------------------------------------------


def test_readme_documents_both_images_at_the_package_version():
    images = documented_images()
    assert set(images) == {str(p.relative_to(REPO_ROOT)) for p in DOCKERFILES}
    version = pyproject_value("project", "version")
    for name in images.values():
        assert name.endswith(":" + version), name
    readme = README.read_text()
    for name in images.values():
        assert f"`{name}`" in readme
    # Both ways a workload image gets the library.
    runtime_image = images["images/runtime/Dockerfile"]
    assert f"FROM {runtime_image}" in readme
    assert f"COPY --from={runtime_image} /usr/local/lib/gpuvisor/" in readme
    assert "deploy/" in readme
