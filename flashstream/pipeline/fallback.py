"""Pipelines flashstream does not accelerate, run by webdataset's own code.

``flashstream.DataPipeline`` and ``flashstream.WebDataset`` accept whatever webdataset's accept.
When the shards cannot be read by flashstream's engine (a ``pipe:`` or remote url, a source
that is not a shard list, a stage flashstream cannot map into its stream), they build
webdataset's own object instead: these subclasses, which only add :meth:`explain`. Their
samples, errors and fluid methods are webdataset's, since its code runs them; they read without
O_DIRECT and have no ``state_dict``.
"""

from __future__ import annotations

from typing import Any, Sequence

import webdataset as wds
import webdataset.compat as wc

from .explain import Explanation, announce_fallback

__all__ = ["WebdatasetDataset", "WebdatasetPipeline"]

_SOURCE = "webdataset's own code reads the data (no O_DIRECT, no exact resume)"


def _set_epoch(stages: Sequence[Any], epoch: int) -> None:
    """Point webdataset's epoch-counting stages (``detshuffle``, ``ResampledShards``, which
    add one to their ``epoch`` as each pass starts) at ``epoch`` for the next pass."""
    for stage in stages:
        if isinstance(getattr(stage, "epoch", None), int):
            stage.epoch = epoch - 1


def _stage_names(stages: Sequence[Any]) -> tuple:
    names = []
    for stage in stages:
        target = getattr(stage, "f", stage)
        names.append(getattr(target, "__name__", type(target).__name__))
    return tuple(names)


class WebdatasetPipeline(wds.DataPipeline, wc.FluidInterface):
    """``webdataset.DataPipeline(*stages)`` itself, with :meth:`explain`; built by
    ``flashstream.DataPipeline`` when it cannot accelerate the pipeline (``reason``)."""

    accelerated = False

    def __init__(self, *stages: Any, reason: str) -> None:
        super().__init__(*stages)
        self.fallback_reason = reason
        announce_fallback("a DataPipeline", reason)

    def explain(self) -> Explanation:
        return Explanation(False, _SOURCE, _stage_names(self.pipeline),
                           (self.fallback_reason,))

    def set_epoch(self, epoch: int) -> None:
        """As flashstream's pipelines: the next pass is ``epoch`` for webdataset's stages that
        count epochs (``detshuffle``, ``ResampledShards``); others have no epoch."""
        _set_epoch(self.pipeline, epoch)


class WebdatasetDataset(wds.WebDataset):
    """``webdataset.WebDataset(urls, **kw)`` itself, with :meth:`explain`; built by
    ``flashstream.WebDataset`` when it cannot accelerate it (``reason``). flashstream's own
    reader settings (``ignored``) have nothing to set here."""

    accelerated = False

    def __init__(self, urls: Any, *, reason: str, ignored: Sequence[str] = (),
                 **kw: Any) -> None:
        super().__init__(urls, **kw)
        self.fallback_reason = reason
        self.ignored_settings = tuple(ignored)
        announce_fallback("a WebDataset", reason)

    def explain(self) -> Explanation:
        notes = [self.fallback_reason]
        if self.ignored_settings:
            notes.append(f"flashstream settings not used by webdataset's reader: "
                         f"{', '.join(self.ignored_settings)}")
        return Explanation(False, _SOURCE, _stage_names(self.pipeline), tuple(notes))

    def set_epoch(self, epoch: int) -> None:
        """As :meth:`WebdatasetPipeline.set_epoch`."""
        _set_epoch(self.pipeline, epoch)
