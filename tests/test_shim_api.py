"""gpuvisor.shim's Python API (ctypes over gpuvisor.h) against real region files.

The library attaches one region per process, so every test that attaches
runs its code in a child process with its own region under tmp_path.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from gpuvisor.shim import (
    GpuvisorError,
    NativeLibraryNotFound,
    library_path,
    parse_memory_limit,
    preload_env,
    simulator_dir,
)
from gpuvisor.shim.capi import API_VERSION, GV_EINVAL, lib

from tests.helpers import GiB, Holder, MiB, SimNode, run_json, run_py

SIM_CONTEXT = 32 * MiB  # what the simulator charges for one context
UUID0 = "GPU-00000000-1111-2222-3333-444444444444"
UUID1 = "GPU-55555555-6666-7777-8888-999999999999"

API = (
    """import json
from gpuvisor.shim import *
from tests.cuclient import emit
def errors_of(calls):
    \"\"\"{name: None, or [code_name, message] of the GpuvisorError it raised}.\"\"\"
    errors = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except GpuvisorError as e:
            errors[name] = [e.code_name, str(e)]
    return errors
def one_device(limit):
    \"\"\"This process's region, with device 0 registered: 16 GiB, this limit.\"\"\"
    r = Region.attach()
    r.register_device(UUID0, 16 << 30, limit)
    return r
"""
    + f"UUID0 = {UUID0!r}\n"
)


# --- loader -------------------------------------------------------------------


def test_library_found_in_build_dir(build_dir: Path) -> None:
    assert library_path() == build_dir / "libgpuvisor.so"
    assert simulator_dir() == build_dir / "sim"
    assert lib().gv_api_version() == API_VERSION


def test_native_dir_override_must_hold_the_library(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GPUVISOR_NATIVE_DIR", str(tmp_path))
    with pytest.raises(NativeLibraryNotFound, match="GPUVISOR_NATIVE_DIR"):
        library_path()


def test_empty_native_dir_counts_as_unset(
    build_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPUVISOR_NATIVE_DIR= (set but empty) is unset, as every other variable:
    it used to mean the current directory, so whatever libgpuvisor.so lay
    there was preloaded and loaded into the process instead of the build's."""
    (tmp_path / "libgpuvisor.so").write_bytes(b"not the build's library")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPUVISOR_NATIVE_DIR", "")
    assert library_path() == build_dir / "libgpuvisor.so"
    assert preload_env({})["LD_PRELOAD"] == str(build_dir / "libgpuvisor.so")


# lib() on the library GPUVISOR_NATIVE_DIR names: err is None, or
# [code name, message] of the GpuvisorError it raised.
LOAD_THE_LIBRARY = (
    API
    + """
from gpuvisor.shim.capi import lib
emit(**errors_of({"err": lib}))
"""
)


def test_a_library_without_the_api_is_a_clear_error(
    build_dir: Path, tmp_path: Path, node: SimNode
) -> None:
    """A libgpuvisor.so that lacks a gv_* function (a stale build, another
    library under that name) used to escape lib() as a bare AttributeError
    from ctypes, before the API version was even checked."""
    shutil.copyfile(build_dir / "sim" / "libcuda.so.1", tmp_path / "libgpuvisor.so")
    env = {**node.env, "GPUVISOR_NATIVE_DIR": str(tmp_path)}
    out = run_json(LOAD_THE_LIBRARY, env)
    assert out["err"] is not None
    assert out["err"][0] == "GV_EINVAL"
    assert str(tmp_path / "libgpuvisor.so") in out["err"][1]
    assert "gv_api_version" in out["err"][1]


