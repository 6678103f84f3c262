"""checkpoint.py --emulate plc|qlc|random: repeated saves on an emulated dense drive.

Longer than the house's ~400 lines, for a reason: it is one run whose steps (the drive made
and its model learned, the wait for reads to settle, each writer through the schedule) share
one set of defaults and windows, kept and documented together (docs/benchmarks.md, "Figures
behind the defaults"). What owns a thing of its own lives beside it: the report and targets
(_emulated_report.py), the open-loop reader (_open_loop.py), fio at a pace (_fio_paced.py) and
the figure (_plot_emulated.py).

The drive under test is throttled into an SLC-cache drive (flashstream.emulation, scaled to
its own new-file write rate), its write model is learned as a user would
(``flashstream probe --sustained``) and compared with the emulator's settings, then each
writer runs the same schedule on a fresh (empty) emulated cache:

- the reader's baseline is measured in the same run, between the writer's saves: its
  *quiet* windows are the times no save is in progress (nor in its first
  ``QUIET_AFTER_SAVE_S``) and no training step runs, interleaved with the saves every gap.
  A host disk's read latency can drift more from one minute to the next than a paced writer
  changes it, so a baseline taken minutes apart (another writer's run) mostly measures the
  drift. Training steps are left out on both sides: an ``add_`` over every tensor on every
  core delays the reader's threads as much as a disk write does, and the schedule never runs
  one during a save (docs/benchmarks.md, "Figures behind the defaults");
- ``none`` first: the same schedule and training steps with no writer at all, the cross-run
  reference (its quiet p95 is what the others' p95 while writing is also compared with);
  it starts once reads are back to their speed before the probe (``settle``);
- idle windows: only the reader runs, before the first save and again after the last one
  (once the drive has settled); they are part of the quiet windows;
- ``--saves`` saves of a state dict larger than the cache (default 1.2 x the size at which an
  unpaced save starts to meet the cliff), one due every
  ``--gap`` seconds (default: so the saves average 85% of the rate the cache drains at), each
  with its deadline ``--within`` seconds after it is due (default 0.8 x the gap);
- an open-loop reader beside it all (250 random 128 KiB O_DIRECT reads/s, latency from each
  read's scheduled time; benchmarks/_open_loop.py) under the same emulated drive.

Writers: ``unpaced``; ``fixed`` at the drive's post-cache rate, the "sustained write" a spec
sheet gives (or ``--rate``); ``auto`` (rate="auto", within=the deadline); ``auto+read_slo``
(the same with read_slo = 1.2 x the median quiet p95 of the runs before it); ``fio-paced``:
fio writing as many bytes per save as auto's saves did, at the pace auto averaged
(benchmarks/_fio_paced.py), so what auto costs the reader is set against what a plain write at
that pace costs it on this drive, in the same run. Per writer: seconds in the
cliff (per save), each save's completion against its deadline, the reader's p95/p99 while
saves are written against the same run's quiet windows (the targets), each save's against the
quiet windows next to it (their median), and against the no-writer run; JSON, a table, the
targets (_emulated_report.py), and a plot over time of cache fill, write rate and reader
latency (benchmarks/_plot_emulated.py).

The model lives in a cache directory of the benchmark's own, so the emulated drive never
replaces what ``flashstream probe`` learned of the real one.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import _bench
import _fio_paced
import _open_loop
import _plot_emulated
import _training
from _emulated_report import (
    BASELINE,
    FIO,
    against_fio,
    baseline_p95,
    check_targets,
    complement,
    per_save,
    phases,
    print_against_fio,
    slo_reference,
    table,
)
from _open_loop import latency_summary, read_calls
from tqdm import tqdm

from flashstream import CheckpointWriter
from flashstream.checkpoint.drive_probe import measure_sustained
from flashstream.emulation import (
    RANDOM_RANGES,
    DriveEmulator,
    DriveSettings,
    profile_settings,
    random_settings,
)
from flashstream.sizes import format_size, parse_size
from flashstream.telemetry import drive_model
from flashstream.telemetry.fio import fio_available

# In this order: none is the SLO's baseline, fio-paced takes auto's pace.
MODES = ("none", "unpaced", "fixed", "auto", "auto+read_slo", "fio-paced")
IDLE_S = 4.0           # the reader alone before each writer's first save, and after its last
SETTLE_S = 2.0         # after the last save, before the second idle window (writeback, folding)
WARMUP_S = 0.5         # the reader's first reads (threads starting) are left out
QUIET_AFTER_SAVE_S = 0.5  # after a save ends, before the reader's windows count as quiet
# Default save size: this many times the size at which an unpaced save starts to meet the
# cliff, cache / (1 - drain / fast rate) (the header prints it per profile).
SAVE_OVER_CLIFF = 1.2
DRAIN_SHARE = 0.85     # default gap: saves average this share of the cache's drain rate
# Default deadline: this share of the gap after a save is due. A flat pace that meets it then
# ends with the cache about half full, inside the planned (cliff-free) regime with room for
# the host disk's noise; a tighter share pushes a schedule onto the headroom, where saves take
# the documented conflict policy (unpaced while the headroom lasts), which is another test.
# The fixed writer at the post-cache rate still misses it (docs/emulation.md).
WITHIN_SHARE = 0.8
SLO_SHARE = 1.2        # auto+read_slo: the SLO is this many times the quiet p95 (slo_reference)
# After the probe (several caches written, then deleted) the host disk can hold reads for
# seconds at a time while it catches up, which would poison the no-writer baseline: the runs
# start once reads are back to their speed before the probe (p95 within SETTLE_SHARE x, or
# SETTLE_MARGIN_S more, in two 1 s samples running).
SETTLE_SHARE = 2.0
SETTLE_MARGIN_S = 0.5e-3
SETTLE_TIMEOUT_S = 120.0
LEARN_OVER_CACHE = 4.0  # the sustained probe's first write, in cache sizes


@dataclasses.dataclass(frozen=True)
class Schedule:
    save_size: int  # tensor bytes of the state dict
    gap: float      # seconds between saves' due times
    within: float   # each save's deadline, seconds after it is due
    saves: int

    @classmethod
    def for_drive(cls, settings: DriveSettings, args) -> Schedule:
        size = int(parse_size(args.emulate_size, name="--size")) if args.emulate_size else int(
            SAVE_OVER_CLIFF * unpaced_cliff_size(settings))
        gap = args.gap or size / (DRAIN_SHARE * settings.drain_rate)
        return cls(size, gap, args.within or WITHIN_SHARE * gap, args.saves)


def unpaced_cliff_size(settings: DriveSettings) -> float:
    """Bytes an unpaced write from an empty cache takes before the cliff (it drains while
    it fills)."""
    fast = settings.fast_rate or math.inf
    return settings.cache_size / (1 - settings.drain_rate / fast)


# -- the run ------------------------------------------------------------------------------------
def run(args) -> int:
    root = args.dir / f"emulated-{args.emulate}"
    root.mkdir(parents=True, exist_ok=True)
    info = _bench.environment(args.dir)
    write_rate = drive_model.remembered_write_rate(args.dir)  # the real drive's (its own cache)
    # From here on the write model is the emulated drive's: a cache directory of its own.
    os.environ["XDG_CACHE_HOME"] = str(root / "model-cache")
    shutil.rmtree(root / "model-cache", ignore_errors=True)
    settings = drive_settings(args, write_rate)
    schedule = Schedule.for_drive(settings, args)
    _bench.print_header(info)
    drawn = (f" (drawn from {RANDOM_RANGES} with --seed {args.seed})"
             if args.emulate == "random" else "")
    print(f"emulated {args.emulate} drive{drawn}: {settings.describe()}")
    print(f"schedule: {args.saves} saves of {format_size(schedule.save_size)} every "
          f"{schedule.gap:.1f} s, each due done {schedule.within:.1f} s after it is due")
    with tqdm(desc="building the state dict", total=1, leave=False, disable=None) as bar:
        state = _training.TrainingState(schedule.save_size)
        bar.update(1)
    reader_file = _open_loop.make_file(root / "reader.bin", parse_size(args.reader_file_size))
    block = parse_size(args.reader_block)
    before_probe = _open_loop.sample_p95(reader_file, block, seconds=2.0)
    learned = learn(args.dir, settings)
    print(learned["describe"])
    settled = settle(reader_file, block, before_probe)
    print(settled["describe"])
    fixed_rate = float(args.rate) if args.rate else settings.post_cache_rate
    if FIO in args.modes and not fio_available():
        print(f"fio is not installed: no {FIO} reference (apt-get install -y fio)")
        args.modes = [m for m in args.modes if m != FIO]
    idle_p95: Optional[float] = None
    modes: Dict[str, Dict[str, object]] = {}
    for mode in args.modes:
        slo = None
        if mode == "auto+read_slo":
            slo = SLO_SHARE * (slo_reference(modes) or idle_p95
                               or measure_idle(args, settings, reader_file))
        modes[mode] = run_mode(mode, state, settings, schedule, reader_file, args,
                               fixed_rate=fixed_rate, read_slo=slo,
                               pace=fio_pace(modes, schedule))
        idle_p95 = idle_p95 or modes[mode]["reader"]["idle"]["p95_s"]
    table(modes, schedule)
    reference = against_fio(modes)
    print_against_fio(reference)
    verdicts = check_targets(modes, learned)
    _bench.print_verdicts(verdicts)
    payload = {"environment": info, "emulated": args.emulate, "seed": args.seed,
               "settings": settings.to_dict(),
               "schedule": dataclasses.asdict(schedule), "fixed_rate": fixed_rate,
               "model": learned, "settle": settled, "modes": modes, "targets": verdicts,
               "against_fio": reference,
               "reader_baseline_p95_s": baseline_p95(modes)}
    _bench.write_outputs(payload, args.json, _plot_emulated.plot, args.plot)
    return 0


def drive_settings(args, write_rate: float) -> DriveSettings:
    """The emulated drive: a profile, or with ``--emulate random`` one drawn (``--seed``) from
    RANDOM_RANGES; both scaled to the real drive's write rate."""
    if args.emulate == "random":
        settings = random_settings(write_rate, random.Random(args.seed))
        if args.cache_size:
            settings = dataclasses.replace(settings, cache_size=args.cache_size)
        return settings
    overrides = {"cache_size": args.cache_size} if args.cache_size else {}
    return profile_settings(args.emulate, write_rate, **overrides)


