"""The pure-Python reference engine: ``os.preadv`` / ``os.pwrite`` on a thread pool.

It implements the same contracts as the C++ SequentialReader (ordered chunks, reads in flight
across extent boundaries, O_DIRECT with buffered fallback, errors raised at the extent's turn)
and the C++ OutputFile / read_file_into (whole-file transfers from and into caller memory),
so that one contract test suite can run against every engine. It is slower, never wrong.

It never imports the extension: the few native helpers it reuses (CRC-32C, the pacer and the
adaptive rate controller) are handed in by flashstream.engine as ``Kernels``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import fcntl
import mmap
import os
import stat
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

__all__ = ["Kernels", "PythonOutputFile", "PythonReader", "python_read_into"]

# Every logical block size in use is a divisor of 4096, so 4096-aligned requests into
# page-aligned (mmap) buffers are valid O_DIRECT requests on any device.
_ALIGN = 4096
# Paced requests grow with the rate past this many a second (csrc/io/bulk_file.cpp says why).
MAX_PACED_REQUESTS_PER_S = 4000


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
                 direct: bool) -> None:
        self._chunk = -(-chunk_size // _ALIGN) * _ALIGN
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
            offset = start - start % _ALIGN
            while offset < stop:
                length = min(self._chunk, -(-(stop - offset) // _ALIGN) * _ALIGN)
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
            if step.file.direct and done % _ALIGN:
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
        self._pool.shutdown(wait=True)
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
        from .telemetry.histogram import LatencyHistogram  # avoids an import cycle

        hist = LatencyHistogram()
        hist.record_many(self._latencies)
        return hist.counts

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


# -- whole-file transfers (the checkpoint writer and loader) ----------------------------------


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Native helpers the reference engine reuses: ``crc32c(data, crc) -> int`` and the
    ``Pacer`` / ``AdaptiveRate`` classes (see csrc/io/pacing.hpp)."""

    crc32c: Callable[..., int]
    pacer: Callable[..., Any]
    adaptive_rate: Callable[..., Any]


def _os_error(exn: OSError, op: str, offset: int, path: str) -> OSError:
    return OSError(exn.errno, f"{os.strerror(exn.errno)} ({op} at offset {offset})", path)


def _address(view: memoryview) -> int:
    import numpy as np  # lazily: numpy is only needed for the alignment check

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


def _check_aligned(view: memoryview, offset: int, length: int, chunk_size: int,
                   paced_chunk_size: int = 0) -> None:
    for what, value in (("chunk_size", chunk_size), ("paced_chunk_size", paced_chunk_size),
                        ("offset", offset), ("length", length),
                        ("buffer address", _address(view))):
        if value % _ALIGN:
            raise ValueError(f"{what} {value} is not a multiple of the O_DIRECT alignment "
                             f"{_ALIGN}")


def _check_common(chunk_size: int, queue_depth: int, interval: float = 0.05,
                  rate: float = 0.0) -> None:
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    if queue_depth <= 0:
        raise ValueError("queue_depth must be positive")
    if not interval >= 0.001:
        raise ValueError("interval must be at least 0.001 s")
    if not rate >= 0:
        raise ValueError("rate must be >= 0 bytes/s (0: unpaced)")


def _latency_result(total: int, seconds: float, latencies: List[int], engine: str) -> dict:
    from .telemetry.histogram import LatencyHistogram  # avoids an import cycle

    hist = LatencyHistogram()
    hist.record_many(latencies)
    return {"bytes": total, "seconds": seconds, "requests": len(latencies),
            "counts": hist.counts, "min_ns": min(latencies, default=0),
            "max_ns": max(latencies, default=0), "sum_ns": sum(latencies), "engine": engine}


