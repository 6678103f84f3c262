"""One writer per rank and checkpoint directory: a lock file the kernel releases on exit."""

from __future__ import annotations

import errno
import fcntl
import os
import warnings
from pathlib import Path
from typing import Union

__all__ = ["WriterLock"]

PathLike = Union[str, os.PathLike]


class WriterLock:
    """One writer per rank and directory: an exclusive ``flock`` on
    ``<directory>/.writer-rank-NNNNN.lock`` for as long as the writer lives. Two writers of one
    rank would delete each other's temporary files, replace each other's committed files and
    prune each other's steps; the second is refused instead. The kernel drops the lock when its
    process dies (even by SIGKILL), so a crash never leaves the directory locked."""

    def __init__(self, directory: PathLike, rank: int) -> None:
        self._fd = -1
        self.path = Path(directory) / f".writer-rank-{rank:05d}.lock"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                if err.errno in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL):
                    warnings.warn(f"{directory}: this filesystem does not lock files "
                                  f"({os.strerror(err.errno)}); nothing stops a second writer "
                                  f"of rank {rank} here", stacklevel=3)
                    self._fd = fd
                    return
                os.close(fd)
                raise
            holder = os.pread(fd, 64, 0).decode("utf-8", "replace").strip()
            os.close(fd)
            raise RuntimeError(
                f"{directory}: another CheckpointWriter ({holder or 'another process'}) is "
                f"writing rank {rank} here; two writers of one rank would replace and prune "
                f"each other's checkpoints (close the other, or use another directory)"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # the lock goes with the descriptor; the file stays
            self._fd = -1

    def __del__(self) -> None:  # a writer dropped without close() frees its rank
        self.release()
