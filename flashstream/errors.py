"""Exceptions raised by flashstream."""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["ChecksumError", "FlashstreamError", "IndexFormatError", "ShardFormatError",
           "SnapshotLostError"]


class FlashstreamError(Exception):
    """Base class of flashstream's own errors (I/O errors are plain ``OSError`` subclasses)."""


class ShardFormatError(FlashstreamError, ValueError):
    """A shard is not a valid (possibly compressed) tar archive.

    ``url`` names the shard and ``offset`` the byte offset of the offending tar header, counted
    in the decompressed stream for compressed shards.
    """

    def __init__(self, url: str, offset: Optional[int], reason: str) -> None:
        self.url = url
        self.offset = offset
        self.reason = reason
        where = f" at byte offset {offset}" if offset is not None else ""
        super().__init__(f"{url}{where}: {reason}")

    def __reduce__(self):  # survives pickling across DataLoader worker processes
        return (type(self), (self.url, self.offset, self.reason))


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
