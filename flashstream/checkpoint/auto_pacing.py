"""``rate="auto"`` for one CheckpointWriter: what it carries from one save to the next.

Each save is paced by a :class:`~flashstream.checkpoint.save_control.SaveController` from the
drive's model, which learns from the save after its commit (drive_learning.py). Between saves
the writer keeps what no single save knows: when the last save's data ended and the drive's
counters then (the bytes since fill its cache; the reads since are its quiet latency), how long
a save's tail takes (for ``within``), whether this writer has seen the drive's cliff itself,
and how its tests went (:func:`save_kind`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Dict, Optional, Tuple

from ..telemetry.device import device_of
from ..telemetry.diskstats import write_read_counters
from ..telemetry.drive_model import (
    MEASURED,
    ClearSchedule,
    DriveModel,
    StartFill,
    assumed_drain,
    load_model,
)
from .cliff_watch import RATE_NOISE, SHORTFALL
from .config import WriterConfig
from .drive_learning import learn
from .pacing import DEFAULT_SETTINGS, PlanSettings
from .pacing_thread import PacingThread
from .save_control import SaveController, describe

__all__ = ["AutoPacing", "AutoSave", "planned_seconds", "repeated_seconds", "save_kind",
           "trial_pace"]

#: Seconds of a save's tail (header, sync, commit) before one was timed.
FIRST_TAIL_S = 0.2
# Seconds per byte of pruning an older checkpoint before one was timed, by how it is removed:
# unlinked at once (freeing its extents), a slice at a time on an online-discard filesystem
# (store.remove_step), or recycled (renames: milliseconds whatever its size). Measured figures:
# docs/benchmarks.md, "Figures behind the defaults".
FIRST_PRUNE_S_PER_BYTE = 0.25e-9
FIRST_GRADUAL_PRUNE_S_PER_BYTE = 0.35e-9
FIRST_RECYCLE_S_PER_BYTE = 0.01e-9
#: The fewest reads between saves that give the drive's quiet read latency.
QUIET_READS = 20
#: Seconds in the cliff a test may cost (the bound after a fresh start's first save,
#: docs/checkpoint.md): a drive that needs longer to leave its cliff (its margin over its
#: drain) is not tested, unless its plan would lose more than that to the test.
TEST_EXIT_S = 0.5
#: Tests of one writer that may meet the cliff before it plans with what it knows.
TEST_CROSSINGS = 2
#: A save tests a faster drain only where its plan could take this many times as long as the
#: test's: below, a cliff the test may meet costs the reads more than the save could gain.
TEST_GAIN = 1.15


@dataclasses.dataclass
class AutoSave:
    """One save's pacing: the model it started from, the thread that paces it, the cache's
    fill at its start by a drain rate, and the drive's counters then."""

    model: DriveModel
    pacing: PacingThread
    start_fill: StartFill
    start_disk: Optional[Tuple[int, int, int]]
    planned: Dict[str, Optional[float]]
    kind: str              # "measure", "test" or "model": how the save learns the drive
    others_before: float   # bytes the drive took since the model's fill estimate


