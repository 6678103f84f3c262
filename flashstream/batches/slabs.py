"""Shared-memory slabs that tensor batches are packed into, reused from batch to batch.

Fresh shared memory is slow to fill: every page faults and is zeroed, an order of magnitude
slower than filling memory already mapped (docs/benchmarks.md, "Figures behind the defaults").
So each process that makes
batches keeps a pool of slabs (``memfd`` files, mapped once) and reuses a slab once every
tensor of the batch it held is gone, in whichever process that happened:

- Each slab starts with a header: a generation number, an in-use flag, and whether the
  process receiving its batches holds it mapped.
- A batch's tensors are views of one lease object (a numpy array over the slab); a finalizer
  on the lease clears the flag when the last tensor dies.
- A batch leaving a DataLoader worker names its slab (the pool's random token and the slab's
  number); the receiving process maps the slab once (and keeps it mapped while the pool
  lives), makes its own lease, and its finalizer clears the flag in the shared header. The
  worker's own lease then never clears it.
- The slab's file descriptor travels with a batch only until the receiver has noted in the
  header that it holds the slab mapped: passing a descriptor is a round trip to a helper
  thread of the (busy) worker, which cost several milliseconds a batch when measured. Slabs a
  pool unmaps are named in its next batch, so the receiver unmaps them too.

A slab is only reused for the generation its lease was made for, so a stale release cannot
free a later batch.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import secrets
import tempfile
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import psutil

from ..world import in_worker

__all__ = ["HEADER", "Lease", "Slab", "SlabPool", "forget_received", "map_received", "pool",
           "received_lease"]

#: Bytes before a slab's data: the header, and page alignment for what follows.
HEADER = 4096
_MIN_SLAB = 2 << 20
_ROUND = 2 << 20
#: Free slabs kept per process beyond this many are unmapped.
_KEEP_FREE = 16
_GENERATION, _BUSY, _RECEIVER = 0, 1, 2  # header words

Key = Tuple[int, int]  # (pool token, slab number)


def _memfd(size: int) -> int:
    try:
        fd = os.memfd_create("flashstream-batch", os.MFD_CLOEXEC)
    except (AttributeError, OSError):  # no memfd: an unlinked file in shared memory
        directory = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        fd, path = tempfile.mkstemp(prefix="flashstream-batch-", dir=directory)
        os.unlink(path)
    try:
        os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        raise
    return fd


def _header(mapping: mmap.mmap) -> np.ndarray:
    return np.frombuffer(mapping, dtype=np.uint64, count=3)


class Slab:
    """One shared-memory file, mapped in this process (see the module docstring)."""

    def __init__(self, size: int, key: Key) -> None:
        self.size = size
        self.key = key
        self.fd = _memfd(size)
        self.map = mmap.mmap(self.fd, size)
        self.header = _header(self.map)
        self.owner = os.getpid()

    @property
    def busy(self) -> bool:
        return bool(self.header[_BUSY])

    @property
    def mapped_by_receiver(self) -> bool:
        return bool(self.header[_RECEIVER])

    def acquire(self) -> int:
        """Mark the slab in use for a new batch; its generation."""
        self.header[_GENERATION] += 1
        self.header[_BUSY] = 1
        return int(self.header[_GENERATION])

    def release(self, generation: int) -> None:
        _release(self.header, generation)

    def view(self) -> memoryview:
        return memoryview(self.map)

    def close(self) -> None:
        """Give the descriptor back; the mapping goes once nothing views it (the header view
        and any lease keep it until they are collected)."""
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _release(header: np.ndarray, generation: int) -> None:
    if int(header[_GENERATION]) == generation:
        header[_BUSY] = 0


class Lease:
    """What a batch's tensors keep alive: ``array`` (uint8 over the whole slab) is the buffer
    every tensor of the batch views. When it dies the slab is free again, unless the batch
    was handed to another process (``hand_over``), which then frees it."""

    def __init__(self, array: np.ndarray, header: np.ndarray, generation: int) -> None:
        self.array = array
        self._may_release = [True]  # shared with the finalizer
        weakref.finalize(array, _release_unless, header, generation, self._may_release)

    def hand_over(self) -> None:
        self._may_release[0] = False


def _release_unless(header: np.ndarray, generation: int, may_release: List[bool]) -> None:
    if may_release[0]:
        _release(header, generation)


class SlabPool:
    """This process's slabs. ``take(nbytes)`` gives a free slab of at least ``nbytes``
    (reusing one, else mapping a new one), marked in use."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.token = secrets.randbits(62)  # names this pool's slabs: pids get reused
        self.slabs: List[Slab] = []
        self._numbers = itertools.count()
        self._dropped: List[int] = []  # slab numbers unmapped since the last batch sent
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> Tuple[Slab, int]:
        with self._lock:
            best: Optional[Slab] = None
            for slab in self.slabs:
                if slab.size >= nbytes and not slab.busy and (best is None
                                                               or slab.size < best.size):
                    best = slab
            if best is None:
                self._trim()
                size = max(_MIN_SLAB, -(-nbytes // _ROUND) * _ROUND)
                best = Slab(size, (self.token, next(self._numbers)))
                self.slabs.append(best)
            return best, best.acquire()

    def _trim(self) -> None:
        free = [s for s in self.slabs if not s.busy]
        if len(free) < _KEEP_FREE:
            return
        for slab in sorted(free, key=lambda s: s.size)[:len(free) - _KEEP_FREE + 1]:
            self.slabs.remove(slab)
            self._dropped.append(slab.key[1])
            slab.close()

    def dropped(self) -> List[int]:
        """The slabs unmapped since the last call (sent with the next batch)."""
        with self._lock:
            out, self._dropped = self._dropped, []
            return out

    def lease(self, slab: Slab, generation: int) -> Lease:
        return Lease(np.frombuffer(slab.map, dtype=np.uint8), slab.header, generation)


_pool: Optional[SlabPool] = None


def pool() -> SlabPool:
    """The slab pool of this process (a forked DataLoader worker gets a new one)."""
    global _pool
    if _pool is None or _pool.pid != os.getpid():
        _pool = SlabPool()
    return _pool


# -- the receiving side --------------------------------------------------------------------------
# Slabs of live pools stay mapped here, so a slab sent again costs no mmap and no page faults.
_received: Dict[Key, Tuple[mmap.mmap, int]] = {}  # key -> (mapping, owner pid)
_received_lock = threading.Lock()


def map_received(fd_source: Any, size: int, key: Key, owner: int,
                 dropped: Sequence[int] = ()) -> mmap.mmap:
    """This process's mapping of slab ``key`` (``size`` bytes) of the pool in process
    ``owner``. ``fd_source``: a multiprocessing ``DupFd`` (its descriptor is taken and closed),
    or None once this process has noted in the slab's header that it keeps it mapped.
    ``dropped``: that pool's slabs it has unmapped, which this process unmaps too."""
    fd = fd_source.detach() if fd_source is not None else None
    try:
        with _received_lock:
            forget_received([(key[0], n) for n in dropped])
            if fd is not None:  # authoritative: map it afresh, whatever was kept under key
                if not any(token == key[0] for token, _ in _received):
                    _forget_dead()
                mapping = mmap.mmap(fd, size)
                _received[key] = (mapping, owner)
                if not in_worker() and owner != os.getpid():
                    _header(mapping)[_RECEIVER] = 1  # later batches may leave out the fd
                return mapping
            found = _received.get(key)
            if found is None or len(found[0]) != size:
                raise RuntimeError(f"flashstream: a batch arrived in shared memory {key} that "
                                   f"this process has not mapped (a batch from a DataLoader "
                                   f"worker must be unpickled by the process that reads that "
                                   f"loader)")
            return found[0]
    finally:
        if fd is not None:
            os.close(fd)


def forget_received(keys: Sequence[Key]) -> None:
    """Unmap received slabs (once no tensor views them)."""
    for key in keys:
        _received.pop(key, None)


def _forget_dead() -> None:
    """A new pool: drop the mappings of pools whose process has exited."""
    for key in [k for k, (_m, owner) in _received.items() if not psutil.pid_exists(owner)]:
        del _received[key]  # unmapped once no tensor views it


def received_lease(mapping: mmap.mmap, generation: int) -> Lease:
    return Lease(np.frombuffer(mapping, dtype=np.uint8), _header(mapping), generation)
