"""One-name swaps for webdataset: ``WebDataset``, ``DataPipeline``, ``WebLoader``.

``flashstream.WebDataset(urls, **webdataset_kwargs)`` takes every argument of
``webdataset.WebDataset`` and yields the same samples for any number of DataLoader workers
(shards are split by rank and worker as webdataset splits them), read by flashstream's engine;
the fluid methods and ``with_epoch`` work as in webdataset, and resume exactly (all but
opaque stages, which resume as if they held nothing). What the engine cannot read runs as
webdataset's own (flashstream/pipeline/fallback.py). docs/migrating.md lists each argument and
method with what flashstream does with it.
"""

from __future__ import annotations

import inspect
import logging
import os
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple
from urllib.parse import urlparse

import webdataset as wds
import webdataset.filters as wf
import webdataset.shardlists as ws
from braceexpand import braceexpand

from ..stream.dataset import ShardSource
from ..stream.state import find_states, finished
from ..stream.urls import Urls
from .fallback import WebdatasetDataset, WebdatasetPipeline
from .pipeline import Pipeline
from .recognise import local_urls_reason, recognise
from .shard_stream import ShardStream
from .stages import Each

__all__ = ["DataPipeline", "WebDataset", "WebLoader"]

log = logging.getLogger(__name__)

_NODE_SPLITTERS = {ws.split_by_node: True, ws.single_node_only: False, None: False}
_WORKER_SPLITTERS = {ws.split_by_worker: True, None: False, False: False}
#: Arguments of ShardStream that webdataset's reader has no use for (fallback: noted).
_FLASHSTREAM_ONLY = tuple(p for p in inspect.signature(ShardSource.__init__).parameters
                          if p not in ("self", "urls", "seed", "handler", "shuffle"))


def _splitter(value: Any, table: Dict[Any, bool]) -> Optional[bool]:
    """The flashstream split a webdataset splitter stands for (None: one it cannot map)."""
    try:
        return table[value]
    except (KeyError, TypeError):
        return None


def _candidate_urls(urls: Any) -> List[str]:
    """The shard urls webdataset would read, as far as their form tells (for the check that
    they are local files; expansion proper is the stream's)."""
    items = [urls] if isinstance(urls, (str, os.PathLike)) else list(urls)
    out: List[str] = []
    for item in items:
        text = os.fspath(item) if isinstance(item, (str, os.PathLike)) else item
        if not isinstance(text, str):
            out.append(text)
            continue
        out.extend(name for part in text.split("::") for name in braceexpand(part))
    return out


def _fallback_reason(urls: Any, *, nodesplitter: Any, workersplitter: Any,
                     rename_files: Any) -> str:
    """Why flashstream.WebDataset(urls, ...) must run as webdataset's own ('' if it need
    not)."""
    if isinstance(urls, dict) or (isinstance(urls, str) and urls.endswith((".yaml", ".yml"))):
        return "a YAML/dict multi-source spec (webdataset's MultiShardSample)"
    if isinstance(urls, str) and urls.endswith(".json"):
        return "a .json shard spec"
    if isinstance(urls, str) and urlparse(urls).path.endswith("/"):
        return ("a directory url (webdataset's DirectoryShardList, which renames the files it "
                "reads); pass a glob of its shards to read them with flashstream")
    try:
        candidates = _candidate_urls(urls)
    except TypeError:
        return f"urls of type {type(urls).__name__}"
    reason = local_urls_reason(candidates)
    if reason:
        return reason
    if _splitter(nodesplitter, _NODE_SPLITTERS) is None:
        return (f"nodesplitter={getattr(nodesplitter, '__name__', nodesplitter)!r} (flashstream "
                f"maps wds.split_by_node, wds.single_node_only and None)")
    if _splitter(workersplitter, _WORKER_SPLITTERS) is None:
        return (f"workersplitter={getattr(workersplitter, '__name__', workersplitter)!r} "
                f"(flashstream maps wds.split_by_worker and None)")
    if rename_files is not None:
        return ("rename_files renames members before they are grouped, which flashstream's "
                "C++ scanner does not do")
    return ""


