"""IndexReader: mmap and RAM serve the same results, every search is counted, the page cache is
really controlled, bad files give clear errors, and replacing the file never breaks a reader."""

from __future__ import annotations

import threading

import numpy as np
import pytest

faiss = pytest.importorskip("faiss")

from flashstream import IndexFormatError, IndexReader, write_index  # noqa: E402
from flashstream.mappings import mappings_of  # noqa: E402
from flashstream.retrieval import SUPPORTED  # noqa: E402

D, N = 32, 4000
KINDS = ("flat", "flat_ip", "ivfflat", "ivfpq", "hnsw")


def _vectors(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(16, D)).astype(np.float32)
    return (centers[rng.integers(0, 16, n)] + 0.3 * rng.normal(size=(n, D))).astype(np.float32)


def _build(kind: str, x: np.ndarray):
    if kind == "flat":
        index = faiss.IndexFlatL2(D)
    elif kind == "flat_ip":
        index = faiss.IndexFlatIP(D)
    elif kind == "ivfflat":
        index = faiss.IndexIVFFlat(faiss.IndexFlatL2(D), D, 16)
    elif kind == "ivfpq":
        index = faiss.IndexIVFPQ(faiss.IndexFlatL2(D), D, 16, 8, 8)
    else:
        index = faiss.IndexHNSWFlat(D, 16)
    if not index.is_trained:
        index.train(x)
    index.add(x)
    return index


@pytest.fixture(scope="module")
def indexes(tmp_path_factory):
    directory = tmp_path_factory.mktemp("indexes")
    x = _vectors(N, 0)
    paths = {}
    for kind in KINDS:
        paths[kind] = directory / f"{kind}.index"
        faiss.write_index(_build(kind, x), str(paths[kind]))
    return paths


@pytest.fixture(scope="module")
def queries():
    return _vectors(64, 1)


@pytest.mark.parametrize("kind", KINDS)
def test_mmap_and_ram_return_identical_results(indexes, queries, kind):
    nprobe = {"nprobe": 4} if kind.startswith("ivf") else {}
    with IndexReader(indexes[kind], io="mmap", **nprobe) as mapped, \
            IndexReader(indexes[kind], mmap=False, **nprobe) as loaded:
        info = mapped.info()
        assert info["io_flag"] in ("IO_FLAG_MMAP_IFC", "IO_FLAG_MMAP")
        assert info["mapped_bytes"] > 0 and info["kind"] in SUPPORTED
        assert loaded.info()["io_flag"] is None and loaded.info()["mapped_bytes"] == 0
        for q in queries[:16]:  # one at a time, as a server calls it
            d1, i1 = mapped.search(q, 10)
            d2, i2 = loaded.search(q, 10)
            np.testing.assert_array_equal(i1, i2)
            np.testing.assert_array_equal(d1, d2)
        d1, i1 = mapped.search(queries, 10)
        d2, i2 = loaded.search(queries, 10)
        np.testing.assert_array_equal(i1, i2)
        assert i1.shape == (len(queries), 10) and (i1 >= 0).all()


def test_latency_counts_every_search_from_many_threads(indexes, queries):
    with IndexReader(indexes["ivfpq"], nprobe=4) as reader:
        per_thread = 50

        def worker(seed):
            for j in range(per_thread):
                reader.search(queries[(seed + j) % len(queries)], 5)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        reader.search(queries, 5)  # a batch is one call, one sample
        hist = reader.latency()
        assert hist.count == 6 * per_thread + 1
        summary = hist.summary()
        assert 0 < summary["p50"] <= summary["p95"] <= summary["p99"] <= summary["max"]
        assert reader.info()["searches"] == hist.count
        assert reader.latency(reset=True).count == hist.count
        assert reader.latency().count == 0


def test_each_search_runs_single_threaded_in_faiss(indexes, queries):
    seen = []
    with IndexReader(indexes["flat"]) as reader:
        def worker():
            reader.search(queries[0], 3)
            seen.append(faiss.omp_get_max_threads())

        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert seen == [1]


def test_evict_makes_it_cold_and_searches_warm_it(indexes, queries):
    with IndexReader(indexes["flat"]) as reader:
        reader.search(queries[:2], 5)
        assert reader.residency() > 0.9  # a flat search reads every vector
        assert reader.evict() < 0.05
        assert reader.residency() < 0.05
        reader.search(queries[:2], 5)
        assert reader.residency() > 0.9
    with IndexReader(indexes["ivfflat"], io="mmap", nprobe=2) as reader:
        cold = reader.evict()
        assert cold < 0.05
        for q in queries[:8]:
            reader.search(q, 5)
        assert reader.residency() > cold


