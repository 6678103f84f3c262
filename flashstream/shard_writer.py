"""Drop-in ``TarWriter`` / ``ShardWriter`` that index shards as they write them.

webdataset's writers, unchanged (same arguments, the very same tar bytes: these subclass
them), plus one thing: as each shard closes, its sample index goes into the ``SHARD.fsidx``
sidecar (see flashstream/stream/index.py), so a ``ShardStream`` over the shards starts without
reading a byte of them to index. The index comes from the offsets the writer saw: where each
sample's first header starts and its last member's padded data ends. Where a scan could group
members differently from the samples written (a key with a dot after its last slash, a key
repeated back to back, metadata-like names) the writer scans the shard it just wrote instead,
so the sidecar always equals what a scan finds.
"""

from __future__ import annotations

import os
from typing import Any, List, Optional

import numpy as np
import webdataset as wds

from . import settings
from .engine import is_meta_name, split_key
from .stream.index import ShardIndex, scan_shards, sidecar_path, write_sidecar
from .stream.urls import local_path

__all__ = ["ShardWriter", "TarWriter"]

_CODEC = {"w|gz": "gzip", "w|bz2": "bzip2", "w|xz": "xz"}


class TarWriter(wds.TarWriter):
    """``webdataset.TarWriter`` that writes the shard's ``.fsidx`` sidecar on ``close()``.

    ``index=False`` writes no sidecar. A writer given an open file object indexes it when the
    object has the ``name`` of a local file; a pipe or a remote URL gets no sidecar. After
    ``close()``, ``index_path`` names the sidecar written (or is None).
    """

    def __init__(self, fileobj: Any, *args: Any, index: bool = True, **kw: Any) -> None:
        name = fileobj if isinstance(fileobj, str) else getattr(fileobj, "name", None)
        super().__init__(fileobj, *args, **kw)
        self._target: Optional[str] = name if index and isinstance(name, str) else None
        self._codec = _CODEC.get(self.tarmode(fileobj, kw.get("compress")))
        self._offsets: List[int] = []
        self._ends: List[int] = []
        self._last_key: Optional[str] = None
        self._exact = True  # False: the samples written may scan as other samples
        self.index_path: Optional[str] = None

    def write(self, obj: Any) -> int:
        start = self.tarstream.offset
        size = super().write(obj)
        end = self.tarstream.offset
        if end > start and self._target is not None:
            key = obj["__key__"]
            if self._exact:
                self._exact = key != self._last_key and self._splits_back(key, obj)
            self._last_key = key
            self._offsets.append(start)
            self._ends.append(end)
        return size

    def _splits_back(self, key: str, obj: Any) -> bool:
        """True when every member written for ``obj`` scans as a field of sample ``key``."""
        for field in obj:
            if field == "__key__" or (not self.keep_meta and field[0] == "_"):
                continue
            name = f"{key}.{field}".encode("utf-8", "surrogateescape")
            split = split_key(name)
            if is_meta_name(name) or split is None or split[0] != key.encode(
                    "utf-8", "surrogateescape"):
                return False
        return True

    def close(self) -> None:
        super().close()
        if self._target is None or not os.path.isfile(local_path(self._target)):
            return
        target, self._target = self._target, None
        stat = os.stat(local_path(target))
        if self._exact:
            index = ShardIndex(np.asarray(self._offsets, dtype=np.int64),
                               np.asarray(self._ends, dtype=np.int64), self._codec,
                               stat.st_size, stat.st_mtime_ns)
        else:
            errors: dict = {}
            (index,) = scan_shards([target], settings.current(), lambda exn: True, errors)
            if errors:  # e.g. a duplicate field: the shard reads with that error; no sidecar
                return
        write_sidecar(target, index)
        self.index_path = sidecar_path(target)


class ShardWriter(wds.ShardWriter):
    """``webdataset.ShardWriter`` whose shards each get their ``.fsidx`` sidecar as they close.

    Same arguments (``pattern``, ``maxcount``, ``maxsize``, ``post``, ``start_shard``,
    ``verbose``, ``opener``, and TarWriter's), plus ``index=False`` to write no sidecars.
    """

    def __init__(self, pattern: str, *args: Any, index: bool = True, **kw: Any) -> None:
        self._index = index
        super().__init__(pattern, *args, **kw)

    def next_stream(self) -> None:
        # webdataset's next_stream, building this module's TarWriter.
        self.finish()
        self.fname = self.pattern % self.shard
        if self.verbose:
            print("# writing", self.fname, self.count, "%.1f GB" % (self.size / 1e9), self.total)
        self.shard += 1
        target = self.opener(self.fname) if self.opener else self.fname
        self.tarstream = TarWriter(target, index=self._index, **self.kw)
        self.count = 0
        self.size = 0
