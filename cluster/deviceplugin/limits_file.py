"""The limits file a container reads (GPUVISOR_LIMITS_FILE,
docs/environment.md): its grant rendered in the limit variables' grammar,
written atomically."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .gpus import Gpu
from .grant import ContainerGrant, GrantError

FILE_NAME = "limits.env"


def render(pod: str, grant: ContainerGrant, visible: Sequence[Gpu]) -> str:
    """The file's text for grant, whose container sees visible (in this
    order: its CUDA ordinals).  Plain variables when every GPU has the same
    limits (they then hold whatever ordinals the container sees), else one
    per ordinal.  GrantError when the grant is not for exactly these GPUs.
    A GPU placed as a MIG instance is seen as that instance (its MIG device
    in CUDA_VISIBLE_DEVICES): the instance's memory, and no SM limit."""
    by_uuid = {g.uuid: g for g in grant.gpus}
    got = [g.uuid for g in visible]
    if sorted(by_uuid) != sorted(got) or len(grant.gpus) != len(by_uuid):
        raise GrantError(
            f"pod {pod} container {grant.name}: kubelet gave it GPUs {got} but its allocation "
            f"places it on {[g.uuid for g in grant.gpus]}"
        )
    lines = [f"# gpuvisor device-plugin: pod {pod}, container {grant.name}"]
    # On a MIG device the memory is the instance's and the SMs are its own:
    # no share of time is taken from them (0: no limit).
    limits = [
        (by_uuid[u].memory_mib, 0 if by_uuid[u].mig is not None else by_uuid[u].cores) for u in got
    ]
    if len(set(limits)) == 1:
        mem, cores = limits[0]
        lines += [f"CUDA_DEVICE_MEMORY_LIMIT={mem}m", f"CUDA_DEVICE_SM_LIMIT={cores}"]
    else:
        for i, (mem, cores) in enumerate(limits):
            lines += [f"CUDA_DEVICE_MEMORY_LIMIT_{i}={mem}m", f"CUDA_DEVICE_SM_LIMIT_{i}={cores}"]
    if grant.sm_policy is not None:
        lines.append(f"GPUVISOR_SM_POLICY={grant.sm_policy}")
    if grant.priority is not None:
        lines.append(f"CUDA_TASK_PRIORITY={grant.priority}")
    return "\n".join(lines) + "\n"


def write(directory: Path, text: str) -> Path:
    """Write text as directory/limits.env atomically (mode 0644)."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".limits-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, directory / FILE_NAME)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return directory / FILE_NAME
