"""The reference engine's ordered chunk reader (csrc/io/sequential_reader.hpp's contract):
``os.preadv`` on a thread pool, reads in flight across extent boundaries."""

from __future__ import annotations

import collections
import contextlib
import errno
import mmap
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Deque, Iterator, List, Optional, Tuple

from .common import ALIGN, NativeHelpers

__all__ = ["PythonReader"]


class _File:
    def __init__(self, path: str, want_direct: bool) -> None:
        self.path = path
        self.direct = False
        flags = os.O_RDONLY | os.O_CLOEXEC
        if want_direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, flags | os.O_DIRECT)
                self.direct = True
            except OSError as exn:
                if exn.errno != errno.EINVAL:
                    raise
                self.fd = os.open(path, flags)
        else:
            self.fd = os.open(path, flags)
        if os.path.isdir(path):
            os.close(self.fd)
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        self.size = os.fstat(self.fd).st_size
        self._buffered_fd: Optional[int] = None

    def buffered_fd(self) -> int:
        if self._buffered_fd is None:
            self._buffered_fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        return self._buffered_fd

    def close(self) -> None:
        os.close(self.fd)
        if self._buffered_fd is not None:
            os.close(self._buffered_fd)


class _Step:
    """One planned item: a read of [offset, offset+length) or an extent-level event."""

    __slots__ = ("extent", "file", "offset", "length", "lo", "hi", "first", "last", "error")

    def __init__(self, extent: int, file: Optional[_File], offset: int, length: int, lo: int,
                 hi: int, first: bool, last: bool, error: Optional[BaseException] = None):
        self.extent, self.file, self.offset, self.length = extent, file, offset, length
        self.lo, self.hi, self.first, self.last, self.error = lo, hi, first, last, error


