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

A controller thread (:class:`SaveController`) runs the planner every ``tick`` seconds against
the write's progress (an ``engine.RateControl``) and notices a cliff the model did not predict
(throughput far below the pace for half a second): it then takes the cache as full.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from typing import List, Optional, Tuple

from .. import engine
from ..telemetry.diskstats import disk_bytes_written
from ..telemetry.read_latency import ReadLatencyMonitor
from ..telemetry.write_model import WriteModel, drained

__all__ = ["DEADLINE_POLICIES", "CachePlanner", "PlanSettings", "SaveController", "plan_save"]

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


class SaveController:
    """Runs a :class:`CachePlanner` against one write in flight (a thread)."""

    def __init__(self, planner: CachePlanner, *, read_slo: Optional[float] = None,
                 disk: Optional[str] = None, tick: float = 0.05, min_rate: float = 16 << 20,
                 fast_rate: Optional[float] = None) -> None:
        self.planner, self.read_slo, self.tick = planner, read_slo, tick
        self.min_rate = min_rate
        self.fast_rate = fast_rate
        self.control = engine.RateControl()
        self.control.rate = planner.rate()
        self.monitor = ReadLatencyMonitor(disk) if read_slo else None
        self.disk = disk
        self._disk0: Optional[int] = None  # the drive's written bytes when the save began
        self.cliffs = 0
        self.slo_misses = 0
        self.conflicted = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flashstream-pacing",
                                        daemon=True)

    def __enter__(self) -> SaveController:
        self._t0 = time.perf_counter()
        self._disk0 = disk_bytes_written(self.disk)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        # The bytes since the last tick: the estimate the model keeps ends with the write.
        self.planner.advance(float(self.control.done), time.perf_counter() - self._t0,
                             self._disk_written())

    def _run(self) -> None:
        # (elapsed, done, pace, the drive's bytes from every writer) over the last half second
        planner, recent = self.planner, []
        slo_every, next_slo = max(self.tick, 0.25), 0.0
        while not self._stop.wait(self.tick):
            elapsed, done = time.perf_counter() - self._t0, float(self.control.done)
            planner.advance(done, elapsed, self._disk_written())
            recent = [r for r in recent if elapsed - r[0] <= 0.5] + [
                (elapsed, done, self.control.rate, planner.written)]
            if self._cliff_seen(recent):
                self.cliffs += 1
                # What the drive wrote in the cliff from every writer: the save's own share
                # already has the others' taken out, and the drain takes it out again.
                planner.saturate((recent[-1][3] - recent[0][3]) / (recent[-1][0] - recent[0][0]))
                recent = recent[-1:]
            if self.monitor is not None and elapsed >= next_slo:
                next_slo = elapsed + slo_every
                self._follow_slo(self.monitor.p95())
            pace = planner.rate()
            if planner.conflict and not self.conflicted:
                self.conflicted = True
                log.warning("flashstream: this checkpoint cannot finish by its deadline without "
                            "filling the drive's write cache; policy %r",
                            planner.settings.deadline_policy)
            self.control.rate = pace

    def _disk_written(self) -> Optional[float]:
        """Bytes the drive completed since the save began, from every writer (None: unknown)."""
        now = disk_bytes_written(self.disk) if self._disk0 is not None else None
        return None if now is None else float(now - self._disk0)

    def _cliff_seen(self, recent) -> bool:
        if len(recent) < 2 or recent[-1][0] - recent[0][0] < 0.45:
            return False
        achieved = (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])
        # What the pacing allowed over the window: each tick's pace, or the drive's own rate
        # where unpaced (a window that went from unpaced to a slow pace is not a cliff).
        fast = self.fast_rate or 0.0
        paces = [r[2] if r[2] > 0 else fast for r in recent[1:]]
        expected = min(paces) if paces and min(paces) > 0 else 0.0
        fill, cache = self.planner.fill, self.planner.cache_size
        if fill >= cache or fill < 0.5 * cache:
            return False  # already counted as full; or too empty for a slowdown to be its cliff
        return expected > 0 and achieved < 0.5 * expected

    def _follow_slo(self, p95: Optional[float]) -> None:
        if p95 is None or self.read_slo is None:
            return
        planner = self.planner
        current = self.control.rate or self.fast_rate or planner.recovery * 4
        if p95 > self.read_slo:
            self.slo_misses += 1
            planner.slo_cap = max(self.min_rate, 0.7 * current)
        elif planner.slo_cap is not None:
            raised = planner.slo_cap * 1.1
            planner.slo_cap = None if self.fast_rate and raised >= self.fast_rate else raised


def plan_save(model: WriteModel, *, total: int, within: Optional[float],
              settings: PlanSettings, read_slo: Optional[float], disk: Optional[str],
              lead: float, min_rate: float,
              written_since: float = 0.0) -> Optional[SaveController]:
    """The controller of one save from the drive's model; None when the model knows too little
    (no cliff seen, and no write this large seen without one): that save learns, with the
    adaptive cliff detector. ``written_since``: bytes the drive took from anything else since
    the model's fill estimate (``WriteModel.fill_at``)."""
    if model.has_cliff:
        cache, recovery = float(model.cache_size), float(model.recovery_rate)
    elif model.cliff_free >= total:
        cache, recovery = math.inf, float(model.fast_rate or math.inf)
    else:
        return None
    planner = CachePlanner(total=total, cache_size=cache, recovery_rate=recovery,
                           fill=model.fill_at(written=written_since), deadline=within,
                           settings=settings, lead=lead)
    return SaveController(planner, read_slo=read_slo, disk=disk, min_rate=min_rate,
                          fast_rate=model.fast_rate)
