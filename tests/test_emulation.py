"""The drive emulator: its cache model (clock-free), and the real throttle (root only)."""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import child_env

from flashstream.emulation import (
    RANDOM_RANGES,
    CacheModel,
    DriveSettings,
    profile_settings,
    random_settings,
    throttle_support,
)
from flashstream.emulation.cgroup import PREFIX, V1_ROOT, V2_ROOT
from flashstream.emulation.model import BUSY_CARRY_S

MiB = 1 << 20


def test_model_fills_drains_and_enters_the_cliff():
    s = DriveSettings(cache_size=100 * MiB, post_cache_rate=10 * MiB, fast_rate=100 * MiB)
    model = CacheModel(s)
    assert model.write_limit() == 100 * MiB and model.read_limit() == 0
    # Writing 50 MiB/s for 1 s while folding 10 MiB/s: 40 MiB in the cache.
    for _ in range(100):
        model.step(0.5 * MiB, 0.01)
    assert model.state.fill == pytest.approx(40 * MiB, rel=1e-6)
    assert not model.state.cliff
    model.step(200 * MiB, 0.01)  # more than the room left: full, in the cliff
    assert model.state.fill == s.cache_size and model.state.cliff
    assert model.write_limit() == s.post_cache_rate
    # Writing at the post-cache rate keeps it full and in the cliff.
    for _ in range(100):
        model.step(0.1 * MiB, 0.01)
    assert model.state.cliff
    # Idle: folding frees the hysteresis, and the drive leaves the cliff.
    seconds = s.hysteresis / s.drain_rate
    model.step(0, seconds * 1.01)
    assert not model.state.cliff


def test_model_tapers_the_write_limit_near_full():
    s = DriveSettings(cache_size=100 * MiB, post_cache_rate=10 * MiB, fast_rate=1000 * MiB)
    model = CacheModel(s, horizon=0.05)
    model.step(99 * MiB, 0.0)
    # 1 MiB of room over the next 0.05 s: 20 MiB/s, not the fast rate.
    assert model.write_limit() == pytest.approx(20 * MiB)


def test_a_throttle_that_releases_bursts_steps_down_half_a_burst_before_full():
    """A kernel throttle lets ``limit x slice`` through at each new limit: a taper (each
    step a new limit) let bursts through all the way to the full cache and beyond. The
    limit steps straight from the fast to the post-cache rate, once the room left is half
    a burst at the post-cache rate and half a step of writing; the drive is in its cliff
    once that room is written, and a writer that stops short is let go a slice later."""
    s = DriveSettings(cache_size=100 * MiB, post_cache_rate=40 * MiB, fast_rate=400 * MiB,
                      fold_read_rate=4 * MiB)
    lead = 0.5 * 40 * MiB * 0.1 + 0.5 * 4 * MiB  # half a burst, half a step at 400 MiB/s

    def held_model():
        model, limits = CacheModel(s, horizon=0.01, release=0.1), set()
        while model.write_limit() != s.post_cache_rate:
            limits.add(model.write_limit())
            model.step(4 * MiB, 0.01)
        assert limits == {s.fast_rate}  # no taper
        room = s.cache_size - model.state.fill
        assert lead - 4 * MiB < room <= lead and not model.state.cliff
        return model, room

    model, room = held_model()
    model.step(room, 0.01)  # the throttle's first burst: the room is written
    assert model.state.cliff and model.state.fill == s.cache_size
    assert model.write_limit() == s.post_cache_rate

    model, room = held_model()  # the writer stops: not in the cliff, let go after a slice
    assert model.read_limit() == s.fold_read_rate
    for _ in range(11):
        model.step(0.0, 0.01)
        assert not model.state.cliff
    assert model.write_limit() == s.fast_rate

    # A paced writer faster than the post-cache rate but slower than the drive folds, its
    # cache near full: a real drive's would never fill, so it is never held (its reads
    # neither), and never in the cliff. (Held by the room alone, such saves met a cliff of
    # 0.6-0.9 s on emulated drives 13, 16 and 18.)
    folding = dataclasses.replace(s, drain_rate=60 * MiB)
    paced = CacheModel(folding, horizon=0.01, release=0.1)
    paced.step(s.cache_size - lead / 2, 0.0)
    for _ in range(100):  # 1 s at 50 MiB/s
        paced.step(50 * MiB * 0.01, 0.01)
        assert not paced.state.cliff
        assert paced.write_limit() == s.fast_rate and paced.read_limit() == 0.0

    idle = CacheModel(s, horizon=0.01, release=0.1)  # idle steps never take hold
    idle.step(s.cache_size - lead / 2, 0.0)
    idle.step(0.0, 0.001)
    assert idle.write_limit() == s.fast_rate


