"""What the reference engine's reader and transfers share: the alignment, argument checks, an
fd that falls back from O_DIRECT, the result dict, and the native helpers it is handed."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import os
import threading
import time
from typing import Any, Callable, List, Sequence, Tuple

__all__ = ["ALIGN", "MAX_PACED_REQUESTS_PER_S", "DirectFile", "NativeHelpers", "check_aligned",
           "check_common", "latency_result", "os_error", "pread"]

# Every logical block size in use is a divisor of 4096, so 4096-aligned requests into
# page-aligned (mmap) buffers are valid O_DIRECT requests on any device.
ALIGN = 4096
# Paced requests grow with the rate past this many a second (csrc/io/bulk_file.cpp says why).
MAX_PACED_REQUESTS_PER_S = 4000


@dataclasses.dataclass(frozen=True)
class NativeHelpers:
    """Native helpers the reference engine reuses, handed in by flashstream.engine (the engine
    itself never imports the extension): ``crc32c(data, crc) -> int``, the ``Pacer`` /
    ``AdaptiveRate`` classes (see csrc/io/pacing.hpp) and ``latency_counts(values_ns)``, which
    bins latencies into the core's histogram buckets."""

    crc32c: Callable[..., int]
    pacer: Callable[..., Any]
    adaptive_rate: Callable[..., Any]
    latency_counts: Callable[[Sequence[int]], Any]


def os_error(exn: OSError, op: str, offset: int, path: str) -> OSError:
    return OSError(exn.errno, f"{os.strerror(exn.errno)} ({op} at offset {offset})", path)


def _address(view: memoryview) -> int:
    import numpy as np  # lazily: numpy is only needed for the alignment check

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


def check_aligned(view: memoryview, offset: int, length: int, chunk_size: int,
                   paced_chunk_size: int = 0) -> None:
    for what, value in (("chunk_size", chunk_size), ("paced_chunk_size", paced_chunk_size),
                        ("offset", offset), ("length", length),
                        ("buffer address", _address(view))):
        if value % ALIGN:
            raise ValueError(f"{what} {value} is not a multiple of the O_DIRECT alignment "
                             f"{ALIGN}")


def check_common(chunk_size: int, queue_depth: int, interval: float = 0.05,
                  rate: float = 0.0) -> None:
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    if queue_depth <= 0:
        raise ValueError("queue_depth must be positive")
    if not interval >= 0.001:
        raise ValueError("interval must be at least 0.001 s")
    if not rate >= 0:
        raise ValueError("rate must be >= 0 bytes/s (0: unpaced)")


def latency_result(total: int, seconds: float, latencies: List[int], engine: str,
                    native: NativeHelpers) -> dict:
    return {"bytes": total, "seconds": seconds, "requests": len(latencies),
            "counts": native.latency_counts(latencies), "min_ns": min(latencies, default=0),
            "max_ns": max(latencies, default=0), "sum_ns": sum(latencies), "engine": engine}


class DirectFile:
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
                raise os_error(exn, name, offset + done, self.path) from None
            if got == 0:
                if name == "write":
                    raise OSError(errno.EIO, f"write made no progress at offset "
                                  f"{offset + done}", self.path)
                break
            done += got
            if name == "read" and direct and (offset + done) % ALIGN:
                break  # a direct read ends off the alignment only at the end of the file
        return done, time.perf_counter_ns() - started


def pread(fd: int, view: memoryview, offset: int) -> int:
    return os.preadv(fd, [view], offset)
