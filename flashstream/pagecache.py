"""Page-cache control for honest measurements: evict files, and check how much is resident.

``evict`` asks the kernel to drop a file's cached pages (``POSIX_FADV_DONTNEED`` after
flushing dirty ones); ``residency`` counts resident pages with ``mincore`` on a private
read-only mapping. A cold benchmark evicts, then checks residency afterwards.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from typing import Iterable, Union

import numpy

__all__ = ["evict", "residency", "resident_bytes"]

PathLike = Union[str, os.PathLike]

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value
_PAGE = mmap.PAGESIZE


def evict(paths: Iterable[PathLike]) -> None:
    """Drop the page-cache pages of each file (dirty pages are written back first)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(path: PathLike) -> int:
    """Bytes of ``path`` now in the page cache (page granularity)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), os.fspath(path))
        try:
            pages = (size + _PAGE - 1) // _PAGE
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), os.fspath(path))
            resident = int((numpy.frombuffer(vec, dtype=numpy.uint8) & 1).sum())
        finally:
            _libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)
    return min(size, resident * _PAGE)


def residency(paths: Iterable[PathLike]) -> float:
    """Fraction (0..1) of the files' bytes that are in the page cache."""
    paths = list(paths)
    total = sum(os.path.getsize(p) for p in paths)
    return sum(resident_bytes(p) for p in paths) / total if total else 0.0
