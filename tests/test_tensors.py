"""ShardStream.tensors(B): batches packed into shared memory from the read buffers carry the
same bytes as the per-sample path, cross DataLoader workers by file descriptor, and reuse
their memory."""

from __future__ import annotations

import pickle
import tarfile

import pytest
import torch
from resume_child import write_uneven
from shardgen import make_samples, write_tar
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import flashstream as fs
from flashstream.batches import Ragged, TensorBatch
from flashstream.batches import pool as slab_pool


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    """Fixed-size 'bin', variable 'txt' and 'cls', a field only some samples have."""
    directory = tmp_path_factory.mktemp("tensors")
    paths = []
    for s in range(4):
        samples = make_samples(9 + s, seed=s, prefix=f"sh{s}/k", sizes=[1000],
                               exts=("cls", "bin"))
        for i, (_key, fields) in enumerate(samples):
            fields["txt"] = b"x" * ((i * 37 + s) % 300)
            if i % 4 == 0:
                fields["json"] = b"{}"
        paths.append(str(write_tar(directory / f"t{s}.tar", samples)))
    return paths


def field_bytes(value, i):
    return bytes(value[i].numpy())


def assert_same_bytes(batches, reference_blocks):
    """Each batch holds exactly its block's samples (in file order), byte for byte."""
    assert len(batches) == len(reference_blocks)
    for batch, block in zip(batches, reference_blocks):
        by_key = {s["__key__"]: s for s in block}
        assert sorted(batch["__key__"]) == sorted(by_key)
        for i, key in enumerate(batch["__key__"]):
            sample = by_key[key]
            assert batch["__url__"][i] == sample["__url__"]
            for name in ("cls", "bin", "txt", "json"):
                if name not in batch:  # a field no sample of the batch has
                    assert not any(name in s for s in block), (key, name)
                    continue
                assert field_bytes(batch[name], i) == sample.get(name, b""), (key, name)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("options", [dict(), dict(shuffle=7, seed=2), dict(index=False)])
def test_tensor_batches_equal_the_per_sample_bytes(urls, options, workers):
    blocks = list(fs.ShardStream(urls, **options).batched(5, collation_fn=None))
    batches = list(DataLoader(fs.ShardStream(urls, **options).tensors(5), batch_size=None,
                              num_workers=workers if options.get("index") is not False else 0))
    assert_same_bytes(batches, blocks)
    assert isinstance(batches[0], TensorBatch)


@pytest.mark.parametrize("chunk", ["4KiB", "16KiB"])
@pytest.mark.parametrize("options", [dict(), dict(shuffle=7, seed=3)])
def test_tensor_batches_from_chunks_of_a_few_samples(urls, chunk, options):
    """Reads of a few samples each: most go whole to one batch, some span two, and shuffled
    blocks read through samples they do not want."""
    blocks = list(fs.ShardStream(urls, **options).batched(4, collation_fn=None))
    batches = list(fs.ShardStream(urls, chunk_size=chunk, **options).tensors(4))
    assert_same_bytes(batches, blocks)


def test_field_shapes(urls):
    batch = next(iter(fs.ShardStream(urls).tensors(4)))
    assert batch["bin"].shape == (4, 1000) and batch["bin"].dtype == torch.uint8
    assert isinstance(batch["txt"], Ragged) and len(batch["txt"]) == 4
    assert batch["txt"].offsets[0] == 0 and batch["txt"].offsets[-1] == len(batch["txt"].values)
    json_field = batch["json"]  # only sample 0 of the batch has it: empty for the others
    assert isinstance(json_field, Ragged) and json_field.lengths().tolist() == [2, 0, 0, 0]
    views = batch["txt"].split()
    base = batch["txt"].values.data_ptr()
    assert all(v.numel() == 0 or base <= v.data_ptr() < base + len(batch["txt"].values)
               for v in views)  # zero-copy views
    assert batch["txt"].tolist() == [bytes(v.numpy()) for v in views]
    assert batch.size == 4


