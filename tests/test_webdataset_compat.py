"""flashstream.WebDataset / DataPipeline / WebLoader against webdataset itself: the same
output for the chains real training scripts use, for 0, 1 and 2 DataLoader workers."""

from __future__ import annotations

import io
import json
import random
import tarfile

import numpy as np
import pytest
import torch
import webdataset as wds
from pipeline_check import flat
from torch.utils.data import DataLoader

import flashstream as fs

PIL = pytest.importorskip("PIL.Image")


def _image(rng: random.Random, fmt: str) -> bytes:
    size = (16, 12)  # one size: the README chain stacks decoded images
    pixels = np.random.default_rng(rng.randrange(1 << 30)).integers(
        0, 255, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    PIL.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def _write(path, samples):
    with tarfile.open(path, "w") as tar:
        for key, fields in samples:
            for ext, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


@pytest.fixture(scope="module")
def image_shards(tmp_path_factory):
    """4 shards of image samples: jpg or png, a caption (some empty), json metadata."""
    directory = tmp_path_factory.mktemp("images")
    rng = random.Random(0)
    urls = []
    for s in range(4):
        samples = []
        for i in range(7 + 2 * s):
            fmt = "jpg" if (s + i) % 3 else "png"
            caption = "" if (s * 7 + i) % 5 == 0 else f"a picture {s}-{i}"
            samples.append((f"shard{s}/img{i:03d}", {
                fmt: _image(rng, "JPEG" if fmt == "jpg" else "PNG"),
                "txt": caption.encode(),
                "json": json.dumps({"shard": s, "index": i}).encode()}))
        urls.append(_write(directory / f"images-{s:04d}.tar", samples))
    return urls


def loader_output(dataset, workers):
    return [flat(item) for item in DataLoader(dataset, batch_size=None, num_workers=workers)]


def readme_chain(module, urls):
    """webdataset's README example (its shuffle left out: webdataset's is random)."""
    return (module.WebDataset(urls, shardshuffle=False).decode("torchrgb")
            .to_tuple("jpg;png", "json").batched(3))


def has_caption(sample):
    return bool(sample.get("txt", b"").strip())


def preprocess(image):
    return torch.from_numpy(np.array(image.resize((8, 8)))).permute(2, 0, 1)


def tokenize(text):
    return torch.tensor([len(text), sum(map(ord, text)) % 997])


def open_clip_chain(module, urls):
    return (module.WebDataset(urls, shardshuffle=False)
            .select(has_caption).decode("pilrgb").rename(image="jpg;png;jpeg;webp", text="txt")
            .map_dict(image=preprocess, text=tokenize).to_tuple("image", "text")
            .batched(4, partial=True))


@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize("chain", [readme_chain, open_clip_chain])
def test_same_output_as_webdataset(image_shards, chain, workers):
    theirs = loader_output(chain(wds, image_shards), workers)
    ours = loader_output(chain(fs, image_shards), workers)
    assert len(ours) > 3 and ours == theirs


def test_readme_chain_with_sample_shuffle_has_the_same_samples(image_shards):
    def chain(module):
        return (module.WebDataset(image_shards, shardshuffle=False).shuffle(1000)
                .decode("torchrgb").to_tuple("__key__", "json"))

    ours = [flat(x) for x in chain(fs)]
    assert sorted(ours) == sorted(flat(x) for x in chain(wds))
    assert ours != sorted(ours)


def test_the_one_block_replacement_for_hand_built_pipelines(image_shards):
    """open_clip builds wds.DataPipeline(SimpleShardList, split_by_node, split_by_worker,
    tarfile_to_samples, ...): one flashstream source replaces that block."""
    stages = [wds.select(has_caption), wds.decode("pilrgb"),
              wds.rename(image="jpg;png", text="txt"),
              wds.map_dict(image=preprocess, text=tokenize), wds.to_tuple("image", "text"),
              wds.batched(4, partial=True)]
    theirs = wds.DataPipeline(wds.SimpleShardList(image_shards), wds.split_by_node,
                              wds.split_by_worker, wds.tarfile_to_samples(), *stages)
    ours = fs.DataPipeline(fs.WebDataset(image_shards, shardshuffle=False,
                                         nodesplitter=wds.split_by_node), *stages)
    for workers in (0, 2):
        assert loader_output(ours, workers) == loader_output(theirs, workers)
    shuffled = fs.DataPipeline(fs.WebDataset(image_shards, shardshuffle=True, seed=1),
                               wds.to_tuple("__key__"))
    first = [flat(x) for x in shuffled]
    shuffled.set_epoch(1)  # reaches the stream through the pipeline
    assert shuffled.stream.epoch == 1 and [flat(x) for x in shuffled] != first


def test_shard_level_stages_after_a_flashstream_source_run_as_in_webdataset(image_shards):
    """split_by_worker after the samples splits samples, in webdataset as here."""
    ours = fs.DataPipeline(fs.WebDataset(image_shards, shardshuffle=False), wds.split_by_worker)
    theirs = wds.DataPipeline(wds.WebDataset(image_shards, shardshuffle=False),
                              wds.split_by_worker)
    assert loader_output(ours, 2) == loader_output(theirs, 2)


@pytest.mark.parametrize("workers", [0, 2])
def test_resampled_is_reproducible_from_the_seed(image_shards, workers):
    def run(seed):
        dataset = fs.WebDataset(image_shards, resampled=True, seed=seed).to_tuple("__key__")
        return loader_output(dataset.with_epoch(30), workers)

    first, again, other = run(1), run(1), run(2)
    assert len(first) == 30 * max(1, workers)  # with_epoch counts per worker, as webdataset
    assert first == again and first != other
    assert len(set(first)) < len(first)  # drawn with replacement


def test_webdataset_arguments(image_shards, monkeypatch):
    with pytest.warns(UserWarning, match="shardshuffle"):
        fs.WebDataset(image_shards)
    with pytest.warns(UserWarning, match="ignored for resampled"):
        fs.WebDataset(image_shards, resampled=True, shardshuffle=100)
    # What flashstream cannot read is webdataset's own dataset, which says why.
    for url in ("pipe:curl -s http://host/a.tar", "https://host/a.tar", "s3://bucket/a.tar"):
        assert "not a local file" in str(fs.WebDataset(url, shardshuffle=False).explain())
    for kw, why in [(dict(nodesplitter=lambda src: src), "nodesplitter"),
                    (dict(rename_files=str.upper), "rename_files")]:
        dataset = fs.WebDataset(image_shards, shardshuffle=False, **kw)
        assert isinstance(dataset, wds.WebDataset) and why in str(dataset.explain())
    dataset = fs.WebDataset(image_shards, shardshuffle=False, cache_dir="/nonexistent",
                            detshuffle=True, verbose=True, repeat=True)
    assert len(list(dataset)) == sum(7 + 2 * s for s in range(4))
    picked = fs.WebDataset(image_shards, shardshuffle=False,
                           select_files=lambda name: not name.endswith(".json"))
    assert all("json" not in s and "txt" in s for s in picked)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="nodesplitter"):
        list(fs.WebDataset(image_shards, shardshuffle=False))
    split = fs.WebDataset(image_shards, shardshuffle=False, nodesplitter=wds.split_by_node)
    assert {s["__url__"] for s in split} == {image_shards[0], image_shards[2]}


