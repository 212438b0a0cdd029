"""Regenerate the Python modules of this directory's .proto files.

    python -m gpuvisor.cluster.deviceplugin.api.generate    (make protos)

The generated modules are committed, so that the runtime needs only grpcio
and protobuf; this needs grpcio-tools (the `test` extra, pinned to the
version the committed files came from).  tests/test_deviceplugin_proto.py
regenerates into a temporary directory and compares the bytes."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = ("deviceplugin_v1beta1.proto", "podresources_v1.proto")
# The import path the generated modules use for each other.
PACKAGE_PATH = "gpuvisor/cluster/deviceplugin/api"


def generate(out_dir: Path) -> list[Path]:
    """Compile PROTOS into out_dir (flat); the generated files' paths."""
    from grpc_tools import protoc  # the test extra

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PACKAGE_PATH}={HERE}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(f"{PACKAGE_PATH}/{p}" for p in PROTOS),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        made = []
        for f in sorted((Path(tmp) / PACKAGE_PATH).iterdir()):
            dest = out_dir / f.name
            shutil.copyfile(f, dest)
            made.append(dest)
        return made


if __name__ == "__main__":
    for path in generate(HERE):
        sys.stdout.write(f"wrote {path}\n")
