"""One-name swaps for webdataset: ``WebDataset``, ``DataPipeline``, ``WebLoader``.

``flashstream.WebDataset(urls, **webdataset_kwargs)`` takes every argument of
``webdataset.WebDataset`` and yields the same samples for any number of DataLoader workers
(shards are split by rank and worker as webdataset splits them), read by flashstream's engine;
the fluid methods and ``with_epoch`` work as in webdataset, and everything resumes exactly.
docs/migrating.md lists each argument and method with what flashstream does with it.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Callable, Dict, Iterator, Optional
from urllib.parse import urlparse

import webdataset as wds
import webdataset.filters as wf
import webdataset.shardlists as ws

from ..stream.dataset import ShardStream
from ..stream.state import find_states, finished
from ..stream.urls import Urls
from .pipeline import Pipeline
from .stages import Each, shard_level_stage

__all__ = ["DataPipeline", "WebDataset", "WebLoader"]

log = logging.getLogger(__name__)

_NODE_SPLITTERS = {ws.split_by_node: True, ws.single_node_only: False, None: False}
_WORKER_SPLITTERS = {ws.split_by_worker: True, None: False, False: False}


def _splitter(value: Any, table: Dict[Any, bool], name: str, allowed: str) -> bool:
    try:
        return table[value]
    except (KeyError, TypeError):
        raise ValueError(f"{name}={value!r} is not supported: flashstream splits shards itself; "
                         f"use one of {allowed}") from None


def _check_urls(urls: Any) -> None:
    """webdataset's url forms that are not shard lists, with what to do instead."""
    if isinstance(urls, dict) or (isinstance(urls, str) and urls.endswith((".yaml", ".yml"))):
        raise ValueError("flashstream.WebDataset takes shard urls (a path, glob, brace pattern "
                         "or list); webdataset's YAML/dict multi-source specs are not supported: "
                         "build one dataset per source")
    if isinstance(urls, str) and urlparse(urls).path.endswith("/"):
        raise ValueError(f"{urls!r} is a directory: pass a glob of its shards, e.g. "
                         f"{urls + '*.tar'!r}")


def _shard_shuffle(shardshuffle: Any, resampled: bool) -> bool:
    """webdataset's shardshuffle (and its warnings) as flashstream's on/off shard shuffle."""
    if resampled:
        if shardshuffle not in (False, None):
            warnings.warn("WebDataset(shardshuffle=...) is ignored for resampled datasets",
                          stacklevel=3)
        return False
    if shardshuffle is None:
        warnings.warn("WebDataset(shardshuffle=...) is None; set explicitly to False or a "
                      "number", stacklevel=3)
        return False
    if isinstance(shardshuffle, bool):
        return shardshuffle
    if not isinstance(shardshuffle, int) or shardshuffle < 0:
        raise ValueError(f"shardshuffle must be None, a bool or an int >= 0, got "
                         f"{shardshuffle!r}")
    return shardshuffle > 0


def _selected(select_files: Callable[[str], bool]) -> Callable[[Dict], Optional[Dict]]:
    """webdataset's select_files on a grouped sample: keep the fields whose member name
    (``key.ext``, the extension lowercased) it selects; a sample left empty is dropped."""

    def keep(sample: Dict) -> Optional[Dict]:
        key = sample["__key__"]
        out = {k: v for k, v in sample.items()
               if k.startswith("__") or select_files(f"{key}.{k}")}
        return out if any(not k.startswith("__") for k in out) else None

    return keep


