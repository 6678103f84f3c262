"""What a ``rate="auto"`` save's looks show of the drive: a cliff (unpaced, under a pace, in
the reads) and where it began; the drive's rates; the drain since the cache was full; the cache
and its margin by the drain; the fill at the end. :class:`SaveReadings` is the controller's
(save_control.py) half that only reads its state.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

from ..telemetry.drive_model import ASSUMED_CLIFF_MARGIN, LOWER_BOUND, MEASURED, ReferenceCliff
from .cliff_watch import (
    DRIVE,
    HOLD_S,
    SHORTFALL,
    SLICE_S,
    bytes_at,
    dropped,
    placed,
    rate_between,
    spread_of,
    stalled,
)
from .save_record import BURST, PLAN, REFILL, REPEAT, TEST, SeenCliff

__all__ = ["POSSIBLE_DRAIN_SHARE", "SaveReadings"]

#: A drain reading at or above this share of the new-file rate is no drive's: one that folds
#: as fast as it writes has no cliff (the rest is the rate's noise, cliff_watch.RATE_NOISE).
POSSIBLE_DRAIN_SHARE = 0.9


class SaveReadings:
    """The reading half of :class:`~flashstream.checkpoint.save_control.SaveController`."""

    def _possible(self, drain: Optional[float]) -> bool:
        """Whether a drain reading can be a drive's (``POSSIBLE_DRAIN_SHARE``)."""
        return bool(drain) and drain > 0 and drain < POSSIBLE_DRAIN_SHARE * (self.fast or math.inf)

    def _two_cliffs(self, ref: ReferenceCliff, cliff: SeenCliff
                    ) -> Tuple[Optional[float], Optional[str]]:
        """The drain read off the model's cliff and this one, and how it is known. Each cliff's
        spread moves the reading by that many seconds of the write's rate over the drain, over
        the seconds between them: within the drain's share plans leave spare (``1 -
        sustain``), measured; beyond, less that error, a lower bound (None: not even that)."""
        drain = ref.drain_to(cliff.seconds, cliff.drive, self.start_fill, self.fast)
        if not self._possible(drain):
            return None, None
        before = rate_between(self.looks, max(self._run_from, cliff.seconds - HOLD_S),
                              cliff.seconds) or self.fast
        error = (spread_of(ref) * abs(self.fast - drain) + cliff.spread * abs(before - drain)) / (
            cliff.seconds - ref.seconds)
        if error <= (1.0 - self.settings.sustain) * drain:
            return drain, MEASURED
        return (drain - error, LOWER_BOUND) if drain > error else (None, None)

    def _cliff_unpaced(self, seconds: float) -> Optional[SeenCliff]:
        """The cliff in an unpaced run, held to the rate the drive was seen to take unpaced
        less its noise (a run never that fast is in its cliff from its start)."""
        floor = 0.9 * self.fast if self.fast else 0.0
        low_from = dropped(self.looks, self._run_from, seconds, floor)
        return None if low_from is None else self._seen(low_from, "writes")

    def _cliff_planned(self, seconds: float) -> Optional[SeenCliff]:
        """A cliff the plan did not predict: an unpaced stretch dropping, a pace the drive
        fell short of, or reads slowing. A run starts where the pace changed by a tenth."""
        low_from = seconds - HOLD_S
        pace = self.planner.rate()
        if pace > 0 and self._steady > 0 and self.reads.slowed():
            return self._seen(low_from, "reads")
        if (pace == 0) != (self._steady == 0) or abs(pace - self._steady) > 0.1 * self._steady:
            self._new_run(self.looks[-2][0], pace)
        if pace == 0:
            return self._cliff_unpaced(seconds)
        # A pace at or below the post-cache rate shows no shortfall in the cliff.
        if low_from < self._run_from or (self.post and pace <= 1.1 * self.post):
            return None
        return self._short_of(min(pace, self.fast or pace), low_from, seconds)

    def _new_run(self, changed: float, pace: float) -> None:
        """A run at ``pace`` (0: unpaced) from ``changed``; a paced one judged from a slice on
        (the slice the run before it spent holds its first requests up to a slice)."""
        self._run_from, self._steady = changed + (SLICE_S if pace else 0.0), pace

    def _cliff_tested(self, seconds: float, bursting: bool) -> Optional[SeenCliff]:
        """A cliff in a test's (or a repeat's) schedule: in its burst as in any unpaced run;
        in its paced tail, the write falling short or the reads slowing."""
        low_from = seconds - HOLD_S
        if not bursting and low_from >= self._run_from and self.reads.slowed():
            return self._seen(low_from, "reads")  # beside the paced tail only
        if bursting or low_from < self._run_from:
            return self._cliff_unpaced(seconds)  # the burst may meet a cliff come early
        return self._short_of(self._steady, low_from, seconds)

    def _short_of(self, pace: float, low_from: float, seconds: float) -> Optional[SeenCliff]:
        """The cliff shown by a paced write under ``SHORTFALL`` of ``pace`` since ``low_from``,
        not stalling."""
        if rate_between(self.looks, low_from, seconds) < SHORTFALL * pace and \
                not stalled(self.looks, low_from):
            return self._seen(low_from, "writes")
        return None

    def _seen(self, low_from: float, shown_by: str) -> SeenCliff:
        """The cliff confirmed low from ``low_from``, placed where the write fell from its pace
        (unpaced: from midway between the drive's rates)."""
        pace = self.pace() if self.mode in (PLAN, TEST, REPEAT) and self._steady else 0.0
        above = SHORTFALL * pace if pace else 0.5 * ((self.fast or 0.0) + (self.post or 0.0))
        at, spread = placed(self.looks, low_from, self._run_from, above) \
            if shown_by == "writes" else (low_from, HOLD_S)
        return SeenCliff(at, bytes_at(self.looks, at), bytes_at(self.looks, at, DRIVE),
                         shown_by, self.mode, spread)

    def _since_full(self, seconds: float, drive: Optional[float] = None) -> Optional[float]:
        """The drive's bytes/s from a moment its cache was full to ``seconds`` (its counter
        then: ``drive``), the least over the anchors (the one it really was full at; the
        others read high). To a cliff, the drain; to a moment out of it, a lower bound."""
        drive = bytes_at(self.looks, seconds, DRIVE) if drive is None else drive
        rates = [(drive - a[DRIVE]) / (seconds - a[0]) for a in self._anchors if seconds > a[0]]
        return min(rates) if rates else None

    def _last_clear(self, seconds: float) -> float:
        """The latest moment a write out of its cliff is known to have stayed out: a slice
        before ``seconds`` (an unseen cliff may lie in it), or the refill's start."""
        return max(seconds - SLICE_S, self._since)

    def _tail_cliff(self, seconds: float) -> Optional[SeenCliff]:
        """A cliff in a write's last ``SLICE_S``, too near its end to last a hold."""
        if self.mode not in (BURST, REFILL, TEST, REPEAT, PLAN) or (
                self.mode == REFILL and not self._probed):
            return None
        start = seconds - SLICE_S
        before = rate_between(self.looks, self._run_from, start)
        if start - self._run_from < HOLD_S or before <= 0:
            return None
        now = rate_between(self.looks, start, seconds)
        if self.mode in (BURST, REFILL) or self._steady == 0 or \
                self.mode in (TEST, REPEAT) and self.looks[-1][DRIVE] < self._test_until:
            low = now < 0.5 * max(before, 0.9 * (self.fast or 0))
        else:
            low = now < SHORTFALL * min(self._steady, before)
        return self._seen(start, "writes") if low else None

    def _clear_of(self, ref, end: float) -> Optional[float]:
        """The least drain under which the save never met the model's cliff, placed as late
        as it may have come (not over the last slice, which could hide a cliff)."""
        best = None
        ref = ref.latest(self.fast or 0.0, spread_of(ref))
        looks = [lk for lk in self.looks if lk[0] <= end - SLICE_S]
        for seconds, _done, drive in looks[::5] + looks[-1:]:
            drain = ref.drain_to(seconds, drive, self.start_fill, self.fast, bound=True)
            if drain is not None and (best is None or drain > best):
                best = drain
        return best

    def _cache(self) -> float:
        """The cache's size by the save's drain, from the first cliff it met."""
        return self._cache_by(self.drain or 0.0)

    def _cache_by(self, drain: float) -> float:
        first = self._first
        return max(float(1 << 20), self.start_fill(drain) + first.drive - drain * first.seconds)

    def _margin(self, cache: float) -> float:
        """Bytes the drive frees before it leaves its cliff: at most what it had freed when
        this save saw it out, else the model's."""
        rec = self.record
        if rec.exit_s is not None and self.drain:
            return min(cache, max(0.0, self.drain * rec.exit_s - rec.exit_bytes))
        return self.model.margin if self.model.has_cliff else ASSUMED_CLIFF_MARGIN * cache

    def _run_rate(self, until: float) -> Optional[float]:
        rate = rate_between(self.looks, self._run_from, until)
        return rate if until - self._run_from >= HOLD_S and rate > 0 else None

    def _peak_rate(self) -> float:
        """The fastest bytes/s between two looks at least 10 ms apart in the last second."""
        recent = [lk for lk in self.looks if lk[0] >= self.looks[-1][0] - 1.0]
        best = 0.0
        for k in range(1, len(recent)):
            j = k - 1
            while j > 0 and recent[k][0] - recent[j][0] < 0.01:
                j -= 1
            span = recent[k][0] - recent[j][0]
            if span >= 0.01:
                best = max(best, (recent[k][2] - recent[j][2]) / span)
        return best

    def _end_fill(self, seconds: float) -> float:
        if self.mode == PLAN:
            return self.planner.fill
        if not self.record.cliffs:
            drain = self.drain or 0.0
            fill = self.start_fill(drain) + self.looks[-1][DRIVE] - drain * seconds
            cache = self.model.cliff.cache(drain) if self.model.has_cliff else math.inf
            return min(max(0.0, fill), cache)
        cache = self._cache()
        if not self._anchors:
            return cache
        anchor = self._anchors[-1]
        return max(0.0, cache - (self.drain or 0.0) * (seconds - anchor[0])
                   + self.looks[-1][2] - anchor[2])