def _shard_shuffle(shardshuffle: Any, resampled: bool) -> bool:
    """webdataset's shardshuffle (and its warnings) as flashstream's on/off shard shuffle."""
    if resampled:
        if shardshuffle not in (False, None):
            warnings.warn("WebDataset(shardshuffle=...) is ignored for resampled datasets",
                          stacklevel=4)
        return False
    if shardshuffle is None:
        warnings.warn("WebDataset(shardshuffle=...) is None; set explicitly to False or a "
                      "number", stacklevel=4)
        return False
    if isinstance(shardshuffle, bool):
        return shardshuffle
    if not isinstance(shardshuffle, int) or shardshuffle < 0:
        raise ValueError(f"shardshuffle must be None, a bool or an int >= 0, got "
                         f"{shardshuffle!r}")
    return shardshuffle > 0


class _Selected:
    """webdataset's select_files on a grouped sample: keep the fields whose member name
    (``key.ext``, the extension lowercased) it selects; a sample left empty is dropped. A
    class, not a closure, so spawned DataLoader workers can unpickle it."""

    def __init__(self, select_files: Callable[[str], bool]) -> None:
        self.select_files = select_files

    def __call__(self, sample: Dict) -> Optional[Dict]:
        key = sample["__key__"]
        out = {k: v for k, v in sample.items()
               if k.startswith("__") or self.select_files(f"{key}.{k}")}
        return out if any(not k.startswith("__") for k in out) else None


def _select_stage(select_files: Any) -> Tuple[Each, ...]:
    if select_files is None:
        return ()
    return (Each(wf.map(_Selected(select_files)), "select_files", drops=True),)


class WebDataset(Pipeline):
    """``webdataset.WebDataset``'s arguments, flashstream's reader (see the module docstring).

    flashstream-only keywords (``index``, ``engine``, ``chunk_size``, ``queue_depth``,
    ``direct``, ``lanes``, ``equal_ranks``, ...) go to :class:`~flashstream.ShardStream`.
    The default ``index=False`` splits shards by rank and worker as webdataset does, so the
    order depends on the number of workers exactly as webdataset's; ``index="auto"`` gives
    flashstream's order, the same for any number of workers.

    What flashstream cannot read (``pipe:`` and remote urls, YAML specs, a directory url, a
    custom splitter, ``rename_files``) is not refused: the call returns webdataset's own
    ``WebDataset`` (with ``explain()``), and the first such build logs one line saying so.
    """

    def __new__(cls, *args: Any, **kw: Any) -> Any:
        if not args and "urls" not in kw:  # copy / unpickle: an instance of this class
            return super().__new__(cls)
        bound = _WDS_SIGNATURE.bind_partial(*args, **{k: v for k, v in kw.items()
                                                       if k in _WDS_SIGNATURE.parameters})
        bound.apply_defaults()
        given = dict(bound.arguments)
        if isinstance(given["urls"], Iterator):  # read once here: checked, then used
            given["urls"] = list(given["urls"])
        reason = _fallback_reason(given["urls"], nodesplitter=given["nodesplitter"],
                                  workersplitter=given["workersplitter"],
                                  rename_files=given["rename_files"])
        if not reason:
            made = super().__new__(cls)
            made._given_urls = given["urls"]
            return made
        ours = [k for k in kw if k in _FLASHSTREAM_ONLY and k not in _WDS_SIGNATURE.parameters]
        unknown = {k: v for k, v in kw.items() if k not in ours and k not in given}
        return WebdatasetDataset(reason=reason, ignored=ours, **given, **unknown)

    def __init__(self, urls: Urls, handler: Any = wds.reraise_exception, mode: Optional[str] = None,
                 resampled: bool = False, repeat: bool = False, shardshuffle: Any = None,
                 cache_size: int = -1, cache_dir: Optional[str] = None,
                 url_to_name: Any = None, detshuffle: bool = False,
                 nodesplitter: Any = ws.single_node_only,
                 workersplitter: Any = ws.split_by_worker, select_files: Any = None,
                 rename_files: Any = None, empty_check: bool = True, verbose: bool = False,
                 seed: Optional[int] = None, **flashstream_kw: Any) -> None:
        urls = self.__dict__.pop("_given_urls", urls)  # an iterator was read by __new__
        resampled = bool(resampled) or mode == "resampled"
        if cache_dir is not None or cache_size not in (-1, 0):
            log.debug("cache_dir/cache_size ignored: flashstream reads local shards directly")
        if seed is None:
            seed = int(os.environ.get("WDS_SEED", 0))  # deterministic, so a resume matches
        flashstream_kw.setdefault("index", False)
        stream = ShardStream(urls, shuffle=False,
                             shard_shuffle=_shard_shuffle(shardshuffle, resampled),
                             seed=seed, handler=handler,
                             split_by_rank=_splitter(nodesplitter, _NODE_SPLITTERS),
                             split_by_worker=_splitter(workersplitter, _WORKER_SPLITTERS),
                             resampled=resampled, **flashstream_kw)
        stream.single_node = nodesplitter is ws.single_node_only
        super().__init__(stream, _select_stage(select_files), empty_check=empty_check,
                         origin=("WebDataset",))


