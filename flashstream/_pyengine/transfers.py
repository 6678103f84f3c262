"""The reference engine's whole-file transfers (csrc/io/bulk_file.hpp's contracts): a new file
written from memory with ``os.pwrite`` on threads, paced and checksummed (the checkpoint
writer), and a file read into caller memory with ``os.preadv`` (the loader)."""

from __future__ import annotations

import errno
import os
import stat
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .common import (
    ALIGN,
    MAX_PACED_REQUESTS_PER_S,
    DirectFile,
    NativeHelpers,
    check_aligned,
    check_common,
    latency_result,
    os_error,
    pread,
)

__all__ = ["PythonOutputFile", "python_read_into"]


class PythonOutputFile:
    """The reference ``OutputFile``: ``os.pwrite`` on ``queue_depth`` threads."""

    def __init__(self, path: str, size: int, direct: bool, *, native: NativeHelpers,
                 existing: bool = False) -> None:
        self._native = native
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
                        raise os_error(exn, "fallocate", 0, path) from None
            self._file: Optional[DirectFile] = DirectFile(fd, path, direct)
        except BaseException:
            os.close(fd)
            if not existing:
                os.unlink(path)  # ours (O_EXCL), and nothing was written
            raise
        self.path = path
        self.alignment = (ALIGN, ALIGN)

    @property
    def direct(self) -> bool:
        return self._file.direct if self._file else False

    def _live(self, op: str) -> DirectFile:
        if self._file is None:
            raise OSError(errno.EBADF, f"{os.strerror(errno.EBADF)} ({op})", self.path)
        return self._file

    def write(self, data: Any, offset: int = 0, *, chunk_size: int = 8 << 20,
              queue_depth: int = 8, rate: Optional[float] = 0.0,
              adaptive: Optional[Dict[str, float]] = None,
              crc_bounds: Optional[Sequence[int]] = None, interval: float = 0.05,
              control: Any = None, paced_chunk_size: int = 0) -> dict:
        rate = float(rate or 0.0)
        check_common(chunk_size, queue_depth, interval, rate)
        view = memoryview(data).cast("B")
        bounds = [int(b) for b in crc_bounds] if crc_bounds is not None else []
        if bounds and (bounds[0] != 0 or bounds != sorted(bounds) or bounds[-1] > len(view)):
            raise ValueError("crc_bounds must be sorted, start at 0 and end at or before the "
                             f"length {len(view)}")
        try:
            controller = (self._native.adaptive_rate(**adaptive) if adaptive is not None
                          else None)
        except TypeError as exn:
            raise ValueError(f"bad adaptive setting: {exn}") from None
        file = self._live("write")
        if file.direct:
            check_aligned(view, offset, len(view), chunk_size, paced_chunk_size)
        run = _PacedWrite(file, view, offset, rate, controller, self._native.pacer, interval,
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
                        crcs[i] = self._native.crc32c(view[lo:hi], crcs[i])
                run.submit(pool, pos, end)
                pos = end
            run.drain()
        result = run.result(self._native)
        result.update(crcs=crcs, direct=file.direct)
        return result

    def commit(self, size: int) -> float:
        file = self._live("commit")
        try:
            os.ftruncate(file.fd, size)
            started = time.perf_counter()
            os.fdatasync(file.fd)
        except OSError as exn:
            raise os_error(exn, "commit", size, self.path) from None
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


#: Seconds a paced write waits at most before it looks at its controlling thread's pace again
#: (the core's kControlPollSeconds).
CONTROL_POLL_S = 5e-3


class _PacedWrite:
    """One write's requests in flight, pacing, windows, timeline and first error."""

    def __init__(self, file: DirectFile, view: memoryview, offset: int, rate: float,
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
            grown = int(min(self.pacer.rate / MAX_PACED_REQUESTS_PER_S, length)) // ALIGN * ALIGN
            length = min(length, max(paced_length, grown))
        if self.pacer is not None and self.error is None:
            now = time.perf_counter()
            began, delay = now, self.pacer.admit(length, now - self.start)
            while self.error is None and (left := now + delay - time.perf_counter()) > 0:
                if self.control is not None and self.control.rate != self.pacer.rate:
                    # A new pace from the controlling thread: a fresh schedule from now, the
                    # request admitted again under it (as the core does).
                    self.pacer = self._make_pacer(self.control.rate)
                    now = time.perf_counter()
                    delay = self.pacer.admit(length, now - self.start)
                    continue
                if self.control is not None:  # wake often enough to see a new pace
                    left = min(left, CONTROL_POLL_S)
                if self.pending:  # collect completions while waiting, as the core does
                    self._collect(wait(self.pending, timeout=left,
                                       return_when=FIRST_COMPLETED)[0])
                else:
                    time.sleep(left)
            if delay > 0:
                self.paused += time.perf_counter() - began
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

    def result(self, native: NativeHelpers) -> dict:
        seconds = self.last - self.start if self.latencies else 0.0
        if self.mark_bytes:
            self.timeline.append((seconds, self.mark_bytes, self._rate()))
        out = latency_result(self.total, seconds, self.latencies, "python", native)
        controller = self.controller
        out.update(paused=self.paused, timeline=self.timeline,
                   peak=controller.peak if controller else 0.0,
                   sustained=controller.sustained if controller else 0.0,
                   final_rate=self._rate())
        return out


def python_read_into(path: str, buffer: Any, length: int, chunk_size: int, queue_depth: int,
                     direct: bool, *, native: NativeHelpers) -> dict:
    """The reference ``read_file_into``: ``os.preadv`` on ``queue_depth`` threads."""
    check_common(chunk_size, queue_depth)
    view = memoryview(buffer).cast("B")
    if view.readonly:
        raise BufferError("read_into needs a writable buffer")
    if length > len(view):
        raise ValueError(f"length {length} exceeds the buffer's {len(view)} bytes")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        file = DirectFile(fd, path, direct)
        request = -(-length // ALIGN) * ALIGN if file.direct else length
        if file.direct:
            if request > len(view):
                raise ValueError(f"the buffer has no room for the length rounded up to the "
                                 f"O_DIRECT alignment ({request})")
            check_aligned(view, 0, request, chunk_size)
        size = os.fstat(fd).st_size
        if size < length:
            raise OSError(errno.ENODATA, f"{os.strerror(errno.ENODATA)} (read at offset "
                          f"{size})", path)
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=queue_depth) as pool:
            futures = [(pos, pool.submit(file.transfer, pread, "read",
                                         view[pos:min(pos + chunk_size, request)], pos))
                       for pos in range(0, request, chunk_size)]
            results = [(pos, f.result()) for pos, f in futures]
        seconds = time.perf_counter() - start if futures else 0.0
        for pos, (got, _) in results:
            if pos + got < min(length, pos + chunk_size):
                raise OSError(errno.ENODATA, f"{os.strerror(errno.ENODATA)} (read at offset "
                              f"{pos + got})", path)
        total = sum(min(got, max(length - pos, 0)) for pos, (got, _) in results)
        out = latency_result(total, seconds, [lat for _, (_, lat) in results], "python",
                             native)
        out["direct"] = file.direct
        return out
    finally:
        os.close(fd)