class _Direct:
    """An fd opened with O_DIRECT where allowed; cleared in place when a request is refused."""

    def __init__(self, fd: int, path: str, want_direct: bool) -> None:
        self.fd, self.path, self.direct = fd, path, False
        self._lock = threading.Lock()
        if want_direct and hasattr(os, "O_DIRECT"):
            try:
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
                self.direct = True
            except OSError as exn:
                if exn.errno != errno.EINVAL:  # EINVAL: this filesystem has no O_DIRECT
                    raise

    def fall_back(self) -> None:
        with self._lock:
            if self.direct:
                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL)
                            & ~os.O_DIRECT)
                self.direct = False

    def transfer(self, op: Callable[[int, memoryview, int], int], name: str, view: memoryview,
                 offset: int) -> Tuple[int, int]:
        """Runs ``op`` until ``view`` is done or the file ends; returns (bytes, latency ns)."""
        started, done = time.perf_counter_ns(), 0
        while done < len(view):
            direct = self.direct
            try:
                got = op(self.fd, view[done:], offset + done)
            except InterruptedError:
                continue
            except OSError as exn:
                if exn.errno == errno.EINVAL and direct:
                    self.fall_back()  # the filesystem refuses this O_DIRECT request
                    continue
                raise _os_error(exn, name, offset + done, self.path) from None
            if got == 0:
                if name == "write":
                    raise OSError(errno.EIO, f"write made no progress at offset "
                                  f"{offset + done}", self.path)
                break
            done += got
            if name == "read" and direct and (offset + done) % _ALIGN:
                break  # a direct read ends off the alignment only at the end of the file
        return done, time.perf_counter_ns() - started


