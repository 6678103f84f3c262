"""flashstream.DataPipeline / WebDataset accept whatever webdataset's accept: what they
recognise runs on flashstream's stream, the rest on webdataset's own code, and each says which.
Every case is compared with webdataset's output on the same input."""

from __future__ import annotations

import io
import logging
import tarfile
from pathlib import Path

import pytest
import webdataset as wds
from pipeline_check import check_resume, flat
from torch.utils.data import DataLoader

import flashstream as fs
from flashstream.pipeline import explain as explain_module


def _write(path, keys, *, fields=("txt", "cls")):
    with tarfile.open(path, "w") as tar:
        for key in keys:
            for ext in fields:
                data = f"{ext} of {key}".encode() * (1 + len(key) % 5)
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    directory = tmp_path_factory.mktemp("drop-in")
    return [_write(directory / f"s-{s}.tar", [f"s{s}/k{i:02d}" for i in range(5 + s)])
            for s in range(4)]


def _items(dataset, workers=None):
    source = dataset if workers is None else DataLoader(dataset, batch_size=None,
                                                        num_workers=workers)
    return [flat(item) for item in source]


def _both(make):
    """``make(module)`` built with flashstream's names and with webdataset's."""
    return make(fs), make(wds)


def _samples(sample):
    return {k: v for k, v in sample.items()}


@pytest.mark.parametrize("workers", [None, 2])
def test_a_shard_list_block_is_accelerated_and_gives_webdataset_samples(shards, workers):
    def make(m):
        return m.DataPipeline(wds.SimpleShardList(shards), wds.split_by_node,
                              wds.split_by_worker, wds.tarfile_to_samples(),
                              wds.map(_samples), wds.to_tuple("__key__", "txt", "cls"))

    ours, theirs = _both(make)
    assert ours.explain().accelerated and "SimpleShardList" in ours.explain().source
    assert _items(ours, workers) == _items(theirs, workers)


def test_without_split_by_worker_every_worker_reads_every_shard_as_in_webdataset(shards):
    def make(m):
        return m.DataPipeline(wds.SimpleShardList(shards[:2]), wds.tarfile_samples,
                              wds.to_tuple("__key__"))

    ours, theirs = _both(make)
    assert _items(ours, 2) == _items(theirs, 2) and len(_items(ours, 2)) == 2 * (5 + 6)


def test_samples_are_the_same_dicts_as_webdatasets(shards):
    """DataPipeline's samples have no __local_path__ (webdataset's url opener gives none)."""
    def make(m):
        return m.DataPipeline(wds.SimpleShardList(shards), wds.tarfile_to_samples())

    ours, theirs = _both(make)
    assert list(ours) == list(theirs)


def test_a_seeded_shard_list_keeps_its_order(shards):
    def make(m):
        return m.DataPipeline(wds.SimpleShardList(shards, seed=5), wds.tarfile_to_samples(),
                              wds.to_tuple("__key__"))

    ours, theirs = _both(make)
    assert _items(ours) == _items(theirs)


def test_a_shard_shuffle_and_sample_shuffle_give_the_same_samples(shards):
    def make(m):
        return m.DataPipeline(wds.SimpleShardList(shards), wds.shuffle(10),
                              wds.tarfile_to_samples(), wds.shuffle(7), wds.to_tuple("__key__"))

    ours, theirs = _both(make)
    assert ours.explain().accelerated
    assert sorted(_items(ours)) == sorted(_items(theirs))


def test_resampled_shards_are_accelerated(shards):
    dataset = fs.DataPipeline(wds.ResampledShards(shards, seed=3), wds.tarfile_to_samples(),
                              wds.to_tuple("__key__")).with_epoch(40)
    assert dataset.explain().accelerated and dataset.stream.config.resampled
    keys = _items(dataset)
    every = {k for k, in _items(wds.DataPipeline(wds.SimpleShardList(shards),
                                                 wds.tarfile_to_samples(),
                                                 wds.to_tuple("__key__")))}
    assert len(keys) == 40 and {k for k, in keys} <= every
    assert keys == _items(fs.DataPipeline(wds.ResampledShards(shards, seed=3),
                                          wds.tarfile_to_samples(),
                                          wds.to_tuple("__key__")).with_epoch(40))


