"""What ``CheckpointWriter.save()`` returns: the handle of one save in the background."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Optional

from .report import SaveReport

__all__ = ["SaveHandle"]


class SaveHandle:
    """The pending result of one ``CheckpointWriter.save``."""

    def __init__(self, step: int, future: Optional[Future], path: Optional[Path],
                 copied: Optional[threading.Event] = None) -> None:
        self.step = step
        self.path = path  # this rank's file once committed
        self._future = future
        self._copied = copied
        self.observed = future is None

    def wait_snapshot(self, timeout: Optional[float] = None) -> bool:
        """Until the snapshot holds a copy of every source tensor; False on timeout.

        Returns at once when save() copied everything (``snapshot="copy"``). With the
        copy-on-write snapshot (``"cow"``, and the default ``"auto"`` where the kernel allows
        it) the copy runs in the background: call this before freeing or
        resizing a saved tensor's storage (FSDP's ``resize_(0)``), which would otherwise fail
        the save with ``SnapshotLostError``. Writing to the tensors needs no wait.
        """
        return self._copied is None or self._copied.wait(timeout)

    @property
    def skipped(self) -> bool:
        """True when the save was skipped because the previous one was still writing."""
        return self._future is None

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def result(self, timeout: Optional[float] = None) -> Optional[SaveReport]:
        """Wait for the write and commit; return its report (None when skipped).

        Raises what the background write raised (``OSError`` for a full disk, ...).
        """
        if self._future is None:
            return None
        self.observed = True
        return self._future.result(timeout)

    def __repr__(self) -> str:
        state = "skipped" if self.skipped else "done" if self.done() else "writing"
        return f"SaveHandle(step={self.step}, {state})"
