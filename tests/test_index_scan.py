"""Header-hopping and sequential index scans give exactly the full scan's index and errors."""

from __future__ import annotations

import gzip
import io
import shutil
import tarfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shardgen import EDGE_SIZES, make_samples, write_tar, write_with_gnu_tar
from test_fuzz_equality import MEMBER, build

from flashstream import ShardStream
from flashstream import settings as fs_settings
from flashstream.errors import ShardFormatError
from flashstream.stream import index_scan
from flashstream.stream.handlers import reraise_exception
from flashstream.stream.index_scan import SCAN_ENV, scan_shards

# The header-hopping scan is the C++ engines' (the python engine leaves indexing to a full
# scan): not rerun on the python engine (tests/conftest.py).
pytestmark = pytest.mark.native_engine

METHODS = ("hop", "sequential", "auto")


def scan(paths, mode, monkeypatch, handler=lambda exn: True, **io):
    """Index and errors of ``paths`` scanned with FLASHSTREAM_INDEX_SCAN=mode."""
    monkeypatch.setenv(SCAN_ENV, mode)
    errors, state = {}, index_scan.ScanState()
    found = scan_shards([str(p) for p in paths], fs_settings.resolve(**io), handler, errors,
                        state=state)
    return found, {i: (type(e), str(e)) for i, e in errors.items()}, state.methods


def assert_same_index(paths, monkeypatch, **io):
    """Every method's index and errors equal the full scan's; returns the methods used."""
    want, want_errors, _ = scan(paths, "full", monkeypatch, **io)
    used = {}
    for mode in METHODS:
        got, got_errors, used[mode] = scan(paths, mode, monkeypatch, **io)
        assert got_errors == want_errors, mode
        for a, b in zip(got, want):
            assert np.array_equal(a.offsets, b.offsets), mode
            assert np.array_equal(a.ends, b.ends), mode
            assert (a.compression, a.shard_bytes, a.mtime_ns) == (
                b.compression, b.shard_bytes, b.mtime_ns)
    return used


def equality_suite(directory):
    """The shards of tests/test_equality.py, with some members made larger so they hop."""
    directory.mkdir()
    shards = [write_tar(directory / "edge.tar", make_samples(
        40, sizes=EDGE_SIZES + [3 << 20, (1 << 20) + 7], exts=("cls", "bin")))]
    long_dir = "d" * 60 + "/" + "e" * 50
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT):
        samples = [(f"{long_dir}/k{i:03d}", {"txt": b"x" * i, "json": b"{}"})
                   for i in range(30)]
        if fmt != tarfile.USTAR_FORMAT:
            samples += [("n" * 120 + f"{i}", {"bin": bytes([i]) * 70_000}) for i in range(5)]
        shards.append(write_tar(directory / f"long-{fmt}.tar", samples, fmt=fmt))
    shards.append(write_tar(directory / "pax.tar", [
        (f"unicode/key{i}", {"TXT": "é".encode() * 9000 * i}) for i in range(10)],
        fmt=tarfile.PAX_FORMAT))
    extra = []
    for name, kind in (("folder", tarfile.DIRTYPE), ("folder/link.txt", tarfile.SYMTYPE),
                       ("folder/hard.txt", tarfile.LNKTYPE), ("__meta__", tarfile.REGTYPE),
                       ("folder/README", tarfile.REGTYPE)):
        info = tarfile.TarInfo(name)
        info.type = kind
        info.linkname = "a.txt" if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
        extra.append(info)
    shards.append(write_tar(directory / "odd.tar", make_samples(10, sizes=[10, 600, 90_000]),
                            extra=extra))
    for fmt in ("gnu", "pax", "ustar"):
        files = {f"sub/dir/sample{i:04d}.{ext}": bytes([i % 251]) * size
                 for i in range(20) for ext, size in (("jpg", 9000 * i + 1), ("cls", 3))}
        files["sub/dir/" + "x" * 90 + ".txt"] = b"long name"
        made = write_with_gnu_tar(directory / f"gnu-{fmt}.tar", directory, files, fmt)
        if made is not None:
            shards.append(made)
    garbage = write_tar(directory / "garbage.tar", make_samples(5, sizes=[200_000]))
    with open(garbage, "ab") as f:
        f.write(b"\x07" * 3000)
    shards.append(garbage)
    return shards


