"""The stages of a pipeline, as small descriptions the runner knows how to resume exactly.

A stage is one of:

- :class:`Each`: at most one output per input, and it pulls one input per output (webdataset's
  ``map``, ``select``, ``decode``, ``to_tuple``, ``map_dict``, ``map_tuple``, ``rename``, ...).
  These run webdataset's own stage functions; they hold nothing between outputs.
- :class:`Batch`: ``batched`` / ``listed``, without webdataset's one-sample read-ahead.
- :class:`Unbatch`: ``unbatched`` / ``unlisted``; holds the rest of a batch between outputs.
- :class:`Slice`: ``slice`` (``itertools.islice``); the count of items it has seen is kept in
  the position.
- :class:`Opaque`: any other iterator function given to ``compose`` (and webdataset's
  ``PipelineStage`` objects, run by their ``run``); resumed as if it held nothing (see
  docs/pipeline.md).

``.shuffle(n)`` before any batching is not a stage: it becomes the stream's own resumable
buffer (see fluid.py); after batching it is webdataset's own shuffle, an opaque stage.
:func:`from_webdataset` turns webdataset's curried stages (``wds.map(f)``, ``wds.batched(16)``,
...) into these, so ``compose`` and ``DataPipeline`` resume them exactly too.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Iterator, Optional, Union

import webdataset.filters as wf
from webdataset.utils import PipelineStage

__all__ = ["Batch", "Each", "Opaque", "Slice", "Stage", "Unbatch", "from_webdataset"]

Apply = Callable[[Iterator[Any]], Iterator[Any]]


@dataclasses.dataclass(frozen=True)
class Each:
    """One output (or none) per input, pulled one input at a time. ``drops``: it may leave
    inputs out on purpose (``select``), so a sample count is not known in advance."""

    apply: Apply
    name: str
    drops: bool = False


@dataclasses.dataclass(frozen=True)
class Batch:
    """Lists of ``size`` consecutive items, collated; ``partial``: keep a short last batch."""

    size: int
    collation_fn: Optional[Callable[[list], Any]] = wf.default_collation_fn
    partial: bool = True
    name: str = "batched"

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"batchsize must be an int >= 1, got {self.size!r}")

    def collate(self, items: list) -> Any:
        return self.collation_fn(items) if self.collation_fn is not None else items


@dataclasses.dataclass(frozen=True)
class Unbatch:
    """The items of each batch, one by one (``unbatched``: collated dicts or tuples;
    ``unlisted``: plain lists)."""

    split: Callable[[Any], Iterator[Any]]
    name: str = "unbatched"


@dataclasses.dataclass(frozen=True)
class Opaque:
    """An iterator function flashstream cannot look into."""

    apply: Apply
    name: str


@dataclasses.dataclass(frozen=True)
class Slice:
    """webdataset's ``slice(*args)``: ``itertools.islice(items, start, stop, step)``. It holds
    nothing, but counts the items it has seen; the runner keeps that count in the position."""

    start: int
    stop: Optional[int]
    step: int

    @staticmethod
    def of(*args: Any) -> Slice:
        """From islice's arguments (``stop`` or ``start, stop[, step]``), checked by islice
        itself so bad ones raise its own ``ValueError``."""
        itertools.islice((), *args)
        bounds = slice(*args)
        return Slice(bounds.start or 0, bounds.stop, bounds.step or 1)

    @property
    def name(self) -> str:
        return "slice"


Stage = Union[Each, Batch, Unbatch, Opaque, Slice]


def _unbatch_one(batch: Any) -> Iterator[Any]:
    return wf.unbatched()(iter([batch]))


def _unlist_one(batch: Any) -> Iterator[Any]:
    return wf.unlisted()(iter([batch]))


def unbatch_stage(name: str = "unbatched") -> Unbatch:
    return Unbatch(_unbatch_one if name == "unbatched" else _unlist_one, name)


# webdataset's per-item stage functions (webdataset.filters): each pulls one input per output.
# (name, drops items on purpose); looked up by name, as older releases lack some.
_EACH_NAMES = {"_map": ("map", False), "_select": ("select", True), "_decode": ("decode", False),
               "_to_tuple": ("to_tuple", False), "_map_tuple": ("map_tuple", False),
               "_map_dict": ("map_dict", False), "_rename": ("rename", False),
               "_rename_keys": ("rename_keys", False), "_extract_keys": ("extract_keys", False),
               "_xdecode": ("xdecode", False), "_rsample": ("rsample", True),
               "_log_keys": ("log_keys", False)}
_EACH = {getattr(wf, f): v for f, v in _EACH_NAMES.items() if hasattr(wf, f)}


def from_webdataset(stage: Any) -> Union[Stage, tuple]:
    """Our description of a webdataset stage (a curried filter such as ``wds.map(f)``, a
    ``wds.detshuffle``), or of any other iterator function (an :class:`Opaque` stage).
    A shuffle comes back as ``("shuffle", bufsize, the stage)``: the stream's buffer where it
    can be, else the stage itself."""
    if isinstance(stage, wf.detshuffle):
        return ("shuffle", stage.bufsize, stage)
    if isinstance(stage, PipelineStage):  # webdataset calls its run(source)
        return Opaque(stage.run, type(stage).__name__)
    if not isinstance(stage, wf.FilterFunction):
        if isinstance(stage, (Each, Batch, Unbatch, Opaque, Slice)):
            return stage
        if not callable(stage):
            raise ValueError(f"{stage!r}: a pipeline stage must be a function of an iterator "
                             f"(such as webdataset's wds.map(f)), not {type(stage).__name__}")
        return Opaque(stage, getattr(stage, "__name__", type(stage).__name__))
    f, args, kw = stage.f, stage.args, stage.kw
    if f in _EACH:
        name, drops = _EACH[f]
        return Each(stage, name, drops)
    if f is wf._batched:
        bound = dict(zip(("batchsize", "collation_fn", "partial"), args), **kw)
        collation = bound.get("collation_fn", wf.default_collation_fn)
        return Batch(bound.get("batchsize", 20), collation, bound.get("partial", True),
                     "batched" if collation is not None else "listed")
    if f is wf._unbatched:
        return unbatch_stage("unbatched")
    if f is wf._unlisted:
        return unbatch_stage("unlisted")
    if f is wf._shuffle:
        bound = dict(zip(("bufsize", "initial"), args), **kw)
        return ("shuffle", bound.get("bufsize", 1000), stage)
    if f is itertools.islice and not kw:
        return Slice.of(*args)
    return Opaque(stage, getattr(f, "__name__", repr(f)))
