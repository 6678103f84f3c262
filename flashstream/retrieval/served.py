"""One opened index file, and how it is served: lists fetched from the drive (``direct``),
memory-mapped by FAISS (``mmap``), or read into RAM (``ram``).

``io="auto"`` serves the IVF kinds whose lists this package can fetch itself (IVF-Flat,
IVF-PQ, IVF-SQ) directly, anything else memory-mapped, and says why in ``io_reason``. The
decision is made from the file's type tag, read with O_DIRECT like everything else a direct
reader reads, so that serving directly leaves the page cache alone.

Memory-mapped, FAISS maps the file itself: IVF indexes through ``IO_FLAG_MMAP`` (the inverted
lists are mapped as they lie in the file), flat and HNSW indexes through ``IO_FLAG_MMAP_IFC``
(codes and graph point into the mapping); the mapping's readahead is then set for the type.
"""

from __future__ import annotations

import mmap as _mmap
import os
import time
from typing import Any, List, Optional, Tuple, Union

import numpy as np

from .. import engine
from ..errors import IndexFormatError
from ..mappings import FileMapping, advise, mappings_of
from .direct import DIRECT_KINDS, DirectConfig, DirectLists, LayoutUnknown
from .kinds import IndexKind, kind_of, kind_of_tag

__all__ = ["IO_MODES", "MMAP_FLAGS", "MmapSetting", "Served", "faiss_module"]

IO_MODES = ("auto", "direct", "mmap")
MMAP_FLAGS = ("IO_FLAG_MMAP_IFC", "IO_FLAG_MMAP")
MmapSetting = Union[bool, str]


def faiss_module():
    try:
        import faiss
    except ImportError as e:  # pragma: no cover - faiss is in the extras
        raise ImportError("IndexReader needs FAISS: pip install faiss-cpu "
                          "(or flashstream[retrieval])") from e
    return faiss


