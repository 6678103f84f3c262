"""The default stream knows every shard's samples: a sidecar, else the index cache, else one
scan whose result goes into the cache (keyed by the shard file as it is now)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from resume_child import UNEVEN, keys, write_uneven

from flashstream import ShardStream
from flashstream.cli import main as cli_main
from flashstream.stream import index as index_module
from flashstream.stream.index import CACHE_ENV, cached_path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    directory = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(directory))
    return directory


@pytest.fixture
def scans(monkeypatch):
    """Counts the shards scanned."""
    scanned = []
    real = index_module.scan_shards

    def counting(urls, *args, **kw):
        scanned.extend(urls)
        return real(urls, *args, **kw)

    monkeypatch.setattr(index_module, "scan_shards", counting)
    return scanned


def test_the_first_stream_scans_and_caches_the_next_reads_the_cache(tmp_path, cache, scans):
    shards = write_uneven(tmp_path / "d")
    first = ShardStream(shards)
    assert first.plan == "samples" and len(first) == sum(UNEVEN)
    assert scans == shards
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        cached_path(s).name for s in shards)
    second = ShardStream(shards, shuffle=True)
    assert scans == shards  # nothing scanned again
    assert sorted(keys(second)) == sorted(keys(first))


def test_a_rewritten_shard_is_scanned_again(tmp_path, cache, scans):
    shards = write_uneven(tmp_path / "d")
    ShardStream(shards)
    other = write_uneven(tmp_path / "other", counts=(4,))
    with open(shards[4], "wb") as f:  # s4 rewritten in place: now 4 samples
        f.write(Path(other[0]).read_bytes())
    os.utime(shards[4], ns=(1, 1))  # a different mtime even on a coarse clock
    stream = ShardStream(shards)
    assert scans[len(shards):] == [shards[4]]
    assert len(stream) == sum(UNEVEN) - 9 + 4 == len(keys(stream))


def test_sidecars_come_first(tmp_path, cache, scans):
    shards = write_uneven(tmp_path / "d")
    assert cli_main(["index", *shards]) == 0
    assert ShardStream(shards).plan == "samples"
    assert scans == [] and not cache.exists()


def test_cache_off_scans_every_time(tmp_path, monkeypatch, scans):
    monkeypatch.setenv(CACHE_ENV, "off")
    shards = write_uneven(tmp_path / "d")
    ShardStream(shards)
    ShardStream(shards)
    assert scans == shards + shards


def test_an_unwritable_cache_only_costs_a_scan(tmp_path, monkeypatch, scans, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "cache"))
    shards = write_uneven(tmp_path / "d")
    with caplog.at_level(logging.WARNING, logger="flashstream"):
        assert len(ShardStream(shards)) == sum(UNEVEN)
    assert caplog.text.count("could not cache shard indexes") == 1


def test_a_corrupt_cache_entry_is_ignored(tmp_path, cache, scans):
    shards = write_uneven(tmp_path / "d")
    ShardStream(shards)
    cached_path(shards[0]).write_text("{not json")
    assert len(ShardStream(shards)) == sum(UNEVEN)
    assert scans[len(shards):] == [shards[0]]


def test_index_false_never_scans(tmp_path, cache, scans):
    shards = write_uneven(tmp_path / "d")
    stream = ShardStream(shards, index=False)
    assert stream.plan == "shards" and scans == [] and not cache.exists()
    with pytest.raises(TypeError, match="no length"):
        len(stream)


def test_a_rewrite_that_restores_the_mtime_is_scanned_again(tmp_path, cache, scans):
    """cp -p, rsync -t and touch -r set the modification time back; the status-change time,
    also in the cache key, cannot be set back."""
    shards = write_uneven(tmp_path / "d")
    ShardStream(shards)
    before = os.stat(shards[4])
    other = write_uneven(tmp_path / "other", counts=(4,))
    with open(shards[4], "r+b") as f:  # same inode
        f.write(Path(other[0]).read_bytes())
        f.truncate()
    os.utime(shards[4], ns=(before.st_atime_ns, before.st_mtime_ns))
    stream = ShardStream(shards)
    assert scans[len(shards):] == [shards[4]]
    assert len(stream) == len(keys(stream))


@pytest.mark.parametrize("entry", ["[" * 100_000, '{"format": "flashstream-shard-index", '
                                   '"version": 1, "shard_bytes": 1e400}',
                                   '{"offsets": [1e30]}'])
def test_any_broken_cache_entry_only_costs_a_scan(tmp_path, cache, scans, entry):
    shards = write_uneven(tmp_path / "d", counts=(3,))
    ShardStream(shards)
    cached_path(shards[0]).write_text(entry)
    assert len(ShardStream(shards)) == 3 and len(scans) == 2


@pytest.mark.parametrize("ranks", [None, 2])
def test_processes_on_one_node_never_scan_a_shard_twice(tmp_path, cache, ranks):
    """Two processes without a process group (with or without RANK/WORLD_SIZE) start together
    on the same shards: through the per-shard locks of the index cache, every shard is
    scanned by exactly one of them, and both end with the same index."""
    import json
    import subprocess
    import sys
    import time

    from conftest import child_env
    from shardgen import write_shards

    shards = [str(p) for p in write_shards(tmp_path / "d", 12, 10, sizes=[3000, 90_000])]
    go = tmp_path / "go"
    script = Path(__file__).with_name("index_lock_child.py")
    procs = []
    for rank in range(2):
        env = dict(child_env(), SCAN_DELAY="0.1")
        if ranks:
            env.update(RANK=str(rank), WORLD_SIZE=str(ranks))
        procs.append(subprocess.Popen([sys.executable, str(script), str(go), *shards],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=env))
    # Both imported before either starts: importing torch on a busy 2-core machine once took
    # one child longer than the other's whole share of the scans, and it then took them all.
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("go.ready.*"))) < 2:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            "a child did not get ready: " + " ".join(p.stderr.read() for p in procs
                                                     if p.poll() is not None)
        time.sleep(0.01)
    go.touch()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    first, second = (set(r["scanned"]) for r in results)
    assert not first & second, "a shard was scanned twice"
    assert first | second == set(shards)
    if ranks:  # each rank took its share first
        assert first == set(shards[0::2]) and second == set(shards[1::2])
    assert results[0]["index"] == results[1]["index"]
    assert results[0]["samples"] == results[1]["samples"] == 120
    for r in results:  # what one did not scan it read from the cache the other wrote
        info = r["info"]
        assert info["scan"]["shards"] == len(r["scanned"])
        assert info["scan"]["shards"] + info["cache"]["shards"] == 12
    assert not list(cache.glob("*.lock"))  # each lock went with its cache entry


def test_a_filesystem_that_cannot_lock_scans_without_locks(tmp_path, cache, scans,
                                                           monkeypatch):
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    shards = write_uneven(tmp_path / "d")
    stream = ShardStream(shards)
    assert scans == shards and len(stream) == sum(UNEVEN)
    assert not list(cache.glob("*.lock"))  # each lock file went with its cache entry
