"""rate="auto" from the drive's write model: the planner (clock-free), the cliff finder, the
model's learning, RateControl through each engine, and saves on an emulated drive (root)."""

from __future__ import annotations

import json
import math
import os
import random
import threading
import time

import numpy as np
import pytest
import torch

from flashstream import CheckpointWriter, engine, load_checkpoint
from flashstream.checkpoint.pacing import CachePlanner, PlanSettings
from flashstream.checkpoint.save_control import plan_save
from flashstream.emulation import DriveSettings, throttle_support
from flashstream.telemetry.cliff import find_cliff
from flashstream.telemetry.write_learning import learn_from_save
from flashstream.telemetry.write_model import (
    MEASURED,
    PARAMETERS,
    WriteModel,
    drained,
    load_model,
)

MiB = 1 << 20


def _run(planner: CachePlanner, drive_rate: float, dt: float = 0.05, limit: float = 120.0,
         others: float = 0.0, counter: bool = True, drain: float = 0.0):
    """Simulates a write steered by `planner` on a drive writing at most drive_rate, beside
    other writers giving the drive `others` bytes/s (seen through the drive's counter if
    `counter`), whose cache drains at `drain` (default: the planner's recovery rate); returns
    (seconds, the most the cache estimate held, the most the cache held)."""
    drain = drain or planner.recovery
    t, done, peak = 0.0, 0.0, planner.fill
    held, held_peak = planner.fill, planner.fill
    while done < planner.total and t < limit:
        pace = planner.rate() or drive_rate
        step = min(planner.total - done, min(pace, drive_rate) * dt)
        done += step
        t += dt
        held = drained(held + step + others * dt, drain, dt)
        planner.advance(done, t, done + others * t if counter else None)
        peak, held_peak = max(peak, planner.fill), max(held_peak, held)
    return t, peak, held_peak


def _save_on_drive(planner: CachePlanner, fast: float, drain: float, held: float = 0.0,
                   dt: float = 0.002) -> tuple:
    """One save planned by ``planner`` on a smooth drive that takes at most ``fast`` bytes/s
    and folds ``drain``, its cache holding ``held`` bytes at the start: the seconds it took,
    the bytes held at its end and the most held meanwhile."""
    t, done, peak = 0.0, 0.0, held
    while done < planner.total:
        step = min(planner.total - done, min(planner.rate() or fast, fast) * dt)
        done, t = done + step, t + dt
        held = drained(held + step, drain, dt)
        peak = max(peak, held)
        planner.advance(done, t)
    return t, held, peak


def test_without_a_deadline_it_bursts_through_the_headroom_then_sustains():
    p = CachePlanner(total=2000 * MiB, cache_size=1000 * MiB, recovery_rate=100 * MiB)
    assert p.rate() == 0  # headroom: unpaced
    seconds, peak, _ = _run(p, drive_rate=1000 * MiB)
    assert peak <= 0.85 * 1000 * MiB + 50 * MiB  # one step past the switch at most
    assert p.rate() == pytest.approx(0.9 * 100 * MiB) or p.done == p.total


def _lumps(t: float, offset: float = 0.0) -> float:
    """Bytes by ``t`` from a drive throttled to 3 GB/s in 0.1 s slices: each slice's 300 MB
    at 6 GB/s, then nothing (the emulator's fast phase); the slices begin ``offset`` s in."""
    if t < offset:
        return 0.0
    slices, into = divmod(t - offset, 0.1)
    return 300e6 * slices + min(300e6, 6e9 * into)


@pytest.mark.parametrize("drive", ["3e9", "4.5e9", "lumps", "lumps between looks"])
def test_an_unpaced_burst_is_paced_at_its_headroom_not_a_tick_past_it(drive):
    """The controller looks again before an unpaced burst can reach the headroom, at the
    faster of the model's new-file rate and the fastest the drive took bytes lately: looking
    a fixed tick (50 ms) later, a burst at a few GB/s ran up to 150 MB past it, and emulated
    drives with their caches' size read a few percent high met the cliff in every save; at
    the new-file rate alone, a burst taken in lumps at twice it still ran 40-90 MB past; at
    the rate seen, lumps the looks fell half-way through ran 59 MB past (the wait now
    allows for twice that rate)."""
    from flashstream.checkpoint.save_control import MIN_WAIT_S, SaveController

    # Lumps half a tick out of step with the looks: each tick's look saw half a lump, the
    # mean rate, until the last wait before the headroom let a whole one through (traced on
    # emulated drive 40: 268 MB in 43 ms, and the cache 0.97 full against a limit of 0.88).
    written = {"lumps": _lumps, "lumps between looks": lambda t: _lumps(t, 0.025)}.get(
        drive, lambda t: float(drive) * t)
    drive_rate = 6e9 if drive.startswith("lumps") else float(drive)

    def burst(looks_when) -> CachePlanner:
        planner = CachePlanner(total=int(2e9), cache_size=1e9, recovery_rate=100e6,
                               lead=64e6)
        controller = SaveController(planner, fast_rate=3e9)
        t = 0.0
        while planner.rate() == 0:
            t += looks_when(controller, planner)
            planner.advance(min(written(t), planner.total), t)
        return planner

    paced = burst(lambda c, p: c._burst_wait(p))
    assert paced.fill + paced.lead <= paced.limit + drive_rate * MIN_WAIT_S
    assert paced.fill + paced.lead >= paced.limit - 30e6  # no earlier than it must
    ticked = burst(lambda c, p: c.tick)
    assert ticked.fill + ticked.lead > paced.limit + 50e6
    fits = CachePlanner(total=int(0.5e9), cache_size=1e9, recovery_rate=300e6)
    assert SaveController(fits, fast_rate=3e9)._burst_wait(fits) == 0.05  # unpaced to its end
    # Past its deadline, unpaced as the cache allows: no headroom steers it, a tick apart
    # (it looked every 2 ms).
    late = CachePlanner(total=int(0.5e9), cache_size=1e9, recovery_rate=300e6, deadline=1.0)
    late.advance(1e8, 2.0)
    assert late.rate() == 0 and late.burst_left() == math.inf
    assert SaveController(late, fast_rate=3e9)._burst_wait(late) == 0.05


