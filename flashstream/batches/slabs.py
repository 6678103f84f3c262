"""Shared-memory slabs that tensor batches are packed into, reused from batch to batch.

Fresh shared memory is slow to fill: every page faults and is zeroed (measured here: 0.8-0.9
GB/s to fill new 6.4 MB buffers, against 24 GB/s into a mapped one). So each process that makes
batches keeps a pool of slabs (``memfd`` files, mapped once) and reuses a slab once every
tensor of the batch it held is gone, in whichever process that happened:

- Each slab starts with a header: a generation number and an in-use flag.
- A batch's tensors are views of one lease object (a numpy array over the slab); a finalizer
  on the lease clears the flag when the last tensor dies.
- A batch sent from a DataLoader worker names its slab; the receiving process maps the slab
  once (and keeps it mapped while the worker lives), makes its own lease, and its finalizer
  clears the flag in the shared header. The worker's own lease then never clears it.
- The slab's file descriptor travels with a batch only until the receiver has noted in the
  header that it holds the slab mapped: passing a descriptor is a round trip to a helper
  thread of the (busy) worker, which cost several milliseconds a batch when measured.

A slab is only reused for the generation its lease was made for, so a stale release cannot
free a later batch.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import tempfile
import threading
import weakref
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

__all__ = ["HEADER", "Lease", "Slab", "SlabPool", "map_received", "pool"]

#: Bytes before a slab's data: the header, and page alignment for what follows.
HEADER = 4096
_MIN_SLAB = 2 << 20
_ROUND = 2 << 20
#: Free slabs kept per process beyond this many are unmapped.
_KEEP_FREE = 16

_serials = itertools.count()


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


class Slab:
    """One shared-memory file, mapped in this process; ``header[0]`` is its generation,
    ``header[1]`` 1 while a batch in it is alive, ``header[2]`` the pid of the process that
    receives its batches and keeps it mapped (0: none yet)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.fd = _memfd(size)
        self.map = mmap.mmap(self.fd, size)
        self.header = np.frombuffer(self.map, dtype=np.uint64, count=3)
        self.serial = next(_serials)
        self.owner = os.getpid()

    @property
    def busy(self) -> bool:
        return bool(self.header[1])

    @property
    def mapped_by_receiver(self) -> bool:
        return bool(self.header[2])

    def acquire(self) -> int:
        """Mark the slab in use for a new batch; its generation."""
        self.header[0] += 1
        self.header[1] = 1
        return int(self.header[0])

    def release(self, generation: int) -> None:
        _release(self.header, generation)

    def view(self) -> memoryview:
        return memoryview(self.map)

    def close(self) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self.map.close()  # refused while something still views it: the GC unmaps later
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _release(header: np.ndarray, generation: int) -> None:
    if int(header[0]) == generation:
        header[1] = 0


class Lease:
    """What a batch's tensors keep alive: ``array`` (uint8 over the whole slab) is the buffer
    every tensor of the batch views. When it dies the slab is free again, unless the batch
    was handed to another process (``transferred``), which then frees it."""

    def __init__(self, array: np.ndarray, header: np.ndarray, generation: int) -> None:
        self.array = array
        self.generation = generation
        self.transferred = False
        self._state = [True]  # the finalizer's view of "may release"
        weakref.finalize(array, _release_unless, header, generation, self._state)

    def hand_over(self) -> None:
        self.transferred = True
        self._state[0] = False


def _release_unless(header: np.ndarray, generation: int, state: List[bool]) -> None:
    if state[0]:
        _release(header, generation)


class SlabPool:
    """This process's slabs. ``take(nbytes)`` gives a free slab of at least ``nbytes``
    (reusing one, else mapping a new one), marked in use."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.slabs: List[Slab] = []
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
                best = Slab(size)
                self.slabs.append(best)
            return best, best.acquire()

    def _trim(self) -> None:
        free = [s for s in self.slabs if not s.busy]
        if len(free) < _KEEP_FREE:
            return
        for slab in sorted(free, key=lambda s: s.size)[:len(free) - _KEEP_FREE + 1]:
            self.slabs.remove(slab)
            slab.close()

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
# Slabs of live workers stay mapped here, so a slab sent again costs no mmap and no page faults.
_received: Dict[Tuple[int, int], mmap.mmap] = {}
_received_lock = threading.Lock()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def map_received(fd_source: Any, size: int, key: Tuple[int, int]) -> mmap.mmap:
    """This process's mapping of the slab ``key`` = (owner pid, serial) of ``size`` bytes.
    ``fd_source``: a multiprocessing ``DupFd`` (its descriptor is taken and closed), or None
    once this process has noted in the slab's header that it keeps the slab mapped."""
    fd = fd_source.detach() if fd_source is not None else None
    try:
        with _received_lock:
            found = _received.get(key)
            if found is None or len(found) != size or found.closed:
                if fd is None:
                    raise RuntimeError(f"flashstream: a batch arrived in shared memory "
                                       f"{key} that this process has not mapped (a batch "
                                       f"from a DataLoader worker must be unpickled by the "
                                       f"process that reads that loader)")
                if not any(owner == key[0] for owner, _ in _received):
                    _forget_dead()
                found = mmap.mmap(fd, size)
                _received[key] = found
                np.frombuffer(found, dtype=np.uint64, count=3)[2] = os.getpid()
            return found
    finally:
        if fd is not None:
            os.close(fd)


def _forget_dead() -> None:
    """A new worker: drop the mappings of workers that have exited."""
    for owner in {owner for owner, _ in _received}:
        if not _alive(owner):
            for key in [k for k in _received if k[0] == owner]:
                del _received[key]  # unmapped once no tensor views it


def received_lease(mapping: mmap.mmap, generation: int) -> Lease:
    array = np.frombuffer(mapping, dtype=np.uint8)
    return Lease(array, np.frombuffer(mapping, dtype=np.uint64, count=3), generation)


