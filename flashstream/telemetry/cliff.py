"""Reading a write cliff off a write's timeline: where a drive's write speed fell off for good,
how fast it wrote after (where the drive, not a pacer, set the pace), and stalls that are not
the cliff. Pure functions of the timeline, shared by the probe's sustained writes, checkpoint
saves and the emulator's tests."""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import List, Optional, Sequence, Tuple

__all__ = ["CLIFF_HOLD_S", "Cliff", "FAST_WINDOW_S", "Timeline", "drive_limited", "fast_until",
           "find_cliff", "intervals", "mean_rate"]

# (end of interval s, bytes completed in it, pacing rate in force, 0 = unpaced)
Timeline = Sequence[Tuple[float, float, float]]

#: Seconds a drop must last to be the cliff; the drive's own pace in the cliff is read after
#: them (they still complete requests it took before, and the throttle's first slice).
CLIFF_HOLD_S = 0.5


@dataclasses.dataclass(frozen=True)
class Cliff:
    seconds: float             # when the drop began, since the write started
    bytes_before: float        # bytes completed before it
    rate: Optional[float]      # median bytes/s in the cliff where the drive, not the pacer,
    #                            set the pace (None: the pacer held it below the drive)
    fast_rate: Optional[float]  # mean unpaced bytes/s before it (None: paced throughout)
    rate_seconds: float = 0.0   # seconds of the drive's own pace that ``rate`` comes from


def intervals(timeline: Timeline) -> List[Tuple[float, float, float, float]]:
    """The timeline as ``(start, end, bytes/s, pace)`` rows, less its last interval (the queue
    draining) where there are more than two."""
    out, start = [], 0.0
    for end, nbytes, pace in timeline:
        if end > start:
            out.append((start, float(end), float(nbytes) / (end - start), float(pace)))
        start = float(end)
    return out[:-1] if len(out) > 2 else out  # the last one is the queue draining


# find_cliff(unpaced=True): back at this share of the peak is the drive writing from its cache
# again. Well above any post-cache rate (20-45% of fast in the documented range; plc 25%, qlc
# 38%), so a cliff's own noise does not pass for a comeback.
RECOVERED = 0.8


def find_cliff(timeline: Timeline, *, ratio: float = 0.5, hold: float = CLIFF_HOLD_S,
               warmup: float = 0.15, unpaced: bool = False, after: float = 0.0
               ) -> Optional[Cliff]:
    """The write cliff in a write's timeline: the first moment from which throughput stays
    (on average) below ``ratio`` x what was expected (the best ``warmup``-long stretch so far,
    or the pacing rate if lower) for ``hold`` seconds, and stays low on average after.

    ``unpaced``: the whole write ran unpaced and long past its cliff (the sustained probe's
    first write, 4 x the cache): a drive in its cliff then stays in it, but for what it folds
    while the disk stalls. A drop the write comes back from (to ``RECOVERED`` x its peak) is
    judged by :func:`_stall_end`; a stall before the cache was full is not the cliff (one read
    as the cliff put a 1.7 GiB cache at 447 MiB), and the search goes on after it. A paced
    save may leave its cliff once the pacer lets the cache drain: not for those.

    ``after``: seconds into the write before which no drop is the cliff (the caller judged
    one there a stall); the stretch before the cliff is read from there on."""
    rows = intervals(timeline)
    if not rows:
        return None
    width = max(1e-6, statistics.median(r[1] - r[0] for r in rows))
    smooth = max(1, round(warmup / width))
    run = max(2, round(hold / width))
    peak, done = 0.0, 0.0
    # The stretch before the cliff starts here: after the last stall.
    floor = next((k for k, r in enumerate(rows) if r[0] >= after), len(rows)) if after else 0
    for i, (start, _end, bps, pace) in enumerate(rows):
        expected = min(peak, pace) if pace > 0 else peak
        window = rows[i:i + run]
        # The first interval low, and the next `hold` seconds low on average (single short
        # intervals hold whole requests, so they scatter around the true rate), each interval
        # against its own pace: a pacer that slows down is not a cliff. Not inside a stall
        # the write came back from (before `floor`).
        if (i >= floor and expected > 0 and len(window) == run and bps < ratio * expected
                and mean_rate(window) < ratio * _allowed(window, peak)):
            back = _stall_end(rows, i, smooth, peak, ratio, done) if unpaced else None
            after = rows[i:]
            if back is not None:
                floor = back
            elif mean_rate(after) < ratio * _allowed(after, peak):
                # Means, not medians: a 50 ms interval holds a few whole requests, so single
                # intervals' rates are quantized to multiples of request size / width.
                # The first `hold` seconds in the cliff still complete requests the drive took
                # before it (they were past the throttle, or in its cache): leave them out.
                free = drive_limited(rows[i + run:])
                # The whole unpaced run up to the cliff, stalls in, not only after the last
                # stall: where a drive completes requests in bursts (full rows between empty
                # ones) the stretch after the last drop the write came back from can be one
                # burst, twice the drive's rate; pacing then called the drive's true rate a
                # cliff.
                before = [r for r in rows[:i] if r[3] <= 0]
                start, done = _refined(rows, i, run, start, done, floor)
                return Cliff(start, done, mean_rate(free) if len(free) >= run else None,
                             mean_rate(before) if before else None,
                             sum(r[1] - r[0] for r in free))
        if i + 1 >= smooth:
            peak = max(peak, statistics.fmean(r[2] for r in rows[i + 1 - smooth:i + 1]))
        done += bps * (rows[i][1] - start)
    return None


