"""Whether a rank may spin: the cores it may run on, and its control groups' CPU quota.

A container's CPU limit (a Kubernetes pod's ``resources.limits.cpu``) lets a
process use fewer CPUs' worth of time than the cores it may be scheduled on;
ranks that spin while they wait would spend that quota and be throttled
(``hora_native.mesh_poll.cores_for``). One test runs a real process in a
real cgroup with a quota, where this machine lets the test make one; the
other reads a cgroup v2 tree laid out as the kernel shows it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from hora_native.mesh_poll import cores_for, cpu_quota

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

V1_CPU = Path("/sys/fs/cgroup/cpu")

CHILD = """
import os, sys
from hora_native.mesh_poll import cores_for, cpu_quota
with open(os.path.join(sys.argv[1], "tasks"), "w") as f:
    f.write(str(os.getpid()))
affinity = len(os.sched_getaffinity(0))
print(cpu_quota(), cores_for(1), cores_for(2), affinity)
"""


def _v1_writable() -> bool:
    return (os.geteuid() == 0 and (V1_CPU / "cpu.cfs_quota_us").exists()
            and os.access(V1_CPU, os.W_OK))


@pytest.mark.skipif(not _v1_writable(), reason="needs root and a writable cgroup v1 cpu "
                                               "hierarchy at /sys/fs/cgroup/cpu")
def test_a_process_under_a_cfs_quota_counts_the_quota_not_its_cores():
    parent = V1_CPU / f"hora-quota-{uuid.uuid4().hex[:8]}"
    child = parent / "rank"
    try:
        child.mkdir(parents=True)
        # Half a CPU for the parent group; none of its own for the child: the
        # tightest quota up the tree is the one that throttles.
        (parent / "cpu.cfs_period_us").write_text("100000")
        (parent / "cpu.cfs_quota_us").write_text("50000")
        out = subprocess.run([sys.executable, "-c", CHILD, str(child)], capture_output=True,
                             text=True, timeout=30, check=True).stdout.split()
        assert out[0] == "0.5", out
        assert out[1:3] == ["False", "False"], out  # not even one rank spins on half a CPU
        # Without a quota, the cores decide again.
        (parent / "cpu.cfs_quota_us").write_text("-1")
        out = subprocess.run([sys.executable, "-c", CHILD, str(child)], capture_output=True,
                             text=True, timeout=30, check=True).stdout.split()
        assert out[0] == "None", out
        assert out[1] == "True" and out[2] == str(int(out[3]) >= 2), out
    finally:
        for group in (child, parent):
            if group.exists():
                group.rmdir()


def _tree(tmp_path: Path, cgroup: str, mountinfo: list[str]) -> str:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text("\n".join(mountinfo) + "\n")
    return str(proc)


def test_cgroup_v2_quotas_are_read_up_the_tree_from_the_mount_root(tmp_path):
    fs = tmp_path / "unified"
    pod = fs / "kubepods" / "pod1"
    container = pod / "ctr"
    container.mkdir(parents=True)
    (fs / "kubepods" / "cpu.max").write_text("max 100000\n")
    (pod / "cpu.max").write_text("300000 100000\n")  # 3 CPUs for the pod
    (container / "cpu.max").write_text("150000 100000\n")  # 1.5 for the container
    proc = _tree(tmp_path, "0::/kubepods/pod1/ctr\n",
                 [f"30 23 0:27 / {fs} rw,relatime shared:9 - cgroup2 cgroup2 rw"])
    assert cpu_quota(proc) == 1.5
    (container / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(proc) == 3.0  # the pod's, above it
    (pod / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(proc) is None


def test_a_container_sees_its_group_as_the_mount_root(tmp_path):
    # Inside a container the cgroup file system is mounted from the
    # container's own group: the mount's root is that group's path.
    fs = tmp_path / "cpu"
    fs.mkdir()
    (fs / "cpu.cfs_quota_us").write_text("200000\n")
    (fs / "cpu.cfs_period_us").write_text("100000\n")
    proc = _tree(tmp_path, "4:cpu,cpuacct:/docker/abc\n0::/\n",
                 [f"40 31 0:35 /docker/abc {fs} rw,nosuid - cgroup cgroup rw,cpu,cpuacct"])
    assert cpu_quota(proc) == 2.0


def test_no_quota_where_nothing_can_be_read(tmp_path):
    assert cpu_quota(str(tmp_path / "absent")) is None
    proc = _tree(tmp_path, "garbage\n", ["not a mount line", "1 2 3 - cgroup2"])
    assert cpu_quota(proc) is None
    assert cores_for(1)  # this test's own process: at least one core


def test_mount_names_in_any_encoding_and_with_escapes_are_read(tmp_path):
    # mountinfo lists every mount: one named in Latin-1 must not stop the
    # read, and a space in the cgroup mount's own path comes as \040.
    fs = tmp_path / "cg root"
    group = fs / "job"
    group.mkdir(parents=True)
    (group / "cpu.max").write_text("100000 100000\n")
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text("0::/job\n")
    escaped = str(fs).replace(" ", "\\040")
    (proc / "mountinfo").write_bytes(
        b"20 1 8:1 / /media/caf\xe9 rw - vfat /dev/sdb1 rw\n"
        + f"30 23 0:27 / {escaped} rw - cgroup2 cgroup2 rw\n".encode())
    assert cpu_quota(str(proc)) == 1.0


def test_groups_outside_the_mount_root_have_no_quota_here(tmp_path):
    fs = tmp_path / "unified"
    fs.mkdir()
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # above the mount: never read
    (fs / "cpu.max").write_text("max 100000\n")
    # A group above this cgroup namespace's root, and a group beside the
    # mount's root that only shares the start of its name.
    proc = _tree(tmp_path, "0::/../x\n", [f"30 23 0:27 / {fs} rw - cgroup2 cgroup2 rw"])
    assert cpu_quota(proc) is None
    (fs / "2").mkdir()
    (fs / "2" / "cpu.max").write_text("50000 100000\n")
    (tmp_path / "proc" / "cgroup").write_text("0::/docker/abc2\n")
    (tmp_path / "proc" / "mountinfo").write_text(
        f"30 23 0:27 /docker/abc {fs} rw - cgroup2 cgroup2 rw\n")
    assert cpu_quota(proc) is None
