"""An IVF index served from the drive by O_DIRECT reads, not by the page cache.

The file is mirrored by an anonymous mapping of its size, the *image*: byte i of the file, once
fetched, sits at image offset i. The header (IVF fields, coarse quantizer, codec) is fetched at
open and FAISS parses it from the image with its zero-copy reader, which points every inverted
list at its place in the image without touching it. Untouched pages of an anonymous mapping
cost no memory, so only the header and the lists fetched take RAM.

A search runs the coarse quantizer, holds the lists it probes in the list cache, fetches those
not in memory in one call (aligned O_DIRECT ranges straight into the image, all in flight at
once), and lets FAISS scan them in place (``search_preassigned`` with the coarse distances, as
FAISS's own ``search`` does: same ids, same distances). A list dropped from the cache gives its
pages back (``MADV_DONTNEED``), so the image reads as zeros there again: only the cache's holds
stop a scan from reading a list that is not there.
"""

from __future__ import annotations

import mmap
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

from .. import engine
from ..errors import IndexFormatError
from ..settings import resolve
from ..sizes import Size, parse_size
from .ivf_layout import LayoutUnknown, ListLayout, check_views, find_lists_tag, parse_lists
from .list_cache import ListCache

__all__ = ["DIRECT_KINDS", "DirectConfig", "DirectLists", "LayoutUnknown"]

#: Index types whose lists a search fetches itself (the others are memory-mapped).
DIRECT_KINDS = ("IndexIVFFlat", "IndexIVFPQ", "IndexIVFScalarQuantizer")

_PAGE = mmap.PAGESIZE
# Header bytes fetched at a time while FAISS parses the header (one request each).
_HEADER_CHUNK = 1 << 20


@dataclass(frozen=True)
class DirectConfig:
    """How lists are fetched and kept. ``list_cache``: bytes of lists kept in memory (int or
    ``"512MiB"``; 0 keeps none beyond the searches that use them). ``engine`` and
    ``queue_depth``: as everywhere (None: the process settings, ``FLASHSTREAM_*``).
    ``request_size``: a list longer than this is read by several requests in flight."""

    list_cache: Size = "512MiB"
    engine: Any = None
    queue_depth: Any = None
    request_size: Size = "128KiB"

    def __post_init__(self) -> None:
        settings = resolve(engine=self.engine, queue_depth=self.queue_depth)
        object.__setattr__(self, "engine", settings.engine)
        object.__setattr__(self, "queue_depth", settings.queue_depth)
        object.__setattr__(self, "list_cache", parse_size(self.list_cache, name="list_cache"))
        size = parse_size(self.request_size, name="request_size")
        if size < 4096 or size % 4096:
            raise ValueError(f"request_size must be a positive multiple of 4KiB, got {size}")
        object.__setattr__(self, "request_size", size)


