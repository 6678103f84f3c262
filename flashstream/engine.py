"""The engine facade: the only module that imports the C++ extension.

It picks the I/O engine (io_uring, thread pool, or the pure-Python reference), opens chunk
readers over file extents, hands out tar scanners, and moves whole files between memory and
disk for checkpoints (paced, checksummed writes; reads into a caller's buffer). Everything
above it deals in paths, ints and buffers.

Longer than the house's ~400 lines, for a reason: it is the one door to the extension, so every
native entry point is named (and its contract documented) here, once; the engines behind it
live in csrc/ and, for the reference, in _pyengine/.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple, Union

import numpy as np

from . import _core
from ._pyengine import (
    NativeHelpers,
    PythonOutputFile,
    PythonRangeFile,
    PythonReader,
    python_read_into,
)
from .settings import ENGINES, IOSettings

__all__ = [
    "TO_END",
    "AdaptiveRate",
    "BatchPacker",
    "ChunkReader",
    "CowSnapshot",
    "FormatError",
    "OutputFile",
    "Pacer",
    "ProbeCancel",
    "RangeReader",
    "RateControl",
    "Scanner",
    "crc32c",
    "crc32c_hardware",
    "create_probe_file",
    "engine_name",
    "copy_ranges",
    "cow_available",
    "cow_preferred",
    "cow_mode",
    "cow_snapshot",
    "histogram_bounds",
    "index_shards",
    "is_meta_name",
    "latency_counts",
    "open_output",
    "open_ranges",
    "open_reader",
    "read_into",
    "run_probe",
    "split_key",
    "uring_available",
]

#: ``end`` of an extent that reads to the end of the file.
TO_END = (1 << 64) - 1

#: Raised by the scanner for malformed tar data; ``args == (message, offset)``.
FormatError = _core.FormatError
Scanner = _core.Scanner
#: ``BatchPacker(memory, base, region_bytes, exts)``: a tensor batch packed into a writable
#: buffer by ``Scanner.pack`` (see csrc/tar/batch_packer.hpp).
BatchPacker = _core.BatchPacker
split_key = _core.split_key
is_meta_name = _core.is_meta_name
#: Lower bound (ns) of every bucket of the core's latency histograms.
histogram_bounds = _core.histogram_bounds
#: One fio-like measurement on an existing file (see flashstream.telemetry.probe).
run_probe = _core.run_probe
#: ``ProbeCancel()``: ``set()`` from another thread ends a ``run_probe(cancel=)`` in progress
#: (its requests in flight complete).
ProbeCancel = _core.ProbeCancel
#: A file of ``size`` random bytes written with O_DIRECT (space reserved first: ENOSPC early).
create_probe_file = _core.create_probe_file

#: ``crc32c(data, crc=0) -> int``: CRC-32C of any contiguous buffer; pass a previous result as
#: ``crc`` to continue it over the next piece.
crc32c = _core.crc32c
#: True when crc32c uses the CPU's CRC instruction (SSE4.2 / ARMv8), not a table.
crc32c_hardware = _core.crc32c_hardware
#: ``AdaptiveRate(*, window, cliff_ratio, cliff_windows, margin, min_rate)``: finds a drive's
#: write cliff from per-window throughput (``observe(bytes, seconds) -> rate``).
AdaptiveRate = _core.AdaptiveRate
#: ``RateControl()``: a write's pace (``rate``, bytes/s, settable from another thread while the
#: write runs; 0: unpaced) and progress (``done``); pass it as ``OutputFile.write(control=)``.
RateControl = _core.RateControl
#: ``Pacer(rate=0.0)``: fixed-rate schedule; ``admit(bytes, now) -> seconds to wait``.
Pacer = _core.Pacer
#: ``LatencyRecorder()``: thread-safe latency histogram; ``stop(start_ns)`` records
#: ``monotonic now - start_ns`` (the clock of ``time.perf_counter_ns``); ``snapshot(reset)``
#: returns the dict ``LatencyHistogram.from_core`` takes.
LatencyRecorder = _core.LatencyRecorder



def latency_counts(values_ns: Sequence[float]) -> np.ndarray:
    """Counts per bucket of the core's latency histogram (``histogram_bounds``) of latencies
    in ns, binned in one vectorized pass; a value past the last bound counts in the last."""
    lower = _bucket_lower()
    values = np.maximum(np.asarray(values_ns, dtype=np.float64), 0)
    index = np.minimum(np.searchsorted(lower, values, side="right") - 1, len(lower) - 1)
    # bincount, not np.add.at: far cheaper per value (benchmarks/micro measures it).
    return np.bincount(index, minlength=len(lower)).astype(np.uint64)


@functools.lru_cache(maxsize=1)
def _bucket_lower() -> np.ndarray:
    return np.asarray(_core.histogram_bounds(), dtype=np.float64)


_NATIVE = NativeHelpers(crc32c=_core.crc32c, pacer=_core.Pacer,
                        adaptive_rate=_core.AdaptiveRate, latency_counts=latency_counts)

Chunk = Tuple[int, int, memoryview, bool, bool]  # extent, offset, data, first, last
Extent = Tuple[str, int, int]  # path, start, end (TO_END for the whole file)
PathLike = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]


class ChunkReader(Protocol):
    """What every engine provides (see csrc/io/sequential_reader.hpp for the contract)."""

    engine: str

    def next(self) -> Optional[Chunk]: ...
    def skip_extent(self) -> None: ...
    def close(self) -> None: ...
    def stats(self) -> dict: ...
    def latency_counts(self): ...


class OutputFile(Protocol):
    """A new file written from memory (see csrc/io/bulk_file.hpp for the contract).

    ``write(data, offset=0, *, chunk_size, queue_depth, rate=0.0, adaptive=None,
    crc_bounds=None, interval=0.05) -> dict`` writes a contiguous buffer at ``offset`` in
    ``chunk_size`` requests, ``queue_depth`` in flight. ``rate``: bytes/s (0: unpaced; with
    ``adaptive`` the ceiling). ``adaptive``: None, or a dict of AdaptiveRate keyword arguments
    (``{}`` for the defaults). ``crc_bounds``: sorted offsets from 0 into ``data``; the result's
    ``crcs`` holds the CRC-32C of each segment between consecutive bounds. With O_DIRECT
    (``direct``), ``data``'s address, ``offset``, its length and ``chunk_size`` must be multiples
    of ``alignment`` (``(offset, memory)``): pad the tail and ``commit`` the exact size. The
    result has bytes, seconds, requests, counts, min_ns, max_ns, sum_ns, paused, timeline
    ([(seconds, bytes, rate)]), peak, sustained, final_rate, crcs, engine and direct.
    ``control``: a :class:`RateControl` another thread steers the pace with while the write
    runs (it then alone sets the pace) and reads the write's progress from.
    ``paced_chunk_size``: while a rate is in force, requests are at most this long (0:
    ``chunk_size``); a read that arrives behind a paced write then waits for a short request.
    Past 4,000 requests a second (rate / paced_chunk_size) they grow with the rate instead,
    up to ``chunk_size``: each paced request costs the pacer a wake-up, and a pace near the
    drive's peak would fall behind.
    """

    path: str
    direct: bool
    alignment: Tuple[int, int]

    def write(self, data: Any, offset: int = 0, *, chunk_size: int = ..., queue_depth: int = ...,
              rate: float = 0.0, adaptive: Optional[Dict[str, float]] = None,
              crc_bounds: Optional[Sequence[int]] = None,
              interval: float = 0.05, control: Optional[Any] = None,
              paced_chunk_size: int = 0) -> Dict[str, Any]: ...
    def commit(self, size: int) -> float: ...
    def close(self) -> None: ...


_WRITE_CHUNK = 8 << 20
_WRITE_DEPTH = 8


class _NativeOutputFile:
    """``OutputFile`` on the C++ core; the engine is picked anew by each write."""

    def __init__(self, path: PathLike, size: int, engine: str, direct: bool,
                 existing: bool = False) -> None:
        self._file = _core.OutputFile(os.fsencode(path), int(size), bool(direct), bool(existing))
        self._engine = engine

    def write(self, data: Any, offset: int = 0, *, chunk_size: int = _WRITE_CHUNK,
              queue_depth: int = _WRITE_DEPTH, rate: Optional[float] = 0.0,
              adaptive: Optional[Dict[str, float]] = None,
              crc_bounds: Optional[Sequence[int]] = None,
              interval: float = 0.05, control: Optional[Any] = None,
              paced_chunk_size: int = 0) -> Dict[str, Any]:
        bounds = None if crc_bounds is None else [int(b) for b in crc_bounds]
        return self._file.write(data, int(offset), int(chunk_size), int(queue_depth),
                                self._engine, float(rate or 0.0),
                                None if adaptive is None else dict(adaptive), bounds,
                                float(interval), control, int(paced_chunk_size))

    def commit(self, size: int) -> float:
        return self._file.commit(int(size))

    def close(self) -> None:
        self._file.close()

    @property
    def path(self) -> str:
        return os.fsdecode(self._file.path)

    @property
    def direct(self) -> bool:
        return self._file.direct

    @property
    def alignment(self) -> Tuple[int, int]:
        return self._file.alignment

    def __enter__(self) -> _NativeOutputFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}; got {engine!r}")


def open_output(path: PathLike, size: int, *, engine: str, direct: bool,
                existing: bool = False) -> OutputFile:
    """Create ``path`` (it must not exist) with ``size`` bytes reserved, for writing from memory.

    ``existing``: open the regular file already at ``path`` instead, to write over its blocks
    (a recycled file: the filesystem allocates nothing it already holds, and frees nothing, so a
    drive mounted with online discard gets no discards). Its old bytes stay until overwritten;
    ``commit`` cuts the file to the size written.

    O_DIRECT where the filesystem allows it and ``direct`` asks for it (``.direct`` says which
    happened). A full disk raises OSError(ENOSPC) here, before any data is written.
    """
    _check_engine(engine)
    if engine == "python":
        return PythonOutputFile(os.fspath(path), int(size), bool(direct), native=_NATIVE,
                                existing=bool(existing))
    return _NativeOutputFile(path, size, engine, direct, existing)


def read_into(path: PathLike, buffer: Any, length: int, *, engine: str, chunk_size: int,
              queue_depth: int, direct: bool) -> Dict[str, Any]:
    """Read the first ``length`` bytes of ``path`` into the writable ``buffer``.

    With O_DIRECT the last request is rounded up to the alignment, so give ``buffer`` room for
    ``length`` rounded up to 4096 and a page-aligned address (``mmap``). A file shorter than
    ``length`` raises OSError(ENODATA). Returns bytes, seconds, requests, counts, min_ns,
    max_ns, sum_ns, engine and direct.
    """
    _check_engine(engine)
    if engine == "python":
        return python_read_into(os.fspath(path), buffer, int(length), int(chunk_size),
                                int(queue_depth), bool(direct), native=_NATIVE)
    return _core.read_file_into(os.fsencode(path), buffer, int(length), int(chunk_size),
                                int(queue_depth), engine, bool(direct))


class RangeReader(Protocol):
    """Scattered reads of one file (see csrc/io/range_reader.hpp for the contract).

    ``read(buffer, ranges, *, queue_depth, request_size) -> dict`` reads each row
    ``(file offset, length, buffer offset)`` of the ``(n, 3)`` uint64 array ``ranges`` into the
    writable ``buffer``, every request in flight together (``queue_depth`` at a time, a range
    cut into ``request_size`` requests). With O_DIRECT (``direct``) offsets and lengths are
    multiples of ``alignment[0]`` and buffer addresses of ``alignment[1]``; a range may run
    past the end of the file (``size``) only within its last alignment unit. Returns bytes,
    requests, seconds, max_ns, sum_ns, engine and direct. Safe to call from many threads.
    """

    path: str
    engine: str

    @property
    def direct(self) -> bool: ...
    @property
    def size(self) -> int: ...
    @property
    def alignment(self) -> Tuple[int, int]: ...
    def read(self, buffer: Any, ranges: np.ndarray, *, queue_depth: int = 32,
             request_size: int = 128 << 10) -> Dict[str, Any]: ...
    def close(self) -> None: ...


class _NativeRangeFile:
    """``RangeReader`` on the C++ core. A fork() child opens its own on first use (the
    parent's engines are the parent's: see csrc/common/owner_process.hpp)."""

    def __init__(self, path: PathLike, engine: str, direct: bool) -> None:
        self.path = os.fsdecode(path)
        self.engine = engine
        self._want_direct = bool(direct)
        self._file = _core.RangeFile(os.fsencode(path), self._want_direct)
        self._pid = os.getpid()

    def read(self, buffer: Any, ranges: np.ndarray, *, queue_depth: int = 32,
             request_size: int = 128 << 10) -> Dict[str, Any]:
        if self._pid != os.getpid():
            self._file = _core.RangeFile(os.fsencode(self.path), self._want_direct)
            self._pid = os.getpid()
        flat = np.ascontiguousarray(ranges, dtype=np.uint64).reshape(-1)
        return self._file.read(buffer, flat, self.engine, int(queue_depth), int(request_size))

    def close(self) -> None:
        self._file.close()

    @property
    def direct(self) -> bool:
        return self._file.direct

    @property
    def size(self) -> int:
        return self._file.size

    @property
    def alignment(self) -> Tuple[int, int]:
        return self._file.alignment


def open_ranges(path: PathLike, *, engine: str, direct: bool) -> RangeReader:
    """``path`` opened for scattered reads into caller memory (:class:`RangeReader`), with
    O_DIRECT where the filesystem takes it and ``direct`` asks for it (``.direct`` says)."""
    _check_engine(engine)
    if engine == "python":
        return PythonRangeFile(os.fspath(path), bool(direct))
    return _NativeRangeFile(path, engine, direct)


def uring_available() -> bool:
    """True when this process may create an io_uring instance (kernel, sysctl and seccomp)."""
    return bool(_core.uring_available())


def engine_name(kind: str) -> str:
    """The engine ``kind`` resolves to here: ``uring``, ``threads`` or ``python``."""
    if kind == "auto":
        return "uring" if uring_available() else "threads"
    return kind


def open_reader(extents: Sequence[Extent], settings: IOSettings) -> ChunkReader:
    """A reader delivering the extents' bytes in order, chunk by chunk, reads kept in flight."""
    extent_list: List[Extent] = [(os.fspath(p), int(s), int(e)) for p, s, e in extents]
    if settings.engine == "python":
        return PythonReader(extent_list, settings.chunk_size, settings.queue_depth,
                            settings.direct, native=_NATIVE)
    # Paths cross as bytes (os.fsencode) so names that are not valid UTF-8 work too.
    encoded = [(os.fsencode(p), s, e) for p, s, e in extent_list]
    return _core.Reader(encoded, settings.chunk_size, settings.queue_depth, settings.engine,
                        settings.direct)


