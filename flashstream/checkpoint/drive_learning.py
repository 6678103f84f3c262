"""What ``rate="auto"`` learns of the drive from each save, and the measurement after a save
that measured it (checkpoint/save_control.py).

Every save refreshes the drive's write model from its own timeline
(``telemetry.write_learning.learn_from_save``: rates only from stretches the drive set). A save
that met its cliff while measuring wrote on in it unpaced, so the drive's cache was full when
its data ended: the writer's thread then refills the cache once, after an idle gap, with a
new file it removes (``learn_after_save``), which gives the recovery rate and, with it, the
cache size. That runs after the save's commit, and a new save interrupts it: the refill write in
progress stops issuing at once (``telemetry.write_on.Interrupt``), and the rest is dropped.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Executor
from typing import Any, Dict, List, Optional

from ..telemetry.cliff import intervals, mean_rate
from ..telemetry.write_learning import (
    MIN_RATE_SECONDS,
    drain_from_cliff,
    drain_lower_bound,
    learn_after_save,
    learn_from_save,
    learn_written_on,
)
from ..telemetry.write_model import (
    ASSUMED,
    ESTIMATED,
    LOWER_BOUND,
    MEASURED,
    WriteModel,
    drained,
)
from ..telemetry.write_on import Interrupt, write_on_to_cliff
from .save_control import UNPREDICTED_CLIFF, SaveController

__all__ = ["DriveLearner"]

log = logging.getLogger(__name__)


def _doubt_drain(model: WriteModel, why: str) -> bool:
    """The drive contradicted the model, or its drain is stale: until refills measure it
    again, the drain is assumed at the safe end (and sizes no cache). Whether it changed."""
    if model.drain_rate is None:
        return False
    model.drain_rate = None
    model.note("drain_rate", ASSUMED, why)
    return True


def _solve_drain(model: WriteModel, known_cache: Optional[tuple], fill_then: Any, cliff: Any,
                 planned_drain: Optional[float]) -> None:
    """After a cliff the model did not predict, with the cache size measured: the drain
    that puts the cliff where it came (``drain_from_cliff``, an estimate: pacing counts on
    ``ESTIMATE_SHARE`` of it) replaces the doubted one (the slow end of drives, assumed until
    refills measure it, which made saves take several times the shortest), and the cache size
    stays what was learned. Where no drain explains the cliff, the drain stays doubted."""
    if known_cache is None or not planned_drain:
        return
    size, evidence = known_cache
    drain = drain_from_cliff(float(size), fill_then, cliff, planned_drain)
    if drain is None:
        return
    model.drain_rate = drain
    model.note("drain_rate", ESTIMATED, "a cliff the model did not predict")
    model.cache_size = size
    model.evidence["cache_size"] = evidence
    model.set_fill(float(size), model.fill_time)  # it was full at the cliff
    model.save()


def _logged(future: Any) -> None:
    """A measurement that failed other than by I/O (caught where it runs) is a bug: said, not
    lost in the executor's future nobody reads."""
    exn = future.exception()
    if exn is not None:
        log.error("flashstream: the drive measurement after a save failed", exc_info=exn)


