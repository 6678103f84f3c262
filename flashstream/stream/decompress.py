"""Compressed shards (gzip, bzip2, xz), detected by magic bytes as tarfile's ``r|*`` does.

The compressed bytes are still read by the O_DIRECT reader; only inflating happens here, with
the standard library's codecs (which release the GIL on large buffers).
"""

from __future__ import annotations

import bz2
import lzma
import zlib
from typing import Callable, Optional

__all__ = ["DECOMPRESSION_ERRORS", "Decompressor", "detect", "is_compressed"]

DECOMPRESSION_ERRORS = (zlib.error, OSError, EOFError, lzma.LZMAError)

_FORMATS = (
    (b"\x1f\x8b", "gzip", lambda: zlib.decompressobj(wbits=31)),
    (b"BZh", "bzip2", bz2.BZ2Decompressor),
    (b"\xfd7zXZ\x00", "xz", lzma.LZMADecompressor),
)


class Decompressor:
    """Inflates one shard fed in pieces; concatenated streams (multi-member gzip) included."""

    def __init__(self, name: str, factory: Callable[[], object]) -> None:
        self.name = name
        self._factory = factory
        self._codec = factory()
        self.consumed = 0  # compressed bytes fed so far, for error offsets

    def decompress(self, data) -> bytes:
        if self._codec.eof and len(data):
            # The previous stream ended exactly at a piece boundary: the next one starts here.
            self._codec = self._factory()
        out = self._codec.decompress(data)
        self.consumed += len(data)
        while self._codec.eof and self._codec.unused_data:
            rest = self._codec.unused_data
            self._codec = self._factory()
            out += self._codec.decompress(rest)
        return out

    def finish(self) -> None:
        """Raise ``EOFError`` when the shard ended inside a compressed stream."""
        if not self._codec.eof:
            raise EOFError(f"truncated {self.name} stream after {self.consumed} compressed bytes")


def detect(head) -> Optional[Decompressor]:
    """A decompressor when ``head`` (the shard's first bytes) starts with a known magic."""
    head = bytes(head[:6])
    for magic, name, factory in _FORMATS:
        if head.startswith(magic):
            return Decompressor(name, factory)
    return None


def is_compressed(path: str) -> bool:
    """Whether the file starts with a compression magic (a few buffered bytes are read).
    A file that cannot be read counts as plain: reading it reports the error in turn."""
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError:
        return False
    return detect(head) is not None