class AutoPacing:
    """The writer's side of ``rate="auto"``; with another rate it only keeps the tail and
    pruning estimates (``time_left``, for ``within``)."""

    def __init__(self, directory: os.PathLike, config: WriterConfig, *,
                 online_discard: bool) -> None:
        self.directory, self.config = directory, config
        self.measured = False  # a save of this writer met the cliff measuring the drive
        self.crossings = 0  # tests of this writer that met the cliff
        self.tail_s = FIRST_TAIL_S
        # (time.time(), the drive's counters) when the last save's data ended
        self.mark: Optional[Tuple[float, Optional[Tuple[int, int, int]]]] = None
        self.prune_s_per_byte = (FIRST_RECYCLE_S_PER_BYTE if config.recycle
                                 else FIRST_GRADUAL_PRUNE_S_PER_BYTE if online_discard
                                 else FIRST_PRUNE_S_PER_BYTE)
        self.prune_s = 0.0
        self._disk_name: Optional[str] = None
        if config.rate == "auto":  # the reads until the first save are quiet ones too
            self.mark = (time.time(), write_read_counters(self.disk()))

    def plan(self, *, capacity: int, time_left: Optional[float],
             counted: bool) -> Optional[AutoSave]:
        """The pacing of a save of ``capacity`` bytes (None: not rate="auto"). ``counted``: the
        drive's counter sees the save's bytes as they complete (O_DIRECT)."""
        cfg = self.config
        if cfg.rate != "auto":
            return None
        model = load_model(self.directory)
        disk = self.disk() if counted else None
        now, counters = time.time(), write_read_counters(disk)
        start_fill = model.start_fill(now, None if counters is None else counters[0])
        settings = PlanSettings(deadline_policy=cfg.deadline_policy)
        measure, test = save_kind(model, capacity, start_fill(model.drain or 0.0),
                                  deadline=time_left, measured=self.measured,
                                  crossings=self.crossings, settings=settings)
        controller = SaveController(
            model, total=capacity, start_fill=start_fill, measure=measure, test=test,
            deadline=time_left, settings=settings, lead=cfg.chunk_size * cfg.queue_depth,
            min_rate=cfg.adaptive.min_rate, quiet_read_s=self._quiet_read_s(counters),
            read_slo=cfg.read_slo)
        planned = {"fast_rate": model.fast_rate, "cache_size": model.cache_size,
                   "post_cache_rate": model.post_cache_rate, "drain": model.drain,
                   "drain_how": model.how("drain_rate"),
                   "fill": start_fill(model.drain or 0.0)}
        kind = "measure" if measure else "test" if test else "model"
        since = model._written_since(None if counters is None else counters[0])
        return AutoSave(model, PacingThread(controller, disk, cfg.read_slo), start_fill,
                        counters, planned, kind, since)

    def _quiet_read_s(self, counters: Optional[Tuple[int, int, int]]) -> Optional[float]:
        """The mean read latency on the drive since the last save's data ended (quiet)."""
        if self.mark is None or self.mark[1] is None or counters is None:
            return None
        reads, read_ms = counters[1] - self.mark[1][1], counters[2] - self.mark[1][2]
        return read_ms / 1e3 / reads if reads >= QUIET_READS else None

    def time_left(self, called: float, tail_extra: float) -> Optional[float]:
        """Seconds the data write has to finish by ``within`` from ``called``
        (time.perf_counter()), less the save's tail and ``tail_extra`` (pruning)."""
        if self.config.within is None:
            return None
        left = self.config.within - (time.perf_counter() - called) - self.tail_s - tail_extra
        return max(left, 1e-3)

    def learn(self, save: AutoSave, *, total: int, ended: float) -> Dict[str, object]:
        """After the commit: the model learns from the save (its data ended at ``ended``,
        time.time()); returns the report's ``pacing``."""
        record = save.pacing.record
        disk = self.disk()
        counters = write_read_counters(disk)
        self.mark = (ended, counters)
        end_disk = None if counters is None else counters[0]
        learn(save.model, record, total=total, start_fill=save.start_fill, ended=ended,
              ended_disk=end_disk if save.pacing.disk else None)
        self.crossings += save.kind == "test" and bool(record.cliffs)
        # A measuring save that met no cliff measured nothing.
        self.measured = self.measured or save.kind == "measure" and bool(record.cliffs)
        out = describe(record)
        out.update(plan=save.kind, model=save.planned, others_before_bytes=save.others_before,
                   others_during_bytes=record.others_bytes)
        return out

    def pruned(self, seconds: float, file_size: int) -> None:
        self.prune_s = seconds
        self.prune_s_per_byte = seconds / max(file_size, 1)

    def disk(self) -> Optional[str]:
        """The block device under the checkpoints (None: unknown)."""
        if self._disk_name is None:
            try:
                self._disk_name = device_of(self.directory, health=False).name or ""
            except OSError:
                self._disk_name = ""
        return self._disk_name or None


