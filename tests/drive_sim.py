"""A simulated SLC-cache drive, clock-free, and saves steered by SaveController on it.

The drive is the emulator's own cache model (flashstream/emulation/model.py) behind a model of
the kernel's block-I/O throttle as the emulator drives it: every 10 ms the model is stepped with
the bytes written and sets the limits; the throttle lets ``limit x 0.1 s`` through at the start
of each 0.1 s slice (a new limit restarts the slice), at the disk's own speed. A write keeps up
to ``lead`` bytes in flight unpaced, a couple of paced requests otherwise. Reads beside it are
counted as /proc/diskstats counts them: in the cliff (and while the emulator holds writes ahead
of it) they pass the read limit (``fold_read_rate``) as the throttle passes them, a slice's
worth at each slice's start and the rest queued, so that a reader asking less than the limit
is hardly slowed, as on the emulator.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import List, Optional

from flashstream.checkpoint.drive_learning import learn
from flashstream.checkpoint.pacing import DEFAULT_SETTINGS, PlanSettings
from flashstream.checkpoint.save_control import (
    CREDITED_IDLE_S,
    PAUSE_RATE,
    SaveController,
    SaveRecord,
)
from flashstream.emulation.model import CacheModel, DriveSettings
from flashstream.telemetry.drive_model import DriveModel

STEP_S = 0.002
EMULATOR_TICK_S = 0.01
SLICE_S = 0.1
PACED_LEAD = 2 * 256 * 1024
QUIET_READ_S = 0.0005  # a 128 KiB read on the disk with nothing else on it


class SimDrive:
    """An emulated drive on a disk writing ``disk_rate`` bytes/s, its clock in ``now``."""

    def __init__(self, settings: DriveSettings, *, disk_rate: float, noise: float = 0.0,
                 seed: int = 0, reads_per_s: float = 0.0, read_block: float = 128 * 1024,
                 stalls_per_s: float = 0.0, idle_credit: bool = False) -> None:
        self.settings, self.disk_rate = settings, disk_rate
        self.model = CacheModel(settings, horizon=EMULATOR_TICK_S, release=SLICE_S)
        self.rng = random.Random(seed)
        self.noise, self.reads_per_s, self.stalls_per_s = noise, reads_per_s, stalls_per_s
        self.now = 0.0
        self.written = 0.0           # the drive's counter: every byte it took
        self.read_block = read_block
        self.reads = 0.0             # completed, as /proc/diskstats counts them
        self.read_s = 0.0            # seconds the completed reads took
        self._queued = 0.0           # reads waiting for the read limit's next slice
        self._read_budget, self._read_slice_at = 0.0, -math.inf
        self.cliff_s = 0.0           # seconds in the cliff so far
        self.cliff_log: List[tuple] = []  # (start, end) of each stay in the cliff
        self._tick_bytes, self._next_tick = 0.0, EMULATOR_TICK_S
        self._limit, self._slice_at, self._budget = 0.0, 0.0, math.inf
        self._stall_until = 0.0
        self._factor = 1.0
        # cgroup v1's throttle credits a group the time it sat idle, while its slice lasts: a
        # writer that resumes after a short pause gets the limit's worth of the pause at once,
        # besides the slice (save_control.CREDITED_IDLE_S); after a longer one, a slice.
        self.idle_credit, self._last_want = idle_credit, 0.0

    def step(self, want: float, others: float = 0.0) -> float:
        """Advance one step with ``want`` bytes of this writer's ready to complete; returns the
        bytes that completed."""
        dt = STEP_S
        if self.now >= self._slice_at + SLICE_S and self._limit:
            self._slice_at, self._budget = self.now, self._limit * SLICE_S
        if want > 0:
            idle = self.now - self._last_want
            if self.idle_credit and self._limit and SLICE_S < idle <= CREDITED_IDLE_S:
                self._slice_at, self._budget = self.now, self._limit * (SLICE_S + idle)
            self._last_want = self.now
        capacity = self.disk_rate * dt * self._factor
        if self.now < self._stall_until:
            capacity = 0.0
        capacity = min(capacity, self._budget)
        done = min(want, capacity)
        if self._limit:
            self._budget -= done
        self._account(done + others * dt, dt)
        return done

    def idle(self, seconds: float, others: float = 0.0) -> None:
        for _ in range(int(round(seconds / STEP_S))):
            self.step(0.0, others)

    def _account(self, nbytes: float, dt: float) -> None:
        self.written += nbytes
        self._tick_bytes += nbytes
        self.now += dt
        cliff = self.model.state.cliff
        if cliff:
            self.cliff_s += dt
        if self.reads_per_s:
            self._read(self.reads_per_s * dt, dt)
        if self.now >= self._next_tick - 1e-12:
            self._next_tick += EMULATOR_TICK_S
            was = self.model.state.cliff
            self.model.step(self._tick_bytes, EMULATOR_TICK_S)
            self._tick_bytes = 0.0
            if self.model.state.cliff and not was:
                self.cliff_log.append([self.now, self.now])
            if self.model.state.cliff:
                self.cliff_log[-1][1] = self.now
            limit = self.model.write_limit()
            if limit != self._limit and not (limit and self._limit and
                                              abs(limit - self._limit) <= 0.05 * self._limit):
                self._limit, self._slice_at = limit, self.now
                self._budget = limit * SLICE_S if limit else math.inf
            if self.noise:
                self._factor = max(0.2, 1 + self.rng.gauss(0, self.noise))
            if self.stalls_per_s and self.rng.random() < self.stalls_per_s * EMULATOR_TICK_S:
                self._stall_until = self.now + self.rng.uniform(0.1, 0.4)

    def _read(self, arriving: float, dt: float) -> None:
        """``arriving`` reads of ``read_block`` bytes over ``dt``: each takes the disk's quiet
        latency, and under a read limit waits its turn in the limit's slices."""
        limit = self.model.read_limit()
        self._queued += arriving
        if limit:
            if self.now >= self._read_slice_at + SLICE_S:
                self._read_slice_at, self._read_budget = self.now, limit * SLICE_S
            served = min(self._queued, self._read_budget / self.read_block)
            self._read_budget -= served * self.read_block
        else:
            served = self._queued
        self.read_s += (self._queued - served) * dt + served * QUIET_READ_S
        self._queued -= served
        self.reads += served

    def cliff_seconds(self, start: float, end: float = math.inf) -> float:
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.cliff_log)


