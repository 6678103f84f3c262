"""rate="auto": the planner (clock-free), the live cliff reading, the controller's modes, the
pace through each engine (a pause included), and the writer's use of it."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
import torch

from flashstream import CheckpointWriter, engine, load_checkpoint
from flashstream.checkpoint.cliff_watch import (
    HOLD_S,
    ReadWatch,
    dropped,
    placed,
    stalled,
)
from flashstream.checkpoint.pacing import CachePlanner, PlanSettings
from flashstream.checkpoint.save_control import (
    BURST,
    PAUSE,
    PAUSE_RATE,
    PLAN,
    RECOVER,
    REPEAT,
    TEST,
    SaveController,
)
from flashstream.telemetry.drive_model import (
    ClearSchedule,
    DriveModel,
    ReferenceCliff,
    left_after_folding,
    load_model,
)

MiB = 1 << 20


def _run(planner: CachePlanner, drive_rate: float, dt: float = 0.05, limit: float = 120.0,
         others: float = 0.0, counter: bool = True, drain: float = 0.0):
    """A write steered by ``planner`` on a drive taking at most ``drive_rate``, beside other
    writers at ``others`` bytes/s (seen through the drive's counter if ``counter``), folding
    ``drain`` (default: the planner's): (seconds, the estimate's peak, the cache's peak)."""
    drain = drain or planner.recovery
    t, done, peak = 0.0, 0.0, planner.fill
    held, held_peak = planner.fill, planner.fill
    while done < planner.total and t < limit:
        pace = planner.rate() or drive_rate
        step = min(planner.total - done, min(pace, drive_rate) * dt)
        done += step
        t += dt
        held = left_after_folding(held + step + others * dt, drain, dt)
        planner.advance(done, t, done + others * t if counter else None)
        peak, held_peak = max(peak, planner.fill), max(held_peak, held)
    return t, peak, held_peak


# -- the planner ---------------------------------------------------------------------------------
def test_without_a_deadline_it_bursts_to_the_headroom_then_paces_to_the_ceiling():
    kw = dict(total=2000 * MiB, cache_size=1000 * MiB, drain=100 * MiB)
    p = CachePlanner(**kw)
    assert p.rate() == 0  # unpaced while under the headroom
    step = 1000 * MiB * 0.05
    seconds, peak, held = _run(p, drive_rate=1000 * MiB)
    assert peak <= 0.95 * 1000 * MiB + step and held <= 0.95 * 1000 * MiB + step
    # A drain the model has a tenth too high still leaves the cache under its ceiling.
    _, _, held = _run(CachePlanner(**kw), drive_rate=1000 * MiB, drain=90 * MiB)
    assert held <= 0.95 * 1000 * MiB + step
    # Flat to the ceiling beats bursting to the headroom and then sustaining.
    burst = 850 * MiB * 1000 / 900
    assert seconds < 0.95 * (burst / (1000 * MiB) + (2000 * MiB - burst) / (90 * MiB))
    with pytest.raises(ValueError, match="ceiling must be at least headroom"):
        PlanSettings(ceiling=0.8)


def test_a_save_that_may_start_in_the_cliff_crawls_until_the_drive_has_left_it():
    p = CachePlanner(total=2000 * MiB, cache_size=1000 * MiB, drain=100 * MiB,
                     fill=980 * MiB, resume=750 * MiB)
    assert p.recovering and p.rate() == pytest.approx(10 * MiB)
    p.advance(10 * MiB, 2.0)  # 980 + 10 - 200 = 790: still above 750
    assert p.rate() == pytest.approx(10 * MiB)
    p.advance(15 * MiB, 2.5)
    assert p.rate() == 0 and not p.recovering
    assert not CachePlanner(total=1, cache_size=1000 * MiB, drain=1, fill=700 * MiB,
                            resume=750 * MiB).recovering
    meet = CachePlanner(total=1, cache_size=1000 * MiB, drain=1, fill=980 * MiB,
                        resume=750 * MiB, settings=PlanSettings(deadline_policy="meet-deadline"))
    assert not meet.recovering


def test_a_deadline_gives_the_flattest_cliff_free_rate():
    p = CachePlanner(total=1000 * MiB, cache_size=1000 * MiB, drain=100 * MiB, deadline=20.0)
    assert p.rate() == pytest.approx(1000 * MiB / 18.0)  # by 90% of the deadline
    seconds, peak, _ = _run(p, drive_rate=1000 * MiB)
    assert seconds <= 20.0 and not p.conflict and peak < 0.85 * 1000 * MiB


def test_a_deadline_that_needs_the_cliff_follows_the_policy():
    kw = dict(total=3000 * MiB, cache_size=500 * MiB, drain=100 * MiB, deadline=10.0)
    avoid = CachePlanner(**kw)
    first = avoid.rate()
    seconds, peak, _ = _run(avoid, drive_rate=1000 * MiB)
    assert avoid.conflict and seconds > 10.0
    assert peak <= 0.95 * 500 * MiB + 50 * MiB
    assert first == pytest.approx(3000 / (3000 - 475) * 90 * MiB)  # flat, to the ceiling
    meet = CachePlanner(**kw, settings=PlanSettings(deadline_policy="meet-deadline"))
    seconds, peak, _ = _run(meet, drive_rate=1000 * MiB)
    assert meet.conflict and seconds <= 10.0 and peak > 500 * MiB
    with pytest.raises(ValueError, match="avoid-cliff, meet-deadline"):
        PlanSettings(deadline_policy="late")


def test_other_writers_fill_the_estimate_and_leave_this_save_less_drain():
    kw = dict(total=3000 * MiB, cache_size=1000 * MiB, drain=100 * MiB)
    counted = CachePlanner(**kw)
    _, _, held = _run(counted, drive_rate=1000 * MiB, others=30 * MiB)
    assert held <= 0.85 * 1000 * MiB + 50 * MiB
    assert counted.others_rate == pytest.approx(30 * MiB, rel=0.01)
    assert counted.drain == pytest.approx(70 * MiB, rel=0.01)
    blind = CachePlanner(**kw)  # without the drive's counter the others are invisible
    _, _, held = _run(blind, drive_rate=1000 * MiB, others=30 * MiB, counter=False)
    assert held > 1000 * MiB and blind.others_rate == 0


def test_a_late_save_whose_rest_fits_is_no_conflict():
    p = CachePlanner(total=100 * MiB, cache_size=1000 * MiB, drain=100 * MiB, deadline=1.0)
    p.advance(50 * MiB, 0.95)
    assert p.rate() == 0 and not p.conflict and p.burst_left() == math.inf
    q = CachePlanner(total=2000 * MiB, cache_size=1000 * MiB, drain=100 * MiB, deadline=1.0)
    q.advance(50 * MiB, 0.95)
    assert q.rate() > 0 and q.conflict


def test_read_slo_caps_the_rate_but_not_below_the_deadline():
    p = CachePlanner(total=1000 * MiB, cache_size=10_000 * MiB, drain=100 * MiB,
                     deadline=100.0)
    p.slo_cap = 1 * MiB
    assert p.rate() == pytest.approx(1000 * MiB / 90.0)
    q = CachePlanner(total=1000 * MiB, cache_size=10_000 * MiB, drain=100 * MiB)
    q.slo_cap = 5 * MiB
    assert q.rate() == 5 * MiB


# -- reading the cliff live ----------------------------------------------------------------------
def _looks(rates, width=0.02, start=(0.0, 0.0)):
    """Looks every ``width`` s of a write at ``rates`` bytes/s in turn (its own bytes and the
    drive's the same)."""
    out, (t, done) = [(start[0], start[1], start[1])], start
    for r in rates:
        t, done = t + width, done + r * width
        out.append((t, done, done))
    return out


def test_a_drop_to_the_post_cache_rate_is_a_cliff_and_is_placed_where_it_began():
    looks = _looks([1e9] * 50 + [0.3e9] * 12)  # the cliff at 1.0 s
    now = looks[-1][0]
    low_from = dropped(looks, 0.0, now)
    assert low_from is not None
    assert placed(looks, low_from, 0.0, 0.65e9)[0] == pytest.approx(1.0, abs=0.01)
    assert dropped(looks[:56], 0.0, looks[55][0]) is None  # not yet a hold long


def test_a_cliff_in_lumps_is_placed_with_a_wider_spread():
    smooth = _looks([1e9] * 50 + [0.3e9] * 12)
    lumps = _looks([3e9, 0.0, 0.0] * 17 + [0.9e9, 0.0, 0.0] * 4)  # the same means, in lumps
    at_smooth, spread_smooth = placed(smooth, dropped(smooth, 0.0, smooth[-1][0]), 0.0, 0.65e9)
    at_lumps, spread_lumps = placed(lumps, dropped(lumps, 0.0, lumps[-1][0]), 0.0, 0.65e9)
    assert spread_smooth < 0.02 and spread_lumps > 2 * spread_smooth  # to within a look
    assert abs(at_smooth - 1.0) <= spread_smooth + 0.001  # the bend lies within its spread
    assert abs(at_lumps - 1.02) <= spread_lumps
    confirmed = _looks([1e9] * 30 + [0.3e9] * 12)  # too short a run before to fit a line
    assert placed(confirmed, 0.6, 0.58, 0.65e9)[1] == HOLD_S  # anywhere in the hold


def test_a_stall_and_a_throttles_bursts_are_not_a_cliff():
    stall = _looks([1e9] * 50 + [0.0] * 12)  # nothing completes: the disk, not the cliff
    assert stalled(stall, 1.0)
    assert dropped(stall, 0.0, stall[-1][0]) is None
    # The throttle's slices: a 0.1 s slice's worth at once, then nothing, at the fast rate.
    lumps = _looks(([5e9] + [0.0] * 4) * 15)
    assert dropped(lumps, 0.0, lumps[-1][0]) is None


def test_reads_slowing_to_a_folding_drives_pace_count_as_its_cliff():
    watch = ReadWatch(quiet=0.0005)
    for k in range(20):  # 20 reads a look at the quiet latency
        watch.add(0.02 * k, 20 * k, 20 * k * 0.0006)
    assert not watch.slowed()
    reads, busy = 400, 400 * 0.0006
    for k in range(20, 40):  # held back while the drive folds: 40 ms each
        reads, busy = reads + 5, busy + 5 * 0.04
        watch.add(0.02 * k, reads, busy)
    assert watch.slowed()
    assert not ReadWatch(quiet=None).slowed()  # nothing seen yet
    # Reads a paced writer's queue holds a few ms are no cliff, even against a quiet 0.1 ms:
    # a folding drive holds them for tens to hundreds.
    queued = ReadWatch(quiet=0.0001)
    for k in range(20):
        queued.add(0.02 * k, 5 * k, 5 * k * 0.004)
    assert not queued.slowed() and queued.quick()


# -- the controller ------------------------------------------------------------------------------
def _model(**kw) -> DriveModel:
    model = DriveModel("test")
    for k, v in kw.items():
        setattr(model, k, v)
    return model


def test_a_drive_seen_for_the_first_time_is_measured_from_the_first_byte():
    ctl = SaveController(DriveModel("new"), total=4e9, start_fill=lambda d: 0.0)
    assert ctl.mode == BURST and ctl.pace() == 0
    # Known to take the save without a cliff: planned (unpaced throughout).
    roomy = SaveController(_model(fast_rate=1e9, clear=ClearSchedule(8e9, 0.0, 8e9)),
                           total=4e9, start_fill=lambda d: 0.0)
    assert roomy.mode == REPEAT and roomy.pace() == 2e9  # paced far above the drive


def test_a_schedule_taken_unpaced_at_the_edge_of_its_bytes_is_repeated_with_a_margin():
    """Taken clear unpaced, a save may have ended at its cliff with its last requests (the
    drive then sits in it until it frees its margin, unseen by the write): written again
    with no bytes to spare, it runs at the sustained share of the new-file rate from its
    start, as a paced schedule repeats at that share of its pace."""
    clear = ClearSchedule(4e9, 0.0, 4e9)
    edge = SaveController(_model(fast_rate=1e9, clear=clear), total=4e9,
                          start_fill=lambda d: 0.0)
    sustain = edge.settings.sustain
    assert edge.mode == REPEAT and edge.pace() == pytest.approx(sustain * 1e9)
    spare = SaveController(_model(fast_rate=1e9, clear=clear), total=sustain * 4e9,
                           start_fill=lambda d: 0.0)
    assert spare.pace() == 2e9  # unpaced: that share of the bytes is the margin


def test_a_repeat_near_the_new_file_rate_is_judged_as_the_unpaced_run_it_repeats():
    """Falling a fifth short of a pace that near the drive's own rate is the drive's noise
    (seen on the emulator: a false cliff, and a fresh model then planned at the slowest drain,
    12 x the shortest save); its cliff is a drop as in an unpaced run, which then reads the
    post-cache rate (for the refill), not the new-file rate (the pace's)."""
    ctl = SaveController(_model(fast_rate=1e9, clear=ClearSchedule(4e9, 0.0, 4e9)),
                         total=4e9, start_fill=lambda d: 0.0)
    t = done = 0.0
    for rate, steps in ((0.7e9, 40), (0.25e9, 20)):  # 0.8 s short of the pace, then the cliff
        for _ in range(steps):
            t, done = t + 0.02, done + rate * 0.02
            ctl.look(t, done)
        if rate > 0.5e9:
            assert ctl.mode == REPEAT and not ctl.record.cliffs
    assert len(ctl.record.cliffs) == 1 and ctl.record.cliffs[0].seconds == pytest.approx(
        0.8, abs=0.05)
    assert ctl.record.fast_rate is None
    assert ctl.record.post_cache_rate == pytest.approx(0.25e9, rel=0.1)
    assert ctl.mode == PAUSE  # the drain is read from the refill


def _measuring_save(total, *, fast, post, drain, cache, margin, stepped=False, look=0.0205):
    """A measuring save on a clock-free drive (stepped every millisecond), looked at every
    ``look`` seconds (the controller's fine tick, off the throttle's slices): unpaced at
    ``fast`` into a ``cache`` folding ``drain``, in its cliff at ``post`` until folding frees
    ``margin``. ``stepped``: in the cliff the drive takes a slice's worth (0.1 s of ``post``)
    in the first quarter of each slice, as the block-I/O throttle passes it. Returns the
    record."""
    ctl = SaveController(DriveModel("sim"), total=total, start_fill=lambda d: 0.0)
    fill, cliff, t, done, since, dt, pace = 0.0, False, 0.0, 0.0, 0.0, 0.001, ctl.pace()
    next_look = look
    while done < total and t < 60:
        rate = fast
        if cliff and stepped:
            rate = 4 * post if (t - since) % 0.1 < 0.025 else 0.0
        elif cliff:
            rate = post
        step = 0.0 if pace == PAUSE_RATE else min(total - done, min(pace or rate, rate) * dt)
        done, t = done + step, t + dt
        fill = min(cache, left_after_folding(fill + step, drain, dt))
        was, cliff = cliff, fill >= cache or (cliff and fill > cache - margin)
        since = t if cliff and not was else since
        if t >= next_look - 1e-9:
            pace, next_look = ctl.look(t, done, done), next_look + look
    return ctl.finish(t, done, done)


def _tested_to_its_cliff(total: float) -> list:
    """A test's save (unpaced to its burst, then at 0.6 GB/s) on a drive whose cliff comes at
    0.9 GB written (then 0.25 GB/s): the modes it went through, (seconds, mode)."""
    model = _model(fast_rate=1e9, post_cache_rate=0.25e9, drain_rate=0.15e9,
                   cliff=ReferenceCliff(1.0, 0.85e9))
    ctl = SaveController(model, total=total, start_fill=lambda d: 0.0, test=0.6e9)
    t = done = 0.0
    modes = [(0.0, ctl.mode)]
    while done < total and t < 10.0:
        pace = ctl.pace()
        rate = min(pace or 2e9, 1e9 if done < 0.9e9 else 0.25e9) if pace > 1.0 else 0.0
        t, done = t + 0.02, min(total, done + rate * 0.02)
        ctl.look(t, done)
        if ctl.mode != modes[-1][1]:
            modes.append((t, ctl.mode))
    return modes


def test_a_cliff_met_with_few_bytes_left_writes_them_rather_than_wait_out_the_margin():
    """A test that meets its cliff at the end of its save stops and waits for the drive to
    free its margin, seconds; bytes the drive folds within a slice keep it in its cliff no
    longer than a cliff is placed to, so they are written at once (on the emulator a save
    waited 1.2 s to write its last 26 MB, 1.9 x the shortest save)."""
    few = _tested_to_its_cliff(0.935e9)  # about 7 MB left at the cliff
    assert [m for _t, m in few] == [TEST, RECOVER, PLAN] and few[2][0] - few[1][0] < 0.05
    many = _tested_to_its_cliff(0.975e9)  # about 47 MB: the drive folds them in 0.4 s
    assert [m for _t, m in many] == [TEST, RECOVER, PLAN] and many[2][0] - many[1][0] > 0.5


def test_a_cliff_stops_the_write_so_the_drive_folds_and_then_reads_its_drain():
    """Clock-free: a drive that takes 1 GB/s into a 1 GB cache folding 200 MB/s, in its cliff
    at 250 MB/s. At the cliff the save pauses (the cache full at the anchor), writes again once
    the drive is out, and the bytes the drive took from the anchor to the cliff's return, over
    the seconds between, are the drain."""
    fast, post, drain, cache = 1e9, 0.25e9, 0.2e9, 1e9
    margin = 0.05 * cache
    record = _measuring_save(4e9, fast=fast, post=post, drain=drain, cache=cache,
                             margin=margin, look=0.01)
    assert [c.during for c in record.cliffs][:2] == [BURST, "refill"]
    assert record.cliffs[0].seconds == pytest.approx(cache / (fast - drain), abs=0.03)
    assert record.fast_rate == pytest.approx(fast, rel=0.02)
    assert record.post_cache_rate == pytest.approx(post, rel=0.1)
    assert record.drain == pytest.approx(drain, rel=0.05) and record.drain_how == "measured"
    assert record.exit_s >= margin / drain
    assert [m for _, m in record.modes][:4] == [BURST, PAUSE, "refill", "recover"]


def test_a_refill_that_meets_its_cliff_within_its_probe_reads_the_drain():
    """The pause freed little more than the drive's margin: the refill runs out of the cliff
    at the new-file rate and meets it again within the 0.25 s its probe takes. It ran fast for
    more than the cliff could take over two slices: out of the cliff, and its cliff gives the
    drain (not a refill judged still in the cliff, paused again and out of bytes)."""
    record = _measuring_save(1.5e9, fast=1e9, post=0.2e9, drain=0.15e9, cache=1e9,
                             margin=0.02e9)
    assert [m for _, m in record.modes][:3] == [BURST, PAUSE, "refill"]
    assert PAUSE not in [m for _, m in record.modes][2:]
    assert record.drain_how == "measured"
    assert record.drain == pytest.approx(0.15e9, rel=0.1)


def test_a_refill_after_a_long_pause_is_judged_out_by_more_than_two_slices():
    """A pause of 0.4 s: a block-I/O throttle credits none of an idle that long (a fresh
    slice), so a refill that ran at the new-file rate for more than two slices of the cliff's
    bytes ran out of the cliff, though not for the 0.35 s of them a credited idle could add.
    Judged still in the cliff, it paused again and ran out of bytes before any reading."""
    record = _measuring_save(1.36e9, fast=1e9, post=0.2e9, drain=0.15e9, cache=1e9,
                             margin=0.02e9)
    modes = [m for _, m in record.modes]
    assert modes[:3] == [BURST, PAUSE, "refill"] and PAUSE not in modes[2:]
    assert record.drain_how == "measured"
    assert record.drain == pytest.approx(0.15e9, rel=0.15)


def test_the_post_cache_rate_is_read_over_a_whole_slice_of_a_stepped_cliff():
    """In its cliff the throttle passes a slice's worth at the start of each 0.1 s slice. The
    looks inside a slice-long window span less than it; read over them, one step came out a
    fifth and more above the rate. Counted to the window's edges: the rate."""
    record = _measuring_save(1.6e9, fast=1e9, post=0.25e9, drain=0.2e9, cache=1e9,
                             margin=0.05e9, stepped=True)
    assert record.post_cache_rate == pytest.approx(0.25e9, rel=0.1)


# A burst into its cliff on the emulator (seed 14 of the learning benchmark's family, a 1 GiB
# cache, 240 MB/s in the cliff, readers beside it taking about 300 MB/s): (ms, 100 kB the
# write completed, 100 kB other writers gave the drive), one look every 20 ms. The throttle
# passes its bytes in lumps, with gaps of 60-80 ms between them; the cliff came at 1.05 s.
_EMULATED_BURST = [
    (21, 264, 0), (42, 481, 0), (62, 725, 0), (83, 1029, 0), (103, 1339, 0), (124, 1642, 0),
    (144, 1939, 0), (165, 2222, 0), (185, 2506, 0), (206, 2776, 0), (226, 3040, 0),
    (247, 3343, 0), (267, 3620, 7), (288, 3917, 0), (309, 4122, 0), (329, 4399, 0),
    (350, 4709, 0), (371, 5018, 0), (391, 5276, 0), (411, 5493, 0), (432, 5882, 0),
    (452, 6298, 0), (473, 6595, 0), (493, 6595, 0), (514, 6865, 0), (534, 7201, 0),
    (555, 7538, 0), (575, 7913, 0), (596, 7913, 0), (617, 8243, 7), (637, 8580, 0),
    (658, 8949, 0), (678, 9232, 0), (699, 9232, 0), (719, 9569, 0), (740, 9892, 0),
    (761, 10241, 0), (781, 10558, 0), (802, 10564, 46), (823, 10987, 0), (843, 11329, 0),
    (864, 11672, 0), (884, 11877, 0), (905, 11982, 0), (925, 12332, 0), (946, 12668, 0),
    (967, 13057, 0), (988, 13196, 0), (1008, 13301, 0), (1028, 13644, 0), (1049, 13882, 0),
    (1070, 13882, 0), (1090, 13882, 0), (1110, 13882, 0), (1131, 13882, 0), (1152, 13937, 0)]


def test_the_post_cache_rate_is_not_read_off_full_rate_bytes_before_a_cliff_placed_early():
    """The emulator's burst above: its cliff is placed about a slice early, among the lumps.
    The mean over all of the cliff seen then holds full-rate bytes and reads twice the rate;
    the slice-long window reads it within its lumps' spread."""
    ctl = SaveController(DriveModel("t"), total=1.75 * 2**30, start_fill=lambda d: 0.0,
                         measure=True)
    for ms, done, others in _EMULATED_BURST:
        ctl.look(ms / 1e3, done * 1e5, (done + others) * 1e5)
    assert ctl.mode == PAUSE and ctl.record.cliffs
    assert ctl.record.cliffs[0].seconds < 1.0  # placed early
    assert 0.6 * 240e6 <= ctl.record.post_cache_rate <= 1.3 * 240e6


def test_a_planned_save_that_meets_the_cliff_reads_the_drain_against_the_models():
    """The model holds a cliff met from an empty cache at 1.25 s after 1.25 GB (a 1 GB cache
    folding 200 MB/s). Planned as if the drive drained 400 MB/s, the save meets the cliff later
    and slower: the two cliffs, each placed to within a look, give the drain."""
    ref = ReferenceCliff(1.25, 1.25e9, spread=0.01)
    model = _model(fast_rate=1e9, post_cache_rate=0.25e9, drain_rate=0.4e9, cliff=ref)
    ctl = SaveController(model, total=3e9, start_fill=lambda d: 0.0)
    assert ctl.mode == PLAN
    fill, t, done, dt = 0.0, 0.0, 0.0, 0.01
    while not ctl.record.cliffs and t < 30:
        pace = ctl.pace() or 1e9
        step = min(pace, 1e9 if fill < 1e9 else 0.25e9) * dt
        done, t = done + step, t + dt
        fill = min(1e9, left_after_folding(fill + step, 0.2e9, dt))
        ctl.look(t, done, done)
    assert ctl.record.cliffs and ctl.record.drain_from == "two cliffs"
    assert ctl.record.drain == pytest.approx(0.2e9, rel=0.1)
    assert ctl.record.drain_how == "measured"


# -- the pace through the engines ----------------------------------------------------------------
@pytest.mark.parametrize("kind", ["auto", "python"])
def test_rate_control_steers_a_write_and_a_pause_holds_it(tmp_path, kind):
    size = 24 * MiB
    data = np.zeros(size, np.uint8)
    out = engine.open_output(tmp_path / "f", size, engine=kind, direct=False)
    control = engine.RateControl()
    control.rate = PAUSE_RATE  # nothing goes out ...
    seen = {}

    def release():
        time.sleep(0.3)
        seen["paused"] = control.done
        control.rate = 0  # ... until someone lifts it
    threading.Thread(target=release).start()
    t = time.perf_counter()
    result = out.write(data, 0, chunk_size=MiB, queue_depth=2, control=control)
    seconds = time.perf_counter() - t
    out.commit(size)
    assert result["bytes"] == size and control.done == size
    assert seen["paused"] <= MiB  # at most the one request admitted as the write began
    assert 0.3 <= seconds < 2.0
    with pytest.raises(ValueError):
        control.rate = -1


# -- the writer ----------------------------------------------------------------------------------
def _seeded(directory, **kw) -> None:
    model = load_model(directory)
    for k, v in kw.items():
        setattr(model, k, v)
    model.save()


def test_auto_plans_a_save_that_fits_and_reports_the_bytes(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    _seeded(directory, fast_rate=1e9, post_cache_rate=50e6,
            cliff=ReferenceCliff(1000.0, 1e12))
    state = {"w": torch.arange(4 * MiB, dtype=torch.float32)}
    with CheckpointWriter(directory, rate="auto", within=30.0) as writer:
        report = writer.save(state, step=1).result()
    assert report.pacing["plan"] == "model" and not report.pacing["cliffs"]
    assert not report.pacing["conflict"]
    assert report.written_bytes == report.bytes  # data and header, nothing else
    assert torch.equal(load_checkpoint(directory)["w"], state["w"])


def test_buffered_saves_count_only_their_own_bytes(tmp_path):
    """Without O_DIRECT the drive takes a save's bytes as the page cache flushes them: its
    counter would count them again, as another writer's, so it is not read."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    _seeded(directory, fast_rate=1e9, post_cache_rate=50e6,
            cliff=ReferenceCliff(1000.0, 1e12))
    state = {"w": torch.rand(4 * MiB)}
    with CheckpointWriter(directory, rate="auto", direct=False) as writer:
        reports = [writer.save(state, step=step).result() for step in range(2)]
    for report in reports:
        assert report.pacing["plan"] == "model"
        assert report.pacing["others_before_bytes"] == 0
        assert report.pacing["others_during_bytes"] == 0


def test_auto_settings_are_checked():
    from flashstream.checkpoint.config import AdaptiveSettings, WriterConfig

    with pytest.raises(ValueError, match="rate='auto'"):
        WriterConfig(rate=None, read_slo=0.01)
    with pytest.raises(ValueError, match="read_slo"):
        WriterConfig(rate="auto", read_slo=-1)
    with pytest.raises(ValueError, match="avoid-cliff"):
        WriterConfig(rate="auto", deadline_policy="never")
    assert AdaptiveSettings(min_rate="32MiB").min_rate == 32 * MiB
    with pytest.raises(TypeError):
        AdaptiveSettings(window=0.1)  # the fields no caller read are gone