def test_empty_check_as_webdataset(image_shards):
    few = image_shards[:1]
    with pytest.raises(ValueError, match="No samples found"):
        list(DataLoader(fs.WebDataset(few, shardshuffle=False), batch_size=None,
                        num_workers=2))
    quiet = fs.WebDataset(few, shardshuffle=False, empty_check=False)
    assert len(list(DataLoader(quiet, batch_size=None, num_workers=2))) == 7


def test_web_loader(image_shards):
    dataset = fs.WebDataset(image_shards, shardshuffle=True, seed=3).to_tuple("__key__")
    loader = fs.WebLoader(dataset, batch_size=None, num_workers=2)
    first = [flat(x) for x in loader]
    second = [flat(x) for x in loader]  # no set_epoch: the loader advanced it
    assert sorted(first) == sorted(second) and first != second and dataset.epoch == 1
    it = iter(loader)
    head = [flat(next(it)) for _ in range(5)]
    state = loader.state_dict()
    del it
    resumed = fs.WebLoader(fs.WebDataset(image_shards, shardshuffle=True, seed=3)
                           .to_tuple("__key__"), batch_size=None, num_workers=2)
    resumed.load_state_dict(state)
    assert head + [flat(x) for x in resumed] == [flat(x) for x in _epoch(image_shards, 2)]
    main_side = loader.map(lambda x: x)
    with pytest.raises(ValueError, match="main process"):
        main_side.state_dict()


