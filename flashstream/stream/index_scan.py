"""Scanning shards for their index: hop from header to header, or read them whole.

The C++ indexer (``csrc/index/shard_indexer.hpp``) reads each member's 512-byte header, then
jumps over its data to the next header, many shards in flight at once; no sample is built. A
shard whose members turn out small (fewer bytes per header read than :func:`hop_threshold`)
is read sequentially instead, still without building samples. Compressed shards (offsets count
in the decompressed stream), shards with extensions only Python's rules can compare, and the
pure-Python engine take the full scan: the reader's own pass, samples and all.

``FLASHSTREAM_INDEX_SCAN`` picks the method: ``auto`` (the default: hop, sequential where
members are small), ``hop`` (always hop), ``sequential`` (read every byte, no samples built) or
``full`` (the reader's pass, as before header hopping existed).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from tqdm import tqdm

from .. import engine as core
from ..errors import ShardFormatError
from ..settings import IOSettings
from .handlers import Handler, goes_on
from .index_format import ShardIndex
from .samples import Piece, ReadStats, Records
from .urls import local_path

__all__ = ["DEFAULT_HOP_THRESHOLD", "SCAN_ENV", "SCAN_MODES", "ScanState", "hop_threshold",
           "scan_mode", "scan_shards"]

SCAN_ENV = "FLASHSTREAM_INDEX_SCAN"
SCAN_MODES = ("auto", "hop", "sequential", "full")

#: Bytes per header read below which a shard is read sequentially, when the drive has no
#: cached probe: the break-even is sequential bytes/s over random 4 KiB reads/s at depth 32
#: (see hop_threshold), rounded up, as sequential reading is the safe side (docs/benchmarks.md,
#: "Figures behind the defaults").
DEFAULT_HOP_THRESHOLD = 64 << 10
#: The threshold is kept within these bounds whatever the probe says.
_THRESHOLD_RANGE = (16 << 10, 4 << 20)
#: Shards per call into the indexer: the progress bar moves between calls.
_BATCH = 256


@dataclasses.dataclass
class ScanState:
    """What a scan carries over when it is made in several calls (batches of shards): how
    many shards each method indexed, and whether the handler ended the scan (later calls then
    read nothing, as one pass over all the shards would not have)."""

    methods: Dict[str, int] = dataclasses.field(
        default_factory=lambda: {"hop": 0, "sequential": 0, "full": 0})
    stopped: bool = False


def scan_mode() -> str:
    """``$FLASHSTREAM_INDEX_SCAN``, validated (default ``auto``)."""
    mode = os.environ.get(SCAN_ENV, "").strip().lower() or "auto"
    if mode not in SCAN_MODES:
        raise ValueError(f"{SCAN_ENV} must be one of {', '.join(SCAN_MODES)}; got {mode!r}")
    return mode


def hop_threshold(path: str, reads_at_once: int) -> Tuple[int, str]:
    """Mean bytes per header read above which hopping beats reading the whole shard, for the
    drive holding ``path`` with ``reads_at_once`` hops in flight, and where the figure came
    from. Hopping reads one 4 KiB block per header at the drive's random-read rate; reading
    everything moves the same bytes at its sequential rate; they break even at a stride of
    sequential bytes/s over random reads/s. Both come from the device probe's cached result
    for this drive (``flashstream probe``), else :data:`DEFAULT_HOP_THRESHOLD` applies."""
    figures = _probe_figures(_device_key(path))
    if figures is None:
        return DEFAULT_HOP_THRESHOLD, "default"
    sequential_bps, iops_by_depth = figures
    iops = _interpolate(iops_by_depth, max(1, reads_at_once))
    low, high = _THRESHOLD_RANGE
    return int(min(max(sequential_bps / iops, low), high)), "probe"


def _device_key(path: str) -> str:
    return _device_key_of(os.path.dirname(os.path.abspath(path)) or ".")


@functools.lru_cache(maxsize=64)
def _device_key_of(directory: str) -> str:
    from ..telemetry.device import device_of
    from ..telemetry.probe import device_ident

    try:
        return device_ident(device_of(directory, health=False).to_dict())
    except (OSError, ValueError):
        return ""


@functools.lru_cache(maxsize=16)
def _probe_figures(device: str) -> Optional[Tuple[float, Dict[int, float]]]:
    """The newest cached probe of ``device``: best sequential read bytes/s and random 4 KiB
    read IOPS by queue depth; None when there is none."""
    from ..telemetry.probe import ProbeResult, default_cache_dir

    if not device:
        return None
    best: Optional[ProbeResult] = None
    for entry in Path(default_cache_dir()).glob(f"{device}-*.json"):
        try:
            result = ProbeResult.from_dict(json.loads(entry.read_text()), cached=True)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if best is None or result.created > best.created:
            best = result
    if best is None:
        return None
    sequential = best.best("read")
    random = {p.queue_depth: p.iops for p in best.select("read", "random") if p.iops > 0}
    if sequential is None or not random:
        return None
    return sequential.gbps * 1e9, random


def _interpolate(iops_by_depth: Dict[int, float], depth: int) -> float:
    """IOPS at ``depth``, log-linear between the probed depths, clamped at their ends."""
    points = sorted(iops_by_depth.items())
    if depth <= points[0][0]:
        return points[0][1]
    for (d0, v0), (d1, v1) in zip(points, points[1:]):
        if depth <= d1:
            t = (math.log(depth) - math.log(d0)) / (math.log(d1) - math.log(d0))
            return v0 + t * (v1 - v0)
    return points[-1][1]


def scan_shards(urls: Sequence[str], settings: IOSettings, handler: Handler,
                errors: Optional[Dict[int, BaseException]] = None, *,
                progress: bool = False, read: Optional[ReadStats] = None,
                state: Optional[ScanState] = None) -> List[ShardIndex]:
    """Index shards. A shard the handler skipped part of is indexed up to the bad spot (what
    reading it delivers: the samples before it, then the group of members open at it, which
    webdataset yields unless the handler raises); ``errors`` collects those errors by shard.
    Errors reach the handler in shard order, as in one pass over the shards; once it ends the
    stream (False, see :func:`~.handlers.goes_on`) the later shards are not indexed (their
    ``errors`` entry says so; the handler does not see those).
    ``progress``: show a progress bar on a terminal. ``read`` receives what the scan read;
    ``state`` carries the method counts and the handler's stop over several calls."""
    state = state if state is not None else ScanState()
    stats = [_stat(url) for url in urls]  # before reading: a changed shard then reads as stale
    mode = scan_mode()
    read = read if read is not None else ReadStats()
    if state.stopped or not urls:
        found: List[_Found] = [(_EMPTY, _EMPTY, None, None, "full") for _ in urls]
    else:
        bar = tqdm(total=len(urls), unit="shard", desc="flashstream: indexing shards",
                   disable=not (progress and sys.stderr.isatty()), leave=False)
        with bar:
            if mode == "full" or settings.engine == "python":
                found = _full_scan(urls, settings, read, bar)
            else:
                found = _indexer_scan(urls, settings, mode, read, bar)
        for _offsets, _ends, _codec, _error, method in found:
            state.methods[method] += 1
    out = []
    for i, (offsets, ends, codec, error, _method) in enumerate(found):
        if state.stopped:  # the handler ended the scan before this shard: not indexed
            offsets = ends = _EMPTY
            if errors is not None:
                errors[i] = RuntimeError(f"{urls[i]}: not read (the handler ended the scan)")
        elif error is not None:
            if errors is not None:
                errors[i] = error
            state.stopped = not goes_on(handler, error)
        out.append(ShardIndex(offsets, ends, codec, *stats[i]))
    return out


