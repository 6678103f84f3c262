"""Refills of a drive's full SLC cache: after an idle gap, a new-file write up to the cliff
again. What each took before its cliff is what the drive freed (folded) since the cache was
full, so two refills after different gaps give the recovery (drain) rate, the detection lag
cancelled (:func:`refill_drain`). Used by the sustained probe and after a save that left the
cache full (telemetry/write_learning.py)."""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple, Union

from .cliff import fast_until, find_cliff, intervals, mean_rate
from .write_on import point_timeline, timed_write

__all__ = ["CONSISTENT_SHARE", "MAX_IDLE", "cut_bound", "measure_refills", "most_drain",
           "refill_cliff", "refill_drain", "stop_below", "two_readings"]


MAX_IDLE = 15.0  # seconds: the longest idle gap before a refill


def measure_refills(directory: Union[str, os.PathLike], *, fast: float, post: float,
                    full_at: float, idle: float, cap: int,
                    progress: Callable[[str], None] = lambda _m: None,
                    stop: Optional[threading.Event] = None,
                    attempts: Optional[List[dict]] = None,
                    cache: Optional[float] = None,
                    readings: int = 2) -> Tuple[List[Tuple[float, float]], Optional[float]]:
    """Two refills (``readings``) of a cache left full at ``full_at`` (time.monotonic()): each
    after an idle gap (``idle`` seconds, then 3 x ``idle`` longer), a new-file write of at
    most ``cap`` bytes up to the cliff again, once short writes have found the drive out of
    its cliff (:func:`_leave_cliff`). A refill slow from its first byte
    found the drive still folding (one that leaves its cliff only once it has freed a
    margin): the same full cache is back, so it is repeated after twice the gap. Returns the
    readings for :func:`refill_drain` and when (time.monotonic()) the cache was last full,
    where it was left so (the last write's end; ``full_at`` where none followed), else None.
    ``stop``: end early (between writes) once set; an ``Interrupt`` (telemetry/write_on.py)
    ends the write in progress too, so that a save waiting for it does not start in the
    cliff the write was about to reach. ``attempts``: gets a dict per refill (its gap,
    bytes, seconds, what it found), for reports. ``cache``: the cache's size as far as
    known; a refill that wrote less than it and met no cliff was sized too small and writes
    on (:func:`_write_to_cliff`), one that wrote more found the cache drained completely
    (None: never writes on). ``readings``: 1 ends after the first reading (after a save: the
    next may come any time)."""
    refills: List[Tuple[float, float]] = []
    wait, apart = idle, 3 * (idle if idle > 0 else 0.25)  # the second gap is `apart` longer
    full, ended = True, full_at
    while len(refills) < readings:
        progress(f"idle {wait:.1f} s, then a write up to the cliff again")
        pause = max(0.0, wait - (time.monotonic() - ended))
        if stop is None:
            time.sleep(pause)
        elif stop.wait(pause):
            break
        # A drive that leaves its cliff only once it has freed a margin may still be in it:
        # a refill begun there reads the margin's folding as the drain's, and one written
        # on at the post-cache rate keeps the drive in its cliff. Short writes tell first.
        probed, first, last = _leave_cliff(directory, fast, post, stop,
                                           latest=ended + MAX_IDLE)
        if stop is not None and stop.is_set():
            break  # a save is waiting: full at `ended`, drained since, but for the probes
        refill = _refill_size(time.monotonic() - ended, fast, post)
        # Ended soon after its cliff, not written on in it to its size: a drive left in its
        # cliff stays there until it has freed a margin, a second or more, and a save that
        # comes meanwhile (cancelling the write in progress) starts in it.
        point, rows, began, written, refill_bytes = _write_to_cliff(
            directory, min(cap, refill), min(cap, (cache or 0.0) - probed), fast, post, stop)
        # One timeline from the last short write on (its fast start is what the cliff is
        # found against), counted from the cache's last full moment with every byte written
        # since: the short writes' in the cliff too.
        since = began - ended
        if last is not None:
            lead, last_began = last
            rows = lead + [(end + began - last_began, nbytes, pace)
                           for end, nbytes, pace in rows]
            probed -= sum(r[1] for r in lead)
            since = last_began - ended
        gap, ended = (first if first is not None else began) - ended, written
        # Slow from its first byte (its first LEAVE_PROBE_S below the midpoint of the two
        # rates): the drive was still folding, as one that leaves its cliff only once it has
        # freed a margin is after a short gap, or the short writes before it took what little
        # room the gap had freed. The same full cache is back: a longer gap, not a reading.
        # (A cliff found in such a write was the throttle's bursts at the post-cache rate:
        # read as one, it put the reading at 1.3-1.65 x the drain.)
        slow = _slow_start(point, fast, post)
        # Not unpaced=True: a refill ends about a second past its cliff, too soon for its
        # second half to give the post-cache rate the stall rule measures against. One
        # write, not chunks: at test scale (caches of a hundred MiB) the gaps between chunks
        # moved the cliffs enough to halve the recovery rate.
        again = None if slow else refill_cliff(rows, fast)
        # Cancelled before its cliff (a save is waiting): maybe a moment from it, so the cache
        # counts as full at its end (the save then lets it drain first, checkpoint/pacing.py).
        # Counted as the drive's writes since the last save instead, spread over the whole
        # time, its bytes passed for drained, and the save met the cliff.
        cut = stop is not None and stop.is_set() and again is None and not slow
        full = again is not None or slow or cut
        if attempts is not None:
            attempts.append({"gap_s": gap, "bytes": refill_bytes, "seconds": written - began,
                             "drain_at_least": cut_bound(rows, since, probed, fast, post)
                             if cut else None,
                             "probes_bytes": probed + sum(r[1] for r in rows) - refill_bytes,
                             "found": "cliff" if again else "still in the cliff" if slow
                             else "cut short" if cut else "no cliff",
                             "reading": (since + again.seconds, probed + again.bytes_before)
                             if again else None})
        if again is not None:
            refills.append((since + again.seconds, probed + again.bytes_before))
            # Not 4 x a retried gap: that could drain the whole cache.
            wait += apart
        elif slow and wait < MAX_IDLE:
            wait = min(MAX_IDLE, max(2 * wait, 0.25))
        else:
            break  # the cache drained completely (or never let go): no second reading
        if stop is not None and stop.is_set():
            break
    return refills, ended if full else None


