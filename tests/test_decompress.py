"""Compressed shards made of several streams, split at every kind of boundary."""

from __future__ import annotations

import bz2
import gzip
import lzma

import pytest

from flashstream.stream.decompress import detect


@pytest.mark.parametrize("compress", [gzip.compress, bz2.compress, lzma.compress])
def test_concatenated_streams_split_exactly_at_the_boundary(compress):
    first, second = b"first stream " * 1000, b"second stream " * 1000
    a, b = compress(first), compress(second)
    for pieces in ([a, b], [a + b], [a[:7], a[7:], b[:3], b[3:]]):
        codec = detect(pieces[0])
        assert codec is not None
        out = b"".join(codec.decompress(p) for p in pieces)
        codec.finish()
        assert out == first + second


def test_truncated_stream_is_reported():
    data = gzip.compress(b"x" * 10000)[:-4]
    codec = detect(data)
    codec.decompress(data)
    with pytest.raises(EOFError, match="truncated gzip"):
        codec.finish()