def learn(directory: Path, settings: DriveSettings) -> Dict[str, object]:
    """The write model as ``flashstream probe --sustained`` learns it, on a fresh emulated
    drive, and its errors against the emulator's settings."""
    # Long enough to meet the cliff while the host disk is slow: from an empty cache a write at
    # w meets it after cache x w / (w - drain), which grows as w falls towards the drain.
    size = int(LEARN_OVER_CACHE * settings.cache_size)
    with DriveEmulator(directory, settings) as drive, tqdm(
            desc="learning the write model", total=3, leave=False, disable=None) as bar:
        drive.add_process()
        model = measure_sustained(directory, size,
                                   progress=lambda _m: bar.update(1))
    errors = {
        "cache_size": model.cache_size / settings.cache_size - 1 if model.cache_size else None,
        "post_cache_rate": (model.post_cache_rate / settings.post_cache_rate - 1
                            if model.post_cache_rate else None),
        "recovery_rate": (model.drain / settings.drain_rate - 1
                          if model.drain else None)}
    described = model.describe() + "\n  against the emulator: " + ", ".join(
        f"{k} {v:+.1%}" for k, v in errors.items() if v is not None)
    return {"cache_size": model.cache_size, "post_cache_rate": model.post_cache_rate,
            "recovery_rate": model.drain, "fast_rate": model.fast_rate,
            "errors": errors, "describe": described}


