"""Scattered reads (engine.open_ranges): one contract for every engine, checked against
os.pread; alignment, the end of the file, a file that shrank, and a filesystem without
O_DIRECT."""

from __future__ import annotations

import errno
import mmap
import os
import random
import re
import threading

import numpy as np
import pytest
from conftest import direct_io_works
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from flashstream import settings
from flashstream.engine import open_ranges

SIZE = (1 << 20) + 4321  # ends off every alignment


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ranges") / "data.bin"
    path.write_bytes(random.Random(3).randbytes(SIZE))
    return path


def _open(path, direct=True):
    return open_ranges(path, engine=settings.current().engine, direct=direct)


def _check(path, buffer, rows):
    with open(path, "rb") as f:
        for offset, length, dest in rows:
            want = os.pread(f.fileno(), length, offset)
            assert bytes(buffer[dest:dest + len(want)]) == want, (offset, length, dest)


def test_ranges_land_where_asked(data_file, engine):
    file = _open(data_file)
    try:
        a = file.alignment[0]
        assert file.size == SIZE and file.engine == engine
        page = 4096  # a multiple of every alignment
        tail = 600 * page
        rows = [(0, page, 0), (7 * page, 3 * page, 16 * page), (40 * page, 150 * page, 32 * page),
                (SIZE // a * a, a, tail)]  # the last ends past the file: an aligned tail
        buffer = mmap.mmap(-1, 1 << 22)
        result = file.read(buffer, np.array(rows, dtype=np.uint64), queue_depth=4,
                           request_size=4 * page)
        _check(data_file, buffer, rows)
        assert result["bytes"] == page + 3 * page + 150 * page + SIZE % a
        assert result["requests"] >= 1 + 1 + 150 // 4 + 1
        assert result["direct"] is True and result["engine"] == engine
        assert bytes(buffer[tail + SIZE % a:tail + a]) == bytes(a - SIZE % a)  # untouched
    finally:
        file.close()


@hsettings(max_examples=40, deadline=None,
           suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, SIZE // 512), st.integers(1, 64)), max_size=12),
       st.sampled_from([512, 4096, 65536]), st.integers(1, 8))
def test_random_ranges_equal_pread(data_file, engine, picks, request_size, depth):
    file = _open(data_file)
    try:
        a = file.alignment[0]
        limit = -(-SIZE // a) * a
        rows = []
        for i, (block, blocks) in enumerate(picks):  # each its own 256 KiB of the buffer
            offset = min(block * 512 // a * a, limit - a)
            length = min(blocks * a, limit - offset)
            rows.append((offset, length, i * 64 * 4096))
        buffer = mmap.mmap(-1, 12 * 64 * 4096)
        request = max(a, request_size // a * a)
        file.read(buffer, np.array(rows, dtype=np.uint64).reshape(-1, 3), queue_depth=depth,
                  request_size=request)
        _check(data_file, buffer, rows)
    finally:
        file.close()


def test_bad_ranges_are_refused_naming_the_range(data_file, engine):
    file = _open(data_file)
    buffer = mmap.mmap(-1, 1 << 20)
    try:
        a = file.alignment[0]
        for rows, text in (([(a + 1, a, 0)], "range 0 .*not aligned"),
                           ([(0, a, 0), (0, a, 3)], "range 1 .*not aligned"),
                           ([(0, a, (1 << 20) - a + a)], "does not fit the region"),
                           ([(SIZE // a * a, 2 * a, 0)], "past the end")):
            with pytest.raises(ValueError, match=text):
                file.read(buffer, np.array(rows, dtype=np.uint64), request_size=a)
        with pytest.raises(ValueError, match="request_size"):
            file.read(buffer, np.array([(0, a, 0)], dtype=np.uint64), request_size=a + 1)
    finally:
        file.close()


def test_a_file_that_shrank_raises_enodata_naming_the_offset(tmp_path, engine):
    path = tmp_path / "shrinks.bin"
    path.write_bytes(bytes(1 << 20))
    file = _open(path)
    try:
        os.truncate(path, 300_000)
        buffer = mmap.mmap(-1, 1 << 20)
        with pytest.raises(OSError) as raised:
            file.read(buffer, np.array([(0, 1 << 20, 0)], dtype=np.uint64), request_size=65536)
        assert raised.value.errno == errno.ENODATA
        assert raised.value.filename == str(path)
        # Where a read found the data missing: the new end, or a later request's start.
        offset = int(re.search(r"at offset (\d+)", str(raised.value)).group(1))
        assert 300_000 <= offset < 1 << 20
    finally:
        file.close()


def test_buffered_where_the_filesystem_refuses_o_direct(no_direct_dir, engine):
    path = no_direct_dir / "data.bin"
    payload = random.Random(5).randbytes(10_000)
    path.write_bytes(payload)
    file = _open(path)
    try:
        assert file.direct is False
        buffer = bytearray(20_000)
        result = file.read(buffer, np.array([(3, 9_000, 11), (9_999, 1, 0)], dtype=np.uint64))
        assert bytes(buffer[11:9_011]) == payload[3:9_003] and buffer[0] == payload[9_999]
        assert result["bytes"] == 9_001 and result["direct"] is False
    finally:
        file.close()


def test_many_threads_read_through_one_file(data_file, engine):
    file = _open(data_file)
    a = file.alignment[0]
    errors = []

    def body(seed: int) -> None:
        rng = random.Random(seed)
        buffer = mmap.mmap(-1, 64 * a)
        try:
            for _ in range(30):
                rows = [(rng.randrange(SIZE // a - 8) * a, rng.randrange(1, 8) * a, i * 8 * a)
                        for i in range(8)]
                file.read(buffer, np.array(rows, dtype=np.uint64), request_size=2 * a)
                _check(data_file, buffer, rows)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    file.close()
    assert not errors, errors[0]


def test_closed_file_refuses_reads(data_file, engine):
    file = _open(data_file)
    file.close()
    file.close()  # idempotent
    with pytest.raises(OSError) as raised:
        file.read(bytearray(4096), np.array([(0, 4096, 0)], dtype=np.uint64))
    assert raised.value.errno == errno.EBADF


def test_o_direct_really_used_on_this_disk(data_file):
    if not direct_io_works(data_file.parent):
        pytest.skip("this filesystem refuses O_DIRECT")
    assert _open(data_file).direct is True
