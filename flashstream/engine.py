"""The engine facade: the only module that imports the C++ extension.

It picks the read engine (io_uring, thread pool, or the pure-Python reference), opens chunk
readers over file extents, and hands out tar scanners. Everything above it deals in paths,
ints and buffers.
"""

from __future__ import annotations

import os
from typing import List, Optional, Protocol, Sequence, Tuple

from . import _core
from ._pyengine import PythonReader
from .settings import IOSettings

__all__ = [
    "TO_END",
    "ChunkReader",
    "FormatError",
    "Scanner",
    "create_probe_file",
    "engine_name",
    "histogram_bounds",
    "is_meta_name",
    "open_reader",
    "run_probe",
    "split_key",
    "uring_available",
]

#: ``end`` of an extent that reads to the end of the file.
TO_END = (1 << 64) - 1

#: Raised by the scanner for malformed tar data; ``args == (message, offset)``.
FormatError = _core.FormatError
Scanner = _core.Scanner
split_key = _core.split_key
is_meta_name = _core.is_meta_name
#: Lower bound (ns) of every bucket of the core's latency histograms.
histogram_bounds = _core.histogram_bounds
#: One fio-like measurement on an existing file (see flashstream.telemetry.probe).
run_probe = _core.run_probe
#: A file of ``size`` random bytes written with O_DIRECT (space reserved first: ENOSPC early).
create_probe_file = _core.create_probe_file

Chunk = Tuple[int, int, memoryview, bool, bool]  # extent, offset, data, first, last
Extent = Tuple[str, int, int]  # path, start, end (TO_END for the whole file)


class ChunkReader(Protocol):
    """What every engine provides (see csrc/io/sequential_reader.hpp for the contract)."""

    engine: str

    def next(self) -> Optional[Chunk]: ...
    def skip_extent(self) -> None: ...
    def close(self) -> None: ...
    def stats(self) -> dict: ...
    def latency_counts(self): ...


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
                            settings.direct)
    # Paths cross as bytes (os.fsencode) so names that are not valid UTF-8 work too.
    encoded = [(os.fsencode(p), s, e) for p, s, e in extent_list]
    return _core.Reader(encoded, settings.chunk_size, settings.queue_depth, settings.engine,
                        settings.direct)
