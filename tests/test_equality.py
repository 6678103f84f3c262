"""Sample-for-sample equality with webdataset.WebDataset(urls, shardshuffle=False)."""

from __future__ import annotations

import io
import shutil
import tarfile

import pytest
from shardgen import (
    EDGE_SIZES,
    make_samples,
    wds_samples,
    write_shards,
    write_tar,
    write_with_gnu_tar,
)

from flashstream import ShardStream

pytest.importorskip("webdataset")


def assert_same_samples(urls, **stream_kw):
    ours = list(ShardStream(urls, **stream_kw))
    theirs = wds_samples(urls)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert list(a.items()) == list(b.items()), (a.get("__key__"), b.get("__key__"))
    return ours


def test_edge_sizes_every_engine(tmp_path, engine):
    samples = make_samples(40, sizes=EDGE_SIZES + [3 << 20, (1 << 20) + 7], exts=("cls", "bin"))
    shard = write_tar(tmp_path / "edge.tar", samples)
    # Small chunks so members and headers straddle chunk boundaries everywhere.
    ours = assert_same_samples(str(shard), chunk_size="4KiB", queue_depth=3)
    assert len(ours) == 40


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
def test_python_tarfile_formats_with_long_names(tmp_path, fmt):
    long_dir = "d" * 60 + "/" + "e" * 50
    samples = [(f"{long_dir}/k{i:03d}", {"txt": b"x" * i, "json": b"{}"}) for i in range(30)]
    if fmt != tarfile.USTAR_FORMAT:  # ustar can't store a 120-character base name
        samples += [("n" * 120 + f"{i}", {"bin": bytes([i]) * 700}) for i in range(5)]
    shard = write_tar(tmp_path / "long.tar", samples, fmt=fmt)
    assert len(assert_same_samples(str(shard), chunk_size="8KiB")) == len(samples)


def test_pax_size_and_unicode_names(tmp_path):
    samples = [(f"ünïcode/ключ{i}", {"TXT": "é".encode() * i}) for i in range(10)]
    shard = write_tar(tmp_path / "pax.tar", samples, fmt=tarfile.PAX_FORMAT)
    ours = assert_same_samples(str(shard))
    assert "txt" in ours[0]  # extensions are lowercased as webdataset does


def test_dirs_links_and_metadata_are_skipped(tmp_path):
    extra = []
    d = tarfile.TarInfo("folder")
    d.type = tarfile.DIRTYPE
    extra.append(d)
    sym = tarfile.TarInfo("folder/link.txt")
    sym.type, sym.linkname = tarfile.SYMTYPE, "a.txt"
    extra.append(sym)
    hard = tarfile.TarInfo("folder/hard.txt")
    hard.type, hard.linkname = tarfile.LNKTYPE, "folder/a.txt"
    extra.append(hard)
    meta = tarfile.TarInfo("__meta__")
    extra.append(meta)
    noext = tarfile.TarInfo("folder/README")
    extra.append(noext)
    samples = make_samples(10, sizes=[10, 600])
    shard = write_tar(tmp_path / "odd.tar", samples, extra=extra)
    assert len(assert_same_samples(str(shard))) == 10


@pytest.mark.parametrize("fmt", ["gnu", "pax", "ustar"])
def test_gnu_tar_formats(tmp_path, fmt):
    files = {f"sub/dir/sample{i:04d}.{ext}": bytes([i % 251]) * size
             for i in range(20) for ext, size in (("jpg", 100 * i + 1), ("cls", 3))}
    files["sub/dir/" + "x" * 90 + ".txt"] = b"long name"  # over 100 chars with the path
    shard = write_with_gnu_tar(tmp_path / f"gnu-{fmt}.tar", tmp_path, files, fmt)
    if shard is None:
        pytest.skip("GNU tar is not installed")
    assert len(assert_same_samples(str(shard), chunk_size="4KiB")) >= 20


def test_gzip_shards(tmp_path, engine):
    samples = make_samples(50, sizes=[1000, 5000])
    plain = write_tar(tmp_path / "a.tar", samples)
    gz = tmp_path / "a.tar.gz"
    import gzip

    gz.write_bytes(gzip.compress(plain.read_bytes()))
    tgz = write_tar(tmp_path / "b.tgz", make_samples(7, seed=3), mode="w:gz")
    assert len(assert_same_samples([str(gz), str(tgz)], chunk_size="4KiB")) == 57


def test_many_shards_brace_and_glob(tmp_path):
    paths = write_shards(tmp_path / "data", 5, 30, sizes=[100, 2000])
    pattern = str(tmp_path / "data" / "shard-{000000..000004}.tar")
    ours = assert_same_samples(pattern, chunk_size="16KiB", queue_depth=16)
    assert len(ours) == 150
    globbed = ShardStream(str(tmp_path / "data" / "*.tar"))
    assert globbed.urls == [str(p) for p in paths]


def test_peer_shards(tmp_path, peer_data, engine):
    for source in sorted(peer_data.iterdir()):
        if source.suffix not in (".tar", ".tgz", ".gz"):
            continue
        local = tmp_path / source.name
        shutil.copyfile(source, local)
        ours = assert_same_samples(str(local), chunk_size="4KiB")
        assert ours, source.name


def test_peer_shards_concatenated(tmp_path, peer_data):
    locals_ = []
    for source in sorted(peer_data.glob("*.tar")):
        shutil.copyfile(source, tmp_path / source.name)
        locals_.append(str(tmp_path / source.name))
    assert_same_samples(locals_)


def test_zero_copy_payloads_are_bytes(tmp_path):
    shard = write_tar(tmp_path / "a.tar", make_samples(3))
    for sample in ShardStream(str(shard)):
        assert all(isinstance(v, bytes) for k, v in sample.items() if not k.startswith("__"))


def test_member_larger_than_chunks(tmp_path):
    big = bytes(range(256)) * (5 << 12)  # 5 MiB
    shard = write_tar(tmp_path / "big.tar", [("big", {"bin": big, "txt": b"t"})])
    (sample,) = ShardStream(str(shard), chunk_size="64KiB", queue_depth=4)
    assert sample["bin"] == big


def test_garbage_after_end_marker_is_ignored(tmp_path):
    shard = write_tar(tmp_path / "a.tar", make_samples(5))
    with open(shard, "ab") as f:
        f.write(io.BytesIO(b"\x07" * 3000).read())
    assert_same_samples(str(shard))
