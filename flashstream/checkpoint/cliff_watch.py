"""Seeing a drive's write cliff live, from a write's progress and the reads beside it.

The save controller (save_control.py) hands every look here: seconds since the write began,
bytes it completed, bytes the drive took from every writer. A cliff shows as:

- an **unpaced** write falling below ``CLIFF_SHARE`` of its rate before for ``HOLD_S`` (not a
  stall: in its cliff a drive keeps completing, at its post-cache rate);
- a **paced** write completing under ``SHORTFALL`` of its pace for ``HOLD_S``: in its cliff a
  drive writes no faster than its post-cache rate, whatever the pace;
- **reads** beside a paced write (or none) slowing to ``READ_SLOWDOWN`` x their quiet latency:
  a folding drive holds reads back. Not beside an unpaced write, whose large requests queue
  reads by themselves.

:func:`placed` puts the cliff's start where the lines the bytes followed before and after it
meet.
"""

from __future__ import annotations

import math
import statistics
from typing import List, Optional, Sequence, Tuple

__all__ = ["CLIFF_SHARE", "DRIVE", "HOLD_S", "RATE_NOISE", "SHORTFALL", "SLICE_S", "STALL_S",
           "WRITE", "Look", "ReadWatch", "bytes_at", "dropped", "placed", "rate_between",
           "spread_of", "stalled"]

# (seconds since the write began, bytes it completed, bytes the drive took from every writer)
Look = Tuple[float, float, float]
WRITE, DRIVE = 1, 2  # the columns of a Look

#: A write below this share of its rate before is in the cliff: a dense drive's post-cache
#: rate is 15-45% of its cache rate (docs/emulation.md's family), noise a tenth or two.
CLIFF_SHARE = 0.5
#: Seconds a drop must last: two of a drive's (or the block-I/O throttle's) slices, so that
#: completions in bursts cannot pass for it.
HOLD_S = 0.2
#: Seconds without a completion that make a window a stall of the disk, not its cliff: longer
#: than the gaps between a throttle's slices.
STALL_S = 0.15
#: Seconds of one of a drive's (or the throttle's) slices: a new limit, or a cliff, releases a
#: slice's worth at once.
SLICE_S = 0.1
#: A paced write that completes less than this share of its pace is held back by the drive.
SHORTFALL = 0.8
#: The spread, as a share, of the rate a drive completes over a hold about its mean: a rate
#: read off one hold, or one slice, may be that far off the drive's.
RATE_NOISE = 0.1
#: Reads this many times slower than when quiet are held back by the drive's folding (a fold
#: slice, tens to hundreds of ms), not by a paced writer's queue (a few tenths of that) ...
READ_SLOWDOWN = 10.0
#: ... and at least this slow on average (seconds): behind a paced writer's requests a read
#: waits milliseconds, behind a fold slice tens of them.
READ_SLOW_S = 0.02
#: Reads within this many times their quiet latency are not held back (the noise of reads,
#: and a paused writer's last requests).
READ_QUICK = 3.0


def rate_between(looks: Sequence[Look], start: float, end: float, column: int = WRITE) -> float:
    """Bytes/s of ``column`` (1: the write's, 2: the drive's) between the looks nearest to
    ``start`` and ``end`` at or inside them (0 over less than a look)."""
    inside = [lk for lk in looks if start - 1e-9 <= lk[0] <= end + 1e-9]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return 0.0
    return (inside[-1][column] - inside[0][column]) / (inside[-1][0] - inside[0][0])


def stalled(looks: Sequence[Look], start: float) -> bool:
    """Whether the write completed nothing for ``STALL_S`` or longer after ``start``."""
    inside = [lk for lk in looks if lk[0] >= start - 1e-9]
    since = None
    for a, b in zip(inside, inside[1:]):
        if b[1] > a[1]:
            since = None
            continue
        since = a[0] if since is None else since
        if b[0] - since >= STALL_S:
            return True
    return False


def dropped(looks: Sequence[Look], run_from: float, now: float, before_at_least: float = 0.0
            ) -> Optional[float]:
    """Where an unpaced run that began at ``run_from`` fell below ``CLIFF_SHARE`` of its rate
    before (at least ``before_at_least``) for the hold that ends at ``now``, not stalling:
    the start of that hold; None where it did not."""
    low_from = now - HOLD_S
    if low_from - run_from < HOLD_S + SLICE_S:
        return None
    # Not the run's first slice: a throttle (or a drive's queue) lets a slice's worth through
    # at once as a write starts, well above the rate it keeps.
    before = max(rate_between(looks, run_from + SLICE_S, low_from), before_at_least)
    if before <= 0 or rate_between(looks, low_from, now) >= CLIFF_SHARE * before or \
            stalled(looks, low_from):
        return None
    return low_from