def save_kind(model: DriveModel, capacity: float, fill: float, *, deadline: Optional[float],
              measured: bool, crossings: int, settings: PlanSettings = DEFAULT_SETTINGS
              ) -> Tuple[bool, Optional[float]]:
    """How the next save learns the drive: (measure, test pace).

    - A drive with no cliff known that may not take the save clear: measure.
    - A save the model says needs no pacing, one the drive took clear unpaced (nothing to
      gain), or with a deadline: plan (or repeat).
    - The first such save of a writer: measure (a model learned elsewhere, or earlier, may be
      wrong either way however recent; only a cliff tells).
    - While the drain is not measured (or read below the slow end of drives): test a faster
      pace (``trial_pace``) where it could shorten the save by ``TEST_GAIN`` against the plan
      (or a schedule taken clear), the drive leaves its cliff soon enough (``TEST_EXIT_S``),
      and fewer than ``TEST_CROSSINGS`` tests met the cliff. A test that meets it bounds the
      drain from above (the next halves the distance); the drain known stays."""
    if model.cliff is None:
        return model.clear is None or model.clear.total < capacity, None
    unpaced_clear = model.clear is not None and not model.clear.pace and \
        model.clear.covers(capacity, fill)
    if deadline is not None or unpaced_clear or \
            fill + capacity <= settings.headroom * model.cache_size:
        return False, None
    if not measured:
        return True, None
    if crossings >= TEST_CROSSINGS or not (model.post_cache_rate and model.fast_rate) or \
            capacity <= model.cliff.bytes or _read_within_family(model):
        return False, None
    pace = trial_pace(model)
    if model.crossed is not None and pace >= model.crossed:
        return False, None  # the cliff met there is all a test can show
    now = planned_seconds(model, model.drain, capacity, settings, fill)
    if model.clear is not None and model.clear.covers(capacity, fill):  # or written as before
        now = min(now, repeated_seconds(model, model.clear, capacity, settings))
    best = planned_seconds(model, pace, capacity, settings)
    if model.cliff_margin is not None and \
            model.cliff_margin > max(TEST_EXIT_S, now - best) * model.drain:
        return False, None  # a cliff met would hold the reads too long
    return False, pace if pace > model.drain and now > TEST_GAIN * best else None


def _read_within_family(model: DriveModel) -> bool:
    """Whether the drain was read off two cliffs and no slower than the slow end of drives (a
    reading below it is likelier a cliff placed wrong, and tested again like a bound)."""
    slow_end = assumed_drain(model.post_cache_rate, model.fast_rate) or 0.0
    return model.how("drain_rate") == MEASURED and model.drain >= slow_end


def trial_pace(model: DriveModel) -> float:
    """The pace a test writes at past its burst: midway between the drive's rates before and
    in its cliff, or, once a test met the cliff at some pace, midway between that and the
    drain known (a bisection); never so slow that the post-cache rate, noise included, would
    not fall short of it (cliff_watch.SHORTFALL): the cliff would pass unseen."""
    high = 0.5 * (model.fast_rate + model.post_cache_rate)
    if model.crossed is not None:
        high = min(high, model.crossed)
    pace = 0.5 * (model.drain + high) if model.crossed is not None else high
    return max(pace, model.post_cache_rate / SHORTFALL * (1.0 + RATE_NOISE))


def repeated_seconds(model: DriveModel, clear: ClearSchedule, capacity: float,
                     settings: PlanSettings = DEFAULT_SETTINGS) -> float:
    """Seconds a save of ``capacity`` bytes takes written as ``clear`` was, repeated."""
    fast = model.fast_rate or math.inf
    burst, pace = settings.repeat(clear, capacity, model.fast_rate)
    if not pace:
        return capacity / fast
    burst = min(burst, capacity)
    return burst / fast + (capacity - burst) / pace


def planned_seconds(model: DriveModel, drain: float, capacity: float,
                    settings: PlanSettings = DEFAULT_SETTINGS, fill: float = 0.0) -> float:
    """Seconds a save of ``capacity`` bytes from ``fill`` in the cache takes planned with
    ``drain``: unpaced to the headroom, then at the sustained share of the drain."""
    fast, cache = model.fast_rate or math.inf, model.cliff.cache(drain)
    room = max(0.0, settings.headroom * cache - fill)
    burst = room * (fast / (fast - drain) if fast > drain else math.inf)
    if capacity <= burst:
        return capacity / fast
    return burst / fast + (capacity - burst) / (settings.sustain * drain)