class DirectLists:
    """One IVF index file served by fetching its lists (see the module docstring).

    ``path`` names the file in errors; ``file`` is the file opened for scattered reads
    (closed here on failure, and by :meth:`close`). IndexFormatError for a damaged file;
    LayoutUnknown for a file FAISS reads but whose lists are not laid out as this module knows
    (the caller serves it memory-mapped instead)."""

    def __init__(self, faiss: Any, path: str, file: engine.RangeReader,
                 config: DirectConfig) -> None:
        self.path, self.config, self.file = path, config, file
        self._swig_ptr = faiss.swig_ptr
        self._users = 0  # searches running: close() leaves the file open for them
        self._closing = False
        self._state_lock = threading.Lock()
        try:
            size, align = self.file.size, self.file.alignment[0]
            self._align = align
            # Private: MADV_DONTNEED then frees a page (a shared anonymous page would stay).
            self._image = mmap.mmap(-1, _round_up(max(size, 1), max(_PAGE, align)),
                                    flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_NOHUGEPAGE"):  # else one list would fault in 2 MiB
                self._image.madvise(mmap.MADV_NOHUGEPAGE)
            self._bytes = np.frombuffer(self._image, dtype=np.uint8)
            self.base = int(self._bytes.ctypes.data)
            self._filled = 0
            start = time.perf_counter()
            self.layout = self._locate(faiss, size)
            self.index, self.ivf = self._load(faiss, size)
            self._quantizer = self.ivf.quantizer
            # Header fetches ran on into the first lists: give those pages back (those lists
            # are not resident; held, they are fetched again).
            keep = _round_up(self.layout.data_start, _PAGE)
            if self._filled > keep:
                self._image.madvise(mmap.MADV_DONTNEED, keep, self._filled - keep)
            self.open_s = time.perf_counter() - start
        except BaseException:
            self.file.close()
            raise
        self.cache = ListCache(self.layout.nbytes, config.list_cache, self._drop)
        self._empty = {-1, *np.flatnonzero(self.layout.nbytes == 0).tolist()}
        self._fetch_lock = threading.Lock()
        self._fetches = dict(calls=0, requests=0, bytes=0, seconds=0.0, max_s=0.0)

    # -- opening ---------------------------------------------------------------------------------
    def _read_at(self, offset: int, n: int) -> bytes:
        """The file's bytes [offset, offset + n), fetched into the image as far as needed."""
        self._fill(offset + n)
        return self._image[offset:offset + n]

    def _fill(self, end: int) -> None:
        """Fetch the file's start up to ``end`` (the header) into the image."""
        end = min(end, self.file.size)
        if end <= self._filled:
            return
        want = _round_up(max(end, self._filled + _HEADER_CHUNK), self._align)
        want = min(want, _round_up(self.file.size, self._align))
        self.file.read(self._image, np.array([[self._filled, want - self._filled,
                                               self._filled]], dtype=np.uint64),
                       queue_depth=self.config.queue_depth,
                       request_size=self.config.request_size)
        self._filled = want

    def _locate(self, faiss: Any, size: int) -> ListLayout:
        table = find_lists_tag(faiss, self.path, size, self._read_at)
        return parse_lists(self.path, size, table, self._read_at)

    def _load(self, faiss: Any, size: int) -> Tuple[Any, Any]:
        self._fill(self.layout.data_start)
        reader = faiss.ZeroCopyIOReader(faiss.swig_ptr(self._bytes), size)
        try:
            index = faiss.read_index(reader)
        except RuntimeError as e:
            detail = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise IndexFormatError(self.path, f"FAISS cannot read it (truncated or corrupt?): "
                                              f"{detail}") from None
        ivf = faiss.extract_index_ivf(index)
        lists = faiss.downcast_InvertedLists(ivf.invlists)
        if not isinstance(lists, faiss.ArrayInvertedLists):
            raise LayoutUnknown(f"FAISS loads its lists as {type(lists).__name__}")
        if int(ivf.nlist) != self.layout.nlist:
            raise IndexFormatError(self.path, f"the list table at offset "
                                              f"{self.layout.table_start} has "
                                              f"{self.layout.nlist} lists, the index "
                                              f"{int(ivf.nlist)}")
        check_views(self.layout, lists, self.base)
        return index, ivf

    # -- searching -------------------------------------------------------------------------------
    def search(self, x: np.ndarray, k: int, nprobe: int) -> Tuple[np.ndarray, np.ndarray]:
        """FAISS's ``search`` for the float32 (n, d) ``x``, the probed lists fetched first."""
        with self._state_lock:
            if self._closing:
                raise ValueError(f"the index {self.path} is closed")
            self._users += 1
        try:
            return self._search(x, k, nprobe)
        finally:
            with self._state_lock:
                self._users -= 1
                last = self._closing and not self._users
            if last:
                self.file.close()

    def _search(self, x: np.ndarray, k: int, nprobe: int) -> Tuple[np.ndarray, np.ndarray]:
        n = len(x)
        probe = min(int(nprobe), self.layout.nlist)
        swig_ptr = self._swig_ptr
        xp = swig_ptr(x)
        # FAISS's search does the same two steps (quantizer, then search_preassigned with the
        # coarse distances); the wrappers' checks are left out: the reader checked x.
        coarse_d = np.empty((n, probe), dtype=np.float32)
        coarse_i = np.empty((n, probe), dtype=np.int64)
        self._quantizer.search_c(n, xp, probe, swig_ptr(coarse_d), swig_ptr(coarse_i), None)
        # The distinct lists probed, less empty ones (and -1: no list found). A set: faster
        # than numpy for the few dozen a search probes.
        wanted = sorted(set(coarse_i.ravel().tolist()) - self._empty)
        fetch, waits = self.cache.acquire(wanted)
        try:
            if fetch:
                try:
                    self._fetch(fetch)
                except BaseException as e:
                    self.cache.fetched(fetch, e)
                    raise
                self.cache.fetched(fetch)
            for pending in waits:
                pending.wait()
            distances = np.empty((n, k), dtype=np.float32)
            labels = np.empty((n, k), dtype=np.int64)
            self.ivf.search_preassigned_c(n, xp, k, swig_ptr(coarse_i), swig_ptr(coarse_d),
                                          swig_ptr(distances), swig_ptr(labels), False)
        finally:
            self.cache.release(wanted)
        return distances, labels

    def _fetch(self, lists: List[int]) -> None:
        """Read ``lists`` into the image: aligned ranges, touching ones merged, one call."""
        if not lists:
            return
        layout = self.layout
        ids = np.asarray(lists, dtype=np.int64)
        a = self._align
        lo = layout.offsets[ids] // a * a
        hi = np.minimum(-(-layout.ends()[ids] // a) * a, _round_up(layout.file_size, a))
        order = np.argsort(lo, kind="stable")
        lo, hi = lo[order], hi[order]
        reach = np.maximum.accumulate(hi)
        first = np.flatnonzero(np.r_[True, lo[1:] > reach[:-1]])
        starts, ends = lo[first], np.maximum.reduceat(hi, first)
        ranges = np.stack([starts, ends - starts, starts], axis=1).astype(np.uint64)
        result = self.file.read(self._image, ranges, queue_depth=self.config.queue_depth,
                                request_size=self.config.request_size)
        with self._fetch_lock:
            f = self._fetches
            f["calls"] += 1
            f["requests"] += int(result["requests"])
            f["bytes"] += int(result["bytes"])
            f["seconds"] += float(result["seconds"])
            f["max_s"] = max(f["max_s"], float(result["seconds"]))

    def _drop(self, i: int, occupied: Callable[[int], bool]) -> None:
        """Give list i's pages back, except one it shares with a list still in memory, or with
        the header (the quantizer's centroids are views into it)."""
        layout = self.layout
        start, end = int(layout.offsets[i]), int(layout.offsets[i] + layout.nbytes[i])
        first = max(start // _PAGE, -(-layout.data_start // _PAGE))
        last = -(-end // _PAGE)  # one past the last page
        if start % _PAGE and first == start // _PAGE and _shares(layout, i, -1, first, occupied):
            first += 1
        if end % _PAGE and last - 1 >= first and _shares(layout, i, 1, last - 1, occupied):
            last -= 1
        if last > first:
            self._image.madvise(mmap.MADV_DONTNEED, first * _PAGE, (last - first) * _PAGE)

    # -- state -----------------------------------------------------------------------------------
    def evict(self) -> int:
        """Empty the list cache (lists in use go when their scans end). Returns lists dropped."""
        return self.cache.evict_all()

    def stats(self) -> Dict[str, Any]:
        with self._fetch_lock:
            fetches = dict(self._fetches)
        return {"list_cache": self.cache.stats().to_dict(), "fetches": fetches,
                "header_bytes": self.layout.data_start, "lists": self.layout.nlist,
                "list_bytes": int(self.layout.nbytes.sum())}

    def close(self) -> None:
        """No new searches; the file closes when the searches running now have ended. The
        image and the index go with this object (each search holds it while it runs)."""
        with self._state_lock:
            self._closing = True
            idle = not self._users
        if idle:
            self.file.close()


def _shares(layout: ListLayout, i: int, step: int, page: int,
            occupied: Callable[[int], bool]) -> bool:
    """Whether a list other than i that lies partly on ``page`` is in memory, looking from i
    towards lower (step -1) or higher (+1) lists. Lists are contiguous in the file."""
    lo, hi = page * _PAGE, (page + 1) * _PAGE
    j = i + step
    while 0 <= j < layout.nlist:
        start, end = int(layout.offsets[j]), int(layout.offsets[j] + layout.nbytes[j])
        if end <= lo or start >= hi:
            if layout.nbytes[j]:
                return False
        elif occupied(j):
            return True
        j += step
    return False


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit
