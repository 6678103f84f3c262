"""rate="auto" learns the drive from the saves themselves (issue 48): the model's figures and
their evidence, what a save's record teaches, the drives of the documented family simulated
clock-free (tests/drive_sim.py: the emulator's own cache model behind its throttle, a reader
beside), stored models wrong by 4 x and measured minutes ago, the bytes a save writes, and saves
on the emulated drive (root)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch
from drive_sim import SimDrive, run_save, shortest

from flashstream import CheckpointWriter, load_checkpoint
from flashstream.checkpoint.auto_pacing import (
    RATE_NOISE,
    planned_seconds,
    save_kind,
    trial_pace,
)
from flashstream.checkpoint.cliff_watch import SHORTFALL
from flashstream.checkpoint.drive_learning import learn
from flashstream.checkpoint.save_control import SaveController, SaveRecord, SeenCliff
from flashstream.emulation import DriveSettings, random_settings, throttle_support
from flashstream.telemetry.drive_model import (
    ASSUMED,
    LOWER_BOUND,
    MEASURED,
    ClearSchedule,
    DriveModel,
    ReferenceCliff,
    StartFill,
    load_model,
    model_path,
)

MiB = 1 << 20
EMPTY = StartFill()


# -- the model -----------------------------------------------------------------------------------
def test_the_model_is_remembered_and_another_layout_is_learned_again(tmp_path):
    model = load_model(tmp_path)
    model.fast_rate, model.post_cache_rate, model.drain_rate = 2e9, 0.5e9, 0.4e9
    model.cliff = ReferenceCliff(1.0, 1.6e9)
    model.clear = ClearSchedule(1e9, 0.6e9, 3e9, 0.0)
    model.note("drain_rate", MEASURED, "save")
    model.set_fill(0.5e9, time.time(), 123)
    model.save()
    again = load_model(tmp_path)
    assert again.cliff == model.cliff and again.clear == model.clear
    assert again.cache_size == pytest.approx(1.2e9) and again.how("drain_rate") == MEASURED
    assert "write cache" in again.describe() and "drain" in again.describe()
    # The previous layout (version 2, figures without a reference cliff): learned again.
    model_path(tmp_path).write_text(json.dumps({"version": 2, "device": "x",
                                                "cache_size": 1e9, "drain_rate": 1e8}))
    assert load_model(tmp_path).cliff is None and load_model(tmp_path).drain_rate is None


def test_a_cache_is_sized_by_the_drain_it_is_planned_with():
    """A cliff after 1 s and 1.6 GB from an empty cache: 1.2 GB by a drain of 400 MB/s, more by
    a slower one. From empty, bursting to the cache by a drain and pacing at it stays under the
    cliff that was seen whatever the true drain above it (docs/checkpoint.md)."""
    ref = ReferenceCliff(1.0, 1.6e9)
    assert ref.cache(0.4e9) == pytest.approx(1.2e9)
    assert ref.cache(0.2e9) == pytest.approx(1.4e9)
    # A start that was not empty: 0.3 GB 2 s before, drained since.
    assert ReferenceCliff(1.0, 1.6e9, fill=0.3e9, before=2.0).cache(0.1e9) == pytest.approx(
        0.1e9 + 1.6e9 - 0.1e9)


def test_two_cliffs_read_the_drain_and_a_clear_write_bounds_it():
    """A 1.2 GB cache draining 400 MB/s, taken at 2 GB/s from empty: the cliff after 0.75 s and
    1.5 GB. A later write, 0.7 s unpaced then 600 MB/s, meets it again when its bytes less what
    drained reach 1.2 GB: the pair gives the drain back; any point short of it bounds it."""
    ref = ReferenceCliff(0.75, 1.5e9)
    written = lambda t: 1.4e9 + 0.6e9 * (t - 0.7)  # noqa: E731
    meet = 0.7 + (1.2e9 - 1.4e9 + 0.4e9 * 0.7) / (0.6e9 - 0.4e9)
    assert ref.drain_to(meet, written(meet), EMPTY, 2e9) == pytest.approx(0.4e9, rel=1e-6)
    bound = ref.drain_to(meet - 0.1, written(meet - 0.1), EMPTY, 2e9)
    assert bound < 0.4e9
    assert ref.drain_to(0.8, written(0.8), EMPTY, 2e9) is None  # too close to tell


# -- what a save teaches -------------------------------------------------------------------------
def _record(**kw) -> SaveRecord:
    return dataclasses.replace(SaveRecord(), **kw)


@pytest.mark.parametrize("spread,how,drain", [(0.01, MEASURED, 0.5e9),
                                               (0.1, LOWER_BOUND, 0.3e9),
                                               (0.3, None, None)])
def test_two_cliffs_read_the_drain_as_closely_as_they_were_placed(spread, how, drain):
    # A cache of 1.2e9 draining at 0.5e9: met from empty at 0.8 s, and again at 1.8 s by a
    # write that ran at 1e9 before it; each cliff placed to within ``spread`` seconds.
    model = DriveModel("x", fast_rate=2e9, post_cache_rate=0.5e9)
    model.cliff = ReferenceCliff(0.8, 1.6e9, spread=spread)
    controller = SaveController(model, total=3e9, start_fill=lambda d: 0.0)
    controller.looks = [(0.0, 0.0, 0.0), (1.6, 1.9e9, 1.9e9), (1.8, 2.1e9, 2.1e9)]
    cliff = SeenCliff(1.8, 2.1e9, 2.1e9, "writes", "test", spread)
    read, known = controller._two_cliffs(model.cliff, cliff)
    assert known == how and read == (None if drain is None else pytest.approx(drain, rel=1e-6))


def test_a_refill_reading_is_measured_and_sizes_the_cache(tmp_path):
    model = load_model(tmp_path)
    record = _record(cliffs=[SeenCliff(0.8, 1.6e9, 1.6e9, "writes", "burst")],
                     fast_rate=2e9, post_cache_rate=0.5e9, drain=0.4e9, drain_how=MEASURED,
                     drain_from="refill", exit_s=0.5, exit_bytes=0.05e9, end_fill=1.1e9)
    learn(model, record, total=3e9, start_fill=EMPTY, ended=time.time(), ended_disk=None)
    again = load_model(tmp_path)
    assert again.drain == 0.4e9 and again.how("drain_rate") == MEASURED
    assert again.cache_size == pytest.approx(1.6e9 - 0.4e9 * 0.8)
    assert again.cliff_margin == pytest.approx(0.4e9 * 0.5 - 0.05e9)
    assert again.fill == pytest.approx(1.1e9)


def test_the_fill_is_anchored_where_the_cache_was_full_for_every_drain(tmp_path):
    """A save that met its cliff anchors the next save's fill at the last moment it saw the
    cache full: the fill then is the cache's size by the drain, and after it every byte the
    drive takes and every second it folds, for any drain the next readings try (not the number
    the model's drain made of it)."""
    model = load_model(tmp_path)
    record = _record(cliffs=[SeenCliff(0.8, 1.6e9, 1.6e9, "writes", "burst")],
                     fast_rate=2e9, post_cache_rate=0.5e9, drain=0.4e9, drain_how=MEASURED,
                     drain_from="refill", end_fill=1.1e9, full_before=(0.5, 0.3e9))
    ended, disk = 1000.0, 10_000_000_000
    learn(model, record, total=3e9, start_fill=EMPTY, ended=ended, ended_disk=disk)
    for drain in (0.2e9, 0.4e9, 0.6e9):
        start = model.start_fill(ended + 2.0, disk + int(0.5e9))(drain)
        # full 0.5 s before the end; 0.3e9 bytes since then, 0.5e9 more, 2.5 s of folding
        assert start == pytest.approx(model.cliff.cache(drain) + 0.8e9 - drain * 2.5)
    # A clear save ends with its own estimate: the idle gaps between saves empty the cache
    # whatever its drain, and a fill carried across them would grow by a slow drain's error.
    clear = _record(end_fill=1.0e9, clear=(1e9, 0.5e9, 0.0))
    learn(model, clear, total=3e9, start_fill=model.start_fill(ended + 2.0, disk + int(0.5e9)),
          ended=ended + 4.0, ended_disk=disk + int(1.0e9))
    assert model.start_fill(ended + 5.0, disk + int(1.0e9))(0.4e9) == pytest.approx(0.6e9)


def test_a_lower_bound_raises_a_drain_and_never_lowers_one(tmp_path):
    model = load_model(tmp_path)
    model.fast_rate, model.post_cache_rate, model.drain_rate = 2e9, 0.5e9, 0.3e9
    model.cliff = ReferenceCliff(0.8, 1.6e9)
    model.note("drain_rate", MEASURED, "earlier")
    faster = _record(drain=0.45e9, drain_how=LOWER_BOUND, drain_from="no cliff")
    learn(model, faster, total=3e9, start_fill=EMPTY, ended=time.time(), ended_disk=None)
    assert model.drain_rate == 0.45e9 and model.how("drain_rate") == LOWER_BOUND
    slower = _record(drain=0.2e9, drain_how=LOWER_BOUND, drain_from="no cliff")
    learn(model, slower, total=3e9, start_fill=EMPTY, ended=time.time(), ended_disk=None)
    assert model.drain_rate == 0.45e9


def test_a_cliff_drops_a_clear_schedule_and_the_drain_it_contradicted(tmp_path):
    model = load_model(tmp_path)
    model.fast_rate, model.post_cache_rate, model.drain_rate = 2e9, 0.5e9, 0.8e9
    model.cliff = ReferenceCliff(0.8, 1.6e9)
    model.clear = ClearSchedule(1.3e9, 0.9e9, 3e9)
    model.note("drain_rate", MEASURED, "minutes ago")
    record = _record(cliffs=[SeenCliff(0.6, 1.1e9, 1.1e9, "writes", "repeat")],
                     test_pace=0.9e9)
    learn(model, record, total=3e9, start_fill=EMPTY, ended=time.time(), ended_disk=None)
    assert model.clear is None and model.crossed == 0.9e9
    assert model.how("drain_rate") == ASSUMED and model.drain == pytest.approx(0.25e9)
    assert model.cliff.bytes == 1.1e9  # it showed the cache smaller than the one held


def test_a_test_that_meets_the_cliff_bounds_its_pace_and_keeps_the_drain_known(tmp_path):
    model = load_model(tmp_path)
    model.fast_rate, model.post_cache_rate, model.drain_rate = 2e9, 0.5e9, 0.3e9
    model.cliff = ReferenceCliff(0.8, 1.6e9)
    model.note("drain_rate", LOWER_BOUND, "save")
    record = _record(cliffs=[SeenCliff(0.85, 1.6e9, 1.6e9, "writes", "test")],
                     test_pace=1.25e9)  # too near the model's cliff to read a drain off
    learn(model, record, total=3e9, start_fill=EMPTY, ended=time.time(), ended_disk=None)
    assert model.crossed == 1.25e9  # the drive drains slower than that ...
    assert model.drain == 0.3e9 and model.how("drain_rate") == LOWER_BOUND  # ... and no slower
    assert trial_pace(model) == pytest.approx(0.5 * (0.3e9 + 1.25e9))


def test_a_save_tests_where_its_plan_would_crawl_from_the_fill_it_starts_at():
    """Seed 11 of the learning benchmark from a model 4 x too slow, on the emulator: a cliff
    in a save's last requests left the drain at the slow end of drives (a fiftieth of this
    drive's, from a post-cache rate read off the write's last 2 MB), which sizes the cache
    2.6 x the drive's and carries the fill across the gap at that crawl. From an empty cache
    that plan looked as fast as a test's, so the next save planned from a cache 96% full by
    that count, and took 8 x the shortest; from the fill it starts at, it tests."""
    model = DriveModel("x", fast_rate=1.757e9, post_cache_rate=34e6)
    model.cliff = ReferenceCliff(1.083, 1.877e9, fill=1.07e9, before=5.0)
    cache = model.cache_size
    assert save_kind(model, 1.879e9, 0.0, deadline=None, measured=True, crossings=0) == (
        False, None)
    assert save_kind(model, 1.879e9, 0.96 * cache, deadline=None, measured=True,
                     crossings=0) == (False, pytest.approx(trial_pace(model)))


def test_a_drive_slow_to_leave_its_cliff_is_tested_where_the_plan_loses_more_than_that():
    """A drive seen to free a wide margin before it leaves its cliff (1.4 s of its drain as
    the model holds it, a lower bound): a test that meets the cliff holds the reads beside it
    that long. Seed 14 of the learning benchmark on the emulator, its post-cache rate read
    0.65 x and its drain bounded at 0.47 x, never tested, and each plan, counting the cache
    fuller after a gap the bound could not drain, took longer than the last (2.3 x, 3.3 x,
    4.4 x the shortest). Where the plan would take longer than a test by more than that
    margin's seconds, the save tests; where by less, it plans."""
    model = DriveModel("x", fast_rate=1.8e9, post_cache_rate=0.23e9, drain_rate=0.18e9)
    model.note("drain_rate", LOWER_BOUND, "save")
    model.cliff, model.cliff_margin = ReferenceCliff(0.75, 1.35e9), 0.25e9
    exit_s = model.cliff_margin / model.drain

    def loses(capacity: float) -> float:
        return (planned_seconds(model, model.drain, capacity)
                - planned_seconds(model, trial_pace(model), capacity))

    assert loses(1.4e9) < exit_s < loses(1.8e9)
    assert save_kind(model, 1.4e9, 0.0, deadline=None, measured=True, crossings=0) == (
        False, None)
    assert save_kind(model, 1.8e9, 0.0, deadline=None, measured=True, crossings=0) == (
        False, pytest.approx(trial_pace(model)))


def test_which_saves_measure_test_repeat_or_plan():
    model = DriveModel("x", fast_rate=2e9, post_cache_rate=0.5e9, drain_rate=0.3e9)
    assert save_kind(model, 3e9, 0.0, deadline=None, measured=False, crossings=0) == (
        True, None)  # seen for the first time
    model.cliff = ReferenceCliff(0.8, 1.6e9)
    model.note("drain_rate", LOWER_BOUND, "save")
    assert save_kind(model, 3e9, 0.0, deadline=None, measured=False, crossings=0) == (
        True, None)  # this writer's first save: the model may be wrong either way
    assert save_kind(model, 3e9, 0.0, deadline=5.0, measured=False, crossings=0) == (
        False, None)  # a deadline a measurement could not keep
    assert save_kind(model, 0.5e9, 0.0, deadline=None, measured=False, crossings=0) == (
        False, None)  # the model says it fits: nothing to pace
    measure, pace = save_kind(model, 3e9, 0.0, deadline=None, measured=True, crossings=0)
    assert not measure and pace == pytest.approx(trial_pace(model)) and pace > model.drain
    assert save_kind(model, 3e9, 0.0, deadline=None, measured=True, crossings=2)[1] is None
    # A schedule taken clear covers the save, but a test's pace would still shorten it.
    model.clear = ClearSchedule(1.3e9, 0.35e9, 3e9)
    assert save_kind(model, 3e9, 0.0, deadline=None, measured=True, crossings=0)[1] == pace
    model.clear = ClearSchedule(1.3e9, 1.2e9, 3e9)  # ... and where it would not, repeat it
    assert save_kind(model, 3e9, 0.0, deadline=None, measured=True, crossings=0)[1] is None
    model.clear = None
    model.crossed = 1.1e9  # a test met the cliff there: the next halves the distance
    assert trial_pace(model) == pytest.approx(0.5 * (0.3e9 + 1.1e9))
    # ... but never below a pace whose cliff would show: in the cliff the drive still takes
    # its post-cache rate, which a slower pace would not fall short of.
    model.crossed = 0.75e9
    assert trial_pace(model) == pytest.approx(0.5e9 / SHORTFALL * (1 + RATE_NOISE))
    model.crossed = 0.6e9  # ... and none where even that pace met the cliff
    assert save_kind(model, 3e9, 0.0, deadline=None, measured=True, crossings=0)[1] is None
    model.crossed = 1.1e9
    model.note("drain_rate", MEASURED, "save")
    assert save_kind(model, 3e9, 0.0, deadline=None, measured=True, crossings=0)[1] is None
    # A drain read below the slow end of drives (half the post-cache rate) is likelier a cliff
    # placed wrong than the drive: tested again, however recent the reading.
    model.drain_rate = 0.2e9
    model.note("drain_rate", MEASURED, "save")
    measure, pace = save_kind(model, 3e9, 0.0, deadline=None, measured=True, crossings=0)
    assert not measure and pace is not None and pace > model.drain


def test_a_save_the_drive_took_unpaced_is_repeated_not_measured_again():
    """A writer's save that found no cliff measured nothing; one like it again has nothing to
    gain from measuring (it runs at the drive's own rate) and, at the edge of the cache, would
    meet the cliff as its requests run out: it repeats the schedule, with the margin repeats
    leave (test_pacing: a repeat at the edge of its bytes)."""
    model = DriveModel("x", fast_rate=2e9, post_cache_rate=0.5e9, drain_rate=0.3e9,
                       cliff=ReferenceCliff(0.8, 1.6e9))
    model.clear = ClearSchedule(3e9, 0.0, 3e9)  # a measuring save of 3 GB met no cliff
    assert save_kind(model, 3e9, 0.0, deadline=None, measured=False, crossings=0) == (
        False, None)
    assert save_kind(model, 3e9, 1e9, deadline=None, measured=False, crossings=0) == (
        True, None)  # ... from a fuller cache than it was taken clear from: measured
    model.clear = ClearSchedule(1.3e9, 1.2e9, 3e9)  # a paced one may go faster: measured
    assert save_kind(model, 3e9, 0.0, deadline=None, measured=False, crossings=0) == (
        True, None)


# -- the family, simulated -----------------------------------------------------------------------
WRITE_RATE = 2.0e9  # a drive writing about this disk's speed
SCENARIOS = {"fresh": None, "slow": 0.25, "fast": 4.0}


def _drive(seed: int) -> DriveSettings:
    settings = random_settings(WRITE_RATE, random.Random(seed))
    return dataclasses.replace(settings, cache_size=min(settings.cache_size, 1 << 30))


def _seeded(settings: DriveSettings, factor, now: float) -> DriveModel:
    """A stored model whose post-cache and drain rates are ``factor`` x the drive's, the cache
    right, measured five minutes ago (None: no model)."""
    model = DriveModel("sim")
    if factor is None:
        return model
    model.fast_rate = settings.fast_rate
    model.post_cache_rate = factor * settings.post_cache_rate
    model.drain_rate = factor * settings.drain_rate
    seconds = settings.cache_size / (settings.fast_rate - model.drain_rate) \
        if model.drain_rate < settings.fast_rate else 0.0
    model.cliff = ReferenceCliff(seconds, settings.cache_size + model.drain_rate * seconds)
    for name in ("post_cache_rate", "drain_rate"):
        model.note(name, MEASURED, "seeded", when=now - 300)
    model.fill_time = now - 300
    return model


def _scenario(seed: int, factor, saves: int = 4, share: float = 1.75):
    """A writer's saves on a simulated drive of the family with a reader beside, as the
    learning benchmark runs them: (per save (ratio to the shortest, cliff seconds), seconds in
    the cliff after the first save)."""
    settings = _drive(seed)
    drive = SimDrive(settings, disk_rate=WRITE_RATE, noise=0.1, seed=seed, reads_per_s=250)
    wall0 = 1e6
    model = _seeded(settings, factor, wall0)
    size = share * settings.cache_size
    gap = 4 / 3 * shortest(settings, settings.cache_size, size) + 2.0
    measured, crossings, rows, first_end = False, 0, [], None
    for _ in range(saves):
        due = drive.now
        fill = model.start_fill(wall0 + due, None)(model.drain or 0.0)
        measure, test = save_kind(model, size, fill, deadline=None, measured=measured,
                                  crossings=crossings)
        save = run_save(drive, model, size, measure=measure, test=test, quiet_read_s=0.0005,
                        wall0=wall0)
        measured = measured or measure and bool(save.record.cliffs)  # as AutoPacing.learn
        crossings += bool(test) and bool(save.record.cliffs)
        took = drive.now - due
        first_end = drive.now if first_end is None else first_end
        drive.idle(max(0.0, due + gap - drive.now))
        rows.append((took / shortest(settings, save.start_fill, size),
                     drive.cliff_seconds(due, drive.now)))
    return rows, drive.cliff_seconds(first_end)


def _meets(scenario: str, rows, after: float) -> bool:
    """Issue 48's targets: after the first save at most 0.5 s in the cliff (1 s from a wrong
    model); from the third save within 1.3 x the shortest (and, from a wrong model, clear)."""
    late = rows[2:]
    clear = scenario == "fresh" or all(cliff == 0 for _, cliff in late)
    return after <= (0.5 if scenario == "fresh" else 1.0) and clear and all(
        ratio <= 1.3 for ratio, _ in late)


def test_the_family_learned_from_the_saves_alone():
    """120 runs on 40 drives of the family (seeds 11-50), each fresh and from stored models
    4 x too slow and too fast measured minutes ago, a reader beside (held in the cliff as the
    emulator holds it: to a rate it asks less than, so it shows no cliff). Issue 48's targets
    are the aim; what this design reaches in the simulation is held against regressions: at
    least 75% of runs meet every target (96 of 120 at this writing), none spends more than 3 s in
    the cliff after its first save, and no save from the third takes over 4 x the shortest.
    (The runs that miss are mostly drives that leave their cliff only after freeing a fifth
    of their cache, and drives whose saves reach barely past it: docs/checkpoint.md,
    limits.)"""
    met, worst_cliff, worst_ratio = 0, 0.0, 0.0
    for seed in range(11, 51):
        for scenario, factor in SCENARIOS.items():
            rows, after = _scenario(seed, factor)
            met += _meets(scenario, rows, after)
            worst_cliff = max(worst_cliff, after)
            worst_ratio = max(worst_ratio, max(r for r, _ in rows[2:]))
    assert met >= 0.75 * 120, met
    assert worst_cliff <= 3.0 and worst_ratio <= 4.0, (worst_cliff, worst_ratio)


@pytest.mark.parametrize("factor", [0.25, 4.0])
def test_a_wrong_model_measured_minutes_ago_is_corrected_by_the_first_save(factor):
    """The first save of a writer measures the drive whatever the model's age: a model 4 x too
    slow (or fast) is replaced by what the drive showed, not kept for a day."""
    for seed in (14, 18, 30, 40):  # drives whose first save reads the drain
        settings = _drive(seed)
        drive = SimDrive(settings, disk_rate=WRITE_RATE, noise=0.1, seed=seed,
                         reads_per_s=250)
        model = _seeded(settings, factor, 1e6)
        measure, _ = save_kind(model, 1.75 * settings.cache_size, 0.0, deadline=None,
                               measured=False, crossings=0)
        assert measure
        run_save(drive, model, 1.75 * settings.cache_size, measure=True, quiet_read_s=0.0005)
        # From 4 x off to within a refill's reading: its two moments' placing over the span
        # between them (a fifth either way at these spans; docs/emulation.md, accuracy).
        assert 0.75 <= model.drain / settings.drain_rate <= 1.25, (seed, model.to_dict())
        assert model.post_cache_rate == pytest.approx(settings.post_cache_rate, rel=0.25)
        # ... and the cache by the cliff this save met, not the stored model's: read by the
        # drain measured, a cliff placed by a drain 4 x too slow sized it a fifth small.
        assert model.cache_size == pytest.approx(settings.cache_size, rel=0.1), seed


@pytest.mark.parametrize("held", [True, False])
def test_a_save_recovers_once_the_reads_its_cliff_held_back_are_quick_again(held):
    """A save that met its cliff stops writing until the drive has freed the margin it needs
    to leave it. Never seen to leave it, the drive is assumed to need the family's widest
    margin (a quarter of its cache) at its slowest drain: about a second here, where this
    drive frees its twentieth in a tenth. Where it held the reads beside it back in its cliff,
    their turning quick again shows it out: the save plans the rest then, and keeps how long
    the drive took to leave, which bounds its margin."""
    settings = DriveSettings(cache_size=1e9, post_cache_rate=0.5e9, drain_rate=0.6e9,
                             fast_rate=1.8e9, hysteresis_share=0.05,
                             fold_read_rate=10e6 if held else 0)
    drive = SimDrive(settings, disk_rate=WRITE_RATE, seed=1, reads_per_s=250)
    # With a deadline the save does not refill (no time to spare): it recovers at once.
    save = run_save(drive, DriveModel("sim"), 1.75e9, measure=True, deadline=30.0,
                    quiet_read_s=0.0005)
    modes = dict((mode, t) for t, mode in save.record.modes)
    stopped = modes["plan"] - modes["recover"]
    if held:
        assert stopped < 0.3, save.record.modes
        assert save.record.exit_s is not None and save.record.exit_s < 0.4
    else:
        assert stopped > 0.6, save.record.modes
        assert save.record.exit_s is None


def test_a_throttle_that_credits_a_pause_is_not_a_drive_out_of_its_cliff():
    """cgroup v1's throttle gives a writer that resumes after a pause the limit's worth of the
    pause at once, besides its slice (20 MB at a 76 MB/s limit after a 0.18 s pause on the
    emulator). A refill whose probe counted that burst read a drive still in its cliff as out
    of it, and the drain off the refill up to 1.7 x high. Measuring saves on the family with
    such a throttle: every drain read off a refill within a refill's accuracy."""
    read = 0
    for seed in range(11, 51):
        settings = _drive(seed)
        drive = SimDrive(settings, disk_rate=WRITE_RATE, noise=0.1, seed=seed,
                         reads_per_s=250, idle_credit=True)
        model = DriveModel("sim")
        save = run_save(drive, model, 1.75 * settings.cache_size, measure=True,
                        quiet_read_s=0.0005)
        if save.record.drain_how == MEASURED:
            read += 1
            assert 0.75 <= model.drain / settings.drain_rate <= 1.25, (seed, model.to_dict())
    assert read >= 10  # the drives whose saves have the bytes to refill


def test_a_refill_that_ends_within_its_probe_is_not_judged_by_a_credited_burst():
    """A drive still in its cliff when a refill began 0.2 s after a pause: the throttle
    credits the pause at once, at the disk's speed, and the save's bytes ran out within the
    refill's probe. Judged by its rate from its start, that refill ran out of the cliff, and
    the drive's bytes since the anchor bounded the drain from below at 1.8 x the drive's."""
    settings = DriveSettings(cache_size=147 * MiB, post_cache_rate=95.5e6, drain_rate=58.8e6,
                             fast_rate=200e6)
    drive = SimDrive(settings, disk_rate=1e9, noise=0.1, seed=46, reads_per_s=100,
                     idle_credit=True)
    save = run_save(drive, DriveModel("sim"), 2 * settings.cache_size, measure=True,
                    quiet_read_s=0.0005)
    assert [m for _, m in save.record.modes].count("refill") >= 2
    assert save.record.drain is None or save.record.drain <= settings.drain_rate


# -- the bytes a save writes ---------------------------------------------------------------------
def _process_written() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise AssertionError("no write_bytes in /proc/self/io")


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs /proc/self/io")
def test_a_save_writes_nothing_but_the_checkpoint(tmp_path):
    """A measuring save (no model: the first of a drive) writes the checkpoint and nothing
    else: no file to learn the drive with. The process's writes, its /proc/self/io, against
    the checkpoint's bytes (the writer's lock file and the model's JSON are a few KiB)."""
    directory = tmp_path / "ckpt"
    state = {"w": torch.rand(16 * MiB // 4)}
    before = _process_written()
    with CheckpointWriter(directory, rate="auto", keep=1) as writer:
        report = writer.save(state, step=0).result()
    os.sync()
    written = _process_written() - before
    assert report.pacing["plan"] == "measure"
    assert report.written_bytes == report.bytes
    assert written <= report.bytes + (1 << 20), (written, report.bytes)
    assert torch.equal(load_checkpoint(directory)["w"], state["w"])


# -- on the emulated drive -------------------------------------------------------------------------
needs_throttle = pytest.mark.skipif(throttle_support() is None,
                                    reason="needs root and a cgroup block-I/O controller")


def _reads(path: Path, stop: threading.Event, rate: float = 100.0) -> None:
    """A reader beside the writer: 128 KiB O_DIRECT reads at ``rate`` a second."""
    import mmap

    block = 128 << 10
    buf = mmap.mmap(-1, block)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    rng = random.Random(0)
    blocks = os.fstat(fd).st_size // block
    try:
        while not stop.is_set():
            os.preadv(fd, [buf], rng.randrange(blocks) * block)
            stop.wait(1 / rate)
    finally:
        os.close(fd)


def _emulated_fill(drive, seconds: float) -> float:
    """The emulated cache's fill at the timeline's first point from ``seconds`` on."""
    return next((p.fill for p in drive.timeline if p.seconds >= seconds), 0.0)


@needs_throttle
def test_an_emulated_drive_is_learned_from_the_saves_with_a_reader_beside(tmp_path):
    """A drive drawn from the documented range at test scale (docs/emulation.md) each run
    (FLASHSTREAM_TEST_SEED replays one), a reader beside: the first save measures it; after
    it, at most a test's cliff (a hold, a slice and the drive's margin: up to 1.1 s at test
    scale, where caches are under a second of writing; the learning benchmark judges issue
    48's 0.5 s at full scale), and the last save clear; nothing but the checkpoints
    written."""
    from flashstream.emulation import DriveEmulator

    seed = int(os.environ.get("FLASHSTREAM_TEST_SEED") or random.randrange(1 << 32))
    rng = random.Random(seed)
    post = rng.uniform(60e6, 100e6)
    settings = DriveSettings(cache_size=rng.randint(96, 160) * MiB, post_cache_rate=post,
                             drain_rate=post * rng.uniform(0.6, 1.0), fast_rate=200e6)
    info = f"seed {seed}: " + json.dumps(settings.to_dict())
    reader_file = tmp_path / "reader.bin"
    with open(reader_file, "wb") as f:
        f.write(os.urandom(64 * MiB))
    directory = tmp_path / "ckpt"
    state = {"w": torch.rand(int(2 * settings.cache_size) // 4)}
    gap = 2.5 * settings.cache_size / settings.drain_rate
    stop = threading.Event()
    os.sync()  # earlier tests' dirty pages would be another writer
    with DriveEmulator(tmp_path, settings) as drive:
        drive.add_process()
        reader = threading.Thread(target=_reads, args=(reader_file, stop))
        reader.start()
        try:
            with CheckpointWriter(directory, rate="auto", keep=1, chunk_size=MiB) as writer:
                windows = []
                for step in range(4):
                    due = time.perf_counter() - drive.started
                    report = writer.save(state, step=step).result()
                    windows.append((due, report))
                    time.sleep(max(0.0, due + gap - (time.perf_counter() - drive.started)))
        finally:
            stop.set()
            reader.join()
    first = windows[0][1]
    assert first.pacing["plan"] == "measure", info
    assert first.pacing["cliffs"], info  # it met the cliff it measured
    # What the emulated drive did in each save's window, beside what the saves saw of it.
    seen = [{"start_fill_MiB": round(_emulated_fill(drive, due) / MiB, 1),
             "cliff_s": round(drive.cliff_seconds(due, due + gap), 2)} for due, _ in windows]
    pacing = json.dumps({"drive": seen, "saves": [r.pacing for _, r in windows]}, default=str)
    after = drive.cliff_seconds(windows[1][0])
    assert after <= 1.5, f"{info}; {after:.2f} s in the cliff after the first save; {pacing}"
    last = windows[-1][0]
    assert drive.cliff_seconds(last, last + gap) == 0, f"{info}; {pacing}"
    assert all(r.written_bytes == r.bytes for _, r in windows), info
    assert torch.equal(load_checkpoint(directory)["w"], state["w"])


@needs_throttle
def test_the_sustained_probe_measures_the_drive_ahead(tmp_path):
    from flashstream.checkpoint.drive_probe import measure_sustained
    from flashstream.emulation import DriveEmulator

    settings = DriveSettings(cache_size=128 * MiB, post_cache_rate=80e6, drain_rate=64e6,
                             fast_rate=200e6)
    os.sync()
    with DriveEmulator(tmp_path, settings) as drive:
        drive.add_process()
        model = measure_sustained(tmp_path, 3 * settings.cache_size)
        remembered = load_model(tmp_path)  # the emulated drive's, kept apart from the real one
    info = json.dumps(model.to_dict(), default=str)
    assert model.has_cliff and model.how("drain_rate") == MEASURED, info
    assert model.cache_size == pytest.approx(settings.cache_size, rel=0.2), info
    assert model.post_cache_rate == pytest.approx(settings.post_cache_rate, rel=0.15), info
    assert model.drain == pytest.approx(settings.drain_rate, rel=0.25), info
    assert remembered.cliff == model.cliff


def _write_steadily(path, rate: float, stop: threading.Event) -> None:
    """Another writer on the drive: 1 MiB O_DIRECT writes at ``rate`` bytes/s."""
    import mmap

    block = mmap.mmap(-1, MiB)
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


@needs_throttle
def test_auto_counts_another_writer_on_the_drive_and_stays_out_of_the_cliff(tmp_path):
    """The drive's cache fills from every writer: another one at 3/8 of the drain during a
    save of 1.5 x the cache, counted through the drive's counter, leaves this save less drain
    and headroom, and the save stays out of the cliff."""
    from flashstream.emulation import DriveEmulator

    settings = DriveSettings(cache_size=128 * MiB, post_cache_rate=80e6, drain_rate=64e6,
                             fast_rate=200e6)
    others = 24e6
    directory = tmp_path / "ckpt"
    directory.mkdir()
    state = {"w": torch.rand(int(1.5 * settings.cache_size) // 4)}
    stop = threading.Event()
    os.sync()
    with DriveEmulator(tmp_path, settings) as drive:
        drive.add_process()
        model = load_model(directory)  # the emulated drive's, as a probe would have left it
        model.fast_rate, model.post_cache_rate = settings.fast_rate, settings.post_cache_rate
        model.drain_rate = settings.drain_rate
        seconds = settings.cache_size / (settings.fast_rate - settings.drain_rate)
        model.cliff = ReferenceCliff(seconds, settings.cache_size + settings.drain_rate * seconds)
        for name in ("post_cache_rate", "drain_rate"):
            model.note(name, MEASURED, "test")
        model.save()
        other = threading.Thread(target=_write_steadily, args=(tmp_path / "other", others, stop))
        other.start()
        try:
            time.sleep(1.0)
            with CheckpointWriter(directory, rate="auto", keep=1, chunk_size=MiB) as writer:
                writer._auto.measured = True  # as after its first save: planned from the model
                began = time.perf_counter() - drive.started
                report = writer.save(state, step=0).result()
                ended = time.perf_counter() - drive.started
        finally:
            stop.set()
            other.join()
    info = json.dumps(report.pacing, default=str)
    assert report.pacing["plan"] == "model", info
    assert drive.cliff_seconds(began, ended) == 0, info
    assert 0.5 * others * report.write_s <= report.pacing["others_during_bytes"], info
    assert torch.equal(load_checkpoint(directory)["w"], state["w"])
