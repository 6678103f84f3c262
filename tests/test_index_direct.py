"""IndexReader(io="direct"): the probed IVF lists fetched with O_DIRECT into a list cache.

Results equal FAISS's in RAM for every kind, nprobe, batch and cache state, from every engine
and from many threads; the page cache is left alone; a list in use is never dropped; damaged
files raise naming the file and the list; what cannot be served directly is memory-mapped and
says why."""

from __future__ import annotations

import ctypes
import mmap
import threading
import time

import numpy as np
import pytest

faiss = pytest.importorskip("faiss")

from flashstream import IndexFormatError, IndexReader, pagecache  # noqa: E402
from flashstream.retrieval.list_cache import ListCache  # noqa: E402

D, N, NLIST = 16, 6000, 32
KINDS = ("ivfflat", "ivfpq", "ivfsq", "ivfflat_ip")


def _vectors(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(24, D)).astype(np.float32)
    return (centers[rng.integers(0, 24, n)] + 0.4 * rng.normal(size=(n, D))).astype(np.float32)


def _build(kind: str, x: np.ndarray):
    if kind == "ivfflat":
        index = faiss.IndexIVFFlat(faiss.IndexFlatL2(D), D, NLIST)
    elif kind == "ivfflat_ip":
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(D), D, NLIST, faiss.METRIC_INNER_PRODUCT)
    elif kind == "ivfpq":
        index = faiss.IndexIVFPQ(faiss.IndexFlatL2(D), D, NLIST, 4, 8)
    else:
        index = faiss.IndexIVFScalarQuantizer(faiss.IndexFlatL2(D), D, NLIST,
                                              faiss.ScalarQuantizer.QT_8bit)
    index.train(x)
    index.add(x)
    return index


@pytest.fixture(scope="module")
def indexes(tmp_path_factory):
    directory = tmp_path_factory.mktemp("direct")
    x = _vectors(N, 0)
    paths = {}
    for kind in KINDS:
        paths[kind] = directory / f"{kind}.index"
        faiss.write_index(_build(kind, x), str(paths[kind]))
    return paths


@pytest.fixture(scope="module")
def queries():
    return _vectors(40, 1)


def _in_ram(path, nprobe):
    index = faiss.read_index(str(path))
    index.nprobe = nprobe
    return index


def _same(reader, ram, q, k=10):
    d1, i1 = reader.search(q, k)
    d2, i2 = ram.search(q.reshape(-1, D), k)
    np.testing.assert_array_equal(i1, i2)
    np.testing.assert_array_equal(d1, d2)


