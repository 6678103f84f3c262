"""Find and drop this process's memory mappings of a file (the ones FAISS made, not ours).

FAISS maps an index file itself when asked to (``IO_FLAG_MMAP_IFC`` / ``IO_FLAG_MMAP``) and does
not tell us where. ``/proc/self/maps`` does: every mapping with the file's device and inode.
Dropping a file's page cache (``POSIX_FADV_DONTNEED``) skips pages some process still maps, so
an honest cold start first unmaps our own pages of it (``MADV_DONTNEED``: for a read-only
shared file mapping the next access simply faults the page back in from the file).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from dataclasses import dataclass
from typing import List

__all__ = ["ADVICE", "FileMapping", "advise", "drop_pages", "mappings_of"]

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)

#: madvise access patterns by name. FAISS maps with MADV_RANDOM, which turns every cold page
#: into its own 4 KiB read; "normal" (the kernel's readahead) or "sequential" make a cold scan
#: many times faster (docs/benchmarks.md, "Figures behind the defaults").
ADVICE = {"normal": getattr(mmap, "MADV_NORMAL", 0), "random": getattr(mmap, "MADV_RANDOM", 1),
          "sequential": getattr(mmap, "MADV_SEQUENTIAL", 2)}


@dataclass(frozen=True)
class FileMapping:
    """One line of /proc/self/maps that maps the file."""

    start: int
    end: int
    offset: int  # file offset of ``start``
    perms: str   # e.g. "r--s"

    @property
    def length(self) -> int:
        return self.end - self.start


def mappings_of(st: os.stat_result, maps_path: str = "/proc/self/maps") -> List[FileMapping]:
    """This process's mappings of the file with ``st``'s device and inode (empty off Linux);
    ``maps_path`` another process's (``/proc/PID/maps``)."""
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    found: List[FileMapping] = []
    try:
        with open(maps_path) as maps:
            lines = maps.readlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split(None, 5)
        if len(fields) < 5 or int(fields[4]) != st.st_ino:
            continue
        dev_major, dev_minor = (int(part, 16) for part in fields[3].split(":"))
        if (dev_major, dev_minor) != (major, minor):
            continue
        start, end = (int(part, 16) for part in fields[0].split("-"))
        found.append(FileMapping(start, end, int(fields[2], 16), fields[1]))
    return found


def advise(found: List[FileMapping], advice: str) -> None:
    """Tell the kernel how the mapped file will be read (one of ``ADVICE``): readahead or not."""
    for m in found:
        if _libc.madvise(ctypes.c_void_p(m.start), m.length, ADVICE[advice]) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise({advice}) of {m.length} bytes: {os.strerror(err)}")


def drop_pages(found: List[FileMapping]) -> int:
    """Unmap the pages of read-only mappings (they fault back in on access); returns bytes."""
    dropped = 0
    for m in found:
        if "w" in m.perms:  # never for a writable mapping: MADV_DONTNEED would lose its data
            continue
        if _libc.madvise(ctypes.c_void_p(m.start), m.length, _MADV_DONTNEED) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise(MADV_DONTNEED) of {m.length} bytes: {os.strerror(err)}")
        dropped += m.length
    return dropped