def _epoch(urls, epoch, workers=2):
    dataset = fs.WebDataset(urls, shardshuffle=True, seed=3).to_tuple("__key__")
    dataset.set_epoch(epoch)
    return DataLoader(dataset, batch_size=None, num_workers=workers)


def test_lengths(image_shards):
    stream = fs.ShardStream(image_shards)  # sample plan: counts are known
    total = len(stream)
    assert len(stream.map(len).batched(4)) == -(-total // 4)
    assert len(stream.batched(4, partial=False)) == total // 4
    assert len(stream.tensors(5)) == -(-total // 5)
    assert len(stream.to_tuple("__key__").with_epoch(7)) == 7
    assert len(stream.map(len).listed(4).with_epoch(100)) == 100
    with pytest.raises(TypeError, match="select"):
        len(stream.select(has_caption))
    assert len(stream.select(has_caption).batched(4)) == -(-total // 4)  # blocks are fixed
    with pytest.warns(UserWarning, match="with_length"):
        assert len(stream.select(has_caption).with_length(3)) == 3
    with pytest.raises(TypeError, match="no length"):
        len(fs.WebDataset(image_shards, shardshuffle=False).batched(4))
    assert len(fs.WebDataset(image_shards, shardshuffle=False).with_length(9, silent=True)) == 9


def test_resampled_ranks_and_workers_draw_their_own_shards(image_shards, monkeypatch):
    def draws(rank, workers=0, **kw):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        dataset = fs.WebDataset(image_shards, resampled=True, seed=1, nodesplitter=None,
                                **kw).to_tuple("__key__").with_epoch(12)
        return loader_output(dataset, workers)

    assert draws(0) != draws(1)  # unsplit ranks still draw independently
    both = draws(0, workers=2, workersplitter=None)
    assert both[0::2] != both[1::2]  # so do unsplit workers


def test_web_loader_resumed_after_a_finished_epoch_moves_on(image_shards):
    def make():
        return fs.WebLoader(fs.WebDataset(image_shards, shardshuffle=True, seed=3)
                            .to_tuple("__key__"), batch_size=None, num_workers=1)

    loader = make()
    epoch0 = [flat(x) for x in loader]
    state = loader.state_dict()  # taken after the whole epoch 0
    resumed = make()
    resumed.load_state_dict(state)
    following = [flat(x) for x in resumed]
    assert resumed.dataset.epoch == 1 and following != epoch0
    assert following == [flat(x) for x in _epoch(image_shards, 1, workers=1)]


def test_a_shuffled_epoch_repeated_without_set_epoch_warns_once(image_shards, monkeypatch):
    import warnings

    import flashstream.stream.handoff as handoff_module

    monkeypatch.setattr(handoff_module, "_REPEAT_WARNED", False)
    stream = fs.ShardStream(image_shards, shuffle=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        list(stream)
        stream.set_epoch(1)
        list(stream)
        assert not caught  # each epoch set: no warning
        list(stream)
        list(stream)
    assert len([w for w in caught if "set_epoch" in str(w.message)]) == 1
    monkeypatch.setattr(handoff_module, "_REPEAT_WARNED", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = fs.ShardStream(image_shards)  # no shuffling: the same order is expected
        list(plain)
        list(plain)
    assert not caught
