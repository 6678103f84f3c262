"""Bad shards and bad arguments give clear errors, and continue-handlers skip bad shards."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import warnings

import pytest
from conftest import child_env
from shardgen import make_samples, write_tar

import flashstream
from flashstream import ShardFormatError, ShardStream


@pytest.fixture
def good(tmp_path):
    return write_tar(tmp_path / "good.tar", make_samples(20, sizes=[3000]))


def corrupt(path, offset, value=b"\xff"):
    data = bytearray(path.read_bytes())
    data[offset:offset + len(value)] = value
    path.write_bytes(bytes(data))
    return path


def second_header_offset(path):
    with tarfile.open(path) as tar:
        return tar.getmembers()[1].offset


def test_bad_checksum_names_shard_and_offset(tmp_path, good, engine):
    bad = tmp_path / "bad.tar"
    bad.write_bytes(good.read_bytes())
    offset = second_header_offset(bad)
    corrupt(bad, offset + 10, b"Z")  # inside the name: the checksum no longer matches
    with pytest.raises(ShardFormatError) as info:
        list(ShardStream(str(bad)))
    assert info.value.url == str(bad) and info.value.offset == offset
    assert "bad.tar" in str(info.value) and str(offset) in str(info.value)


def test_samples_before_the_bad_header_are_delivered(tmp_path, good):
    bad = tmp_path / "bad.tar"
    bad.write_bytes(good.read_bytes())
    with tarfile.open(bad) as tar:
        offset = tar.getmembers()[10].offset  # first member of sample 5
    corrupt(bad, offset + 148, b"9999999")
    seen = []
    with pytest.raises(ShardFormatError):  # without an index: found while reading
        for sample in ShardStream(str(bad), index=False):
            seen.append(sample["__key__"])
    assert seen == [f"s{i:06d}" for i in range(5)]
    # The default indexes the shard first: the same error, before any sample.
    with pytest.raises(ShardFormatError, match=f"byte offset {offset}") as info:
        ShardStream(str(bad))
    assert info.value.url == str(bad)
    # handler="warn": indexed up to the bad spot, those samples delivered, the rest skipped.
    with pytest.warns(UserWarning, match="bad.tar"):
        stream = ShardStream(str(bad), handler="warn")
    assert [sample["__key__"] for sample in stream] == [f"s{i:06d}" for i in range(5)]


def test_truncated_member(tmp_path, good, engine):
    bad = tmp_path / "trunc.tar"
    data = good.read_bytes()
    with tarfile.open(good) as tar:
        member = tar.getmembers()[7]
    cut = member.offset_data + member.size // 2
    bad.write_bytes(data[:cut])
    with pytest.raises(ShardFormatError, match="truncated") as info:
        list(ShardStream(str(bad)))
    assert info.value.url == str(bad)
    assert info.value.offset is not None


def test_truncated_header(tmp_path, good):
    bad = tmp_path / "trunc.tar"
    bad.write_bytes(good.read_bytes()[: second_header_offset(good) + 100])
    with pytest.raises(ShardFormatError, match="truncated"):
        list(ShardStream(str(bad)))


def test_garbage_file(tmp_path, engine):
    bad = tmp_path / "garbage.tar"
    bad.write_bytes(os.urandom(5000))
    with pytest.raises(ShardFormatError) as info:
        list(ShardStream(str(bad)))
    assert info.value.offset == 0


def test_empty_file(tmp_path, engine):
    bad = tmp_path / "empty.tar"
    bad.write_bytes(b"")
    with pytest.raises(ShardFormatError, match="empty"):
        list(ShardStream(str(bad)))


def test_missing_file(tmp_path, engine):
    with pytest.raises(FileNotFoundError) as info:
        list(ShardStream(str(tmp_path / "nope.tar")))
    assert "nope.tar" in str(info.value)


def test_corrupt_gzip(tmp_path):
    good = write_tar(tmp_path / "a.tgz", make_samples(30, sizes=[5000]), mode="w:gz")
    data = bytearray(good.read_bytes())
    data[len(data) // 2: len(data) // 2 + 50] = b"\x00" * 50
    bad = tmp_path / "bad.tgz"
    bad.write_bytes(bytes(data))
    with pytest.raises(ShardFormatError) as info:
        list(ShardStream(str(bad)))
    assert info.value.url == str(bad)
    truncated = tmp_path / "cut.tgz"
    truncated.write_bytes(good.read_bytes()[:-40])
    with pytest.raises(ShardFormatError, match="truncated|corrupt"):
        list(ShardStream(str(truncated)))


def test_duplicate_extension_in_a_sample(tmp_path):
    bad = write_tar(tmp_path / "dup.tar", [("a", {"txt": b"1"}), ("a", {"txt": b"2"})])
    with pytest.raises(ShardFormatError, match="duplicate"):
        list(ShardStream(str(bad)))


@pytest.mark.parametrize("handler", ["warn", "ignore", flashstream.ignore_and_continue])
def test_continue_handlers_skip_bad_shards(tmp_path, good, handler, engine):
    empty = tmp_path / "empty.tar"
    empty.write_bytes(b"")
    garbage = tmp_path / "garbage.tar"
    garbage.write_bytes(os.urandom(20000))
    urls = [str(empty), str(good), str(tmp_path / "missing.tar"), str(garbage), str(good)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        samples = list(ShardStream(urls, handler=handler, chunk_size="4KiB"))
    assert len(samples) == 40
    if handler == "warn":
        assert len(caught) == 3


def test_handler_returning_false_stops(tmp_path, good):
    urls = [str(good), str(tmp_path / "missing.tar"), str(good)]
    samples = list(ShardStream(urls, handler=lambda exn: False))
    assert len(samples) == 20


@pytest.mark.skipif(not hasattr(os, "setuid"), reason="needs POSIX users")
def test_permission_denied(tmp_path, good):
    locked = tmp_path / "locked.tar"
    locked.write_bytes(good.read_bytes())
    locked.chmod(0)
    # Root reads anything, so the child drops to nobody after importing flashstream.
    code = (
        "import os, sys\nfrom flashstream import ShardStream\n"
        "if os.geteuid() == 0:\n    os.setgid(65534); os.setuid(65534)\n"
        "try:\n    list(ShardStream(sys.argv[1]))\n"
        "except PermissionError as e:\n    print('PermissionError', e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(locked)], capture_output=True,
                            text=True, cwd=tmp_path, env=child_env())
    assert "PermissionError" in result.stdout, result.stderr
    assert "locked.tar" in result.stdout


def test_bad_arguments():
    with pytest.raises(ValueError, match="at least one shard"):
        ShardStream([])
    with pytest.raises(ValueError, match="reraise, warn, ignore"):
        ShardStream("x.tar", handler="explode")
    with pytest.raises(ValueError, match="shuffle"):
        ShardStream("x.tar", shuffle="yes")
    with pytest.raises(ValueError, match="local files"):
        ShardStream("http://example.invalid/a.tar")
    with pytest.raises(ValueError, match="queue_depth"):
        ShardStream("x.tar", queue_depth=0)
    with pytest.raises(ValueError, match="MiB"):
        ShardStream("x.tar", chunk_size="lots")
    with pytest.raises(ValueError, match="auto, uring, threads, python"):
        ShardStream("x.tar", engine="spdk")
    with pytest.raises(FileNotFoundError, match="no shard matches"):
        ShardStream("/nonexistent-dir/*.tar")


def test_samples_before_a_truncated_end_are_delivered(tmp_path, engine):
    """A shard cut inside its last member: the complete samples come through, then the error
    (the cut sample is lost, as webdataset loses it when tarfile raises)."""
    good = write_tar(tmp_path / "ten.tar", make_samples(10, sizes=[3000]))
    with tarfile.open(good) as tar:
        last = tar.getmembers()[-1]
    cut = tmp_path / "cut.tar"
    cut.write_bytes(good.read_bytes()[: last.offset_data + 100])
    seen = []
    with pytest.raises(ShardFormatError, match="truncated"):
        for sample in ShardStream(str(cut), index=False):
            seen.append(sample["__key__"])
    assert seen == [f"s{i:06d}" for i in range(9)]
    with pytest.raises(ShardFormatError, match="truncated"):  # indexing finds it first
        ShardStream(str(cut))


def test_a_shard_cut_in_the_padding_after_a_member_raises(tmp_path, engine):
    """A download that stopped inside the padding after a member's data: every member is whole,
    and it yielded all but nothing was said. webdataset (tarfile) raises; so must we, in the
    scan, in the read, and with an index that was written over the cut file (an older
    flashstream accepted it), naming the file and offset."""
    import dataclasses

    from flashstream.settings import IOSettings
    from flashstream.stream import index as shard_index
    from flashstream.stream.handlers import reraise_exception

    good = write_tar(tmp_path / "ten.tar", make_samples(10, sizes=[3000]))
    with tarfile.open(good) as tar:
        last = tar.getmembers()[-1]
    cut = tmp_path / "cut.tar"
    where = last.offset_data + last.size + 30  # the padding runs to the next 512 bytes
    cut.write_bytes(good.read_bytes()[:where])
    for index in (False, True):
        with pytest.raises(ShardFormatError, match="truncated tar padding") as info:
            list(ShardStream(str(cut), index=index))
        assert info.value.url == str(cut) and info.value.offset == where
    stat = os.stat(cut)
    whole = shard_index.scan_shards([str(good)], IOSettings(), reraise_exception)[0]
    shard_index.write_sidecar(str(cut), dataclasses.replace(
        whole, shard_bytes=stat.st_size, mtime_ns=stat.st_mtime_ns))
    with pytest.raises(ShardFormatError, match="truncated tar padding"):
        list(ShardStream(str(cut)))
    with pytest.raises(Exception, match="unexpected end of data"):  # what webdataset does
        import webdataset as wds
        list(wds.WebDataset(str(cut), shardshuffle=False))
    # Cut exactly after the padding (no end-of-archive blocks): tarfile accepts that, so do we.
    whole_blocks = tmp_path / "blocks.tar"
    whole_blocks.write_bytes(good.read_bytes()[:last.offset_data + 3072])
    assert len(list(ShardStream(str(whole_blocks), index=False))) == 10


def _one_key_tar(path, exts):
    import io

    with tarfile.open(path, "w") as tar:
        for ext in exts:
            info = tarfile.TarInfo(f"s1.{ext}")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    return path


def test_many_members_under_one_key_are_checked_for_duplicates_in_linear_time(tmp_path):
    """Each member was compared with every earlier one of its sample: 80,000 members under
    one key took 7-9 s (0.04-0.08 s with distinct keys). Past 16 fields a hash set checks
    them; duplicates must still raise wherever they are, on either side of that switch."""
    exts = [f"e{i}" for i in range(20_000)]
    good = _one_key_tar(tmp_path / "many.tar", exts)
    (sample,) = list(ShardStream(str(good), index=False))
    assert len(sample) == 20_000 + 3 and sample["e19999"] == b"x"  # + __key__, __url__, path
    for at in (5, 15, 16, 17, 19_999):
        bad = _one_key_tar(tmp_path / f"dup{at}.tar", exts[:at] + [exts[at // 2]] + exts[at:])
        with pytest.raises(ShardFormatError, match="duplicate file name"):
            list(ShardStream(str(bad), index=False))


def _folding_tar(tmp_path, ext: str):
    """Samples s0, s1 and s2 with one field "k"; s1 has a second member with extension
    ``ext``, which str.lower() may fold into "k" or into a reserved key."""
    import io

    path = tmp_path / "fold.tar"
    with tarfile.open(path, "w") as tar:
        for name in ("s0.k", "s1.k", f"s1.{ext}", "s2.k"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    return path


@pytest.mark.parametrize("ext", ["\u212a", "__\u212aey__", "__local_path__"])
def test_extensions_equal_once_lowercased_are_duplicates(tmp_path, ext):
    """The scanner compared ASCII-lowercased extensions, the sample dict str.lower()ed ones:
    "s1.k" and "s1.\u212a" (KELVIN SIGN) became one field (a payload lost without a word),
    and "s1.__\u212aey__" replaced the sample's __key__. One rule now, and no member sets
    __key__, __url__ or __local_path__; the samples before it are delivered."""
    path = _folding_tar(tmp_path, ext)
    seen = []
    with pytest.raises(ShardFormatError, match="duplicate file name") as info:
        for sample in ShardStream(str(path), index=False):
            seen.append(sample["__key__"])
    assert seen == ["s0"] and info.value.offset == 1024
    with pytest.raises(ShardFormatError, match="duplicate file name"):
        list(ShardStream(str(path)))


@pytest.mark.parametrize("ext", ["\u212a", "__\u212aey__", "__url__"])
def test_packed_batches_refuse_fields_equal_once_lowercased(tmp_path, ext):
    """The tensor-batch path names columns with str.lower() too: "k" and "\u212a" must not
    become one column, nor a member a column called __key__ or __url__."""
    path = _folding_tar(tmp_path, ext)
    with pytest.raises(ValueError, match="once lowercased|duplicate file name"):
        list(ShardStream(str(path)).tensors(4))


def test_samples_before_a_cut_gzip_trailer_are_delivered(tmp_path):
    import gzip

    plain = write_tar(tmp_path / "a.tar", make_samples(30, sizes=[5000]))
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(gzip.compress(plain.read_bytes())[:-6])  # the tar is whole, the trailer not
    samples = list(ShardStream(str(cut), handler="ignore", chunk_size="4KiB"))
    assert len(samples) == 30
    with pytest.raises(ShardFormatError, match="truncated gzip"):
        list(ShardStream(str(cut)))


def test_non_utf8_file_names(tmp_path, engine):
    name = os.fsdecode(b"shard-\xff.tar")  # a surrogate-escaped str, as glob returns it
    write_tar(tmp_path / name, make_samples(4))
    samples = list(ShardStream(str(tmp_path / "*.tar")))
    assert len(samples) == 4 and samples[0]["__url__"] == str(tmp_path / name)
    with pytest.raises(FileNotFoundError) as info:
        list(ShardStream([str(tmp_path / os.fsdecode(b"gone-\xfe.tar"))]))
    assert info.value.filename == str(tmp_path / os.fsdecode(b"gone-\xfe.tar"))