def test_every_method_indexes_the_equality_suite_as_the_full_scan(tmp_path, monkeypatch,
                                                                   engine):
    if engine == "python":
        pytest.skip("the indexer is C++; the python engine always takes the full scan")
    shards = equality_suite(tmp_path / "suite")
    used = assert_same_index(shards, monkeypatch)
    assert used["hop"]["hop"] >= len(shards) - used["hop"]["full"] > 0
    assert used["sequential"]["sequential"] == len(shards) - used["sequential"]["full"]


def test_peer_shards_index_alike(tmp_path, monkeypatch, peer_data):
    shards = [shutil.copyfile(s, tmp_path / s.name) for s in sorted(peer_data.iterdir())
              if s.suffix in (".tar", ".tgz", ".gz")]
    used = assert_same_index(shards, monkeypatch)
    assert used["hop"]["full"] >= 1  # the compressed ones


def test_compressed_shards_take_the_full_scan(tmp_path, monkeypatch):
    plain = write_tar(tmp_path / "a.tar", make_samples(20, sizes=[1000, 90_000]))
    gz = tmp_path / "a.tar.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    used = assert_same_index([plain, gz], monkeypatch)
    assert used["hop"] == {"hop": 1, "sequential": 0, "full": 1}


def test_extensions_only_python_can_compare_take_the_full_scan(tmp_path, monkeypatch):
    # "\u212a" (Kelvin sign) lowercases to "k" in Python: .K and .\u212a collide in webdataset's
    # dict, which the full scan reports; the indexer leaves such shards to it.
    shard = write_tar(tmp_path / "kelvin.tar", [("a", {"k": b"1" * 70_000, "\u212a": b"2"})],
                      fmt=tarfile.PAX_FORMAT)
    local = write_tar(tmp_path / "local.tar", [("a", {"__local_path__": b"x"})])
    used = assert_same_index([shard, local], monkeypatch)
    assert used["hop"]["full"] == 2
    _, errors, _ = scan([shard], "hop", monkeypatch)
    assert "duplicate" in errors[0][1]