@pytest.mark.parametrize("content", ["garbage", "foreign"])
def test_a_library_that_cannot_be_used_is_one_line_from_api_and_shim_info(
    build_dir: Path, tmp_path: Path, node: SimNode, content: str
) -> None:
    """A libgpuvisor.so that the dynamic linker cannot load (cut short, of
    another architecture) escaped lib() as a bare OSError from ctypes, not
    the GpuvisorError the API promises; and `gpuvisor shim-info` without
    --region died with a traceback for it, or for a foreign library (it
    asks the library its default path before anything else)."""
    lib_file = tmp_path / "libgpuvisor.so"
    if content == "garbage":
        lib_file.write_bytes(b"not a shared object")
    else:
        shutil.copyfile(build_dir / "sim" / "libcuda.so.1", lib_file)
    env = {**node.env, "GPUVISOR_NATIVE_DIR": str(tmp_path)}
    out = run_json(LOAD_THE_LIBRARY, env)
    assert out["err"] is not None
    assert out["err"][0] == "GV_EINVAL"
    assert str(lib_file) in out["err"][1]
    env.pop("CUDA_DEVICE_MEMORY_SHARED_CACHE", None)  # the library's default path
    proc = run_py("from gpuvisor.shim.cli import main; main()", env, args=["shim-info"])
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("Error: gpuvisor: ")
    assert str(lib_file) in lines[0]


def test_preload_env_prepends_and_keeps_entries(build_dir: Path) -> None:
    env = preload_env(
        {"LD_PRELOAD": "/x/liba.so /x/libb.so", "LD_LIBRARY_PATH": "/opt/lib", "K": "v"},
        simulate=True,
    )
    assert env["LD_PRELOAD"] == f"{build_dir / 'libgpuvisor.so'}:/x/liba.so:/x/libb.so"
    assert env["LD_LIBRARY_PATH"] == f"{build_dir / 'sim'}:/opt/lib"
    assert env["K"] == "v"
    plain = preload_env({"LD_PRELOAD": str(build_dir / "libgpuvisor.so")})
    assert plain["LD_PRELOAD"] == str(build_dir / "libgpuvisor.so")
    assert "LD_LIBRARY_PATH" not in plain