def test_past_the_headroom_it_paces_to_the_ceiling_at_the_sustained_drain():
    """The tail's pace counts on 0.9 x the drain: a drain the model has a tenth too high still
    leaves the cache below its ceiling; an exact one finishes sooner than sustaining did."""
    kw = dict(total=2000 * MiB, cache_size=1000 * MiB, recovery_rate=100 * MiB)
    step = 1000 * MiB * 0.05
    _, _, held = _run(CachePlanner(**kw), drive_rate=1000 * MiB, drain=90 * MiB)
    assert held <= 0.95 * 1000 * MiB + step
    seconds, _, held = _run(CachePlanner(**kw), drive_rate=1000 * MiB)
    assert held < 0.95 * 1000 * MiB + step
    burst = 850 * MiB * 1000 / 900  # to the headroom, draining at 100 MiB/s meanwhile
    burst_then_sustain = burst / (1000 * MiB) + (2000 * MiB - burst) / (90 * MiB)
    assert seconds < 0.95 * burst_then_sustain
    with pytest.raises(ValueError, match="ceiling must be at least headroom"):
        PlanSettings(ceiling=0.8)


def test_a_drain_estimated_a_tenth_high_never_fills_the_cache_on_the_family():
    """Over drives drawn from the documented family, saves of 4 x the cache planned from a
    recovery rate 10% above the drive's stay out of the cliff: the tail's margin holds for
    long saves. (Sustaining at 0.9 x the drain past the headroom, then bursting again each
    time the estimate fell back under it, filled the cache to 1.14 x on these drives.)"""
    import random

    from flashstream.emulation import random_settings

    for seed in range(11, 31):
        s = random_settings(800e6, random.Random(seed))
        planner = CachePlanner(total=int(4 * s.cache_size), cache_size=float(s.cache_size),
                               recovery_rate=1.1 * s.drain_rate, lead=8 * MiB)
        _t, _held, peak = _save_on_drive(planner, s.fast_rate, s.drain_rate, dt=0.02)
        assert peak < s.cache_size, (seed, s.describe(), peak / s.cache_size)


def test_an_estimated_drain_leaves_an_exact_model_near_the_shortest_on_the_family():
    """Saves of 1.75 x the cache, planned from an exact model whose drain is an estimate (the
    one refill reading after a learning save), take at most 1.22 x the shortest cliff-free
    duration on the family and leave a tenth of the cache spare: the margins stacked on an
    estimate are paid in every save (at ESTIMATE_SHARE 0.95, 1.25 x; with the cache read 7%
    low, as the emulated drives' learning saves gave it, 1.35 x against the target's 1.3)."""
    import random

    from flashstream.emulation import random_settings
    from flashstream.telemetry.write_model import ESTIMATE_SHARE

    for seed in range(11, 31):
        s = random_settings(3.27e9, random.Random(seed))
        cache, fast, drain = float(s.cache_size), s.fast_rate, s.drain_rate
        total = 1.75 * cache
        burst = cache * fast / (fast - drain)  # unpaced until full, then at the drain
        shortest = total / fast if total <= burst else burst / fast + (total - burst) / drain
        planner = CachePlanner(total=int(total), cache_size=cache,
                               recovery_rate=ESTIMATE_SHARE * drain, lead=64 * MiB)
        t, _held, peak = _save_on_drive(planner, fast, drain)
        assert t <= 1.22 * shortest, (seed, s.describe(), t / shortest)
        assert peak <= 0.9 * cache, (seed, s.describe(), peak / cache)


def test_a_cache_sized_by_a_drain_read_low_keeps_saves_out_of_the_cliff():
    """A learning save met its cliff from an empty cache; its refill, cut short by the next
    save, only bounded the drain from below. Sized by that bound (the drain the saves plan
    with), the cache comes out too large by what the drive drained faster up to the cliff,
    and the fill estimate errs the same way: bursts from an empty cache meet the headroom
    where the drive's cache does, and the estimate stays above the drive's fill after. On
    the family, with bounds from 0.3 x the drain up, saves from empty and saves 1 s apart
    (each starting from the fill the last left) keep the cache below the planner's ceiling
    (a tail paced to the ceiling of the larger cache ends at most 0.92 full). (Sized by
    the fast end of drives instead, the cache came out 0.82-0.84 x on emulated drive 38 and
    its saves took 1.44-1.48 x the shortest.)"""
    import random

    from flashstream.emulation import random_settings

    for seed in range(11, 31):
        s = random_settings(3.27e9, random.Random(seed))
        cache, fast, drain = float(s.cache_size), s.fast_rate, s.drain_rate
        to_cliff = cache / (fast - drain)  # the learning save, unpaced from empty
        for share in (0.3, 0.6, 0.95):
            low = share * drain
            sized = fast * to_cliff - low * to_cliff  # bytes before the cliff less the drain
            held, estimate = 0.0, 0.0
            for gap in (10.0, 1.0, 1.0):
                held, estimate = drained(held, drain, gap), drained(estimate, low, gap)
                planner = CachePlanner(total=int(1.75 * cache), cache_size=sized,
                                       recovery_rate=low, fill=estimate, lead=64 * MiB)
                _t, held, peak = _save_on_drive(planner, fast, drain, held, dt=0.004)
                estimate = planner.fill
                info = (seed, share, gap, s.describe(), peak / cache)
                assert peak <= 0.93 * cache, info
                assert estimate >= held, info