def test_profiles_scale_to_the_drive_and_check_settings():
    s = profile_settings("plc", 1e9)
    assert s.fast_rate == pytest.approx(0.9e9)
    assert s.post_cache_rate == pytest.approx(0.9e9 * 0.8 / 3.2)
    assert s.cache_size == int(1.25 * 0.9e9)
    assert profile_settings("qlc", 1e9, cache_size="1GiB").cache_size == 1 << 30
    with pytest.raises(ValueError, match="plc, qlc"):
        profile_settings("tlc", 1e9)
    with pytest.raises(ValueError, match="allowed"):
        profile_settings("plc", 1e9, bogus=1)
    with pytest.raises(ValueError, match="drain_rate"):
        DriveSettings(cache_size="1GiB", post_cache_rate="100MB", drain_rate="200MB",
                      fast_rate="150MB")
    with pytest.raises(ValueError, match="hysteresis"):
        DriveSettings(cache_size="1GiB", post_cache_rate="100MB", hysteresis_share=1.5)


def test_a_drive_that_folds_faster_idle_than_it_writes_in_the_cliff():
    """drain above the post-cache rate: written at the post-cache rate it stays in the
    cliff; idle it frees its hysteresis at the full drain rate."""
    s = DriveSettings(cache_size=100 * MiB, post_cache_rate=10 * MiB, drain_rate=30 * MiB,
                      fast_rate=100 * MiB, hysteresis_share=0.2)
    model = CacheModel(s)
    model.step(200 * MiB, 0.01)
    assert model.state.cliff
    for _ in range(300):  # 3 s written at the post-cache rate
        model.step(0.1 * MiB, 0.01)
    assert model.state.cliff and model.state.fill == s.cache_size
    for _ in range(60):  # 0.6 s idle folds 18 MiB: still short of the hysteresis
        model.step(0, 0.01)
    assert model.state.cliff
    assert model.state.fill == pytest.approx(s.cache_size - 18 * MiB)
    for _ in range(8):
        model.step(0, 0.01)
    assert not model.state.cliff
    # Out of the cliff, writing below the drain rate empties the cache.
    for _ in range(100):
        model.step(0.2 * MiB, 0.01)
    assert model.state.fill < s.cache_size - 20 * MiB - 9 * MiB


def test_a_steady_writer_in_bursts_keeps_the_cliff_full():
    """The block-I/O throttle releases a writer at the post-cache rate in bursts, twice the
    rate every other step: the drive is busy writing all along, so it stays full and in its
    cliff. (Judged step by step, it folded at the mean of the two rates in the empty steps'
    favour, and a few seconds in the cliff left its "full" cache tens of MB short.)"""
    s = DriveSettings(cache_size=1000 * MiB, post_cache_rate=100 * MiB, drain_rate=150 * MiB,
                      fast_rate=500 * MiB, hysteresis_share=0.2)
    model = CacheModel(s)
    model.step(2000 * MiB, 0.05)
    assert model.state.cliff
    for k in range(161):  # 8 s, ending with a burst
        model.step(10 * MiB if k % 2 == 0 else 0.0, 0.05)
    assert model.state.cliff and model.state.fill == pytest.approx(s.cache_size, rel=1e-3)
    # A burst owes at most BUSY_CARRY_S of writing: a long stall after it is idle.
    model.step(100 * MiB, 0.05)
    for _ in range(40):  # 2 s: BUSY_CARRY_S of it written at the post-cache rate, the rest idle
        model.step(0.0, 0.05)
    idle = 2 - BUSY_CARRY_S
    assert model.state.fill == pytest.approx(s.cache_size - idle * 150 * MiB, rel=1e-3)


def test_bursts_in_the_cliff_do_not_take_a_drive_with_a_small_margin_out_of_it():
    """A drive whose margin is a burst's worth (5% of a 1 GB cache, folding at 1 GB/s idle)
    written at its post-cache rate in the throttle's bursts stays in its cliff: each burst's
    bytes enter the cache over the steps it stands for. (Counted in their own step, the bytes
    beyond the full cache were lost, and the empty step after it folded the cache out of the
    cliff.)"""
    s = DriveSettings(cache_size=1000 * MiB, post_cache_rate=800 * MiB, drain_rate=1000 * MiB,
                      fast_rate=2500 * MiB, hysteresis_share=0.05)
    model = CacheModel(s)
    model.step(2000 * MiB, 0.05)
    assert model.state.cliff
    for k in range(81):  # 4 s, a burst every third step
        model.step(120 * MiB if k % 3 == 0 else 0.0, 0.05)
        assert model.state.cliff, k