@pytest.mark.parametrize("name", ["with space", "with:colon"])
def test_a_library_path_the_linker_would_split_is_refused(
    build_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """The dynamic linker splits LD_PRELOAD at spaces and colons: a native
    directory with one in its path used to be preloaded as two broken
    entries, ignored with a warning, and the workload ran unlimited."""
    native = tmp_path / name
    shutil.copytree(build_dir, native, ignore=shutil.ignore_patterns("tests", "bench", "demo"))
    monkeypatch.setenv("GPUVISOR_NATIVE_DIR", str(native))
    with pytest.raises(NativeLibraryNotFound, match="LD_PRELOAD cannot hold"):
        preload_env({})


# --- parse_memory_limit (the C parser, through ctypes) ------------------------


@pytest.mark.parametrize(
    ("text", "physical", "expected"),
    [
        ("1", 0, 1),
        ("1048576", 0, MiB),
        ("1k", 0, 1024),
        ("1K", 0, 1024),
        ("512m", 0, 512 * MiB),
        ("512MiB", 0, 512 * MiB),
        ("512mb", 0, 512 * MiB),
        ("512Mi", 0, 512 * MiB),
        ("4g", 0, 4 * GiB),
        ("4G", 0, 4 * GiB),
        ("4gib", 0, 4 * GiB),
        ("1t", 0, 1 << 40),
        ("25%", 16 * GiB, 4 * GiB),
        ("100%", 16 * GiB, 16 * GiB),
    ],
)
def test_parse_memory_limit(build_dir, text, physical, expected) -> None:
    assert parse_memory_limit(text, physical) == expected


@pytest.mark.parametrize(
    "text",
    ["", "abc", "-1", "0", "12q", "150%", "1.5.5g", "g", "99999999999999999999", "20000000t"],
)
def test_parse_memory_limit_rejects(build_dir, text) -> None:
    with pytest.raises(GpuvisorError) as info:
        parse_memory_limit(text, 16 * GiB)
    assert info.value.code == GV_EINVAL
    assert info.value.message


def test_parse_memory_limit_rejects_nul(build_dir) -> None:
    with pytest.raises(GpuvisorError, match="NUL"):
        parse_memory_limit("4g\0junk")


def test_a_value_that_is_not_utf8_is_a_clear_error(node) -> None:
    """Linux variables hold bytes; Python gives a non-UTF-8 one to os.environ
    with surrogates.  Such a limit used to escape as UnicodeEncodeError
    (parse_memory_limit) or UnicodeDecodeError of the library's own message
    (validate_environment, so `gpuvisor run` died with a traceback) instead
    of the one-line GpuvisorError naming the variable."""
    bad = os.fsdecode(b"4\xffg")
    code = f"""
from gpuvisor.shim.limits import validate_environment
emit(**errors_of({{
    "parse": lambda: parse_memory_limit({bad!r}),
    "env": validate_environment,
}}))
"""
    out = run_json(API + code, {**node.env, "CUDA_DEVICE_MEMORY_LIMIT": bad})
    assert out["parse"][0] == "GV_EINVAL"
    assert "not a memory size" in out["parse"][1]
    assert out["env"][0] == "GV_EINVAL"
    assert "CUDA_DEVICE_MEMORY_LIMIT=" in out["env"][1]
    assert "not a memory size" in out["env"][1]


def test_a_value_with_a_newline_is_quoted_on_one_line(node) -> None:
    """The messages quoted a bad value as it was: one with a newline in it
    made the library's stderr line stop at the newline,
    'gpuvisor[pid]: CUDA_DEVICE_MEMORY_LIMIT="4' and no reason, and the
    Python error span two lines.  Control characters are now escaped."""
    shimmed = run_py(
        "from tests.cuclient import *\nemit(init=call(cu.cuInit, 0)[0].name)\n",
        {**node.env, "LD_PRELOAD": str(library_path()), "CUDA_DEVICE_MEMORY_LIMIT": "4\ng"},
    )
    assert json.loads(shimmed.stdout) == {"init": "CUDA_ERROR_NOT_PERMITTED"}
    lines = shimmed.stderr.splitlines()
    assert any(
        'CUDA_DEVICE_MEMORY_LIMIT="4\\ng": not a memory size' in line
        and line.endswith("CUDA_ERROR_NOT_PERMITTED")
        for line in lines
    ), shimmed.stderr
    with pytest.raises(GpuvisorError) as info:
        parse_memory_limit("4\ng\t\x7f")
    assert "\n" not in str(info.value)
    assert 'memory limit "4\\ng\\t\\x7f": not a memory size' in str(info.value)


# --- the region ---------------------------------------------------------------


def api(node: SimNode, code: str):
    return run_json(API + code, node.env)


def attach_error(node: SimNode, path: Path | None = None) -> list[str] | None:
    """None if the region at path (None: the node's) attaches, else the
    GpuvisorError's [code name, str()]."""
    where = repr(str(path)) if path else ""
    err: list[str] | None = api(
        node, f"emit(**errors_of({{'err': lambda: Region.attach({where})}}))"
    )["err"]
    return err


def test_attach_register_and_limits(node) -> None:
    out = api(
        node,
        f"""
r = Region.attach({str(node.region)!r})
i0 = r.register_device({UUID0!r}, 16 << 30, 4 << 30)
i1 = r.register_device({UUID1!r}, 24 << 30, None)
again = r.register_device({UUID0!r}, 16 << 30, 4 << 30)
before = [d.__dict__ for d in r.devices()]
r.set_limit(0, 8 << 30)
r.set_limit(1, 2 << 30)
mid = (r.get_limit(0), r.get_limit(1))
r.set_limit(0, None)
emit(path=str(r.path), i=[i0, i1, again], before=before, mid=mid,
     after=r.get_limit(0), used=r.used(0), procs=r.processes())
""",
    )
    assert out["path"] == str(node.region)
    assert node.region.is_file()
    assert out["i"] == [0, 1, 0]
    assert out["before"] == [
        {
            "index": 0,
            "uuid": UUID0,
            "limit": 4 * GiB,
            "used": 0,
            "physical_total": 16 * GiB,
            "oom_count": 0,
            "context_cost": 0,
            "spilled": 0,
            "guarantee": 0,
        },
        {
            "index": 1,
            "uuid": UUID1,
            "limit": None,
            "used": 0,
            "physical_total": 24 * GiB,
            "oom_count": 0,
            "context_cost": 0,
            "spilled": 0,
            "guarantee": 0,
        },
    ]
    assert out["mid"] == [8 * GiB, 2 * GiB]
    assert out["after"] is None
    assert out["used"] == 0


def test_the_largest_limit_the_parser_gives_can_be_set(node) -> None:
    """The C parser (and gv_device_set_limit) accept 18446744073709551615
    bytes, GV_UNLIMITED; Region.set_limit and register_device refused that
    very figure, so a `node-agent set-limit --memory 18446744073709551615`
    the agent acked was never applied and the old, tighter limit stayed."""
    out = api(
        node,
        f"""
top = parse_memory_limit("18446744073709551615")
r = Region.attach()
i = r.register_device({UUID0!r}, 16 << 30, 4 << 30)
r.set_limit(i, top)
after_set = r.get_limit(i)
j = r.register_device({UUID1!r}, 16 << 30, top)
emit(top=top, after_set=after_set, registered=r.get_limit(j))
""",
    )
    assert out == {"top": 2**64 - 1, "after_set": None, "registered": None}


def test_attach_default_path_from_env(node) -> None:
    out = api(node, "emit(path=str(Region.attach().path))")
    assert out["path"] == str(node.region)


def test_attach_elsewhere_is_refused(node, tmp_path) -> None:
    out = api(
        node,
        f"""
Region.attach({str(node.region)!r})
Region.attach({str(node.region)!r})  # same path again: fine
try:
    Region.attach({str(tmp_path / "other.shr")!r})
    emit(code=None)
except GpuvisorError as e:
    emit(code=e.code_name)
""",
    )
    assert out["code"] == "GV_EINVAL"


def test_bad_arguments_raise(node) -> None:
    out = api(
        node,
        """
r = one_device(None)
emit(**errors_of({
    "no-device": lambda: r.device(5),
    "limit-no-device": lambda: r.set_limit(7, 1 << 30),
    "limit-zero": lambda: r.set_limit(0, 0),
    "bad-uuid": lambda: r.register_device("not-a-uuid", 1 << 30, None),
    "no-pid": lambda: r.process_used(999999999, 0),
}))
""",
    )
    for name, err in out.items():
        assert err is not None, f"{name} did not raise"
        assert err[1], name
    assert out["limit-zero"][0] == "GV_EINVAL"
    assert out["no-device"][0] in ("GV_ENOENT", "GV_EINVAL")


def test_an_index_outside_c_int_is_refused_not_wrapped(node) -> None:
    """ctypes wraps a Python int into a C int modulo 2^32 without a word:
    set_limit(2**32, ...) used to change device 0's limit, device(2**32)
    reported device 0 under index 4294967296, and a pid of 2**32 + p read
    process p's usage."""
    out = api(
        node,
        """
import os
r = one_device(4 << 30)
errors = errors_of({
    "set-limit": lambda: r.set_limit(1 << 32, 1 << 30),
    "device": lambda: r.device(1 << 32),
    "negative": lambda: r.get_limit(-(1 << 32)),
    "bool": lambda: r.used(True),
    "sm-limit": lambda: r.set_sm_limit(1 << 32, 50),
    "yield": lambda: r.set_sm_yield(1 << 32, 1),
    "others": lambda: r.set_sm_others(1 << 32, 50),
    "pid": lambda: r.process_used((1 << 32) + os.getpid(), 0),
})
emit(errors=errors, limit=r.get_limit(0), sm=r.sm(0).limit, others=r.sm_others(0)[1])
""",
    )
    for name, err in out["errors"].items():
        assert err is not None, f"{name} did not raise"
    assert "4294967296" in out["errors"]["device"][1]
    assert str(1 << 32) in out["errors"]["set-limit"][1]
    assert out["limit"] == 4 * GiB  # device 0 untouched
    assert out["sm"] is None
    assert out["others"] is None


def test_a_yield_is_a_lease_of_at_most_60_s(node) -> None:
    """A yield lasts the lease given, 60 s at most: a longer one (or a bare
    True, which used to mean "until cleared") is refused, naming the value,
    in Python and in C."""
    out = api(
        node,
        """
from gpuvisor.shim.capi import lib
r = one_device(4 << 30)
errors = errors_of({
    "long": lambda: r.set_sm_yield(0, 61),
    "bool": lambda: r.set_sm_yield(0, True),
    "negative": lambda: r.set_sm_yield(0, -1),
    "nan": lambda: r.set_sm_yield(0, float("nan")),
    "max": lambda: r.set_sm_yield(0, 60),
    "clear": lambda: r.set_sm_yield(0, 0),
})
rc = lib().gv_device_set_sm_yield(0, 60001)
emit(errors=errors, rc=rc, c_error=lib().gv_last_error().decode())
""",
    )
    errors = out["errors"]
    assert errors["long"] == ["GV_EINVAL", "gpuvisor: yield seconds=61 is not 0..60 (GV_EINVAL)"]
    assert errors["bool"] == ["GV_EINVAL", "gpuvisor: yield seconds=True is not 0..60 (GV_EINVAL)"]
    assert errors["negative"][0] == errors["nan"][0] == "GV_EINVAL"
    assert errors["max"] is None
    assert errors["clear"] is None
    assert out["rc"] == GV_EINVAL
    assert out["c_error"] == "gpuvisor: gv_device_set_sm_yield: lease_ms=60001: more than 60000 ms"


def test_attach_a_path_that_is_not_utf8(node, tmp_path) -> None:
    """A Linux path is bytes.  The library attached (and created) such a
    region, then Region.attach decoded its path strictly and raised
    UnicodeDecodeError, with the file left behind."""
    path = os.fsdecode(os.fsencode(tmp_path) + b"/r\xff.shr")
    code = f"""
import os
r = Region.attach({path!r} if os.environ.get("BY_ARG") else None)
emit(same=r.path == __import__("pathlib").Path({path!r}), exists=r.path.is_file())
"""
    by_env = run_json(API + code, {**node.env, "CUDA_DEVICE_MEMORY_SHARED_CACHE": path})
    by_arg = run_json(API + code, {**node.env, "BY_ARG": "1"})
    assert by_env == by_arg == {"same": True, "exists": True}


def test_attach_bad_path_names_it(node, tmp_path) -> None:
    bad = tmp_path / "no-such-dir" / "region.shr"
    err = attach_error(node, bad)
    assert err is not None
    assert err[0] == "GV_EIO"
    assert str(bad) in err[1]


def test_attach_a_dangling_symlink_says_so(node, tmp_path) -> None:
    """A region path that is a symbolic link to a missing file cannot be
    created (link() finds the name taken) nor opened: the attach tried 16
    times and then reported "open: File exists", leaving the reader to
    guess which file exists."""
    target = tmp_path / "gone" / "region.shr"
    link = tmp_path / "region-link.shr"
    link.symlink_to(target)
    err = attach_error(node, link)
    assert err == [
        "GV_EIO",
        f"gpuvisor: region {link}: a symbolic link to {target}, which does not exist (GV_EIO)",
    ]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("region-link.shr.")]