def corrupt_shard(path, *, members=12, size=1 << 20, bad=7):
    """Members of ``size`` bytes; the header of member ``bad`` has a broken checksum."""
    write_tar(path, [(f"s{i:03d}", {"bin": bytes([i]) * size}) for i in range(members)])
    header = bad * (512 + -(-size // 512) * 512)  # each member: a header, data padded to 512
    data = bytearray(path.read_bytes())
    assert data[header:header + 8] == f"s{bad:03d}.bin".encode()[:8]
    data[header + 148:header + 156] = b"0000000\0"
    path.write_bytes(bytes(data))
    return header


def stopping_shard(path, *, members=4, size=100_000, bad=2):
    """corrupt_shard's members, cut inside the padding before member ``bad``'s header:
    tarfile raises looking for that header, where webdataset's False handler ends the stream
    (after the open sample, member ``bad - 1``). A bad header itself it would pass over."""
    header = corrupt_shard(path, members=members, size=size, bad=bad)
    path.write_bytes(path.read_bytes()[:header - 100])
    return header - 100


@pytest.mark.parametrize("mode", METHODS)
def test_a_corrupt_header_found_by_hopping_raises_as_the_full_scan(tmp_path, monkeypatch,
                                                                    mode):
    shard = tmp_path / "bad.tar"
    offset = corrupt_shard(shard)
    raised = {}
    for method in ("full", mode):
        monkeypatch.setenv(SCAN_ENV, method)
        with pytest.raises(ShardFormatError) as caught:
            scan_shards([str(shard)], fs_settings.resolve(), reraise_exception)
        raised[method] = caught.value
    assert str(raised[mode]) == str(raised["full"])
    assert raised[mode].offset == raised["full"].offset == offset
    assert str(shard) in str(raised[mode])
    # With a skipping handler, the samples before the bad header are indexed.
    assert_same_index([shard], monkeypatch)
    (index,), _, _ = scan([shard], mode, monkeypatch)
    assert index.count == 7


@pytest.mark.parametrize("cut", [100, 512 * 3 + 7, (1 << 20) + 300, 5 * ((1 << 20) + 512) - 1])
def test_truncated_shards_fail_alike(tmp_path, monkeypatch, cut):
    shard = write_tar(tmp_path / "t.tar", [(f"s{i}", {"bin": bytes(1 << 20), "txt": b"t"})
                                           for i in range(6)])
    data = shard.read_bytes()
    shard.write_bytes(data[:cut])
    assert_same_index([shard], monkeypatch)


def test_empty_and_missing_shards_fail_alike(tmp_path, monkeypatch):
    empty = tmp_path / "empty.tar"
    empty.write_bytes(b"")
    good = write_tar(tmp_path / "good.tar", make_samples(3, sizes=[80_000]))
    _, errors, _ = scan([empty, tmp_path / "missing.tar", good], "hop", monkeypatch)
    assert set(errors) == {0, 1}
    assert_same_index([empty, tmp_path / "missing.tar", good], monkeypatch)


def test_a_handler_that_stops_leaves_the_later_shards_unread(tmp_path, monkeypatch):
    bad = tmp_path / "bad.tar"
    corrupt_shard(bad, members=4, size=100_000, bad=2)
    good = write_tar(tmp_path / "good.tar", make_samples(3, sizes=[80_000]))
    cut = tmp_path / "cut.tar"
    stopping_shard(cut)
    for mode in ("full", "hop"):
        seen = []
        found, errors, _ = scan([good, cut, good], mode, monkeypatch,
                                handler=lambda exn, seen=seen: seen.append(exn) and False)
        assert [index.count for index in found] == [3, 2, 0], mode
        assert "not read" in errors[2][1]
        assert len(seen) == 1  # the handler never sees the shards it left unread
        # A bad header after the first: tarfile ends the archive there quietly, and webdataset
        # goes on with the next shard, so a False verdict ends only that shard.
        seen.clear()
        found, errors, _ = scan([good, bad, good], mode, monkeypatch,
                                handler=lambda exn, seen=seen: seen.append(exn) and False)
        assert [index.count for index in found] == [3, 2, 3], mode
        assert len(seen) == 1 and seen[0].shard_only


def test_hopping_one_mib_members_reads_under_two_percent(tmp_path, monkeypatch):
    shards = [write_tar(tmp_path / f"big{s}.tar",
                        [(f"s{i:04d}", {"bin": bytes([i % 256]) * (1 << 20), "json": b"{}"})
                         for i in range(40)]) for s in range(3)]
    total = sum(p.stat().st_size for p in shards)
    for mode in ("auto", "hop"):
        monkeypatch.setenv(SCAN_ENV, mode)
        stream = ShardStream([str(p) for p in shards])
        scanned = stream.index_info["by_source"]["scan"]
        assert scanned["shards"] == 3 and scanned["methods"]["hop"] == 3
        assert scanned["bytes"] <= 0.02 * total, (mode, scanned["bytes"], total)
        assert len(stream) == 120
        for path in shards:  # the next mode scans again
            from flashstream.stream.index import cached_path

            cached_path(str(path)).unlink()


def test_small_members_are_read_sequentially_under_auto(tmp_path, monkeypatch):
    shard = write_tar(tmp_path / "small.tar", make_samples(300, sizes=[2000, 9000]))
    used = assert_same_index([shard], monkeypatch)
    assert used["auto"]["sequential"] == 1 and used["hop"]["hop"] == 1


def test_the_threshold_follows_the_probe(tmp_path, monkeypatch):
    from flashstream.telemetry import probe as probe_module
    from flashstream.telemetry.probe import ProbePoint, ProbeResult

    index_scan._probe_figures.cache_clear()
    threshold, source = index_scan.hop_threshold(str(tmp_path / "x.tar"), 32)
    assert (threshold, source) == (index_scan.DEFAULT_HOP_THRESHOLD, "default")
    device = index_scan._device_key(str(tmp_path / "x.tar"))

    def point(pattern, bs, qd, nbytes, requests):
        return ProbePoint(op="read", pattern=pattern, block_size=bs, queue_depth=qd,
                          bytes=nbytes, seconds=1.0, requests=requests, direct=True,
                          latency_us={})

    result = ProbeResult(device={}, engine="uring", config={}, points=[
        point("sequential", 1 << 20, 8, 2_000_000_000, 1907),
        point("random", 4096, 1, 4096 * 10_000, 10_000),
        point("random", 4096, 32, 4096 * 100_000, 100_000)])
    cache = probe_module.default_cache_dir()
    cache.mkdir(parents=True)
    (cache / f"{device}-uring-0123456789.json").write_text(__import__("json").dumps(
        result.to_dict()))
    index_scan._probe_figures.cache_clear()
    try:
        assert index_scan.hop_threshold(str(tmp_path / "x.tar"), 32) == (20_000, "probe")
        assert index_scan.hop_threshold(str(tmp_path / "x.tar"), 1) == (200_000, "probe")
        middle, _ = index_scan.hop_threshold(str(tmp_path / "x.tar"), 4)
        assert 20_000 < middle < 200_000
    finally:
        index_scan._probe_figures.cache_clear()


@pytest.mark.parametrize("mode", METHODS + ("full",))
def test_nothing_to_scan(monkeypatch, mode):
    assert scan([], mode, monkeypatch)[0] == []


def test_the_handler_ending_the_scan_carries_over_batches(tmp_path, monkeypatch):
    bad = tmp_path / "bad.tar"
    stopping_shard(bad)
    good = write_tar(tmp_path / "good.tar", make_samples(3, sizes=[80_000]))
    seen, state, errors = [], index_scan.ScanState(), {}

    def handler(exn):
        seen.append(exn)
        return False

    first = scan_shards([str(bad)], fs_settings.resolve(), handler, errors, state=state)
    later = scan_shards([str(good)], fs_settings.resolve(), handler, errors, state=state)
    assert [first[0].count, later[0].count] == [2, 0] and len(seen) == 1
    assert state.stopped and "not read" in str(errors[0])
    assert state.methods == {"hop": 1, "sequential": 0, "full": 0}


def test_a_bad_scan_mode_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(SCAN_ENV, "fast")
    with pytest.raises(ValueError, match="auto, hop, sequential, full"):
        scan_shards([str(tmp_path / "a.tar")], fs_settings.resolve(), reraise_exception)


def mangle(data: bytes, cut: int, flips) -> bytes:
    out = bytearray(data[:max(0, len(data) - cut)])
    for position, value in flips:
        if out:
            out[position % len(out)] = value
    return bytes(out)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(members=st.lists(MEMBER, min_size=1, max_size=20),
       big=st.lists(st.integers(0, 200_000), max_size=4),
       fmt=st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]),
       long_prefix=st.sampled_from(["", "p" * 120 + "/"]),
       cut=st.sampled_from([0, 0, 0, 1, 513, 1500, 10_000]),
       flips=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=2))