#: Writes that carry a refill on where it ran out of bytes before its cliff.
MORE_WRITES = 2


def _write_to_cliff(directory: Union[str, os.PathLike], size: int, cap: float, fast: float,
                    post: float, stop: Optional[threading.Event]):
    """A refill's write of ``size`` bytes, ended soon after its cliff; where it wrote them all
    and met none (sized by a post-cache rate read low, say: the drive folds faster than
    the size allowed for), written on at once, twice as much each time, at most
    ``MORE_WRITES`` times, while all it wrote is below ``cap`` (less than the cache holds:
    more, and the cache had drained completely, which no cliff reading measures). (Ended
    there, it gave no reading, and the drain stood assumed at the slow end: saves took
    10-25 x the shortest.) Returns the
    first write's ProbePoint, the joined timeline (:func:`point_timeline`, on the first
    write's clock), when (time.monotonic()) the first began and the last request completed,
    and the bytes written."""
    below = stop_below(fast, post)
    point, began, ended = timed_write(directory, size, stop_below=below, stop=stop)
    rows, nbytes, asked, more = point_timeline(point), point.bytes, size, point
    for _ in range(MORE_WRITES):
        ran_out = more.bytes >= asked and (stop is None or not stop.is_set())
        if not ran_out or nbytes >= cap or refill_cliff(rows, fast) is not None:
            break
        asked = int(min(2 * asked, cap - nbytes))
        if asked < (1 << 20):
            break
        more, start, ended = timed_write(directory, asked, stop_below=below, stop=stop)
        rows += [(end + start - began, b, pace) for end, b, pace in point_timeline(more)]
        nbytes += more.bytes
    return point, rows, began, ended, nbytes


#: A drop a refill came back from, to this share of the new-file rate on average over
#: ``COMEBACK_S``, was a stall of the disk, not its cliff: in its cliff a drive written on
#: stays there, at its post-cache rate (at most 45% of the new-file rate in the family of
#: docs/emulation.md) or, tapering, at its drain (at most 72%).
COMEBACK_SHARE = 0.85
COMEBACK_S = 0.2