@pytest.mark.parametrize(
    "content",
    [b"garbage" * 1000, b"", b"\0" * 4096, b"GVPVSH1\0" + b"\xff" * 64],
    ids=["garbage", "empty", "zeros", "short"],
)
def test_attach_corrupt_region_names_it(node, content) -> None:
    node.region.write_bytes(content)
    err = attach_error(node)
    assert err is not None
    assert err[0] == "GV_ECORRUPT"
    assert str(node.region) in err[1]


def test_processes_usage_and_reclaim(node) -> None:
    holder_code = """
from tests.cuclient import *
init()
p = ok(cu.cuMemAlloc, 1 * GiB)
hold(used=used())
"""
    query = """
r = Region.attach()
pids = r.processes()
emit(pids=pids, devs=[d.__dict__ for d in r.devices()],
     per_pid={p: r.process_used(p, 0) for p in pids})
"""
    holder = Holder(holder_code, node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="4g"))
    with holder as held:
        live = api(node, query)
        holder.kill()  # SIGKILL: its slot stays behind until reclaimed
        dead = api(node, query)
        reclaimed = api(
            node,
            "r = Region.attach()\nn = r.reclaim_dead()\n"
            "emit(n=n, pids=r.processes(), used=r.used(0))",
        )
    assert held["used"] == SIM_CONTEXT + 1 * GiB
    assert live["pids"] == [holder.pid]
    dev = live["devs"][0]
    assert dev["limit"] == 4 * GiB
    assert dev["physical_total"] == 16 * GiB
    assert dev["used"] == held["used"]
    assert live["per_pid"] == {str(holder.pid): held["used"]}
    # Nothing reclaims a dead slot behind the caller's back.
    assert dead["pids"] == [holder.pid]
    assert reclaimed == {"n": 1, "pids": [], "used": 0}


