"""File-system helpers of the disk tier: opening only regular files, making its directory.

A block's name in a shared directory may hold anything another process put there. Opening
a FIFO for reading blocks until a writer comes, and opening a device may have effects of
its own, so a block is read only from a regular file, checked before and after the open.
"""

from __future__ import annotations

import contextlib
import os
import stat
from typing import BinaryIO


def open_regular(path: str) -> BinaryIO | None:
    """`path` open for reading if it is a regular file, else None (never blocks).

    The stat spares a device the open; O_NONBLOCK keeps a FIFO that appears in between from
    blocking it; the fstat checks what was actually opened. OSError as open() raises it.
    """
    if not stat.S_ISREG(os.stat(path).st_mode):
        return None
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def make_directory(path: str) -> None:
    """Create the tier's directory; a ValueError says why it cannot be one."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{path} is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot create the directory {path}: {reason(exc)}") from None


def reason(exc: OSError) -> str:
    """ "permission denied", not "[Errno 13] Permission denied: '/x'"."""
    if isinstance(exc, NotADirectoryError | FileExistsError):
        return "a part of the path is a file, not a directory"
    return (exc.strerror or str(exc)).lower()


def unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