def test_a_finite_resampled_shards_runs_as_webdataset(shards):
    def make(m):
        return m.DataPipeline(wds.ResampledShards(shards, nshards=3), wds.tarfile_to_samples())

    ours, theirs = _both(make)
    assert not ours.explain().accelerated and "nshards" in str(ours.explain())
    assert 3 * 5 <= len(list(ours)) <= 3 * 8


@pytest.mark.parametrize("source", ["generator", "list", "iterator function"])
def test_sources_that_are_not_shard_lists_run_as_webdataset(source):
    def make(m):
        first = {"generator": lambda: (i * i for i in range(6)),
                 "list": [[1, 2, 3]],
                 "iterator function": lambda: iter([4, 5, 6])}[source]
        return m.DataPipeline(first, wds.map(lambda x: x + 1),
                              wds.batched(2, collation_fn=None))

    ours, theirs = _both(make)
    assert isinstance(ours, wds.DataPipeline) and not ours.explain().accelerated
    assert _items(ours) == _items(theirs)


def test_a_data_loader_source_runs_as_webdataset(shards):
    def make(m):
        inner = DataLoader(fs.ShardStream(shards).to_tuple("__key__"), batch_size=None)
        return m.DataPipeline(inner, wds.map(lambda x: x[0].upper()))

    ours, theirs = _both(make)
    assert _items(ours) == _items(theirs)


def test_pipe_urls_are_read_through_webdatasets_opener(shards):
    def make(m):
        return m.WebDataset([f"pipe:cat {u}" for u in shards], shardshuffle=False).to_tuple(
            "__key__", "txt")

    ours, theirs = _both(make)
    assert isinstance(ours, wds.WebDataset)
    explained = ours.explain()
    assert not explained.accelerated and "pipe:" in str(explained)
    assert _items(ours) == _items(theirs)
    block = fs.DataPipeline(wds.SimpleShardList(f"pipe:cat {shards[0]}"),
                            wds.tarfile_to_samples(), wds.to_tuple("__key__"))
    assert not block.explain().accelerated
    assert _items(block) == [(f"s0/k{i:02d}",) for i in range(5)]


@pytest.mark.parametrize("handler", [wds.ignore_and_stop, wds.ignore_and_continue])
def test_a_truncated_pipe_shard_yields_what_webdataset_yields(tmp_path, shards, handler):
    cut = tmp_path / "cut.tar"
    cut.write_bytes(Path(shards[3]).read_bytes()[:3000])
    urls = [f"pipe:cat {cut}", shards[0]]

    def make(m):
        return m.WebDataset(urls, shardshuffle=False, handler=handler).to_tuple("__key__")

    ours, theirs = _both(make)
    assert _items(ours) == _items(theirs)
    with pytest.raises(tarfile.ReadError):
        list(fs.WebDataset(urls, shardshuffle=False))


def test_rename_files_and_custom_splitters_run_as_webdataset(shards):
    def rename(name):
        return name.replace(".txt", ".text")

    def make(m):
        return m.DataPipeline(wds.SimpleShardList(shards), wds.tarfile_to_samples(
            rename_files=rename), wds.to_tuple("__key__", "text"))

    ours, theirs = _both(make)
    assert "rename_files" in str(ours.explain()) and _items(ours) == _items(theirs)

    def every_other(src):
        yield from list(src)[::2]

    def split(m):
        return m.DataPipeline(wds.SimpleShardList(shards), every_other,
                              wds.tarfile_to_samples(), wds.to_tuple("__key__"))

    ours, theirs = _both(split)
    assert "every_other" in str(ours.explain()) and _items(ours) == _items(theirs)


def test_select_files_in_the_block(shards):
    def make(m):
        return m.DataPipeline(wds.SimpleShardList(shards),
                              wds.tarfile_to_samples(select_files=lambda n: n.endswith(".cls")))

    ours, theirs = _both(make)
    assert ours.explain().accelerated and list(ours) == list(theirs)


