"""Which epoch DataLoader workers last started, seen from the process that made the stream.

Workers iterate copies of the stream, so the stream in the main process cannot know how far
they got; only the DataLoader (torchdata's StatefulDataLoader) can. This marker lets the main
process refuse ``state_dict()`` in that case instead of returning a stale position. It is a
small file (``/dev/shm`` where it exists) made by the creating process and removed when that
object is collected; workers, forked or spawned, open it by path.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import weakref
from typing import Dict, Optional

__all__ = ["WorkerMarks"]


def _unlink(path: str, owner_pid: int) -> None:
    if os.getpid() == owner_pid:
        with contextlib.suppress(OSError):
            os.unlink(path)


class WorkerMarks:
    """The last epoch any DataLoader worker of this stream started iterating."""

    def __init__(self, path: Optional[str] = None) -> None:
        if path is None:
            directory = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
            fd, path = tempfile.mkstemp(prefix="flashstream-marks-", dir=directory)
            os.close(fd)
            weakref.finalize(self, _unlink, path, os.getpid())
        self.path = path

    def __getstate__(self) -> Dict[str, str]:
        return {"path": self.path}

    def __setstate__(self, state: Dict[str, str]) -> None:
        self.path = state["path"]  # a worker's copy never removes the file

    def mark(self, epoch: int) -> None:
        try:
            with open(self.path, "w") as f:
                f.write(str(epoch))
        except OSError:
            pass  # only a safety check depends on it

    def last(self) -> Optional[int]:
        try:
            with open(self.path) as f:
                text = f.read().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None