class WebDataset(Pipeline):
    """``webdataset.WebDataset``'s arguments, flashstream's reader (see the module docstring).

    flashstream-only keywords (``index``, ``engine``, ``chunk_size``, ``queue_depth``,
    ``direct``, ``lanes``, ``equal_ranks``, ...) go to :class:`~flashstream.ShardStream`.
    The default ``index=False`` splits shards by rank and worker as webdataset does, so the
    order depends on the number of workers exactly as webdataset's; ``index="auto"`` gives
    flashstream's order, the same for any number of workers.
    """

    def __init__(self, urls: Urls, handler: Any = wds.reraise_exception, mode: Optional[str] = None,
                 resampled: bool = False, repeat: bool = False, shardshuffle: Any = None,
                 cache_size: int = -1, cache_dir: Optional[str] = None,
                 url_to_name: Any = None, detshuffle: bool = False,
                 nodesplitter: Any = ws.single_node_only,
                 workersplitter: Any = ws.split_by_worker, select_files: Any = None,
                 rename_files: Any = None, empty_check: bool = True, verbose: bool = False,
                 seed: Optional[int] = None, **flashstream_kw: Any) -> None:
        _check_urls(urls)
        if mode not in (None, "resampled"):
            raise ValueError(f"mode must be None or 'resampled', got {mode!r}")
        resampled = bool(resampled) or mode == "resampled"
        if rename_files is not None:
            raise ValueError("rename_files is not supported (flashstream groups members in its "
                             "C++ scanner): rename fields with .rename() or .map()")
        if cache_dir is not None or cache_size not in (-1, 0):
            log.debug("cache_dir/cache_size ignored: flashstream reads local shards directly")
        if seed is None:
            seed = int(os.environ.get("WDS_SEED", 0))  # deterministic, so a resume matches
        split_by_rank = _splitter(nodesplitter, _NODE_SPLITTERS, "nodesplitter",
                                  "wds.split_by_node, wds.single_node_only or None")
        split_by_worker = _splitter(workersplitter, _WORKER_SPLITTERS, "workersplitter",
                                    "wds.split_by_worker or None")
        flashstream_kw.setdefault("index", False)
        stream = ShardStream(urls, shuffle=False,
                             shard_shuffle=_shard_shuffle(shardshuffle, resampled),
                             seed=seed, handler=handler, split_by_rank=split_by_rank,
                             split_by_worker=split_by_worker, resampled=resampled,
                             **flashstream_kw)
        stream.single_node = nodesplitter is ws.single_node_only
        stages = ()
        if select_files is not None:
            stages = (Each(wf.map(_selected(select_files)), "select_files", drops=True),)
        super().__init__(stream, stages, empty_check=empty_check)

    def __enter__(self) -> WebDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def DataPipeline(*args: Any) -> Pipeline:  # noqa: N802 - webdataset's name
    """``webdataset.DataPipeline(source, stage, ...)`` with a flashstream source first (a
    ShardStream, flashstream.WebDataset or pipeline); the stages (``wds.map(f)``,
    ``wds.batched(16)``, any iterator function) are composed onto it and resume exactly.
    webdataset's shard-level stages (shard lists, split_by_node, split_by_worker,
    tarfile_to_samples) are what the source replaces: see docs/migrating.md."""
    flat = [a for arg in args if arg is not None
            for a in (arg if isinstance(arg, list) else [arg])]
    if not flat:
        raise ValueError("DataPipeline needs a source")
    source, stages = flat[0], flat[1:]
    if not isinstance(source, (ShardStream, Pipeline)):
        name = shard_level_stage(source) or type(source).__name__
        raise ValueError(
            f"flashstream.DataPipeline starts with a flashstream source, not {name}: replace the "
            f"block of shard list, split_by_node, split_by_worker and tarfile_to_samples with "
            f"one flashstream.WebDataset(urls, ...) (or ShardStream), then keep your stages")
    return source.compose(*stages) if stages else source._compose()


class WebLoader(wds.DataPipeline, wds.FluidInterface):
    """``webdataset.WebLoader``: a DataLoader (torchdata's ``StatefulDataLoader`` where it is
    installed, so the loader's ``state_dict()`` resumes exactly) with the fluid methods, whose
    stages run in the main process over the loader's items, as webdataset's do.

    ``set_epoch(epoch)`` reaches the dataset; when it is not called between two epochs, each
    new pass over the loader advances the dataset's epoch itself, so every epoch has a new
    order (as webdataset's random shuffles do)."""

    def __init__(self, dataset: Any, *args: Any, **kw: Any) -> None:
        try:
            from torchdata.stateful_dataloader import StatefulDataLoader as Loader
        except ImportError:
            from torch.utils.data import DataLoader as Loader
        super().__init__(Loader(dataset, *args, **kw))
        self.loader = self.pipeline[0]
        self.dataset = dataset
        self._last_epoch: Optional[int] = None  # the epoch the last pass used

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        epoch = getattr(self.dataset, "epoch", None)
        if epoch is not None and hasattr(self.dataset, "set_epoch"):
            if self._last_epoch is not None and epoch == self._last_epoch:
                epoch += 1
                self.dataset.set_epoch(epoch)
            self._last_epoch = epoch
        return super().__iter__()

    def __len__(self) -> int:
        if len(self.pipeline) > 1:
            raise TypeError("a WebLoader with stages has no length (they may change the count)")
        return len(self.loader)

    def _stateful(self) -> Any:
        if len(self.pipeline) > 1:
            raise ValueError("stages added to a WebLoader run in the main process over the "
                             "loader's items and are not resumable: add them to the dataset "
                             "instead (they then run in the workers and resume exactly)")
        if not hasattr(self.loader, "state_dict"):
            raise ValueError("resuming a WebLoader needs torchdata (pip install torchdata)")
        return self.loader

    def state_dict(self) -> Dict[str, Any]:
        return self._stateful().state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._stateful().load_state_dict(state)
        found = find_states(state)
        if found:  # the epoch the loader resumes: the next pass continues it, unless it ended
            epoch = found[0]["epoch"]
            self.dataset.set_epoch(epoch)
            ended = bool(state.get("_iterator_finished")) or all(finished(s) for s in found)
            self._last_epoch = epoch if ended else None