def test_the_first_fallback_logs_one_line(caplog, monkeypatch):
    monkeypatch.setattr(explain_module, "_ANNOUNCED", False)
    with caplog.at_level(logging.WARNING, logger="flashstream"):
        fs.DataPipeline(lambda: iter([1]))
        fs.DataPipeline(lambda: iter([2]))
    lines = [r for r in caplog.records if "not accelerated" in r.getMessage()]
    assert len(lines) == 1 and "DataPipeline" in lines[0].getMessage()


def test_explain_names_the_source_and_each_stage(shards):
    def double(src):
        for x in src:
            yield x
            yield x

    dataset = (fs.WebDataset(shards, shardshuffle=False).shuffle(8).decode()
               .to_tuple("__key__", "txt").batched(3).compose(double).slice(5))
    explained = dataset.explain()
    text = str(explained)
    assert explained.accelerated and text.startswith("accelerated:")
    for part in ("O_DIRECT", "shuffle(8)", "decode", "to_tuple", "batched(3)", "double",
                 "as if it held nothing", "slice(0, 5, 1)"):
        assert part in text, (part, text)


def test_fluid_methods_webdataset_has(shards, tmp_path):
    def make(m, method, *args):
        return getattr(m.WebDataset(shards, shardshuffle=False), method)(*args).to_tuple(
            "__key__")

    for method, args in [("slice", (3,)), ("slice", (2, 20, 3)), ("rsample", (1.0,)),
                         ("mcached", ()), ("log_keys", (str(tmp_path / "keys.log"),))]:
        ours, theirs = make(fs, method, *args), make(wds, method, *args)
        assert _items(ours) == _items(theirs), method
    assert (tmp_path / "keys.log").read_text().count("s0/k00") == 2
    half = fs.WebDataset(shards, shardshuffle=False).rsample(0.5)
    assert 0 < sum(len(list(half)) for _ in range(20)) < 20 * 26
    with fs.WebDataset(shards, shardshuffle=False).shuffle(5).to_tuple("__key__") as ds:
        assert len(list(ds)) == 26


def test_shuffle_after_batching_shuffles_batches_as_webdataset(shards):
    def make(m):
        return m.WebDataset(shards, shardshuffle=False).to_tuple("__key__").batched(4).shuffle(
            3)

    ours, theirs = _both(make)
    assert sorted(_items(ours)) == sorted(_items(theirs))


@pytest.mark.parametrize("workers", [0, 2])
def test_slice_resumes_exactly(shards, workers):
    def make():
        return fs.WebDataset(shards, shardshuffle=False).to_tuple("__key__").slice(1, 9, 2)

    reference = check_resume(make, workers=workers)
    assert len(reference) == 4 * max(1, workers)


def test_a_resumed_data_pipeline_continues_exactly(shards):
    def make():
        return fs.DataPipeline(wds.SimpleShardList(shards), wds.split_by_worker,
                               wds.tarfile_to_samples(), wds.to_tuple("__key__"),
                               wds.batched(3))

    check_resume(make, workers=2, stops=[0, 1, 3, 5])


def test_urls_given_as_a_one_shot_iterator(shards):
    ours = fs.WebDataset(iter(shards), shardshuffle=False).to_tuple("__key__")
    theirs = wds.WebDataset(iter(shards), shardshuffle=False).to_tuple("__key__")
    assert ours.explain().accelerated and _items(ours) == _items(theirs)
    piped = fs.WebDataset((f"pipe:cat {u}" for u in shards), shardshuffle=False)
    assert len(list(piped)) == 26


def test_arguments_webdataset_refuses_are_refused_with_its_error(shards):
    with pytest.raises(TypeError):
        fs.WebDataset(shards, shardshuffle=False, no_such_argument=1)
    with pytest.raises(TypeError):
        fs.WebDataset(["pipe:cat x.tar"], no_such_argument=1)



