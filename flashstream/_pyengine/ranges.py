"""The pure-Python reference for scattered reads (csrc/io/range_reader.hpp's RangeFile).

Same contract as the C++ ``RangeFile``: each (file offset, length, buffer offset) range read
into its place of one writable buffer, O_DIRECT with a buffered fallback, a range allowed past
the end of the file only within its last alignment unit, short reads resumed, a file shorter
than at open reported as ``OSError(ENODATA)`` naming the offset. Requests run one after
another: this engine is the reference the tests compare with, not a fast path.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from typing import Any, Dict, Tuple

import numpy as np

from .common import ALIGN, DirectFile, os_error

__all__ = ["PythonRangeFile"]


class PythonRangeFile:
    """One file opened for scattered reads (``read``), with ``os.preadv``."""

    engine = "python"

    def __init__(self, path: str, direct: bool) -> None:
        self.path = path
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
            self._file = DirectFile(fd, path, direct)
        except BaseException:
            os.close(fd)
            raise
        self.size = st.st_size
        self._users = 0
        self._closed = False
        self._cond = threading.Condition()

    @property
    def direct(self) -> bool:
        return self._file.direct

    @property
    def alignment(self) -> Tuple[int, int]:
        return (ALIGN, ALIGN)

    def read(self, buffer: Any, ranges: np.ndarray, *, queue_depth: int = 32,
             request_size: int = 128 << 10) -> Dict[str, Any]:
        if queue_depth <= 0 or request_size <= 0:
            raise ValueError("queue_depth and request_size must be positive")
        view = memoryview(buffer).cast("B")
        if view.readonly:
            raise BufferError("read needs a writable buffer")
        triples = np.asarray(ranges, dtype=np.uint64).reshape(-1, 3).tolist()
        with self._cond:
            if self._closed:
                raise OSError(errno.EBADF, f"{os.strerror(errno.EBADF)} (read)", self.path)
            self._users += 1
        try:
            return self._read(view, triples, request_size)
        finally:
            with self._cond:
                self._users -= 1
                self._cond.notify_all()

    def _read(self, view: memoryview, triples, request_size: int) -> Dict[str, Any]:
        direct = self.direct
        if direct and request_size % ALIGN:
            raise ValueError(f"request_size {request_size} is not a multiple of the O_DIRECT "
                             f"alignment {ALIGN} of {self.path}")
        limit = -(-self.size // ALIGN) * ALIGN
        base = np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0
        pieces = []
        for i, (offset, length, dest) in enumerate(triples):
            if length == 0:
                continue
            text = f"range {i} (offset {offset}, length {length}, dest {dest})"
            if dest + length > len(view):
                raise ValueError(f"{text} does not fit the region of {len(view)} bytes")
            if offset + length > limit:
                raise ValueError(f"{text} lies past the end of {self.path} ({self.size} bytes)")
            if direct and (offset % ALIGN or length % ALIGN or (base + dest) % ALIGN):
                raise ValueError(f"{text} is not aligned for O_DIRECT on {self.path} (offsets "
                                 f"and lengths: multiples of {ALIGN}, memory: {ALIGN})")
            for pos in range(0, length, request_size):
                n = min(request_size, length - pos)
                need = max(0, min(n, self.size - (offset + pos)))
                if need:
                    pieces.append((offset + pos, dest + pos, n, need))
        start = time.perf_counter()
        total, latencies = 0, []
        for offset, dest, n, need in pieces:
            got, ns = self._file.transfer(_preadv, "read", view[dest:dest + n], offset)
            latencies.append(ns)
            if got < need:
                raise os_error(OSError(errno.ENODATA, ""), "read", offset + got, self.path)
            total += need
        return {"bytes": total, "requests": len(latencies),
                "seconds": time.perf_counter() - start if pieces else 0.0,
                "max_ns": max(latencies, default=0), "sum_ns": sum(latencies),
                "engine": "python", "direct": self.direct}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: self._users == 0)
            if self._file.fd >= 0:
                os.close(self._file.fd)
                self._file.fd = -1


def _preadv(fd: int, view: memoryview, offset: int) -> int:
    return os.preadv(fd, [view], offset)