def test_oom_count_counts_each_refused_allocation(node) -> None:
    out = run_json(
        """
from tests.cuclient import *
from gpuvisor.shim import Region
init()
errs = [call(cu.cuMemAlloc, 8 * GiB)[0].name for _ in range(3)]
emit(errs=errs, oom=Region.attach().device(0).oom_count)
""",
        node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="4g"),
    )
    assert out == {"errs": ["CUDA_ERROR_OUT_OF_MEMORY"] * 3, "oom": 3}


def test_shim_info_survives_a_process_that_leaves_while_listed(node) -> None:
    """shim-info lists the region's PIDs, then asks each one's usage: a
    process that exits in between (its slot is given back at exit) made the
    whole command fail with "pid N is not registered".  The child stands a
    listed-but-gone process in for that moment."""
    code = f"""
import sys
from gpuvisor.shim import Region
from gpuvisor.shim.cli import main
r = Region.attach()
r.register_device({UUID0!r}, 16 << 30, 4 << 30)
listed = Region.processes
Region.processes = lambda self: listed(self) + [999999]  # exited after the listing
main(sys.argv[1:])
"""
    proc = run_py(code, node.env, args=["shim-info", "--json"])
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert [(d["uuid"], d["processes"]) for d in info["devices"]] == [(UUID0, [])]