@dataclasses.dataclass
class SimSave:
    seconds: float
    record: SaveRecord
    start_fill: float
    cliff_after_s: float = 0.0


def run_save(drive: SimDrive, model: DriveModel, total: float, *, measure: bool,
             test: Optional[float] = None,
             lead: float = 64 << 20, deadline: Optional[float] = None,
             others: float = 0.0, counter: bool = True,
             settings: PlanSettings = DEFAULT_SETTINGS, quiet_read_s: Optional[float] = None,
             wall0: float = 1e6) -> SimSave:
    """One save of ``total`` bytes on ``drive`` from ``model`` (updated after it)."""
    start_disk = drive.written
    wall = wall0 + drive.now
    start_fill_of = model.start_fill(wall, int(start_disk) if counter else None)
    truth = drive.model.state.fill
    ctl = SaveController(model, total=total, start_fill=start_fill_of, measure=measure,
                         test=test,
                         deadline=deadline, settings=settings, lead=lead,
                         quiet_read_s=quiet_read_s)
    t, done, issued = 0.0, 0.0, 0.0
    pace = ctl.pace()
    next_look = ctl.next_wait()
    reads0, read_s0 = drive.reads, drive.read_s
    while done < total:
        if t > 600:
            raise RuntimeError(f"a save that never ends: {ctl.mode} since {ctl._since:.2f} s, "
                               f"{done:.0f} of {total:.0f} bytes, modes {ctl.record.modes}")
        if pace == 0:
            issued = min(total, done + lead)
        elif pace > PAUSE_RATE:
            issued = min(total, issued + pace * STEP_S, done + max(PACED_LEAD, pace * STEP_S))
        done += drive.step(issued - done, others)
        t += STEP_S
        if t >= next_look - 1e-12 and done < total:
            seen = drive.written - start_disk if counter else None
            pace = ctl.look(t, done, seen, int(drive.reads - reads0), drive.read_s - read_s0)
            next_look = t + ctl.next_wait()
    record = ctl.finish(t, done, drive.written - start_disk if counter else None)
    learn(model, record, total=total, start_fill=start_fill_of, ended=wall0 + drive.now,
          ended_disk=int(drive.written) if counter else None)
    return SimSave(t, record, truth)


def shortest(settings: DriveSettings, fill: float, nbytes: float) -> float:
    """The least seconds the drive takes ``nbytes`` in without its cliff, from ``fill``:
    unpaced until the cache is full, then at its drain."""
    fast, cache, drain = settings.fast_rate, settings.cache_size, settings.drain_rate
    burst = max(0.0, cache - fill) * fast / (fast - drain)
    return nbytes / fast if nbytes <= burst else burst / fast + (nbytes - burst) / drain