def test_a_state_saved_through_one_slice_does_not_load_into_another(shards):
    def make(stop):
        return fs.WebDataset(shards, shardshuffle=False).to_tuple("__key__").slice(1, stop)

    saved = make(9)
    it = iter(saved)
    next(it)
    state = saved.state_dict()
    make(9).load_state_dict(state)
    with pytest.raises(ValueError):
        make(10).load_state_dict(state)


def _not_json(name):
    return not name.endswith(".json")


def test_len_of_a_sliced_pipeline_is_not_claimed(shards):
    sliced = fs.ShardStream(shards).to_tuple("__key__").slice(5)
    with pytest.raises(TypeError, match="slice"):
        len(sliced)


@pytest.mark.parametrize("index", [False, "auto"])
def test_dropping_a_pipeline_frees_its_stages_at_once(shards, index):
    import gc
    import weakref

    from webdataset.utils import PipelineStage

    class Holder(PipelineStage):
        def run(self, src):
            yield from src

    holder = Holder()
    alive = weakref.ref(holder)
    pipeline = fs.ShardStream(shards, index=index).compose(holder)
    del holder
    gc.disable()
    try:
        assert len(list(pipeline)) == 26
        del pipeline
        assert alive() is None  # by reference counting, without the collector
    finally:
        gc.enable()


def test_select_files_pickles_for_spawned_workers(shards):
    import pickle

    for dataset in (fs.WebDataset(shards, shardshuffle=False, select_files=_not_json),
                    fs.DataPipeline(wds.SimpleShardList(shards),
                                    wds.tarfile_to_samples(select_files=_not_json))):
        assert list(pickle.loads(pickle.dumps(dataset))) == list(dataset)


def test_empty_check_counts_samples_read_not_items_left(shards):
    def make(m):
        return m.WebDataset(shards, shardshuffle=False).slice(100, 200)

    ours, theirs = _both(make)
    assert list(ours) == list(theirs) == []
    assert list(fs.WebDataset(shards, shardshuffle=False).select(lambda s: False)) == []
    # A stage that never reads its source: webdataset's check never runs, nor does ours.
    assert list(fs.WebDataset(shards, shardshuffle=False).compose(lambda src: iter(()))) == []


def test_a_seeded_shuffle_stage_after_batching_keeps_its_seed(shards):
    def make(m):
        return m.DataPipeline(wds.SimpleShardList(shards), wds.tarfile_to_samples(),
                              wds.to_tuple("__key__"), wds.batched(3),
                              wds.shuffle(5, seed=7))

    ours, theirs = _both(make)
    assert _items(ours) == _items(make(fs)) == _items(theirs)


def test_worker_split_before_node_split_runs_as_webdataset(shards):
    dataset = fs.DataPipeline(wds.SimpleShardList(shards), wds.split_by_worker,
                              wds.split_by_node, wds.tarfile_to_samples())
    assert not dataset.explain().accelerated and "comes before" in str(dataset.explain())


def test_append_and_stage_as_webdataset_has_them(shards):
    def make(m):
        dataset = m.DataPipeline(wds.SimpleShardList(shards), wds.tarfile_to_samples())
        dataset.append(wds.to_tuple("__key__"))
        return dataset

    ours, theirs = _both(make)
    assert _items(ours) == _items(theirs)
    with pytest.raises(TypeError, match="explain"):
        ours.stage(0)


def test_set_epoch_reaches_webdatasets_own_epoch_counting_stages(shards):
    urls = [f"pipe:cat {u}" for u in shards]
    loader = fs.WebLoader(fs.WebDataset(urls, shardshuffle=10, detshuffle=True, seed=3),
                          batch_size=None)
    firsts = []
    for epoch in (4, 4, 5):
        loader.set_epoch(epoch)
        firsts.append([s["__key__"] for s in loader])
    assert firsts[0] == firsts[1] != firsts[2]


def test_repeat_once_ignores_nbatches_as_webdataset(shards):
    def make(m):
        return m.WebDataset(shards, shardshuffle=False).to_tuple("__key__").repeat(1, 2)

    ours, theirs = _both(make)
    assert _items(ours) == _items(theirs) and len(_items(ours)) == 26