def test_shim_info_cli(node) -> None:
    cli = "from gpuvisor.shim.cli import main; main()"
    missing = run_py(cli, node.env, args=["shim-info", "--json"])
    assert missing.returncode == 0, missing.stderr
    assert json.loads(missing.stdout)["region_exists"] is False
    assert not node.region.exists()  # reading never creates the region
    api(node, f"Region.attach().register_device({UUID0!r}, 16 << 30, 4 << 30); emit()")
    proc = run_py(cli, node.env, args=["shim-info", "--json"])
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["region"] == str(node.region)
    assert info["library"].endswith("libgpuvisor.so")
    assert [(d["uuid"], d["limit"], d["used"]) for d in info["devices"]] == [(UUID0, 4 * GiB, 0)]
    table = run_py(cli, node.env, args=["shim-info"])
    assert UUID0 in table.stdout
    node.region.write_bytes(b"garbage" * 100)
    bad = run_py(cli, node.env, args=["shim-info"])
    assert bad.returncode != 0
    assert str(node.region) in bad.stderr


@pytest.mark.parametrize("delta", [-1, 1, 4096], ids=["short", "long", "long-page"])
def test_attach_region_of_the_wrong_size_says_which_way(node, delta) -> None:
    """A region file whose size is not its header's total, smaller or larger,
    is refused with one line naming the path, the size found and the size
    expected, and which way it is off (a larger file is not "truncated")."""
    api(node, "Region.attach()\nemit()")
    expected = node.region.stat().st_size
    with node.region.open("r+b") as f:
        f.truncate(expected + delta)
    err = attach_error(node)
    way = "small" if delta < 0 else "large"
    assert err == [
        "GV_ECORRUPT",
        f"gpuvisor: region {node.region}: file is {expected + delta} bytes, "
        f"expected {expected} (too {way}) (GV_ECORRUPT)",
    ]