def test_a_save_that_starts_with_a_full_cache_lets_it_drain_first():
    """At its ceiling or over, the cache may be in the drive's cliff, which the drive leaves
    only once it has freed a margin: a crawl until the estimate falls to `resume`, then as
    usual (the burst)."""
    p = CachePlanner(total=2000 * MiB, cache_size=1000 * MiB, recovery_rate=100 * MiB,
                     fill=980 * MiB)
    assert p.recovering and p.rate() == pytest.approx(10 * MiB)
    p.advance(10 * MiB, 2.0)  # 980 + 10 - 200 = 790: still over 750
    assert p.rate() == pytest.approx(10 * MiB)
    p.advance(15 * MiB, 2.5)
    assert p.rate() == 0 and not p.recovering  # 745 MiB: below the headroom, unpaced
    below = CachePlanner(total=2000 * MiB, cache_size=1000 * MiB, recovery_rate=100 * MiB,
                         fill=900 * MiB)
    assert not below.recovering
    # An estimate that dates from a full cache (a refill's cliff): below the ceiling now, but
    # the drive may still be in its cliff until it freed the margin.
    model = WriteModel("x", fast_rate=1000 * MiB, cache_size=1000 * MiB,
                       post_cache_rate=100 * MiB, drain_rate=100 * MiB)
    model.set_fill(1000 * MiB, when=time.time() - 1.5)  # full 1.5 s ago: about 850 MiB now
    plan = plan_save(model, total=2000 * MiB, within=None, settings=PlanSettings(),
                     read_slo=None, disk=None, lead=0, min_rate=1)
    assert plan.planner.recovering and plan.planner.rate() == pytest.approx(10 * MiB)
    model.set_fill(1000 * MiB, when=time.time() - 3.0)  # about 700 MiB now: drained enough
    plan = plan_save(model, total=2000 * MiB, within=None, settings=PlanSettings(),
                     read_slo=None, disk=None, lead=0, min_rate=1)
    assert not plan.planner.recovering
    meet = CachePlanner(total=2000 * MiB, cache_size=1000 * MiB, recovery_rate=100 * MiB,
                        fill=980 * MiB, settings=PlanSettings(deadline_policy="meet-deadline"))
    assert not meet.recovering
    with pytest.raises(ValueError, match="resume must be at most ceiling"):
        PlanSettings(resume=0.99)


def test_a_deadline_gives_the_flattest_cliff_free_rate():
    p = CachePlanner(total=1000 * MiB, cache_size=1000 * MiB, recovery_rate=100 * MiB,
                     deadline=20.0)
    assert p.rate() == pytest.approx(1000 * MiB / 18.0)  # finish by 90% of the deadline
    seconds, peak, _ = _run(p, drive_rate=1000 * MiB)
    assert seconds <= 20.0 and not p.conflict
    assert peak < 0.85 * 1000 * MiB


def test_a_deadline_that_needs_the_cliff_follows_the_policy():
    kw = dict(total=3000 * MiB, cache_size=500 * MiB, recovery_rate=100 * MiB, deadline=10.0)
    avoid = CachePlanner(**kw)
    first = avoid.rate()
    seconds, peak, _ = _run(avoid, drive_rate=1000 * MiB)
    assert avoid.conflict and seconds > 10.0  # late, but out of the cliff
    assert peak <= 0.95 * 500 * MiB + 50 * MiB
    # Flat, not a burst: the fastest pace that ends at the ceiling counting the drain at 0.9 x
    # recovery, d * R / (R - ceiling), which beats filling the headroom unpaced and then
    # sustaining at d.
    assert first == pytest.approx(3000 / (3000 - 475) * 90 * MiB)
    burst_then_sustain = (3000 - 425) / 90
    assert seconds < burst_then_sustain
    meet = CachePlanner(**kw, settings=PlanSettings(deadline_policy="meet-deadline"))
    seconds, peak, _ = _run(meet, drive_rate=1000 * MiB)
    assert meet.conflict and seconds <= 10.0 and peak > 500 * MiB
    with pytest.raises(ValueError, match="avoid-cliff, meet-deadline"):
        PlanSettings(deadline_policy="late")


def test_the_cache_estimate_starts_from_what_the_last_save_left():
    full = CachePlanner(total=100 * MiB, cache_size=1000 * MiB, recovery_rate=100 * MiB,
                        fill=900 * MiB)
    # Past the headroom: the 100 MiB left end at the ceiling (950 MiB) at a drain of 90 MiB/s.
    assert full.rate() == pytest.approx(90 * MiB * 100 / (900 + 100 - 950))
    model = WriteModel("x", cache_size=1000 * MiB, post_cache_rate=100 * MiB,
                       drain_rate=100 * MiB)
    model.set_fill(900 * MiB, when=time.time() - 5)
    assert model.fill_at() == pytest.approx(400 * MiB, rel=0.01)  # 5 s at 100 MiB/s


def test_other_writers_fill_the_estimate_and_leave_this_save_less_drain():
    kw = dict(total=3000 * MiB, cache_size=1000 * MiB, recovery_rate=100 * MiB)
    counted = CachePlanner(**kw)
    seconds, peak, held = _run(counted, drive_rate=1000 * MiB, others=30 * MiB)
    assert held <= 0.85 * 1000 * MiB + 50 * MiB  # the cache itself stays out of the cliff
    assert counted.others_rate == pytest.approx(30 * MiB, rel=0.01)
    assert counted.drain == pytest.approx(70 * MiB, rel=0.01)
    # Sustained: 0.9 x the drain the others leave (while it had not finished yet).
    assert counted.rate() == pytest.approx(0.9 * 70 * MiB, rel=0.01) or counted.done == 3000 * MiB
    # Without the drive's counter the others are invisible: the cache fills past its size.
    blind = CachePlanner(**kw)
    _, _, held = _run(blind, drive_rate=1000 * MiB, others=30 * MiB, counter=False)
    assert held > 1000 * MiB and blind.others_rate == 0