def test_ram_reader_does_not_depend_on_the_file_after_open(indexes, queries, tmp_path):
    path = tmp_path / "copy.index"
    path.write_bytes(indexes["ivfflat"].read_bytes())
    with IndexReader(path, mmap=False, nprobe=4) as reader:
        expected = reader.search(queries, 5)[1]
        reader.evict()
        path.unlink()
        np.testing.assert_array_equal(reader.search(queries, 5)[1], expected)


def test_close_unmaps_the_file(indexes, queries):
    reader = IndexReader(indexes["hnsw"])
    reader.search(queries[0], 3)
    st = indexes["hnsw"].stat()
    assert mappings_of(st)
    reader.close()
    assert not mappings_of(st)
    with pytest.raises(ValueError, match="closed"):
        reader.search(queries[0], 3)
    assert "closed" in repr(reader)


def test_replacing_the_file_by_rename_keeps_old_readers_working(tmp_path, queries):
    path = tmp_path / "live.index"
    old = _build("ivfflat", _vectors(N, 0))
    new = _build("ivfflat", _vectors(N, 7))
    write_index(old, path)
    with IndexReader(path, nprobe=16) as reader:
        before = reader.search(queries, 5)[1]
        write_index(new, path)  # temp file + rename: the reader's inode lives on
        assert not list(tmp_path.glob(".*tmp*"))
        reader.evict()  # even with its pages dropped, the old file is still there to fault in
        np.testing.assert_array_equal(reader.search(queries, 5)[1], before)
        assert reader.refresh() is True
        assert reader.refresh() is False
        assert reader.info()["nprobe"] == 16  # settings carry over to the new file
        with IndexReader(path, nprobe=16) as fresh:
            np.testing.assert_array_equal(reader.search(queries, 5)[1],
                                          fresh.search(queries, 5)[1])


def test_unsupported_index_lists_what_is_supported(tmp_path):
    x = _vectors(2000, 0)
    index = faiss.IndexPQ(D, 8, 8)
    index.train(x)
    index.add(x)
    path = tmp_path / "pq.index"
    faiss.write_index(index, str(path))
    with pytest.raises(IndexFormatError, match="IndexIVFPQ") as info:
        IndexReader(path)
    assert str(path) in str(info.value) and "IxPq" in str(info.value)


@pytest.mark.parametrize("content", [b"", b"ab", b"not a faiss index at all" * 10])
def test_not_an_index(tmp_path, content):
    path = tmp_path / "junk.index"
    path.write_bytes(content)
    with pytest.raises(IndexFormatError, match="junk.index"):
        IndexReader(path)


@pytest.mark.parametrize("kind", ["flat", "ivfpq", "hnsw"])
@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("keep", [0.3, 0.999])
def test_truncated_index_names_the_file(indexes, tmp_path, kind, mmap, keep):
    data = indexes[kind].read_bytes()
    path = tmp_path / f"cut-{kind}.index"
    path.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(IndexFormatError, match=f"cut-{kind}.index.*truncated or corrupt"):
        IndexReader(path, mmap=mmap)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.index"):
        IndexReader(tmp_path / "nowhere.index")


def test_bad_arguments(indexes, queries):
    with pytest.raises(ValueError, match="nprobe does not apply to IndexFlat"):
        IndexReader(indexes["flat"], nprobe=4)
    with pytest.raises(ValueError, match="ef_search does not apply"):
        IndexReader(indexes["ivfpq"], ef_search=4)
    with pytest.raises(ValueError, match="positive"):
        IndexReader(indexes["ivfpq"], nprobe=0)
    with IndexReader(indexes["hnsw"], ef_search=32) as reader:
        assert reader.info()["ef_search"] == 32
        with pytest.raises(ValueError, match=r"shape \(n, 32\)"):
            reader.search(np.zeros((2, 5), np.float32), 3)
        for k in (0, -1, 2.5, True):
            with pytest.raises(ValueError, match="k must be a positive integer"):
                reader.search(queries[0], k)
        assert reader.latency().count == 0  # refused calls are not timed


def test_write_index_into_a_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        write_index(faiss.IndexFlatL2(D), tmp_path / "missing" / "x.index")


