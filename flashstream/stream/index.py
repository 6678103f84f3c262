"""Per-shard sample index: where each sample's headers start and its data ends.

Knowing every shard's samples lets the stream plan an epoch by sample ranges (equal shares
per rank, the same order for any number of DataLoader workers, an exact ``len()``). The index
of a shard comes from a sidecar file ``SHARD.fsidx`` that ``flashstream index`` writes, else
from the user's index cache (see :func:`cache_dir`), else from scanning the shard (one full
read), whose result then goes into that cache so that it is read once per shard file.

The sidecar's JSON format is in :mod:`flashstream.stream.index_format`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..settings import IOSettings
from .handlers import Handler
from .index_format import ShardIndex
from .index_locks import scan_with_locks
from .index_scan import ScanState, scan_mode, scan_shards
from .index_share import share_scan
from .samples import ReadStats
from .urls import INDEX_SUFFIX, local_path

__all__ = ["CACHE_ENV", "INDEX_SUFFIX", "ShardIndex", "cache_dir", "cached_path", "load_index",
           "read_cached", "read_sidecar", "scan_shards", "sidecar_path", "write_cached",
           "write_sidecar"]

log = logging.getLogger(__name__)

#: Where scanned indexes are kept: a directory, or "off" to keep none.
CACHE_ENV = "FLASHSTREAM_INDEX_CACHE"

def sidecar_path(url: str) -> str:
    return local_path(url) + INDEX_SUFFIX


def read_sidecar(url: str) -> Optional[ShardIndex]:
    """The shard's sidecar index, None when it has none (or the shard cannot be stat'ed).
    Raises ``ValueError`` for a malformed or stale sidecar."""
    return _read_sidecar(url)[0]


def _read_sidecar(url: str) -> Tuple[Optional[ShardIndex], int]:
    """``read_sidecar`` and the bytes it read."""
    path = sidecar_path(url)
    try:
        with open(path, "rb") as f:
            raw = f.read()
        stat = os.stat(local_path(url))
    except FileNotFoundError:
        return None, 0
    try:
        data = json.loads(raw)
    except ValueError as exn:
        raise ValueError(f"{path}: not valid JSON ({exn}); rewrite it with "
                         f"`flashstream index`") from None
    index = ShardIndex.from_json(data, path)
    if (index.shard_bytes, index.mtime_ns) != (stat.st_size, stat.st_mtime_ns):
        raise ValueError(f"{path} is stale: it describes {index.shard_bytes} bytes modified at "
                         f"{index.mtime_ns} ns, but {url} has {stat.st_size} bytes modified at "
                         f"{stat.st_mtime_ns} ns; rerun `flashstream index` on it (or delete the "
                         f"sidecar)")
    return index, len(raw)


def write_sidecar(url: str, index: ShardIndex) -> str:
    """Write ``SHARD.fsidx`` atomically (temporary file, then rename); returns its path."""
    return _write_json(sidecar_path(url), index)


def cache_dir() -> Optional[Path]:
    """The index cache: ``$FLASHSTREAM_INDEX_CACHE`` (``off``: none), else
    ``$XDG_CACHE_HOME/flashstream/index``, else ``~/.cache/flashstream/index``."""
    chosen = os.environ.get(CACHE_ENV, "").strip()
    if chosen.lower() in ("off", "0", "none", "false"):
        return None
    if chosen:
        return Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flashstream" / "index"


def cached_path(url: str) -> Optional[Path]:
    """The cache file for the shard as it is now: named by its real path, inode, size,
    modification time and status-change time (which no tool can set back, unlike the
    modification time that ``cp -p`` or ``touch -r`` restore), so a rewritten or replaced shard
    never meets its old index."""
    directory = cache_dir()
    if directory is None:
        return None
    path = os.path.realpath(local_path(url))
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (f"{path}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}"
           f"\0{st.st_ctime_ns}")
    name = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return directory / f"{name}{INDEX_SUFFIX}"


def read_cached(url: str) -> Optional[ShardIndex]:
    """The shard's cached index, None when there is none (an unreadable entry is ignored)."""
    return _read_cached(url)[0]


def _read_cached(url: str) -> Tuple[Optional[ShardIndex], int]:
    """``read_cached`` and the bytes it read."""
    path = cached_path(url)
    if path is None:
        return None, 0
    try:
        raw = path.read_bytes()
        index = ShardIndex.from_json(json.loads(raw), str(path))
        stat = os.stat(local_path(url))
    except Exception:  # noqa: BLE001 - any broken entry only costs a scan
        return None, 0
    if (index.shard_bytes, index.mtime_ns) != (stat.st_size, stat.st_mtime_ns):
        return None, len(raw)
    return index, len(raw)


def write_cached(url: str, index: ShardIndex) -> Optional[Path]:
    """Keep a scanned index in the cache; best effort (an unwritable cache only costs a scan
    next time). Returns the file written, or None; raises OSError when it cannot write."""
    path = cached_path(url)
    if path is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_json(str(path), index)
    return path


def _write_json(path: str, index: ShardIndex) -> str:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".fsidx-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(index.to_json(), f, separators=(",", ":"))
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


#: A scan reading more than this warns first, naming the ways to avoid it.
SCAN_WARN_BYTES = 4 << 30


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _each(read, urls: Sequence[str], found: List[Optional[ShardIndex]]):
    """``found`` with each gap filled by ``read(url)``, and the bytes those reads took."""
    out, total = list(found), 0
    for i, url in enumerate(urls):
        if out[i] is None:
            out[i], nbytes = read(url)
            total += nbytes
    return out, total


