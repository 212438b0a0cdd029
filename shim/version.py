"""What is installed: the Python package's release and the loaded library's
release and build id, and the one warning when the two releases differ."""

from __future__ import annotations

import importlib.metadata
import sys
import threading
from dataclasses import dataclass

from .capi import lib
from .loader import library_path

DISTRIBUTION = "gpuvisor"
UNKNOWN = "unknown"

_warned = threading.Event()


def package_version() -> str:
    """The gpuvisor Python package's release, or "unknown" when it is run
    from a source tree that was never installed."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return UNKNOWN


@dataclass(frozen=True)
class LibraryVersion:
    path: str
    version: str  # gv_version(): the release it was built from
    build_id: str  # gv_build_id(): the hash of the file's contents

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path, "version": self.version, "build_id": self.build_id}


def library_version() -> LibraryVersion:
    """The loaded libgpuvisor.so's release and build id (GpuvisorError when
    it cannot be loaded)."""
    handle = lib()
    return LibraryVersion(
        path=str(library_path()),
        version=handle.gv_version().decode(errors="replace"),
        build_id=handle.gv_build_id().decode(errors="replace"),
    )


def mismatch(package: str, library: LibraryVersion) -> str | None:
    """One line when the package and the library are different releases."""
    if package == UNKNOWN or package == library.version:
        return None
    return (
        f"gpuvisor: warning: the Python package is release {package} but {library.path} "
        f"is release {library.version}; install matching releases"
    )


def warn_on_mismatch() -> None:
    """Print the mismatch line once per process, on stderr."""
    if _warned.is_set():
        return
    line = mismatch(package_version(), library_version())
    _warned.set()
    if line:
        print(line, file=sys.stderr, flush=True)


def build_info() -> dict[str, object]:
    """The package's release and the library's (None when it cannot be
    loaded), as `shim-info`, `status` and the node agent's /status show them."""
    from .capi import GpuvisorError
    from .loader import NativeLibraryNotFound

    try:
        library: dict[str, str] | None = library_version().as_dict()
    except (GpuvisorError, NativeLibraryNotFound):
        library = None
    return {"version": package_version(), "library": library}
