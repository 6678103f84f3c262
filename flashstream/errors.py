"""Exceptions raised by flashstream."""

from __future__ import annotations

import re
import tarfile
from typing import Optional, Sequence, Tuple

__all__ = ["ChecksumError", "FlashstreamError", "IndexFormatError", "ShardFormatError",
           "SnapshotLostError"]


class FlashstreamError(Exception):
    """Base class of flashstream's own errors (I/O errors are plain ``OSError`` subclasses)."""


class ShardFormatError(FlashstreamError, ValueError, tarfile.ReadError):
    """A shard is not a valid (possibly compressed) tar archive.

    ``url`` names the shard and ``offset`` the byte offset of the offending tar header, counted
    in the decompressed stream for compressed shards. It is also a ``tarfile.ReadError``, what
    webdataset raises for a damaged shard, so code written for webdataset catches it.

    ``shard_only``: webdataset, meeting the same damage, could end only this shard: the shard
    is cut inside a member's data (webdataset's own member loop hands that error to the
    handler, and a handler returning False ends the shard there), or it is damaged where
    Python's tarfile ends the archive quietly (a bad or cut header after the first). A handler
    returning False then ends this shard and the stream goes on, as webdataset's does.

    Raised in a DataLoader worker, it reaches the main process as ShardFormatError too: torch
    rebuilds a worker's error from its type and one message (the worker's traceback), and the
    fields are read back from the traceback's last line (``shard_only`` reads False there: it
    served the worker's handler).
    """

    def __init__(self, url: str, offset: Optional[int] = None, reason: Optional[str] = None,
                 shard_only: bool = False) -> None:
        if reason is None and offset is None:  # one message: see the class docstring
            self.url, self.offset, self.reason = _fields_of(url)
            self.shard_only = shard_only
            super().__init__(url)
            return
        self.url = url
        self.offset = offset
        self.reason = reason or ""
        self.shard_only = shard_only
        where = f" at byte offset {offset}" if offset is not None else ""
        super().__init__(f"{url}{where}: {self.reason}")

    def __reduce__(self):  # survives pickling across DataLoader worker processes
        return (type(self), (self.url, self.offset, self.reason, self.shard_only))


#: The last line of a traceback that ends in a ShardFormatError: "...ShardFormatError: URL[ at
#: byte offset N]: REASON".
_TRACEBACK_LINE = re.compile(r"^[\w.]*ShardFormatError: (.*?)(?: at byte offset (\d+))?: (.*)$",
                             re.MULTILINE)


def _fields_of(message: str) -> Tuple[str, Optional[int], str]:
    """(url, offset, reason) of a ShardFormatError from a message that ends in its text (a
    DataLoader worker's traceback), else (message, None, message)."""
    found = list(_TRACEBACK_LINE.finditer(message))
    if not found:
        return message, None, message
    url, offset, reason = found[-1].groups()
    return url, int(offset) if offset is not None else None, reason


class ChecksumError(FlashstreamError, ValueError):
    """A checkpoint's bytes do not match the checksum recorded when it was written.

    ``path`` names the file, ``tensor`` the tensor (or ``"<header>"``), and ``begin``/``end``
    its byte range in the file.
    """

    def __init__(self, path: str, tensor: str, begin: int, end: int) -> None:
        self.path, self.tensor, self.begin, self.end = path, tensor, begin, end
        super().__init__(f"{path}: checksum mismatch in {tensor!r} (bytes {begin}..{end}); "
                         f"the file is corrupt")

    def __reduce__(self):
        return (type(self), (self.path, self.tensor, self.begin, self.end))


class IndexFormatError(FlashstreamError, ValueError):
    """A FAISS index file is corrupt, truncated, or of a type IndexReader does not serve.

    ``path`` names the file; ``reason`` says what is wrong (for an unsupported type, which
    types are supported).
    """

    def __init__(self, path: str, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(f"{path}: {reason}")

    def __reduce__(self):
        return (type(self), (self.path, self.reason))


class SnapshotLostError(FlashstreamError, RuntimeError):
    """A copy-on-write snapshot lost tensors: their memory was released before it was copied.

    ``tensors`` names them. The checkpoint was not written; the previous one is untouched.
    """

    def __init__(self, step: int, tensors: Sequence[str]) -> None:
        self.step, self.tensors = step, list(tensors)
        shown = ", ".join(repr(t) for t in self.tensors[:5])
        more = f" and {len(self.tensors) - 5} more" if len(self.tensors) > 5 else ""
        super().__init__(
            f"checkpoint step {step} was not written: with the copy-on-write snapshot "
            f"(snapshot='auto' or 'cow') the memory of "
            f"{shown}{more} was released (storage freed, resized, e.g. FSDP's resize_(0), or "
            f"unmapped) before the background copy reached it. Keep those storages allocated "
            f"until the save's snapshot is done, or use snapshot='copy' for them")

    def __reduce__(self):
        return (type(self), (self.step, self.tensors))
