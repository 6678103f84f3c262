"""One contract suite for whole-file writes and reads (the checkpoint I/O) on every engine."""

from __future__ import annotations

import errno
import mmap
import random

import numpy as np
import pytest

from flashstream import engine as fse

ALIGN = 4096
MiB = 1 << 20
RESULT_KEYS = {"bytes", "seconds", "requests", "counts", "min_ns", "max_ns", "sum_ns", "paused",
               "timeline", "peak", "sustained", "final_rate", "crcs", "engine", "direct"}
READ_KEYS = {"bytes", "seconds", "requests", "counts", "min_ns", "max_ns", "sum_ns", "engine",
             "direct"}


def padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def aligned(n: int, seed: int = 0) -> np.ndarray:
    """n random bytes in page-aligned memory (O_DIRECT takes it), writable."""
    buf = np.frombuffer(mmap.mmap(-1, max(n, ALIGN)), dtype=np.uint8)[:n]
    buf[:] = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return buf


def crc32c_reference(data: bytes, crc: int = 0) -> int:
    """Bit-at-a-time CRC-32C: slow, obviously right."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def expected_engine(name: str) -> str:
    return fse.engine_name(name)


def write_file(path, data, engine, *, size=None, chunk_size=MiB, queue_depth=4, direct=True,
               **kw):
    """Writes data (padded when direct) and commits `size` bytes; returns the result dict."""
    size = len(data) if size is None else size
    out = fse.open_output(path, max(len(data), size), engine=engine, direct=direct)
    try:
        result = out.write(data, 0, chunk_size=chunk_size, queue_depth=queue_depth, **kw)
        out.commit(size)
    finally:
        out.close()
    return result


# -- round trips ------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * MiB + 17])
@pytest.mark.parametrize("chunk_size", [MiB, 320 * 1024])
def test_round_trip(tmp_path, engine, size, chunk_size):
    data = aligned(padded(size), seed=size)
    path = tmp_path / "out.bin"
    result = write_file(path, data, engine, size=size, chunk_size=chunk_size)
    assert set(result) == RESULT_KEYS
    assert result["bytes"] == len(data)
    assert result["engine"] == expected_engine(engine)
    assert result["direct"] is True  # tmp_path is on a disk that takes O_DIRECT
    assert int(result["counts"].sum()) == result["requests"] >= -(-len(data) // chunk_size)
    assert sum(b for _, b, _ in result["timeline"]) == len(data)
    assert result["crcs"] == [] and result["paused"] == 0 and result["final_rate"] == 0
    assert path.read_bytes() == data[:size].tobytes()


def test_header_written_last_and_crcs(tmp_path, engine):
    header, body = ALIGN, 5 * MiB + 2 * ALIGN
    data = aligned(header + body, seed=3)
    path = tmp_path / "ckpt.bin"
    out = fse.open_output(path, header + body, engine=engine, direct=True)
    assert out.path == str(path) and out.direct and out.alignment[0] > 0
    bounds = [0, 100, 100, MiB + 7, 3 * MiB, body - 3]  # across chunks, one empty segment
    result = out.write(data[header:], header, chunk_size=MiB, queue_depth=4, crc_bounds=bounds)
    assert result["crcs"] == [fse.crc32c(data[header + a:header + b])
                              for a, b in zip(bounds, bounds[1:])]
    assert result["crcs"][0] == crc32c_reference(data[header:header + 100].tobytes())
    assert result["crcs"][1] == 0
    head = out.write(data[:header], 0, chunk_size=ALIGN, queue_depth=1, crc_bounds=[0, header])
    assert head["crcs"] == [fse.crc32c(data[:header])]
    out.commit(header + body - 10)  # drops the padding: the exact size
    out.close()  # idempotent after commit
    assert path.read_bytes() == data[:header + body - 10].tobytes()


def test_read_only_buffers_of_any_kind(tmp_path, engine):
    payload = random.Random(5).randbytes(10_000)
    kinds = {"bytes": payload, "memoryview": memoryview(payload),
             "numpy": np.frombuffer(payload, dtype=np.uint8)}
    for name, data in kinds.items():
        path = tmp_path / f"{name}.bin"
        write_file(path, data, engine, chunk_size=ALIGN, direct=False)
        assert path.read_bytes() == payload


def test_exclusive_create(tmp_path, engine):
    path = tmp_path / "exists"
    path.write_bytes(b"keep")
    with pytest.raises(FileExistsError):
        fse.open_output(path, ALIGN, engine=engine, direct=True)
    assert path.read_bytes() == b"keep"


def test_closed_file_refuses_writes(tmp_path, engine):
    out = fse.open_output(tmp_path / "c", ALIGN, engine=engine, direct=True)
    out.close()
    with pytest.raises(OSError) as info:
        out.write(aligned(ALIGN), 0, chunk_size=ALIGN, queue_depth=1)
    assert info.value.errno == errno.EBADF


@pytest.fixture
def small_tmpfs(small_fs):
    """A 4 MiB tmpfs (needs root to mount)."""
    return small_fs("4m")


def test_disk_full_fails_at_open(small_tmpfs, engine):
    path = small_tmpfs / "big.bin"
    with pytest.raises(OSError) as info:
        fse.open_output(path, 16 * MiB, engine=engine, direct=True)
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == str(path)
    assert not path.exists()  # nothing half-made is left behind


def test_disk_full_while_writing(small_tmpfs, engine):
    path = small_tmpfs / "unreserved.bin"
    out = fse.open_output(path, 0, engine=engine, direct=True)  # no space reserved
    with pytest.raises(OSError) as info:
        out.write(aligned(8 * MiB), 0, chunk_size=MiB, queue_depth=4)
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == str(path)
    assert "offset" in str(info.value)
    out.close()


def test_buffered_fallback(no_direct_dir, engine):
    payload = random.Random(7).randbytes(5000)  # unaligned length, offset and address
    path = no_direct_dir / "f.bin"
    out = fse.open_output(path, 6000, engine=engine, direct=True)
    assert out.direct is False
    result = out.write(payload, 3, chunk_size=1000, queue_depth=3, crc_bounds=[0, 5000])
    assert result["direct"] is False and result["crcs"] == [fse.crc32c(payload)]
    out.write(b"abc", 0, chunk_size=ALIGN, queue_depth=1)
    out.commit(5003)
    assert path.read_bytes() == b"abc" + payload
    buf = bytearray(padded(5003))
    got = fse.read_into(path, buf, 5003, engine=engine, chunk_size=ALIGN, queue_depth=2,
                        direct=True)
    assert got["direct"] is False and bytes(buf[:5003]) == b"abc" + payload


# -- reads ------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [0, 1, 4096, 4097, 3 * MiB + 17])
@pytest.mark.parametrize("direct", [True, False])
def test_read_into(tmp_path, engine, size, direct):
    payload = random.Random(size).randbytes(size)
    path = tmp_path / "r.bin"
    path.write_bytes(payload)
    buf = aligned(padded(size))
    result = fse.read_into(path, buf, size, engine=engine, chunk_size=256 * 1024, queue_depth=4,
                           direct=direct)
    assert set(result) == READ_KEYS
    assert result["bytes"] == size and result["direct"] is direct
    assert int(result["counts"].sum()) == result["requests"]
    assert result["engine"] == expected_engine(engine)
    assert buf[:size].tobytes() == payload


def test_read_into_short_file(tmp_path, engine):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 10_000)
    with pytest.raises(OSError) as info:
        fse.read_into(path, aligned(32 * 1024), 20_000, engine=engine, chunk_size=ALIGN,
                      queue_depth=4, direct=True)
    assert info.value.errno == errno.ENODATA
    assert info.value.filename == str(path)
    assert "10000" in str(info.value)
    with pytest.raises(FileNotFoundError):
        fse.read_into(tmp_path / "missing", aligned(ALIGN), 1, engine=engine, chunk_size=ALIGN,
                      queue_depth=1, direct=True)


# -- arguments --------------------------------------------------------------------------------

def test_bad_arguments(tmp_path, engine):
    out = fse.open_output(tmp_path / "v", 0, engine=engine, direct=True)
    data = aligned(2 * ALIGN)
    ok = {"chunk_size": ALIGN, "queue_depth": 2}
    bad_calls = [
        ({"chunk_size": 0, "queue_depth": 2}, 0, data),
        ({"chunk_size": ALIGN, "queue_depth": 0}, 0, data),
        ({**ok, "crc_bounds": [0, 200, 100]}, 0, data),
        ({**ok, "crc_bounds": [1, 200]}, 0, data),
        ({**ok, "crc_bounds": [0, 3 * ALIGN]}, 0, data),
        ({**ok, "interval": 0.0}, 0, data),
        ({**ok, "rate": -1.0}, 0, data),
        ({**ok, "adaptive": {"nonsense": 1}}, 0, data),
        ({**ok, "adaptive": {"cliff_windows": 99}}, 0, data),
    ]
    if out.direct:  # O_DIRECT alignment rules
        bad_calls += [({"chunk_size": ALIGN + 1, "queue_depth": 2}, 0, data),
                      (ok, 1, data), (ok, 0, data[:100]), (ok, 0, data[1:ALIGN + 1])]
    for kw, offset, buf in bad_calls:
        with pytest.raises(ValueError):
            out.write(buf, offset, **kw)
    out.write(data, 0, **ok)  # still usable after refused calls
    out.close()
    with pytest.raises(ValueError):
        fse.open_output(tmp_path / "w", 0, engine="bogus", direct=True)
    path = tmp_path / "r"
    path.write_bytes(b"y" * 100)
    with pytest.raises(ValueError):
        fse.read_into(path, bytearray(10), 100, engine=engine, chunk_size=ALIGN, queue_depth=1,
                      direct=False)
    with pytest.raises((BufferError, TypeError)):
        fse.read_into(path, b"z" * 100, 100, engine=engine, chunk_size=ALIGN, queue_depth=1,
                      direct=False)


# -- pacing -----------------------------------------------------------------------------------

def test_fixed_rate_pacing(tmp_path, engine):
    size, rate = 32 * MiB, 64.0 * MiB  # half a second on tmp_path's disk
    data = aligned(size)
    # A shared (virtual) disk sometimes stalls for longer than the whole write: then the
    # average says nothing about the pacer, so a stalled attempt is repeated (at most four
    # times: three attempts in a row once met a stall, in a clean-clone CI run).
    for attempt in range(5):
        result = write_file(tmp_path / f"paced{attempt}.bin", data, engine, rate=rate,
                            chunk_size=512 * 1024, queue_depth=8)
        average = result["bytes"] / result["seconds"]
        if abs(average / rate - 1) < 0.05:
            break
    assert abs(average / rate - 1) < 0.05, f"{average / MiB:.1f} MiB/s"
    assert result["paused"] > 0.2
    assert result["final_rate"] == rate
    assert all(r == rate for _, _, r in result["timeline"])


def test_paced_requests_are_cut_to_paced_chunk_size(tmp_path, engine):
    # A rate above the disk's speed paces (the schedule runs) without slowing the test, and
    # below the one at which requests grow (4000 a second of 1 MiB).
    data = aligned(8 * MiB + 3 * ALIGN, seed=4)
    fast = 4e9
    paced = write_file(tmp_path / "paced.bin", data, engine, rate=fast, chunk_size=4 * MiB,
                       paced_chunk_size=MiB, crc_bounds=[0, len(data)])
    unpaced = write_file(tmp_path / "unpaced.bin", data, engine, chunk_size=4 * MiB,
                         paced_chunk_size=MiB)
    assert paced["requests"] == 9 and unpaced["requests"] == 3  # 1 MiB vs 4 MiB requests
    assert paced["crcs"] == [fse.crc32c(data)]
    assert (tmp_path / "paced.bin").read_bytes() == data.tobytes()
    # Larger than chunk_size: chunk_size holds.
    wide = write_file(tmp_path / "wide.bin", data, engine, rate=fast, chunk_size=MiB,
                      paced_chunk_size=4 * MiB)
    assert wide["requests"] == 9


def test_paced_requests_grow_with_a_high_rate(tmp_path, engine):
    """Past 4000 paced requests a second each one's wake-up costs the pace more than a short
    request saves the reads: at 8 GB/s, 1 MiB requests grow to 2 MB (aligned down), and at
    1e12 bytes/s to chunk_size."""
    data = aligned(8 * MiB, seed=5)
    grown = write_file(tmp_path / "grown.bin", data, engine, rate=8e9, chunk_size=4 * MiB,
                       paced_chunk_size=MiB)
    assert grown["requests"] == -(-len(data) // (2_000_000 // ALIGN * ALIGN))
    assert (tmp_path / "grown.bin").read_bytes() == data.tobytes()
    widest = write_file(tmp_path / "widest.bin", data, engine, rate=1e12, chunk_size=4 * MiB,
                        paced_chunk_size=MiB)
    assert widest["requests"] == 2


def test_paced_chunk_size_must_be_aligned(tmp_path, engine):
    out = fse.open_output(tmp_path / "f.bin", MiB, engine=engine, direct=True)
    try:
        with pytest.raises(ValueError, match="O_DIRECT alignment"):
            out.write(aligned(MiB), 0, chunk_size=MiB, queue_depth=2, rate=1e9,
                      paced_chunk_size=1000)
    finally:
        out.close()


def test_adaptive_under_a_ceiling(tmp_path, engine):
    data = aligned(8 * MiB, seed=9)
    path = tmp_path / "adaptive.bin"
    result = write_file(path, data, engine, rate=256.0 * MiB, adaptive={"window": 0.005},
                        crc_bounds=[0, len(data)])
    assert result["peak"] > 0
    assert 0 < result["final_rate"] <= 256.0 * MiB
    assert result["crcs"] == [fse.crc32c(data)]
    assert path.read_bytes() == data.tobytes()


def test_pacer_schedule():
    pacer = fse.Pacer(100.0)
    now = 0.0
    for i in range(50):
        delay = pacer.admit(10, now)
        assert delay >= 0
        now += delay
        assert now == pytest.approx(i * 0.1)
    assert fse.Pacer().admit(1 << 30, 0.0) == 0.0


def test_adaptive_rate_finds_the_cliff():
    rate = fse.AdaptiveRate(window=0.1, cliff_windows=2, margin=0.9)
    for _ in range(20):  # 3 GB/s while the SLC cache lasts
        assert rate.observe(300_000_000, 0.1) == 0.0
    assert not rate.cliff and rate.peak == pytest.approx(3e9)
    rate.observe(100_000_000, 0.1)  # 1 GB/s: one window is not yet a cliff
    assert not rate.cliff
    assert rate.observe(100_000_000, 0.1) == pytest.approx(0.9e9)
    assert rate.cliff and rate.sustained == pytest.approx(1e9)
    with pytest.raises(ValueError):
        fse.AdaptiveRate(margin=0.0)


# -- CRC-32C ----------------------------------------------------------------------------------

def test_crc32c_known_vector_and_reference():
    assert fse.crc32c(b"123456789") == 0xE3069283
    assert fse.crc32c(b"") == 0
    assert fse.crc32c(b"6789", fse.crc32c(b"12345")) == 0xE3069283
    assert isinstance(fse.crc32c_hardware(), bool)
    rng = random.Random(2)
    for _ in range(50):
        data = rng.randbytes(rng.randrange(0, 300))
        assert fse.crc32c(data) == crc32c_reference(data)
    big = np.frombuffer(rng.randbytes(200_000), dtype=np.uint8)  # over the GIL-release size
    whole = fse.crc32c(big)
    assert fse.crc32c(big[70_001:], fse.crc32c(big[:70_001])) == whole
    assert fse.crc32c(memoryview(big.tobytes())) == whole