def test_fuzzed_tars_index_alike(tmp_path_factory, monkeypatch, members, big, fmt, long_prefix,
                                 cut, flips):
    members = members + [(f"big{i}.bin", size, tarfile.REGTYPE) for i, size in enumerate(big)]
    path = tmp_path_factory.mktemp("fuzz") / "shard.tar"
    path.write_bytes(mangle(build(members, fmt, long_prefix), cut, flips))
    assert_same_index([path], monkeypatch)


def test_an_archive_with_only_small_reads_hops_correctly_across_windows(tmp_path, monkeypatch):
    """Headers and pax records that straddle the hop reads' 4 KiB windows."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for i in range(60):
            info = tarfile.TarInfo(f"k{i:03d}/" + "n" * (i * 37 % 3000) + ".bin")
            info.size = 3000 + 1531 * i
            tar.addfile(info, io.BytesIO(bytes(info.size)))
    path = tmp_path / "straddle.tar"
    path.write_bytes(out.getvalue())
    assert_same_index([path], monkeypatch)


def test_a_signal_stops_a_long_scan_promptly(tmp_path, monkeypatch):
    """Ctrl-C (here SIGALRM raising KeyboardInterrupt) reaches Python within the indexer's
    50 ms poll, not after the whole scan, and the next scan works."""
    import signal
    import time

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for i in range(20_000):  # one hop per member, each waiting for the one before
            info = tarfile.TarInfo(f"k{i:05d}.bin")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    shard = tmp_path / "long.tar"
    shard.write_bytes(out.getvalue())
    monkeypatch.setenv(SCAN_ENV, "hop")

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        start = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            scan_shards([str(shard)], fs_settings.resolve(), reraise_exception)
        stopped_after = time.perf_counter() - start
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    start = time.perf_counter()
    (index,) = scan_shards([str(shard)], fs_settings.resolve(), reraise_exception)
    whole = time.perf_counter() - start
    assert index.count == 20_000
    assert stopped_after < whole / 2, (stopped_after, whole)
