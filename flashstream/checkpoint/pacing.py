"""rate="auto": plan each save from the drive's write model so its cache never fills.

The planner (clock-free, so tests drive it with synthetic progress) keeps an estimate of the
bytes in the drive's write cache: what the model remembered from the last save, drained at the
recovery rate since, plus every byte the drive is given meanwhile, less what it folds. The
drive's own counter (/proc/diskstats) gives those bytes where it is known, so writes from other
processes fill the estimate as they fill the cache; they also count as a slower drain in every
pace below (the drain left for this save: the recovery rate less their rate over the last
second). Without the counter, only this save's bytes are counted.

- With a deadline (``within=``), it paces at the flattest rate that finishes in time:
  ``remaining / time left`` (of all schedules, the one that fills the cache least and leaves
  reads the most of the drive at every moment). If that fills the cache past its ceiling
  (below) before the end, no schedule meets the deadline without the cliff (each has the
  same drain to spend over the time left): a conflict, warned once; then ``deadline_policy``
  says what to do: "avoid-cliff" (default) paces at the fastest flat rate that ends with the
  cache at its ceiling, and finishes late; "meet-deadline" keeps the flat rate and enters the
  cliff.
- Without one, it writes unpaced while the estimated headroom lasts, then at that same
  fastest flat pace for the rest.
- ``read_slo`` (a p95 in seconds for reads on the same drive) lowers the rate while reads miss
  it and raises it back while they meet it, never below what the deadline needs.

The fastest flat pace counts on the drain at only ``sustain`` x the estimate (the recovery
rate, less other writers'), from the save's start (the cache counted that way is ``worst``),
and lets the cache end at ``ceiling`` of its size; past the ceiling by that count it sustains
at ``sustain`` x the drain, and once that count has reached the ceiling it never bursts
again. That makes ``sustain`` a real margin for a drain the model has too high. (Before, the
save sustained at ``sustain`` x the drain past the headroom, the estimate then fell back under
the headroom, and the save burst again: on average it wrote at the full estimated drain, and
a long save on a drain estimated high filled the cache; docs/checkpoint.md has the figures.)

A save that starts with the cache estimated at its ceiling or over, or with an estimate that
dates from a full cache (a measurement after the last save left it full just before this one)
not yet drained to ``resume``, may start in the drive's cliff, which a drive leaves only once
folding has freed a margin (up to a quarter of the cache in the family of docs/emulation.md).
A drive that folds no faster than it is written in its cliff stays there while written at
the drain. So, unless the policy is "meet-deadline", the save first writes at a crawl
(``CRAWL_SHARE`` of the drain) until the estimate has fallen to ``resume`` of the cache.

A controller thread (checkpoint/save_control.py) runs the planner every ``tick`` seconds
against the write's progress, and sooner while an unpaced burst could reach the headroom
before the next tick (``burst_left``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import List, Optional, Tuple

from ..telemetry.write_model import drained

__all__ = ["DEADLINE_POLICIES", "CachePlanner", "PlanSettings"]

log = logging.getLogger(__name__)
DEADLINE_POLICIES = ("avoid-cliff", "meet-deadline")
#: The pace, as a share of the drain, of a save waiting for a full cache to drain (see the
#: module docstring): slow enough that the drive folds almost at its idle rate.
CRAWL_SHARE = 0.1
#: The shortest span over which CachePlanner.peak_rate measures: a single request's
#: completion over a millisecond or two is no rate.
PEAK_SPAN_S = 0.01


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """headroom: write unpaced while the cache estimate is below this share of its size.
    sustain: the share of the estimated drain (the recovery rate, less other writers' rate)
        pacing counts on past the headroom: the margin for a drain the model has too high.
    ceiling: past the headroom, pace so that the cache would end at most this share full
        should it drain at only ``sustain`` x the estimate (at least ``headroom``).
    resume: a save that starts with the cache at its ceiling or over writes at a crawl until
        the estimate has fallen to this share (at most ``ceiling``).
    finish: aim to finish by this share of the deadline (slack for the drive's noise).
    deadline_policy: "avoid-cliff" or "meet-deadline" (see the module docstring).
    """

    headroom: float = 0.85
    sustain: float = 0.9
    finish: float = 0.9
    deadline_policy: str = "avoid-cliff"
    ceiling: float = 0.95
    resume: float = 0.75

    def __post_init__(self) -> None:
        for name in ("headroom", "sustain", "finish", "ceiling", "resume"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        if self.ceiling < self.headroom:
            raise ValueError(f"ceiling must be at least headroom ({self.headroom!r}), got "
                             f"{self.ceiling!r}")
        if self.resume > self.ceiling:
            raise ValueError(f"resume must be at most ceiling ({self.ceiling!r}), got "
                             f"{self.resume!r}")
        if self.deadline_policy not in DEADLINE_POLICIES:
            raise ValueError(f"deadline_policy must be one of {', '.join(DEADLINE_POLICIES)}; "
                             f"got {self.deadline_policy!r}")


class CachePlanner:
    """The pace of one save, from the cache estimate, the bytes left and the deadline."""

    def __init__(self, *, total: int, cache_size: float, recovery_rate: float, fill: float = 0.0,
                 deadline: Optional[float] = None, settings: PlanSettings = PlanSettings(),
                 lead: float = 0.0, from_full: bool = False) -> None:
        self.total, self.cache_size, self.recovery = total, cache_size, recovery_rate
        self.fill, self.deadline, self.settings = fill, deadline, settings
        # The cache counted as draining at only `sustain` x the recovery rate: what the
        # tail's pace keeps below the ceiling (the module docstring).
        self.worst = fill
        self.lead = lead  # bytes in flight: the estimate lags the drive by that much
        self.done = 0.0
        self.written = 0.0  # bytes counted into the cache since the start: ours, or the drive's
        self.elapsed = 0.0
        self.others_rate = 0.0  # bytes/s other writers gave the drive over the last second
        self._recent: List[Tuple[float, float, float]] = [(0.0, 0.0, 0.0)]  # elapsed, done, written
        self.conflict = False  # the deadline cannot be met without the cliff
        self.slo_cap: Optional[float] = None  # bytes/s read_slo allows (None: no limit)
        # Started with the cache at its ceiling or over, or with an estimate that dates from a
        # full cache (`from_full`): crawls until it drained to `resume`.
        self.recovering = (settings.deadline_policy == "avoid-cliff"
                           and fill > settings.resume * cache_size
                           and (from_full or fill + lead >= self.ceiling))

    @property
    def limit(self) -> float:
        return self.settings.headroom * self.cache_size

    @property
    def ceiling(self) -> float:
        return self.settings.ceiling * self.cache_size

    @property
    def drain(self) -> float:
        """Bytes/s the cache frees for this save: the recovery rate less other writers' rate,
        at least a tenth of it (a pace of 0 would mean unpaced)."""
        return max(self.recovery - self.others_rate, 0.1 * self.recovery)

    def advance(self, done: float, elapsed: float, disk_written: Optional[float] = None) -> None:
        """The write has completed ``done`` bytes after ``elapsed`` seconds; ``disk_written``:
        the bytes the drive completed meanwhile from every writer (None: unknown)."""
        written = max(done, disk_written if disk_written is not None else 0.0, self.written)
        self.fill = drained(self.fill + (written - self.written), self.recovery,
                            elapsed - self.elapsed)
        self.worst = drained(self.worst + (written - self.written),
                             self.settings.sustain * self.recovery, elapsed - self.elapsed)
        self.done, self.written, self.elapsed = done, written, elapsed
        self._recent = [r for r in self._recent if elapsed - r[0] <= 1.0] + [
            (elapsed, done, written)]
        first = self._recent[0]
        if elapsed - first[0] >= 0.25:
            others = (written - first[2]) - (done - first[1])
            self.others_rate = max(0.0, others / (elapsed - first[0]))

    def peak_rate(self) -> float:
        """The fastest bytes/s the drive took between two looks at least ``PEAK_SPAN_S``
        apart over the last second (0: none yet). A drive may take a burst in lumps faster
        than its mean (a throttle's slices: a few hundred MB at the disk's own speed), and
        the burst's end is judged by its fastest."""
        best, recent = 0.0, self._recent
        for k in range(1, len(recent)):
            j = k - 1
            while j > 0 and recent[k][0] - recent[j][0] < PEAK_SPAN_S:
                j -= 1
            span = recent[k][0] - recent[j][0]
            if span >= PEAK_SPAN_S:
                best = max(best, (recent[k][2] - recent[j][2]) / span)
        return best

    def saturate(self, observed_rate: float) -> None:
        """A cliff was seen: the cache is full, and it recovers no faster than the drive
        writes now."""
        self.fill = self.worst = self.cache_size
        if observed_rate > 0:  # at most a halving per cliff: one slow stretch is not a model
            self.recovery = min(self.recovery, max(observed_rate, 0.5 * self.recovery))

    def needed(self) -> float:
        """Bytes/s that finish by the deadline (0 without one; inf once it has passed)."""
        remaining = max(0.0, self.total - self.done)
        if self.deadline is None or remaining == 0:
            return 0.0
        left = self.deadline * self.settings.finish - self.elapsed
        return remaining / left if left > 0 else math.inf

    def rate(self) -> float:
        """Bytes/s to pace at now; 0: unpaced."""
        if self.recovering:
            if self.fill > self.settings.resume * self.cache_size:
                return CRAWL_SHARE * self.drain
            self.recovering = False
        needed = self.needed()
        pace = self._cliff_free(needed)
        if self.slo_cap is not None:
            pace = self.slo_cap if pace == 0 else min(pace, self.slo_cap)
            if needed and math.isfinite(needed):
                pace = max(pace, needed)
        return pace

    def burst_left(self) -> float:
        """Bytes an unpaced write may still add before the headroom paces it (inf: it never
        will; 0: it paces now). The controller looks again before they are written: a look
        a fixed tick later let a burst of a few GB/s run a tick past the headroom. Past its
        deadline a save writes as fast as the cache allows (:meth:`_cliff_free`), which no
        headroom steers: inf, and the controller looks every tick (with 0, every 2 ms)."""
        needed = self.needed()
        if math.isinf(needed):
            return math.inf
        if self.recovering or needed or self.slo_cap is not None:
            return 0.0
        return self._unpaced_room(max(0.0, self.total - self.done))

    def _unpaced_room(self, remaining: float) -> float:
        """Without a deadline: the bytes a write may add unpaced, below the headroom by the
        estimate and below the ceiling by the sustained count (inf: the ``remaining`` bytes
        all fit below the ceiling). Where the tail's pace let the estimate fall back under
        the headroom, bursting again would spend the drain's margin (at the drain on
        average)."""
        if self.worst + self.lead + remaining <= self.ceiling:
            return math.inf
        return max(0.0, min(self.limit - self.fill, self.ceiling - self.worst) - self.lead)

    def _cliff_free(self, needed: float) -> float:
        sustained = self.settings.sustain * self.drain
        remaining = max(0.0, self.total - self.done)
        if not needed:
            return 0.0 if self._unpaced_room(remaining) > 0 else \
                self._fastest_cliff_free(remaining)
        if not math.isfinite(needed):  # past the planned finish: as soon as the cache allows
            self.conflict = self.worst + self.lead + remaining > self.ceiling
            if self.conflict and self.settings.deadline_policy == "avoid-cliff":
                return self._fastest_cliff_free(remaining)
            return 0.0
        # A flat write at `needed` for `left` seconds ends with this much in the cache, counted
        # at the sustained drain (as the fastest cliff-free pace counts it).
        left = remaining / needed
        end_fill = self.worst + self.lead + remaining - sustained * left
        if needed <= sustained or end_fill <= self.ceiling:
            self.conflict = False
            return needed
        # No flat pace is cliff-free, and none other is either: every schedule has the same
        # drain to spend over the time left, and the flat one fills the cache least.
        self.conflict = True
        if self.settings.deadline_policy == "meet-deadline":
            return needed
        return self._fastest_cliff_free(remaining)

    def _fastest_cliff_free(self, remaining: float) -> float:
        """The fastest flat pace that ends with the cache at its ceiling, counted at the
        sustained drain d (``worst``): writing R bytes at r ends at worst + R - d * R / r, so
        r = d * R / (worst + R - ceiling). It finishes as soon as filling the cache unpaced to
        the ceiling and then writing at d does, and it never bursts at the reads beside it;
        never below d (past the ceiling by that count: sustained). The bytes in flight
        (``lead``) count only where the rest would go unpaced: a paced write keeps few."""
        sustained = self.settings.sustain * self.drain
        excess = self.worst + remaining - self.ceiling
        if excess + self.lead <= 0:
            return 0.0  # all of it fits below the ceiling
        return max(sustained, sustained * remaining / max(excess, 1.0))
