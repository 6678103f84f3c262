"""``Pipeline``: a ShardStream followed by webdataset-style stages, as one resumable dataset.

Built by the fluid methods (``ShardStream(...).decode("pil").to_tuple("jpg", "cls")
.batched(64)``), by ``flashstream.DataPipeline(stream, wds.map(f), ...)`` or by
``flashstream.WebDataset``. It is an ``IterableDataset`` whose stages run where it is
iterated (inside each DataLoader worker), with ``set_epoch``, ``state_dict()`` /
``load_state_dict()`` (exact through every stage) and ``len()`` where the count is known.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import warnings
from typing import Any, Dict, Iterator, Optional, Tuple

import webdataset.filters as wf
from torch.utils.data import IterableDataset
from webdataset.utils import PipelineStage

from ..stream.state import own_entry
from ..world import in_worker
from .explain import Explanation, explain_pipeline
from .fluid import FluidInterface
from .run import Compiled, Run, compile_stages
from .stages import Batch, Each, Opaque, Slice, Stage, Unbatch

__all__ = ["EpochSpec", "Pipeline"]

ENDLESS = sys.maxsize


@dataclasses.dataclass(frozen=True)
class EpochSpec:
    """How long an epoch is: ``items`` outputs (None: as the data gives), over at most
    ``repetitions`` passes of the data (``with_epoch`` / ``repeat``)."""

    items: Optional[int] = None
    repetitions: int = 1

    def describe(self) -> str:
        if self == EpochSpec():
            return ""
        reps = "endless" if self.repetitions >= ENDLESS else str(self.repetitions)
        return f"epoch(items={self.items},repetitions={reps})"


def _describe(stage: Stage) -> str:
    if isinstance(stage, Batch):
        return f"{stage.name}({stage.size},partial={stage.partial})"
    if isinstance(stage, Slice):
        return f"slice({stage.start},{stage.stop},{stage.step})"
    return stage.name


class Pipeline(FluidInterface, IterableDataset):
    """A stream and its stages (see the module docstring and docs/pipeline.md).

    Args:
        stream: the ShardStream the samples come from (the pipeline works on its own copy).
        stages: the stages, in order (see ``flashstream.pipeline.stages``).
        epoch: the epoch's length (``with_epoch`` / ``repeat``).
        length: what ``len()`` returns, overriding the count (``with_length``).
        tensors: a ``TensorSpec``: the source packs tensor batches (``.tensors(B)``).
        empty_check: a pass that yields nothing raises ``ValueError`` (webdataset's check,
            for example more DataLoader workers than shards).
        origin: the webdataset stages the source stands for (``SimpleShardList``,
            ``split_by_worker``, ``tarfile_to_samples``...), for :meth:`explain`.
    """

    def __init__(self, stream: Any, stages: Tuple[Stage, ...] = (), *,
                 epoch: EpochSpec = EpochSpec(), length: Optional[int] = None,
                 tensors: Any = None, empty_check: bool = False,
                 origin: Tuple[str, ...] = ()) -> None:
        super().__init__()
        self.origin = tuple(origin)
        self.source = stream  # as given: shuffle() and further stages derive from it
        self.stages = tuple(stages)
        self.epoch_spec = epoch
        self.length = length
        self.tensor_spec = tensors
        self.empty_check = empty_check
        self._build()

    def _build(self) -> None:
        by_block = self.source.plan == "samples" and self.tensor_spec is None
        self.compiled: Compiled = compile_stages(self.stages, by_block=by_block)
        self._check()
        block = self.compiled.batch_size or (self.tensor_spec.size if self.tensor_spec else None)
        self.stream = self.source.derive(batch_size=block, signature=self.signature)

    def _check(self) -> None:
        if self.tensor_spec is not None and any(isinstance(s, Unbatch) for s in self.stages):
            raise ValueError("tensors() makes the batches the DataLoader carries; unbatched() "
                             "after it is not supported (use batched() for per-sample stages)")
        reps = self.epoch_spec.repetitions
        if self.source.plan == "samples" and reps >= ENDLESS and self.epoch_spec.items is None:
            raise ValueError("an endless repeat() needs with_epoch(n) (or repeat(nbatches=n)) "
                             "to say how long an epoch is")

    @property
    def signature(self) -> str:
        """What a saved state must match: the stages' kinds and sizes, the epoch's length."""
        parts = [_describe(s) for s in self.stages]
        if self.tensor_spec is not None:
            parts.insert(0, self.tensor_spec.describe())
        epoch = self.epoch_spec.describe()
        return "|".join(parts + ([epoch] if epoch else []))

    # -- building -----------------------------------------------------------------------------
    def _replace(self, **changes: Any) -> Pipeline:
        fields = dict(stream=self.source, stages=self.stages, epoch=self.epoch_spec,
                      length=self.length, tensors=self.tensor_spec,
                      empty_check=self.empty_check, origin=self.origin)
        fields.update(changes)
        return Pipeline(fields.pop("stream"), fields.pop("stages"), **fields)

    def _compose(self, *stages: Stage) -> Pipeline:
        return self._replace(stages=self.stages + stages)

    def append(self, stage: Any) -> None:
        """webdataset's ``append``: add a stage to this pipeline itself (``compose`` returns a
        new one)."""
        self.__dict__.update(self.compose(stage).__dict__)

    def stage(self, i: int) -> Any:
        """webdataset's ``stage(i)`` indexes its internal stage list (shard list, splitters,
        url opener, tar expander, ...), which a flashstream pipeline does not have."""
        raise TypeError("a flashstream pipeline has no webdataset stage list to index: its "
                        "shard list, splitters and tar expansion are one stream (see "
                        "explain()); its stages are in .stages")

    def _shuffled(self, size: int, original: Any = None, **kw: Any) -> Pipeline:
        if any(not isinstance(s, Each) for s in self.stages) or self.tensor_spec is not None:
            # After batching (or an opaque stage) the items are no longer the stream's
            # samples: webdataset's own shuffle (the stage given, seed and all) shuffles them.
            if original is None:
                original = wf.shuffle(size, **kw)
            run = original.run if isinstance(original, PipelineStage) else original
            return self._compose(Opaque(run, "shuffle"))
        return self._replace(stream=self.source.derive(shuffle_buffer=size))

    def _epoch(self, *, items: Optional[int], repetitions: int) -> Pipeline:
        # webdataset's with_epoch / repeat change the pipeline itself and return it.
        self.epoch_spec = EpochSpec(items, repetitions)
        self._build()
        return self

    def tensors(self, batch_size: int, *, partial: bool = True) -> Pipeline:
        """See ShardStream.tensors: it packs samples as they are read, so it must come right
        after the source (shuffle() first is fine: that is the stream's buffer)."""
        from .tensors import TensorSpec

        if self.stages or self.tensor_spec is not None:
            raise ValueError("tensors() must come right after the source "
                             "(ShardStream(...).tensors(B), or .shuffle(n).tensors(B)); stages "
                             "go after it and receive whole batches")
        return self._replace(tensors=TensorSpec(batch_size, partial))

    def with_length(self, n: int, silent: bool = False) -> Pipeline:
        """Make ``len()`` return ``n`` (webdataset's workaround for code that needs a length;
        the epoch itself is unchanged)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"with_length needs an int >= 0, got {n!r}")
        if not silent:
            warnings.warn(".with_length() only sets the value of __len__ for compatibility "
                          "with some training environments. It does not change the number "
                          "of samples in an epoch.", stacklevel=2)
        self.length = n
        return self

    # -- webdataset's context manager, and what runs how -------------------------------------
    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """webdataset's ``close()``: close the stages that hold resources (webdataset's
        ``PipelineStage`` objects, such as ``LMDBCached``'s database)."""
        for stage in self.stages:
            owner = getattr(getattr(stage, "apply", None), "__self__", None)
            if isinstance(owner, PipelineStage) and callable(getattr(owner, "close", None)):
                owner.close()

    def explain(self) -> Explanation:
        """What reads the shards, how each stage runs and resumes (see
        flashstream.pipeline.explain)."""
        return explain_pipeline(self)

    @property
    def accelerated(self) -> bool:
        """True: flashstream's engine reads this pipeline's shards (always, for this class;
        webdataset's own pipelines, built where flashstream cannot read, say False)."""
        return True

    # -- the stream's controls ----------------------------------------------------------------
    @property
    def plan(self) -> str:
        return self.stream.plan

    @property
    def epoch(self) -> int:
        self.stream.follow_main_epoch()
        return self.stream.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next pass uses (see ShardStream.set_epoch)."""
        self.stream.set_epoch(epoch)

    def stats(self) -> Dict[str, object]:
        return self.stream.stats()

    def reset_stats(self) -> None:
        self.stream.reset_stats()

    @property
    def last_stats(self) -> Any:
        return self.stream.last_stats

    @property
    def index_info(self) -> Dict[str, float]:
        return self.stream.index_info

    @property
    def urls(self) -> Any:
        return self.stream.urls

    @property
    def local_paths(self) -> Any:
        return self.stream.local_paths

    @property
    def io_settings(self) -> Any:
        return self.stream.io_settings

    def state_dict(self) -> Dict[str, Any]:
        """The position after the last item this process delivered (see
        ShardStream.state_dict); the stages' part is in each worker's entry."""
        return self.stream.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.stream.load_state_dict(state)

    # -- epochs and length --------------------------------------------------------------------
    def _unit(self) -> int:
        """Positions of the rank's sequence per item the pipeline yields (sample plan)."""
        if self.tensor_spec is not None and not any(isinstance(s, Unbatch) for s in self.stages):
            return self.tensor_spec.size
        block = self.compiled.block
        if block is not None and not any(isinstance(s, Unbatch) for s in self.compiled.after):
            return block.size
        return 1

    def _positions(self) -> Optional[int]:
        """Sample plan: positions of the rank's sequence this epoch (None: one epoch)."""
        spec = self.epoch_spec
        if spec == EpochSpec():
            return None
        period = self.stream.sequence_length()
        total = period * spec.repetitions if spec.repetitions < ENDLESS else None
        if spec.items is not None:
            wanted = spec.items * self._unit()
            total = wanted if total is None else min(total, wanted)
        return total

    def __len__(self) -> int:
        """Items this rank yields this epoch (all DataLoader workers together) where that is
        known in advance: the sample plan without filters before the count is fixed."""
        if self.length is not None:
            return self.length
        if self.stream.plan == "shards":
            raise TypeError("this pipeline has no length: without an index (index=False) or "
                            "with resampled shards the count is not known in advance; use "
                            "with_length(n)")
        positions = self._positions()
        if positions is None:
            positions = len(self.stream)
        unknown = self._unknown_count()
        if unknown:
            raise TypeError(f"this pipeline's length is not known in advance: {unknown}; use "
                            f"with_length(n)")
        unit = self._unit()
        if unit == 1:
            return positions
        spec = self.tensor_spec if self.tensor_spec is not None else self.compiled.block
        partial = spec.partial
        return -(-positions // unit) if partial else positions // unit

    def _unknown_count(self) -> str:
        """Why the number of items is not fixed by the plan ('' when it is)."""
        blocked = self.tensor_spec is not None or self.compiled.block is not None
        stages = self.compiled.after if blocked else self.stages
        for stage in stages:
            if isinstance(stage, Each) and stage.drops:
                return f"{stage.name}() drops items"
            if isinstance(stage, Opaque):
                return f"{stage.name} may change the count"
            if isinstance(stage, Slice):
                return "slice() cuts each DataLoader worker's items"
            if isinstance(stage, Batch):
                return "batched() after a stage that may change the count"
        return ""

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        stream = self.stream
        positions = self._positions() if stream.plan == "samples" else None
        if self.tensor_spec is not None:
            work = self.tensor_spec.open(stream, length=positions)
        else:
            work = stream.open_pass(length=positions)
        entry = _resumed_entry(stream)
        shard_plan = stream.plan == "shards"
        spec = self.epoch_spec

        run = Run(work, self.compiled, entry=entry, finish=_finisher(),
                  limit=spec.items if shard_plan else None,
                  repeats=spec.repetitions if shard_plan else 1,
                  next_pass=(functools.partial(_next_pass, stream, self.tensor_spec)
                             if shard_plan else None),
                  # webdataset's check is per worker: the shard plan's; the sample plan deals
                  # blocks, and a worker without one is normal there.
                  empty_check=self.empty_check and shard_plan)
        stream.attach(run)
        return iter(run)

    def __repr__(self) -> str:
        return f"Pipeline({self.stream!r}, stages={self.signature or '(none)'})"


def _next_pass(stream: Any, tensor_spec: Any, repeat: int, run: Run) -> Any:
    """Open the stream's repetition ``repeat`` of the epoch for ``run`` (shard plan)."""
    opened = (tensor_spec.open(stream, repeat=repeat) if tensor_spec is not None
              else stream.open_pass(repeat=repeat))
    stream.attach(run)  # the run, not the pass, knows the pipeline's position
    return opened


def _finisher() -> Any:
    """What each item goes through as it leaves: in a DataLoader worker, tensor batches get
    their key lists ready for the loader (see flashstream.batches.for_loader)."""
    if not in_worker():
        return None
    from ..batches import for_loader

    return for_loader


def _resumed_entry(stream: Any) -> Optional[Dict[str, Any]]:
    """The worker entry of the state this pass resumed, with the stages' part (outputs to
    drop, items counted). A state merged from several workers can only be re-dealt where no
    worker was inside a batch being unbatched."""
    state = stream.resumed
    if not state or not state.get("num_workers"):
        return None
    world = stream.world()
    if stream.plan == "shards":  # always the worker's own (shard_entry checked it)
        return state["workers"].get(str(world.worker))
    entry = own_entry(state, world.worker, world.num_workers, stream.config.batch_size)
    if entry is not None:
        return entry
    if any(int(e.get("skip", 0)) for e in state["workers"].values()):
        raise ValueError("this state was saved while a worker was partway through an "
                         "unbatched() batch, so it can only be resumed by the same worker: "
                         "resume through StatefulDataLoader.load_state_dict with the same "
                         "num_workers, or save at a batch boundary")
    if any(any(e.get("sliced", ())) for e in state["workers"].values()):
        raise ValueError("this state was saved by a pipeline with slice(), which counts each "
                         "worker's items, so it can only be resumed by the same workers: "
                         "resume through StatefulDataLoader.load_state_dict with the same "
                         "num_workers")
    return None