#: One shard's indexing by :func:`index_shards`: ``(outcome, offsets, ends, error, sequential,
#: hops)``; outcome ``indexed``, ``failed`` (error holds the exception: OSError or
#: FormatError), ``compressed`` or ``full_scan`` (both left to the reader's own pass).
ShardIndexing = Tuple[str, Any, Any, Optional[BaseException], bool, int]


def index_shards(paths: Sequence[str], settings: IOSettings, hop_threshold: int,
                 hop_read: int = 4096) -> Tuple[List[ShardIndexing], Dict[str, Any]]:
    """Index tar shards in C++ without building samples: hop from header to header, or read
    a shard sequentially once it advanced fewer than ``hop_threshold`` bytes per hop (0: always
    hop; 2**64 - 1: never). The GIL is released throughout. Returns one result per path and
    the run's figures (bytes_read, requests, engine)."""
    if settings.engine == "python":
        raise ValueError("index_shards needs a C++ engine: auto, uring or threads")
    return _core.index_shards([os.fsencode(p) for p in paths], settings.engine,
                              settings.queue_depth, settings.direct, settings.chunk_size,
                              hop_read, hop_threshold)


def copy_ranges(triples: Any, threads: int = 1) -> None:
    """Copy raw memory: ``triples`` is a flat uint64 numpy array ``[src, dst, len, ...]``.

    One call for any number of copies, the GIL released, the bytes shared evenly over
    ``threads`` plain threads (not torch's OpenMP pool: see csrc/snapshot/copy_ranges.hpp).
    The caller keeps every source and destination alive until it returns.
    """
    _core.copy_ranges(triples, max(1, int(threads)))