def refill_cliff(rows: Sequence[Tuple[float, float, float]], fast: float):
    """The cliff in a refill's timeline ``rows`` (find_cliff's), past any drop the write came
    back from to the drive's new-file rate ``fast`` (``COMEBACK_SHARE`` of it over
    ``COMEBACK_S``): a stall of the disk. Read as the cliff, such a drop put a refill's
    reading at 0.4-0.8 x the drain, and a pair of readings that contradict each other left
    the lower one, which sized the cache 1.3 x too large and paced later saves at 0.4 x."""
    cliff = find_cliff(rows)
    for _ in range(8):  # stalls in one refill: a few at most
        back = _comeback(rows, cliff.seconds, fast) if cliff is not None else None
        if back is None:
            return cliff
        cliff = find_cliff(rows, after=back)
    return None


def _comeback(rows: Sequence[Tuple[float, float, float]], drop: float, fast: float
              ) -> Optional[float]:
    """Where (seconds into the write) a write that dropped at ``drop`` came back to
    ``COMEBACK_SHARE`` x ``fast`` on average over ``COMEBACK_S``; None if it did not."""
    table = [r for r in intervals(rows) if r[0] >= drop + 0.05]  # past the drop's own edge
    for k, first in enumerate(table):
        window = [r for r in table[k:] if r[1] <= first[0] + COMEBACK_S + 1e-9]
        if window and window[-1][1] - first[0] >= COMEBACK_S - 1e-9 and \
                mean_rate(window) >= COMEBACK_SHARE * fast:
            return first[0]
    return None


def cut_bound(rows: Sequence[Tuple[float, float, float]], since: float, before: float,
              fast: float, post: float) -> Optional[float]:
    """The least recovery rate a refill cut short before its cliff showed: every byte it
    wrote while it still ran above the midpoint of the new-file and post-cache rates (up to
    the end of its last ``FAST_WINDOW_S`` that did: :func:`~flashstream.telemetry.cliff.
    fast_until`) went into room the drive had freed since the cache was full, ``since``
    seconds before the refill's timeline ``rows`` began, ``before`` bytes written meanwhile.
    None where it never ran fast."""
    upto = fast_until(rows, stop_below(fast, post))
    if upto is None or since + upto[0] <= 0:
        return None
    return (before + upto[1]) / (since + upto[0])


def _in_cliff(point, fast: float, post: float) -> bool:
    """Whether a write ran below the midpoint of the new-file and post-cache rates: the
    drive was in its cliff for most of it."""
    return point.bytes / max(point.seconds, 1e-9) < 0.5 * (fast + post)


def _slow_start(point, fast: float, post: float) -> bool:
    """Whether a write's first ``LEAVE_PROBE_S`` (all of it, if shorter) ran below the
    midpoint of the new-file and post-cache rates: the drive was in its cliff from its first
    byte."""
    rows = point_timeline(point)
    first = rows[:next((k + 1 for k, r in enumerate(rows) if r[0] >= LEAVE_PROBE_S - 1e-9),
                       len(rows))]
    if not first or first[-1][0] <= 0:
        return _in_cliff(point, fast, post)
    return sum(r[1] for r in first) / first[-1][0] < 0.5 * (fast + post)


#: Seconds of writing that tell whether a drive has left its cliff before a refill.
LEAVE_PROBE_S = 0.1


def _leave_cliff(directory: Union[str, os.PathLike], fast: float, post: float,
                 stop: Optional[threading.Event], latest: float
                 ) -> Tuple[float, Optional[float], Optional[Tuple[list, float]]]:
    """Short writes (``LEAVE_PROBE_S``) until one runs faster than the midpoint of the two
    rates, the drive out of its cliff, with idle waits between that double from the probe's
    own length (a drive folding at half its post-cache rate frees what a probe in its cliff
    wrote in twice the probe's time), until ``latest`` (time.monotonic()) or ``stop``. Returns
    the bytes they all wrote, when (time.monotonic()) the first began, and the last one's
    timeline (:func:`point_timeline`) and start (None where none ran)."""
    written, first, last, wait = 0.0, None, None, 2 * LEAVE_PROBE_S
    while stop is None or not stop.is_set():
        point, began, _ended = timed_write(directory, int(LEAVE_PROBE_S * fast) + (1 << 20),
                                           seconds=LEAVE_PROBE_S, stop=stop)
        first = began if first is None else first
        written += point.bytes
        last = (point_timeline(point), began)
        if not _in_cliff(point, fast, post) or time.monotonic() + wait > latest:
            break
        if stop is None:
            time.sleep(wait)
        elif stop.wait(wait):
            break
        wait *= 2
    return written, first, last


