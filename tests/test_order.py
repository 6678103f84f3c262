"""Deterministic order: a pure function of the shards, (seed, epoch) and the number of ranks;
with an index, not of the number of DataLoader workers."""

from __future__ import annotations

import pytest
from resume_child import UNEVEN, keys, write_uneven
from shardgen import wds_samples

from flashstream import ShardStream
from flashstream.cli import main as cli_main
from flashstream.stream.plan import rank_plan, shard_order
from flashstream.world import World

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

N = sum(UNEVEN)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_uneven(tmp_path_factory.mktemp("uneven"))


def loader_keys(stream, workers, batch_size=None):
    if batch_size is None:
        return keys(DataLoader(stream, batch_size=None, num_workers=workers))
    return list(DataLoader(stream, batch_size=batch_size, num_workers=workers,
                           collate_fn=lambda batch: [s["__key__"] for s in batch]))


@pytest.mark.parametrize("shuffle", [False, 4, True])
def test_same_order_for_any_number_of_workers(shards, shuffle):
    def stream():
        return ShardStream(shards, shuffle=shuffle, seed=11, index=True)

    reference = keys(stream())
    assert len(reference) == N and len(set(reference)) == N
    for workers in (0, 1, 2, 3):
        assert loader_keys(stream(), workers) == reference, workers


def test_same_batches_for_any_number_of_workers(shards):
    def stream():
        return ShardStream(shards, shuffle=6, seed=2, index=True, batch_size=4)

    reference = loader_keys(stream(), 0, batch_size=4)
    assert [k for batch in reference for k in batch] == keys(stream())
    for workers in (1, 2, 3):
        assert loader_keys(stream(), workers, batch_size=4) == reference, workers


@pytest.mark.parametrize("index", [False, True])
def test_order_is_a_function_of_seed_and_epoch(shards, index):
    def order(seed, epoch, workers=None):
        stream = ShardStream(shards, shuffle=5, seed=seed, index=index)
        stream.set_epoch(epoch)
        return keys(stream) if workers is None else loader_keys(stream, workers)

    first = order(1, 0)
    assert order(1, 0) == first  # reproducible: no timing, no global random state
    torch.manual_seed(123)
    assert order(1, 0, workers=2) == order(1, 0, workers=2)  # with workers too
    assert order(1, 1) != first and sorted(order(1, 1)) == sorted(first)  # reshuffled per epoch
    assert order(2, 0) != first


def test_without_an_index_the_order_depends_on_the_workers(shards):
    """Documented: each worker reads its own shards through its own buffer; the DataLoader
    interleaves them. The epoch's samples are the same, their order is not."""
    one = loader_keys(ShardStream(shards, index=False), 1)
    two = loader_keys(ShardStream(shards, index=False), 2)
    assert sorted(one) == sorted(two) and one != two


def test_shard_to_worker_assignment_changes_between_epochs():
    world = World(rank=0, world_size=1, worker=0, num_workers=2)
    seen = [world.split(shard_order(20, shuffle=True, seed=0, epoch=e)) for e in range(3)]
    assert seen[0] != seen[1] != seen[2]
    assert shard_order(20, shuffle=False, seed=0, epoch=1) == list(range(20))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_what_depends_on_the_number_of_ranks(shards, monkeypatch, world):
    """With an index: the epoch's global sequence (shards in epoch order, samples in file
    order) does not depend on the ranks; each rank takes a contiguous slice of it, and the
    shuffle buffer runs per rank. Concatenating the ranks' unshuffled shares gives it back."""
    everything = keys(ShardStream(shards, shuffle=False, index=True))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    plain, shuffled = [], []
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        plain.extend(keys(ShardStream(shards, shuffle=False, index=True)))
        share = keys(ShardStream(shards, shuffle=5, seed=4, index=True))
        assert len(share) in (N // world, N // world + 1)
        shuffled.append(share)
    assert plain == everything
    assert sorted(k for share in shuffled for k in share) == sorted(everything)


def test_plan_slices_are_exact():
    counts, order = [5, 3, 7], [2, 0, 1]
    whole = [(s, k) for s in order for k in range(counts[s])]
    for world in (1, 2, 3, 4, 7):
        plans = [rank_plan(counts, order, world_size=world, rank=r, equal=None)
                 for r in range(world)]
        assert [p.ref(q) for p in plans for q in range(p.length)] == whole


def test_index_keeps_webdataset_equality(tmp_path):
    """Default settings with sidecar indexes: the sample plan yields webdataset's samples."""
    shards = write_uneven(tmp_path)
    assert cli_main(["index", *shards]) == 0
    stream = ShardStream(shards)
    assert stream.plan == "samples"
    ours = list(stream)
    theirs = wds_samples(shards)
    assert [list(s.items()) for s in ours] == [list(s.items()) for s in theirs]
