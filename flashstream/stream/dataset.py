"""``ShardStream``: a drop-in ``IterableDataset`` over WebDataset tar shards."""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, Iterator, Optional, Union

from torch.utils.data import IterableDataset

from ..settings import IOSettings, resolve
from ..sizes import Size
from ..telemetry.board import StatsBoard
from .handlers import Handler, resolve_handler
from .samples import ReadStats, iter_samples
from .shuffle import rng_for, shuffle_buffer, shuffled
from .urls import Urls, expand_urls
from .world import current_world

__all__ = ["DEFAULT_SHUFFLE_BUFFER", "ShardStream"]

DEFAULT_SHUFFLE_BUFFER = 1000


@dataclasses.dataclass(frozen=True)
class _StreamConfig:
    shuffle_buffer: int
    shard_shuffle: bool
    seed: int
    split_by_rank: bool
    split_by_worker: bool

    def __post_init__(self) -> None:
        if self.shuffle_buffer < 0:
            raise ValueError(f"shuffle must be True, False or a buffer size >= 0, "
                             f"got {self.shuffle_buffer}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")


def _shuffle_config(shuffle: Union[bool, int]) -> tuple:
    if shuffle is True:
        return DEFAULT_SHUFFLE_BUFFER, True
    if shuffle is False or shuffle is None:
        return 0, False
    if isinstance(shuffle, int):
        return shuffle, shuffle > 0
    raise ValueError(f"shuffle must be True, False or a buffer size (int), got {shuffle!r}")


class ShardStream(IterableDataset):
    """Samples of WebDataset tar shards, read with aligned O_DIRECT requests kept in flight.

    Yields the same dicts as ``webdataset.WebDataset(urls, shardshuffle=False)`` when
    ``shuffle=False``: ``{"__key__", "__url__", "__local_path__", <ext>: bytes, ...}``.

    Args:
        urls: a shard path, a list of paths, a glob (``"data/*.tar"``) or a brace pattern
            (``"train-{000000..000099}.tar"``). Plain ``.tar`` and gzip/bzip2/xz compressed.
        shuffle: ``False`` keeps shard and sample order; ``True`` shuffles the shard order and
            passes samples through a buffer of 1000; an int sets that buffer size.
        seed: seed of the shard order and the buffer; each epoch (``set_epoch``) reshuffles.
        handler: what a bad shard does: ``"reraise"`` (default), ``"warn"`` or ``"ignore"``
            (skip the rest of that shard and go on), or a webdataset-style callable.
        split_by_rank, split_by_worker: give each rank, then each DataLoader worker, its own
            shards (rank from torch.distributed, else the RANK/WORLD_SIZE variables).
        engine, chunk_size, queue_depth, direct: reader settings; ``None`` takes the
            process-wide value (see ``flashstream.settings``).
    """

    def __init__(
        self,
        urls: Urls,
        *,
        shuffle: Union[bool, int] = False,
        seed: int = 0,
        handler: Union[str, Handler] = "reraise",
        split_by_rank: bool = True,
        split_by_worker: bool = True,
        engine: Optional[str] = None,
        chunk_size: Optional[Size] = None,
        queue_depth: Optional[int] = None,
        direct: Optional[bool] = None,
    ) -> None:
        super().__init__()
        self.urls = expand_urls(urls)
        buffer, shard_shuffle = _shuffle_config(shuffle)
        self.config = _StreamConfig(buffer, shard_shuffle, seed, split_by_rank, split_by_worker)
        self.handler = resolve_handler(handler)
        self._io = dict(engine=engine, chunk_size=chunk_size, queue_depth=queue_depth,
                        direct=direct)
        resolve(**self._io)  # validate now, not in a worker process later
        self.epoch = 0
        self.last_stats: Optional[ReadStats] = None
        # Made here, in the process that builds the stream, so DataLoader workers share it.
        self.board = StatsBoard()

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose shard order and shuffle buffer the next pass uses."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        self.epoch = epoch

    @property
    def io_settings(self) -> IOSettings:
        """The reader settings a pass started now would use."""
        return resolve(**self._io)

    def __iter__(self) -> Iterator[Dict]:
        config, world = self.config, current_world()
        shards = self.urls
        if config.shard_shuffle:
            shards = shuffled(shards, rng_for("shards", config.seed, self.epoch))
        mine = world.split(shards, by_rank=config.split_by_rank,
                           by_worker=config.split_by_worker)
        self.last_stats = ReadStats()
        if not mine:
            return iter(())
        samples = iter_samples(mine, self.io_settings, self.handler, self.last_stats,
                               on_end=functools.partial(self._record, world.worker))
        if config.shuffle_buffer > 1:
            rng = rng_for("buffer", config.seed, self.epoch, world.rank, world.worker)
            samples = shuffle_buffer(samples, config.shuffle_buffer, rng)
        return samples

    def _record(self, slot: int, stats: ReadStats) -> None:
        """When a pass ends (here or in a DataLoader worker), add it to the shared board."""
        self.board.add(slot, dict(stats.counters(), passes=1), stats.latency_counts)

    def stats(self) -> Dict[str, object]:
        """Counters and the merged request-latency histogram of the passes since the last
        ``reset_stats()``, summed over this process and its DataLoader workers."""
        return self.board.totals()

    def reset_stats(self) -> None:
        self.board.reset()

    def __repr__(self) -> str:
        return (f"ShardStream({len(self.urls)} shards, shuffle_buffer="
                f"{self.config.shuffle_buffer}, seed={self.config.seed}, epoch={self.epoch})")
