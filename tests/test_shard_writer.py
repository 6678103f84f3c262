"""ShardWriter / TarWriter: webdataset's bytes, plus a sidecar that makes indexing free; the
`flashstream index` jobs and --check; what indexing cost, per source."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from shardgen import make_samples

import flashstream
from flashstream import ShardStream, settings
from flashstream.cli import main as cli
from flashstream.stream import index as index_module
from flashstream.stream.index import read_sidecar, scan_shards, sidecar_path


def samples(n):
    """webdataset-style dicts of shardgen's samples (a short label, payloads of three sizes)."""
    return [{"__key__": key, **fields}
            for key, fields in make_samples(n, sizes=[100, 1097, 4085])]


@pytest.fixture(autouse=True)
def no_index_cache(monkeypatch):
    monkeypatch.setenv("FLASHSTREAM_INDEX_CACHE", "off")


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz"])
def test_tar_writer_writes_webdatasets_bytes_and_a_sidecar(tmp_path, suffix):
    ours, theirs = tmp_path / f"ours{suffix}", tmp_path / f"theirs{suffix}"
    with flashstream.TarWriter(str(ours), mtime=1_700_000_000) as writer:
        for sample in samples(40):
            writer.write(sample)
    with wds.TarWriter(str(theirs), mtime=1_700_000_000) as writer:
        for sample in samples(40):
            writer.write(sample)
    if suffix == ".tar":  # gzip stamps the time of writing into its header
        assert ours.read_bytes() == theirs.read_bytes()
    sidecar = read_sidecar(str(ours))
    assert sidecar is not None and sidecar.count == 40
    (scanned,) = scan_shards([str(ours)], settings.current(), lambda exn: True)
    assert np.array_equal(sidecar.offsets, scanned.offsets)
    assert np.array_equal(sidecar.ends, scanned.ends)
    assert sidecar.compression == scanned.compression == (None if suffix == ".tar" else "gzip")
    stream = ShardStream(str(ours))
    assert stream.index_info["scan"] == 0 and stream.index_info["sidecar"] == 1
    assert stream.index_info["by_source"]["scan"]["bytes"] == 0
    assert [s["__key__"] for s in stream] == [s["__key__"] for s in samples(40)]


def test_shard_writer_indexes_every_shard_and_a_stream_reads_none_to_index(tmp_path):
    pattern = str(tmp_path / "train-%06d.tar")
    with flashstream.ShardWriter(pattern, maxcount=25, verbose=0, mtime=1) as writer:
        for sample in samples(110):
            writer.write(sample)
    with wds.ShardWriter(str(tmp_path / "ref-%06d.tar"), maxcount=25, verbose=0,
                         mtime=1) as writer:
        for sample in samples(110):
            writer.write(sample)
    shards = sorted(str(p) for p in tmp_path.glob("train-*.tar"))
    assert len(shards) == 5
    for i, shard in enumerate(shards):
        assert os.path.exists(sidecar_path(shard))
        assert Path(shard).read_bytes() == (tmp_path / f"ref-{i:06d}.tar").read_bytes()
    stream = ShardStream(shards)
    assert stream.index_info["scan"] == 0 and stream.index_info["bytes_read"] < 64 << 10
    assert len(stream) == 110 and sum(1 for _ in stream) == 110
    assert cli(["index", "--check", *shards]) == 0


@pytest.mark.parametrize("keys", [
    ["a.b", "a.c", "x"],         # a dot in the key: the scan groups members differently
    ["k", "k", "m"],             # the same key twice in a row: one sample when scanned
    ["__meta__", "n1", "n2"],    # metadata-like names a scan skips
], ids=["dotted", "repeated", "meta"])
def test_sidecar_equals_the_scan_when_keys_are_unusual(tmp_path, keys):
    path = tmp_path / "odd.tar"
    with flashstream.TarWriter(str(path)) as writer:
        for i, key in enumerate(keys):
            writer.write({"__key__": key, f"e{i}": b"x" * (i + 1)})
    sidecar = read_sidecar(str(path))
    (scanned,) = scan_shards([str(path)], settings.current(), lambda exn: True)
    assert sidecar is not None
    assert np.array_equal(sidecar.offsets, scanned.offsets)
    assert np.array_equal(sidecar.ends, scanned.ends)


