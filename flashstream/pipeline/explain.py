"""What a pipeline runs accelerated, and why not: ``pipeline.explain()``.

Every pipeline the webdataset names build can say whether flashstream's O_DIRECT stream reads
its shards, what runs each stage, what resumes exactly, and, where webdataset's own code runs
instead, why. The first pipeline in a process that is not accelerated logs one line saying so
(logger ``flashstream``), so a slow path is never silent.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Tuple

from .stages import Batch, Each, Opaque, Slice, Unbatch

__all__ = ["Explanation", "announce_fallback", "explain_pipeline"]

log = logging.getLogger("flashstream")

_ANNOUNCED = False  # the not-accelerated line is logged once per process


@dataclasses.dataclass(frozen=True)
class Explanation:
    """``accelerated``: flashstream's engine reads the shards. ``source``: what reads them.
    ``stages``: each stage after the source and how it runs. ``notes``: why the pipeline is
    not accelerated, or what in it does not resume exactly."""

    accelerated: bool
    source: str
    stages: Tuple[str, ...] = ()
    notes: Tuple[str, ...] = ()

    def __str__(self) -> str:
        head = "accelerated" if self.accelerated else "NOT accelerated"
        lines = [f"{head}: {self.source}"]
        lines += [f"  stage {i}: {stage}" for i, stage in enumerate(self.stages, start=1)]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def announce_fallback(what: str, reason: str) -> None:
    """Log, once per process, that ``what`` runs through webdataset's own code, and why."""
    global _ANNOUNCED
    if _ANNOUNCED:
        return
    _ANNOUNCED = True
    log.warning("flashstream: %s is not accelerated (%s); it runs through webdataset's own "
                "code, without O_DIRECT or exact resume. explain() on the pipeline says more.",
                what, reason)


def _stage_line(stage: Any, by_block: bool) -> str:
    if isinstance(stage, Each):
        return f"{stage.name}: webdataset's stage function, resumed exactly"
    if isinstance(stage, Batch):
        how = "survivors of one planned block each" if by_block else "consecutive items"
        return f"{stage.name}({stage.size}): {how}, resumed exactly"
    if isinstance(stage, Unbatch):
        return f"{stage.name}: resumed exactly (the position inside a batch is kept)"
    if isinstance(stage, Slice):
        return f"slice({stage.start}, {stage.stop}, {stage.step}): resumed exactly"
    return (f"{stage.name}: runs as given (a function flashstream cannot look into); resumed "
            f"as if it held nothing")


def explain_pipeline(pipeline: Any) -> Explanation:
    """The :class:`Explanation` of a flashstream ``Pipeline``."""
    stream = pipeline.stream
    settings = stream.io_settings
    source = (f"flashstream's stream reads {len(stream.urls)} local shard(s) "
              f"({'O_DIRECT' if settings.direct else 'buffered'}, engine {settings.engine}, "
              f"{stream.plan} plan)")
    if pipeline.origin:
        source += f" in place of {' + '.join(pipeline.origin)}"
    stages = []
    if pipeline.tensor_spec is not None:
        stages.append(f"{pipeline.tensor_spec.describe()}: packed by the C++ core from the "
                      f"read buffers, resumed exactly")
    block = pipeline.compiled.block
    stages += [_stage_line(stage, stage is block) for stage in pipeline.stages]
    notes = []
    if stream.config.shuffle_buffer > 1:
        notes.append(f"shuffle({stream.config.shuffle_buffer}): the stream's own seeded "
                     f"buffer, resumed exactly")
    if any(isinstance(stage, Opaque) for stage in pipeline.stages):
        notes.append("opaque stages are resumed as if they held nothing: one that buffers "
                     "items (webdataset's shuffle after batching, for one) loses what it "
                     "held at a resume")
    return Explanation(True, source, tuple(stages), tuple(notes))
