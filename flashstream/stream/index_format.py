"""The shard index and its file format (sidecars and cache entries).

Sidecar format (JSON): ``{"format": "flashstream-shard-index", "version": 1, "shard_bytes":
size of the shard file, "mtime_ns": its modification time, "compression": null | "gzip" |
"bzip2" | "xz", "samples": n, "offsets": [...], "ends": [...]}``. Offsets count in the
decompressed stream for compressed shards. A sidecar whose size or modification time differs
from the shard's is stale: an error (tar files are padded to 10 KiB records, so a rewritten
shard often keeps its size; an index that does not match its shard would plan wrong samples).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import numpy as np

__all__ = ["ShardIndex"]

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
        except (KeyError, TypeError, ValueError, OverflowError) as exn:
            raise bad(str(exn)) from None
        if len(offsets) != len(ends) or len(offsets) != data.get("samples"):
            raise bad("sample count does not match the offset lists")
        if len(offsets) and (np.any(ends <= offsets) or np.any(offsets[1:] < ends[:-1])
                             or offsets[0] < 0):
            raise bad("offsets are not increasing")
        return cls(offsets, ends, data["compression"], size, mtime)