def refill_drain(refills: Sequence[Tuple[float, float]],
                 fast: Optional[float]) -> Optional[float]:
    """The recovery rate from refills of a full cache: ``(seconds since it was full until the
    refill's cliff, bytes the refill wrote before it)``. Each took ``drain x seconds`` bytes,
    plus the same detection lag, so the difference of two readings gives the rate; a single
    reading gives it with the lag in (a little high), as do two that contradict each other (the
    lower of the two then). None without a usable reading. At most :func:`most_drain`
    (95% of ``fast``)."""
    usable = _usable(refills)
    if len(usable) >= 2:
        (t1, b1), (t2, b2) = usable[0], usable[-1]
        if two_readings(refills):
            rate = (b2 - b1) / (t2 - t1)
        elif t2 > t1 and b2 > b1 and (b2 - b1) / (t2 - t1) > EARLY_SHARE * b2 / t2:
            # A difference above the longer single reading: the shorter one's cliff came
            # early (its lag below the longer one's, so below none). The longer one, with its
            # lag in, stands.
            rate = b2 / t2
        else:
            # A longer gap that took no more bytes, or far too few (two_readings): one cliff
            # was misplaced, which one is not known; the lower single reading.
            rate = min(b1 / t1, b2 / t2)
    elif usable:
        rate = usable[0][1] / usable[0][0]
    else:
        return None
    return min(most_drain(fast) or rate, max(rate, 1.0))


def most_drain(fast: Optional[float]) -> Optional[float]:
    """The fastest recovery rate a reading may give a drive whose new-file rate is ``fast``
    (None: unknown): 95% of it. A drive that folds as fast as it writes has no cliff to plan
    around."""
    return 0.95 * fast if fast else None


def two_readings(refills: Sequence[Tuple[float, float]]) -> bool:
    """Whether ``refills`` give the recovery rate as a difference, the detection lag
    cancelled (:func:`refill_drain`): else it is one reading's, with the lag in (an
    estimate)."""
    usable = _usable(refills)
    if len(usable) < 2:
        return False
    (t1, b1), (t2, b2) = usable[0], usable[-1]
    if not (t2 > t1 and b2 > b1):
        return False
    # The lag puts each single reading a little above the drain, the longer one least: a
    # difference far below it means one refill's cliff was misplaced (a stall read as the
    # cliff), not a slow drive. (Taken as measured, such a pair gave 0.07 x the drain.) One
    # above it means the shorter one's cliff came early: its lag was below the longer one's.
    # (Taken as measured, such a pair gave 1.11 x the drain, and the next save met a cliff
    # of 9 s.)
    difference, longer = (b2 - b1) / (t2 - t1), b2 / t2
    return CONSISTENT_SHARE * longer <= difference <= EARLY_SHARE * longer


#: The least share of the longer refill's single reading that the difference of two readings
#: may come to and still be taken as the drain (:func:`two_readings`).
CONSISTENT_SHARE = 0.5
#: ... and the most: above the longer reading, by more than the noise of the two cliffs'
#: placements (their lags differ by about 10 MB here, which is 1-2% of a difference over a
#: few seconds), the shorter one's cliff came early.
EARLY_SHARE = 1.03


def _usable(refills: Sequence[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """The readings with time and bytes, shortest gap first."""
    return sorted((t, b) for t, b in refills if t > 0 and b > 0)


def stop_below(fast: float, post: float) -> float:
    """The rate below which a refill has met its cliff: midway between the fast and the
    post-cache rate (a post-cache rate known too high counts as at most half the fast one)."""
    return 0.5 * (fast + min(post, 0.5 * fast))


def _refill_size(gap: float, fast: float, post: float) -> int:
    """Bytes a refill writes after ``gap`` seconds idle on a cache left full. Folding at ``d``
    frees ``d * gap``, and writing at ``fast`` fills it back after ``fast * d * gap / (fast -
    d)`` bytes; the longest of these is at the fastest fold to expect: 1.6 x the post-cache
    rate (drives fold faster idle than they write in the cliff, docs/emulation.md). A fifth
    more for noise, then a second in the cliff for find_cliff's hold. (A refill sized from the
    cache instead missed its cliff whenever the disk wrote slower than at the first write, and
    the recovery rate fell back to an assumption.)"""
    fold = min(1.6 * post, 0.9 * fast)
    to_cliff = fast * fold * gap / (fast - fold)
    return int(1.2 * to_cliff + post) + (32 << 20)
