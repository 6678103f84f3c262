"""What ``rate="auto"`` learns of the drive from one save's record (save_record.py): only what
the drive showed, nothing written to learn it. The new-file and post-cache rates, where the
drive set an unpaced save's pace; the drain (measured, a lower bound, else the slow end of
drives); the save's first cliff as the reference that sizes the cache by the drain; the margin
the drive freed before it left its cliff; the fill at the end, for the next save.

A newer reading replaces an older one, whatever their ages: a drive that changed (another
tenant, a drive swapped behind the same name) is known by what it shows now.
"""

from __future__ import annotations

import logging
from typing import Optional

from ..telemetry.drive_model import (
    ASSUMED,
    LOWER_BOUND,
    MEASURED,
    ClearSchedule,
    DriveModel,
    ReferenceCliff,
    StartFill,
    assumed_drain,
)
from .cliff_watch import spread_of
from .save_record import BURST, SaveRecord

__all__ = ["learn"]

log = logging.getLogger(__name__)


def learn(model: DriveModel, record: SaveRecord, *, total: float,
          start_fill: StartFill, ended: float, ended_disk: Optional[int],
          source: str = "save") -> DriveModel:
    """Updates ``model`` from ``record`` (a save of ``total`` bytes from ``start_fill(drain)``
    that ended at ``ended``, time.time(), the drive's write counter then ``ended_disk``) and
    saves it."""
    model.sources = (model.sources + [source])[-20:]
    if record.fast_rate:
        model.fast_rate = record.fast_rate
    if record.post_cache_rate:
        model.post_cache_rate = record.post_cache_rate
        model.note("post_cache_rate", MEASURED, source)
    if record.cliffs:
        model.clear = None  # a schedule taken clear before is not, or the drive changed
        if record.test_pace:  # the drive drains slower than the pace the test met it at
            model.crossed = min(model.crossed or record.test_pace, record.test_pace)
        _learn_cliff(model, record, start_fill, source)
        return _saved(model, record, ended, ended_disk)
    if record.clear is not None and (model.clear is None or model.clear.total <= total):
        model.clear = ClearSchedule(record.clear[0], record.clear[1], float(total),
                                    record.clear[2])
    if record.drain_how == LOWER_BOUND and record.drain > (model.drain or 0.0):
        # Clear where a slower drain would have met the cliff: faster, however recent the model.
        model.drain_rate = record.drain
        model.note("drain_rate", LOWER_BOUND, source)
    return _saved(model, record, ended, ended_disk)


def _saved(model: DriveModel, record: SaveRecord, ended: float, ended_disk: Optional[int]
           ) -> DriveModel:
    _anchor_fill(model, record, ended, ended_disk)
    try:
        model.save()
    except OSError as exn:  # the model is a cache: never fail a committed save over it
        log.warning("flashstream: could not save the drive's write model: %s", exn)
    return model


def _anchor_fill(model: DriveModel, record: SaveRecord, ended: float,
                 ended_disk: Optional[int]) -> None:
    """Where the next save's fill is reckoned from. After a cliff, the last moment the save saw
    the cache full, as a function of the drain (the next save's readings solve for the drain
    through it; a number by the drain held now would carry its error). Else, or without the
    drive's counter, the end fill, afresh each save (idle gaps bound its error)."""
    if ended_disk is not None and record.full_before is not None and model.cliff is not None:
        seconds, nbytes = record.full_before
        model.set_full(ended - seconds, int(ended_disk - nbytes))
    elif model.cliff is not None or record.end_fill is not None:
        model.set_fill(record.end_fill or 0.0, ended, ended_disk)


def _learn_cliff(model: DriveModel, record: SaveRecord, start_fill: StartFill,
                 source: str) -> None:
    if record.drain_how == MEASURED:
        model.drain_rate = record.drain
        model.note("drain_rate", MEASURED, source)
    else:
        assumed = assumed_drain(model.post_cache_rate, model.fast_rate)
        bound = record.drain if record.drain_how == LOWER_BOUND else None
        if record.test_pace and record.cliffs[0].during == "test" and model.drain_rate:
            # A test met its cliff above the drain known: the drain stays, raised to a bound.
            if bound and bound > model.drain_rate:
                model.drain_rate = bound
                model.note("drain_rate", LOWER_BOUND, source)
        elif bound and (assumed is None or bound > assumed):
            model.drain_rate = bound
            model.note("drain_rate", LOWER_BOUND, source)
        else:  # the cliff contradicted the model or confirmed nothing: the safe end again
            model.drain_rate = None
            model.note("drain_rate", ASSUMED, source)
    drain = model.drain or 0.0
    first = record.cliffs[0]
    seen = ReferenceCliff(first.seconds, first.drive, start_fill.fill, start_fill.since,
                          start_fill.before, first.spread)
    # The reference becomes this cliff where none is held, where this save measured (its
    # drain was read against it), or where it shows the cache smaller even placed as late as
    # it may have come (the drive changed); else the one held stays, met from the emptiest
    # start (one from an estimated fill would size the cache small, a bound off it high).
    measuring = bool(record.modes) and record.modes[0][1] == BURST  # its first cliff ended it
    if model.cliff is None or measuring or \
            seen.latest(model.fast_rate or 0.0, spread_of(seen)).cache(drain) < \
            model.cliff.cache(drain):
        model.cliff = seen
    if record.exit_s is not None and drain:
        model.cliff_margin = max(0.0, drain * record.exit_s - record.exit_bytes)
        model.note("cliff_margin", LOWER_BOUND if record.drain_how == MEASURED else ASSUMED,
                   source)