def test_index_check_reports_missing_stale_and_differing_sidecars(tmp_path, capsys):
    shards = []
    for name in ("good", "missing", "differs", "stale"):
        path = tmp_path / f"{name}.tar"
        with flashstream.TarWriter(str(path), index=name != "missing") as writer:
            for sample in samples(5):
                writer.write(sample)
        shards.append(str(path))
    sidecar = Path(sidecar_path(shards[2]))
    side = json.loads(sidecar.read_text())
    side["ends"][1] -= 512
    sidecar.write_text(json.dumps(side))
    os.utime(shards[3], ns=(1, 1))
    assert cli(["index", "--check", "--json", *shards]) == 1
    rows = {os.path.basename(r["shard"]): r["status"]
            for r in json.loads(capsys.readouterr().out)["results"]}
    assert rows == {"good.tar": "ok", "missing.tar": "missing", "differs.tar": "differs",
                    "stale.tar": "stale"}


def test_index_jobs_write_the_same_sidecars_as_one_scan(tmp_path):
    shards = []
    for s in range(6):
        path = tmp_path / f"p{s}.tar"
        with wds.TarWriter(str(path)) as writer:
            for sample in samples(20 + s):
                writer.write(sample)
        shards.append(str(path))
    assert cli(["index", "--jobs", "3", *shards]) == 0
    scanned = scan_shards(shards, settings.current(), lambda exn: True)
    for shard, index in zip(shards, scanned):
        sidecar = read_sidecar(shard)
        assert np.array_equal(sidecar.offsets, index.offsets)
    with pytest.raises(SystemExit):
        cli(["index", "--jobs", "x", *shards])


@pytest.mark.native_engine  # the C++ scan's sequential method
def test_a_large_scan_warns_and_index_info_counts_its_bytes(tmp_path, monkeypatch):
    path = tmp_path / "big.tar"
    with wds.TarWriter(str(path)) as writer:
        for sample in samples(50):
            writer.write(sample)
    monkeypatch.setattr(index_module, "SCAN_WARN_BYTES", 10_000)
    with pytest.warns(UserWarning, match="flashstream index.*ShardWriter"):
        stream = ShardStream(str(path))
    scan = stream.index_info["by_source"]["scan"]
    # Small members: read sequentially, up to the end-of-archive block (not its padding).
    assert scan["shards"] == 1 and scan["methods"]["sequential"] == 1
    assert 0.9 * path.stat().st_size <= scan["bytes"] <= path.stat().st_size
    assert stream.index_info["bytes_read"] == scan["bytes"]


@pytest.mark.parametrize("world,count", [(2, 6), (4, 6), (4, 2)])
def test_gloo_ranks_scan_disjoint_shares_and_end_with_one_index(tmp_path, world, count):
    """Each rank scans its share of the shards without sidecar or cache entry; the indexes
    travel through the job's gloo group; every rank ends with the index one process scans
    alone, and the drive is read for indexing once in all (not once per rank). With fewer
    shards than ranks, some ranks scan nothing."""
    import subprocess
    import sys

    from conftest import child_env
    from shardgen import write_shards

    shards = [str(p) for p in write_shards(tmp_path / "d", count, 30, sizes=[3000, 9000])]
    env = dict(child_env(), FLASHSTREAM_INDEX_CACHE="off")
    script = Path(__file__).with_name("index_share_rank.py")
    init = tmp_path / "init"
    ranks = [subprocess.Popen([sys.executable, str(script), str(r), str(world), str(init),
                               *shards], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for r in range(world)]
    results = []
    for proc in ranks:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    alone = ShardStream(shards, split_by_rank=False)
    assert {r["index"] for r in results} == {results[0]["index"]}
    assert all(r["samples"] == len(alone) == 30 * count for r in results)
    assert all(r["keys"] == [s["__key__"] for s in alone][:5] for r in results)
    assert sorted(r["scanned"] for r in results) == sorted(
        len(range(r, count, world)) for r in range(world))
    data = sum(os.path.getsize(s) for s in shards)
    assert sum(r["bytes"] for r in results) <= 1.05 * data + world * (1 << 20)