class PythonOutputFile:
    """The reference ``OutputFile``: ``os.pwrite`` on ``queue_depth`` threads."""

    def __init__(self, path: str, size: int, direct: bool, *, kernels: Kernels,
                 existing: bool = False) -> None:
        self._kernels = kernels
        # O_RDWR for an existing file: where the filesystem has no fallocate, glibc's
        # posix_fallocate falls back to reading and rewriting each block.
        flags = (os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC if existing
                 else os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC)
        fd = os.open(path, flags, 0o644)
        try:
            if existing and not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "open (not a regular file)", path)
            if size > 0:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exn:
                    if exn.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                        raise _os_error(exn, "fallocate", 0, path) from None
            self._file: Optional[_Direct] = _Direct(fd, path, direct)
        except BaseException:
            os.close(fd)
            if not existing:
                os.unlink(path)  # ours (O_EXCL), and nothing was written
            raise
        self.path = path
        self.alignment = (_ALIGN, _ALIGN)

    @property
    def direct(self) -> bool:
        return self._file.direct if self._file else False

    def _live(self, op: str) -> _Direct:
        if self._file is None:
            raise OSError(errno.EBADF, f"{os.strerror(errno.EBADF)} ({op})", self.path)
        return self._file

    def write(self, data: Any, offset: int = 0, *, chunk_size: int = 8 << 20,
              queue_depth: int = 8, rate: Optional[float] = 0.0,
              adaptive: Optional[Dict[str, float]] = None,
              crc_bounds: Optional[Sequence[int]] = None, interval: float = 0.05,
              control: Any = None, paced_chunk_size: int = 0) -> dict:
        rate = float(rate or 0.0)
        _check_common(chunk_size, queue_depth, interval, rate)
        view = memoryview(data).cast("B")
        bounds = [int(b) for b in crc_bounds] if crc_bounds is not None else []
        if bounds and (bounds[0] != 0 or bounds != sorted(bounds) or bounds[-1] > len(view)):
            raise ValueError("crc_bounds must be sorted, start at 0 and end at or before the "
                             f"length {len(view)}")
        try:
            controller = (self._kernels.adaptive_rate(**adaptive) if adaptive is not None
                          else None)
        except TypeError as exn:
            raise ValueError(f"bad adaptive setting: {exn}") from None
        file = self._live("write")
        if file.direct:
            _check_aligned(view, offset, len(view), chunk_size, paced_chunk_size)
        run = _PacedWrite(file, view, offset, rate, controller, self._kernels.pacer, interval,
                          control)
        crcs = [0] * max(len(bounds) - 1, 0)
        with ThreadPoolExecutor(max_workers=queue_depth) as pool:
            pos = 0
            while pos < len(view):
                length = run.wait_turn(min(chunk_size, len(view) - pos),
                                       min(paced_chunk_size or chunk_size, len(view) - pos),
                                       queue_depth)
                if not length:
                    break
                end = pos + length
                for i in range(len(crcs)):  # the segments this chunk overlaps
                    lo, hi = max(pos, bounds[i]), min(end, bounds[i + 1])
                    if lo < hi:
                        crcs[i] = self._kernels.crc32c(view[lo:hi], crcs[i])
                run.submit(pool, pos, end)
                pos = end
            run.drain()
        result = run.result()
        result.update(crcs=crcs, direct=file.direct)
        return result

    def commit(self, size: int) -> float:
        file = self._live("commit")
        try:
            os.ftruncate(file.fd, size)
            started = time.perf_counter()
            os.fdatasync(file.fd)
        except OSError as exn:
            raise _os_error(exn, "commit", size, self.path) from None
        seconds = time.perf_counter() - started
        self.close()
        return seconds

    def close(self) -> None:
        if self._file is not None:
            os.close(self._file.fd)
            self._file = None

    def __enter__(self) -> PythonOutputFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _PacedWrite:
    """One write's requests in flight, pacing, windows, timeline and first error."""

    def __init__(self, file: _Direct, view: memoryview, offset: int, rate: float,
                 controller: Any, pacer: Callable[[float], Any], interval: float,
                 control: Any = None) -> None:
        self.file, self.view, self.offset = file, view, offset
        self.ceiling, self.controller, self.interval = rate, controller, interval
        self.control, self._make_pacer = control, pacer
        paced = rate > 0 or controller is not None or control is not None
        self.pacer = pacer(self._rate()) if paced else None
        self.pending: set = set()
        self.error: Optional[BaseException] = None
        self.latencies: List[int] = []
        self.timeline: List[Tuple[float, int, float]] = []
        self.total = self.paused = 0
        self.start = self.last = self.window_start = time.perf_counter()
        self.next_mark, self.mark_bytes, self.window_bytes = interval, 0, 0

    def _rate(self) -> float:
        if self.control is not None:  # another thread sets the pace (see RateControl)
            return self.control.rate
        adaptive = self.controller.rate if self.controller else 0.0
        if adaptive <= 0:
            return self.ceiling
        return min(self.ceiling, adaptive) if self.ceiling > 0 else adaptive

    def wait_turn(self, length: int, paced_length: int, depth: int) -> int:
        """Waits for a free slot and the pacer; returns the next request's length
        (``paced_length`` while a rate holds, else ``length``), 0 once an error stops the
        write."""
        while self.error is None and len(self.pending) >= depth:
            self._collect(wait(self.pending, return_when=FIRST_COMPLETED)[0])
        if self.control is not None and self.control.rate != self.pacer.rate:
            self.pacer = self._make_pacer(self.control.rate)  # a fresh schedule: no burst
        if self.pacer is not None and self.pacer.rate > 0:
            # As the core: paced requests grow with the rate past MAX_PACED_REQUESTS_PER_S.
            grown = int(min(self.pacer.rate / MAX_PACED_REQUESTS_PER_S, length)) // _ALIGN * _ALIGN
            length = min(length, max(paced_length, grown))
        if self.pacer is not None and self.error is None:
            now = time.perf_counter()
            delay = self.pacer.admit(length, now - self.start)
            while self.error is None and (left := now + delay - time.perf_counter()) > 0:
                if self.pending:  # collect completions while waiting, as the core does
                    self._collect(wait(self.pending, timeout=left,
                                       return_when=FIRST_COMPLETED)[0])
                else:
                    time.sleep(left)
            if delay > 0:
                self.paused += time.perf_counter() - now
        return length if self.error is None else 0

    def submit(self, pool: ThreadPoolExecutor, pos: int, end: int) -> None:
        self.pending.add(pool.submit(self.file.transfer, os.pwrite, "write",
                                     self.view[pos:end], self.offset + pos))

    def drain(self) -> None:
        while self.pending:
            self._collect(wait(self.pending, return_when=FIRST_COMPLETED)[0])
        if self.error is not None:
            raise self.error

    def _collect(self, done: set) -> None:
        if not done:
            return
        now = time.perf_counter()
        for future in done:
            self.pending.discard(future)
            try:
                got, latency = future.result()
            except OSError as exn:
                self.error = self.error or exn  # the first error is the cause
                continue
            self.latencies.append(latency)
            self.total += got
            if self.control is not None:
                self.control.add_done(got)
            self.last = now
            while now - self.start >= self.next_mark:
                self.timeline.append((self.next_mark, self.mark_bytes, self._rate()))
                self.next_mark += self.interval
                self.mark_bytes = 0
            self.mark_bytes += got
            self.window_bytes += got
        if self.controller is not None and now - self.window_start >= self.controller.window:
            self.controller.observe(self.window_bytes, now - self.window_start)
            if self.pacer is not None:
                self.pacer.set_rate(self._rate(), now - self.start)
            self.window_start, self.window_bytes = now, 0

    def result(self) -> dict:
        seconds = self.last - self.start if self.latencies else 0.0
        if self.mark_bytes:
            self.timeline.append((seconds, self.mark_bytes, self._rate()))
        out = _latency_result(self.total, seconds, self.latencies, "python")
        controller = self.controller
        out.update(paused=self.paused, timeline=self.timeline,
                   peak=controller.peak if controller else 0.0,
                   sustained=controller.sustained if controller else 0.0,
                   final_rate=self._rate())
        return out


