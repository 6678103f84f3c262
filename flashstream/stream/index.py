"""Per-shard sample index: where each sample's headers start and its data ends.

Knowing every shard's samples lets the stream plan an epoch by sample ranges (equal shares
per rank, the same order for any number of DataLoader workers, an exact ``len()``). The index
of a shard comes from a sidecar file ``SHARD.fsidx`` that ``flashstream index`` writes, or
from scanning the shard (one full read).

Sidecar format (JSON): ``{"format": "flashstream-shard-index", "version": 1, "shard_bytes":
size of the shard file, "mtime_ns": its modification time, "compression": null | "gzip" |
"bzip2" | "xz", "samples": n, "offsets": [...], "ends": [...]}``. Offsets count in the
decompressed stream for compressed shards. A sidecar whose size or modification time differs
from the shard's is stale: an error (tar files are padded to 10 KiB records, so a rewritten
shard often keeps its size; an index that does not match its shard would plan wrong samples).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..settings import IOSettings
from .handlers import Handler
from .samples import Piece, Records
from .urls import INDEX_SUFFIX, local_path

__all__ = ["INDEX_SUFFIX", "ShardIndex", "load_index", "read_sidecar", "scan_shards",
           "sidecar_path", "write_sidecar"]

_FORMAT = "flashstream-shard-index"
_VERSION = 1
_CODECS = (None, "gzip", "bzip2", "xz")


@dataclasses.dataclass(frozen=True)
class ShardIndex:
    """The samples of one shard: ``offsets[i]`` is sample i's first header, ``ends[i]`` the
    byte just past its last member (both int64 arrays)."""

    offsets: np.ndarray
    ends: np.ndarray
    compression: Optional[str]
    shard_bytes: int
    mtime_ns: int = -1

    @property
    def count(self) -> int:
        return len(self.offsets)

    def to_json(self) -> Dict[str, object]:
        return {"format": _FORMAT, "version": _VERSION, "shard_bytes": self.shard_bytes,
                "mtime_ns": self.mtime_ns, "compression": self.compression, "samples": self.count,
                "offsets": self.offsets.tolist(), "ends": self.ends.tolist()}

    @classmethod
    def from_json(cls, data: object, where: str) -> ShardIndex:
        def bad(reason: str) -> ValueError:
            return ValueError(f"{where}: not a valid flashstream shard index ({reason}); "
                              f"rewrite it with `flashstream index`")

        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise bad("wrong format marker")
        if data.get("version") != _VERSION:
            raise bad(f"version {data.get('version')!r}, this flashstream reads {_VERSION}")
        if data.get("compression") not in _CODECS:
            raise bad(f"compression {data.get('compression')!r}")
        try:
            offsets = np.asarray(data["offsets"], dtype=np.int64).reshape(-1)
            ends = np.asarray(data["ends"], dtype=np.int64).reshape(-1)
            size = int(data["shard_bytes"])
            mtime = int(data["mtime_ns"])
        except (KeyError, TypeError, ValueError) as exn:
            raise bad(str(exn)) from None
        if len(offsets) != len(ends) or len(offsets) != data.get("samples"):
            raise bad("sample count does not match the offset lists")
        if len(offsets) and (np.any(ends <= offsets) or np.any(offsets[1:] < ends[:-1])
                             or offsets[0] < 0):
            raise bad("offsets are not increasing")
        return cls(offsets, ends, data["compression"], size, mtime)


def sidecar_path(url: str) -> str:
    return local_path(url) + INDEX_SUFFIX


def read_sidecar(url: str) -> Optional[ShardIndex]:
    """The shard's sidecar index, None when it has none (or the shard cannot be stat'ed).
    Raises ``ValueError`` for a malformed or stale sidecar."""
    path = sidecar_path(url)
    try:
        with open(path, "rb") as f:
            raw = f.read()
        stat = os.stat(local_path(url))
    except FileNotFoundError:
        return None
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
    return index


def write_sidecar(url: str, index: ShardIndex) -> str:
    """Write ``SHARD.fsidx`` atomically (temporary file, then rename); returns its path."""
    path = sidecar_path(url)
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


def scan_shards(urls: Sequence[str], settings: IOSettings, handler: Handler,
                errors: Optional[Dict[int, BaseException]] = None) -> List[ShardIndex]:
    """Index shards by reading them once. A shard the handler skipped part of is indexed up to
    the bad spot (what reading it delivers); ``errors`` collects those errors by shard."""
    offsets: List[List[int]] = [[] for _ in urls]
    ends: List[List[int]] = [[] for _ in urls]
    stats = []
    for url in urls:  # before reading: a shard changed meanwhile then reads as stale
        try:
            stat = os.stat(local_path(url))
            stats.append((stat.st_size, stat.st_mtime_ns))
        except OSError:
            stats.append((-1, -1))
    records = Records([Piece(url) for url in urls], settings, handler)
    if errors is not None:
        records.errors = errors
    for piece, offset, end, _sample in records:
        offsets[piece].append(offset)
        ends[piece].append(end)
    out = []
    for i in range(len(urls)):
        out.append(ShardIndex(np.asarray(offsets[i], dtype=np.int64),
                              np.asarray(ends[i], dtype=np.int64), records.codecs.get(i),
                              *stats[i]))
    return out


def load_index(urls: Sequence[str], *, scan_missing: bool, settings: IOSettings,
               handler: Handler) -> Optional[List[ShardIndex]]:
    """Every shard's index from its sidecar; shards without one are scanned when
    ``scan_missing``, else the result is None (no index)."""
    found = [read_sidecar(url) for url in urls]
    missing = [i for i, index in enumerate(found) if index is None]
    if missing and not scan_missing:
        return None
    if missing:
        scanned = scan_shards([urls[i] for i in missing], settings, handler)
        for i, index in zip(missing, scanned):
            found[i] = index
    return found  # type: ignore[return-value]