class Served:
    """One opened index file: the faiss object, the open file (its inode), how it is served."""

    def __init__(self, path: str, io: str, mmap: MmapSetting, advice: str,
                 config: DirectConfig) -> None:
        faiss = faiss_module()
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.stat = os.fstat(self.fd)
            # The descriptor's /proc path: the inode we hold, even if the name moves on.
            self.source = f"/proc/self/fd/{self.fd}"
            self.direct: Optional[DirectLists] = None
            self.io_reason: Optional[str] = None
            self.io_flag: Optional[str] = None
            self.mappings: List[FileMapping] = []
            self.advice: Optional[str] = None
            # auto: direct unless a mapping flag or RAM was asked for by name.
            if io == "direct" or (io == "auto" and mmap is True):
                self.kind = self._open_direct(faiss, path, config)
            else:
                self.kind = kind_of(path)
            if self.direct is None:
                self._open_mapped(faiss, path, mmap, advice)
            self.io = "direct" if self.direct else "mmap" if self.mappings else "ram"
            self.d = int(self.index.d)
        except BaseException:
            os.close(self.fd)
            raise

    def _open_direct(self, faiss, path: str, config: DirectConfig) -> IndexKind:
        """Serve directly if the kind and the layout allow it; returns the kind either way."""
        file = engine.open_ranges(self.source, engine=config.engine, direct=True)
        try:
            kind = kind_of_tag(path, _first_bytes(file), file.size)
            if kind.name not in DIRECT_KINDS:
                self.io_reason = (f"{kind.name} is memory-mapped: direct reads serve "
                                  f"{', '.join(DIRECT_KINDS)}")
            elif not hasattr(faiss, "ZeroCopyIOReader"):
                self.io_reason = (f"this FAISS ({faiss.__version__}) has no ZeroCopyIOReader "
                                  f"(FAISS 1.11 or later): memory-mapped")
            else:
                start = time.perf_counter()
                self.direct = DirectLists(faiss, path, file, config)
                self.index = self.direct.index
                self.open_s = time.perf_counter() - start
                if not file.direct:
                    self.io_reason = "the filesystem refuses O_DIRECT: lists are read buffered"
                return kind
        except LayoutUnknown as e:  # DirectLists closed the file
            self.io_reason = f"lists not laid out as direct reads know ({e}): memory-mapped"
            return kind
        except BaseException:
            file.close()
            raise
        file.close()
        return kind

    def _open_mapped(self, faiss, path: str, mmap: MmapSetting, advice: str) -> None:
        before = set(mappings_of(self.stat))
        if isinstance(mmap, str) and not hasattr(faiss, mmap):
            raise ValueError(f"this FAISS ({faiss.__version__}) has no {mmap}; "
                             f"use mmap=True to pick what it has")
        flags = [f for f in _flag_order(self.kind, mmap) if hasattr(faiss, f)]
        for name in flags or [None]:
            flag = getattr(faiss, name) | faiss.IO_FLAG_READ_ONLY if name else 0
            start = time.perf_counter()
            self.index: Any = _read(faiss, path, self.source, flag)
            self.open_s = time.perf_counter() - start
            self.io_flag = name
            self.mappings = [m for m in mappings_of(self.stat) if m not in before]
            if self.mappings:
                break  # else this flag read it into RAM: try the next (or keep that)
        if self.mappings:
            self.advice = _resolve_advice(self.kind, advice)
            advise(self.mappings, self.advice)
        if self.io_flag == "IO_FLAG_MMAP" and self.kind.ivf:
            _stop_list_prefetch(faiss, self.index)

    @property
    def mapped_bytes(self) -> int:
        return sum(m.length for m in self.mappings)

    def search(self, q: np.ndarray, k: int) -> Tuple[np.ndarray, np.ndarray]:
        if self.direct is not None:
            return self.direct.search(q, k, int(self.index.nprobe))
        return self.index.search(q, k)

    def close(self) -> None:
        if self.direct is not None:
            self.direct.close()  # the file stays open for searches still running
        self.index = None  # FAISS unmaps when the index is freed (after in-flight searches)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _first_bytes(file: engine.RangeReader) -> bytes:
    """The file's first 4 bytes (its FAISS type tag), read the way the lists will be."""
    buffer = _mmap.mmap(-1, max(_mmap.PAGESIZE, file.alignment[0]))
    length = min(file.alignment[0], -(-file.size // file.alignment[0]) * file.alignment[0])
    file.read(buffer, np.array([[0, length, 0]], dtype=np.uint64))
    return bytes(buffer[:min(4, file.size)])


def _flag_order(kind: IndexKind, mmap: MmapSetting) -> Tuple[str, ...]:
    """The FAISS mapping flags to try, best first; () reads the index into RAM.

    IVF: IO_FLAG_MMAP first. It maps the file and points each inverted list into it, at a
    cost that does not grow with the lists. IO_FLAG_MMAP_IFC maps too, but first allocates and
    zeroes a heap buffer the size of each list, only to swap it for the mapped view: a memset
    that grows with the index (docs/benchmarks.md, "Figures behind the defaults"). Flat and
    HNSW: only IO_FLAG_MMAP_IFC maps them
    (IO_FLAG_MMAP would read them into RAM), so it comes first."""
    if mmap is False:
        return ()
    if isinstance(mmap, str):
        return (mmap,)
    return ("IO_FLAG_MMAP", "IO_FLAG_MMAP_IFC") if kind.ivf else MMAP_FLAGS


def _resolve_advice(kind: IndexKind, advice: str) -> str:
    """``auto``: the kernel's readahead ("normal") for flat scans and IVF lists, which are read
    in long runs; "random" (FAISS's own choice) for HNSW, which hops between small vectors."""
    if advice != "auto":
        return advice
    return "random" if kind.hnsw else "normal"


def _stop_list_prefetch(faiss, index) -> None:
    """IO_FLAG_MMAP serves IVF lists through OnDiskInvertedLists, whose ``prefetch_lists`` starts
    up to 32 threads on every search (and joins the previous search's) to touch the lists it
    will probe. Warm, that thread churn costs a large share of single-thread QPS; cold, the
    kernel's readahead on the mapping already reads each list in long requests, and the threads
    only add latency (docs/benchmarks.md, "Figures behind the defaults"). So: no prefetch
    threads."""
    lists = faiss.downcast_InvertedLists(faiss.extract_index_ivf(index).invlists)
    if hasattr(lists, "prefetch_nthread"):
        lists.prefetch_nthread = 0


def _read(faiss, path: str, source: str, flag: int):
    try:
        return faiss.read_index(source, flag)
    except RuntimeError as e:
        detail = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise IndexFormatError(path, f"FAISS cannot read it (truncated or corrupt?): "
                                     f"{detail}") from None
