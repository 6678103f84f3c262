"""Exact resume through pipeline stages, and the same order for any number of workers.

Every composition is stopped after each of its items, saved through torchdata's
StatefulDataLoader (a JSON round trip), resumed in a fresh pipeline and loader, and compared
with the uninterrupted epoch (pipeline_check.check_resume)."""

from __future__ import annotations

import pytest
import webdataset as wds
from pipeline_check import check_resume, epoch_items, flat
from resume_child import write_uneven
from torch.utils.data import DataLoader

import flashstream as fs

pytest.importorskip("torchdata")


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    return write_uneven(tmp_path_factory.mktemp("pipeline") / "s")  # 32 samples in 5 shards


def key(sample):
    return sample["__key__"]


def odd_label(sample):
    return int(sample["cls"]) % 3 != 0


# name -> builder(urls); the sample plan (default index) unless the name says webdataset.
COMPOSITIONS = {
    "decode+batched": lambda u: fs.ShardStream(u).decode().to_tuple("__key__", "cls")
    .batched(3),
    "shuffle+batched": lambda u: fs.ShardStream(u, seed=3).shuffle(5).map(key)
    .batched(4, collation_fn=None),
    "select+batched": lambda u: fs.ShardStream(u).select(odd_label).map(key)
    .batched(4, collation_fn=None),
    "batched+unbatched": lambda u: fs.ShardStream(u, shuffle=6).map(key).listed(4).unlisted(),
    "with_epoch past the data": lambda u: fs.ShardStream(u, shuffle=4).map(key).listed(3)
    .with_epoch(15),
    "tensors": lambda u: fs.ShardStream(u, shuffle=4).tensors(3),
    "webdataset select+batched": lambda u: fs.WebDataset(u, shardshuffle=False)
    .select(odd_label).map(key).batched(4, collation_fn=None),
    "webdataset shuffle+listed+unlisted": lambda u: fs.WebDataset(u, shardshuffle=True, seed=2)
    .shuffle(4).map(key).listed(3).unlisted(),
    "webdataset with_epoch": lambda u: fs.WebDataset(u, shardshuffle=True).map(key).listed(3)
    .with_epoch(5),
    "webdataset resampled": lambda u: fs.WebDataset(u, resampled=True, seed=5).map(key)
    .listed(3).with_epoch(6),
    "DataPipeline with webdataset's stages": lambda u: fs.DataPipeline(
        fs.ShardStream(u, shuffle=5), wds.decode(), wds.to_tuple("__key__", "cls"),
        wds.batched(4)),
}


@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize("name", sorted(COMPOSITIONS))
def test_resume_is_exact_at_every_item(urls, name, workers):
    items = check_resume(lambda: COMPOSITIONS[name](urls), workers=workers)
    assert len(items) > 3


SAMPLE_PLAN = ["decode+batched", "shuffle+batched", "select+batched", "batched+unbatched",
               "with_epoch past the data", "tensors"]


@pytest.mark.parametrize("name", SAMPLE_PLAN)
def test_sample_plan_order_does_not_depend_on_workers(urls, name):
    outputs = [[flat(item) for item in DataLoader(COMPOSITIONS[name](urls), batch_size=None,
                                                  num_workers=w)] for w in (0, 1, 2, 3)]
    assert all(out == outputs[0] for out in outputs[1:])


def test_select_batches_are_the_survivors_of_planned_blocks(urls):
    blocks = [flat(b) for b in fs.ShardStream(urls).map(key).listed(4)]
    kept = {k for s in fs.ShardStream(urls) if odd_label(s) for k in [s["__key__"]]}
    filtered = [flat(b) for b in fs.ShardStream(urls).select(odd_label).map(key).listed(4)]
    expected = [tuple(k for k in block if k in kept) for block in blocks]
    assert filtered == [b for b in expected if b]
    assert any(len(b) < 4 for b in filtered)  # the rule, not webdataset's fill-up