def settle(reader_file: Path, block: int, before: float) -> Dict[str, object]:
    """Waits until reads are back to their p95 before the probe (see SETTLE_SHARE)."""
    bound = max(SETTLE_SHARE * before, before + SETTLE_MARGIN_S)
    began, streak, samples = time.perf_counter(), 0, []
    with tqdm(desc="waiting for the drive to settle after the probe", leave=False,
              disable=None, unit="s") as bar:
        while streak < 2 and time.perf_counter() - began < SETTLE_TIMEOUT_S:
            samples.append(_open_loop.sample_p95(reader_file, block))
            streak = streak + 1 if samples[-1] <= bound else 0
            bar.update(1)
    waited = time.perf_counter() - began
    ok = streak >= 2
    describe = (f"after the probe: reads' p95 {samples[-1] * 1e3:.2f} ms (before it "
                f"{before * 1e3:.2f} ms); " + (f"settled in {waited:.0f} s" if ok else
                f"NOT settled in {waited:.0f} s: the first runs may meet the drive's stalls"))
    return {"before_p95_s": before, "samples_p95_s": samples, "waited_s": waited,
            "settled": ok, "describe": describe}


def measure_idle(args, settings: DriveSettings, reader_file: Path) -> float:
    """The reader's idle p95 (seconds) on the emulated drive, no writer."""
    with DriveEmulator(args.dir, settings) as drive:
        reader = _reader(args, reader_file, drive)
        begin = time.perf_counter()
        time.sleep(IDLE_S)
        reads = reader.stop()
    return latency_summary(reads, begin + WARMUP_S, begin + IDLE_S)["p95_s"]


