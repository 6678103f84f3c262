"""Resume and epoch edge cases found in review: merged states with the same worker count, a
loaded state that DataLoader workers already consumed, a checkpoint at an epoch's end loaded
lazily after set_epoch, StatefulDataLoader snapshots, persistent workers, and a scan ended by
the handler."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from resume_child import keys, write_uneven

from flashstream import ShardStream
from flashstream.stream.index import CACHE_ENV

torch = pytest.importorskip("torch")
pytest.importorskip("torchdata")
from torch.utils.data import DataLoader  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_uneven(tmp_path_factory.mktemp("uneven"))


def _make(shards, **kw):
    return lambda: ShardStream(shards, shuffle=4, seed=1, **kw)


def _state_after(make, n):
    """The keys of the first ``n`` samples of an in-process pass, and its state then."""
    first = make()
    it = iter(first)
    head = [next(it)["__key__"] for _ in range(n)]
    return head, json.loads(json.dumps(first.state_dict()))


def _saved_after(make, workers, n, **loader_kw):
    loader = StatefulDataLoader(make(), batch_size=None, num_workers=workers, **loader_kw)
    it = iter(loader)
    before = [next(it)["__key__"] for _ in range(n)]
    return before, json.loads(json.dumps(loader.state_dict()))


@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_a_merged_state_resumes_in_order_with_any_worker_count(shards, workers):
    make = _make(shards)
    before, saved = _saved_after(make, 2, 3)
    stream = make()
    stream.load_state_dict(ShardStream.collect_states(saved))
    after = keys(DataLoader(stream, batch_size=None, num_workers=workers))
    assert before + after == keys(make())


def test_the_shard_plan_refuses_a_merged_state_it_cannot_resume_in_order(shards):
    make = _make(shards, index=False)
    _, saved = _saved_after(make, 2, 3)
    stream = make()
    stream.load_state_dict(ShardStream.collect_states(saved))
    with pytest.raises(ValueError, match="round-robin at worker 0"):
        keys(DataLoader(stream, batch_size=None, num_workers=2))


def test_a_loaded_state_resumes_one_pass_only(shards):
    make = _make(shards)
    full = keys(make())
    head, state = _state_after(make, 5)
    stream = make()
    stream.load_state_dict(state)
    loader = DataLoader(stream, batch_size=None, num_workers=2)
    assert head + keys(loader) == full  # the first pass resumes ...
    assert keys(loader) == full  # ... a second pass of the epoch starts it over
    with pytest.raises(RuntimeError, match="being read by DataLoader workers"):
        stream.state_dict()  # never the stale loaded state


def test_a_consumed_state_is_not_returned_while_workers_read(shards):
    make = _make(shards)
    stream = make()
    stream.load_state_dict(_state_after(make, 1)[1])
    it = iter(DataLoader(stream, batch_size=None, num_workers=2))
    next(it)
    with pytest.raises(RuntimeError, match="being read by DataLoader workers"):
        stream.state_dict()
    del it


@pytest.mark.parametrize("workers", [0, 2])
def test_a_checkpoint_at_the_end_of_an_epoch_loaded_after_set_epoch(shards, workers):
    """torchdata loads the dataset state lazily, after the loop's set_epoch(next)."""
    make = _make(shards)
    expected = make()
    expected.set_epoch(1)
    epoch1 = keys(expected)
    stream = make()
    loader = StatefulDataLoader(stream, batch_size=None, num_workers=workers)
    keys(loader)  # all of epoch 0
    saved = json.loads(json.dumps(loader.state_dict()))
    stream = make()
    loader = StatefulDataLoader(stream, batch_size=None, num_workers=workers)
    loader.load_state_dict(saved)
    stream.set_epoch(1)
    assert keys(loader) == epoch1 and stream.epoch == 1


def test_collect_states_refuses_a_state_between_snapshots(shards):
    _, saved = _saved_after(_make(shards), 2, 8, snapshot_every_n_steps=5)
    with pytest.raises(ValueError, match="snapshot_every_n_steps=1"):
        ShardStream.collect_states(saved)


def test_persistent_workers_follow_set_epoch(shards):
    make = _make(shards)
    orders = []
    for epoch in (0, 1):
        stream = make()
        stream.set_epoch(epoch)
        orders.append(keys(stream))
    stream = make()
    loader = DataLoader(stream, batch_size=None, num_workers=2, persistent_workers=True)
    for epoch in (0, 1):
        stream.set_epoch(epoch)
        assert keys(loader) == orders[epoch]


def test_a_scan_ended_by_the_handler_caches_nothing_it_did_not_read(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    paths = write_uneven(tmp_path / "d", counts=(5, 3, 4))
    # Cut in the padding before the second sample's header: tarfile raises looking for it,
    # and a False handler ends the stream there, as webdataset's does (after the open sample).
    Path(paths[1]).write_bytes(Path(paths[1]).read_bytes()[:1024 - 100])
    stopped = ShardStream(paths, handler=lambda exn: False)
    assert [ix.count for ix in stopped.index] == [5, 1, 0]
    fresh = ShardStream([paths[2]])
    assert fresh.index_info["scan"] == 1 and len(fresh) == 4 == len(keys(fresh))


@pytest.mark.parametrize("reseed", ["manual_seed", "generator"])
def test_a_second_pass_resumes_nothing_even_with_the_same_loader_seed(shards, reseed):
    """Passes are told apart by which worker claimed the state, not by the DataLoader's seed,
    which repeats when the training script reseeds before every pass."""
    make = _make(shards)
    full = keys(make())
    head, state = _state_after(make, 5)
    stream = make()
    stream.load_state_dict(state)
    passes = []
    for _ in range(2):
        kw = {}
        if reseed == "manual_seed":
            torch.manual_seed(0)
        else:
            kw["generator"] = torch.Generator().manual_seed(7)
        passes.append(keys(DataLoader(stream, batch_size=None, num_workers=2, **kw)))
    assert head + passes[0] == full and passes[1] == full


def test_persistent_workers_resume_a_state_loaded_after_they_started(shards):
    make = _make(shards)
    full = keys(make())
    head, state = _state_after(make, 12)
    stream = make()
    loader = DataLoader(stream, batch_size=None, num_workers=2, persistent_workers=True)
    keys(loader)  # a whole pass: the workers exist before the load
    stream.load_state_dict(state)
    stream.set_epoch(0)
    assert head + keys(loader) == full
    assert keys(loader) == full  # the next pass starts the epoch over


def test_a_deep_copy_talks_to_its_own_workers(shards):
    import copy

    make = _make(shards)
    reference = keys(make())
    a = make()
    b = copy.deepcopy(a)
    b.set_epoch(3)
    assert keys(DataLoader(a, batch_size=None, num_workers=1)) == reference