def test_with_epoch_and_persistent_workers_follow_set_epoch(urls):
    pipeline = fs.ShardStream(urls, shuffle=8, seed=1).map(key).listed(4).with_epoch(6)
    loader = DataLoader(pipeline, batch_size=None, num_workers=2, persistent_workers=True)
    epochs = []
    for epoch in range(3):
        pipeline.set_epoch(epoch)
        epochs.append([flat(b) for b in loader])
    assert all(len(e) == 6 for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    again = fs.ShardStream(urls, shuffle=8, seed=1).map(key).listed(4).with_epoch(6)
    again.set_epoch(1)
    assert [flat(b) for b in again] == epochs[1]  # a pure function of (seed, epoch)


def test_webdataset_with_epoch_and_set_epoch_reshuffle_shards(urls):
    dataset = fs.WebDataset(urls, shardshuffle=True, seed=4).map(key).with_epoch(12)
    loader = DataLoader(dataset, batch_size=None, num_workers=1, persistent_workers=True)
    first = list(loader)
    dataset.set_epoch(1)
    second = list(loader)
    assert len(first) == len(second) == 12 and first != second


def test_changing_worker_count_through_collect_states(urls):
    make = COMPOSITIONS["select+batched"]
    reference = epoch_items(lambda: make(urls), 2)
    first = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader(
        make(urls), batch_size=None, num_workers=2)
    it = iter(first)
    before = [flat(next(it)) for _ in range(3)]
    state = first.state_dict()
    del it, first
    pipeline = make(urls)
    pipeline.load_state_dict(fs.ShardStream.collect_states(state))
    after = [flat(b) for b in DataLoader(pipeline, batch_size=None, num_workers=3)]
    assert before + after == reference


def test_state_of_another_pipeline_is_refused(urls):
    state = fs.ShardStream(urls).map(key).listed(4).state_dict()
    with pytest.raises(ValueError, match="pipeline"):
        fs.ShardStream(urls).map(key).listed(5).load_state_dict(state)
    with pytest.raises(ValueError, match="pipeline"):
        fs.ShardStream(urls).load_state_dict(state)


def test_set_epoch_on_the_base_stream_reaches_the_pipeline(urls):
    base = fs.ShardStream(urls, shuffle=6, seed=2)
    pipeline = base.map(key).listed(4)
    base.set_epoch(3)
    assert pipeline.epoch == 3 and pipeline.state_dict()["epoch"] == 3
    reference = fs.ShardStream(urls, shuffle=6, seed=2).map(key).listed(4)
    reference.set_epoch(3)
    assert [flat(b) for b in pipeline] == [flat(b) for b in reference]
    finished = pipeline.state_dict()  # the end of epoch 3
    base.set_epoch(4)
    pipeline.load_state_dict(finished)  # older and finished: ignored, epoch 4 stays
    assert pipeline.epoch == 4 and len([b for b in pipeline]) == 8


def _stop_at(bad_key):
    def check(sample):
        if sample["__key__"] == bad_key:
            raise ValueError("bad sample")
        return sample

    return check


def _stop(_exn):
    return False  # webdataset's *_and_stop: end the stream


@pytest.mark.parametrize("index", [True, False])
def test_a_handler_that_stops_ends_the_stream_even_at_a_block_end(urls, index):
    keys = [s["__key__"] for s in fs.ShardStream(urls)]
    for stop in (2, 3):  # inside the first block of 4, and its last sample
        out = [flat(b) for b in fs.ShardStream(urls, index=index)
               .map(_stop_at(keys[stop]), handler=_stop).map(key).listed(4)]
        assert out == [tuple(keys[:stop])], (index, stop, out)


def test_with_epoch_counts_planned_items_on_the_sample_plan(urls):
    pipeline = fs.ShardStream(urls).select(odd_label).map(key).with_epoch(20)
    assert len([x for x in pipeline]) < 20  # 20 positions, the filter's survivors
    assert len(list(fs.WebDataset(urls, shardshuffle=False).select(odd_label).map(key)
                    .with_epoch(20))) == 20  # per-worker outputs, as webdataset


def test_sample_plan_webdataset_with_more_workers_than_blocks(urls):
    dataset = fs.WebDataset(urls, shardshuffle=False, index="auto").map(key).listed(16)
    outputs = [[flat(b) for b in DataLoader(dataset, batch_size=None, num_workers=w)]
               for w in (0, 3)]
    assert outputs[0] == outputs[1] and len(outputs[0]) == 2
