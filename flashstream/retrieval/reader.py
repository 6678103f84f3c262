"""IndexReader: a FAISS index served from the drive, with per-call latency.

How the file is served (``io``): IVF-Flat, IVF-PQ and IVF-SQ by fetching the lists each search
probes with O_DIRECT reads into a DRAM list cache (``direct``, see direct.py), anything else
memory-mapped by FAISS (``mmap``), or read into RAM (``mmap=False``); served.py opens it.
Every ``search`` call is timed into a thread-safe C++ histogram (the same buckets as the
loader's), and ``residency``/``evict`` show and control how much of the file is cached.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import numpy as np

from .. import engine as _engine
from .. import pagecache
from ..mappings import ADVICE, drop_pages, mappings_of
from ..sizes import Size
from ..telemetry.histogram import LatencyHistogram
from ..telemetry.read_latency import register_reader
from .direct import DirectConfig
from .served import IO_MODES, MMAP_FLAGS, MmapSetting, Served, faiss_module

__all__ = ["IndexReader", "write_index"]

PathLike = Union[str, os.PathLike]
ADVICE_SETTINGS = ("auto", *ADVICE)
_METRICS = {0: "inner_product", 1: "l2", 2: "l1", 3: "linf"}  # faiss.MetricType values
_thread = threading.local()


def _single_threaded(faiss) -> None:
    """One OpenMP thread for FAISS calls from this thread (QPS comes from caller threads).

    FAISS's OpenMP setting is per calling thread, so each thread sets it once. It is FAISS's
    own OpenMP runtime: torch's thread settings are untouched."""
    if not getattr(_thread, "faiss_single", False):
        faiss.omp_set_num_threads(1)
        _thread.faiss_single = True