#: ``CowSnapshot``: a copy-on-write snapshot in progress (``wait()``, ``done()``, ``stats()``).
CowSnapshot = _core.CowSnapshot
CopyRange = Tuple[int, int, int]  # src address, dst address, length in bytes


def cow_available() -> bool:
    """True when this process can write-protect memory with userfaultfd, kernel writes included.

    Needs root, CAP_SYS_PTRACE or ``vm.unprivileged_userfaultfd=1``; elsewhere (see
    :func:`cow_mode`) :func:`cow_snapshot` copies everything eagerly.
    """
    return bool(_core.cow_available())


#: Linux 5.19 drops write protection from the pages a fork() child inherits ("mm/userfaultfd: fix
#: uffd-wp special cases for fork()"); before it a child could keep protected pages with no
#: handler behind them.
_COW_DEFAULT_KERNEL = (5, 19)


def cow_preferred() -> bool:
    """Whether ``snapshot="auto"`` (the CheckpointWriter default) takes the copy-on-write path.

    Needs :func:`cow_available` and a kernel from 5.19 on, where a process may fork (DataLoader
    workers starting) while its snapshot is still being copied.
    """
    return cow_available() and _kernel_version() >= _COW_DEFAULT_KERNEL


def _kernel_version() -> Tuple[int, int]:
    numbers = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return (int(numbers.group(1)), int(numbers.group(2))) if numbers else (0, 0)


