"""Locate the native libraries and build environments that preload the shim.

Search order for the native directory:

1. ``$GPUVISOR_NATIVE_DIR`` (a make build directory or an installed
   ``_native`` directory; empty counts as unset);
2. the package's own ``_native/`` (wheels and ``pip install .``);
3. the repository's ``build/`` next to the source tree (editable installs).

A build directory keeps the simulated driver in ``sim/``; the installed
``_native/`` keeps it next to ``libgpuvisor.so``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

LIBRARY_NAME = "libgpuvisor.so"
SIM_CUDA_NAME = "libcuda.so.1"
SIM_NVML_NAME = "libnvidia-ml.so.1"
NATIVE_DIR_ENV = "GPUVISOR_NATIVE_DIR"

_PACKAGE_DIR = Path(__file__).resolve().parent


class NativeLibraryNotFound(FileNotFoundError):
    """The native libraries are missing (not built, or a bad GPUVISOR_NATIVE_DIR)."""


def _candidates() -> list[Path]:
    return [_PACKAGE_DIR / "_native", _PACKAGE_DIR.parent / "build"]


def native_dir() -> Path:
    """Directory holding libgpuvisor.so."""
    # Set but empty counts as unset (as for every other variable); Path("")
    # would be the current directory.
    override = os.environ.get(NATIVE_DIR_ENV)
    if override:
        path = Path(override)
        if not (path / LIBRARY_NAME).is_file():
            raise NativeLibraryNotFound(
                f"gpuvisor: {NATIVE_DIR_ENV}={override!r} has no {LIBRARY_NAME}"
            )
        return path.resolve()
    for path in _candidates():
        if (path / LIBRARY_NAME).is_file():
            return path
    raise NativeLibraryNotFound(
        f"gpuvisor: {LIBRARY_NAME} not found; run make or set {NATIVE_DIR_ENV}"
    )


def library_path() -> Path:
    """Absolute path of libgpuvisor.so."""
    return native_dir() / LIBRARY_NAME


def simulator_dir() -> Path:
    """Directory holding the simulated libcuda.so.1 and libnvidia-ml.so.1."""
    base = native_dir()
    for path in (base / "sim", base):
        if (path / SIM_CUDA_NAME).is_file() and (path / SIM_NVML_NAME).is_file():
            return path
    raise NativeLibraryNotFound(
        f"gpuvisor: simulated driver ({SIM_CUDA_NAME}) not found in {base}; "
        f"run make sim or set {NATIVE_DIR_ENV}"
    )


def _listable(path: Path, variable: str, seps: str) -> str:
    """path as an entry of a list variable the dynamic linker splits at seps.

    A path with a separator in it would be split and the entry ignored (for
    LD_PRELOAD with a warning only): the workload would run without the
    interposer, unlimited.  Refused instead (fail closed)."""
    text = str(path)
    bad = [c for c in seps if c in text]
    if bad:
        raise NativeLibraryNotFound(
            f"gpuvisor: {variable} cannot hold {text!r} (the dynamic linker splits it at "
            f"{' and '.join(repr(c) for c in bad)}); set {NATIVE_DIR_ENV} to a directory "
            "whose path has none"
        )
    return text


def _prepend(value: str | None, entry: str, sep: str) -> str:
    parts = [p for p in (value or "").split(sep) if p and p != entry]
    return sep.join([entry, *parts])


def preload_env(
    base_env: Mapping[str, str] | None = None, *, simulate: bool = False
) -> dict[str, str]:
    """Return a copy of base_env (default os.environ) that preloads the shim.

    LD_PRELOAD gets libgpuvisor.so first, keeping existing entries; with
    simulate=True, LD_LIBRARY_PATH gets the simulated driver first.
    """
    env = dict(os.environ if base_env is None else base_env)
    # ld.so accepts both spaces and colons in LD_PRELOAD; keep its entries.
    existing = (env.get("LD_PRELOAD") or "").replace(" ", ":")
    lib = _listable(library_path(), "LD_PRELOAD", " :")
    env["LD_PRELOAD"] = _prepend(existing, lib, ":")
    if simulate:
        sim = _listable(simulator_dir(), "LD_LIBRARY_PATH", ":;")
        env["LD_LIBRARY_PATH"] = _prepend(env.get("LD_LIBRARY_PATH"), sim, ":")
    return env
