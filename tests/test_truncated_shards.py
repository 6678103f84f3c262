"""Truncated and corrupt shards: flashstream yields what webdataset yields, for every handler.

Each case damages the first of two shards and reads both with ``webdataset.WebDataset`` and
with flashstream's ``WebDataset`` and ``ShardStream`` (``index=False`` and ``index="auto"``),
under webdataset's handlers; keys and field bytes must agree. webdataset yields the sample it
was assembling when the shard failed (e.g. ``{__key__, __url__, cls}`` when the ``.png`` after
the ``.cls`` is cut) unless the handler raises; so must we.

Intended differences, asserted as such where they occur:

- webdataset does not see some damage at all: Python's tarfile takes a bad or cut header after
  the first for the end of the archive, and reads a gzip stream cut after the tar's end without
  complaint. We report it (never a silent loss): under ``reraise`` we raise after yielding all
  that webdataset yields from that shard; the other handlers then yield exactly what it yields.
- ``index="auto"`` makes the index when the stream is made, so under ``reraise`` the index
  scan raises there, before any sample.

What we raise is both a ``tarfile.ReadError`` (what webdataset raises) and a
``ShardFormatError`` naming the shard and a byte offset.
"""

from __future__ import annotations

import gzip
import io
import pickle
import random
import tarfile
import types
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import pytest

import flashstream as fs
from flashstream import ShardFormatError

wds = pytest.importorskip("webdataset")

HANDLERS = {
    "reraise": wds.reraise_exception,
    "ignore_and_continue": wds.ignore_and_continue,
    "ignore_and_stop": wds.ignore_and_stop,
    "warn_and_continue": wds.warn_and_continue,
}

READERS: Dict[str, Callable] = {
    "flashstream.WebDataset": lambda urls, handler: fs.WebDataset(
        urls, shardshuffle=False, handler=handler),
    "ShardStream(index=False)": lambda urls, handler: fs.ShardStream(
        urls, handler=handler, index=False),
    "ShardStream(index='auto')": lambda urls, handler: fs.ShardStream(
        urls, handler=handler, index="auto"),
    # Small reads: the damage then falls in a later read than the samples before it.
    "ShardStream(index=False, 4 KiB reads)": lambda urls, handler: fs.ShardStream(
        urls, handler=handler, index=False, chunk_size="4KiB", queue_depth=2),
    "ShardStream(index='auto', 4 KiB reads)": lambda urls, handler: fs.ShardStream(
        urls, handler=handler, index="auto", chunk_size="4KiB", queue_depth=2),
}

LONG = "d" * 120 + "/"  # a key this long takes a GNU long-name header


@pytest.fixture(autouse=True)
def no_warning_pause(monkeypatch):
    """webdataset's warn_and_continue sleeps half a second after each warning."""
    monkeypatch.setattr(wds.handlers, "time", types.SimpleNamespace(sleep=lambda _: None))


def shard_bytes(first: int, count: int = 4) -> bytes:
    """Samples ``{cls, png}``; sample 2's key is long (an extended header before each member)."""
    rng = random.Random(first)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for i in range(first, first + count):
            key = f"{LONG if i - first == 2 else ''}s{i:04d}"
            for ext, data in (("cls", str(i).encode()), ("png", rng.randbytes(1500))):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size, info.mtime = len(data), 1_700_000_000
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


GOOD = shard_bytes(0)
OTHER = shard_bytes(100)
with tarfile.open(fileobj=io.BytesIO(GOOD)) as _tar:
    MEMBERS = {m.name.rsplit("/", 1)[-1]: m for m in _tar}


def cut(offset: int) -> Callable[[bytes], bytes]:
    return lambda data: data[:offset]


def bad_checksum(header: int) -> Callable[[bytes], bytes]:
    def damage(data: bytes) -> bytes:
        out = bytearray(data)
        out[header + 148] ^= 0x01
        return bytes(out)

    return damage


def header_of(name: str) -> int:
    """The member's own header (after its long-name header, if any)."""
    return MEMBERS[name].offset_data - 512


S1_CLS, S1_PNG, S2_CLS = MEMBERS["s0001.cls"], MEMBERS["s0001.png"], MEMBERS["s0002.cls"]