def test_slabs_are_reused_in_process(urls):
    pool = slab_pool()
    before = len(pool.slabs)
    for _ in range(3):
        for batch in fs.ShardStream(urls).tensors(3):
            del batch
    assert len(pool.slabs) - before <= 3


class _PickledSizes(IterableDataset):
    """In each worker: the bytes a batch pickles to on its way to the main process."""

    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        from multiprocessing.reduction import ForkingPickler

        from flashstream.batches import for_loader

        assert get_worker_info() is not None
        for batch in self.inner:
            payload = sum(v.numel() if isinstance(v, torch.Tensor) else v.values.numel()
                          for k, v in batch.items() if not k.startswith("__"))
            yield {"payload": payload,
                   "pickled": len(ForkingPickler.dumps(for_loader(batch)))}


def test_payloads_cross_by_descriptor_not_by_pickle(urls):
    sizes = list(DataLoader(_PickledSizes(fs.ShardStream(urls).tensors(8)), batch_size=None,
                            num_workers=1))
    # Keys, urls and the layout only: no payload byte is pickled, whatever the batch holds.
    assert sizes and all(s["pickled"] < 1500 for s in sizes), sizes
    assert sum(s["payload"] for s in sizes) > 6 * sum(s["pickled"] for s in sizes)


def test_batches_through_workers_stay_valid_and_pin_memory_works(urls):
    loader = DataLoader(fs.ShardStream(urls).tensors(4), batch_size=None, num_workers=2,
                        pin_memory=True, prefetch_factor=4)
    kept = [b for b in loader]  # kept alive: their slabs must not be reused under them
    reference = list(fs.ShardStream(urls).batched(4, collation_fn=None))
    assert_same_bytes(kept, reference)
    assert isinstance(kept[0]["__key__"], list)
    if torch.cuda.is_available():
        assert kept[0]["bin"].is_pinned()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_copy_to_gpu(urls):
    batch = next(iter(fs.ShardStream(urls).tensors(4))).pin_memory()
    assert batch["bin"].is_pinned() and batch["txt"].values.is_pinned()
    on_gpu = batch["bin"].to("cuda", non_blocking=True)
    assert torch.equal(on_gpu.cpu(), batch["bin"])


def test_a_changed_batch_still_crosses_whole(urls):
    def add_field(batch):
        batch["sum"] = batch["bin"].sum(dim=1)
        batch["bin"] = batch["bin"][:, :10].clone()
        return batch

    loader = DataLoader(fs.ShardStream(urls).tensors(4).map(add_field), batch_size=None,
                        num_workers=1)
    for batch in loader:
        assert batch["bin"].shape[1] == 10 and batch["sum"].shape == (len(batch["__key__"]),)
        assert isinstance(batch["txt"], Ragged)


def test_bad_arguments(urls):
    stream = fs.ShardStream(urls)
    with pytest.raises(ValueError, match="batch size"):
        stream.tensors(0)
    # After batching, shuffle is webdataset's own shuffle of the batches (as in webdataset).
    assert "shuffle: runs as given" in str(stream.tensors(4).shuffle(10).explain())
    with pytest.raises(ValueError, match="right after"):
        stream.map(len).tensors(4)
    with pytest.raises(ValueError, match="unbatched"):
        stream.tensors(4).unbatched()


def test_pickling_outside_a_worker_keeps_the_tensors(urls):
    batch = next(iter(fs.ShardStream(urls).tensors(4)))
    copy = pickle.loads(pickle.dumps(batch))
    assert isinstance(copy, TensorBatch) and torch.equal(copy["bin"], batch["bin"])