def load_index(urls: Sequence[str], *, settings: IOSettings, handler: Handler,
               sources: Optional[Dict[str, int]] = None,
               info: Optional[Dict[str, Dict[str, float]]] = None) -> List[ShardIndex]:
    """Every shard's index: its sidecar, else the cache, else a scan (then cached). A shard
    scanned with errors the handler skipped is indexed as read but not cached. ``sources``
    receives how many came from each: ``sidecar``, ``cache``, ``scan``; ``info`` receives per
    source ``{"shards", "bytes", "seconds"}``: the bytes read to index (sidecar and cache
    files, or the shards a scan read) and the time it took; the scan's entry also has
    ``methods``: how many shards this process indexed by each method (``hop``,
    ``sequential``, ``full``; see :mod:`flashstream.stream.index_scan`)."""
    clock = time.perf_counter()
    found, sidecar_bytes = _each(_read_sidecar, urls, [None] * len(urls))
    sidecars = sum(index is not None for index in found)
    after_sidecars = time.perf_counter()
    found, cache_bytes = _each(_read_cached, urls, found)
    missing = [i for i, index in enumerate(found) if index is None]
    after_cache = time.perf_counter()
    if sources is not None:
        sources.update(sidecar=sidecars, cache=len(urls) - sidecars - len(missing),
                       scan=len(missing))
    read = ReadStats()
    state = ScanState()  # over every batch this process scans
    cache_later: Dict[int, int] = {}  # cached by another process while this one waited
    mine: List[int] = []  # the shards this process scanned
    if missing:
        where = cache_dir()
        # Header hopping reads a few KB per member, so how much a scan reads is known only
        # after it, unless every byte is read by choice.
        reads_all = scan_mode() in ("sequential", "full") or settings.engine == "python"
        planned = sum(_file_size(local_path(urls[i])) for i in missing) if reads_all else 0
        if planned > SCAN_WARN_BYTES:
            _warn_scan(f"will read {planned / 1e9:.1f} GB", len(missing), where)
        log.info("indexing %d shard(s) (%s); `flashstream index` writes sidecars instead",
                 len(missing), f"kept in {where}" if where else f"not kept: {CACHE_ENV}=off")

        def scan_some(positions: List[int]):
            errors: Dict[int, BaseException] = {}
            try:
                part = scan_shards([urls[i] for i in positions], settings, handler, errors,
                                   progress=True, read=read, state=state)
            except Exception as exn:  # noqa: BLE001 - raised on every rank after the exchange
                return {}, {}, exn
            return (dict(zip(positions, part)),
                    {positions[j]: str(exn) for j, exn in errors.items()}, None)

        failed: Optional[OSError] = None

        def cache(url: str, index: ShardIndex) -> None:
            nonlocal failed
            try:
                write_cached(url, index)
            except OSError as exn:
                failed = failed or exn  # one warning, not one per shard
                raise

        shared = share_scan(urls, missing, scan_some)
        if shared is not None:  # the ranks of the process group scanned a share each
            indexes, bad, mine = shared
            for i in mine:  # each rank caches what it scanned
                if i not in bad and failed is None:
                    with contextlib.suppress(OSError):
                        cache(urls[i], indexes[i])
        elif where is not None:  # processes on this node share the work through the cache
            indexes, bad, mine, cache_later = scan_with_locks(
                urls, missing, scan_some, _lock_path, _read_cached, cache,
                stopped=lambda: state.stopped)
        else:  # no cache to share through: this process scans all it lacks
            indexes, bad, raised = scan_some(missing)
            if raised is not None:
                raise raised
            mine = missing
        for i in missing:
            found[i] = indexes[i]
        if failed is not None:
            log.warning("could not cache shard indexes in %s: %s", where, failed)
        if cache_later and sources is not None:
            sources.update(cache=sources["cache"] + len(cache_later),
                           scan=sources["scan"] - len(cache_later))
        cache_bytes += sum(cache_later.values())
        if not reads_all and read.bytes_read > SCAN_WARN_BYTES:  # small members: read whole
            _warn_scan(f"read {read.bytes_read / 1e9:.1f} GB", len(mine), where)
    if info is not None:
        info.update(
            sidecar={"shards": sidecars, "bytes": sidecar_bytes,
                     "seconds": after_sidecars - clock},
            cache={"shards": len(urls) - sidecars - len(missing) + len(cache_later),
                   "bytes": cache_bytes,
                   "seconds": after_cache - after_sidecars},
            scan={"shards": len(mine), "bytes": read.bytes_read,
                  "seconds": time.perf_counter() - after_cache,
                  "methods": state.methods if mine else {}})
    return found  # type: ignore[return-value]


def _lock_path(url: str) -> Optional[Path]:
    path = cached_path(url)
    return None if path is None else path.with_name(path.name + ".lock")


def _warn_scan(amount: str, shards: int, where: Optional[Path]) -> None:
    warnings.warn(
        f"flashstream: indexing {shards} shard(s) {amount} before the first sample (then kept "
        f"in {where or 'no cache'}); `flashstream index SHARDS` writes sidecars once for every "
        f"later run and machine, and flashstream.ShardWriter writes them while making the "
        f"shards", stacklevel=4)
