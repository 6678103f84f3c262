"""The pace of one ``rate="auto"`` save from the drive's model, so that its cache never fills.

The clock-free planner keeps an estimate of the bytes in the drive's cache: the start fill,
plus every byte the drive takes (its counter in /proc/diskstats, other processes' writes
included; else this save's own), drained at the drain rate, less other writers' recent rate.

- With a deadline (``within=``): the flattest rate that finishes in time, which fills the cache
  least. If even that passes the ceiling, no schedule meets the deadline cliff-free (a
  conflict): "avoid-cliff" paces at the fastest flat rate that ends at the ceiling and finishes
  late; "meet-deadline" keeps the flat rate.
- Without one: unpaced while the estimate is under the headroom, then the fastest flat pace
  that ends at the ceiling counting only ``sustain`` of the drain (``worst``); once that count
  reaches the ceiling it never bursts again, a real margin for a drain read high.
- ``read_slo`` lowers the pace while reads miss it (``slo_cap``), never below the deadline's.
- A save that may start in the cliff (the estimate above ``resume``, where the drive leaves it)
  crawls until below it: a drive written at its drain in its cliff stays there.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Tuple

from ..telemetry.drive_model import ClearSchedule, left_after_folding

__all__ = ["DEADLINE_POLICIES", "DEFAULT_SETTINGS", "CachePlanner", "PlanSettings"]

DEADLINE_POLICIES = ("avoid-cliff", "meet-deadline")
#: The pace, as a share of the drain, of a save waiting for its cache to drain below where the
#: drive leaves its cliff: the drive then folds at almost its idle rate.
CRAWL_SHARE = 0.1


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """The margins of a plan, each a share of the cache or of the drain.

    headroom: an unpaced burst stops at this share of the cache (the rest: bytes in flight as
        the burst is paced, and the error of a cache read off one cliff).
    sustain: the share of the drain paces count on: the margin for a drain read high.
    ceiling: past the headroom, the cache may end at most this full by that count.
    finish: with a deadline, aim to finish by this share of it (the drive's noise).
    deadline_policy: "avoid-cliff" or "meet-deadline" (see the module docstring).
    """

    headroom: float = 0.85
    sustain: float = 0.9
    ceiling: float = 0.95
    finish: float = 0.9
    deadline_policy: str = "avoid-cliff"

    def __post_init__(self) -> None:
        for name in ("headroom", "sustain", "ceiling", "finish"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        if self.ceiling < self.headroom:
            raise ValueError(f"ceiling must be at least headroom ({self.headroom!r}), got "
                             f"{self.ceiling!r}")
        if self.deadline_policy not in DEADLINE_POLICIES:
            raise ValueError(f"deadline_policy must be one of {', '.join(DEADLINE_POLICIES)}; "
                             f"got {self.deadline_policy!r}")

    def repeat(self, clear: ClearSchedule, total: float, fast: Optional[float]
               ) -> Tuple[float, float]:
        """How a save of ``total`` bytes repeats a schedule taken clear: (bytes unpaced, then
        the pace; 0: unpaced throughout). The pace is the sustained share of the one it was
        taken at (a cliff in its last slice would have passed unseen); a schedule taken
        unpaced throughout, from its start at that share of the new-file rate ``fast``,
        unless the save has that share of its bytes to spare."""
        if clear.pace or not fast or total <= self.sustain * clear.total:
            return clear.burst, self.sustain * clear.pace
        return 0.0, self.sustain * fast


DEFAULT_SETTINGS = PlanSettings()


class CachePlanner:
    """The pace of one save from the cache estimate, the bytes left and the deadline.
    ``resume``: the fill below which the drive is out of its cliff (None: no wait); ``lead``:
    bytes in flight, which the estimate has not seen yet."""

    def __init__(self, *, total: float, cache_size: float, drain: float, fill: float = 0.0,
                 deadline: Optional[float] = None, settings: PlanSettings = PlanSettings(),
                 lead: float = 0.0, resume: Optional[float] = None) -> None:
        self.total, self.cache_size, self.recovery = total, cache_size, drain
        self.fill = self.worst = fill
        self.deadline, self.settings, self.lead = deadline, settings, lead
        self.done = self.written = self.elapsed = 0.0
        self.others_rate = 0.0  # bytes/s other writers gave the drive over the last second
        self._recent: List[Tuple[float, float, float]] = [(0.0, 0.0, 0.0)]
        self.conflict = False
        self.slo_cap: Optional[float] = None
        self.recovering = (settings.deadline_policy == "avoid-cliff" and resume is not None
                           and fill > resume)
        self.resume = resume

    @property
    def limit(self) -> float:
        return self.settings.headroom * self.cache_size

    @property
    def ceiling(self) -> float:
        return self.settings.ceiling * self.cache_size

    @property
    def drain(self) -> float:
        """Bytes/s the cache frees for this save: the drain less other writers' rate, at least
        a tenth of it (a pace of 0 would mean unpaced)."""
        return max(self.recovery - self.others_rate, 0.1 * self.recovery)

    def advance(self, done: float, elapsed: float, disk_written: Optional[float] = None) -> None:
        """The write completed ``done`` bytes after ``elapsed`` s; the drive took
        ``disk_written`` from every writer (None: unknown)."""
        written = max(done, disk_written or 0.0, self.written)
        span = elapsed - self.elapsed
        self.fill = left_after_folding(self.fill + written - self.written, self.recovery, span)
        self.worst = left_after_folding(self.worst + written - self.written,
                             self.settings.sustain * self.recovery, span)
        self.done, self.written, self.elapsed = done, written, elapsed
        self._recent = [r for r in self._recent if elapsed - r[0] <= 1.0] + [
            (elapsed, done, written)]
        first = self._recent[0]
        if elapsed - first[0] >= 0.25:
            others = (written - first[2]) - (done - first[1])
            self.others_rate = max(0.0, others / (elapsed - first[0]))

    def needed(self) -> float:
        """Bytes/s that finish by the deadline (0 without one; inf once past it)."""
        remaining = max(0.0, self.total - self.done)
        if self.deadline is None or remaining == 0:
            return 0.0
        left = self.deadline * self.settings.finish - self.elapsed
        return remaining / left if left > 0 else math.inf

    def rate(self) -> float:
        """Bytes/s to pace at now; 0: unpaced."""
        if self.recovering:
            if self.fill > self.resume:
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
        """Bytes an unpaced write may still add before it is paced (inf: never, as past the
        deadline; 0: now)."""
        needed = self.needed()
        if math.isinf(needed):
            return math.inf
        if self.recovering or needed or self.slo_cap is not None:
            return 0.0
        return self._unpaced_room(max(0.0, self.total - self.done))

    def _unpaced_room(self, remaining: float) -> float:
        """Bytes a write may add unpaced: under the headroom by the estimate and under the
        ceiling by the sustained count (inf where all of ``remaining`` fits)."""
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
        # A flat write at `needed` ends with this much in the cache, at the sustained drain.
        end_fill = self.worst + self.lead + remaining - sustained * remaining / needed
        if needed <= sustained or end_fill <= self.ceiling:
            self.conflict = False
            return needed
        self.conflict = True
        if self.settings.deadline_policy == "meet-deadline":
            return needed
        return self._fastest_cliff_free(remaining)

    def _fastest_cliff_free(self, remaining: float) -> float:
        """The fastest flat pace that ends at the ceiling at the sustained drain s: R bytes at r
        end at worst + R - s * R / r, so r = s * R / (worst + R - ceiling), never below s.
        Bytes in flight count only where the rest would go unpaced."""
        sustained = self.settings.sustain * self.drain
        excess = self.worst + remaining - self.ceiling
        if excess + self.lead <= 0:
            return 0.0
        return max(sustained, sustained * remaining / max(excess, 1.0))
