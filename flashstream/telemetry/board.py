"""A stats board shared by a stream's DataLoader workers and the main process.

Each worker process has one slot in a small file-backed shared mapping (``/dev/shm`` where it
exists): when a pass ends, the worker adds its counters and its request-latency histogram to its
slot; the main process sums the slots for the epoch report. ``reset()`` starts a new
generation, and a pass adds its figures only if it started in the current one: a pass that
began before the reset (one left unfinished, which persistent DataLoader workers close only
when the next epoch starts) does not leak into the next report. The file is made by the process
that creates the stream and removed when that object is collected; workers (forked or spawned)
open it by path. No pickling of stats, no extra queues.

A DataLoader worker opens its first pass when the process has started, which can be after a
``reset()`` that came once the DataLoader iteration that started it was under way (persistent
workers of an epoch broken off early, slow to start, then reset and resumed): that pass belongs
to the generation in force when the worker process was made, which the board notes as the
process is forked (or pickled for a spawned one). See :meth:`StatsBoard.pass_generation`.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import tempfile
import threading
import weakref
from typing import Dict, Iterator, Optional

import numpy as np

from .histogram import LatencyHistogram

__all__ = ["COUNTERS", "StatsBoard"]

#: Counters each slot holds (int64), in this order.
COUNTERS = ("passes", "shards", "samples", "members", "bytes_read", "requests", "short_reads",
            "direct_files", "buffered_files", "errors", "wait_ns", "latency_sum_ns",
            "latency_min_ns", "latency_max_ns")
MAX_SLOTS = 64  # DataLoader workers per rank; slot = worker id % MAX_SLOTS


def _slot_layout():
    buckets = len(LatencyHistogram().counts)
    return buckets, (len(COUNTERS) + buckets) * 8


_ROWS = MAX_SLOTS + 1  # the slots, then one row whose first word is the generation

_LIVE: weakref.WeakSet[StatsBoard] = weakref.WeakSet()  # this process's boards, for forks
_LIVE_LOCK = threading.Lock()


class StatsBoard:
    """Per-worker slots of counters and latency histograms in one shared file."""

    def __init__(self, path: Optional[str] = None) -> None:
        self._buckets, self._slot_bytes = _slot_layout()
        self._owner = path is None
        if path is None:
            directory = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
            fd, path = tempfile.mkstemp(prefix="flashstream-stats-", dir=directory)
            os.ftruncate(fd, self._slot_bytes * _ROWS)
            os.close(fd)
            # Only the creating process removes the file: a forked child inherits this
            # finalizer and must not delete the board its parent still uses.
            weakref.finalize(self, _unlink, path, os.getpid())
        self.path = path
        self._map: Optional[mmap.mmap] = None
        self._pid = -1
        self._lock = threading.Lock()
        # The generation when this process (a copy of the board in it) was made from the one
        # that made the board: a DataLoader worker's first pass belongs to it.
        self._born: Optional[int] = None
        self._at_fork: Optional[int] = None
        with _LIVE_LOCK:
            _LIVE.add(self)

    def __getstate__(self) -> Dict[str, object]:
        return {"path": self.path, "generation": self._peek()}

    def __setstate__(self, state: Dict[str, object]) -> None:
        self.__init__(state["path"])  # a worker's copy: opens the same file, never removes it
        self._born = state.get("generation")  # pickled as a spawned worker was started

    def _array(self) -> np.ndarray:
        if self._map is None or self._pid != os.getpid():  # fresh mapping after a fork
            with open(self.path, "r+b") as f:
                self._map = mmap.mmap(f.fileno(), self._slot_bytes * _ROWS)
            self._pid = os.getpid()
        return np.frombuffer(self._map, dtype=np.int64).reshape(_ROWS, -1)

    def generation(self) -> int:
        """The current generation."""
        return int(self._array()[MAX_SLOTS, 0])

    def pass_generation(self, worker: bool) -> int:
        """The generation of a pass starting now, to give to ``add``: the current one, except
        for the first pass of a DataLoader worker (``worker``), which belongs to the generation
        in force when the worker process was made. The DataLoader iteration that made the
        process started then; the worker gets to its pass later, and a ``reset()`` in between
        must not count it (an epoch broken off early would leak into the next report)."""
        born, self._born = self._born, None
        return born if worker and born is not None else self.generation()

    def _peek(self) -> Optional[int]:
        try:
            return self.generation()
        except (OSError, ValueError):  # the board is gone
            return None

    def add(self, slot: int, counters: Dict[str, int], latency_counts,
            generation: Optional[int] = None) -> None:
        """Add one pass's counters and latency counts into ``slot``, unless the pass started
        in an earlier ``generation`` than the current one, or the board is gone: the process
        that made it dropped its stream (a worker can close a pass after that, and at exit the
        board is removed before passes left open are closed), so nobody reads the figures."""
        # The generation check and the add as one step against reset() in another process:
        # checked just before a reset and added after it, a closing pass's figures would
        # land in the new generation's zeroed slots. The mapping first: opening it closes a
        # descriptor of the file, which would release the lock (see _exclusive).
        try:
            table = self._array()
            with self._exclusive(), self._lock:
                if generation is not None and generation != int(table[MAX_SLOTS, 0]):
                    return
                self._add(table[slot % MAX_SLOTS], counters, latency_counts)
        except FileNotFoundError:
            return

    @staticmethod
    def _add(row: np.ndarray, counters: Dict[str, int], latency_counts) -> None:
        n = len(COUNTERS)
        for i, name in enumerate(COUNTERS):
            value = int(counters.get(name, 0))
            if name == "latency_min_ns":
                row[i] = value if row[i] == 0 else min(row[i], value or row[i])
            elif name == "latency_max_ns":
                row[i] = max(row[i], value)
            else:
                row[i] += value
        if latency_counts is not None:
            row[n:] += np.asarray(latency_counts, dtype=np.uint64).astype(np.int64)

    def reset(self) -> None:
        table = self._array()
        with self._exclusive(), self._lock:
            table[:MAX_SLOTS] = 0
            table[MAX_SLOTS, 0] += 1

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """An exclusive lock on the board file against other processes (take ``_lock`` too,
        against this process's threads). A POSIX record lock, not flock: a DataLoader worker
        forked while it is held does not inherit it, where an inherited flock would stay held
        until the worker exits. A POSIX lock goes when the process closes any descriptor of
        the file: nothing in the lock opens it. FileNotFoundError: the board is gone."""
        fd = os.open(self.path, os.O_RDWR)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def totals(self) -> Dict[str, object]:
        """Counters summed over slots, plus the merged ``latency`` histogram."""
        table = self._array()[:MAX_SLOTS]
        n = len(COUNTERS)
        used = table[table[:, 0] > 0]
        out: Dict[str, object] = {name: int(used[:, i].sum()) for i, name in enumerate(COUNTERS)}
        if len(used):
            mins = used[:, COUNTERS.index("latency_min_ns")]
            out["latency_min_ns"] = int(mins[mins > 0].min()) if (mins > 0).any() else 0
            out["latency_max_ns"] = int(used[:, COUNTERS.index("latency_max_ns")].max())
        out["workers"] = len(used)
        hist = LatencyHistogram(used[:, n:].sum(axis=0).astype(np.uint64) if len(used) else None,
                                min_ns=out["latency_min_ns"] or None,
                                max_ns=out["latency_max_ns"] or None,
                                sum_ns=out["latency_sum_ns"])
        out["latency"] = hist
        return out


def _before_fork() -> None:
    """In the forking process: note each board's generation for the child (see ``_born``)."""
    with _LIVE_LOCK:
        boards = list(_LIVE)
    for board in boards:
        board._at_fork = board._peek()


def _after_fork_in_child() -> None:
    global _LIVE_LOCK
    _LIVE_LOCK = threading.Lock()  # another thread may have held it as the process forked
    for board in list(_LIVE):
        board._born, board._at_fork = board._at_fork, None
        board._lock = threading.Lock()  # the same, for a board's own lock


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def _unlink(path: str, owner_pid: int) -> None:
    if os.getpid() != owner_pid:
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