def _reader(args, reader_file: Path, drive: DriveEmulator) -> _open_loop.OpenLoopReader:
    reader = _open_loop.OpenLoopReader(
        reader_file, rate=args.reader_rate, block=parse_size(args.reader_block),
        out=reader_file.with_suffix(".reads.json"))
    drive.add_process(reader.start())
    return reader


@dataclasses.dataclass(frozen=True)
class FioPace:
    """What fio-paced writes per save, and how fast."""

    rate: float   # bytes/s
    nbytes: int   # per save
    source: str   # "auto": auto's saves in this run; "deadline": the flat deadline pace


def fio_pace(modes: Dict[str, Dict[str, object]], schedule: Schedule) -> FioPace:
    """fio-paced's pace: the bytes auto's saves wrote over the seconds they took to write them,
    and their mean size; without auto in the run, the state dict's bytes at the flat pace that
    just meets the deadline."""
    saves = modes.get("auto", {}).get("saves") or []
    written, seconds = sum(s["bytes"] for s in saves), sum(s["write_s"] for s in saves)
    if written and seconds:
        return FioPace(written / seconds, round(written / len(saves)), "auto")
    return FioPace(schedule.save_size / schedule.within, schedule.save_size, "deadline")


def _writer_kwargs(mode: str, schedule: Schedule, fixed_rate: float,
                   read_slo: Optional[float], pace: Optional[FioPace] = None
                   ) -> Dict[str, object]:
    if mode == BASELINE:
        return {}
    if mode == FIO:
        return {"fio": dataclasses.asdict(pace)}
    if mode == "unpaced":
        return {"rate": None}
    if mode == "fixed":
        return {"rate": fixed_rate}
    kw: Dict[str, object] = {"rate": "auto", "within": schedule.within}
    if mode == "auto+read_slo":
        kw["read_slo"] = read_slo
    return kw