ENV_DEVICE_LIMITS = """
import json, sys
import pynvml
from gpuvisor.shim.capi import GpuvisorError
from gpuvisor.shim.limits import env_device_limits
pynvml.nvmlInit()
uuids = [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(2)]
uuids = [u.decode() if isinstance(u, bytes) else u for u in uuids]
uuids.append("GPU-00000000-1111-2222-3333-444444444444")  # not on this node
out = {}
for name, env in json.loads(sys.argv[1]).items():
    row = []
    for u in uuids:
        try:
            d = env_device_limits(env, u, 16 << 30)
            row.append([d.ordinal, d.memory, d.sm, bool(d.why_unknown)])
        except GpuvisorError as exc:
            row.append(exc.code_name)
    out[name] = row
print(json.dumps(out))
"""


def test_env_device_limits_are_the_ones_of_the_devices_cuda_ordinal(node: SimNode) -> None:
    """gv_env_device_limits: what a process of the container with that
    environment configures a device with at its first CUDA use, found by
    the device's UUID: its CUDA ordinal through the environment's
    CUDA_VISIBLE_DEVICES (not the caller's), the per-device variable of
    that ordinal else the plain one, a percentage of the size given, no SM
    limit under GPU_CORE_UTILIZATION_POLICY=disable.  A device whose
    ordinal cannot be known gets the strictest limits the environment gives
    any ordinal (ordinal None); a malformed value is GV_EINVAL."""
    G = GiB
    envs = {
        "plain": {"CUDA_DEVICE_MEMORY_LIMIT": "3g", "CUDA_DEVICE_SM_LIMIT": "40"},
        "per-device": {
            "CUDA_DEVICE_MEMORY_LIMIT_0": "25%",
            "CUDA_DEVICE_MEMORY_LIMIT": "3g",
            "CUDA_DEVICE_SM_LIMIT_1": "10",
        },
        "reordered": {
            "CUDA_VISIBLE_DEVICES": "1,0",
            "CUDA_DEVICE_MEMORY_LIMIT_0": "2g",
            "CUDA_DEVICE_SM_LIMIT_0": "50",
            "CUDA_DEVICE_SM_LIMIT_1": "20",
        },
        "hidden": {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_SM_LIMIT_0": "50"},
        "disabled": {"CUDA_DEVICE_SM_LIMIT_0": "30", "GPU_CORE_UTILIZATION_POLICY": "Disable"},
        "malformed": {"CUDA_DEVICE_SM_LIMIT_1": "abc"},
    }
    # The caller's own environment hides device 1 and limits everything:
    # only the environment passed counts.
    # node.env: the caller runs without the library.
    caller = dict(node.env, CUDA_VISIBLE_DEVICES="0", CUDA_DEVICE_SM_LIMIT="5")
    got = run_json(ENV_DEVICE_LIMITS, caller, args=[json.dumps(envs)])
    assert got["plain"] == [[0, 3 * G, 40, False], [1, 3 * G, 40, False], [None, 3 * G, 40, True]]
    assert got["per-device"] == [
        [0, 4 * G, None, False],
        [1, 3 * G, 10, False],
        [None, 3 * G, 10, True],
    ]
    assert got["reordered"] == [
        [1, None, 20, False],
        [0, 2 * G, 50, False],
        [None, 2 * G, 20, True],
    ]
    strict = [None, None, 50, True]
    assert got["hidden"] == [strict, [0, None, 50, False], strict]
    assert got["disabled"] == [
        [0, None, None, False],
        [1, None, None, False],
        [None, None, None, True],
    ]
    assert got["malformed"] == ["GV_EINVAL"] * 3


ENV_SM_SETTINGS = r"""
import ctypes, json, sys
from gpuvisor.shim.capi import GpuvisorError, lib
from gpuvisor.shim.limits import env_sm_settings
out = {}
for name, env in json.loads(sys.argv[1]).items():
    try:
        got = env_sm_settings(env)
        out[name] = [got.policy, got.priority]
    except GpuvisorError as exc:
        out[name] = [exc.code_name, exc.message]
out["null outputs"] = lib().gv_env_sm_settings(None, None, None)
print(json.dumps(out))
"""


def test_env_sm_settings_are_read_by_the_librarys_rules(node: SimNode) -> None:
    """gv_env_sm_settings: the policy and priority an environment gives,
    from the environment passed only (the caller's own says best-effort and
    priority 0): GPUVISOR_SM_POLICY in any case, fixed-share when unset or
    under GPU_CORE_UTILIZATION_POLICY=force or disable; CUDA_TASK_PRIORITY
    0 only when "0".  A malformed value is GV_EINVAL with one line naming
    the variable and the value; NULL outputs are GV_EINVAL."""
    envs = {
        "empty": {},
        "burst": {"GPUVISOR_SM_POLICY": "Burst-Share", "CUDA_TASK_PRIORITY": "0"},
        "best-effort low": {"GPUVISOR_SM_POLICY": "best-effort", "CUDA_TASK_PRIORITY": "1"},
        "forced": {"GPUVISOR_SM_POLICY": "burst-share", "GPU_CORE_UTILIZATION_POLICY": "force"},
        "disabled": {"GPUVISOR_SM_POLICY": "best-effort", "GPU_CORE_UTILIZATION_POLICY": "DISABLE"},
        "default": {"GPUVISOR_SM_POLICY": "best-effort", "GPU_CORE_UTILIZATION_POLICY": "default"},
        "priority empty": {"CUDA_TASK_PRIORITY": ""},
        "bad policy": {"GPUVISOR_SM_POLICY": "burst"},
        "bad priority": {"CUDA_TASK_PRIORITY": "2"},
        "bad limit": {"CUDA_DEVICE_SM_LIMIT": "101"},
    }
    # node.env: the caller runs without the library.
    caller = dict(node.env, GPUVISOR_SM_POLICY="best-effort", CUDA_TASK_PRIORITY="0")
    got = run_json(ENV_SM_SETTINGS, caller, args=[json.dumps(envs)])
    assert got["empty"] == ["fixed-share", 1]
    assert got["burst"] == ["burst-share", 0]
    assert got["best-effort low"] == ["best-effort", 1]
    assert got["forced"] == ["fixed-share", 1]
    assert got["disabled"] == ["fixed-share", 1]
    assert got["default"] == ["best-effort", 1]
    assert got["priority empty"] == ["fixed-share", 1]
    for name, var, value in (
        ("bad policy", "GPUVISOR_SM_POLICY", "burst"),
        ("bad priority", "CUDA_TASK_PRIORITY", "2"),
        ("bad limit", "CUDA_DEVICE_SM_LIMIT", "101"),
    ):
        code, message = got[name]
        assert code == "GV_EINVAL"
        assert var in message, message
        assert value in message, message
        assert "\n" not in message, message
    assert got["null outputs"] == GV_EINVAL


ENV_LIMITS_THEN_SHUTDOWN = r"""
import pynvml
from gpuvisor.shim.limits import env_device_limits
pynvml.nvmlInit()
uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
for _ in range(5):
    assert env_device_limits({"CUDA_DEVICE_SM_LIMIT": "30"}, uuid, 16 << 30).ordinal == 0
pynvml.nvmlShutdown()
try:
    pynvml.nvmlDeviceGetCount()
except pynvml.NVMLError_Uninitialized:
    print("shut down")
else:
    print("still initialised")
"""


def test_env_device_limits_leave_nvml_as_the_caller_had_it(node: SimNode) -> None:
    """NVML counts its initialisations: gv_env_device_limits reads NVML's
    device list with an initialisation of its own and gives it back, so a
    caller's nvmlShutdown after any number of calls still shuts NVML down
    (each call left one behind before, and NVML stayed up)."""
    proc = run_py(ENV_LIMITS_THEN_SHUTDOWN, node.env)  # without the library
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "shut down"
