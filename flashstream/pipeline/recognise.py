"""Recognising the shard block at the head of a webdataset pipeline.

webdataset pipelines start with a block that lists shards, splits them, opens them and groups
their members into samples::

    wds.DataPipeline(wds.SimpleShardList(urls) | wds.ResampledShards(urls),
                     [wds.split_by_node | wds.single_node_only], [wds.split_by_worker],
                     [wds.shuffle(n) | wds.detshuffle(n)],   # of shards, anywhere in the block
                     wds.tarfile_to_samples(handler=..., select_files=...) | wds.tarfile_samples,
                     stages...)

:func:`recognise` reads such a block into the settings of one flashstream source (which reads
the same shards with O_DIRECT and resumes exactly), or says why it cannot: then the whole
pipeline runs through webdataset's own code (see ``flashstream.pipeline.fallback``).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union
from urllib.parse import urlparse

import webdataset.filters as wf
import webdataset.shardlists as ws
import webdataset.tariterators as wt

from ..stream.handlers import Handler

__all__ = ["ShardBlock", "local_urls_reason", "recognise"]


@dataclasses.dataclass(frozen=True)
class ShardBlock:
    """The settings of the flashstream source that replaces a pipeline's first ``length``
    stages (named in ``names``)."""

    urls: Tuple[str, ...]
    resampled: bool
    shard_shuffle: bool
    seed: int
    split_by_rank: bool
    split_by_worker: bool
    single_node: bool
    handler: Handler
    select_files: Optional[Callable[[str], bool]]
    length: int
    names: Tuple[str, ...]


def local_urls_reason(urls: Sequence[str]) -> str:
    """Why these urls cannot be read by flashstream's O_DIRECT engine ('' when they can): only
    local files (plain paths, ``file://``) can."""
    for url in urls:
        if not isinstance(url, str):
            return f"the shard list holds a {type(url).__name__}, not a url string"
        scheme = urlparse(url).scheme
        if scheme not in ("", "file") and len(scheme) != 1:
            return (f"{url!r} is not a local file ({scheme}: urls are read through "
                    f"webdataset's own opener; O_DIRECT reads local drives)")
    return ""


def _name(stage: Any) -> str:
    target = stage.f if isinstance(stage, wf.FilterFunction) else stage
    return getattr(target, "__name__", type(target).__name__)


def _head(source: Any) -> Union[Tuple[List[str], bool, int], str]:
    """The urls of a shard list in the order webdataset yields them, whether they are drawn
    with replacement, and the seed; or why the source is not a shard list."""
    if isinstance(source, ws.ResampledShards):
        if source.nshards != sys.maxsize:
            return (f"ResampledShards(nshards={source.nshards}) draws a fixed number of "
                    f"shards; flashstream's draws are endless (cut epochs with with_epoch)")
        seed = source.seed if isinstance(source.seed, int) else 0
        return list(source.urls), True, seed
    if type(source) is ws.SimpleShardList:
        # Its own iteration gives the order (a seeded SimpleShardList shuffles its urls).
        return [entry["url"] for entry in source], False, 0
    return (f"the source is {type(source).__name__}, not a shard list flashstream reads "
            f"(SimpleShardList, ResampledShards)")


def _tar_stage(stage: Any) -> Optional[dict]:
    """The keyword arguments of a tar expansion stage, or None when ``stage`` is not one."""
    if stage is wt.tarfile_samples:
        return {}
    if isinstance(stage, wf.FilterFunction) and stage.f is wt.tarfile_samples:
        names = ("handler", "select_files", "rename_files")
        return dict(zip(names, stage.args), **stage.kw)
    return None


def recognise(stages: Sequence[Any]) -> Union[ShardBlock, str]:
    """The shard block at the head of ``stages`` (see the module docstring), or the reason
    the pipeline is not accelerated."""
    if not stages:
        return "the pipeline is empty"
    head = _head(stages[0])
    if isinstance(head, str):
        return head
    urls, resampled, seed = head
    if not urls:
        return "the shard list is empty"
    reason = local_urls_reason(urls)
    if reason:
        return reason
    flags = {"split_by_node": False, "single_node_only": False, "split_by_worker": False,
             "shuffle": False, "shuffled": False}
    names = [type(stages[0]).__name__]
    for i, stage in enumerate(stages[1:], start=1):
        tar = _tar_stage(stage)
        if tar is not None:
            if tar.get("rename_files") is not None:
                return ("tarfile_to_samples(rename_files=...) renames members before they are "
                        "grouped, which flashstream's C++ scanner does not do")
            extra = set(tar) - {"handler", "select_files", "rename_files"}
            if extra:
                return f"tarfile_to_samples got arguments flashstream does not map: {extra}"
            names.append(_name(stage))
            return ShardBlock(
                tuple(urls), resampled, flags["shuffled"], seed, flags["split_by_node"],
                flags["split_by_worker"], flags["single_node_only"],
                tar.get("handler") or wf.reraise_exception, tar.get("select_files"), i + 1,
                tuple(names))
        key = _shard_stage(stage)
        if key == "shuffle":
            size, shuffle_seed = _shuffle_settings(stage)
            flags["shuffled"] = size > 1
            seed = shuffle_seed if shuffle_seed is not None else seed
        if key is None:
            return (f"{_name(stage)} comes between the shard list and tarfile_to_samples; "
                    f"flashstream maps only split_by_node, single_node_only, split_by_worker "
                    f"and a shard shuffle there")
        if flags[key]:
            return f"{key} appears twice in the shard block"
        if key in ("split_by_node", "single_node_only") and flags["split_by_worker"]:
            return (f"split_by_worker comes before {key}: flashstream splits shards by rank "
                    f"first, then by worker, so it would give each rank other shards")
        flags[key] = True
        names.append(_name(stage))
    return "no tarfile_to_samples stage turns the shard list into samples"


def _shard_stage(stage: Any) -> Optional[str]:
    """Which shard-level stage ``stage`` is (a key of recognise's flags), or None."""
    for known in (ws.split_by_node, ws.single_node_only, ws.split_by_worker):
        if stage is known:
            return known.__name__
    if isinstance(stage, wf.detshuffle):
        return "shuffle"
    if isinstance(stage, wf.FilterFunction) and stage.f is wf._shuffle:
        return "shuffle"
    return None


def _shuffle_settings(stage: Any) -> Tuple[int, Optional[int]]:
    """A shard shuffle's buffer size and seed (None: no seed of its own)."""
    if isinstance(stage, wf.detshuffle):
        seed = stage.seed if isinstance(stage.seed, int) else None
        return int(stage.bufsize), seed
    bound = dict(zip(("bufsize", "initial", "rng", "seed"), stage.args), **stage.kw)
    seed = bound.get("seed")
    return int(bound.get("bufsize", 1000)), seed if isinstance(seed, int) else None
