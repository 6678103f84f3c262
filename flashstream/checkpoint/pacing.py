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
  reads the most of the drive at every moment). If that fills the cache past ``headroom`` of
  its size before the end, no schedule meets the deadline without the cliff (each has the
  same drain to spend over the time left): a conflict, warned once; then ``deadline_policy``
  says what to do: "avoid-cliff" (default) paces at the fastest flat rate that ends with the
  cache at its headroom, and finishes late; "meet-deadline" keeps the flat rate and enters
  the cliff.
- Without one, it writes unpaced while the estimated headroom lasts, then at ``sustain`` x
  the drain (the recovery rate, less other writers'), which the cache absorbs indefinitely.
- ``read_slo`` (a p95 in seconds for reads on the same drive) lowers the rate while reads miss
  it and raises it back while they meet it, never below what the deadline needs.

A controller thread (checkpoint/save_control.py) runs the planner every ``tick`` seconds
against the write's progress.
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


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """headroom: fill the drive's cache to at most this share of its size.
    sustain: once the headroom is spent, write at this share of the drain (the recovery rate,
        less other writers' rate).
    finish: aim to finish by this share of the deadline (slack for the drive's noise).
    deadline_policy: "avoid-cliff" or "meet-deadline" (see the module docstring).
    """

    headroom: float = 0.85
    sustain: float = 0.9
    finish: float = 0.9
    deadline_policy: str = "avoid-cliff"

    def __post_init__(self) -> None:
        for name in ("headroom", "sustain", "finish"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        if self.deadline_policy not in DEADLINE_POLICIES:
            raise ValueError(f"deadline_policy must be one of {', '.join(DEADLINE_POLICIES)}; "
                             f"got {self.deadline_policy!r}")


class CachePlanner:
    """The pace of one save, from the cache estimate, the bytes left and the deadline."""

    def __init__(self, *, total: int, cache_size: float, recovery_rate: float, fill: float = 0.0,
                 deadline: Optional[float] = None, settings: PlanSettings = PlanSettings(),
                 lead: float = 0.0) -> None:
        self.total, self.cache_size, self.recovery = total, cache_size, recovery_rate
        self.fill, self.deadline, self.settings = fill, deadline, settings
        self.lead = lead  # bytes in flight: the estimate lags the drive by that much
        self.done = 0.0
        self.written = 0.0  # bytes counted into the cache since the start: ours, or the drive's
        self.elapsed = 0.0
        self.others_rate = 0.0  # bytes/s other writers gave the drive over the last second
        self._recent: List[Tuple[float, float, float]] = [(0.0, 0.0, 0.0)]  # elapsed, done, written
        self.conflict = False  # the deadline cannot be met without the cliff
        self.slo_cap: Optional[float] = None  # bytes/s read_slo allows (None: no limit)

    @property
    def limit(self) -> float:
        return self.settings.headroom * self.cache_size

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
        self.done, self.written, self.elapsed = done, written, elapsed
        self._recent = [r for r in self._recent if elapsed - r[0] <= 1.0] + [
            (elapsed, done, written)]
        first = self._recent[0]
        if elapsed - first[0] >= 0.25:
            others = (written - first[2]) - (done - first[1])
            self.others_rate = max(0.0, others / (elapsed - first[0]))

    def saturate(self, observed_rate: float) -> None:
        """A cliff was seen: the cache is full, and it recovers no faster than the drive
        writes now."""
        self.fill = self.cache_size
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
        needed = self.needed()
        pace = self._cliff_free(needed)
        if self.slo_cap is not None:
            pace = self.slo_cap if pace == 0 else min(pace, self.slo_cap)
            if needed and math.isfinite(needed):
                pace = max(pace, needed)
        return pace

    def _cliff_free(self, needed: float) -> float:
        sustained = self.settings.sustain * self.drain
        asap = 0.0 if self.fill + self.lead < self.limit else sustained
        if not needed:
            return asap
        remaining = max(0.0, self.total - self.done)
        if not math.isfinite(needed):  # past the planned finish: as soon as the cache allows
            self.conflict = self.fill + self.lead + remaining > self.limit
            if self.conflict and self.settings.deadline_policy == "avoid-cliff":
                return self._fastest_cliff_free(remaining)
            return 0.0
        # A flat write at `needed` for `left` seconds ends with this much in the cache.
        left = remaining / needed
        end_fill = self.fill + self.lead + remaining - self.drain * left
        if needed <= sustained or end_fill <= self.limit:
            self.conflict = False
            return needed
        # No flat pace is cliff-free, and none other is either: every schedule has the same
        # drain to spend over the time left, and the flat one fills the cache least.
        self.conflict = True
        if self.settings.deadline_policy == "meet-deadline":
            return needed
        return self._fastest_cliff_free(remaining)

    def _fastest_cliff_free(self, remaining: float) -> float:
        """The fastest flat pace that ends with the cache at its headroom: writing R bytes at r
        ends at fill + R - drain * R / r, so r = drain * R / (fill + R - limit). It finishes
        sooner than filling the headroom unpaced and then sustaining (by 1/sustain), and it
        never bursts at the reads beside it; never below the sustained pace."""
        sustained = self.settings.sustain * self.drain
        excess = self.fill + self.lead + remaining - self.limit
        if excess <= 0:
            return 0.0  # all of it fits in the headroom
        return max(sustained, self.drain * remaining / excess)
