"""IndexReader: a FAISS index served memory-mapped from the drive, with per-call latency.

FAISS maps the file itself, so opening costs milliseconds whatever the size and the page cache
decides what is in memory: IVF indexes through ``IO_FLAG_MMAP`` (the inverted lists are mapped
as they lie in the file), flat and HNSW indexes through ``IO_FLAG_MMAP_IFC`` (codes and graph
point into the mapping). The mapping's readahead is then set for the index type (``advice``).
Every ``search`` call is timed into a thread-safe C++ histogram (the same buckets as the
loader's), and ``residency``/``evict`` show and control how much of the file is cached.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from .. import cache, engine
from ..errors import IndexFormatError
from ..telemetry.histogram import LatencyHistogram
from ..telemetry.read_latency import register_reader
from .kinds import IndexKind, kind_of
from .mapping import ADVICE, FileMapping, advise, drop_pages, mappings_of

__all__ = ["IndexReader", "write_index"]

PathLike = Union[str, os.PathLike]
MMAP_FLAGS = ("IO_FLAG_MMAP_IFC", "IO_FLAG_MMAP")
MmapSetting = Union[bool, str]
ADVICE_SETTINGS = ("auto", *ADVICE)
_METRICS = {0: "inner_product", 1: "l2", 2: "l1", 3: "linf"}  # faiss.MetricType values
_thread = threading.local()


def _faiss():
    try:
        import faiss
    except ImportError as e:  # pragma: no cover - faiss is in the extras
        raise ImportError("IndexReader needs FAISS: pip install faiss-cpu "
                          "(or flashstream[retrieval])") from e
    return faiss


def _single_threaded(faiss) -> None:
    """One OpenMP thread for FAISS calls from this thread (QPS comes from caller threads).

    FAISS's OpenMP setting is per calling thread, so each thread sets it once. It is FAISS's
    own OpenMP runtime: torch's thread settings are untouched."""
    if not getattr(_thread, "faiss_single", False):
        faiss.omp_set_num_threads(1)
        _thread.faiss_single = True


class _Served:
    """One opened index file: the faiss object, the open file (its inode), how it was loaded."""

    def __init__(self, path: str, mmap: MmapSetting, advice: str) -> None:
        self.kind: IndexKind = kind_of(path)
        faiss = _faiss()
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.stat = os.fstat(self.fd)
            before = set(mappings_of(self.stat))
            if isinstance(mmap, str) and not hasattr(faiss, mmap):
                raise ValueError(f"this FAISS ({faiss.__version__}) has no {mmap}; "
                                 f"use mmap=True to pick what it has")
            flags = [f for f in _flag_order(self.kind, mmap) if hasattr(faiss, f)]
            self.io_flag: Optional[str] = None
            self.mappings: List[FileMapping] = []
            for name in flags or [None]:
                flag = getattr(faiss, name) | faiss.IO_FLAG_READ_ONLY if name else 0
                start = time.perf_counter()
                # The descriptor's /proc path: the inode we hold, even if the name moves on.
                self.index: Any = _read(faiss, path, f"/proc/self/fd/{self.fd}", flag)
                self.open_s = time.perf_counter() - start
                self.io_flag = name
                self.mappings = [m for m in mappings_of(self.stat) if m not in before]
                if self.mappings:
                    break  # else this flag read it into RAM: try the next (or keep that)
            self.advice: Optional[str] = None
            if self.mappings:
                self.advice = _resolve_advice(self.kind, advice)
                advise(self.mappings, self.advice)
            if self.io_flag == "IO_FLAG_MMAP" and self.kind.ivf:
                _stop_list_prefetch(faiss, self.index)
            self.d = int(self.index.d)
        except BaseException:
            os.close(self.fd)
            raise

    @property
    def mapped_bytes(self) -> int:
        return sum(m.length for m in self.mappings)

    def close(self) -> None:
        self.index = None  # FAISS unmaps when the index is freed (after in-flight searches)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _flag_order(kind: IndexKind, mmap: MmapSetting) -> Tuple[str, ...]:
    """The FAISS mapping flags to try, best first; () reads the index into RAM.

    IVF: IO_FLAG_MMAP first. It maps the file and points each inverted list into it (0.5 ms for
    a 1.4 GiB IVF-Flat). IO_FLAG_MMAP_IFC maps too, but first allocates and zeroes a heap
    buffer the size of each list, only to swap it for the mapped view: 26-80 ms of memset for
    that index, growing with the index. Flat and HNSW: only IO_FLAG_MMAP_IFC maps them
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
    will probe. Warm, that thread churn cut single-thread IVF-PQ QPS from 630 to 376 here; cold,
    the kernel's readahead on the mapping already reads each list in long requests (100 cold
    IVF-Flat searches: 10.2 ms mean without the threads, 14.4 ms with). So: no prefetch threads."""
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