def test_a_deadline_plans_with_the_drain_other_writers_leave():
    # 1000 MiB by 90% of 20 s: 55.6 MiB/s fits 100 MiB/s of drain alone, not the 30 MiB/s
    # that writers at 70 leave: paced to end at the headroom, 30 x 1000 / 745 MiB/s, late.
    kw = dict(total=1000 * MiB, cache_size=300 * MiB, recovery_rate=100 * MiB, deadline=20.0)
    alone = CachePlanner(**kw)
    _, _, held = _run(alone, drive_rate=1000 * MiB)
    assert not alone.conflict and held < 0.85 * 300 * MiB
    crowded = CachePlanner(**kw)
    seconds, _, held = _run(crowded, drive_rate=1000 * MiB, others=70 * MiB)
    assert crowded.conflict and held <= 0.95 * 300 * MiB + 20 * MiB and seconds > 20.0


def test_a_late_save_whose_rest_fits_the_headroom_is_no_conflict():
    p = CachePlanner(total=100 * MiB, cache_size=1000 * MiB, recovery_rate=100 * MiB,
                     deadline=1.0)
    p.advance(50 * MiB, 0.95)  # past 90% of the deadline: as fast as the cache allows
    assert p.rate() == 0 and not p.conflict
    q = CachePlanner(total=2000 * MiB, cache_size=1000 * MiB, recovery_rate=100 * MiB,
                     deadline=1.0)
    q.advance(50 * MiB, 0.95)
    assert q.rate() > 0 and q.conflict  # the rest would fill the cache: paced, and said so


def test_writes_since_the_estimate_fill_the_cache_as_a_slower_drain_would():
    model = WriteModel("x", cache_size=1000 * MiB, post_cache_rate=100 * MiB,
                       drain_rate=100 * MiB)
    model.set_fill(400 * MiB, when=time.time() - 5)
    assert model.fill_at(written=300 * MiB) == pytest.approx(200 * MiB, rel=0.01)
    assert model.fill_at(written=5000 * MiB) == 1000 * MiB  # capped at the cache
    model.set_fill(0.0)
    assert model.fill_at(written=80 * MiB) == pytest.approx(80 * MiB, rel=0.01)


def test_read_slo_caps_the_rate_but_not_below_the_deadline():
    p = CachePlanner(total=1000 * MiB, cache_size=10_000 * MiB, recovery_rate=100 * MiB,
                     deadline=100.0)
    p.slo_cap = 1 * MiB
    assert p.rate() == pytest.approx(1000 * MiB / 90.0)  # what the deadline needs
    q = CachePlanner(total=1000 * MiB, cache_size=10_000 * MiB, recovery_rate=100 * MiB)
    q.slo_cap = 5 * MiB
    assert q.rate() == 5 * MiB  # unpaced before; now held to the cap


def _timeline(rates, width=0.05, pace=0.0):
    t, rows = 0.0, []
    for r in rates:
        t += width
        rows.append((t, r * width, pace))
    return rows


def test_find_cliff_reads_the_drop_and_the_rate_after_it():
    rows = _timeline([800e6] * 40 + [200e6] * 60 + [0])
    cliff = find_cliff(rows)
    assert cliff is not None
    assert cliff.seconds == pytest.approx(2.0)
    assert cliff.bytes_before == pytest.approx(800e6 * 2.0)
    assert cliff.rate == pytest.approx(200e6)
    assert cliff.fast_rate == pytest.approx(800e6)
    assert find_cliff(_timeline([800e6] * 30 + [300e6] * 3 + [800e6] * 30)) is None  # a dip
    assert find_cliff(_timeline([100e6] * 50, pace=100e6)) is None  # paced, at its pace


