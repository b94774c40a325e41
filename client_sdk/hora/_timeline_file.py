"""The timeline's file operations: unnamed temporary files and in-kernel copies (Linux).

:mod:`hora.timeline` publishes every version of its file through these: a new
file is made beside the target (``O_TMPFILE`` where the file system has it),
the published array is copied into it, and it is renamed over the target.
"""

from __future__ import annotations

import contextlib
import errno
import os

__all__ = ["copy_prefix", "link_tmpfile", "new_file", "pwrite_all"]


def _temp_name(target: str) -> str:
    head, tail = os.path.split(target)
    return os.path.join(head, f".{tail}.{os.getpid()}.hora-tmp")


def new_file(target: str) -> tuple[int, str | None]:
    """An empty file in ``target``'s directory, and its name if it has one.

    An unnamed ``O_TMPFILE`` file when the file system has them, so a killed
    writer leaves nothing behind; otherwise a hidden temporary name.
    """
    directory = os.path.dirname(target) or "."
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o644), None
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise  # a missing or unwritable directory fails the named way too
    name = _temp_name(target)
    return os.open(name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644), name


def link_tmpfile(fd: int, target: str) -> str:
    """Gives the unnamed file ``fd`` a temporary name next to ``target``; returns it."""
    name = _temp_name(target)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name)  # left by a writer killed between this link and its rename
    # CPython calls plain link(2), which does not follow /proc's link to the
    # file, unless a directory fd is given; then it calls linkat(2) with
    # AT_SYMLINK_FOLLOW.
    directory = os.open(os.path.dirname(name) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.link(
            f"/proc/self/fd/{fd}",
            os.path.basename(name),
            dst_dir_fd=directory,
            follow_symlinks=True,
        )
    finally:
        os.close(directory)
    return name


def copy_prefix(src: int, dst: int, count: int) -> None:
    """Copies the first ``count`` bytes of ``src`` to the start of ``dst``, in the kernel."""
    done = 0
    try:
        while done < count:
            copied = os.copy_file_range(src, dst, count - done, done, done)
            if copied == 0:
                break
            done += copied
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
    while done < count:  # no copy_file_range here: through user space
        chunk = os.pread(src, min(count - done, 1 << 20), done)
        if not chunk:
            raise OSError(errno.EIO, f"the published timeline ended at byte {done} of {count}")
        pwrite_all(dst, chunk, done)
        done += len(chunk)


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written