def cow_mode() -> str:
    """``full``, ``user`` (UFFD_USER_MODE_ONLY: read(2) into protected memory fails) or ``none``."""
    return str(_core.cow_mode())


def cow_snapshot(ranges: Sequence[CopyRange], block: int = 2 << 20, *,
                 allow_user_mode_only: bool = False) -> Any:
    """Snapshot raw memory ``ranges`` ``(src_ptr, dst_ptr, len)`` into their destinations.

    Returns once every byte is either copied or write-protected, so the caller may modify the
    sources at once; the protected bytes are copied in the background (a write to one first
    copies its block). Call ``wait()`` on the result before reading the destinations, and keep
    the source and destination memory alive until then. Destinations must not overlap sources
    (ValueError, raised before anything is protected, as for any malformed range).
    """
    checked: List[CopyRange] = []
    for i, r in enumerate(ranges):
        if len(r) != 3:
            raise ValueError(f"range {i} must be (src_ptr, dst_ptr, len), got {r!r}")
        src, dst, length = (int(v) for v in r)
        if min(src, dst, length) < 0 or max(src + length, dst + length) >= 1 << 64:
            raise ValueError(f"range {i} is not a valid (src_ptr, dst_ptr, len): {r!r}")
        checked.append((src, dst, length))
    if int(block) <= 0:
        raise ValueError(f"block must be a positive multiple of the page size, got {block}")
    return _core.CowSnapshot(checked, int(block), bool(allow_user_mode_only))
