"""``ShardSource``: an ``IterableDataset`` over WebDataset tar shards, resumable.

It is the stream layer's part of ``flashstream.ShardStream`` (which adds webdataset's fluid
methods, in the pipeline layer), and the source every pipeline builds on through a small
public interface: ``derive``, ``open_pass``, ``attach``, ``sequence_length``, ``world``,
``follow_main_epoch``, ``plan``, ``config`` and ``resumed``. It knows nothing of the stages
above it.

Longer than the house's ~400 lines, for a reason: it is one class whose methods are the
stream's documented API (and about a tenth of it is that documentation). What owns a thing of
its own lives beside it: the configuration (config.py), the resume hand-off to DataLoader
workers (handoff.py), the passes (passes.py), the plans (plan.py) and the states (state.py).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, TypeVar, Union

from torch.utils.data import IterableDataset

from ..settings import IOSettings, resolve
from ..sizes import Size
from ..telemetry.board import StatsBoard
from ..world import World, current_world, dataloader_worker, in_worker, job_rank
from .config import DEFAULT_SHUFFLE_BUFFER, StreamConfig, equal_rule, shuffle_config
from .handlers import Handler, resolve_handler
from .handoff import Handoff
from .index import ShardIndex, load_index
from .passes import PassContext, SamplePass, ShardPass
from .plan import DEFAULT_LANES, RankPlan, order_key, rank_plan, shard_order
from .samples import ReadStats
from .shuffle import ShardDraws
from .state import (
    Delivered,
    Identity,
    check_state,
    find_states,
    finished,
    merge_states,
    nested_dicts,
    new_state,
    shard_digest,
    shard_entry,
    worker_cursor,
)
from .urls import Urls, expand_urls, local_path

__all__ = ["DEFAULT_SHUFFLE_BUFFER", "ShardSource"]

#: Resampled shards are read this many draws per reader (the draws are endless).
RESAMPLED_WINDOW = 64

_S = TypeVar("_S", bound="ShardSource")


def _snapshot_steps(obj: Any) -> int:
    """The largest ``_steps_since_snapshot`` of the StatefulDataLoader states in ``obj``."""
    steps = (found.get("_steps_since_snapshot") for found in nested_dicts(obj))
    return max((n for n in steps if isinstance(n, int) and not isinstance(n, bool)), default=0)


def _record(board: StatsBoard, slot: int, generation: int, stats: ReadStats) -> None:
    """When a pass ends (here or in a DataLoader worker), add it to the shared board, if no
    ``reset_stats()`` came since it started. Not while the interpreter shuts down (a pass left
    unfinished is closed then, with builtins gone)."""
    if sys.is_finalizing():
        return
    board.add(slot, dict(stats.counters(), passes=1), stats.latency_counts, generation)


def _plan_of(cache: Dict[tuple, RankPlan], index: List[ShardIndex], config: StreamConfig,
             epoch: int, world: World, repeat: int = 0) -> RankPlan:
    """The rank's plan of ``epoch`` (or of a pipeline's repetition of it), kept in ``cache``."""
    key = (epoch, repeat, world.world_size, world.rank)
    if key not in cache:
        if len(cache) > 4:  # an epoch's plan, and the repetitions in flight
            cache.clear()
        order = shard_order(len(index), shuffle=config.shard_shuffle, seed=config.seed,
                            epoch=order_key(epoch, repeat))
        cache[key] = rank_plan([ix.count for ix in index], order, world_size=world.world_size,
                               rank=world.rank, equal=config.equal_ranks)
    return cache[key]


class ShardSource(IterableDataset):
    """Samples of WebDataset tar shards, read with aligned O_DIRECT requests kept in flight.

    Yields the same dicts as ``webdataset.WebDataset(urls, shardshuffle=False)`` when
    ``shuffle=False``: ``{"__key__", "__url__", "__local_path__", <ext>: bytes, ...}``.
    ``state_dict()`` / ``load_state_dict()`` resume mid-epoch exactly (see
    docs/shardstream.md for the order and resume guarantees). ``index_info`` says where the
    index came from: how many shards from a ``sidecar``, the ``cache`` or a ``scan``, the
    ``seconds`` it took, the ``bytes_read`` for it, and ``by_source``: per source the shards,
    bytes read and seconds (a scan reads the shards; a sidecar or the cache, small files).

    Args:
        urls: a shard path, a list of paths, a glob (``"data/*.tar"``) or a brace pattern
            (``"train-{000000..000099}.tar"``). Plain ``.tar`` and gzip/bzip2/xz compressed.
        shuffle: ``False`` keeps shard and sample order; ``True`` shuffles the shard order and
            passes samples through a buffer of 1000; an int sets that buffer size.
        seed: seed of the shard order and the buffer; each epoch (``set_epoch``) reshuffles.
        handler: what a bad shard does: ``"reraise"`` (default), ``"warn"`` or ``"ignore"``
            (skip the rest of that shard and go on), or a webdataset-style callable.
        split_by_rank, split_by_worker: give each rank, then each DataLoader worker, its own
            share (rank from torch.distributed, else the RANK/WORLD_SIZE variables).
        equal_ranks: ``True`` or ``"drop"``: every rank delivers ``total // world_size``
            samples per epoch (the rest of the epoch's sequence is dropped); ``"repeat"``:
            ``ceil(total / world_size)``, the last rank's share continuing from the start.
            Needs the shards' sample counts (an index, scanned if there is no sidecar).
        index: ``"auto"`` (default) or ``True``: know every shard's samples, from its
            ``SHARD.fsidx`` sidecar (``flashstream index``), else from the index cache
            (``FLASHSTREAM_INDEX_CACHE``), else by reading the shard once here (then cached).
            The order then does not depend on the number of DataLoader workers, and
            ``len()`` is exact. ``False``: no index, no scan; each worker reads its own
            shards, so the order depends on the number of workers (see docs/shardstream.md).
        batch_size: with an index, the DataLoader's batch size: workers take turns in blocks
            of this many samples, so batches too are the same for any number of workers.
        lanes: with an index, the rank's sequence interleaves this many contiguous runs of its
            shards, each with its share of the shuffle buffer. A worker count dividing it
            reads each lane front to back. Default (``None``): 16 when shuffling, else 1 (file
            order, as webdataset).
        resampled: each DataLoader worker (of each rank) reads shards drawn with replacement,
            endlessly, seeded from (seed, epoch, rank, worker): webdataset's ``resampled=True``.
            No index is needed; cut epochs with ``.with_epoch(n)``.
        shard_shuffle: shuffle the shard order or not, whatever ``shuffle`` says of the buffer
            (default: as ``shuffle``).
        engine, chunk_size, queue_depth, direct: reader settings; ``None`` takes the
            process-wide value (see ``flashstream.settings``).

    ``flashstream.ShardStream`` is this class with webdataset's fluid methods
    (``.shuffle .decode .to_tuple .map .batched ...``), which return a resumable
    ``flashstream.Pipeline``, and ``.tensors(B)`` (see docs/pipeline.md and docs/tensors.md).
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
        equal_ranks: Union[bool, str] = False,
        index: Union[bool, str] = "auto",
        batch_size: int = 1,
        lanes: Optional[int] = None,
        resampled: bool = False,
        shard_shuffle: Optional[bool] = None,
        engine: Optional[str] = None,
        chunk_size: Optional[Size] = None,
        queue_depth: Optional[int] = None,
        direct: Optional[bool] = None,
    ) -> None:
        super().__init__()
        self.urls = expand_urls(urls)
        buffer, shuffled = shuffle_config(shuffle)
        if shard_shuffle is None:
            shard_shuffle = shuffled
        elif not isinstance(shard_shuffle, bool):
            raise ValueError(f"shard_shuffle must be None, True or False, got {shard_shuffle!r}")
        self._lanes_given = lanes
        if lanes is None:
            lanes = DEFAULT_LANES if buffer > 1 or shard_shuffle else 1
        self.config = StreamConfig(buffer, shard_shuffle, seed, split_by_rank, split_by_worker,
                                    equal_rule(equal_ranks), batch_size, lanes, resampled)
        self.handler = resolve_handler(handler)
        self._io = dict(engine=engine, chunk_size=chunk_size, queue_depth=queue_depth,
                        direct=direct)
        resolve(**self._io)  # validate now, not in a worker process later
        self.index = self._load_index(index)
        counts = None if self.index is None else [ix.count for ix in self.index]
        self._shards = {"count": len(self.urls), "digest": shard_digest(self.urls, counts)}
        self.epoch = 0
        self._job = job_rank()  # refreshed by every call in the main process (see world)
        self.last_stats: Optional[ReadStats] = None
        # Made here, in the process that builds the stream, so DataLoader workers share it.
        self.board = StatsBoard()
        self._handoff = Handoff()  # to and from DataLoader workers: epochs, loaded states
        self._active: Optional[Union[ShardPass, SamplePass]] = None
        self.signature = ""  # a Pipeline's stages, part of what a saved state must match
        self.single_node = False  # webdataset's single_node_only: refuse to run on many ranks
        self.resumed: Optional[Dict[str, Any]] = None  # the state the last pass resumed
        self._plans: Dict[tuple, RankPlan] = {}

    def _load_index(self, mode: Union[bool, str]) -> Optional[List[ShardIndex]]:
        if not (isinstance(mode, bool) or (isinstance(mode, str) and mode == "auto")):
            raise ValueError(f"index must be 'auto', True or False; got {mode!r}")
        self.index_info: Dict[str, float] = {}
        if self.config.resampled:
            if mode is True or self.config.equal_ranks:
                raise ValueError("resampled shards are drawn while reading and need no index; "
                                 "leave index='auto' and equal_ranks=False")
            return None
        if mode is False:
            if self.config.equal_ranks:
                raise ValueError("equal_ranks needs every shard's sample count, which "
                                 "index=False forbids; use index='auto' or True")
            return None
        start = time.perf_counter()
        sources: Dict[str, int] = {}
        by_source: Dict[str, Dict[str, float]] = {}
        found = load_index(self.urls, settings=self.io_settings, handler=self.handler,
                           sources=sources, info=by_source)
        self.index_info = dict(sources, seconds=time.perf_counter() - start,
                               bytes_read=sum(v["bytes"] for v in by_source.values()),
                               by_source=by_source)
        return found

    # -- epochs and the plan ------------------------------------------------------------------
    @property
    def plan(self) -> str:
        """``"samples"`` when every shard's samples are known (an index), else ``"shards"``."""
        return "shards" if self.index is None else "samples"

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose shard order and shuffle buffer the next pass uses. A state
        loaded for this same epoch stays pending; for another epoch it is dropped."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        self.world()  # remember the job's rank now, for DataLoader workers started later
        self._switch_epoch(epoch)

    def _switch_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._active = None
        self._handoff.epoch_set(epoch)  # for workers already started (persistent)
        self.epoch = epoch

    def follow_main_epoch(self) -> None:
        """Take the epoch set last in the main process, on this stream or on one it was derived
        from or for (pipelines share the note). A worker started before that ``set_epoch``
        (``persistent_workers=True``) would otherwise repeat its old epoch."""
        main = self._handoff.main_epoch()
        if main is not None and main != self.epoch:
            self._switch_epoch(main)

    @property
    def local_paths(self) -> List[str]:
        """The shards' filesystem paths (``urls`` as the reader opens them)."""
        return [local_path(url) for url in self.urls]

    @property
    def io_settings(self) -> IOSettings:
        """The reader settings a pass started now would use."""
        return resolve(**self._io)

    def world(self) -> World:
        """This process's place in the job, after split_by_rank / split_by_worker."""
        world = current_world(self._job)
        if not in_worker():
            self._job = (world.rank, world.world_size)
        rank, size = (world.rank, world.world_size) if self.config.split_by_rank else (0, 1)
        worker, workers = ((world.worker, world.num_workers) if self.config.split_by_worker
                           else (0, 1))
        return World(rank=rank, world_size=size, worker=worker, num_workers=workers)

    def _identity(self, world: World) -> Identity:
        config = self.config.identity_config()
        if self.signature:
            config["pipeline"] = self.signature
        return Identity(self.plan, config, self._shards, world.world_size, world.rank)

    def _rank_plan(self, world: World, repeat: int = 0) -> RankPlan:
        """The rank's plan of the current epoch (or of a pipeline's repetition of it)."""
        return _plan_of(self._plans, self.index, self.config, self.epoch, world, repeat)

    def __len__(self) -> int:
        """Samples this rank delivers in the current epoch (all workers together); exact, and
        only known with an index."""
        if self.index is None:
            raise TypeError("ShardStream has no length with index=False (no index)")
        if not in_worker():
            self.follow_main_epoch()
        return self._rank_plan(self.world()).length

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Dict]:
        return self.open_pass().generate()

    def open_pass(self, *, length: Optional[int] = None, repeat: int = 0
                  ) -> Union[ShardPass, SamplePass]:
        """Start this process's pass over the current epoch (resuming a loaded state), and make
        it the active one. The state it resumed, if any, is ``self.resumed``. For pipelines:
        ``length`` cuts the sample plan's sequence short or continues it into repetitions of
        the epoch; ``repeat`` starts the shard plan's repetition ``repeat`` of the epoch."""
        config, world = self.config, self.world()
        if self.single_node and self._job[1] > 1:
            raise ValueError(f"this dataset reads every shard on each of {self._job[1]} ranks "
                             f"(nodesplitter=single_node_only, webdataset's default): pass "
                             f"nodesplitter=wds.split_by_node to split shards by rank, or "
                             f"nodesplitter=None to read all shards on every rank")
        info = dataloader_worker()
        self.follow_main_epoch()  # set_epoch on the stream or on a pipeline built from it
        if info is not None:
            self._handoff.worker_started(self.epoch)
        resume = self._handoff.take(info, self.epoch)
        self.resumed = resume
        self._handoff.note_pass(info, self.epoch, resumed=resume is not None, shuffled=(
            config.shard_shuffle or config.shuffle_buffer > 1 or config.resampled))
        entry = None  # shard plan: this worker's entry of the resumed state
        if resume is not None and self.index is None:
            entry = shard_entry(resume, world.worker, world.num_workers)
            repeat = int((entry or {}).get("repeat", repeat))  # a pipeline's repetition
        self.last_stats = ReadStats()
        # The board, not the stream: a pass kept by the stream must not keep the stream alive.
        on_end = functools.partial(_record, self.board, info.id if info else 0,
                                   self.board.pass_generation(worker=info is not None))
        ctx = PassContext(self.urls, self.io_settings, self.handler, self.last_stats, on_end,
                          config.shuffle_buffer, config.seed, self.epoch, world.rank,
                          world.worker, world.num_workers, config.lanes, config.batch_size,
                          repeat)
        if config.resampled:
            # Seeded from the job's own rank and worker, split or not (as webdataset's are):
            # unsplit ranks and workers draw their own shards rather than the same ones.
            job = current_world(self._job)
            draws = ShardDraws(len(self.urls), sys.maxsize, config.seed, ctx.order, job.rank,
                               job.worker, job.num_workers)
            self._active = ShardPass(ctx, draws, entry, window=RESAMPLED_WINDOW)
        elif self.index is None:
            if config.split_by_rank and world.world_size > len(self.urls):
                raise ValueError(
                    f"{len(self.urls)} shard(s) for {world.world_size} ranks: some ranks would "
                    f"get no data and a distributed job would hang at the epoch's end; pass "
                    f"equal_ranks=True (splits shards by sample ranges using an index)")
            order = shard_order(len(self.urls), shuffle=config.shard_shuffle, seed=config.seed,
                                epoch=ctx.order)
            self._active = ShardPass(ctx, world.split(order), entry)
        else:
            # Not a bound method: the pass (kept by this stream) must not keep the stream.
            plans = functools.partial(_plan_of, self._plans, self.index, config, self.epoch,
                                      world)
            total = plans(0).length if length is None else length
            done, cursor = Delivered(), 0
            if resume is not None:
                done, cursor = worker_cursor(resume, world.worker, world.num_workers,
                                             config.batch_size, total)
            self._active = SamplePass(ctx, self.index, plans, config.batch_size, done, cursor,
                                      length=length)
        return self._active

    # -- the source interface pipelines build on ----------------------------------------------
    def derive(self: _S, *, shuffle_buffer: Optional[int] = None,
               batch_size: Optional[int] = None, signature: Optional[str] = None) -> _S:
        """A copy for a pipeline: the same shards and index, some settings changed, its own
        files shared with its DataLoader workers. It follows ``set_epoch`` on this stream too
        (the epoch note is shared), so either object can be told the epoch."""
        changes: Dict[str, Any] = {}
        if shuffle_buffer is not None:
            changes["shuffle_buffer"] = shuffle_buffer
            if self._lanes_given is None:
                busy = shuffle_buffer > 1 or self.config.shard_shuffle
                changes["lanes"] = DEFAULT_LANES if busy else 1
        if batch_size is not None and batch_size != self.config.batch_size:
            if self.config.batch_size != 1:
                raise ValueError(f"the stream was made with batch_size={self.config.batch_size}"
                                 f" and the pipeline batches by {batch_size}: leave the "
                                 f"stream's batch_size at 1 (batched() sets it)")
            changes["batch_size"] = batch_size
        new = copy.copy(self)
        new.config = dataclasses.replace(self.config, **changes)
        new.board, new._handoff, new._active = StatsBoard(), self._handoff.derived(), None
        new._plans = {}
        new.last_stats = None
        if signature is not None:
            new.signature = signature
        return new

    def sequence_length(self) -> int:
        """Sample plan: positions of the rank's sequence in the current epoch (one pass)."""
        return self._rank_plan(self.world()).length

    def attach(self, run: Any) -> None:
        """Make ``run`` the active pass: ``state_dict()`` then asks it for this process's
        position (a pipeline's runner knows it better than the stream's pass)."""
        self._active = run

    def stats(self) -> Dict[str, object]:
        """Counters and the merged request-latency histogram of the passes started since the
        last ``reset_stats()`` and ended, summed over this process and its DataLoader
        workers."""
        return self.board.totals()

    def reset_stats(self) -> None:
        self.board.reset()

    # -- resume -------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The position after the last sample this process's pass delivered, as plain values
        (ints, strings, lists, str-keyed dicts). Inside a DataLoader worker: that worker's
        position (torchdata's StatefulDataLoader collects them)."""
        if not in_worker():
            self.follow_main_epoch()  # set_epoch on a stream this one was derived from
        world = self.world()
        identity = self._identity(world)
        active = self._active
        if active is not None and active.epoch == self.epoch:
            done = (0, [])
            if self.index is not None:
                done = (active.done.below, sorted(active.done.extra))
            return new_state(identity, self.epoch, num_workers=world.num_workers,
                             batch_size=self.config.batch_size,
                             workers={str(world.worker): active.state()}, done=done)
        pending = self._handoff.pending()
        if pending is not None:
            return pending
        if self._handoff.workers_reading(self.epoch):
            raise RuntimeError(
                f"epoch {self.epoch} of this ShardStream is being read by DataLoader workers, "
                f"whose positions this process cannot know: use torchdata's StatefulDataLoader "
                f"and save loader.state_dict(), or save at an epoch boundary (after "
                f"set_epoch(next epoch))")
        return new_state(identity, self.epoch)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resume from ``state`` (from ``state_dict()``, or ``collect_states()`` of a
        DataLoader's state): the next pass continues its epoch exactly where it stopped.
        Raises ``ValueError`` when the state does not fit this stream and job."""
        if not in_worker():
            self.follow_main_epoch()  # set_epoch on a stream this one was derived from
        check_state(state, self._identity(self.world()))
        if finished(state) and state["epoch"] < self.epoch:
            # Saved after the last sample of an epoch older than the one set (torchdata loads
            # the state lazily, after the training loop's set_epoch): nothing to resume.
            return
        self._switch_epoch(state["epoch"])
        self._active = None
        self._handoff.load(state)

    @staticmethod
    def collect_states(obj: Any) -> Dict[str, Any]:
        """One state from every ShardStream state found in ``obj``: for example the per-worker
        states inside a StatefulDataLoader's ``state_dict()``. Load it to resume with a
        different number of workers (index needed) or without the DataLoader's own state.

        Raises ``ValueError`` for a StatefulDataLoader state taken between worker snapshots
        (``snapshot_every_n_steps`` > 1): its workers' states are older than what it
        delivered, and only StatefulDataLoader itself can replay the difference."""
        steps = _snapshot_steps(obj)
        if steps:
            raise ValueError(f"this StatefulDataLoader state was taken {steps} step(s) after "
                             f"its workers' last snapshot, so their positions are behind what "
                             f"it delivered; save with snapshot_every_n_steps=1 to collect "
                             f"states, or resume through StatefulDataLoader.load_state_dict")
        return merge_states(find_states(obj))

    def __getstate__(self) -> Dict[str, Any]:
        self.world()  # spawned DataLoader workers get the rank the parent sees now
        state = self.__dict__.copy()
        state["_active"] = None  # a running pass (generator) does not cross processes
        return state

    def __repr__(self) -> str:
        return (f"ShardStream({len(self.urls)} shards, plan={self.plan}, shuffle_buffer="
                f"{self.config.shuffle_buffer}, seed={self.config.seed}, epoch={self.epoch})")