def run_mode(mode: str, state: _training.TrainingState, settings: DriveSettings,
             schedule: Schedule, reader_file: Path, args, *, fixed_rate: float,
             read_slo: Optional[float], pace: FioPace) -> Dict[str, object]:
    """One writer through the schedule on a fresh emulated drive, the reader beside it
    (``none``: the schedule's training steps alone)."""
    directory = args.dir / f"emulated-{args.emulate}" / mode.replace("+", "-")
    shutil.rmtree(directory, ignore_errors=True)
    writer = None if mode in (BASELINE, FIO) else CheckpointWriter(
        directory, keep=1, chunk_size=args.chunk_size, queue_depth=args.queue_depth,
        snapshot=args.snapshot, **_writer_kwargs(mode, schedule, fixed_rate, read_slo))
    if mode == FIO:
        directory.mkdir(parents=True)
    saves: List[Dict[str, object]] = []
    steps: List[Tuple[float, float]] = []  # the training steps' (start, end)
    warmup = None
    try:
        with DriveEmulator(args.dir, settings) as drive, tqdm(
                desc=mode, total=schedule.saves + 1, unit="save", leave=False,
                disable=None) as bar:
            drive.add_process()
            fio = None if mode != FIO else _fio_paced.FioPacedWriter(
                directory, pace.nbytes, pace.rate, drive, args.queue_depth)
            # A writer's first save faults its staging memory in (seconds, nothing to do with
            # pacing): it runs first, unscheduled, and the schedule starts once the emulated
            # cache has drained again (the write model follows the fill on its own).
            if writer is not None:
                warmup = writer.save(state.state, step=0).result()
                _wait_drained(drive, settings)
            bar.update(1)
            reader = _reader(args, reader_file, drive)
            begin = time.perf_counter()
            first_due = begin + IDLE_S
            try:
                for i in range(schedule.saves):
                    due = first_due + i * schedule.gap
                    stepped = time.perf_counter()
                    state.mutate()  # the training step before the save
                    steps.append((stepped, time.perf_counter()))
                    time.sleep(max(0.0, due - time.perf_counter()))
                    if writer is not None or fio is not None:
                        called = time.perf_counter()
                        report = (fio.save(i + 1) if fio is not None
                                  else writer.save(state.state, step=i + 1).result())
                        saves.append(_save_row(report, due, called, time.perf_counter(),
                                               schedule, drive))
                    bar.update(1)
                end = first_due + schedule.saves * schedule.gap
                time.sleep(max(0.0, end - time.perf_counter()))
                after = max(end, time.perf_counter()) + SETTLE_S
                time.sleep(max(0.0, after + IDLE_S - time.perf_counter()))
            finally:
                reads = reader.stop()
    finally:
        if writer is not None:
            writer.close()
        shutil.rmtree(directory, ignore_errors=True)
    zero = drive.started
    busy_end = max([end] + [s["done_s"] + zero for s in saves])
    writing = [(s["called_s"] + zero, s["done_s"] + zero) for s in saves]
    saving = [t for span in writing for t in span]  # flat bounds, as latency_summary takes
    calls = read_calls(reads)
    quiet = complement(begin + WARMUP_S, after + IDLE_S,
                        [(a, b + QUIET_AFTER_SAVE_S) for a, b in writing] + steps
                        + [(busy_end, after)])
    return {
        "writer": _writer_kwargs(mode, schedule, fixed_rate, read_slo, pace),
        "warmup": None if warmup is None else {
            "stall_s": warmup.stall_s, "write_s": warmup.write_s, "pacing": warmup.pacing},
        "saves": saves,
        "cliff_seconds": drive.cliff_seconds(first_due - zero, end - zero),
        "reader": {"idle": latency_summary(reads, begin + WARMUP_S, first_due,
                                           after, after + IDLE_S),
                   "idle_before": latency_summary(reads, begin + WARMUP_S, first_due),
                   "idle_after": latency_summary(reads, after, after + IDLE_S),
                   "writing": latency_summary(reads, *saving),
                   # The first scheduled save writes a new file: nothing was pruned before
                   # it. From the second on, each writes over a recycled one (recycle=True).
                   "writing_later": latency_summary(
                       reads, *[t for span in writing[1:] for t in span]),
                   "quiet": latency_summary(reads, *quiet),
                   # The read call alone (without the wait before it): the drive's share.
                   "read_calls": {"quiet": latency_summary(calls, *quiet),
                                  "writing": latency_summary(calls, *saving)},
                   "per_save": per_save(reads, writing, quiet),
                   "phases": phases(reads, saves, zero, first_due, busy_end)},
        "timeline": [[round(p.seconds, 3), p.fill, p.cliff, p.write_rate, p.read_rate]
                     for p in drive.timeline],
        "training_steps": [[round(a - zero, 3), round(b - zero, 3)] for a, b in steps],
        "reads": [[round(d - zero, 4), round(lat, 6), round(waited, 6)]
                  for d, lat, waited in reads],
        "zero": zero,
    }


def _wait_drained(drive: DriveEmulator, settings: DriveSettings) -> None:
    """Until the emulated cache is empty (at most twice its drain time)."""
    deadline = time.perf_counter() + 2 * settings.cache_size / settings.drain_rate + 1
    while time.perf_counter() < deadline:
        time.sleep(0.1)
        if drive.timeline and drive.timeline[-1].fill == 0:
            return


def _save_row(report, due: float, called: float, returned: float, schedule: Schedule,
              drive: DriveEmulator) -> Dict[str, object]:
    zero = drive.started
    done = returned - due
    return {"step": report.step, "due_s": due - zero, "called_s": called - zero,
            "done_s": returned - zero, "completion_s": done, "deadline_s": schedule.within,
            "met": done <= schedule.within, "stall_s": report.stall_s, "bytes": report.bytes,
            "write_start_s": report.write_start_s,
            "write_s": report.write_s, "gbps": report.bytes / max(report.write_s, 1e-9) / 1e9,
            "cliff_seconds": drive.cliff_seconds(due - zero, due - zero + schedule.gap),
            "pacing": report.pacing,
            "emulated_fill_at_end": drive.timeline[-1].fill if drive.timeline else None,
            "write_timeline": [[round(t, 3), b, p] for t, b, p in report.timeline]}
