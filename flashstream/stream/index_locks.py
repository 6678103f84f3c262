"""Processes on one node without a process group share the scan through the index cache.

Each shard has a lock file beside its cache entry (``flock``: released by the kernel when its
holder exits, even killed). A process takes the locks of a batch of shards it lacks, checks the
cache again (another process may have finished them meanwhile), scans the rest, caches them and
lets go; shards whose locks are held elsewhere are left for later, and read from the cache once
their holder is done. So no two processes scan the same shard at once, and none scans a shard
another one has cached. With RANK/WORLD_SIZE set, each rank first takes the share a process
group would give it, then helps with what is left of the others'.

A shard whose scan failed is not cached (nor one whose cache entry could not be written): a
process that wanted it scans it itself, to meet the error under its own handler; its lock
file stays behind, empty. Where the filesystem cannot lock (NFS without lockd, some FUSE
mounts), shards are scanned without locks, as if no other process wanted them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..world import job_rank
from .index_share import Scan

__all__ = ["LOCK_BATCH", "scan_with_locks"]

#: Shards locked and scanned together (the indexer keeps many shards in flight at once).
LOCK_BATCH = 64

# read(url) -> (ShardIndex or None, bytes read); store(url, index) caches it
Read = Callable[[str], Tuple[Optional[object], int]]
Store = Callable[[str, object], None]


class _Lock:
    """An exclusive flock on ``path`` (created when missing, if ``create``)."""

    def __init__(self, path: Path, create: bool = True) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o644)

    def take(self, wait: bool) -> Optional[bool]:
        """True when locked, False when another process holds it (without ``wait``), None
        when this filesystem cannot lock (NFS without lockd, some FUSE mounts)."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            return False
        except OSError:
            return None
        return True

    def release(self, *, remove: bool = False) -> None:
        # Removing before unlocking is safe: whoever locks the old file or makes a new one
        # then finds the cache entry that was written first.
        if remove:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        os.close(self.fd)


def _open_lock(path: Optional[Path], create: bool = True) -> Optional[_Lock]:
    """The shard's lock, or None when it has none (no cache entry name, or an unwritable
    cache directory: the shard is then scanned without one; or, unless ``create``, no lock
    file)."""
    if path is None:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return _Lock(path, create)
    except OSError:
        return None


def scan_with_locks(urls: Sequence[str], missing: List[int], scan: Scan, lock_path:
                    Callable[[str], Optional[Path]], read: Read, store: Store,
                    stopped: Callable[[], bool] = lambda: False
                    ) -> Tuple[Dict[int, object], Dict[int, str], List[int], Dict[int, int]]:
    """Index ``missing`` (positions into ``urls``), sharing the work with other processes
    through the cache. Returns the index of every position, the scan errors, the
    positions this process scanned, and for the ones it found cached meanwhile the bytes
    read. Raises what ``scan`` raised, after letting go of its locks. Once ``stopped()`` (the
    handler ended the scan), what is left goes to ``scan`` at once, unlocked and unread from
    the cache: one pass over the shards would not have read those either."""
    rank, world = job_rank()
    if not (world > 1 and 0 <= rank < world):
        rank, world = 0, 1
    # This rank's share first (as the process group would split them), then the others'.
    own = missing[rank::world]
    taken = set(own)
    out = _Outcome()
    rest = [i for i in missing if i not in taken]
    for k, part in enumerate((own, rest)):
        pending = part
        while pending and not stopped():
            pending = _round(urls, pending, scan, lock_path, read, store, out)
        if stopped():
            left = pending + (rest if k == 0 else [])
            got, bad, raised = scan(left) if left else ({}, {}, None)
            if raised is not None:
                raise raised
            out.indexes.update(got)
            out.errors.update(bad)
            break
    return out.indexes, out.errors, out.mine, out.cached


class _Outcome:
    def __init__(self) -> None:
        self.indexes: Dict[int, object] = {}
        self.errors: Dict[int, str] = {}
        self.mine: List[int] = []  # scanned here
        self.cached: Dict[int, int] = {}  # found cached meanwhile: bytes read


def _round(urls: Sequence[str], pending: List[int], scan: Scan,
           lock_path: Callable[[str], Optional[Path]], read: Read, store: Store,
           out: _Outcome) -> List[int]:
    """Lock, scan and cache one batch of ``pending`` (or wait for a shard another process
    holds, when all are held); returns what is still pending."""
    batch: List[Tuple[int, Optional[_Lock]]] = []
    later: List[int] = []
    try:
        for i in pending:
            if len(batch) >= LOCK_BATCH:
                later.append(i)
                continue
            lock = _open_lock(lock_path(urls[i]))
            if lock is not None:
                taken = lock.take(wait=False)
                if taken is not True:
                    lock.release(remove=taken is None)  # unlockable: the file is no use
                    lock = None
                if taken is False:
                    later.append(i)
                    continue
            found, nbytes = read(urls[i])
            if found is not None:  # cached by another process meanwhile
                out.indexes[i], out.cached[i] = found, nbytes
                if lock is not None:
                    lock.release(remove=True)  # it may have made the file anew
                continue
            batch.append((i, lock))
        if batch:
            positions = [i for i, _lock in batch]
            got, bad, raised = scan(positions)
            if raised is not None:
                raise raised
            out.indexes.update(got)
            out.errors.update(bad)
            out.mine.extend(positions)
            for i, lock in batch:
                stored = i not in bad
                if stored:
                    try:
                        store(urls[i], got[i])
                    except OSError:
                        stored = False  # others then scan it themselves
                if lock is not None:
                    lock.release(remove=stored)
            batch = []
        elif later:  # every shard left is being scanned elsewhere: wait for one
            lock = _open_lock(lock_path(urls[later[0]]), create=False)
            if lock is not None:  # (gone: its holder is done already)
                try:
                    lock.take(wait=True)
                finally:
                    lock.release()
    finally:
        for _i, lock in batch:  # not scanned (it raised): let others have them
            if lock is not None:
                lock.release()
    return later