def _pread(fd: int, view: memoryview, offset: int) -> int:
    return os.preadv(fd, [view], offset)


def python_read_into(path: str, buffer: Any, length: int, chunk_size: int, queue_depth: int,
                     direct: bool) -> dict:
    """The reference ``read_file_into``: ``os.preadv`` on ``queue_depth`` threads."""
    _check_common(chunk_size, queue_depth)
    view = memoryview(buffer).cast("B")
    if view.readonly:
        raise BufferError("read_into needs a writable buffer")
    if length > len(view):
        raise ValueError(f"length {length} exceeds the buffer's {len(view)} bytes")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        file = _Direct(fd, path, direct)
        request = -(-length // _ALIGN) * _ALIGN if file.direct else length
        if file.direct:
            if request > len(view):
                raise ValueError(f"the buffer has no room for the length rounded up to the "
                                 f"O_DIRECT alignment ({request})")
            _check_aligned(view, 0, request, chunk_size)
        size = os.fstat(fd).st_size
        if size < length:
            raise OSError(errno.ENODATA, f"{os.strerror(errno.ENODATA)} (read at offset "
                          f"{size})", path)
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=queue_depth) as pool:
            futures = [(pos, pool.submit(file.transfer, _pread, "read",
                                         view[pos:min(pos + chunk_size, request)], pos))
                       for pos in range(0, request, chunk_size)]
            results = [(pos, f.result()) for pos, f in futures]
        seconds = time.perf_counter() - start if futures else 0.0
        for pos, (got, _) in results:
            if pos + got < min(length, pos + chunk_size):
                raise OSError(errno.ENODATA, f"{os.strerror(errno.ENODATA)} (read at offset "
                              f"{pos + got})", path)
        total = sum(min(got, max(length - pos, 0)) for pos, (got, _) in results)
        out = _latency_result(total, seconds, [lat for _, (_, lat) in results], "python")
        out["direct"] = file.direct
        return out
    finally:
        os.close(fd)