class PythonReader:
    """Ordered chunk reader over ``(path, start, end)`` extents using ``os.preadv``."""

    engine = "python"

    def __init__(self, extents: List[Tuple[str, int, int]], chunk_size: int, queue_depth: int,
                 direct: bool, *, native: NativeHelpers) -> None:
        self._native = native
        self._chunk = -(-chunk_size // ALIGN) * ALIGN
        self._depth = queue_depth
        self._direct = direct
        self._plan = self._steps(extents)
        self._pool = ThreadPoolExecutor(max_workers=min(queue_depth, 16))
        self._buffers = [mmap.mmap(-1, self._chunk) for _ in range(queue_depth + 1)]
        self._free: Deque[mmap.mmap] = collections.deque(self._buffers)
        self._inflight: Deque[Tuple[_Step, Optional[mmap.mmap], Optional[Future]]] = (
            collections.deque())
        self._held: Optional[mmap.mmap] = None  # buffer of the chunk last delivered
        self._current = -1
        self._skip_below = -1  # steps of extents <= this are dropped
        self._files: List[_File] = []
        self._stats = {"bytes_read": 0, "requests": 0, "short_reads": 0, "direct_files": 0,
                       "buffered_files": 0, "wait_ns": 0}
        self._latencies: List[int] = []  # per-request ns, binned when asked for
        self._owner = os.getpid()  # a fork() child has none of the pool's threads
        self._fill()

    # -- planning -------------------------------------------------------------------------
    def _steps(self, extents: List[Tuple[str, int, int]]) -> Iterator[_Step]:
        for index, (path, start, end) in enumerate(extents):
            try:
                file = _File(path, self._direct)
            except OSError as exn:
                yield _Step(index, None, 0, 0, 0, 0, True, True, error=exn)
                continue
            self._files.append(file)
            self._stats["direct_files" if file.direct else "buffered_files"] += 1
            stop = min(end, file.size)
            if start >= stop:
                yield _Step(index, file, start, 0, start, start, True, True)
                continue
            offset = start - start % ALIGN
            while offset < stop:
                length = min(self._chunk, -(-(stop - offset) // ALIGN) * ALIGN)
                lo, hi = max(start, offset), min(stop, offset + length)
                yield _Step(index, file, offset, length, lo, hi, lo == start,
                            offset + length >= stop)
                offset += length

    def _fill(self) -> None:
        while self._free and len(self._inflight) < self._depth:
            step = next(self._plan, None)
            if step is None:
                return
            if step.error is not None or step.length == 0:
                self._inflight.append((step, None, None))
                continue
            buffer = self._free.popleft()
            self._inflight.append((step, buffer, self._pool.submit(self._read, step, buffer)))

    # -- I/O (worker threads) ---------------------------------------------------------------
    def _read(self, step: _Step, buffer: mmap.mmap) -> int:
        view = memoryview(buffer)
        started = time.perf_counter_ns()
        done = 0
        want = step.hi - step.offset
        while done < want:
            fd = step.file.fd
            if step.file.direct and done % ALIGN:
                fd = step.file.buffered_fd()  # an unaligned remainder can't use O_DIRECT
            try:
                got = os.preadv(fd, [view[done:step.length]], step.offset + done)
            except InterruptedError:
                continue
            except OSError as exn:
                if exn.errno == errno.EINVAL and fd == step.file.fd and step.file.direct:
                    got = os.preadv(step.file.buffered_fd(), [view[done:step.length]],
                                    step.offset + done)
                else:
                    raise OSError(exn.errno, f"{exn.strerror} (read at offset "
                                  f"{step.offset + done})", step.file.path) from None
            self._stats["requests"] += 1
            if got == 0:
                break  # the file shrank: deliver what there is
            if done + got < want:
                self._stats["short_reads"] += 1
            done += got
            self._stats["bytes_read"] += got
        self._latencies.append(time.perf_counter_ns() - started)
        return done

    # -- the reader contract ------------------------------------------------------------------
    def _check_owner(self) -> None:
        if os.getpid() != self._owner:
            raise RuntimeError(
                f"this reader was created in process {self._owner} and cannot be used in "
                f"process {os.getpid()} (a fork() child has none of its threads): create a "
                f"new one in this process")

    def next(self) -> Optional[Tuple[int, int, memoryview, bool, bool]]:
        self._check_owner()
        self._release_held()
        self._fill()
        while self._inflight:
            step, buffer, future = self._inflight.popleft()
            if step.extent <= self._skip_below:
                self._recycle(buffer, future)
                self._fill()
                continue
            self._current = step.extent
            if step.error is not None:
                raise step.error
            if future is None:
                return (step.extent, step.offset, memoryview(b""), True, True)
            try:
                waited = time.perf_counter_ns()
                got = future.result()
                self._stats["wait_ns"] += time.perf_counter_ns() - waited
            except BaseException:
                self._free.append(buffer)
                raise
            self._held = buffer
            end = min(step.hi, step.offset + got)
            data = memoryview(buffer)[step.lo - step.offset:max(end, step.lo) - step.offset]
            short = end < step.hi
            if short:  # the file shrank: this chunk ends the extent, as in the C++ engines
                self.skip_extent()  # and the requests still in flight for it are dropped
            return (step.extent, step.lo, data, step.first, step.last or short)
        return None

    def skip_extent(self) -> None:
        self._check_owner()
        self._skip_below = max(self._skip_below, self._current)

    def _recycle(self, buffer: Optional[mmap.mmap], future: Optional[Future]) -> None:
        if future is not None:
            with contextlib.suppress(OSError):  # the extent is skipped: its errors don't matter
                future.result()
        if buffer is not None:
            self._free.append(buffer)

    def _release_held(self) -> None:
        if self._held is not None:
            self._free.append(self._held)
            self._held = None

    def close(self) -> None:
        if os.getpid() != self._owner:
            return  # its reads never complete here: waiting for them would hang
        for _, buffer, future in self._inflight:
            self._recycle(buffer, future)
        self._inflight.clear()
        # Every read has completed: the pool's threads are idle, and are let go without a
        # join. A join can deadlock the process when close() runs from a finalizer (a reader
        # or its pass dropped unclosed): the collector runs those wherever it is triggered,
        # even inside another thread's start, which holds the lock a join needs.
        self._pool.shutdown(wait=False)
        for file in self._files:
            file.close()
        self._files.clear()

    def stats(self) -> dict:
        out = dict(self._stats)
        lat = self._latencies
        out.update(latency_count=len(lat), latency_sum_ns=sum(lat),
                   latency_min_ns=min(lat) if lat else 0, latency_max_ns=max(lat) if lat else 0)
        return out

    def latency_counts(self):
        """Per-request latencies binned like the C++ core's histogram."""
        return self._native.latency_counts(self._latencies)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