def _stall_end(rows, low: int, smooth: int, peak: float, ratio: float,
               done: float) -> Optional[int]:
    """Where an unpaced write low from interval ``low`` came back from a stall, or None if the
    drop is its cliff.

    In its cliff a drive writes at its post-cache rate on average: it writes faster only for
    the room it folded while written slower (after a stall), so from the drop to the end of
    its last fast stretch it writes no more than the post-cache rate allows. Before the cache
    is full it writes the room left besides, however many stalls come between. So: the
    bytes from the drop to the end of the write's last fast stretch, less the post-cache rate
    over that time, against a margin for noise (a quarter second at that rate, 3% of the
    bytes so far). The post-cache rate is the median interval of the write's second half (a
    stall there does not move it much)."""
    post = statistics.median(r[2] for r in rows[len(rows) // 2:])
    if post >= RECOVERED * peak:
        post = ratio * peak  # no cliff at the end: any comeback is one from a stall
    fast = RECOVERED * peak

    def fast_from(j: int) -> bool:  # a fast interval, and fast on average from it
        return rows[j][2] >= fast and statistics.fmean(r[2] for r in rows[j:j + smooth]) >= fast

    back = next((j for j in range(low + 1, len(rows) - smooth + 1) if fast_from(j)), None)
    if back is None:
        return None
    last = next(j for j in range(len(rows) - smooth, back - 1, -1) if fast_from(j))
    net = sum((r[2] - post) * (r[1] - r[0]) for r in rows[low:last + smooth])
    return back if net > max(0.25 * post, 0.03 * done) else None


def _refined(rows, i: int, run: int, start: float, done: float,
             floor: int = 0) -> Tuple[float, float]:
    """Where the cliff really began: the meeting point of two straight lines fitted to the
    bytes completed over time, one before the first low interval ``i`` (from ``floor``: after
    a stall) and one after the next ``run`` (the hold). A chance dip just before the cliff, or
    one slow interval too few, then moves the estimate by less than an interval instead of by
    the dip's distance (10% of a small cache). Falls back to ``(start, done)`` where the write
    stalled after the cliff (:func:`_stalled`), where either side is too short, or where the
    lines do not meet near ``i`` and after the before-line's first point (a stall inside the
    cliff lowers the line after it until the two met inside the stall before ``floor``, at a
    negative byte count)."""
    if _stalled(rows[i:]):
        return start, done
    points, total = [(0.0, 0.0)], 0.0
    for s, e, bps, _pace in rows:
        total += bps * (e - s)
        points.append((e, total))
    before, after = points[floor:i + 1], points[i + 1 + run:]
    if len(before) < 3 or len(after) < max(3, run):
        # A short write past its cliff (a save or a refill that ended within a second of
        # it): the split where two lines fit it best. (The line after was fitted to the few
        # points past the hold, where the write was ending, or to all of it but its first
        # interval, taking in the fast run between a throttle gap read as the first low
        # interval and the cliff: a save 0.5 s into its cliff read the cliff 0.3 GB late,
        # and the cache was sized that much too large.)
        split = _bend(points, floor, i)
        if split is None:
            return start, done
        before, after = points[floor:split + 1], points[split + 1:]
    fast = statistics.linear_regression(*zip(*before))
    slow = statistics.linear_regression(*zip(*after))
    if fast.slope <= slow.slope:
        return start, done
    meet = (slow.intercept - fast.intercept) / (fast.slope - slow.slope)
    width = rows[min(i + run, len(rows) - 1)][1] - rows[i][0]
    at = fast.intercept + fast.slope * meet
    if not max(start - width, before[0][0]) <= meet <= start + width or at <= 0:
        return start, done
    return meet, at


def _bend(points, floor: int, low: int) -> Optional[int]:
    """The point, from the first low interval ``low`` on, after which a second straight line
    fits the bytes completed over time (``points``, from ``floor``) with the least squared
    error of the two lines together; None where either side would hold fewer than 3 points."""
    best, split = math.inf, None
    for k in range(max(low, floor + 2), len(points) - 3):
        error = _line_error(points[floor:k + 1]) + _line_error(points[k + 1:])
        if error < best:
            best, split = error, k
    return split


def _line_error(points) -> float:
    """The squared error of the straight line fitted to ``points``."""
    xs, ys = zip(*points)
    line = statistics.linear_regression(xs, ys)
    return sum((y - line.intercept - line.slope * x) ** 2 for x, y in points)


# A stall in the cliff: this many seconds in a row below this share of the cliff's mean rate
# (time-weighted: the comeback after a stall pays it back, so the mean stays near the
# post-cache rate, where a median is 0 once most intervals are empty). Noise (10% per interval
# on the emulator) stays far above it, and the block-I/O throttle's gaps are shorter: in its
# cliff the emulated drive writes in bursts every 100 ms, with up to 60 ms of empty 20 ms
# intervals between them. A pacer holding a save far below the drive (read_slo at its floor)
# for this long counts as one too; the first slow interval then stands, which costs at most
# the chance dip the refinement corrects.
STALL_SHARE = 0.25
STALL_S = 0.2


def _stalled(rows) -> bool:
    """Whether the write stalled in ``rows`` (those from the cliff on): the drive held it while
    it folded, then wrote faster for what it folded. The line fitted after the cliff then runs
    through both and meets the line before it away from the cliff (simulated 0.3-1.2 s
    stalls: a mean error of 110 ms against 23 ms for the first slow interval)."""
    typical = mean_rate(rows)
    low = 0.0
    for start, end, bps, _pace in rows:
        low = low + (end - start) if bps < STALL_SHARE * typical else 0.0
        if low >= STALL_S * (1 - 1e-6):
            return True
    return False


def _allowed(rows, peak: float) -> float:
    """The mean bytes/s the pacing allowed over ``rows``: each interval's pace, or ``peak``
    where it was unpaced (or paced above it)."""
    seconds = sum(r[1] - r[0] for r in rows)
    allowed = sum((min(peak, r[3]) if r[3] > 0 else peak) * (r[1] - r[0]) for r in rows)
    return allowed / seconds if seconds > 0 else 0.0


#: Seconds of consecutive paced rows judged together by :func:`drive_limited`.
DRIVE_WINDOW_S = 0.25


def drive_limited(rows, slack: float = 1.2, window: float = DRIVE_WINDOW_S) -> list:
    """The rows in which the drive, not a pacer, set the throughput: unpaced, or paced more
    than ``slack`` x above what completed (requests queued behind the drive). Only these show
    what the drive can do; a paced row shows the pacer.

    Paced rows are judged in stretches of ``window`` seconds, not one by one: a row holds
    whole requests, and a drive (or a throttle) that completes them in bursts leaves empty
    rows between full ones. Judged alone, the empty rows passed for the drive's pace and the
    full ones for the pacer's, and the rate read from them came out at a fraction of the
    drive's."""
    out: list = []
    stretch: list = []

    def judge() -> None:
        seconds = sum(r[1] - r[0] for r in stretch)
        pace = sum(r[3] * (r[1] - r[0]) for r in stretch) / seconds if seconds > 0 else 0.0
        if stretch and pace > slack * mean_rate(stretch):
            out.extend(stretch)
        stretch.clear()

    for r in rows:
        if r[3] <= 0:
            judge()
            out.append(r)
            continue
        stretch.append(r)
        if stretch[-1][1] - stretch[0][0] >= window:
            judge()
    judge()
    return out


#: Seconds of writing judged together by :func:`fast_until`: the block-I/O throttle passes a
#: writer at the new-file rate in slices, with an empty 20 ms interval every 100 ms.
FAST_WINDOW_S = 0.1


def fast_until(timeline: Timeline, below: float) -> Optional[Tuple[float, float]]:
    """The end of the last ``FAST_WINDOW_S`` of a write's ``timeline`` that ran at ``below``
    bytes/s or faster on average, and the bytes completed by then: where a write cut off (or
    ended) before its cliff could be seen was last out of it (a drop shows at once, where a
    cliff is only confirmed after ``CLIFF_HOLD_S``). None where no window ran that fast."""
    points, total = [(0.0, 0.0)], 0.0
    for end, nbytes, _pace in timeline:
        total += nbytes
        points.append((float(end), total))
    last, k = None, 0
    for end, done in points[1:]:
        while k + 1 < len(points) and points[k + 1][0] <= end - FAST_WINDOW_S + 1e-9:
            k += 1
        start = points[k]
        if start[0] <= end - FAST_WINDOW_S + 1e-9 and (done - start[1]) >= below * (
                end - start[0]):
            last = (end, done)
    return last


def mean_rate(rows) -> float:
    """Bytes/s over ``rows``, weighted by their length."""
    seconds = sum(r[1] - r[0] for r in rows)
    return sum(r[2] * (r[1] - r[0]) for r in rows) / seconds if seconds > 0 else 0.0