class IndexReader:
    """A FAISS index opened read-only, memory-mapped by default, that times every search.

    ``IndexReader(path, mmap=True)`` maps the file (milliseconds for any size) with the best
    FAISS flag for its type (or the one named: ``"IO_FLAG_MMAP_IFC"``, ``"IO_FLAG_MMAP"``);
    ``mmap=False`` reads it all into RAM, for comparison. Supports IndexFlat (L2/IP), IndexIVFFlat,
    IndexIVFPQ and IndexHNSWFlat; other files raise IndexFormatError listing those.
    ``advice`` sets the mapping's readahead: ``"auto"`` (kernel readahead for flat and IVF,
    none for HNSW), ``"normal"``, ``"random"`` or ``"sequential"``.
    ``nprobe`` (IVF) and ``ef_search`` (HNSW) set the search breadth.

    ``search`` is safe to call from many threads at once; each call runs single-threaded in
    FAISS, so throughput comes from caller threads. Replace the file on disk only by writing a
    new file and renaming it over the old one (``write_index`` does): a reader keeps serving the
    file it opened, and ``refresh()`` switches to the new one.
    """

    def __init__(self, path: PathLike, *, mmap: MmapSetting = True, advice: str = "auto",
                 nprobe: Optional[int] = None, ef_search: Optional[int] = None) -> None:
        self.path = os.fspath(path)
        if not (isinstance(mmap, bool) or mmap in MMAP_FLAGS):
            raise ValueError(f"mmap must be True, False or one of {', '.join(MMAP_FLAGS)}, "
                             f"got {mmap!r}")
        if advice not in ADVICE_SETTINGS:
            raise ValueError(f"advice must be one of {', '.join(ADVICE_SETTINGS)}, "
                             f"got {advice!r}")
        self.mmap = mmap
        self.advice = advice
        self._recorder = engine.LatencyRecorder()
        register_reader(self)  # its searches count toward CheckpointWriter(read_slo=)
        self._lock = threading.Lock()  # refresh/close against each other
        self._served: Optional[_Served] = _Served(self.path, self.mmap, self.advice)
        self._nprobe: Optional[int] = None
        self._ef_search: Optional[int] = None
        self.configure(nprobe=nprobe, ef_search=ef_search)

    # -- serving ---------------------------------------------------------------------------------
    @property
    def index(self) -> Any:
        """The faiss index object (do not change it while searches run)."""
        return self._open().index

    @property
    def d(self) -> int:
        return int(self.index.d)

    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)

    def configure(self, *, nprobe: Optional[int] = None, ef_search: Optional[int] = None) -> None:
        """Set IVF ``nprobe`` and/or HNSW ``ef_search`` (None leaves a setting as it is)."""
        served = self._open()
        for name, value, applies in (("nprobe", nprobe, served.kind.ivf),
                                     ("ef_search", ef_search, served.kind.hnsw)):
            if value is None:
                continue
            if not applies:
                raise ValueError(f"{name} does not apply to {served.kind.name}; "
                                 f"nprobe is for IVF indexes, ef_search for HNSW")
            if int(value) < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if nprobe is not None:
            self._nprobe = int(nprobe)
        if ef_search is not None:
            self._ef_search = int(ef_search)
        self._apply(served)

    def _apply(self, served: _Served) -> None:
        if self._nprobe is not None:
            served.index.nprobe = self._nprobe
        if self._ef_search is not None:
            served.index.hnsw.efSearch = self._ef_search

    def search(self, queries: Any, k: int) -> Tuple[np.ndarray, np.ndarray]:
        """FAISS's ``(distances, labels)`` for ``queries`` (n x d, or one vector of d).

        The call's latency is recorded (one sample per call: call it one query at a time for
        per-query latency)."""
        served = self._open()
        index = served.index  # a local reference: a concurrent refresh cannot free it
        q = queries
        if not (type(q) is np.ndarray and q.dtype == np.float32 and q.flags.c_contiguous):
            q = np.ascontiguousarray(q, dtype=np.float32)
        if q.ndim == 1:
            q = q.reshape(1, -1)
        if q.ndim != 2 or q.shape[1] != served.d:
            raise ValueError(f"queries must have shape (n, {served.d}) or ({served.d},), "
                             f"got {np.shape(queries)}")
        if type(k) is not int and (isinstance(k, bool) or not isinstance(k, np.integer)):
            raise ValueError(f"k must be a positive integer, got {k!r}")
        if k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        if not getattr(_thread, "faiss_single", False):
            _single_threaded(_faiss())
        start = time.perf_counter_ns()
        result = index.search(q, int(k))
        self._recorder.stop(start)
        return result

    def latency(self, *, reset: bool = False) -> LatencyHistogram:
        """The latencies of every ``search`` call so far (with ``reset``, then start over)."""
        return LatencyHistogram.from_core(self._recorder.snapshot(bool(reset)))

    def reset_latency(self) -> None:
        self._recorder.snapshot(True)

    # -- page cache ------------------------------------------------------------------------------
    def residency(self) -> float:
        """Fraction (0..1) of the served file now in the page cache (mincore on a mapping)."""
        served = self._open()
        size = served.stat.st_size
        return cache.resident_bytes(f"/proc/self/fd/{served.fd}") / size if size else 0.0

    def evict(self) -> float:
        """Make the next searches cold: drop this process's mapped pages of the file, then the
        file's page cache. Returns ``residency()`` afterwards (near 0 unless another process
        maps the file). With ``mmap=False`` the index itself stays in RAM."""
        served = self._open()
        drop_pages(mappings_of(served.stat))
        cache.evict([f"/proc/self/fd/{served.fd}"])
        return self.residency()

    # -- lifecycle -------------------------------------------------------------------------------
    def refresh(self) -> bool:
        """Serve the file now at ``path`` if it was replaced since opening; True if it was.

        Searches already running finish on the old index, which is freed after them."""
        with self._lock:
            served = self._open()
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == (served.stat.st_dev, served.stat.st_ino):
                return False
            fresh = _Served(self.path, self.mmap, self.advice)
            self._apply(fresh)
            self._served = fresh
        served.close()
        return True

    def info(self) -> Dict[str, object]:
        """How the index is served: type, size, mapping flag and mapped bytes, open time."""
        served = self._open()
        index = served.index
        size = served.stat.st_size
        return {
            "path": self.path,
            "type": type(index).__name__,
            "kind": served.kind.name,
            "d": int(index.d),
            "ntotal": int(index.ntotal),
            "metric": _METRICS.get(int(index.metric_type), f"metric {int(index.metric_type)}"),
            "file_bytes": size,
            "mmap": bool(self.mmap),
            "io_flag": served.io_flag,
            "advice": served.advice,
            "mapped_bytes": served.mapped_bytes,
            "mapped_fraction": min(1.0, served.mapped_bytes / size) if size else 0.0,
            "open_s": served.open_s,
            "nprobe": int(index.nprobe) if served.kind.ivf else None,
            "ef_search": int(index.hnsw.efSearch) if served.kind.hnsw else None,
            "searches": self.latency().count,
        }

    def close(self) -> None:
        with self._lock:
            served, self._served = self._served, None
        if served is not None:
            served.close()

    def _open(self) -> _Served:
        served = self._served
        if served is None:
            raise ValueError(f"IndexReader for {self.path} is closed")
        return served

    def __enter__(self) -> IndexReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._served is None:
            return f"IndexReader({self.path!r}, closed)"
        how = self._served.io_flag or "in RAM"
        return f"IndexReader({self.path!r}, {self._served.kind.name}, {how})"


def write_index(index: Any, path: PathLike) -> Path:
    """Write a FAISS index so that readers never see a partial file: write a temporary file in
    the same directory, fsync it, rename it over ``path``, fsync the directory."""
    faiss = _faiss()
    target = Path(path)
    if not target.parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, "no such directory", str(target.parent))
    temp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        faiss.write_index(index, str(temp))
        fd = os.open(temp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return target
