"""One contract suite for every read engine (uring, threads, python)."""

from __future__ import annotations

import errno
import os
import random

import pytest
from conftest import ENGINES
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from shardgen import EDGE_SIZES

import flashstream
from flashstream import settings
from flashstream.engine import TO_END, open_reader


def read_all(extents, **kw):
    """Concatenated bytes per extent, checking chunk order and flags on the way."""
    reader = open_reader(extents, settings.resolve(**kw))
    out = {i: bytearray() for i in range(len(extents))}
    seen_first, seen_last = set(), set()
    try:
        while (chunk := reader.next()) is not None:
            extent, offset, data, first, last = chunk
            assert extent not in seen_last, "chunk after the last one of its extent"
            if first:
                seen_first.add(extent)
                assert offset == max(extents[extent][1], 0) or len(data) == 0
            assert offset == extents[extent][1] + len(out[extent]) or len(data) == 0
            out[extent] += data
            if last:
                seen_last.add(extent)
        assert seen_first == seen_last == set(range(len(extents)))
        stats = reader.stats()
        # Every completed request's latency is in the histogram, in every engine.
        assert int(reader.latency_counts().sum()) == stats["latency_count"]
        assert stats["latency_count"] >= (1 if stats["bytes_read"] else 0)
        assert stats["wait_ns"] >= 0
        return [bytes(out[i]) for i in range(len(extents))], stats
    finally:
        reader.close()


@pytest.fixture
def files(tmp_path):
    rng = random.Random(1)
    paths = {}
    for size in EDGE_SIZES + [(3 << 20) + 17]:
        path = tmp_path / f"f{size}.bin"
        path.write_bytes(rng.randbytes(size))
        paths[size] = str(path)
    return paths


@pytest.mark.parametrize("chunk_size,depth", [(4096, 1), (8192, 8), (1 << 20, 4)])
def test_whole_files_in_order(files, engine, chunk_size, depth):
    extents = [(p, 0, TO_END) for p in files.values()]
    data, stats = read_all(extents, chunk_size=chunk_size, queue_depth=depth)
    for (path, _, _), got in zip(extents, data):
        with open(path, "rb") as f:
            assert got == f.read()
    assert stats["direct_files"] == len(extents)  # tmp_path is on a disk that takes O_DIRECT
    assert stats["buffered_files"] == 0


def test_sub_ranges(files, engine):
    path = files[(3 << 20) + 17]
    with open(path, "rb") as f:
        whole = f.read()
    ranges = [(0, 1), (1, 2), (511, 513), (4095, 4097), (12345, 1 << 20), (0, len(whole)),
              (len(whole) - 5, TO_END), (len(whole), TO_END), (len(whole) + 100, TO_END)]
    data, _ = read_all([(path, s, e) for s, e in ranges], chunk_size="64KiB", queue_depth=5)
    for (start, end), got in zip(ranges, data):
        assert got == whole[start:end if end != TO_END else None]


def test_missing_file_raises_at_its_turn_and_skip_continues(files, tmp_path, engine):
    good = files[4097]
    extents = [(good, 0, TO_END), (str(tmp_path / "missing.tar"), 0, TO_END), (good, 0, TO_END)]
    reader = open_reader(extents, settings.resolve(chunk_size=4096, queue_depth=8))
    try:
        got = bytearray()
        while True:
            chunk = reader.next()
            got += chunk[2]
            if chunk[4]:
                break
        assert len(got) == 4097  # everything before the bad extent arrives first
        with pytest.raises(FileNotFoundError) as info:
            reader.next()
        assert info.value.errno == errno.ENOENT
        assert "missing.tar" in str(info.value)
        reader.skip_extent()
        tail = bytearray()
        while (chunk := reader.next()) is not None:
            assert chunk[0] == 2
            tail += chunk[2]
        assert len(tail) == 4097
    finally:
        reader.close()


def test_directory_is_refused(tmp_path, engine):
    with pytest.raises(IsADirectoryError):
        read_all([(str(tmp_path), 0, TO_END)])


def test_refused_o_direct_falls_back_to_buffered(no_direct_dir, engine):
    path = no_direct_dir / "a.bin"
    content = os.urandom(10000)
    path.write_bytes(content)
    data, stats = read_all([(str(path), 0, TO_END)], chunk_size=4096)
    assert data == [content]
    assert stats["buffered_files"] == 1 and stats["direct_files"] == 0


def test_skip_extent_after_last_chunk_is_a_no_op(files, engine):
    a, b = files[513], files[4096]
    reader = open_reader([(a, 0, TO_END), (b, 0, TO_END)], settings.resolve(chunk_size=4096))
    try:
        chunk = reader.next()
        assert chunk[0] == 0 and chunk[4]
        reader.skip_extent()
        chunk = reader.next()
        assert chunk[0] == 1 and len(chunk[2]) == 4096
    finally:
        reader.close()


def test_a_file_shrinking_mid_read_ends_its_extent_once(tmp_path, engine):
    """Every engine flags exactly one chunk as its extent's last, also when the file shrinks
    under the reader (the Python engine flagged each chunk still in flight: 11 of them), and
    goes on with the next extent."""
    big, small = tmp_path / "big.bin", tmp_path / "small.bin"
    big.write_bytes(os.urandom(4 << 20))
    small.write_bytes(b"s" * 5000)
    reader = open_reader([(str(big), 0, 4 << 20), (str(small), 0, TO_END)],
                         settings.resolve(chunk_size=65536, queue_depth=16))
    lasts, after, data = {0: 0, 1: 0}, {0: 0, 1: 0}, {0: bytearray(), 1: bytearray()}
    try:
        first = reader.next()
        data[0] += first[2]
        os.truncate(big, 100_000)
        while (chunk := reader.next()) is not None:
            extent, _offset, piece, _first, last = chunk
            after[extent] += lasts[extent]  # a chunk after the last one
            lasts[extent] += bool(last)
            data[extent] += piece
    finally:
        reader.close()
    assert lasts == {0: 1, 1: 1} and after == {0: 0, 1: 0}
    assert bytes(data[1]) == b"s" * 5000


def test_engine_names():
    assert flashstream.engine_name("threads") == "threads"
    assert flashstream.engine_name("auto") in ("uring", "threads")
    with pytest.raises(ValueError, match="auto, uring, threads, python"):
        settings.resolve(engine="spdk")


@pytest.mark.parametrize("kind", ENGINES)
@hsettings(max_examples=40, deadline=None,
           suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_ranges_equal_pread(tmp_path_factory, kind, data):
    if kind == "uring" and not flashstream.uring_available():
        pytest.skip("io_uring is not available")
    directory = tmp_path_factory.mktemp("prop")
    size = data.draw(st.integers(0, 300_000))
    path = directory / "f.bin"
    path.write_bytes(random.Random(size).randbytes(size))
    ranges = data.draw(st.lists(st.tuples(st.integers(0, size + 10), st.integers(0, 70_000)),
                                min_size=1, max_size=6))
    chunk = data.draw(st.sampled_from([4096, 12288, 65536]))
    depth = data.draw(st.integers(1, 9))
    extents = [(str(path), off, off + length) for off, length in ranges]
    got, _ = read_all(extents, engine=kind, chunk_size=chunk, queue_depth=depth)
    fd = os.open(path, os.O_RDONLY)
    try:
        for (start, end), block in zip([(s, e) for _, s, e in extents], got):
            assert block == os.pread(fd, max(0, end - start), start)
    finally:
        os.close(fd)