def _list_bytes(path) -> int:
    with IndexReader(path, io="direct") as reader:
        return reader.info()["direct"]["list_bytes"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("share", [0.0, 0.3, 2.0])  # cache: none, part of the lists, all
def test_results_equal_faiss_in_ram(indexes, queries, kind, share):
    budget = int(_list_bytes(indexes[kind]) * share)
    with IndexReader(indexes[kind], io="direct", list_cache=budget) as reader:
        info = reader.info()
        assert info["io"] == "direct" and info["io_flag"] is None and info["mapped_bytes"] == 0
        for nprobe in (1, 3, NLIST, NLIST + 5):
            reader.configure(nprobe=nprobe)
            ram = _in_ram(indexes[kind], nprobe)
            for q in queries[:6]:
                _same(reader, ram, q)
            _same(reader, ram, queries[:7])
            _same(reader, ram, queries, k=50)
        stats = reader.info()["direct"]["list_cache"]
        assert stats["resident_bytes"] <= max(budget, 0) or share == 0.0
        assert stats["misses"] > 0 and (stats["hits"] > 0) == (share > 0)
        if share >= 1:  # everything fits: each list was fetched once
            assert stats["misses"] == NLIST and stats["evictions"] == 0


def test_every_engine_serves_the_same_results(indexes, queries, engine):
    with IndexReader(indexes["ivfpq"], io="direct", nprobe=5, list_cache="16KiB") as reader:
        ram = _in_ram(indexes["ivfpq"], 5)
        _same(reader, ram, queries)
        for q in queries[:10]:
            _same(reader, ram, q)
        assert reader.info()["o_direct"] is True


def test_auto_is_direct_for_ivf_and_mmap_otherwise_with_the_reason(indexes, tmp_path):
    with IndexReader(indexes["ivfsq"]) as reader:
        assert reader.info()["io"] == "direct" and reader.info()["io_reason"] is None
        assert "direct" in repr(reader)
    flat = faiss.IndexFlatL2(D)
    flat.add(_vectors(100, 2))
    path = tmp_path / "flat.index"
    faiss.write_index(flat, str(path))
    with IndexReader(path, io="direct") as reader:
        info = reader.info()
        assert info["io"] == "mmap" and "IndexFlat is memory-mapped" in info["io_reason"]
        assert "IndexIVFPQ" in info["io_reason"]
    with IndexReader(indexes["ivfflat"], mmap="IO_FLAG_MMAP") as named:  # a flag: mmap
        assert named.info()["io"] == "mmap"
    with IndexReader(indexes["ivfflat"], mmap=False) as loaded:
        assert loaded.info()["io"] == "ram"


def test_a_layout_it_does_not_know_is_memory_mapped_never_guessed(indexes, queries, tmp_path):
    """Bytes after the last list (a newer or other layout) are not what direct reads know:
    the file is served memory-mapped, with the reason, and results stay right."""
    path = tmp_path / "trailing.index"
    path.write_bytes(indexes["ivfflat"].read_bytes() + b"\0" * 100)
    with IndexReader(path, nprobe=4) as reader:
        info = reader.info()
        assert info["io"] == "mmap" and "bytes follow the last list" in info["io_reason"]
        _same(reader, _in_ram(indexes["ivfflat"], 4), queries)


def test_page_cache_untouched_and_evict_gives_the_memory_back(indexes, queries):
    path = indexes["ivfflat"]
    with IndexReader(path, io="direct", nprobe=NLIST) as reader:
        assert reader.evict() == 0.0  # the file's page cache dropped (it was just written)
        reader.search(queries, 5)  # every list fetched
        assert pagecache.resident_bytes(path) == 0  # O_DIRECT: nothing went through the cache
        direct = reader._open().direct
        lists = direct.layout
        start, end = int(lists.offsets[0]), int(lists.ends()[-1])
        assert _resident(direct, start, end) > 0.9 * (end - start)
        stats = reader.info()["direct"]["list_cache"]
        assert stats["resident_lists"] == NLIST
        reader.evict()
        assert reader.info()["direct"]["list_cache"]["resident_bytes"] == 0
        # Only pages shared with the header (the quantizer's centroids) stay.
        assert _resident(direct, start, end) <= mmap.PAGESIZE
        _same(reader, _in_ram(path, NLIST), queries)  # fetched again, right again


def _resident(direct, start: int, end: int) -> int:
    """Bytes of the image's [start, end) in memory (mincore on the anonymous mapping)."""
    page = mmap.PAGESIZE
    first, last = start // page * page, -(-end // page) * page
    vec = (ctypes.c_ubyte * ((last - first) // page))()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(direct.base + first), last - first, vec) == 0
    return int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) * page


def test_concurrent_searches_equal_sequential_ones(indexes, queries):
    path = indexes["ivfpq"]
    ram = _in_ram(path, 6)
    expected = [ram.search(q[None, :], 10) for q in queries]
    budget = _list_bytes(path) // 4  # lists come and go while the threads search
    errors = []
    with IndexReader(path, io="direct", nprobe=6, list_cache=budget) as reader:
        def body(seed: int) -> None:
            try:
                for j in range(60):
                    i = (seed * 7 + j) % len(queries)
                    d, labels = reader.search(queries[i], 10)
                    np.testing.assert_array_equal(labels, expected[i][1])
                    np.testing.assert_array_equal(d, expected[i][0])
            except BaseException as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=body, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        assert reader.latency().count == 8 * 60


def test_eviction_under_concurrent_scans_never_frees_a_list_in_use(indexes, queries):
    path = indexes["ivfflat"]
    ram = _in_ram(path, 8)
    expected = ram.search(queries, 10)[1]
    stop = threading.Event()
    errors = []
    with IndexReader(path, io="direct", nprobe=8) as reader:
        def evicting() -> None:
            while not stop.is_set():
                reader.evict()

        def searching(seed: int) -> None:
            try:
                for j in range(40):
                    i = (seed + j) % len(queries)
                    np.testing.assert_array_equal(reader.search(queries[i], 10)[1][0],
                                                  expected[i])
            except BaseException as e:  # surfaced below
                errors.append(e)

        evictor = threading.Thread(target=evicting)
        evictor.start()
        threads = [threading.Thread(target=searching, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        evictor.join()
        assert not errors, errors[0]

        # The same, step by step: a held list survives evict() and goes at release.
        direct = reader._open().direct
        held = [0, 1]
        reader.evict()
        fetch, waits = direct.cache.acquire(held)
        assert fetch == held and not waits
        direct._fetch(fetch)
        direct.cache.fetched(fetch)
        lo, hi = int(direct.layout.offsets[0]), int(direct.layout.ends()[1])
        with open(path, "rb") as f:
            f.seek(lo)
            want = f.read(hi - lo)
        direct.evict()
        assert all(direct.cache.is_resident(i) for i in held)
        assert bytes(direct._image[lo:hi]) == want
        direct.cache.release(held)
        assert not any(direct.cache.is_resident(i) for i in held)


def test_one_fetch_for_a_list_two_threads_want_at_once(indexes, queries, monkeypatch):
    path = indexes["ivfflat"]
    with IndexReader(path, io="direct", nprobe=4) as reader:
        direct = reader._open().direct
        fetched = []
        real = direct._fetch

        def slow(lists):
            fetched.extend(lists)
            time.sleep(0.2)  # the other thread asks for the same lists meanwhile
            real(lists)

        monkeypatch.setattr(direct, "_fetch", slow)
        results = []
        threads = [threading.Thread(target=lambda: results.append(reader.search(queries[0], 5)))
                   for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(fetched) == len(set(fetched)) == 4  # each list fetched once
        stats = reader.info()["direct"]["list_cache"]
        assert stats["misses"] == 4 and stats["shared"] == 4
        np.testing.assert_array_equal(results[0][1], results[1][1])


def test_a_failed_fetch_raises_and_leaves_nothing_half_there(indexes, queries, monkeypatch):
    path = indexes["ivfflat"]
    with IndexReader(path, io="direct", nprobe=4) as reader:
        direct = reader._open().direct

        def broken(lists):
            raise OSError(5, "Input/output error (read at offset 123)", str(path))

        monkeypatch.setattr(direct, "_fetch", broken)
        with pytest.raises(OSError, match="Input/output error"):
            reader.search(queries[0], 5)
        assert reader.info()["direct"]["list_cache"]["resident_bytes"] == 0
        monkeypatch.undo()
        _same(reader, _in_ram(path, 4), queries[0])


@pytest.mark.parametrize("io", ["direct", "auto"])
@pytest.mark.parametrize("keep", [0.02, 0.5, 0.999])
def test_truncated_file_names_the_file(indexes, tmp_path, io, keep):
    data = indexes["ivfflat"].read_bytes()
    path = tmp_path / "cut.index"
    path.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(IndexFormatError, match=r"cut.index.*(truncated or corrupt|too short)"):
        IndexReader(path, io=io)


def test_corrupt_list_size_table_names_the_file_and_the_list(indexes, tmp_path):
    data = bytearray(indexes["ivfflat"].read_bytes())
    table = data.index(b"ilar") + 4 + 16 + 4 + 8  # the "full" sizes after nlist, code_size
    sizes = np.frombuffer(data, dtype="<u8", count=NLIST, offset=table).copy()
    for bad, value, text in ((5, sizes[5] + 1, r"list size table is at offset \d+"),
                             (9, 1 << 40, r"list 9: size 1099511627776 in the list size table")):
        broken = bytearray(data)
        broken[table + 8 * bad:table + 8 * bad + 8] = int(value).to_bytes(8, "little")
        path = tmp_path / f"sizes-{bad}.index"
        path.write_bytes(broken)
        with pytest.raises(IndexFormatError, match=rf"sizes-{bad}.index: .*{text}"):
            IndexReader(path, io="direct")


def test_bad_arguments_name_the_allowed_values(indexes):
    with pytest.raises(ValueError, match="io must be one of auto, direct, mmap"):
        IndexReader(indexes["ivfflat"], io="uring")
    with pytest.raises(ValueError, match="mmap=False"):
        IndexReader(indexes["ivfflat"], io="direct", mmap=False)
    with pytest.raises(ValueError, match="list_cache"):
        IndexReader(indexes["ivfflat"], list_cache="lots")
    with pytest.raises(ValueError, match="engine must be one of"):
        IndexReader(indexes["ivfflat"], engine="spdk")


def test_refresh_serves_the_new_file_directly(tmp_path, queries):
    from flashstream import write_index

    path = tmp_path / "live.index"
    write_index(_build("ivfflat", _vectors(N, 0)), path)
    with IndexReader(path, nprobe=4) as reader:
        before = reader.search(queries, 5)[1]
        write_index(_build("ivfflat", _vectors(N, 9)), path)
        np.testing.assert_array_equal(reader.search(queries, 5)[1], before)  # old inode
        assert reader.refresh() is True and reader.info()["io"] == "direct"
        _same(reader, _in_ram(path, 4), queries)


# -- the list cache's policy ---------------------------------------------------------------------
def _cache(budget: int, lists: int = 20, size: int = 10):
    dropped = []
    return ListCache(np.full(lists, size), budget, lambda i, occupied: dropped.append(i)), dropped


def _use(cache: ListCache, lists) -> None:
    fetch, _ = cache.acquire(lists)
    cache.fetched(fetch)
    cache.release(lists)


def test_hot_lists_survive_a_stream_of_one_off_lists():
    cache, _ = _cache(budget=50)
    for _ in range(3):
        _use(cache, [0, 1, 2])  # popular: used again and again
    for cold in range(3, 20):
        _use(cache, [cold])  # each used once
    assert all(cache.is_resident(i) for i in (0, 1, 2))
    assert cache.stats().resident_bytes <= 50


def test_over_the_budget_only_while_held():
    cache, dropped = _cache(budget=20)
    fetch, waits = cache.acquire([0, 1, 2, 3])
    assert fetch == [0, 1, 2, 3] and not waits and not dropped  # all held: none dropped
    cache.fetched(fetch)
    assert cache.stats().resident_bytes == 40
    cache.release([0, 1, 2, 3])
    assert cache.stats().resident_bytes == 20 and len(dropped) == 2
    assert cache.stats().peak_bytes == 40


def test_evict_all_drops_held_lists_when_released():
    cache, dropped = _cache(budget=100)
    _use(cache, [4])
    fetch, _ = cache.acquire([5])
    assert cache.evict_all() == 1 and dropped == [4]
    cache.fetched(fetch)
    assert cache.is_resident(5)
    cache.release([5])
    assert not cache.is_resident(5) and dropped == [4, 5]
    with pytest.raises(ValueError, match="budget"):
        ListCache(np.ones(3), -1, lambda i, occupied: None)


def test_a_forked_child_searches_with_reads_of_its_own(indexes, queries):
    """A DataLoader-style fork after searches: the child opens the file again with engines of
    its own (the parent's ring and threads are the parent's) and gets the same results."""
    import multiprocessing

    path = indexes["ivfflat"]
    with IndexReader(path, io="direct", nprobe=4, list_cache="64KiB") as reader:
        expected = reader.search(queries, 5)[1]
        context = multiprocessing.get_context("fork")
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=_search_in_child, args=(reader, queries, send))
        child.start()  # fork: the reader is not pickled, the child has the parent's copy
        got = receive.recv()
        child.join()
        assert child.exitcode == 0
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(reader.search(queries, 5)[1], expected)  # parent too


def _search_in_child(reader, queries, send):
    reader.evict()  # the lists are fetched again, by this process
    send.send(reader.search(queries, 5)[1])
