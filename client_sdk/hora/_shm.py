"""Names of a job's shared-memory segments, shared by the engine and horarun.

The control mesh of every worker names its segments in /dev/shm after the
job (see ``hora_native.mesh_transport``). A segment is unlinked once every peer has
mapped it, but a worker killed in between leaves its file behind; horarun
removes what is left of its job's files when the job ends. No torch here:
horarun imports this.
"""

from __future__ import annotations

import os
import re

__all__ = ["SHM_DIR", "job_tag", "remove_leftovers", "segment_prefix"]

SHM_DIR = "/dev/shm"


def job_tag(job_id: str) -> str:
    """The part of a segment's file name that names the job (file-name safe)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", job_id)


def segment_prefix(job_id: str, directory: str = SHM_DIR) -> str:
    """The path every shared segment file of the job starts with."""
    return os.path.join(directory, f"hora-{job_tag(job_id)}-")


def remove_leftovers(job_id: str, directory: str = SHM_DIR) -> list[str]:
    """Unlinks the job's segment files still in ``directory``; returns their names."""
    prefix = os.path.basename(segment_prefix(job_id, directory))
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(directory, name))
                removed.append(name)
            except OSError:
                pass
    return removed