@pytest.mark.parametrize("kind", KINDS)
def test_each_mapping_flag_serves_the_same_results(indexes, queries, kind):
    """IO_FLAG_MMAP for IVF (without FAISS's per-search prefetch threads), IO_FLAG_MMAP_IFC for
    the rest by default; either named flag works, and one that maps nothing for the type still
    serves (from RAM, and says so)."""
    knobs = {"nprobe": 4} if kind.startswith("ivf") else {}
    with IndexReader(indexes[kind], mmap=False, **knobs) as loaded:
        expected = loaded.search(queries, 5)[1]
    with IndexReader(indexes[kind], io="mmap", **knobs) as best:
        flag = best.info()["io_flag"]
        assert flag == ("IO_FLAG_MMAP" if kind.startswith("ivf") else "IO_FLAG_MMAP_IFC")
        assert best.info()["mapped_bytes"] > 0
        if kind.startswith("ivf"):
            lists = faiss.downcast_InvertedLists(faiss.extract_index_ivf(best.index).invlists)
            assert type(lists).__name__ == "OnDiskInvertedLists" and lists.prefetch_nthread == 0
        np.testing.assert_array_equal(best.search(queries, 5)[1], expected)
    for flag in ("IO_FLAG_MMAP_IFC", "IO_FLAG_MMAP"):
        if not hasattr(faiss, flag):
            continue
        with IndexReader(indexes[kind], mmap=flag, **knobs) as reader:
            assert reader.info()["io_flag"] == flag
            mapped = reader.info()["mapped_bytes"] > 0
            assert mapped or (flag == "IO_FLAG_MMAP" and not kind.startswith("ivf"))
            np.testing.assert_array_equal(reader.search(queries, 5)[1], expected)


def _vm_flags(reader) -> set:
    """The kernel's VmFlags of the reader's mappings of its file (rr: random, sr: sequential)."""
    starts = {f"{m.start:x}" for m in mappings_of(reader._open().stat)}
    flags, current = set(), False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if "-" in line.split(" ", 1)[0] and not line.startswith("VmFlags"):
                current = line.split("-", 1)[0] in starts
            elif current and line.startswith("VmFlags:"):
                flags.update(line.split()[1:])
    return flags


@pytest.mark.parametrize("kind,advice,expected", [
    ("flat", "auto", set()), ("ivfpq", "auto", set()), ("hnsw", "auto", {"rr"}),
    ("flat", "sequential", {"sr"}), ("ivfflat", "random", {"rr"}), ("hnsw", "normal", set()),
])
def test_advice_sets_the_mappings_readahead(indexes, queries, kind, advice, expected):
    """FAISS maps with MADV_RANDOM; the reader sets the advice asked for (auto: by index type)
    and the kernel shows it in the mapping's VmFlags."""
    with IndexReader(indexes[kind], io="mmap", advice=advice) as reader:
        assert reader.info()["advice"] == (advice if advice != "auto" else
                                           "random" if kind == "hnsw" else "normal")
        assert _vm_flags(reader) & {"rr", "sr"} == expected
        assert reader.search(queries[:4], 5)[1].shape == (4, 5)
    with IndexReader(indexes[kind], mmap=False, advice=advice) as loaded:
        assert loaded.info()["advice"] is None  # nothing mapped to advise


def test_bad_advice_setting(indexes):
    with pytest.raises(ValueError, match="auto, normal, random, sequential"):
        IndexReader(indexes["flat"], advice="willneed")


def test_bad_mmap_setting(indexes):
    with pytest.raises(ValueError, match="IO_FLAG_MMAP_IFC, IO_FLAG_MMAP"):
        IndexReader(indexes["flat"], mmap="yes")


def test_searches_are_live_read_latencies_for_write_pacing(indexes, queries):
    """CheckpointWriter(read_slo=) sees an open IndexReader's searches (the p95 of those made
    since its last look), and nothing once none were made."""
    from flashstream.telemetry.read_latency import ReadLatencyMonitor

    with IndexReader(indexes["flat"]) as reader:
        monitor = ReadLatencyMonitor(None)
        for q in queries[:20]:
            reader.search(q[None, :], 5)
        p95 = monitor.p95()
        assert p95 is not None and 0 < p95 < 10
        assert p95 <= reader.latency().percentile(100) / 1e9 * 1.5
        assert monitor.p95() is None  # no search since
