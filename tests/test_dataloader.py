"""DataLoader workers and ranks: every sample exactly once per epoch."""

from __future__ import annotations

import collections

import pytest
from shardgen import write_shards

from flashstream import ShardStream

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402


@pytest.fixture
def shards(tmp_path):
    return [str(p) for p in write_shards(tmp_path / "d", 6, 25, sizes=[300, 5000])]


def keys_via_loader(stream, workers):
    loader = DataLoader(stream, batch_size=None, num_workers=workers)
    return [sample["__key__"] for sample in loader]


def all_keys(shards):
    return [s["__key__"] for s in ShardStream(shards, split_by_rank=False)]


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_each_sample_once(shards, workers):
    keys = keys_via_loader(ShardStream(shards, chunk_size="8KiB"), workers)
    assert len(keys) == 150
    assert collections.Counter(keys) == collections.Counter(all_keys(shards))


@pytest.mark.parametrize("workers", [0, 2])
def test_two_simulated_ranks_split_the_shards(shards, monkeypatch, workers):
    per_rank = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        per_rank.append(keys_via_loader(ShardStream(shards), workers))
    assert not set(per_rank[0]) & set(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == sorted(all_keys(shards))


def test_shuffle_is_seeded(shards):
    a = [s["__key__"] for s in ShardStream(shards, shuffle=20, seed=3)]
    b = [s["__key__"] for s in ShardStream(shards, shuffle=20, seed=3)]
    c = [s["__key__"] for s in ShardStream(shards, shuffle=20, seed=4)]
    assert a == b and a != c and sorted(a) == sorted(all_keys(shards))
    stream = ShardStream(shards, shuffle=True, seed=3)
    first = [s["__key__"] for s in stream]
    stream.set_epoch(1)
    assert [s["__key__"] for s in stream] != first


def test_batched_tensors_through_the_loader(shards):
    def collate(samples):
        return torch.tensor([int(s["cls"]) for s in samples])

    loader = DataLoader(ShardStream(shards), batch_size=10, num_workers=2, collate_fn=collate)
    total = sum(len(batch) for batch in loader)
    assert total == 150
