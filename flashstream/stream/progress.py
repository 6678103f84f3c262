"""What the process that made a stream and its DataLoader workers tell each other.

Workers iterate copies of the stream, made when the DataLoader starts them (or once, with
``persistent_workers``), so neither side sees the other's later calls. Three small shared
files (``/dev/shm`` where it exists), made by the creating process and removed when that
object is collected, carry what must cross anyway; workers, forked or spawned, open them by
path:

- :class:`WorkerMarks`: the last epoch a worker started, so that the main process refuses
  ``state_dict()`` instead of returning a stale position;
- the epoch last set with ``set_epoch`` in the main process, so that persistent workers read
  the epoch the main process is in;
- which pass consumed a loaded state, so that a state resumes one pass only (every worker of
  that pass), not each later pass that copies the main process's stream.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import weakref
from typing import Dict, Optional

__all__ = ["SharedNote", "WorkerMarks"]


def _unlink(path: str, owner_pid: int) -> None:
    if os.getpid() == owner_pid:
        with contextlib.suppress(OSError):
            os.unlink(path)


class SharedNote:
    """A line of text shared through a small file; replaced whole, so a reader never sees half
    a write. Failures are ignored: only safety checks depend on it."""

    def __init__(self, path: Optional[str] = None) -> None:
        if path is None:
            directory = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
            fd, path = tempfile.mkstemp(prefix="flashstream-note-", dir=directory)
            os.close(fd)
            weakref.finalize(self, _unlink, path, os.getpid())
        self.path = path

    def __getstate__(self) -> Dict[str, str]:
        return {"path": self.path}

    def __setstate__(self, state: Dict[str, str]) -> None:
        self.path = state["path"]  # a worker's copy never removes the file

    def write(self, text: str) -> None:
        directory = os.path.dirname(self.path)
        try:
            fd, temp = tempfile.mkstemp(prefix=".flashstream-note-", dir=directory)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(temp, self.path)
        except OSError:
            with contextlib.suppress(OSError, UnboundLocalError):
                os.unlink(temp)

    def read(self) -> str:
        try:
            with open(self.path) as f:
                return f.read().strip()
        except OSError:
            return ""


class WorkerMarks(SharedNote):
    """The last epoch any DataLoader worker of this stream started iterating."""

    def mark(self, epoch: int) -> None:
        self.write(str(epoch))

    def last(self) -> Optional[int]:
        text = self.read()
        return int(text) if text.isdigit() else None
