"""Indexing many shards at once, and checking sidecars against the shards they describe.

``flashstream index`` runs these: groups of shards are scanned on several threads (each scan
keeps many shards in flight itself, and reading and scanning release the GIL), with one
progress bar over all of them.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from tqdm import tqdm

from ..settings import IOSettings
from .index import ShardIndex, read_sidecar, scan_shards

__all__ = ["GROUP", "check_sidecars", "default_jobs", "scan_parallel"]

#: Shards per scan call: the indexer hops many shards at once within one call.
GROUP = 64


def default_jobs() -> int:
    """Shards scanned at once: a few, as one scan already keeps the drive's queue busy."""
    return max(1, min(4, os.cpu_count() or 1))


def scan_parallel(urls: Sequence[str], settings: IOSettings, *, jobs: int,
                  progress: bool = True) -> Tuple[List[Optional[ShardIndex]],
                                                  Dict[int, BaseException]]:
    """Scan every shard, in groups of up to :data:`GROUP` shards, ``jobs`` groups at a time.
    Returns the indexes (None where a shard failed) and the errors by position; a failed shard
    never stops the others."""
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    out: List[Optional[ShardIndex]] = [None] * len(urls)
    errors: Dict[int, BaseException] = {}
    size = max(1, min(GROUP, -(-len(urls) // jobs)))
    groups = [range(a, min(a + size, len(urls))) for a in range(0, len(urls), size)]

    def one(group: range) -> None:
        failed: Dict[int, BaseException] = {}
        found = scan_shards([urls[i] for i in group], settings, lambda exn: True, failed)
        for j, i in enumerate(group):
            if j in failed:
                errors[i] = failed[j]
            else:
                out[i] = found[j]

    bar = tqdm(total=len(urls), unit="shard", desc="flashstream: indexing",
               disable=not (progress and sys.stderr.isatty()))
    with bar, concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(one, group): group for group in groups}
        for future in concurrent.futures.as_completed(futures):
            try:
                future.result()
            except (OSError, ValueError) as exn:  # the whole group: e.g. a bad setting
                for i in futures[future]:
                    errors[i] = exn
            bar.update(len(futures[future]))
    return out, errors


def check_sidecars(urls: Sequence[str], settings: IOSettings, *, jobs: int,
                   progress: bool = True) -> List[Dict[str, object]]:
    """For each shard: ``ok`` when its sidecar equals a fresh scan, else why not (``missing``,
    ``stale`` or malformed, ``differs``, or the shard's read ``error``)."""
    rows: List[Dict[str, object]] = [{"shard": url} for url in urls]
    present: List[Tuple[int, ShardIndex]] = []
    for i, url in enumerate(urls):
        try:
            index = read_sidecar(url)
        except ValueError as exn:
            rows[i].update(status="stale", detail=str(exn))
            continue
        if index is None:
            rows[i].update(status="missing")
        else:
            present.append((i, index))
    scanned, errors = scan_parallel([urls[i] for i, _ in present], settings, jobs=jobs,
                                    progress=progress)
    for j, (i, index) in enumerate(present):
        fresh = scanned[j]
        if fresh is None:
            rows[i].update(status="error", detail=str(errors.get(j)))
        elif (index.compression == fresh.compression and np.array_equal(index.offsets,
                                                                        fresh.offsets)
              and np.array_equal(index.ends, fresh.ends)):
            rows[i].update(status="ok", samples=index.count)
        else:
            rows[i].update(status="differs",
                           detail=f"sidecar has {index.count} samples, the shard "
                                  f"{fresh.count}" + _first_difference(index, fresh))
    return rows


def _first_difference(a: ShardIndex, b: ShardIndex) -> str:
    n = min(a.count, b.count)
    for i in range(n):
        if a.offsets[i] != b.offsets[i] or a.ends[i] != b.ends[i]:
            return (f"; sample {i} differs: sidecar [{a.offsets[i]}, {a.ends[i]}), shard "
                    f"[{b.offsets[i]}, {b.ends[i]})")
    return ""