@pytest.mark.parametrize("past", [0.5, 0.6, 0.8])
def test_a_write_that_ends_soon_after_its_cliff_reads_it_where_it_came(past):
    """As the emulated drive writes: 3 GB/s in 20 ms intervals with an empty one every 100 ms
    (the block-I/O throttle's slices), the cliff at 0.5 s, then the post-cache rate of
    0.75 GB/s in bursts every other 60 ms, the write ending ``past`` seconds after its cliff
    (a save or a refill that stops soon after it). The line after the cliff was fitted to the
    few points past the hold, where the write was ending, or to all of it but its first
    interval: the cliff came out 0.3 GB late (a third of the cache this drive would have)."""
    rates = [0.0 if k % 5 == 4 else 3.75e9 for k in range(25)]
    rates += [1.5e9 if (k // 3) % 2 == 0 else 0.0 for k in range(round(past / 0.02))]
    cliff = find_cliff(_timeline(rates, 0.02) + [(0.5 + past + 0.02, 0.0, 0.0)])
    assert cliff is not None
    assert cliff.seconds == pytest.approx(0.5, abs=0.03)
    assert cliff.bytes_before == pytest.approx(1.5e9, rel=0.04)


@pytest.mark.parametrize("hold", [10, 16, 20])
def test_the_refined_cliff_never_falls_inside_the_stall_before_it(hold):
    """A write that stalls (0.3 s), writes fast for 80 ms and meets its cliff, then stalls
    again inside it while the drive folds: the line fitted after the hold lies low, and the
    two lines used to meet inside the first stall, at a negative byte count (-0.16 GB here).
    The cliff then stays where the first slow interval put it."""
    from flashstream.telemetry.cliff import _refined

    width, fast, slow = 0.02, 1e9, 0.6e9
    rates = [0.0] * 15 + [fast] * 4 + [0.0] * (hold // 2) + [slow] * (hold - hold // 2 + 30)
    rows = [(k * width, (k + 1) * width, r, 0.0) for k, r in enumerate(rates)]
    start, done = rows[19][0], 4 * fast * width
    assert _refined(rows, 19, hold, start, done, floor=15) == (start, done)
    # the same write without the second stall is refined as before: the lines meet at the cliff
    rows = [(k * width, (k + 1) * width, r, 0.0)
            for k, r in enumerate([0.0] * 15 + [fast] * 4 + [slow] * (hold + 30))]
    meet, at = _refined(rows, 19, hold, start, done, floor=15)
    assert meet == pytest.approx(start) and at == pytest.approx(done)
    # bytes written before the first stall keep the meeting point's count positive: the time
    # alone (before the fit's first point) makes it fall back
    rates = [fast] * 15 + [0.0] * 15 + [fast] * 4 + [0.0] * (hold // 2) \
        + [slow] * (hold - hold // 2 + 30)
    rows = [(k * width, (k + 1) * width, r, 0.0) for k, r in enumerate(rates)]
    start, done = rows[34][0], 19 * fast * width
    assert _refined(rows, 34, hold, start, done, floor=30) == (start, done)


@pytest.mark.parametrize("stall_at", [1.3, 2.0])
@pytest.mark.parametrize("noise", [0.0, 0.1])
def test_a_stall_inside_the_cliff_does_not_bend_the_refined_cliff(stall_at, noise,
                                                                   monkeypatch):
    """1.2 GB/s for 1 s into the cache, then 0.4 GB/s; a 0.6 s stall inside the cliff, after
    which the drive writes fast for what it folded meanwhile. The line fitted after the cliff
    ran through the stall and its comeback and put the cliff 7-16% of the cache early; the
    first slow interval stands instead."""
    import flashstream.telemetry.cliff as wm

    fast, slow, width, rng = 1.2e9, 0.4e9, 0.02, random.Random(7)
    rates, owed = [], 0.0
    for k in range(250):
        t = k * width
        if stall_at <= t < stall_at + 0.6:
            rate, owed = 0.0, owed + slow * width
        elif t >= 1.0 and owed > 0:
            rate, owed = fast, max(0.0, owed - (fast - slow) * width)
        else:
            rate = fast if t < 1.0 else slow
        rates.append(rate * max(0.0, rng.gauss(1, noise)))
    timeline = _timeline(rates, width)
    cliff = find_cliff(timeline, unpaced=True)
    assert cliff.seconds == pytest.approx(1.0, abs=width)
    assert cliff.bytes_before == pytest.approx(fast * 1.0, rel=0.02)
    monkeypatch.setattr(wm, "_stalled", lambda rows: False)  # the plain line fit
    assert find_cliff(timeline, unpaced=True).bytes_before < 0.95 * fast * 1.0


def test_the_throttles_slices_are_not_a_stall():
    """In its cliff the emulated drive writes in bursts every 100 ms (the block-I/O throttle's
    slice), with up to three empty 20 ms intervals between them: not a stall."""
    from flashstream.telemetry.cliff import _stalled, intervals

    for slice_ in ([0.68e9, 1.26e9, 0.37e9, 0.0, 0.0], [1.5e9, 0.0, 0.0, 0.0, 0.9e9]):
        burst = slice_ * 30  # the second has more empty intervals than not: its median is 0
        assert not _stalled(intervals(_timeline(burst, 0.02)))
        stalled = burst[:50] + [0.0] * 10 + burst[50:]  # 0.2 s of nothing
        assert _stalled(intervals(_timeline(stalled, 0.02)))
        assert not _stalled(intervals(_timeline(burst[:50] + [0.0] * 7 + burst[50:], 0.02)))


@pytest.mark.parametrize("drain_share", [0.6, 1.0])
@pytest.mark.parametrize("gap", [0.6, 1.6, 6.0])
def test_a_refill_reaches_the_cliff_again_and_stays_in_it_for_the_hold(drain_share, gap):
    """The sustained probe's refills, on the emulator's own cache model: after `gap` s idle on
    a full cache, a refill is long enough to meet the cliff and spend find_cliff's half-second
    hold in it, whatever the drive folds at (up to its post-cache rate)."""
    from flashstream.emulation import CacheModel
    from flashstream.telemetry.refills import _refill_size

    fast, post = 200e6, 80e6  # a cache no gap here drains empty (an empty one is no reading)
    model = CacheModel(DriveSettings(cache_size=1 << 30, post_cache_rate=post,
                                     drain_rate=drain_share * post, fast_rate=fast))
    model.step(float(1 << 30), 0.0)  # the first write left it full
    assert model.state.cliff
    assert not model.step(0.0, gap).cliff
    written, dt = 0.0, 0.001
    while not model.step(fast * dt, dt).cliff:
        written += fast * dt
    assert written + 0.5 * post <= _refill_size(gap, fast, post)


def _probe_with_stall(post_share: float, stall_s: float, *, stall_fill=None, stall_in=None,
                      drain_share: float = 1.0, seed: int = 0):
    """An unpaced probe write of 3 x a 1.5 GB cache on the emulator's cache model, its rate
    noisy (10% per 20 ms interval), with one stall of ``stall_s`` (the disk: no bytes, the drive
    folds meanwhile) once the cache holds ``stall_fill`` of its size, or ``stall_in`` seconds
    into the cliff. Returns the timeline and the bytes written when the cliff began."""
    from flashstream.emulation import CacheModel

    fast, cache, dt = 1e9, 1.5e9, 0.02
    post = post_share * fast
    model = CacheModel(DriveSettings(cache_size=cache, post_cache_rate=post,
                                     drain_rate=drain_share * post, fast_rate=fast), horizon=dt)
    rng = random.Random(seed)
    rows, t, written, cliff_at, cliff_t, stalled = [], 0.0, 0.0, None, None, False
    while written < 3 * cache:
        due = (not stalled and (
            (stall_fill is not None and model.state.fill >= stall_fill * cache)
            or (stall_in is not None and cliff_t is not None and t >= cliff_t + stall_in)))
        if due:  # the stall, in intervals like the rest
            stalled = True
            for _ in range(round(stall_s / dt)):
                model.step(0.0, dt)
                t += dt
                rows.append((t, 0.0, 0.0))
            continue
        nbytes = model.write_limit() * dt * rng.uniform(0.9, 1.1)
        state = model.step(nbytes, dt)
        written += nbytes
        t += dt
        rows.append((t, nbytes, 0.0))
        # The model's flag comes late: its limit tapers to the post-cache rate as the room
        # runs out (and the fill then barely moves where it drains as fast): the drop is the
        # cliff.
        if state.fill >= 0.98 * cache and cliff_at is None:
            cliff_at, cliff_t = written, t
    return rows, cliff_at


@pytest.mark.parametrize("post_share", [0.2, 0.45])  # RANDOM_RANGES' ends
@pytest.mark.parametrize("drain_share", [0.6, 1.0])
@pytest.mark.parametrize("stall_s", [0.3, 0.7, 1.2])
@pytest.mark.parametrize("stall_fill", [0.1, 0.25, 0.5])
def test_a_stall_before_the_cliff_does_not_pass_for_it(post_share, drain_share, stall_s,
                                                       stall_fill):
    """A stall of the disk in the sustained probe's first write, before the cache is full:
    the write comes back to its fast rate for all the room left. Read as the cliff, such a
    drop put a 1.7 GiB cache at 447 MiB in one run here."""
    rows, truth = _probe_with_stall(post_share, stall_s, stall_fill=stall_fill,
                                    drain_share=drain_share,
                                    seed=round(100 * post_share + 10 * stall_s))
    cliff = find_cliff(rows, unpaced=True)
    assert cliff is not None
    # Within 3% of the cache, and a few intervals of writing (the finder's resolution).
    assert abs(cliff.bytes_before - truth) <= 0.03 * 1.5e9 + 3 * 0.02 * 1e9
    assert cliff.rate == pytest.approx(post_share * 1e9, rel=0.1)


@pytest.mark.parametrize("post_share", [0.2, 0.45])  # RANDOM_RANGES' ends
@pytest.mark.parametrize("drain_share", [0.6, 1.0])
@pytest.mark.parametrize("stall_s", [0.3, 0.7, 1.2])
@pytest.mark.parametrize("stall_in", [0.1, 0.6, 1.0, 3.0])
def test_a_stall_inside_the_cliff_leaves_the_cliff_as_it_was(post_share, drain_share, stall_s,
                                                            stall_in):
    """Inside the cliff the drive folds through a stall and then writes fast again, for what
    it freed: the rule must not take that for a comeback and pass over the true cliff (the
    first stall rule did, by up to 2.2 s)."""
    rows, truth = _probe_with_stall(post_share, stall_s, stall_in=stall_in,
                                    drain_share=drain_share,
                                    seed=round(100 * post_share + 10 * stall_s))
    # The reading is the plain finder's: the rule never fires inside the cliff. (How far a
    # stall there moves the plain reading is the line fit's own limit, not checked here: at
    # the range's edge, post-cache 45% of fast, up to a fifth of the cache in these cases.)
    assert find_cliff(rows, unpaced=True) == find_cliff(rows)


def test_without_the_stall_rule_a_stall_passes_for_the_cliff():
    rows, truth = _probe_with_stall(0.2, 0.7, stall_fill=0.25)
    early = find_cliff(rows)
    assert early is not None and early.bytes_before < 0.5 * truth
    assert abs(find_cliff(rows, unpaced=True).bytes_before - truth) < 0.03 * 1.5e9


def test_a_pacer_slowing_down_is_not_a_cliff():
    # Unpaced at 800 MB/s, then held by the pacer to 150 MB/s and lower: the drive kept up.
    rows = _timeline([800e6] * 20)
    t = rows[-1][0]
    for i, pace in enumerate([150e6] * 20 + [100e6] * 20 + [60e6] * 20):
        rows.append((t + 0.05 * (i + 1), pace * 0.05, pace))
    assert find_cliff(rows) is None


def test_a_save_teaches_the_model_its_cliff(tmp_path):
    model = load_model(tmp_path)
    rows = _timeline([800e6] * 40 + [200e6] * 60 + [0])
    learn_from_save(model, rows, total=2e9, start_fill=0.0, end_fill=None, ended=time.time())
    again = load_model(tmp_path)  # remembered
    assert again.has_cliff
    assert again.post_cache_rate == pytest.approx(200e6)
    # 1.6 GB before the cliff at 2 s, 1.6 x 200 MB/s drained meanwhile (the drain unknown).
    assert again.cache_size == pytest.approx(1.6e9 - 1.6 * 200e6 * 2.0)
    assert again.fill_at() == pytest.approx(again.cache_size, rel=0.05)


@pytest.mark.parametrize("kind", ["auto", "python"])
def test_rate_control_steers_a_write_while_it_runs(tmp_path, kind):
    size = 24 * MiB
    data = np.zeros(size, np.uint8)
    out = engine.open_output(tmp_path / "f", size, engine=kind if kind == "python" else "auto",
                             direct=False)
    control = engine.RateControl()
    control.rate = 8 * MiB  # 3 s at this pace ...

    def speed_up():
        time.sleep(0.3)
        control.rate = 0  # ... unless someone lifts it
    threading.Thread(target=speed_up).start()
    t = time.perf_counter()
    result = out.write(data, 0, chunk_size=MiB, queue_depth=2, control=control)
    seconds = time.perf_counter() - t
    out.commit(size)
    assert result["bytes"] == size and control.done == size
    assert seconds < 2.0
    with pytest.raises(ValueError):
        control.rate = -1


def test_auto_with_a_known_model_plans_the_save_and_refreshes_the_model(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    model = load_model(directory)
    model.cache_size, model.post_cache_rate, model.fast_rate = 1e12, 50e6, 1e9
    model.save()
    state = {"w": torch.arange(4 * MiB, dtype=torch.float32)}
    with CheckpointWriter(directory, rate="auto", within=30.0) as writer:
        report = writer.save(state, step=1).result()
    assert report.pacing["plan"] == "model"
    assert report.pacing["cliffs_seen"] == 0 and not report.pacing["deadline_conflict"]
    assert torch.equal(load_checkpoint(directory)["w"], state["w"])
    assert load_model(directory).observations == 1


def test_buffered_saves_count_only_their_own_bytes(tmp_path):
    """Without O_DIRECT the drive takes a save's bytes as the page cache flushes them: its
    counter would count them again, as another writer's, so it is not read."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    model = load_model(directory)
    model.cache_size, model.post_cache_rate, model.fast_rate = 1e12, 50e6, 1e9
    model.save()
    state = {"w": torch.rand(4 * MiB)}
    with CheckpointWriter(directory, rate="auto", direct=False) as writer:
        reports = [writer.save(state, step=step).result() for step in range(2)]
    for report in reports:
        assert report.pacing["plan"] == "model"
        assert report.pacing["others_before_bytes"] == 0
        assert report.pacing["others_during_bytes"] == 0


def test_auto_settings_are_checked():
    from flashstream.checkpoint.config import WriterConfig

    with pytest.raises(ValueError, match="rate='auto'"):
        WriterConfig(rate=None, read_slo=0.01)
    with pytest.raises(ValueError, match="read_slo"):
        WriterConfig(rate="auto", read_slo=-1)
    with pytest.raises(ValueError, match="avoid-cliff"):
        WriterConfig(rate="auto", deadline_policy="never")


@pytest.mark.skipif(throttle_support() is None,
                    reason="needs root and a cgroup block-I/O controller")
def test_a_random_emulated_drive_is_learned_and_auto_keeps_its_saves_out_of_the_cliff(tmp_path):
    """Parameters drawn from the documented range (docs/emulation.md) each run: the sustained
    probe recovers them, then saves 1.2 x the cache, each due before the next one (they
    average 85% of the drain rate), never enter the cliff."""
    from flashstream.emulation import DriveEmulator
    from flashstream.telemetry.write_learning import learn_sustained

    # A new draw each run; FLASHSTREAM_TEST_SEED replays one (the seed is in every message).
    seed = int(os.environ.get("FLASHSTREAM_TEST_SEED") or random.randrange(1 << 32))
    rng = random.Random(seed)
    post = rng.uniform(60e6, 100e6)
    settings = DriveSettings(cache_size=rng.randint(96, 192) * MiB, post_cache_rate=post,
                             drain_rate=post * rng.uniform(0.6, 1.0), fast_rate=200e6)
    info = f"seed {seed}: " + json.dumps(settings.to_dict())
    directory = tmp_path / "ckpt"
    state = {"w": torch.rand(int(1.2 * settings.cache_size) // 4)}
    gap = 1.2 * settings.cache_size / (0.85 * settings.drain_rate)
    os.sync()  # earlier tests' dirty pages: a burst from another writer, not this drive's
    with DriveEmulator(tmp_path, settings) as drive:
        drive.add_process()
        # A measurement on a shared disk: one noisy probe may miss (cache estimates of -27% and
        # +39% came once each and did not replay), so a miss is measured once more, on a cache
        # drained empty again; a real bias misses both times.
        for attempt in range(2):
            model = learn_sustained(tmp_path, 3 * settings.cache_size)
            if model.cache_size and abs(model.cache_size / settings.cache_size - 1) <= 0.2:
                break
            info += f"; attempt {attempt + 1} estimated {model.cache_size}"
            time.sleep(2 * settings.cache_size / settings.drain_rate + 1)
        assert model.has_cliff, info
        info += (f"; learned cache {model.cache_size:.0f}, post {model.post_cache_rate:.0f}, "
                 f"recovery {model.recovery_rate:.0f}")
        # Small caches at test scale: what is in flight at the cliff weighs more than at
        # full scale (docs/emulation.md gives the figures measured there).
        assert model.cache_size == pytest.approx(settings.cache_size, rel=0.2), info
        assert model.post_cache_rate == pytest.approx(settings.post_cache_rate, rel=0.1), info
        # Idle folding may outrun the post-cache rate (docs/emulation.md): no longer capped
        # there, the recovery rate stays within the family's bound.
        assert 0 < model.recovery_rate <= model.post_cache_rate * 1.6, info
        assert load_model(tmp_path).cache_size == model.cache_size  # remembered
        # The probe left the cache full; the model knows, and the first save's plan starts
        # from it (it may meet the cliff the probe left; the later ones must not).
        with CheckpointWriter(directory, rate="auto", within=gap, keep=1,
                              chunk_size=MiB) as writer:
            windows = []
            for step in range(3):
                due = time.perf_counter() - drive.started
                report = writer.save(state, step=step).result()
                windows.append((due, due + gap, report))
                if step:  # the first starts on the cache the probe left full
                    # By the deadline, give or take this shared disk: planned to end at 90%
                    # of it, 52 saves in 26 runs here ended at 0.88-0.97 of it, but a slow
                    # minute of the disk took one to 1.11 x (it replayed at <= 1.0 x twice).
                    # A gross check: how close auto comes to its deadlines is the emulated
                    # benchmark's figure (checkpoint.py --emulate), not a timed test's.
                    took = time.perf_counter() - drive.started - due
                    assert took <= 1.25 * gap, (info, took / gap, report.pacing)
                time.sleep(max(0.0, due + gap - (time.perf_counter() - drive.started)))
    for due, end, report in windows[1:]:
        assert report.pacing["plan"] == "model", info
        cliff = drive.cliff_seconds(due, end)
        assert cliff == 0, f"{info}; due {due:.2f} s: {cliff:.2f} s in the cliff; " \
                           f"pacing {json.dumps(report.pacing, default=str)}"
    assert torch.equal(load_checkpoint(directory)["w"], state["w"])


def _write_steadily(path, rate: float, stop: threading.Event) -> None:
    """Another writer on the drive: 1 MiB O_DIRECT writes at `rate` bytes/s (straight to the
    drive, as a paced writer's, not later in the page cache's bursts) until `stop`."""
    import mmap

    block = mmap.mmap(-1, MiB)  # page-aligned, as O_DIRECT needs
    block.write(os.urandom(MiB))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        began, written = time.perf_counter(), 0
        while not stop.is_set():
            os.pwrite(fd, block, written % (256 * MiB))
            written += MiB
            time.sleep(max(0.0, began + written / rate - time.perf_counter()))
    finally:
        os.close(fd)


@pytest.mark.skipif(throttle_support() is None,
                    reason="needs root and a cgroup block-I/O controller")
def test_auto_counts_another_writer_on_the_drive_and_stays_out_of_the_cliff(tmp_path):
    """The drive's cache fills from every writer. Another one at 3/8 of the drain rate during
    a save of 1.5 x the cache: counted through the drive's counter, it leaves auto less drain
    and less headroom, and the save never enters the cliff. (Counting only its own bytes, auto
    bursts into a cache the other writer has already partly filled, then sustains at 0.9 x a
    drain that the other writer shares, and meets the cliff within the first second.)"""
    from flashstream.emulation import DriveEmulator

    settings = DriveSettings(cache_size=128 * MiB, post_cache_rate=80e6, drain_rate=64e6,
                             fast_rate=200e6)
    others = 24e6
    directory = tmp_path / "ckpt"
    directory.mkdir()
    state = {"w": torch.rand(int(1.5 * settings.cache_size) // 4)}
    stop = threading.Event()
    os.sync()  # earlier tests' dirty pages would be a third writer, in bursts
    with DriveEmulator(tmp_path, settings) as drive:
        drive.add_process()
        model = load_model(directory)  # the emulated drive's, as a probe would have left it
        model.cache_size, model.post_cache_rate = settings.cache_size, settings.post_cache_rate
        model.drain_rate, model.fast_rate = settings.drain_rate, settings.fast_rate
        for name in PARAMETERS:
            model.note(name, MEASURED, "test")
        model.save()
        other = threading.Thread(target=_write_steadily, args=(tmp_path / "other", others, stop))
        other.start()
        try:
            time.sleep(1.0)  # under way, and the cache at its steady state beside it (empty)
            with CheckpointWriter(directory, rate="auto", keep=1, chunk_size=MiB) as writer:
                began = time.perf_counter() - drive.started
                report = writer.save(state, step=0).result()
                ended = time.perf_counter() - drive.started
        finally:
            stop.set()
            other.join()
    info = json.dumps(report.pacing, default=str)
    assert report.pacing["plan"] == "model", info
    assert drive.cliff_seconds(began, ended) == 0, info
    # Counted, and not the save's own bytes counted twice (the page cache was flushed first).
    during = report.pacing["others_during_bytes"]
    assert 0.5 * others * report.write_s <= during <= 0.5 * report.bytes, info
    assert torch.equal(load_checkpoint(directory)["w"], state["w"])


@pytest.mark.skipif(throttle_support() is None,
                    reason="needs root and a cgroup block-I/O controller")
def test_a_refill_ends_soon_after_its_cliff(tmp_path):
    """A refill of a full cache stops once it has been in its cliff long enough to place it,
    not at its size: a save due meanwhile waits for it, and a drive left in its cliff still is
    when that save starts. So does one that meets its cliff soon, as after a short gap: ended
    once a window twice that long averaged below the midpoint, it had to fill the window first
    and wrote on in its cliff for over a second."""
    from flashstream.emulation import DriveEmulator
    from flashstream.telemetry.refills import stop_below
    from flashstream.telemetry.write_on import STOP_AFTER_S, point_timeline, timed_write

    settings = DriveSettings(cache_size=96 * MiB, post_cache_rate=60e6, drain_rate=60e6,
                             fast_rate=200e6)
    asked = 1 << 30  # 14 s in the cliff, were it written to its size
    os.sync()  # earlier tests' dirty pages would be another writer
    with DriveEmulator(tmp_path, settings) as drive:
        drive.add_process()
        below = stop_below(settings.fast_rate, settings.post_cache_rate)
        point, _began, _ended = timed_write(tmp_path, asked, stop_below=below)
        time.sleep(0.4)  # frees 24 MB: the next refill meets its cliff after about 0.2 s
        soon, _began, _ended = timed_write(tmp_path, asked, stop_below=below)
    cliff = find_cliff(point_timeline(point))
    info = f"{point.bytes} bytes in {point.seconds:.2f} s, cliff {cliff}"
    assert cliff is not None, info
    assert point.bytes < asked / 2, info
    assert point.seconds < cliff.seconds + STOP_AFTER_S + 1.0, info
    early = find_cliff(point_timeline(soon))
    info = f"{soon.bytes} bytes in {soon.seconds:.2f} s, cliff {early}"
    assert early is not None and early.seconds < 0.5, info
    assert soon.seconds < early.seconds + STOP_AFTER_S + 0.4, info
