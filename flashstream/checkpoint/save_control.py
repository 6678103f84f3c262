"""The pace of one ``rate="auto"`` save, set while it writes, and what the save showed of the
drive: the saves are the measurements, and they write nothing but the checkpoint.

:class:`SaveController` is clock-free: handed a look at the write's progress (seconds, bytes
it completed, bytes the drive took from every writer, the reads on the drive), it answers the
pace (pacing_thread.py runs it against a write in flight). Its modes:

- ``plan``: the :class:`~flashstream.checkpoint.pacing.CachePlanner`'s pace from the model.
- ``burst``: unpaced to the cliff, where this writer has not yet seen the model confirmed (a
  model measured by someone else, or before, may be wrong either way).
- ``pause``: from the cliff the save stops, so the drive folds from a full cache (the
  *anchor*: the last request completed); then ``refill``: unpaced until the cliff comes back.
  The drive's bytes over the seconds between are its drain (every writer's, by its counter);
  where the bytes run out first, a lower bound.
- ``recover``: stopped until the drive has freed the margin it needs to leave its cliff,
  then ``plan`` for the rest from the figures just read.
- ``test``: where the drain is not measured, from an empty cache, unpaced short of the
  model's cliff for any drain, then midway between the drive's two rates
  (auto_pacing.trial_pace). A drive draining slower meets its cliff late: the save recovers
  at once, and the two cliffs read the drain (save_readings.py); one that does not ends close
  under its cliff, a close lower bound.
- ``repeat``: a schedule the drive took clear before, written the same way again.

In ``plan``, a cliff the plan did not predict (cliff_watch.py: the write falling short, or the
reads slowing) starts the same measurement. A deadline (``within=``) bounds all of it: once
measuring would leave too little time for the rest, the save plans.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional

from ..telemetry.drive_model import LOWER_BOUND, MEASURED, DriveModel, assumed_drain
from .cliff_watch import (
    CLIFF_SHARE,
    DRIVE,
    HOLD_S,
    RATE_NOISE,
    SLICE_S,
    WRITE,
    Look,
    ReadWatch,
    bytes_at,
    rate_between,
)
from .pacing import DEFAULT_SETTINGS, CachePlanner, PlanSettings
from .save_readings import SaveReadings
from .save_record import (
    BURST,
    PAUSE,
    PLAN,
    RECOVER,
    REFILL,
    REPEAT,
    TEST,
    SaveRecord,
    SeenCliff,
    describe,
)

__all__ = ["PLAN", "BURST", "PAUSE", "REFILL", "RECOVER", "REPEAT", "TEST", "SaveController",
           "SaveRecord", "SeenCliff", "describe"]

#: The pace that stops a write (bytes/s): a request waits far longer than any save lasts.
PAUSE_RATE = 1.0
#: Seconds between looks while unpaced or measuring (a cliff is placed to about one), else.
FINE_TICK_S, TICK_S = 0.02, 0.05
#: Seconds of a refill, from a slice after it began (the first slice brings a burst at any
#: rate: what the pause folded, or a throttle's credit), that tell whether the drive is out of
#: its cliff: more than a slice.
PROBE_S = 0.15
#: The longest idle a block-I/O throttle credits a writer when it resumes (seconds), besides
#: its slice; a longer one starts a fresh slice (docs/emulation.md).
CREDITED_IDLE_S = 0.2
#: The least pause before a refill (seconds): shorter, the drive has not folded a margin.
MIN_PAUSE_S = 0.1
#: A measuring write is paced at this many times the drive's new-file rate, once known: the
#: drive still sets the pace, and fewer bytes are in flight when the cliff comes.
BURST_OVER_FAST = 2.0
#: The longest a save stops writing (seconds): past the longest any drive of
#: docs/emulation.md's family needs to free its margin (a quarter of a cache of 2.5 s of fast
#: writing, folding at half the slowest post-cache rate: under 9 s).
MAX_STOP_S = 15.0
#: A refill whose probe ran at this share of the new-file rate or faster is out of the cliff:
#: in it a drive writes at most 0.45 of that rate (docs/emulation.md's family), 0.6 with part
#: of a slice's burst; out of it, the rate less its noise.
OUT_SHARE = 0.75
#: A post-cache window (a slice past the cliff's first) under this share of the mean over the
#: whole cliff caught next to none of a slice's bytes (a gap between slices): the mean reads
#: closer then. Not more: the mean also holds full-rate bytes of a cliff placed early.
EMPTY_WINDOW_SHARE = 0.25
#: How much longer each pause is than the last while the drive is still in its cliff.
PAUSE_GROWTH = 1.5
#: The fastest drain to expect, as a share of the post-cache rate: the fast end of
#: docs/emulation.md's family (idle folding outruns folding under writes).
FASTEST_DRAIN_SHARE = 1.6


class SaveController(SaveReadings):
    """The pace of one save (see the module docstring). ``start_fill(drain)``: the cache's
    fill at the start by a drain rate; ``measure``: burst to the cliff and measure the drain;
    ``test``: the pace to test the model's cliff at; ``lead``: the bytes an unpaced write keeps
    in flight; ``quiet_read_s``: the drive's mean read latency while quiet (None: unknown)."""

    def __init__(self, model: DriveModel, *, total: float, start_fill: Callable[[float], float],
                 measure: bool = False, test: Optional[float] = None,
                 deadline: Optional[float] = None,
                 settings: PlanSettings = DEFAULT_SETTINGS, lead: float = 0.0,
                 min_rate: float = 16 << 20, quiet_read_s: Optional[float] = None,
                 read_slo: Optional[float] = None) -> None:
        self.model, self.total, self.start_fill = model, float(total), start_fill
        self.deadline, self.settings, self.lead = deadline, settings, lead
        self.min_rate, self.read_slo = min_rate, read_slo
        self.fast, self.post, self.drain = model.fast_rate, model.post_cache_rate, model.drain
        self.looks: List[Look] = [(0.0, 0.0, 0.0)]
        self.reads = ReadWatch(quiet_read_s)
        self.record = SaveRecord()
        self.planner: Optional[CachePlanner] = None
        self.mode = ""
        self._since = 0.0       # when the mode began (seconds into the write)
        self._run_from = 0.0    # when the current unpaced run (or steady pace) began
        self._steady = 0.0      # the pace in force since then
        self._anchors: List[Look] = []  # the moments since the cliff the cache may have been full
        self._pause_s = 0.0
        self._probed = False
        self._first: Optional[SeenCliff] = None  # the cliff that sizes the cache
        self._slo_next = 0.0
        self._test_until = self._test_pace = 0.0
        self._reads_held = False  # reads were seen held back since the last cliff
        self._judged_unpaced = False
        fill = start_fill(self.drain or 0.0)
        clear = model.clear
        if measure or not model.has_cliff and (clear is None or clear.total < total):
            self._enter(BURST, 0.0)
        elif test and model.has_cliff and self.fast and self.post:
            # Unpaced to the cliff's bytes less the start fill by the fastest drain to expect
            # (short of the cliff for any drain), then at the test's pace.
            ref, fastest = model.cliff, FASTEST_DRAIN_SHARE * self.post
            self._test_until = self.settings.headroom * (
                ref.start_fill(fastest) + ref.bytes - start_fill(fastest))
            self._test_pace = self.record.test_pace = test
            self._enter(TEST, 0.0)
        elif clear is not None and clear.covers(total, fill):
            self._test_until, self._test_pace = self.settings.repeat(clear, total, self.fast)
            # One taken unpaced, repeated at a share of the new-file rate, is judged as the
            # unpaced run it repeats: falling short of a pace that near the drive's own rate
            # is the drive's noise, not its cliff.
            self._judged_unpaced = not clear.pace and bool(self._test_pace)
            self._enter(REPEAT, 0.0)
        else:
            self._plan(0.0, fill, model.cliff.cache(self.drain or 0.0) if model.has_cliff
                       else None, resume=True)

    # -- the look ------------------------------------------------------------------------
    def pace(self) -> float:
        """Bytes/s the write should run at now (0: unpaced)."""
        if self.mode == PLAN:
            return self.planner.rate()
        scheduled = self.mode in (TEST, REPEAT)
        if self.mode in (BURST, REFILL) or scheduled and (
                self.looks[-1][DRIVE] < self._test_until or not self._test_pace):
            return BURST_OVER_FAST * self.fast if self.fast else 0.0
        return self._test_pace if scheduled else PAUSE_RATE

    def look(self, seconds: float, done: float, drive: Optional[float] = None,
             reads: Optional[int] = None, read_s: Optional[float] = None,
             read_p95: Optional[float] = None) -> float:
        """The write completed ``done`` bytes after ``seconds``; the drive took ``drive`` from
        every writer (None: unknown); its reads: ``reads`` completed, ``read_s`` spent, the
        readers' p95. Returns the pace from now on."""
        drive = done if drive is None else max(drive, done)
        self.looks.append((seconds, float(done), float(drive)))
        self.reads.add(seconds, reads, read_s)
        {BURST: self._burst, PAUSE: self._pause, REFILL: self._refill, TEST: self._test,
         REPEAT: self._test, RECOVER: self._recover, PLAN: self._planned}[self.mode](
            seconds, float(done))
        self.record.unpaced = self.record.unpaced and self.pace() == 0
        if self.mode == PLAN and self.read_slo and read_p95 is not None:
            self._follow_slo(seconds, read_p95)
        return self.pace()

    def next_wait(self) -> float:
        """Seconds until the next look: fine while a cliff or the burst's headroom may come."""
        if self.mode != PLAN:
            return FINE_TICK_S
        if self.planner.rate() != 0:
            return TICK_S
        room, rate = self.planner.burst_left(), max(self.fast or 0.0, self._peak_rate())
        if not math.isfinite(room) or rate <= 0:
            return TICK_S
        # Half the time to the headroom at the fastest the drive took bytes lately: a drive
        # that takes bytes in lumps would otherwise run a lump past it between two looks.
        return min(TICK_S, max(0.002, room / (2 * rate)))

    def finish(self, seconds: float, done: float, drive: Optional[float] = None) -> SaveRecord:
        """The write ended: what it showed of the drive."""
        self.look(seconds, done, drive)
        rec = self.record
        if self.mode == REFILL and not self._probed and seconds - self._since > SLICE_S:
            self._judge_probe(seconds)  # a refill that ended within its probe
        tail = self._tail_cliff(seconds)
        if tail is not None:  # met in its last requests, too near the end to hold
            rec.cliffs.append(tail)
            self._first = self._first or tail
        if self.mode == REFILL and self._probed and rec.drain_how != MEASURED:
            if tail is not None:  # the refill's cliff, in its last requests
                rec.drain, rec.drain_how = self._since_full(tail.seconds, tail.drive), MEASURED
                rec.drain_from = "refill"
            else:
                # Out of the cliff and no cliff since: the drive drained at least as fast as
                # it took bytes since the cache was full.
                rec.drain = self._since_full(self._last_clear(seconds))
                rec.drain_how = LOWER_BOUND
        if self.mode in (BURST, REFILL) and self._run_from == 0.0 and (
                not rec.cliffs or rec.cliffs == [tail]):
            # Unpaced from the start: the drive's new-file rate, up to a cliff in the last
            # requests ...
            rec.fast_rate = rec.fast_rate or self._run_rate(tail.seconds if tail else seconds)
            if tail is not None and rec.fast_rate and not rec.post_cache_rate:
                # ... and in it, as its last slice shows (a model without it assumes the
                # slowest drain, and no test could find it faster).
                post = rate_between(self.looks, tail.seconds, seconds)
                rec.post_cache_rate = min(post, CLIFF_SHARE * rec.fast_rate) or None
        if not rec.cliffs and self.model.has_cliff and self.fast:
            bound = self._clear_of(self.model.cliff, seconds)
            if bound is not None:
                rec.drain, rec.drain_how, rec.drain_from = bound, LOWER_BOUND, "no cliff"
        rec.others_bytes = self.looks[-1][DRIVE] - self.looks[-1][1]
        if not rec.cliffs and self.mode in (TEST, REPEAT, BURST):
            # A repeat took the schedule it repeats clear again; a test or a burst, its own.
            burst, pace = (self.model.clear.burst, self.model.clear.pace) if self.mode == REPEAT \
                else (self._test_until if self._test_pace else self.total, self._test_pace)
            rec.clear = (burst, pace, self.start_fill(self.model.drain or 0.0))
        rec.ends_full = tail is not None or self.mode in (PAUSE, RECOVER) and not self._probed
        rec.end_fill = self._end_fill(seconds)
        if rec.cliffs:
            full = self.looks[-1] if rec.ends_full or not self._anchors else self._anchors[-1]
            rec.full_before = (self.looks[-1][0] - full[0], self.looks[-1][DRIVE] - full[DRIVE])
        if self.planner is not None:
            rec.conflict = self.planner.conflict
        return rec

    # -- the modes -----------------------------------------------------------------------
    def _enter(self, mode: str, seconds: float) -> None:
        self.mode, self._since = mode, seconds
        if mode in (BURST, REFILL):
            self._run_from = seconds
        self.record.modes.append((round(seconds, 3), mode))

    def _burst(self, seconds: float, done: float) -> None:
        if not self.fast and seconds - self._run_from >= HOLD_S:
            self.fast = self._run_rate(seconds)
        cliff = self._cliff_unpaced(seconds)
        if cliff is not None:
            self._met(cliff, seconds)

    def _refill(self, seconds: float, done: float) -> None:
        if not self._probed and (seconds - self._since < SLICE_S + PROBE_S
                                 or not self._judge_probe(seconds)):
            return
        cliff = self._cliff_unpaced(seconds)
        if cliff is None:
            return
        reading = self._since_full(cliff.seconds, cliff.drive)
        if self._possible(reading) and self.record.drain_how != MEASURED:  # the longest span
            self.drain = reading
            self.record.drain, self.record.drain_how = self.drain, MEASURED
            self.record.drain_from = "refill"
        self.record.cliffs.append(cliff)
        self._anchors = []
        self._enter(RECOVER, seconds)

    def _test(self, seconds: float, done: float) -> None:
        bursting = self.looks[-1][DRIVE] < self._test_until or not self._test_pace or \
            self._judged_unpaced
        if not bursting and not self._steady:  # the burst's end: paced from here
            self._new_run(self.looks[-1][0], self.pace())
        cliff = self._cliff_tested(seconds, bursting)
        if cliff is not None:
            self._met(cliff, seconds)

    def _judge_probe(self, seconds: float, out: bool = False) -> bool:
        """Whether the refill's first bytes, past the first slice's burst, ran out of the cliff
        (``out``: the reads showed it); if not, back to pausing."""
        quick = seconds - self._since >= SLICE_S + PROBE_S and rate_between(
            self.looks, self._since + SLICE_S, seconds) >= OUT_SHARE * (self.fast or 0.0)
        if not out and not quick and not self._ran_out_first():
            # Still in the cliff: the probe's end is another moment the cache may be full.
            self._pause_s *= PAUSE_GROWTH
            self._anchors.append(self.looks[-1])
            self._enter(PAUSE, seconds)
            return False
        self._probed = True
        self._note_exit(self._since)
        return True

    def _note_exit(self, at: float) -> None:
        """The drive was out of its cliff at ``at``: how long after the first anchor, and the
        bytes it took meanwhile (the margin it needed is at most what it freed)."""
        first = self._anchors[0]
        self.record.exit_s = at - first[0]
        self.record.exit_bytes = bytes_at(self.looks, at, DRIVE) - first[DRIVE]

    def _reads_show_out(self, seconds: float) -> bool:
        """Whether reads held back since the last cliff are quick again, once the stop has
        lasted ``MIN_PAUSE_S``: the drive has left its cliff."""
        self._reads_held = self._reads_held or self.reads.slowed()
        return self._reads_held and seconds - self._since >= MIN_PAUSE_S and self.reads.quick()

    def _ran_out_first(self) -> bool:
        """Whether the refill ran out of the cliff and met it again within its probe: from its
        start at ``OUT_SHARE`` of the new-file rate or faster for more bytes than the drive
        takes in its cliff over two slices (which may come at once) and a credited pause, by
        a post-cache rate read up to its noise low."""
        if not (self.fast and self.post and self._anchors):
            return False
        idle = max(0.0, self._since - self._anchors[-1][0])
        credited = idle if idle <= CREDITED_IDLE_S else 0.0
        refill = [lk for lk in self.looks if lk[0] >= self._since - 1e-9]
        fast = 0.0
        for a, b in zip(refill, refill[1:]):
            if b[0] <= a[0] or (b[WRITE] - a[WRITE]) / (b[0] - a[0]) < OUT_SHARE * self.fast:
                break
            fast = b[WRITE] - refill[0][WRITE]
        return fast > (1.0 + RATE_NOISE) * (credited + 2 * SLICE_S) * self.post

    def _pause(self, seconds: float, done: float) -> None:
        self._hold_anchor(done)
        if self._reads_show_out(seconds):
            self._enter(REFILL, seconds)
            self._judge_probe(seconds, out=True)
        elif (seconds - self._anchors[-1][0] >= min(self._pause_s, MAX_STOP_S) and
              seconds - self._since >= MIN_PAUSE_S):
            self._enter(REFILL, seconds)

    def _recover(self, seconds: float, done: float) -> None:
        self._hold_anchor(done)
        cache = self._cache()
        margin = self._margin(cache)
        # Full at the anchor: out of the cliff once the drive freed its margin since, or once
        # the reads it held back are quick again.
        anchor = self._anchors[-1]
        freed = (self.drain or 0.0) * (seconds - anchor[0]) - (self.looks[-1][2] - anchor[2])
        out = self._reads_show_out(seconds)
        if out and self.record.exit_s is None:
            self._note_exit(seconds)
        # Bytes left that the drive folds within a slice keep it in its cliff no longer than
        # a cliff is placed to: written now, they spare the save the wait for its margin.
        few = self.total - done <= SLICE_S * (self.drain or 0.0)
        if out or few or freed >= margin or self._out_of_time(seconds) or \
                seconds - self._since > MAX_STOP_S:
            self._plan(seconds, cache - max(0.0, freed), cache)

    def _plan(self, seconds: float, fill: float, cache: Optional[float],
              resume: bool = False) -> None:
        done = self.looks[-1][1]
        if cache is None:  # no cliff seen, and none needed: the drive took more than this
            cache = math.inf
        drain = self.drain if self.drain else (self.fast or math.inf)
        deadline = None if self.deadline is None else max(1e-3, self.deadline - seconds)
        margin = self._margin(cache) if math.isfinite(cache) else 0.0
        self.planner = CachePlanner(
            total=self.total - done, cache_size=cache, drain=drain, fill=fill,
            deadline=deadline, settings=self.settings, lead=self.lead,
            resume=cache - margin if resume and math.isfinite(cache) else None)
        self._plan_from = self.looks[-1]
        self._enter(PLAN, seconds)

    def _planned(self, seconds: float, done: float) -> None:
        base = self._plan_from
        self.planner.advance(done - base[1], seconds - base[0], self.looks[-1][2] - base[2])
        cliff = self._cliff_planned(seconds)
        if cliff is not None:
            self._met(cliff, seconds)

    # -- cliffs ----------------------------------------------------------------------------
    def _met(self, cliff: SeenCliff, seconds: float) -> None:
        """A cliff: the first sizes the cache; measure the drain if bytes and time allow."""
        rec = self.record
        rec.cliffs.append(cliff)
        self._first = self._first or cliff
        if cliff.shown_by == "writes" and (self.mode in (BURST, REFILL) or
                                           self.mode in (TEST, REPEAT) and not self._steady):
            # Met unpaced: the drive's own rates before (not a repeat's pace) and in its cliff.
            if not self._judged_unpaced:
                rec.fast_rate = rec.fast_rate or self._run_rate(cliff.seconds)
                self.fast = rec.fast_rate or self.fast
            # Past the cliff's first slice (still a slice's worth at once), over one slice
            # counted to its edges (the looks inside span less and read a step high).
            whole = rate_between(self.looks, cliff.seconds, seconds)
            start = min(cliff.seconds + SLICE_S, seconds - SLICE_S)
            post = (bytes_at(self.looks, seconds) - bytes_at(self.looks, start)) / (
                seconds - start)
            if post < EMPTY_WINDOW_SHARE * whole:
                post = whole
            post = post or rate_between(self.looks, seconds - HOLD_S, seconds)
            if post > 0:
                # Below half the rate before, the rule that found the cliff: more is a
                # slice's burst or requests still in flight.
                rec.post_cache_rate = self.post = min(post, CLIFF_SHARE * (self.fast or post))
        ref = self.model.cliff
        if cliff is self._first and self.mode in (PLAN, TEST, REPEAT) and ref is not None and \
                self.fast:
            # Against the cliff the model holds, the one a planned save met tells the drain.
            drain, how = self._two_cliffs(ref, cliff)
            if drain is not None and rec.drain_how != MEASURED:
                rec.drain, rec.drain_how, rec.drain_from = drain, how, "two cliffs"
                if how == MEASURED:
                    self.drain = drain
        if rec.drain_how != MEASURED:
            # Until the refill reads it, the slow end of drives (or a slower drain a plan
            # knew): a model being measured, or just contradicted, may be wrong either way.
            assumed = assumed_drain(self.post, self.fast) or assumed_drain(
                None, rate_between(self.looks, self._run_from, cliff.seconds))
            self.drain = min(self.drain, assumed) if self.drain and assumed and \
                cliff.during == PLAN else (assumed or self.drain)
        self._anchors, self._reads_held = [], False
        # Measured off two cliffs, or met by a test (a refill would hold the drive in its
        # cliff again): recover and plan; else pause and read the drain from the refill.
        self._pause_s = 0.0 if rec.drain_how == MEASURED or cliff.during == TEST \
            else self._pause_for(seconds)
        self._enter(PAUSE if self._pause_s > 0 else RECOVER, seconds)

    # -- helpers -------------------------------------------------------------------------
    def _hold_anchor(self, done: float) -> None:
        """The newest anchor: the last look at which the write still completed bytes in the
        cliff (requests in flight complete after the pause begins)."""
        if not self._anchors:
            self._anchors.append(self.looks[-1])
        elif done > self._anchors[-1][1]:
            self._anchors[-1] = self.looks[-1]

    def _pause_for(self, seconds: float) -> float:
        """Seconds to pause before the refill: as long as the bytes left allow a refill to
        its cliff and a hold in it (a longer span reads the drain closer, and frees the
        margin), short of emptying the cache at the fastest drain (0: no reading)."""
        left = self.total - self.looks[-1][1] - self.lead
        if self.deadline is not None or not self.post or not self.fast or left <= 0:
            return 0.0
        # A pause of p fills back after d * p * fast / (fast - d) bytes at a drain d (guessed
        # at the post-cache rate, the middle of drives), then a hold at the post-cache rate.
        guess = min(self.post, 0.9 * self.fast)
        per_second = guess * self.fast / (self.fast - guess)
        pause = (left - self.post * (HOLD_S + SLICE_S)) / per_second
        if self._first is not None:
            fastest = min(FASTEST_DRAIN_SHARE * self.post, 0.9 * self.fast)
            pause = min(pause, 0.8 * self._cache_by(guess) / fastest)
        # Too few bytes to reach the cliff again: the least pause bounds the drain closest.
        return max(pause, MIN_PAUSE_S)

    def _out_of_time(self, seconds: float) -> bool:
        return self.deadline is not None and seconds >= self.deadline * self.settings.finish

    def _follow_slo(self, seconds: float, p95: float) -> None:
        """Lowers the pace while reads miss ``read_slo``, raises it back while they meet it."""
        if seconds < self._slo_next:
            return
        self._slo_next = seconds + 0.25
        planner = self.planner
        current = planner.rate() or self.fast or planner.recovery * 4
        if p95 > self.read_slo:
            self.record.slo_misses += 1
            planner.slo_cap = max(self.min_rate, 0.7 * current)
        elif planner.slo_cap is not None:
            raised = planner.slo_cap * 1.1
            planner.slo_cap = None if self.fast and raised >= self.fast else raised