class IndexReader:
    """A FAISS index opened read-only from the drive, that times every search.

    ``io`` says how it is served. ``"direct"``: the coarse quantizer and the header in memory,
    the inverted lists each search probes fetched from the drive with O_DIRECT reads (all of a
    search's lists in flight at once) into a DRAM list cache of ``list_cache`` bytes shared by
    every searching thread; the page cache is left alone. For IndexIVFFlat, IndexIVFPQ and
    IndexIVFScalarQuantizer; other types are memory-mapped, and ``info()["io_reason"]`` says
    why. ``"mmap"``: FAISS maps the file (milliseconds for any size) with the best flag for its
    type, or the one named by ``mmap`` (``"IO_FLAG_MMAP_IFC"``, ``"IO_FLAG_MMAP"``); the page
    cache decides what is in memory. ``"auto"`` (the default): direct where it applies, else
    mmap (and mmap when ``mmap`` names a flag). ``mmap=False`` reads the whole index into RAM
    instead, for comparison.

    Supports IndexFlat (L2/IP), IndexIVFFlat, IndexIVFPQ, IndexIVFScalarQuantizer and
    IndexHNSWFlat; other files raise IndexFormatError listing those. ``advice`` sets a
    mapping's readahead: ``"auto"`` (kernel readahead for flat and IVF, none for HNSW),
    ``"normal"``, ``"random"`` or ``"sequential"``. ``nprobe`` (IVF) and ``ef_search`` (HNSW)
    set the search breadth. ``engine`` and ``queue_depth`` choose how direct reads are made
    (None: the process settings, ``FLASHSTREAM_ENGINE`` / ``FLASHSTREAM_QUEUE_DEPTH``).

    ``search`` is safe to call from many threads at once; each call runs single-threaded in
    FAISS, so throughput comes from caller threads. Replace the file on disk only by writing a
    new file and renaming it over the old one (``write_index`` does): a reader keeps serving the
    file it opened, and ``refresh()`` switches to the new one.
    """

    def __init__(self, path: PathLike, *, io: str = "auto", mmap: MmapSetting = True,
                 advice: str = "auto", nprobe: Optional[int] = None,
                 ef_search: Optional[int] = None, list_cache: Size = "512MiB",
                 engine: Optional[str] = None, queue_depth: Optional[int] = None) -> None:
        self.path = os.fspath(path)
        if io not in IO_MODES:
            raise ValueError(f"io must be one of {', '.join(IO_MODES)}, got {io!r}")
        if not (isinstance(mmap, bool) or mmap in MMAP_FLAGS):
            raise ValueError(f"mmap must be True, False or one of {', '.join(MMAP_FLAGS)}, "
                             f"got {mmap!r}")
        if io == "direct" and mmap is False:
            raise ValueError("io='direct' fetches lists from the drive and mmap=False reads "
                             "the whole index into RAM: use one of them")
        if advice not in ADVICE_SETTINGS:
            raise ValueError(f"advice must be one of {', '.join(ADVICE_SETTINGS)}, "
                             f"got {advice!r}")
        self.io, self.mmap, self.advice = io, mmap, advice
        self.direct_config = DirectConfig(list_cache=list_cache, engine=engine,
                                          queue_depth=queue_depth)
        self._recorder = _engine.LatencyRecorder()
        register_reader(self)  # its searches count toward CheckpointWriter(read_slo=)
        self._lock = threading.Lock()  # refresh/close against each other
        self._served: Optional[Served] = self._serve()
        self._nprobe: Optional[int] = None
        self._ef_search: Optional[int] = None
        self.configure(nprobe=nprobe, ef_search=ef_search)

    def _serve(self) -> Served:
        return Served(self.path, self.io, self.mmap, self.advice, self.direct_config)

    # -- serving ---------------------------------------------------------------------------------
    @property
    def index(self) -> Any:
        """The faiss index object (do not change it while searches run). Served directly, its
        inverted lists are in memory only while a ``search`` holds them: search through
        ``search``, never ``index.search``, which would scan absent lists as zeros."""
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

    def _apply(self, served: Served) -> None:
        if self._nprobe is not None:
            served.index.nprobe = self._nprobe
        if self._ef_search is not None:
            served.index.hnsw.efSearch = self._ef_search

    def search(self, queries: Any, k: int) -> Tuple[np.ndarray, np.ndarray]:
        """FAISS's ``(distances, labels)`` for ``queries`` (n x d, or one vector of d).

        The call's latency is recorded (one sample per call: call it one query at a time for
        per-query latency)."""
        served = self._open()  # a local reference: a concurrent refresh cannot free it
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
            _single_threaded(faiss_module())
        start = time.perf_counter_ns()
        result = served.search(q, int(k))
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
        return pagecache.resident_bytes(f"/proc/self/fd/{served.fd}") / size if size else 0.0

    def evict(self) -> float:
        """Make the next searches cold: empty the list cache (direct; lists in use go when
        their searches end), drop this process's mapped pages of the file, then the file's page
        cache. Returns ``residency()`` afterwards (near 0 unless another process maps the
        file). With ``mmap=False`` the index itself stays in RAM."""
        served = self._open()
        if served.direct is not None:
            served.direct.evict()
        drop_pages(mappings_of(served.stat))
        pagecache.evict([f"/proc/self/fd/{served.fd}"])
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
            fresh = self._serve()
            self._apply(fresh)
            self._served = fresh
        served.close()
        return True

    def info(self) -> Dict[str, object]:
        """How the index is served: type, size, ``io`` (``direct``, ``mmap`` or ``ram``) and
        ``io_reason`` (why not direct), mapping flag and mapped bytes, open time; served
        directly, also the list cache's figures and the fetches' (``direct``)."""
        served = self._open()
        index = served.index
        size = served.stat.st_size
        direct = served.direct
        return {
            "path": self.path,
            "type": type(index).__name__,
            "kind": served.kind.name,
            "d": int(index.d),
            "ntotal": int(index.ntotal),
            "metric": _METRICS.get(int(index.metric_type), f"metric {int(index.metric_type)}"),
            "file_bytes": size,
            "io": served.io,
            "io_reason": served.io_reason,
            "o_direct": bool(direct.file.direct) if direct else None,
            "mmap": bool(self.mmap),
            "io_flag": served.io_flag,
            "advice": served.advice,
            "mapped_bytes": served.mapped_bytes,
            "mapped_fraction": min(1.0, served.mapped_bytes / size) if size else 0.0,
            "open_s": served.open_s,
            "nprobe": int(index.nprobe) if served.kind.ivf else None,
            "ef_search": int(index.hnsw.efSearch) if served.kind.hnsw else None,
            "searches": self.latency().count,
            "direct": direct.stats() if direct else None,
        }

    def close(self) -> None:
        with self._lock:
            served, self._served = self._served, None
        if served is not None:
            served.close()

    def _open(self) -> Served:
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
        how = ("direct" if self._served.direct else self._served.io_flag) or "in RAM"
        return f"IndexReader({self.path!r}, {self._served.kind.name}, {how})"


def write_index(index: Any, path: PathLike) -> Path:
    """Write a FAISS index so that readers never see a partial file: write a temporary file in
    the same directory, fsync it, rename it over ``path``, fsync the directory."""
    faiss = faiss_module()
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