@pytest.mark.parametrize("chunk", [None, "4KiB"])
def test_bad_shard_in_the_tensor_path(tmp_path, chunk):
    good = write_uneven(tmp_path / "good", (6, 5))
    bad = tmp_path / "bad.tar"
    with open(good[0], "rb") as f:
        data = bytearray(f.read())
    with tarfile.open(good[0]) as tar:
        third = tar.getmembers()[4].offset  # the header of sample 2's first member
    data[third + 148] ^= 0x55  # its checksum
    bad.write_bytes(bytes(data))
    urls = [str(bad), good[1]]
    with pytest.raises(fs.ShardFormatError) as caught:
        fs.ShardStream(urls, index=True)  # the index scan finds it first
    assert caught.value.url == str(bad)
    stream = fs.ShardStream(urls, handler="ignore", chunk_size=chunk)
    keys = [k for b in stream.tensors(3) for k in b["__key__"]]
    assert keys[:2] == ["sh0/k000000", "sh0/k000001"]  # before the bad header
    assert "sh0/k000002" not in keys and keys[-5:] == [f"sh1/k{i:06d}" for i in range(5)]


def _round_trip(batch):
    """A stage that pickles its batch inside the worker (e.g. torch.save to a log)."""
    import io

    buffer = io.BytesIO()
    torch.save(batch, buffer)
    copy = pickle.loads(pickle.dumps(batch))
    assert torch.equal(copy["bin"], batch["bin"]) and len(buffer.getvalue()) > batch["bin"].numel()
    return batch


def test_pickling_inside_a_worker_copies_and_leaves_the_slab_protocol_alone(urls):
    loader = DataLoader(fs.ShardStream(urls).tensors(4).map(_round_trip), batch_size=None,
                        num_workers=1)
    for _ in range(2):
        assert_same_bytes(list(loader),
                          list(fs.ShardStream(urls).batched(4, collation_fn=None)))


def test_a_descriptor_replaces_a_kept_mapping_and_dropped_slabs_are_forgotten():
    import os

    from flashstream.batches import slabs

    class Fd:  # what multiprocessing's DupFd gives the receiver
        def __init__(self, fd):
            self.fd = os.dup(fd)

        def detach(self):
            return self.fd

    first, second = slabs.Slab(1 << 20, (7, 0)), slabs.Slab(1 << 20, (7, 0))
    first.map[4096:4100], second.map[4096:4100] = b"old!", b"new!"
    key, owner = (123, 0), os.getpid() + 1
    assert slabs.map_received(Fd(first.fd), 1 << 20, key, owner)[4096:4100] == b"old!"
    # A pool reusing a key (a new worker with a recycled pid, before keys were random) must
    # not be read through the old mapping.
    assert slabs.map_received(Fd(second.fd), 1 << 20, key, owner)[4096:4100] == b"new!"
    assert slabs.map_received(None, 1 << 20, key, owner)[4096:4100] == b"new!"
    slabs.map_received(Fd(first.fd), 1 << 20, (123, 1), owner, dropped=[0])
    with pytest.raises(RuntimeError, match="not mapped"):
        slabs.map_received(None, 1 << 20, key, owner)


def test_ragged_indexing():
    import numpy as np

    values = torch.arange(10, dtype=torch.uint8)
    ragged = Ragged(values, torch.tensor([0, 3, 3, 10]))
    assert len(ragged) == 3
    assert ragged[np.int64(0)].tolist() == [0, 1, 2] and ragged[torch.tensor(2)].numel() == 7
    assert ragged[-2].numel() == 0
    with pytest.raises(IndexError):
        ragged[3]
    with pytest.raises(TypeError, match="split"):
        ragged["values"]
    values_back, offsets_back = ragged  # still a NamedTuple for torch's utilities
    assert values_back is values


@pytest.mark.parametrize("shuffle", [False, 5])
def test_tensor_batches_from_compressed_shards(tmp_path, shuffle):
    urls = write_uneven(tmp_path / "gz", gzip=(0, 2))  # inflated from their start per run
    blocks = list(fs.ShardStream(urls, shuffle=shuffle, chunk_size="4KiB")
                  .batched(3, collation_fn=None))
    batches = list(fs.ShardStream(urls, shuffle=shuffle, chunk_size="4KiB").tensors(3))
    for batch, block in zip(batches, blocks):
        by_key = {s["__key__"]: s for s in block}
        assert sorted(batch["__key__"]) == sorted(by_key)
        for i, k in enumerate(batch["__key__"]):
            assert field_bytes(batch["bin"], i) == by_key[k]["bin"]
    assert len(batches) == len(blocks) == 11