class DriveLearner:
    """The learning side of one CheckpointWriter (see the module docstring). ``measurements``:
    one dict per refill measurement run (for reports and benchmarks)."""

    def __init__(self, directory: os.PathLike, executor: Executor) -> None:
        self.directory = directory
        self._executor = executor
        self._stop = Interrupt()
        self.measurements: List[Dict[str, object]] = []

    def interrupt(self) -> None:
        """A save or close() is waiting: end a refill measurement now, its write in progress
        too (a save that waited for one began in the cliff it had just reached, and stayed
        there while the drive freed the margin it leaves its cliff at)."""
        self._stop.set()

    def learn(self, model: WriteModel, controller: SaveController, data: dict, *, total: int,
              start_fill: float, ended: float, written_since: float, began: float,
              full_at: float, deadline: Optional[float]) -> Dict[str, object]:
        """Refresh the drive's write model from this save (and start the refill after it
        where it measured the drive); what the pacing did, for the report. ``began`` /
        ``ended``: time.time() when the data write began and ended; ``full_at``:
        time.monotonic() when it ended."""
        planner = controller.planner
        prior = (model.fill, model.fill_time)
        # The premise a cliff the model did not predict can be solved against: a measured
        # cache size, and the drain this save planned with.
        known_cache = (model.cache_size, model.evidence.get("cache_size")) \
            if model.how("cache_size") in (MEASURED, ESTIMATED) else None
        planned_drain = model.planning_recovery
        def fill_then(drain: float) -> float:
            """The fill this save began from, by the drain the refill measures."""
            if not prior[1]:
                return 0.0  # nothing known before: a drive seen for the first time
            return drained(prior[0] + written_since, drain, began - prior[1])

        doubted = controller.measuring == UNPREDICTED_CLIFF or (
            controller.measuring is not None and "drain_rate" in controller.probe)
        if doubted:
            _doubt_drain(model, controller.measuring)
        measuring = controller.measuring is not None
        post_before = model.post_cache_rate
        try:
            cliff = learn_from_save(model, data["timeline"], total=total, start_fill=start_fill,
                                    end_fill=planner.fill if planner and not measuring else None,
                                    ended=ended, measured=measuring)
        except OSError as exn:  # the model is a cache: never fail a committed save over it
            log.warning("flashstream: could not update the drive's write model: %s", exn)
            cliff = None
        if measuring and cliff is None and model.has_cliff:
            # Written unpaced past where the model put the cliff, and none came: the drive
            # drains at least this fast (the model was too slow).
            floor = drain_lower_bound(data["timeline"], float(model.cache_size))
            if floor > (model.recovery_rate or 0.0):
                model.drain_rate = floor
                model.note("drain_rate", LOWER_BOUND, "save written past the model's cliff")
                model.save()
        # A planned save whose unpaced burst met a cliff in its last second (too short for the
        # controller to call it one the model did not predict) ends in it all the same: the
        # model was wrong, and the cache is full. Measured after, as after such a cliff.
        timeline = data["timeline"]
        surprised = (not measuring and cliff is not None and bool(timeline)
                     and timeline[-1][2] <= 0)
        if surprised and _doubt_drain(model, UNPREDICTED_CLIFF):
            model.save()
        if cliff is not None and (surprised or controller.measuring == UNPREDICTED_CLIFF):
            _solve_drain(model, known_cache, fill_then, cliff, planned_drain)
        ends_full = (measuring and controller.ends_full) or surprised
        write_began, save_s = full_at - (ended - began), ended - began
        unpaced = bool(timeline) and all(r[2] <= 0 for r in timeline)
        # The new-file rate writing on starts from: the model's, or this save's own where it
        # ran unpaced throughout (too short for the model to take it: under a second).
        fast = model.fast_rate or (mean_rate(intervals(timeline)) if unpaced else None)
        job: Optional[tuple] = None
        if cliff is not None and ends_full:
            # Where the cliff came too near the save's end for this save to give the drive's
            # pace in it (not even a bound that moved the model's figure, which may be the one
            # the cliff just contradicted), writing on reads it first; the refill follows
            # either way. Writing on costs the gap before the next save a second or two. A
            # bound on a drive seen for the first time moved no figure: from a save's last
            # few tenths in the throttle's bursts it may be a fifth of the drive's pace.
            read_here = (cliff.rate is not None and cliff.rate_seconds >= MIN_RATE_SECONDS
                         ) or post_before not in (None, model.post_cache_rate)
            job = (self._refill, model, cliff, fill_then, full_at, total) \
                if read_here or not fast else \
                (self._write_on, model, fast, timeline, fill_then, write_began, save_s,
                 total, cliff)
        elif cliff is None and fast and (ends_full or (controller.probe and unpaced)):
            # Unpaced to its end and no cliff: it may have met it in its last requests, too
            # late to show (telemetry/write_on.py). Write on until it does, then refill. So
            # too a save whose model is not confirmed and planned no pacing at all: it never
            # reached the point from which it would have measured the drive.
            job = (self._write_on, model, fast, timeline, fill_then, write_began, save_s,
                   total, None)
        if job is not None:
            self._stop = Interrupt()
            self._executor.submit(*job, self._stop).add_done_callback(_logged)
        return {"plan": "measure" if planner is None else "model",
                "measured": controller.measuring,
                # What the writer's thread measures next, in the background (None: nothing).
                "then": None if job is None else (
                    "write on" if job[0] == self._write_on else "refills"),
                "measured_from_s": controller.measured_from,
                "start_fill": start_fill, "end_fill": model.fill,
                "cliff_at_s": cliff.seconds if cliff else None,
                "cliffs_seen": controller.cliffs,
                "deadline_conflict": controller.conflicted if planner else None,
                "slo_misses": controller.slo_misses,
                "deadline_s": deadline,
                "write_within_s": planner.deadline if planner else None,
                # Bytes the drive took from other writers, counted into the cache estimate:
                # since the last save (from start_fill's estimate on), and during this one.
                "others_before_bytes": written_since,
                "others_during_bytes": planner.written - planner.done if planner else None}

    def _write_on(self, model: WriteModel, fast: float, timeline: Any, fill_then: Any,
                  write_began: float, save_seconds: float, total: int, known: Any,
                  stop: Interrupt) -> None:
        """Writes on past a save that met no cliff (see ``learn``): a cliff found gives the
        model its cache size and post-cache rate, then refills give the recovery rate; none
        found within the save's size again says the drive takes that much more."""
        record: Dict[str, object] = {"kind": "write on"}
        try:
            found = write_on_to_cliff(self.directory, fast=float(fast),
                                      cap=float(total), stop=stop)
        except OSError as exn:
            log.warning("flashstream: could not write on to the drive's cliff: %s", exn)
            record["error"] = str(exn)
            self.measurements.append(record)
            return
        offset = found.began - write_began  # the first chunk's start, from the save's
        record.update(written=found.written, interrupted=found.interrupted,
                      started_s_after_save=offset,
                      cliff_at_s=None if found.cliff is None else offset + found.cliff.seconds)
        self.measurements.append(record)
        if found.cliff is None:
            if not found.interrupted and known is None:
                learn_written_on(model, timeline, found, offset, total)
            return
        if not model.fast_rate:  # the save was too short to give it; its run up to the cliff
            model.fast_rate = found.cliff.fast_rate or fast
        cliff = learn_written_on(model, timeline, found, offset, total,
                                 start_fill=fill_then, save_seconds=save_seconds, known=known)
        if cliff is not None and not stop.is_set():
            self._refill(model, cliff, fill_then, found.ended, total, stop)

    def _refill(self, model: WriteModel, cliff: Any, fill_then: Any, full_at: float,
                cap: int, stop: Interrupt) -> None:
        started = time.monotonic()
        record: Dict[str, object] = {"kind": "refills",
                                     "started_s_after_save": started - full_at}
        try:
            drain = learn_after_save(model, self.directory, cliff=cliff, start_fill=fill_then,
                                     full_at=full_at, cap=cap, stop=stop,
                                     attempts=record.setdefault("refills", []))
        except OSError as exn:
            log.warning("flashstream: could not measure the drive's recovery: %s", exn)
            drain = None
            record["error"] = str(exn)
        record.update(drain_rate=drain, cache_size=model.cache_size, interrupted=stop.is_set(),
                      seconds=time.monotonic() - started)
        self.measurements.append(record)