#: name: (damage, what webdataset does under reraise: "raises"; "quiet", where tarfile takes
#: the damage for the archive's end and we raise; "whole": a valid archive, nobody raises)
CASES: Dict[str, Tuple[Callable[[bytes], bytes], str]] = {
    "cut in the .png data after a whole .cls": (cut(S1_PNG.offset_data + 700), "raises"),
    "cut in a sample's first member": (cut(S1_CLS.offset_data + 1), "raises"),
    "cut right after a member's data": (cut(S1_PNG.offset_data + S1_PNG.size), "raises"),
    "cut in the padding after a member": (cut(S1_PNG.offset_data + S1_PNG.size + 9), "raises"),
    "cut in a header": (cut(header_of("s0001.png") + 200), "quiet"),
    "cut in a long-name header": (cut(S2_CLS.offset + 600), "raises"),
    "cut in the header after a long-name header": (cut(header_of("s0002.cls") + 100), "raises"),
    "cut in the first header": (cut(100), "raises"),
    "cut at a header (no end-of-archive blocks)": (cut(S2_CLS.offset), "whole"),
    "bad header checksum": (bad_checksum(header_of("s0001.png")), "quiet"),
    "bad checksum after a long-name header": (bad_checksum(header_of("s0002.cls")), "raises"),
    "bad first header checksum": (bad_checksum(0), "raises"),
}


def read(make: Callable) -> Tuple[List[dict], Optional[BaseException]]:
    """The samples ``make()`` yields, and what it raised after them (None: nothing)."""
    samples: List[dict] = []
    try:
        for sample in make():
            samples.append(sample)
    except Exception as exn:  # noqa: BLE001 - compared with webdataset's
        return samples, exn
    return samples, None


def items(samples: List[dict]) -> List[list]:
    return [sorted(sample.items()) for sample in samples]


def check_like_webdataset(urls: List[str], handler, *, expect: Optional[str] = None) -> None:
    """Every reader against webdataset on ``urls`` (the first one damaged). ``expect``: what
    webdataset does under reraise (see CASES; None: not known, as in the offset sweeps)."""
    bad = urls[0]
    theirs = {check: read(lambda check=check: wds.WebDataset(
        urls, shardshuffle=False, handler=handler, empty_check=check)) for check in (True, False)}
    if expect is not None and handler is wds.reraise_exception:
        assert (theirs[False][1] is not None) == (expect == "raises"), theirs[False][1]
        ours = read(lambda: fs.ShardStream(urls, handler=handler, index=False))[1]
        assert (ours is None) == (expect == "whole"), ours
    for name, make in READERS.items():
        # ShardStream has no empty_check; webdataset's raises when nothing came at all.
        expected, their_error = theirs[name == "flashstream.WebDataset"]
        ours, our_error = read(lambda make=make: make(urls, handler))
        if our_error is None:
            assert their_error is None, (name, their_error)
            assert items(ours) == items(expected), name
            continue
        if not isinstance(our_error, ShardFormatError):  # empty_check's "No samples found"
            assert type(our_error) is type(their_error), (name, our_error)
            assert items(ours) == items(expected), name
            continue
        assert isinstance(our_error, tarfile.ReadError), name
        assert our_error.url == bad and our_error.offset is not None, name
        assert bad in str(our_error) and f"byte offset {our_error.offset}" in str(our_error)
        assert handler is wds.reraise_exception, (name, our_error)  # the rest never raise
        if "index='auto'" in name:
            assert ours == []  # intended: the index scan raises as the stream is made
        elif their_error is not None:
            assert isinstance(their_error, tarfile.ReadError)
            assert items(ours) == items(expected), name
        else:
            # Intended: webdataset does not see this damage and goes on; we raise after all it
            # yields from the damaged shard.
            assert items(ours) == items([s for s in expected if s["__url__"] == bad]), name


def write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize("handler", HANDLERS)
@pytest.mark.parametrize("case", CASES)
def test_a_damaged_tar_shard(tmp_path, case, handler):
    damage, expect = CASES[case]
    urls = [write(tmp_path / "bad.tar", damage(GOOD)), write(tmp_path / "next.tar", OTHER)]
    check_like_webdataset(urls, HANDLERS[handler], expect=expect)


@pytest.mark.parametrize("handler", HANDLERS)
@pytest.mark.parametrize("case", ["cut in the .png data after a whole .cls", "cut in a header",
                                  "cut in a long-name header", "bad header checksum"])
def test_a_damaged_gzip_shard(tmp_path, case, handler):
    """Offsets count in the decompressed stream: a gzip of the damaged tar fails as the tar."""
    damage, expect = CASES[case]
    urls = [write(tmp_path / "bad.tar.gz", gzip.compress(damage(GOOD), mtime=0)),
            write(tmp_path / "next.tar", OTHER)]
    check_like_webdataset(urls, HANDLERS[handler], expect=expect)