def test_random_drives_fall_in_the_documented_range():
    rng = random.Random(7)
    seen = set()
    for _ in range(200):
        s = random_settings(1e9, rng)
        fast = 0.9e9
        post = s.post_cache_rate / fast
        assert RANDOM_RANGES["post_cache"][0] <= post <= RANDOM_RANGES["post_cache"][1]
        seconds = s.cache_size / fast
        assert RANDOM_RANGES["cache_seconds"][0] - 1e-6 <= seconds <= RANDOM_RANGES[
            "cache_seconds"][1]
        share = s.drain_rate / s.post_cache_rate
        assert RANDOM_RANGES["drain_share"][0] <= share <= RANDOM_RANGES["drain_share"][1]
        held = s.hysteresis / s.cache_size
        low, high = RANDOM_RANGES["hysteresis_share"]
        assert low - 1e-6 <= held <= high + 1e-6
        seen.add((share > 1, held > 0.1, seconds < 0.5))
    # The family holds drives that fold faster idle than in the cliff, wide hysteresis and
    # small caches, in every combination.
    assert len(seen) == 8
    assert random_settings(1e9, random.Random(3)) == random_settings(1e9, random.Random(3))
    with pytest.raises(ValueError, match="write_rate"):
        random_settings(0, random.Random(1))


needs_throttle = pytest.mark.skipif(
    throttle_support() is None, reason="needs root and a cgroup block-I/O controller")


def _groups():
    root = V1_ROOT if throttle_support() == "v1" else V2_ROOT
    return sorted(p.name for p in root.glob(f"{PREFIX}*"))


def _timed_direct_write(path, nbytes, block=4 * MiB):
    """Seconds to write nbytes with O_DIRECT (page-aligned buffer from mmap)."""
    import mmap

    buf = mmap.mmap(-1, block)
    buf.write(os.urandom(block))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        t = time.perf_counter()
        for off in range(0, nbytes, block):
            os.pwritev(fd, [buf], off)
        os.fdatasync(fd)
        return time.perf_counter() - t
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.mark.timing
@needs_throttle
def test_a_write_runs_at_the_post_cache_rate_once_the_cache_is_full(tmp_path):
    from flashstream.emulation import DriveEmulator

    s = DriveSettings(cache_size=32 * MiB, post_cache_rate=40e6, fast_rate=400e6)
    before = _groups()
    with DriveEmulator(tmp_path, s) as emu:
        emu.add_thread()
        _timed_direct_write(tmp_path / "fill", 96 * MiB)  # fills the cache: in the cliff
        seconds = _timed_direct_write(tmp_path / "cliff", 48 * MiB)
        summary = emu.summary()
    rate = 48 * MiB / seconds
    # The throttle, not the drive, sets the pace: within 25% of 40 MB/s (the kernel's slices).
    assert 0.75 * 40e6 < rate < 1.25 * 40e6, rate
    assert summary["cliff_seconds"] > 0.5
    assert _groups() == before  # the group is gone, the thread is back


@needs_throttle
def test_a_write_at_full_speed_reads_its_cliff_where_the_cache_is_full(tmp_path):
    """The writer's bytes, not the emulator's flag, place the cliff: an unpaced write from an
    empty cache runs fast until the cache holds ``cache_size`` (plus what folded meanwhile),
    however the throttle releases its bursts. With the limit rewritten only at the full
    cache, each write ran fast for a burst (``post_cache_rate`` x the kernel's slice) and a
    reaction beyond it, and read the cache 7-11% large here (34-114 MB on 1 GiB emulated
    caches): a save paced to that cache met its cliff unseen."""
    from flashstream.checkpoint.cliff_watch import bytes_at
    from flashstream.checkpoint.drive_probe import _write, find_cliff
    from flashstream.emulation import DriveEmulator

    s = DriveSettings(cache_size=256 * MiB, post_cache_rate=180e6, drain_rate=120e6,
                      fast_rate=400e6)
    os.sync()
    readings = []
    with DriveEmulator(tmp_path, s) as drive:
        drive.add_process()
        for _ in range(2):
            time.sleep(1.2 * s.cache_size / s.drain_rate)  # folded empty
            looks, _, _ = _write(tmp_path, int(2.5 * s.cache_size))
            cliff = find_cliff(looks)
            assert cliff is not None, looks
            at = cliff[0]
            readings.append((bytes_at(looks, at) - s.drain_rate * at) / s.cache_size)
    assert all(0.96 <= r <= 1.04 for r in readings), readings


@needs_throttle
def test_the_group_is_removed_after_a_failing_run(tmp_path):
    from flashstream.emulation import DriveEmulator

    s = DriveSettings(cache_size=32 * MiB, post_cache_rate=40e6)
    before = _groups()
    with pytest.raises(RuntimeError, match="boom"), DriveEmulator(tmp_path, s) as emu:
        emu.add_process()
        assert len(_groups()) == len(before) + 1
        raise RuntimeError("boom")
    assert _groups() == before
    own = Path(f"/proc/{os.getpid()}/cgroup").read_text()
    assert PREFIX not in own


