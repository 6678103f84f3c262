"""Learning a drive's write model (telemetry/write_model.py) from what the drive showed.

- :func:`learn_sustained` (``flashstream probe --sustained``): an unpaced write far past the
  cliff, then two refills of the cache after idle gaps.
- :func:`learn_from_save`: a checkpoint save's own timeline. A rate comes only from stretches
  where the drive, not the writer's pacer, set the pace (:func:`~flashstream.telemetry.cliff.
  drive_limited`): a paced stretch shows the pacer, and at most gives a lower bound.
- :func:`learn_after_save`: after a save that measured the drive on purpose (the first on an
  unknown drive, one that met a cliff its model did not predict, one whose model was stale:
  checkpoint/pacing.py) and so left its cache full, one refill gives the recovery rate.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable, List, Optional, Union

from ..sizes import Size, format_size, parse_size
from .cliff import (
    CLIFF_HOLD_S,
    FAST_WINDOW_S,
    Cliff,
    Timeline,
    drive_limited,
    fast_until,
    find_cliff,
    intervals,
    mean_rate,
)
from .probe import new_file_write
from .refills import (
    MAX_IDLE,
    measure_refills,
    most_drain,
    refill_drain,
    stop_below,
    two_readings,
)
from .write_model import (
    ASSUMED,
    ESTIMATE_SHARE,
    ESTIMATED,
    LOWER_BOUND,
    MEASURED,
    WriteModel,
    drained,
    load_model,
    sizing_drain,
)
from .write_on import point_timeline, timed_write

__all__ = ["MIN_RATE_SECONDS", "drain_from_cliff", "drain_lower_bound", "drive_write_rate",
           "learn_after_save",
           "learn_from_save", "learn_sustained", "learn_written_on", "measure_refills",
           "refill_drain"]

#: A rate read off fewer seconds of the drive's own pace than this is a lower bound, not a
#: measurement: the block-I/O throttle and the drive's own folding come in slices of up to a
#: tenth of a second, so a few intervals can hold a stall or a burst.
MIN_RATE_SECONDS = 0.5
#: After a save, the idle gap before its one refill, in seconds per byte of the cache at the
#: post-cache rate: long enough that a drive folding at half its post-cache rate has freed
#: more than the largest margin it leaves its cliff at (a quarter of the cache in the family
#: of docs/emulation.md), short enough that one folding at 1.6 x has not drained completely.
#: One refill, not two: the next save may come any time after this one, and one that finds
#: the drive in the cliff a refill just reached stays there until the drive has freed its
#: margin (most of the saves in the cliff after learning were such). One reading has the
#: cliff's detection lag in it, an estimate that pacing counts on less of; after a fifth of
#: the cache's drain time, the first refill was still in the cliff on most drives.
AFTER_SAVE_GAP = 0.55

def drive_write_rate(path: Union[str, os.PathLike], cache_dir: Optional[Path] = None) -> float:
    """The drive's new-file write bytes/s: remembered, else measured (a 1 GiB write, at most
    3 s) and remembered."""
    model = load_model(path, cache_dir)
    if not model.fast_rate:
        point = new_file_write(path, "1GiB", seconds=3.0)
        model.fast_rate = point.bytes / point.seconds
        model.sources.append("write")
        model.observations += 1
        model.save()
    return float(model.fast_rate)


def learn_sustained(directory: Union[str, os.PathLike], size: Size, *,
                    idle: Optional[float] = None, cache_dir: Optional[Path] = None,
                    progress: Callable[[str], None] = lambda _m: None) -> WriteModel:
    """Learns the drive's write model with sustained new-file writes.

    The first writes ``size`` bytes unpaced: its speed before a cliff is the new-file rate, its
    speed well after it the post-cache rate. Two more writes follow, each after an idle gap
    (``idle`` seconds, default a fifth of the cache's drain time at the post-cache rate, at
    most 15 s; then 3 x ``idle`` longer than the gap that gave the first reading) on a cache
    the previous write left full (a refill slow from its start found the drive still folding:
    it is repeated after twice the gap): each takes
    ``drain_rate x (gap + its time to the cliff)`` bytes before its cliff, plus the same
    detection lag, so the difference of the two gives the recovery rate, and with it the cache
    size (the first write's bytes before its cliff, less what drained meanwhile).
    Without a cliff in the first write the model records that ``size`` bytes went without
    one. Assumes the cache is empty when it starts.
    """
    nbytes = parse_size(size, name="size")
    model = load_model(directory, cache_dir)
    progress(f"sustained write of {format_size(nbytes)}")
    first, _, ended = timed_write(directory, nbytes)
    cliff = find_cliff(point_timeline(first), unpaced=True)
    model.sources.append("probe")
    model.observations += 1
    if cliff is None:
        model.fast_rate = first.bytes / first.seconds
        model.cliff_free = max(model.cliff_free, float(nbytes))
        model.cache_size = model.post_cache_rate = model.drain_rate = None
        model.set_fill(0.0)
        model.save()
        return model
    post = cliff.rate or (first.bytes - cliff.bytes_before) / max(
        1e-9, first.seconds - cliff.seconds)
    model.fast_rate = cliff.fast_rate or first.bytes / first.seconds
    model.post_cache_rate = post
    guess = max(cliff.bytes_before - post * cliff.seconds, float(64 << 20))
    idle = min(MAX_IDLE, 0.2 * guess / post) if idle is None else idle
    refills, full_since = measure_refills(directory, fast=model.fast_rate, post=post,
                                          full_at=ended, idle=idle, cap=nbytes,
                                          progress=progress, cache=guess)
    model.drain_rate = refill_drain(refills, model.fast_rate)
    how = MEASURED if two_readings(refills) else ESTIMATED
    if model.drain_rate is not None:
        model.note("drain_rate", how, "probe")
    else:  # tried: assumed until a later try (WriteModel.unconfirmed)
        model.note("drain_rate", ASSUMED, "probe, no refill reading")
    # Unmeasured, the drain stands at the fast end here: the smaller cache (see _learn_cliff).
    recovery = model.sizing_recovery or post
    model.cache_size = max(cliff.bytes_before - recovery * cliff.seconds, float(1 << 20))
    model.note("cache_size", how if model.drain_rate is not None else LOWER_BOUND, "probe")
    model.note("post_cache_rate", MEASURED if cliff.rate_seconds >= MIN_RATE_SECONDS
               else LOWER_BOUND, "probe", cliff.rate_seconds)
    model.cliff_free = 0.0
    if full_since is not None:
        model.set_fill(model.cache_size, _wall(full_since))
    else:
        model.set_fill(model.cache_size if refills else 0.0)
    model.save()
    return model


def learn_from_save(model: WriteModel, timeline: Timeline, *, total: float,
                    start_fill: float, end_fill: Optional[float], ended: float,
                    measured: bool = False) -> Optional[Cliff]:
    """Refreshes ``model`` from one save's write (its per-interval timeline) and saves it.

    ``start_fill`` is the cache estimate the save started from, ``end_fill`` the planner's
    estimate at its end (None: no planner ran; estimated here), ``ended`` the time.time() the
    write ended. A cliff in the timeline gives the cache size (the bytes before it, plus the
    fill it started from, less what drained meanwhile) and, where the drive set the pace for
    long enough after it, the post-cache rate (else at most a raised lower bound); a save
    without one raises the cache size to at least the most the cache held during it.
    ``measured``: the save wrote unpaced from some point on, so that a drop it came back from
    was a stall of the disk, not its cliff (as in the sustained probe's first write).
    """
    rows = intervals(timeline)
    unpaced = [r for r in rows if r[3] <= 0]
    cliff = find_cliff(timeline, unpaced=measured)
    # The new-file rate only from an unpaced run (up to the cliff, if any): unpaced rows picked
    # out from between paced ones are the throttle's or the pacer's bursts, not the drive's
    # rate (read so, a drive's fast rate came out twice the truth).
    before = [r for r in rows if cliff is None or r[1] <= cliff.seconds]
    if before and all(r[3] <= 0 for r in before):
        if cliff is None and sum(r[1] - r[0] for r in before) >= 1.0:
            model.fast_rate = mean_rate(before)
        elif cliff is not None and cliff.fast_rate:
            model.fast_rate = cliff.fast_rate
    model.sources.append("save")
    model.observations += 1
    if cliff is not None:
        _learn_cliff(model, rows, cliff, start_fill=start_fill, ended=ended,
                     end_fill=end_fill)
    elif model.has_cliff:
        # The most the cache held, by the fastest drain the model allows (measured, else
        # the fast end: sizing_recovery), so that the model's size is at least that. Only an
        # unpaced save says so: a planned one stays below the size by construction, and where
        # it did not, its fill estimate (drifting with the drain's error from save to save) is
        # no evidence of a larger cache. (By the assumed slow drain, a save that took the
        # drive's whole cache and more without a cliff raised it to 2.5 x.)
        recovery = model.sizing_recovery
        held, peak = start_fill, start_fill
        for start, end, bps, _pace in rows:
            held = drained(held + bps * (end - start), recovery or 0.0, end - start)
            peak = max(peak, held)
        if unpaced and len(unpaced) == len(rows) and peak > (model.cache_size or 0.0):
            model.cache_size = peak
        fill = held if end_fill is None else end_fill
        model.set_fill(fill, ended)
    elif rows and all(r[3] <= 0 for r in rows):
        # Only an unpaced write says the drive takes this much without a cliff: a paced one
        # may have stayed below the rate at which the cache drains.
        model.cliff_free = max(model.cliff_free, float(total))
    model.save()
    return cliff


def _learn_cliff(model: WriteModel, rows, cliff: Cliff, *, start_fill: float, ended: float,
                 end_fill: Optional[float]) -> None:
    """What a save's cliff teaches: the post-cache rate where the drive set the pace for long
    enough (else a raised lower bound at most), and the cache size."""
    if cliff.rate is not None and cliff.rate_seconds >= MIN_RATE_SECONDS:
        model.post_cache_rate = cliff.rate
        model.note("post_cache_rate", MEASURED, "save", cliff.rate_seconds)
    else:
        # The drive showed too little of its own pace (or none: a pacer held the cliff): it
        # writes at least that fast in its cliff, so this only ever raises the figure.
        # Not the first half second in the cliff: it still completes requests the drive took
        # before it, and the throttle's first slice (find_cliff's hold leaves it out too).
        # A figure that is not current gives way to it all the same (_bound_counts).
        seen = cliff.rate if cliff.rate is not None else mean_rate(
            drive_limited([r for r in rows if r[0] >= cliff.seconds + CLIFF_HOLD_S]))
        if seen and _bound_counts(model, seen):
            model.post_cache_rate = seen
            model.note("post_cache_rate", LOWER_BOUND, "save", cliff.rate_seconds)
    if model.post_cache_rate is None:
        return  # no rate the drive set: nothing to size the cache by (the next save measures)
    # Bytes before the cliff = its size less what drained meanwhile. With the drain unknown,
    # the fast end of what drives do stands for it here (sizing_recovery: the smaller cache),
    # where pacing assumes the slow end (recovery_rate): both err safe.
    drain = model.sizing_recovery or 0.0
    size = start_fill + cliff.bytes_before - drain * cliff.seconds
    if size > 0:
        model.cache_size = size
        how = model.how("drain_rate")  # the cache is known as well as the drain is
        model.note("cache_size", how if how in (MEASURED, ESTIMATED) else LOWER_BOUND, "save")
    model.cliff_free = 0.0
    fill = float(model.cache_size or 0.0)
    model.set_fill(fill if end_fill is None else min(fill, end_fill), ended)


def _bound_counts(model: WriteModel, seen: float) -> bool:
    """Whether a post-cache rate read off too short a stretch (a lower bound) replaces the
    model's: where it has none, where it is higher, or where the model's is not current
    (measured days ago, say: another drive may be behind the name). Kept, a stale rate 4 x
    too high stood save after save, each of which measured it again and met the cliff."""
    return (model.post_cache_rate is None or seen > model.post_cache_rate
            or "post_cache_rate" in model.unconfirmed())


def learn_after_save(model: WriteModel, directory: Union[str, os.PathLike], *, cliff: Cliff,
                     start_fill: Callable[[float], float], full_at: float, cap: int,
                     stop: Optional[threading.Event] = None,
                     attempts: Optional[List[dict]] = None) -> Optional[float]:
    """After a save that met its cliff and wrote on in it unpaced (so it left the cache full at
    ``full_at``, time.monotonic()): one refill of the cache after ``AFTER_SAVE_GAP``
    (:func:`measure_refills`, new files of at most ``cap`` bytes in ``directory``, removed
    after) gives the recovery rate, an estimate;
    with it, the cache size from the save's ``cliff`` and the fill the save began from
    (``start_fill(drain)``: it depends on the drain). Returns the recovery rate (None: not
    measured; the model is unchanged then). ``stop``: give up between steps once set (a new
    save is waiting; an ``Interrupt`` ends the refill write in progress too)."""
    if not (model.fast_rate and model.post_cache_rate):
        return None
    post = model.post_cache_rate
    guess = max(float(model.cache_size or cliff.bytes_before), float(64 << 20))
    attempts = [] if attempts is None else attempts
    refills, full_since = measure_refills(directory, fast=model.fast_rate, post=post,
                                          full_at=full_at,
                                          idle=min(MAX_IDLE, AFTER_SAVE_GAP * guess / post),
                                          cap=cap, stop=stop, attempts=attempts,
                                          cache=guess, readings=1)
    drain = refill_drain(refills, model.fast_rate)
    # No reading, but a refill the next save cut short before its cliff wrote so many bytes
    # while it still ran fast, so many seconds after the cache was full: the drain is at
    # least that (refills.cut_bound). It counts with an estimate's margin: the last fast
    # stretch may hold a moment past the cliff before the drive slowed. (Assumed instead, at
    # the slow end of drives, it made every save after take 3-6.5 x the shortest.)
    bound = ESTIMATE_SHARE * max(
        (a["drain_at_least"] for a in attempts if a.get("drain_at_least")), default=0.0)
    if drain is None:
        # Nothing read: the drain is assumed (the slow end of drives) until the next try, not
        # whatever figure stood before under that name (a stored drain 4 x the drive's, kept
        # so, paced the save after into its cliff); a cut refill's bound beats the assumption.
        model.drain_rate = None
        if bound > (model.recovery_rate or 0.0):
            model.drain_rate = min(bound, most_drain(model.fast_rate) or bound)
            model.note("drain_rate", LOWER_BOUND, "a refill cut short before its cliff")
            # The cache by the same drain the saves plan with, not by the fast end of drives
            # (_size_cache says why that is safe; by the fast end, 1.6 x the post-cache rate
            # on a drive folding at 1.3 x, the cache came out 0.82-0.84 x and the saves after
            # took 1.44-1.48 x the shortest).
            _size_cache(model, start_fill, cliff, model.drain_rate, ESTIMATED,
                        "learning save, by the drain's lower bound")
        else:  # tried: assumed until the next try (WriteModel.unconfirmed)
            model.note("drain_rate", ASSUMED, "learning save, no refill reading")
    else:
        model.drain_rate = drain
        # One refill's reading (the next save cut the second off) has its cliff's detection
        # lag in it: an estimate, which pacing counts on less of (planning_recovery).
        how = MEASURED if two_readings(refills) else ESTIMATED
        model.note("drain_rate", how, "learning save")
        _size_cache(model, start_fill, cliff, drain, how, "learning save")
    # Full when the last refill ended (or was cut short: measure_refills), not when this
    # returns.
    if full_since is not None and model.cache_size:
        model.set_fill(float(model.cache_size), _wall(full_since))
    model.save()
    return drain


def _size_cache(model: WriteModel, start_fill: Callable[[float], float], cliff: Cliff,
                drain: float, how: str, source: str) -> None:
    """The cache size a learning save's ``cliff`` gives by ``drain``: the fill it began from
    (``start_fill(drain)``) and the bytes before the cliff, less what drained meanwhile.

    Sized and planned by the same drain, a cache and its fill estimate err together. By a
    drain read low by ``e``, the cache comes out high by ``e`` x the seconds the learning save
    took to its cliff, and a later burst from an empty cache (at the same new-file rate)
    counts its fill high by ``e`` x its own seconds: it reaches a share of the larger cache
    after that share of those seconds, when the drive's cache is at that share of its own.
    After, the estimate drains slower than the drive and stays above its fill. So a lower
    bound on the drain sizes the cache as safely as the drain itself would
    (``test_a_cache_sized_by_a_drain_read_low_keeps_saves_out_of_the_cliff``)."""
    size = start_fill(drain) + cliff.bytes_before - drain * cliff.seconds
    if size > 0:
        model.cache_size = size
        model.note("cache_size", how, source)


def _wall(monotonic: float) -> float:
    """``monotonic`` (a time.monotonic() reading) as time.time()."""
    return time.time() - (time.monotonic() - monotonic)


def drain_lower_bound(timeline: Timeline, cache_size: float) -> float:
    """The least recovery rate that lets a write of ``timeline`` stay out of a cliff of
    ``cache_size`` bytes from any starting fill: after ``t`` seconds it gave the drive
    ``W(t)`` bytes and the cache held them less what drained, so ``drain >= (W(t) - cache) /
    t``. 0 where it wrote less than the cache."""
    written, best = 0.0, 0.0
    for end, nbytes, _pace in timeline:
        written += nbytes
        if end > 0:
            best = max(best, (written - cache_size) / end)
    return best


def drain_from_cliff(cache_size: float, start_fill: Callable[[float], float], cliff: Cliff,
                     ceiling: float) -> Optional[float]:
    """The recovery rate that puts a cliff the model did not predict where it came: a save
    that began with ``start_fill(drain)`` bytes in a cache of ``cache_size`` met it after
    ``cliff.bytes_before`` bytes and ``cliff.seconds``, so ``start_fill(d) + bytes_before -
    d * seconds = cache_size``. The left side falls as ``d`` grows; the root below
    ``ceiling`` (the drain the save planned with, which put the cliff later) is the drain the
    drive showed, given the cache size and the fill the save began from. None where no drain
    in ``[0, ceiling]`` puts it there (the cache or the fill is what was wrong)."""
    def excess(drain: float) -> float:
        return start_fill(drain) + cliff.bytes_before - drain * cliff.seconds - cache_size

    if ceiling <= 0 or excess(0.0) < 0 or excess(ceiling) > 0:
        return None
    low, high = 0.0, ceiling
    for _ in range(60):  # to well under a byte per second
        middle = 0.5 * (low + high)
        low, high = (middle, high) if excess(middle) > 0 else (low, middle)
    return 0.5 * (low + high) or None


def _last_fast(timeline: Timeline, fast: Optional[float], post: Optional[float]
               ) -> Optional[tuple]:
    """Where an unpaced write last ran fast (``fast_until``, above the midpoint of the two
    rates), as (seconds, bytes); None where it was paced in its last window or the rates are
    unknown."""
    if not (fast and post) or not timeline:
        return None
    tail = [r for r in timeline if r[0] >= timeline[-1][0] - FAST_WINDOW_S - 0.05]
    if any(r[2] > 0 for r in tail):
        return None  # paced: the pacer, not the drive, set how fast it ran
    return fast_until(timeline, stop_below(fast, post))


def learn_written_on(model: WriteModel, timeline: Timeline, found, offset: float, total: float,
                     *, start_fill: Optional[Callable[[float], float]] = None,
                     save_seconds: Optional[float] = None,
                     known: Optional[Cliff] = None) -> Optional[Cliff]:
    """Refreshes ``model`` from writing on past a save that met no cliff (``found``, a
    :class:`~flashstream.telemetry.write_on.WriteOn` that began ``offset`` seconds after the
    save's write of ``total`` bytes, whose ``timeline`` it was). Its cliff is the save's: at
    ``offset`` + its seconds, after ``total`` + its bytes; it gives the cache size (from the
    fill the save began from, ``start_fill(drain)``) and the post-cache rate as a save's cliff
    does. Without one, the drive took both writes without a cliff: with no cliff known,
    ``cliff_free`` grows to their sum; with one, the drain is at least what kept it out
    (:func:`drain_lower_bound`). A cliff at writing on's first byte (the drive in it
    already) was met in the save's last requests: at ``save_seconds`` (the save's write time),
    where given. ``known``: the save's own cliff, where it met one too late to read its
    post-cache rate; writing on (in the cliff still) reads it then. Returns the cliff, counted
    from the save's start."""
    model.sources.append("write on")
    model.observations += 1
    if found.cliff is None:
        if not model.has_cliff:
            model.cliff_free = max(model.cliff_free, float(total + found.written))
        else:
            joined = list(timeline) + [(offset + end, nbytes, pace)
                                       for end, nbytes, pace in found.timeline]
            floor = drain_lower_bound(joined, float(model.cache_size))
            if floor > (model.recovery_rate or 0.0):
                model.drain_rate = floor
                model.note("drain_rate", LOWER_BOUND, "writing on past a save")
            # The figures this save measured for went unmeasured: tried, so the next try
            # comes after RETRY_AFTER, not at the next save. (Tried again at every save, a
            # drive that took each save and its writing on with no cliff long enough to
            # place, 136 MiB of cache behind 0.3 s saves, met that short cliff every time.)
            for name in model.unconfirmed():
                model.note(name, ASSUMED, "writing on past a save: no cliff to measure")
        model.save()
        return None
    seen = found.cliff
    at, before = offset + seen.seconds, total + seen.bytes_before
    if found.from_start and save_seconds is not None:
        at = min(at, save_seconds)
        # Met in the save's last requests, too near its end to be confirmed there: where the
        # save last ran fast, it was not in it yet. (At the save's end, every byte the drive
        # took at its post-cache rate after the cliff counted into the cache: 6-12% over.)
        last = _last_fast(timeline, model.fast_rate, seen.rate or model.post_cache_rate)
        if last is not None and last[0] < at:
            at, before = last
    cliff = known or Cliff(at, before, seen.rate, seen.fast_rate or model.fast_rate,
                           seen.rate_seconds)
    rows = [(offset + a, offset + b, bps, pace) for a, b, bps, pace in intervals(found.timeline)]
    # The save's cliff, read on past its end: a long enough reading is the drive's rate,
    # whatever the model said (the cliff may just have contradicted it); a short one only
    # raises the figure.
    if known is not None and seen.rate is not None and (
            seen.rate_seconds >= MIN_RATE_SECONDS or _bound_counts(model, seen.rate)):
        model.post_cache_rate = seen.rate
        model.note("post_cache_rate", MEASURED if seen.rate_seconds >= MIN_RATE_SECONDS
                   else LOWER_BOUND, "writing on past a save", seen.rate_seconds)
    drain = model.sizing_recovery or sizing_drain(seen.rate, model.fast_rate) or 0.0
    ended = time.time() - (time.monotonic() - found.ended)
    _learn_cliff(model, rows, cliff, start_fill=start_fill(drain) if start_fill else 0.0,
                 ended=ended, end_fill=None)
    model.save()
    return cliff