def placed(looks: Sequence[Look], low_from: float, run_from: float, above: float
           ) -> Tuple[float, float]:
    """When a cliff confirmed low from ``low_from`` on began (seconds into the write), and how
    far off that may be: where the lines fitted to the write's bytes over the ``2 * HOLD_S``
    before ``low_from`` (within its run from ``run_from``) and after it meet, off by the
    bytes' scatter about them over the difference of their slopes. Where they cannot be fitted
    or do not meet within a hold of ``low_from``: the end of the write's last slice at
    ``above`` bytes/s or faster, not before ``run_from``, off by a hold (the hold that
    confirmed it). Placed late, a cliff costs a reading little (the bytes it adds came near
    the drain); placed early, it loses bytes written at the full rate."""
    before = [lk for lk in looks if max(run_from, low_from - 2 * HOLD_S) <= lk[0] <= low_from]
    after = [lk for lk in looks if lk[0] >= low_from]
    if len(before) >= 3 and len(after) >= 3:
        fast = statistics.linear_regression([lk[0] for lk in before], [lk[1] for lk in before])
        slow = statistics.linear_regression([lk[0] for lk in after], [lk[1] for lk in after])
        if fast.slope > slow.slope:
            meet = (slow.intercept - fast.intercept) / (fast.slope - slow.slope)
            if low_from - HOLD_S <= meet <= low_from + HOLD_S:
                scatter = math.hypot(_scatter(before, fast), _scatter(after, slow))
                return meet, scatter / (fast.slope - slow.slope)
    last = max(run_from, low_from)
    for t, _done, _drive in looks:
        if max(run_from, low_from - HOLD_S) + SLICE_S <= t <= looks[-1][0] - SLICE_S and \
                rate_between(looks, t - SLICE_S, t) >= above:
            last = max(last, t)
    return last, HOLD_S


def spread_of(cliff) -> float:
    """Seconds a reference cliff's placement may be off: its spread, else (a probe's) a hold."""
    return HOLD_S if cliff.spread is None else cliff.spread


def _scatter(looks: Sequence[Look], line) -> float:
    """The bytes' standard deviation about a fitted line."""
    residuals = [lk[1] - (line.intercept + line.slope * lk[0]) for lk in looks]
    return math.sqrt(sum(r * r for r in residuals) / max(1, len(residuals) - 2))


def bytes_at(looks: Sequence[Look], t: float, column: int = WRITE) -> float:
    """The bytes of ``column`` at ``t`` seconds, between the two looks around it."""
    prev = looks[0]
    for lk in looks:
        if lk[0] >= t:
            span = lk[0] - prev[0]
            share = (t - prev[0]) / span if span > 0 else 1.0
            return prev[column] + share * (lk[column] - prev[column])
        prev = lk
    return looks[-1][column]


class ReadWatch:
    """The reads' mean latency on the drive lately against their quiet mean ``quiet`` (seconds
    per read; None: unknown, and the absolute floors alone judge)."""

    MIN_READS = 4  # fewer reads in a window say nothing of their latency

    def __init__(self, quiet: Optional[float]) -> None:
        self.quiet = quiet
        self._counts: List[Tuple[float, int, float]] = []  # (t, reads, seconds reading)

    def add(self, t: float, reads: Optional[int], read_s: Optional[float]) -> None:
        if reads is None or read_s is None:
            return
        self._counts = [c for c in self._counts if t - c[0] <= 2 * HOLD_S] + [
            (t, reads, read_s)]

    def quick(self, seconds: float = SLICE_S) -> bool:
        """Reads over the last ``seconds`` back within ``READ_QUICK`` x quiet (or a quarter of
        ``READ_SLOW_S``): the drive left its cliff."""
        mean = self._mean(seconds)
        return mean is not None and mean <= max(READ_QUICK * (self.quiet or 0.0),
                                                0.25 * READ_SLOW_S)

    def _mean(self, seconds: float) -> Optional[float]:
        if len(self._counts) < 2:
            return None
        last = self._counts[-1]
        first = next((c for c in self._counts if last[0] - c[0] <= seconds), None)
        if first is None or last[0] - first[0] < 0.8 * seconds:
            return None
        reads = last[1] - first[1]
        return (last[2] - first[2]) / reads if reads >= self.MIN_READS else None

    def slowed(self) -> bool:
        """Reads over the last hold slower than ``READ_SLOWDOWN`` x quiet (and ``READ_SLOW_S``)."""
        mean = self._mean(HOLD_S)
        return mean is not None and mean >= max(READ_SLOWDOWN * (self.quiet or 0.0),
                                                READ_SLOW_S)