@needs_throttle
def test_run_places_a_command_under_the_emulator_and_returns_its_status(tmp_path):
    from flashstream.emulation import DriveEmulator

    s = DriveSettings(cache_size=32 * MiB, post_cache_rate=40e6)
    with DriveEmulator(tmp_path, s) as emu:
        status = emu.run([sys.executable, "-c",
                          "import sys; sys.exit(0 if 'flashstream-emu-' in "
                          "open('/proc/self/cgroup').read() else 3)"])
        assert status == 0
        assert emu.run([sys.executable, "-c", "raise SystemExit(5)"]) == 5


@needs_throttle
def test_what_is_learned_under_the_emulator_is_kept_apart_from_the_real_drive(tmp_path):
    """A write model (or probe result) learned through the emulator describes the emulation:
    it goes to a directory of the emulated drive's own, in this process and in a command
    run under it, and the real drive's stays where it was."""
    from flashstream.emulation import DriveEmulator
    from flashstream.telemetry.drive_model import model_path
    from flashstream.telemetry.probe import EMULATED_DRIVE_ENV

    real = model_path(tmp_path)
    assert EMULATED_DRIVE_ENV not in os.environ
    with DriveEmulator(tmp_path, DriveSettings(cache_size=32 * MiB,
                                               post_cache_rate=40e6)) as emu:
        assert model_path(tmp_path) == real  # not placed under it yet
        emu.add_process()
        emulated = model_path(tmp_path)
        assert emulated != real and emulated.parent.name == f"emulated-{emu.tag}"
        code = (f"import os, sys; sys.exit(0 if os.environ.get({EMULATED_DRIVE_ENV!r}) == "
                f"{emu.tag!r} else 3)")
        assert emu.run([sys.executable, "-c", code]) == 0
    assert EMULATED_DRIVE_ENV not in os.environ and model_path(tmp_path) == real


def test_the_cache_directory_of_an_emulated_drive_is_its_own(monkeypatch, tmp_path):
    from flashstream.telemetry.probe import EMULATED_DRIVE_ENV, default_cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(EMULATED_DRIVE_ENV, raising=False)
    real = default_cache_dir()
    monkeypatch.setenv(EMULATED_DRIVE_ENV, "vda-0123/../x")
    assert default_cache_dir() == real / "emulated-vda-0123_.._x"


@needs_throttle
def test_a_killed_emulator_leaves_nothing_behind(tmp_path):
    """A group whose owner died (SIGKILL: no cleanup ran) is removed by the next emulator."""
    code = ("import time, sys; from flashstream.emulation import DriveEmulator, DriveSettings;"
            f"e = DriveEmulator({str(tmp_path)!r}, DriveSettings(cache_size='32MiB', "
            "post_cache_rate='40MB')).start(); print('up', flush=True); time.sleep(60)")
    # The child imports the flashstream these tests import (not the source tree's, unbuilt).
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=child_env(), cwd=tmp_path)
    assert proc.stdout.readline().strip() == "up"
    proc.kill()
    proc.wait()
    from flashstream.emulation import DriveEmulator

    stale = [g for g in _groups() if g.startswith(f"{PREFIX}{proc.pid}-")]
    assert stale
    with DriveEmulator(tmp_path, DriveSettings(cache_size=32 * MiB, post_cache_rate=40e6)):
        assert not [g for g in _groups() if g.startswith(f"{PREFIX}{proc.pid}-")]


def test_without_a_throttle_it_raises_a_clear_error(tmp_path, monkeypatch):
    from flashstream.emulation import cgroup

    monkeypatch.setattr(cgroup, "throttle_support", lambda *a, **k: None)
    with pytest.raises(cgroup.ThrottleUnavailable, match="needs root"):
        cgroup.ThrottleGroup("254:0")


def test_v2_limits_are_written_as_io_max(tmp_path):
    """cgroup v2's file protocol, against a fake cgroupfs (this machine runs v1)."""
    from flashstream.emulation.cgroup import ThrottleGroup

    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu io memory\n")
    (root / "cgroup.subtree_control").write_text("")
    group = ThrottleGroup("259:0", v1_root=tmp_path / "none", v2_root=root)
    assert group.version == "v2"
    group.set_limits(0, 100e6)
    assert (group.path / "io.max").read_text() == "259:0 rbps=max wbps=100000000"
    group.set_limits(5e6, 0)
    assert (group.path / "io.max").read_text() == "259:0 rbps=5000000 wbps=max"
    for f in group.path.iterdir():
        f.unlink()
    group.remove()
    assert not group.path.exists()