@pytest.mark.parametrize("handler", HANDLERS)
def test_tar_shards_cut_at_many_offsets(tmp_path, handler):
    ends = [m.offset_data + m.size for m in MEMBERS.values()]
    offsets = sorted(set(range(50, len(GOOD), 331)) | {end + d for end in ends for d in (-1, 0, 7)})
    for offset in offsets:
        urls = [write(tmp_path / f"cut{offset}.tar", GOOD[:offset]),
                write(tmp_path / "next.tar", OTHER)]
        check_like_webdataset(urls, HANDLERS[handler])


@pytest.mark.parametrize("handler", HANDLERS)
def test_gzip_shards_cut_at_many_offsets(tmp_path, handler):
    """A gzip stream cut short is a tar stream cut where its last whole deflate block ends; cut
    in its last bytes (the trailer), the tar is whole: webdataset is silent, we raise."""
    packed = gzip.compress(GOOD, mtime=0)
    offsets = list(range(15, len(packed), len(packed) // 23)) + [len(packed) - 4]
    for offset in offsets:
        urls = [write(tmp_path / f"cut{offset}.tar.gz", packed[:offset]),
                write(tmp_path / "next.tar", OTHER)]
        check_like_webdataset(urls, HANDLERS[handler])
    urls = [str(tmp_path / f"cut{len(packed) - 4}.tar.gz"), urls[1]]
    check_like_webdataset(urls, HANDLERS[handler], expect="quiet")


def test_the_partial_sample_before_a_cut(tmp_path):
    """The issue's case: one shard whose first sample lost its .png. webdataset yields the
    .cls alone; we yielded nothing, then empty_check raised "No samples found"."""
    url = write(tmp_path / "cut.tar", GOOD[:MEMBERS["s0000.png"].offset_data + 300])
    for make in (fs.WebDataset, wds.WebDataset):
        (sample,) = make(url, shardshuffle=False, handler=wds.ignore_and_stop)
        assert sample["__key__"] == "s0000" and sample["cls"] == b"0" and "png" not in sample
        assert sample["__url__"] == url
    (sample,) = fs.ShardStream(url, handler=wds.ignore_and_stop)
    assert sorted(sample) == ["__key__", "__local_path__", "__url__", "cls"]
    with pytest.raises(tarfile.ReadError, match="cut.tar at byte offset"):
        list(fs.WebDataset(url, shardshuffle=False))


def test_the_error_survives_pickling_and_dataloader_workers(tmp_path):
    from torch.utils.data import DataLoader

    error = ShardFormatError("a.tar", 4096, "truncated member", True)
    copy = pickle.loads(pickle.dumps(error))
    assert isinstance(copy, tarfile.ReadError) and isinstance(copy, ValueError)
    assert (copy.url, copy.offset, copy.reason, copy.shard_only) == ("a.tar", 4096,
                                                                   "truncated member", True)
    assert str(copy) == str(error) == "a.tar at byte offset 4096: truncated member"
    offset = S1_PNG.offset_data + 700
    url = write(tmp_path / "cut.tar", GOOD[:offset])
    loader = DataLoader(fs.ShardStream(url, index=False), batch_size=None, num_workers=1)
    with pytest.raises(tarfile.ReadError) as caught:
        list(loader)
    assert isinstance(caught.value, ShardFormatError)
    assert (caught.value.url, caught.value.offset) == (url, offset)
    assert "DataLoader worker" in str(caught.value)


def test_reading_by_index_reports_a_cut_its_index_did_not_know(tmp_path):
    """A sample the index says is whole but that is cut now is reported, not passed over as
    the index scan's own error: the index here was made before the cut (kept in memory)."""
    path = tmp_path / "s.tar"
    path.write_bytes(GOOD)
    seen: List[BaseException] = []
    stream = fs.ShardStream(str(path), handler=lambda exn: seen.append(exn) or True)
    path.write_bytes(GOOD[:S1_PNG.offset_data + S1_PNG.size + 9])  # in s0001's last padding
    keys = [sample["__key__"] for sample in stream]
    assert keys == ["s0000", "s0001"]  # s0001 is whole, but the shard was cut in its padding
    assert len(seen) == 1 and isinstance(seen[0], ShardFormatError)
    assert "truncated tar padding" in str(seen[0])