_Found = Tuple[np.ndarray, np.ndarray, Optional[str], Optional[BaseException], str]
_EMPTY = np.empty(0, dtype=np.int64)


def _stat(url: str) -> Tuple[int, int]:
    try:
        stat = os.stat(local_path(url))
        return stat.st_size, stat.st_mtime_ns
    except OSError:
        return -1, -1


def _indexer_scan(urls: Sequence[str], settings: IOSettings, mode: str, read: ReadStats,
                  bar: tqdm) -> List[_Found]:
    """The C++ indexer over every shard; the shards it leaves go through the full scan."""
    paths = [local_path(url) for url in urls]
    if mode == "hop":
        threshold = 0
    elif mode == "sequential":
        threshold = 2**64 - 1
    else:
        threshold, _source = hop_threshold(paths[0], min(len(paths), settings.queue_depth))
    found: List[Optional[_Found]] = [None] * len(urls)
    left: List[int] = []
    for start in range(0, len(paths), _BATCH):
        batch = range(start, min(start + _BATCH, len(paths)))
        results, stats = core.index_shards([paths[i] for i in batch], settings, threshold)
        read.engine = read.engine or stats["engine"]
        read.bytes_read += stats["bytes_read"]
        read.requests += stats["requests"]
        indexed = 0
        for i, (outcome, offsets, ends, error, sequential, _hops) in zip(batch, results):
            if outcome in ("compressed", "full_scan"):
                left.append(i)
                continue
            indexed += 1
            if isinstance(error, core.FormatError):
                message, offset = error.args
                error = ShardFormatError(urls[i], offset, message,
                                         getattr(error, "shard_only", False))
            found[i] = (offsets, ends, None, error, "sequential" if sequential else "hop")
            read.shards += 1
            read.samples += len(offsets)
            read.errors += error is not None
        bar.update(indexed)
    if left:
        for i, entry in zip(left, _full_scan([urls[i] for i in left], settings, read, bar)):
            found[i] = entry
    return found  # type: ignore[return-value]


def _full_scan(urls: Sequence[str], settings: IOSettings, read: ReadStats,
               bar: tqdm) -> List[_Found]:
    """The reader's own pass over the shards (samples built), every error collected."""
    offsets: List[List[int]] = [[] for _ in urls]
    ends: List[List[int]] = [[] for _ in urls]
    records = Records([Piece(url) for url in urls], settings, lambda exn: True, read)
    done = 0
    for piece, offset, end, _sample in records:
        offsets[piece].append(offset)
        ends[piece].append(end)
        if piece > done:
            bar.update(piece - done)
            done = piece
    bar.update(len(urls) - done)
    return [(np.asarray(offsets[i], dtype=np.int64), np.asarray(ends[i], dtype=np.int64),
             records.codecs.get(i), records.errors.get(i), "full") for i in range(len(urls))]
