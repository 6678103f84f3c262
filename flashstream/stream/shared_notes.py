"""What the process that made a stream and its DataLoader workers tell each other.

Workers iterate copies of the stream, made when the DataLoader starts them (or once, with
``persistent_workers``), so neither side sees the other's later calls. Small shared files
(``/dev/shm`` where it exists), made by the creating process and removed when that object is
collected, carry what must cross anyway; workers, forked or spawned, open them by path:

- :class:`WorkerMarks`: the last epoch a worker started, so that the main process refuses
  ``state_dict()`` instead of returning a stale position;
- a :class:`SharedNote` of the epoch last set with ``set_epoch`` in the main process, so that
  persistent workers read the epoch the main process is in;
- a :class:`SharedNote` of the state loaded in the main process, so that workers started
  before the load (persistent ones) see it too, and :class:`Claims`, so that each worker
  resumes it once: the first pass after the load, not every later pass.

A deep copy of a stream gets files of its own; the same stream pickled to another job's
processes would share them (build one stream per process instead).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from typing import Any, Dict, Optional

__all__ = ["Claims", "SharedNote", "WorkerMarks"]


def _shm() -> Optional[str]:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


def _unlink(path: str, owner_pid: int) -> None:
    if os.getpid() == owner_pid:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _rmtree(path: str, owner_pid: int) -> None:
    if os.getpid() == owner_pid:
        shutil.rmtree(path, ignore_errors=True)


class _Shared:
    """A path in shared memory, made by the creating object and removed when it is collected.
    Pickled copies (DataLoader workers) open the same path and never remove it; a deep copy
    makes its own."""

    def __init__(self, path: Optional[str] = None) -> None:
        if path is None:
            path = self._make()
            weakref.finalize(self, self._remove, path, os.getpid())
        self.path = path

    @staticmethod
    def _make() -> str:
        raise NotImplementedError

    @staticmethod
    def _remove(path: str, owner_pid: int) -> None:
        raise NotImplementedError

    def __getstate__(self) -> Dict[str, str]:
        return {"path": self.path}

    def __setstate__(self, state: Dict[str, str]) -> None:
        self.path = state["path"]

    def __deepcopy__(self, memo: Dict[int, Any]) -> _Shared:
        return type(self)()  # a copied stream talks to its own workers only


class SharedNote(_Shared):
    """A line of text shared through a small file; replaced whole, so a reader never sees half
    a write. Failures are ignored: only safety checks depend on it."""

    @staticmethod
    def _make() -> str:
        fd, path = tempfile.mkstemp(prefix="flashstream-note-", dir=_shm())
        os.close(fd)
        return path

    _remove = staticmethod(_unlink)

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


class Claims(_Shared):
    """Who took what once: ``claim(token, who)`` is True for the first caller with that pair,
    in any process (an exclusively created file), False ever after."""

    @staticmethod
    def _make() -> str:
        return tempfile.mkdtemp(prefix="flashstream-claims-", dir=_shm())

    _remove = staticmethod(_rmtree)

    def claim(self, token: str, who: object) -> bool:
        try:
            os.close(os.open(os.path.join(self.path, f"{token}-{who}"),
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return False
        except OSError:
            return True  # cannot record it: resume rather than lose the position
        return True

    def claimed(self, token: str) -> bool:
        try:
            return any(name.startswith(f"{token}-") for name in os.listdir(self.path))
        except OSError:
            return False