#: webdataset.WebDataset's own parameters (what the fallback passes on to it).
_WDS_SIGNATURE = inspect.signature(wds.WebDataset)


def DataPipeline(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 - webdataset's name
    """``webdataset.DataPipeline(*stages)``: accepts whatever webdataset's accepts.

    - A flashstream source first (a ShardStream, flashstream.WebDataset or pipeline): the
      stages are composed onto it and resume exactly.
    - A shard block first (``SimpleShardList`` / ``ResampledShards`` of local shards, then
      ``split_by_node`` / ``single_node_only`` / ``split_by_worker`` / a shard shuffle, then
      ``tarfile_to_samples``): flashstream's O_DIRECT stream replaces it; the stages after it
      are composed onto that stream.
    - Anything else runs through webdataset's own code (``explain()`` says why), and the first
      such build in a process logs one line saying so.

    ``kwargs`` are accepted and ignored, as webdataset does.
    """
    flat = [a for arg in args if arg is not None
            for a in (arg if isinstance(arg, list) else [arg])]
    if flat and isinstance(flat[0], (ShardSource, Pipeline)):
        source, stages = flat[0], flat[1:]
        pipeline = source if isinstance(source, Pipeline) else Pipeline(source)
        return pipeline.compose(*stages) if stages else pipeline._compose()
    block = recognise(flat)
    if isinstance(block, str):
        return WebdatasetPipeline(*args, reason=block)
    stream = ShardStream(list(block.urls), shuffle=False, shard_shuffle=block.shard_shuffle,
                         seed=block.seed, handler=block.handler,
                         split_by_rank=block.split_by_rank,
                         split_by_worker=block.split_by_worker, resampled=block.resampled,
                         index=False)
    stream.single_node = block.single_node
    # webdataset's url_opener gives no local path: its samples have no __local_path__.
    stages = _select_stage(block.select_files) + (
        Each(wf.map(_without_local_path), "tarfile_to_samples"),)
    pipeline = Pipeline(stream, stages, origin=block.names)
    rest = flat[block.length:]
    return pipeline.compose(*rest) if rest else pipeline


def _without_local_path(sample: Dict) -> Dict:
    sample.pop("__local_path__", None)
    return sample


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
        self.dataset.set_epoch(epoch)  # webdataset's own datasets too (see fallback.py)

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
