"""Equal ranks: every rank delivers the same number of samples per epoch, by a documented
rule, even with uneven shards or fewer shards than ranks x workers; the sample index
(``flashstream index`` sidecars, or a scan) that this needs; and a real gloo run that must
not hang at the epoch's end."""

from __future__ import annotations

import collections
import json
import os
import time

import pytest
from resume_child import UNEVEN, check_resume, gloo_train, keys, spread, write_uneven
from shardgen import make_samples, write_tar

from flashstream import ShardStream
from flashstream.cli import main as cli_main
from flashstream.settings import resolve
from flashstream.stream.handlers import resolve_handler
from flashstream.stream.index import read_sidecar, scan_shards, sidecar_path

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

N = sum(UNEVEN)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_uneven(tmp_path_factory.mktemp("uneven"))


def per_rank(monkeypatch, world, make, workers=0):
    """Each simulated rank's epoch (RANK/WORLD_SIZE), through a DataLoader."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    out = []
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        stream = make()
        got = keys(DataLoader(stream, batch_size=None, num_workers=workers))
        assert len(stream) == len(got)  # the epoch length is exact
        out.append(got)
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("workers", [0, 2])
def test_drop_gives_equal_counts_and_no_repeats(shards, monkeypatch, world, workers):
    ranks = per_rank(monkeypatch, world, lambda: ShardStream(shards, shuffle=4,
                                                             equal_ranks=True), workers)
    assert [len(r) for r in ranks] == [N // world] * world
    flat = [k for r in ranks for k in r]
    assert len(set(flat)) == len(flat)  # the remainder is dropped, nothing is repeated


@pytest.mark.parametrize("world", [3, 4])
def test_repeat_pads_from_the_epoch_start(shards, monkeypatch, world):
    everything = keys(ShardStream(shards, index=True))  # the repeats are the epoch's first
    ranks = per_rank(monkeypatch, world, lambda: ShardStream(shards, equal_ranks="repeat"))
    share = -(-N // world)
    assert [len(r) for r in ranks] == [share] * world
    counts = collections.Counter(k for r in ranks for k in r)
    assert len(counts) == N  # every sample at least once
    repeated = [k for k, c in counts.items() if c > 1]
    assert len(repeated) == share * world - N and all(counts[k] == 2 for k in repeated)
    assert sorted(repeated) == sorted(everything[:len(repeated)])
    assert all(len(set(r)) == len(r) for r in ranks)  # never twice on one rank


def test_fewer_shards_than_ranks_times_workers(tmp_path, monkeypatch):
    """Two shards for 3 ranks x 2 workers: split by sample ranges inside the shards."""
    paths = write_uneven(tmp_path, (5, 8))
    ranks = per_rank(monkeypatch, 3, lambda: ShardStream(paths, shuffle=3, equal_ranks=True),
                     workers=2)
    assert [len(r) for r in ranks] == [13 // 3] * 3
    flat = [k for r in ranks for k in r]
    assert len(set(flat)) == len(flat)


def test_without_an_index_too_few_shards_is_refused(tmp_path, monkeypatch):
    paths = write_uneven(tmp_path, (5, 8))
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match="2 shard.*for 3 ranks.*equal_ranks=True"):
        list(ShardStream(paths, index=False))


def test_equal_ranks_resume(shards, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))

        def make():
            return ShardStream(shards, shuffle=3, equal_ranks=True)

        reference = check_resume(make, workers=None, stops=range(N // 3 + 1))
        check_resume(make, workers=2, stops=spread(N // 3), reference=reference)


def test_bad_settings_are_refused(shards):
    with pytest.raises(ValueError, match="equal_ranks must be False, True .*'drop' or 'repeat'"):
        ShardStream(shards, equal_ranks="most")
    with pytest.raises(ValueError, match="index must be 'auto', True or False"):
        ShardStream(shards, index="sidecar")
    with pytest.raises(ValueError, match="equal_ranks needs every shard's sample count"):
        ShardStream(shards, index=False, equal_ranks=True)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        ShardStream(shards, batch_size=0)
    with pytest.raises(TypeError, match="no length with index=False"):
        len(ShardStream(shards, index=False))
    with pytest.raises(ValueError, match="cannot give each of 40 ranks one"):
        os.environ["WORLD_SIZE"], os.environ["RANK"] = "40", "0"
        try:
            len(ShardStream(shards, equal_ranks=True))
        finally:
            del os.environ["WORLD_SIZE"], os.environ["RANK"]


def test_flashstream_index_writes_sidecars(tmp_path, capsys):
    paths = write_uneven(tmp_path, (4, 6), gzip=(1,))
    assert cli_main(["index", str(tmp_path / "*"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["indexed"] == 2 and summary["samples"] == 10
    assert [r["compression"] for r in summary["results"]] == [None, "gzip"]
    scanned = scan_shards(paths, resolve(), resolve_handler("reraise"))
    for path, index in zip(paths, scanned):
        sidecar = read_sidecar(path)
        assert sidecar.count == index.count and list(sidecar.offsets) == list(index.offsets)
    assert cli_main(["index", *paths]) == 0
    assert "2 already up to date" in capsys.readouterr().out
    # globs do not pick up the sidecars as shards; the stream uses them by default
    stream = ShardStream(str(tmp_path / "*"))
    assert stream.urls == paths and stream.plan == "samples" and len(stream) == 10


def test_stale_or_bad_sidecars_are_errors(tmp_path, capsys):
    (path,) = write_uneven(tmp_path, (4,))
    assert cli_main(["index", path]) == 0
    write_tar(tmp_path / "s0.tar", make_samples(6))  # rewritten (tar pads: the same size)
    with pytest.raises(ValueError, match="is stale.*rerun `flashstream index`"):
        ShardStream(path)
    with open(sidecar_path(path), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ShardStream(path)
    assert cli_main(["index", path]) == 0  # rewrites what it cannot use
    assert len(ShardStream(path)) == 6
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"not a tar file" * 100)
    assert cli_main(["index", path, str(bad)]) == 1
    assert "bad.tar at byte offset 0" in capsys.readouterr().out
    assert read_sidecar(str(bad)) is None  # no index for a bad shard


def test_a_shard_that_no_longer_matches_its_index_is_an_error(tmp_path):
    """Same size, other content: reading by index notices and reports it (or skips it)."""
    (path,) = write_uneven(tmp_path, (4,), sizes=[100])
    assert cli_main(["index", path]) == 0
    stat = os.stat(path)
    samples = make_samples(4, sizes=[100], prefix="other/long-name-")
    write_tar(tmp_path / "s0.tar", samples)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # hide it from the mtime check
    stream = ShardStream(path, shuffle=False)
    assert stream.plan == "samples"
    try:
        got = keys(stream)
    except ValueError as exn:
        assert "shard index says" in str(exn) or "tar" in str(exn)
    else:  # the offsets happened to match the new members: the samples are the new ones
        assert got == [k for k, _ in samples]


def test_real_gloo_ranks_do_not_hang(tmp_path):
    """Uneven shards, 3 real processes, an all_reduce per batch: without equal shares one
    rank would stop early and the others would wait forever."""
    paths = write_uneven(tmp_path / "data", UNEVEN)
    world = 3
    context = torch.multiprocessing.spawn(
        gloo_train, args=(world, str(tmp_path / "store"), paths, str(tmp_path)), nprocs=world,
        join=False)
    deadline = time.monotonic() + 240
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the gloo ranks hung")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    share = N // world
    assert [r["steps"] for r in results] == [2 * -(-share // 2)] * world
    assert [len(r["keys"]) for r in results] == [share] * world
    assert [r["len"] for r in results] == [share] * world
    flat = [k for r in results for k in r["keys"]]
    assert len(set(flat)) == len(flat)
