"""The controller thread of a ``rate="auto"`` save, and the plan it starts from.

Every ``tick`` seconds it reads the write's progress (an ``engine.RateControl``) and the
drive's written bytes, and sets the pace, in one of two modes:

- **planning**: the :class:`~flashstream.checkpoint.pacing.CachePlanner`'s pace (lowered while
  reads miss ``read_slo``), from the drive's write model;
- **measuring**: unpaced, so that what the model learns is what the drive showed, not what a
  pacer made it do. A save measures the drive
  - from its start, where the model knows no cliff and no write this large without one (a
    drive seen for the first time);
  - from the moment its planned burst ends, where a figure of the model is not confirmed (never
    measured, or measured longer than ``RECONFIRM_AFTER`` ago): the save then either meets the
    cliff, measuring it, or shows the drive takes more than the model said;
  - from a cliff the model did not predict (throughput below half the pace for a second: a
    shorter slow stretch is as often the disk's own; or, paced at no more than half the
    new-file rate, short of the pace by a fifth for two: a drive that could take the pace
    from its cache falls short of it only in its cliff, where it may write at most of a pace
    set near the drain): for ``MEASURE_S``, which gives the post-cache rate; then the save
    paces at the sustained share of the recovery rate assumed from it
    (``ASSUMED_DRAIN_SHARE``), which takes it out of the cliff. (Written on to its end
    instead, so that refills could follow, saves met their cliffs for seconds each, save
    after save, on the emulated drives of benchmarks/checkpoint.py --learning.) A save that
    ends before it left the cliff ends with the cache full: refills follow it. So does one
    whose model has unconfirmed figures (``probe``): it writes on in the cliff to its end,
    and the refill confirms them all, where leaving the cliff left the cache size to the
    next save, which measured it in a cliff of its own.

  Written unpaced into its cliff to its end, a save leaves the drive's cache full; the writer
  then measures the recovery rate with a refill (``telemetry.write_learning.
  learn_after_save``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import List, Optional, Sequence

from .. import engine
from ..telemetry.diskstats import disk_bytes_written
from ..telemetry.read_latency import ReadLatencyMonitor
from ..telemetry.write_model import ASSUMED_DRAIN_SHARE, WriteModel
from .pacing import CachePlanner, PlanSettings

__all__ = ["UNKNOWN_DRIVE", "UNPREDICTED_CLIFF", "SaveController", "plan_save"]

log = logging.getLogger(__name__)

UNKNOWN_DRIVE = "no cliff known for a write this large"
UNPREDICTED_CLIFF = "a cliff the model did not predict"
#: Seconds of throughput below half the pace that make a cliff the model did not predict.
CLIFF_S = 1.0
#: Seconds a save that met a cliff the model did not predict writes unpaced in it.
MEASURE_S = 1.0
#: A pace at most this share of the new-file rate the drive takes from its cache at ease: a
#: shortfall of more than ``1 - SHORTFALL`` of it that lasts ``SHORTFALL_S`` beyond a CLIFF_S
#: window is the drive's cliff. (In its cliff a drive writes at its post-cache rate, which
#: can be most of a pace set near its drain: the half rule alone never saw such a cliff, and
#: a drain the model had too high put save after save in it; docs/checkpoint.md, step 7.)
SLOW_PACE_SHARE = 0.5
SHORTFALL = 0.8
SHORTFALL_S = 1.0
#: The shortest wait between the controller's looks near the end of an unpaced burst (its
#: tick otherwise): at a few GB/s, a few MB.
MIN_WAIT_S = 0.002
#: How many times the fastest rate seen a burst may take its last bytes at: the wait before
#: the headroom halves at each look, so a lump the looks had not seen whole (each tick's
#: look fell half-way through one, and saw the mean) cannot run past it. Looked at the rate
#: seen, the emulated drive's throttle let 268 MB through in the last 43 ms (6.2 GB/s, where
#: the looks had seen 2.7-3.1), and the cache reached 0.97 of its size against a limit of
#: 0.88. It costs a few more looks, milliseconds apart, at the end of each burst.
BURST_RATE_MARGIN = 2.0


class SaveController:
    """Runs one save's pace against its write in flight (a thread; see the module docstring).

    ``planner``: None where the save measures from its start. ``measuring``: why it does (None:
    it plans). ``probe``: the model's unconfirmed figures; the save measures once its planned
    burst ends."""

    def __init__(self, planner: Optional[CachePlanner], *, read_slo: Optional[float] = None,
                 disk: Optional[str] = None, tick: float = 0.05, min_rate: float = 16 << 20,
                 fast_rate: Optional[float] = None, measuring: Optional[str] = None,
                 probe: Sequence[str] = ()) -> None:
        if planner is None and measuring is None:
            raise ValueError("a save without a plan measures the drive: give measuring=")
        self.planner, self.read_slo, self.tick = planner, read_slo, tick
        self.min_rate = min_rate
        self.fast_rate = fast_rate
        self.measuring = measuring
        self.probe: List[str] = list(probe)
        self.measured_from: Optional[float] = 0.0 if measuring else None  # s into the write
        self.ends_full = measuring is not None  # written unpaced to the end (refills follow)
        self.control = engine.RateControl()
        self.control.rate = 0.0 if planner is None or measuring else planner.rate()
        self.monitor = ReadLatencyMonitor(disk) if read_slo else None
        self.disk = disk
        self._disk0: Optional[int] = None  # the drive's written bytes when the save began
        self._measure_mark: Optional[tuple] = None  # (elapsed, done) as measuring began
        self.cliffs = 0
        self._short_since: Optional[float] = None  # when a shortfall below the pace began
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
        if self.measuring == UNPREDICTED_CLIFF and self.control.rate <= 0:
            self.ends_full = True  # it ended unpaced in the cliff, before leaving it
        # The bytes since the last tick: the estimate the model keeps ends with the write.
        if self.planner is not None:
            self.planner.advance(float(self.control.done), time.perf_counter() - self._t0,
                                 self._disk_written())

    def _measure(self, why: str, elapsed: float) -> None:
        """From now on, write unpaced: the drive sets the pace, and the model learns it."""
        self.measuring, self.measured_from = why, elapsed
        # After a cliff the model did not predict, it leaves the cliff (_leave_cliff), unless
        # figures are unconfirmed: then the refill after it confirms them (the docstring).
        self.ends_full = why != UNPREDICTED_CLIFF or bool(self.probe)
        self.control.rate = 0.0
        log.info("flashstream: this checkpoint measures the drive from %.2f s: %s", elapsed,
                 why)

    def _run(self) -> None:
        # (elapsed, done, pace, the drive's bytes from every writer) over the last CLIFF_S
        recent: list = []
        slo_every, next_slo = max(self.tick, 0.25), 0.0
        while not self._stop.wait(self._next_wait()):
            planner = self.planner
            if self.measuring == UNPREDICTED_CLIFF and not self.ends_full and planner:
                self._leave_cliff(planner)
            if self.measuring or planner is None:
                continue  # unpaced to the end
            elapsed, done = time.perf_counter() - self._t0, float(self.control.done)
            planner.advance(done, elapsed, self._disk_written())
            recent = [r for r in recent if elapsed - r[0] <= CLIFF_S] + [
                (elapsed, done, self.control.rate, planner.written)]
            if self._cliff_seen(recent):
                self.cliffs += 1
                self._measure(UNPREDICTED_CLIFF, elapsed)
                continue
            if self.probe and planner.fill + planner.lead >= planner.limit:
                self._measure(f"the model's {', '.join(self.probe)} not confirmed", elapsed)
                continue
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

    def _next_wait(self) -> float:
        """Seconds until the controller looks again: a tick, or less during an unpaced burst
        the planner steers (:meth:`_burst_wait`)."""
        if self.planner is None or self.measuring or self.control.rate != 0:
            return self.tick
        return self._burst_wait(self.planner)

    def _burst_wait(self, planner: CachePlanner) -> float:
        """Seconds until the controller looks again during an unpaced burst: a tick, or less
        where the burst could reach the planner's headroom sooner at ``BURST_RATE_MARGIN`` x
        the faster of the drive's new-file rate and the fastest it took bytes over the last
        second (at least ``MIN_WAIT_S``). At the new-file rate alone, a burst the emulated
        drive's throttle let through in lumps at the disk's own speed ran 40-90 MB past the
        headroom."""
        room = planner.burst_left()
        rate = max(self.fast_rate or 0.0, planner.peak_rate())
        if not math.isfinite(room) or rate <= 0:
            return self.tick
        return min(self.tick, max(MIN_WAIT_S, room / (BURST_RATE_MARGIN * rate)))

    def _leave_cliff(self, planner: CachePlanner) -> None:
        """After ``MEASURE_S`` unpaced in a cliff the model did not predict: pace at the
        sustained share of the drain assumed from the rate the drive showed there."""
        elapsed, done = time.perf_counter() - self._t0, float(self.control.done)
        if self._measure_mark is None:
            self._measure_mark = (elapsed, done)
            return
        seconds = elapsed - self._measure_mark[0]
        if seconds < MEASURE_S or self.control.rate > 0:
            return
        post = (done - self._measure_mark[1]) / seconds
        self.control.rate = max(self.min_rate, planner.settings.sustain * ASSUMED_DRAIN_SHARE
                                * post)

    def _disk_written(self) -> Optional[float]:
        """Bytes the drive completed since the save began, from every writer (None: unknown)."""
        now = disk_bytes_written(self.disk) if self._disk0 is not None else None
        return None if now is None else float(now - self._disk0)

    def _cliff_seen(self, recent) -> bool:
        """Throughput below half what the pacing allowed for CLIFF_S, or short of a slow
        pace (``SLOW_PACE_SHARE``) for longer: the drive's cliff, wherever the model put the
        cache's fill (a model that is wrong puts it anywhere)."""
        if len(recent) < 2 or recent[-1][0] - recent[0][0] < 0.9 * CLIFF_S:
            return False
        achieved = (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])
        # What the pacing allowed over the window: each tick's pace, or the drive's own rate
        # where unpaced (a window that went from unpaced to a slow pace is not a cliff).
        fast = self.fast_rate or 0.0
        paces = [r[2] if r[2] > 0 else fast for r in recent[1:]]
        expected = min(paces) if paces and min(paces) > 0 else 0.0
        if expected > 0 and achieved < 0.5 * expected:
            return True
        slow = all(r[2] > 0 for r in recent[1:]) and 0 < expected <= SLOW_PACE_SHARE * fast
        if not (slow and achieved < SHORTFALL * expected):
            self._short_since = None
            return False
        if self._short_since is None:
            self._short_since = recent[-1][0]
        return recent[-1][0] - self._short_since >= SHORTFALL_S

    def _follow_slo(self, p95: Optional[float]) -> None:
        if p95 is None or self.read_slo is None or self.planner is None:
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
              lead: float, min_rate: float, written_since: float = 0.0,
              now: Optional[float] = None) -> SaveController:
    """The controller of one save from the drive's model (see the module docstring).
    ``written_since``: bytes the drive took from anything else since the model's fill estimate
    (``WriteModel.fill_at``)."""
    common = dict(read_slo=read_slo, disk=disk, min_rate=min_rate, fast_rate=model.fast_rate)
    if model.has_cliff:
        cache, recovery = float(model.cache_size), float(model.planning_recovery)
        probe = model.unconfirmed(now)
    elif model.cliff_free >= total:
        cache, recovery = math.inf, float(model.fast_rate or math.inf)
        probe = []
    else:
        return SaveController(None, measuring=UNKNOWN_DRIVE, **common)
    # An estimate that dates from a full cache (a cliff, a refill's) may find the drive still
    # in its cliff: the planner lets it drain first (checkpoint/pacing.py).
    from_full = model.has_cliff and model.fill >= cache
    planner = CachePlanner(total=total, cache_size=cache, recovery_rate=recovery,
                           fill=model.fill_at(written=written_since), deadline=within,
                           settings=settings, lead=lead, from_full=from_full)
    return SaveController(planner, probe=probe, **common)
