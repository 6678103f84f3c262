"""A drive's write model, learned and remembered: how fast it writes a new file, how many bytes
its write cache takes before the cliff, how fast it writes in the cliff, and how fast the cache
recovers while idle.

It is learned from ``flashstream probe --sustained`` (two sustained writes with an idle gap
between them) and refreshed by every checkpoint save from the save's own per-interval timings.
One JSON file per device lives beside the probe cache; ``flashstream probe`` shows it, and
``CheckpointWriter(rate="auto")`` plans its saves from it (checkpoint/pacing.py).

Writes are measured as checkpoints make them: into a new, preallocated file (a rewrite of an
existing file skips block allocation and reads faster than the checkpoint will write).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple, Union

from ..sizes import Size, format_size, parse_size
from .device import device_of
from .probe import default_cache_dir, device_ident, measure, new_file_write, preallocated_file

__all__ = ["Cliff", "WriteModel", "drained", "drive_write_rate", "find_cliff",
           "learn_from_save", "learn_sustained", "load_model", "model_path", "new_file_write"]

MODEL_VERSION = 1
# (end of interval s, bytes completed in it, pacing rate in force, 0 = unpaced)
Timeline = Sequence[Tuple[float, float, float]]


def drained(fill: float, rate: float, seconds: float) -> float:
    """Bytes left in a write cache holding ``fill`` after folding at ``rate`` for
    ``seconds`` (the one arithmetic the model, the planner and the emulator share)."""
    return max(0.0, fill - rate * max(0.0, seconds))


@dataclasses.dataclass
class WriteModel:
    """What is known of one drive's writes; None where not yet measured."""

    device: str
    fast_rate: Optional[float] = None        # bytes/s into a new file, cache not full
    cache_size: Optional[float] = None       # bytes the write cache holds
    post_cache_rate: Optional[float] = None  # bytes/s once it is full
    drain_rate: Optional[float] = None       # bytes/s it recovers (None: assume post_cache_rate)
    cliff_free: float = 0.0                  # the most bytes seen written without a cliff
    fill: float = 0.0                        # estimated bytes in the cache at fill_time
    fill_time: float = 0.0                   # time.time() of that estimate
    observations: int = 0
    updated: float = 0.0
    sources: List[str] = dataclasses.field(default_factory=list)
    path: Optional[str] = dataclasses.field(default=None, compare=False)

    @property
    def has_cliff(self) -> bool:
        return self.cache_size is not None and self.post_cache_rate is not None

    @property
    def recovery_rate(self) -> Optional[float]:
        """Bytes/s the cache drains: measured, else assumed equal to the post-cache rate."""
        return self.drain_rate if self.drain_rate is not None else self.post_cache_rate

    def fill_at(self, when: Optional[float] = None, written: float = 0.0) -> float:
        """Estimated bytes in the cache at ``when`` (default now): the last estimate, drained
        at the recovery rate since. ``written``: bytes the drive took since that estimate from
        anything else (other processes, this one's smaller writes). Spread evenly over the
        time since, they fill the cache as a slower drain would, which ends where adding them
        to the estimate and then draining does (until the cache fills: capped at its size)."""
        if not self.has_cliff or not (self.fill or written):
            return 0.0
        now = time.time() if when is None else when
        fill = drained(self.fill + max(0.0, written), self.recovery_rate or 0.0,
                       now - self.fill_time)
        return min(fill, float(self.cache_size))

    def set_fill(self, fill: float, when: Optional[float] = None) -> None:
        cap = self.cache_size if self.cache_size is not None else fill
        self.fill = min(max(0.0, fill), cap)
        self.fill_time = time.time() if when is None else when

    def save(self) -> None:
        """Writes the model to its file atomically (a no-op for a model without a file)."""
        if not self.path:
            return
        self.updated = time.time()
        target = Path(self.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        data = {k: v for k, v in dataclasses.asdict(self).items() if k != "path"}
        data["version"] = MODEL_VERSION
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, target)

    def describe(self) -> str:
        def rate(v: Optional[float]) -> str:
            return f"{v / 1e9:.3f} GB/s" if v else "not measured"

        lines = [f"write model of {self.device} ({self.observations} observations: "
                 f"{', '.join(sorted(set(self.sources))) or 'none'})",
                 f"  new-file write     {rate(self.fast_rate)}"]
        if self.has_cliff:
            assumed = "" if self.drain_rate is not None else " (assumed: the post-cache rate)"
            lines += [f"  write cache        {format_size(int(self.cache_size))}",
                      f"  in the cliff       {rate(self.post_cache_rate)}",
                      f"  recovery           {rate(self.recovery_rate)}{assumed}",
                      f"  cache fill now     {format_size(int(self.fill_at()))} (estimate)"]
        else:
            seen = format_size(int(self.cliff_free)) if self.cliff_free else "nothing yet"
            lines.append(f"  write cliff        none seen (largest write watched: {seen})")
        return "\n".join(lines)


def model_path(path: Union[str, os.PathLike], cache_dir: Optional[Path] = None) -> Path:
    """Where the write model of the drive that holds ``path`` is kept."""
    ident = device_ident(device_of(path, health=False).to_dict())
    return Path(cache_dir or default_cache_dir()) / f"write-model-{ident}.json"


def load_model(path: Union[str, os.PathLike], cache_dir: Optional[Path] = None) -> WriteModel:
    """The remembered write model of the drive that holds ``path`` (an empty one if none)."""
    target = model_path(path, cache_dir)
    try:
        data = json.loads(target.read_text())
        if data.pop("version", None) != MODEL_VERSION:
            raise ValueError("old version")
        fields = {f.name for f in dataclasses.fields(WriteModel)}
        model = WriteModel(**{k: v for k, v in data.items() if k in fields})
    except (OSError, ValueError, TypeError):
        model = WriteModel(device=target.stem[len("write-model-"):])
    model.path = str(target)
    return model


# -- measuring ------------------------------------------------------------------------------
def drive_write_rate(path: Union[str, os.PathLike], cache_dir: Optional[Path] = None) -> float:
    """The drive's new-file write bytes/s: remembered, else measured (a 1 GiB write, at most
    3 s) and remembered."""
    model = load_model(path, cache_dir)
    if not model.fast_rate:
        point = new_file_write(path, "1GiB", seconds=3.0)
        model.fast_rate = point.bytes / point.seconds
        model.sources.append("write")
        model.observations += 1
        model.save()
    return float(model.fast_rate)


# -- reading a cliff off a timeline ------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Cliff:
    seconds: float             # when the drop began, since the write started
    bytes_before: float        # bytes completed before it
    rate: Optional[float]      # median bytes/s in the cliff where the drive, not the pacer,
    #                            set the pace (None: the pacer held it below the drive)
    fast_rate: Optional[float]  # median unpaced bytes/s before it (None: paced throughout)


def _intervals(timeline: Timeline):
    out, start = [], 0.0
    for end, nbytes, pace in timeline:
        if end > start:
            out.append((start, float(end), float(nbytes) / (end - start), float(pace)))
        start = float(end)
    return out[:-1] if len(out) > 2 else out  # the last one is the queue draining


# find_cliff(unpaced=True): back at this share of the peak is the drive writing from its cache
# again. Well above any post-cache rate (20-45% of fast in the documented range; plc 25%, qlc
# 38%), so a cliff's own noise does not pass for a comeback.
RECOVERED = 0.8


def find_cliff(timeline: Timeline, *, ratio: float = 0.5, hold: float = 0.5,
               warmup: float = 0.15, unpaced: bool = False) -> Optional[Cliff]:
    """The write cliff in a write's timeline: the first moment from which throughput stays
    (on average) below ``ratio`` x what was expected (the best ``warmup``-long stretch so far,
    or the pacing rate if lower) for ``hold`` seconds, and stays low on average after.

    ``unpaced``: the whole write ran unpaced and long past its cliff (the sustained probe's
    first write, 4 x the cache): a drive in its cliff then stays in it, but for what it folds
    while the disk stalls. A drop the write comes back from (to ``RECOVERED`` x its peak) is
    judged by :func:`_stall_end`; a stall before the cache was full is not the cliff (one read
    as the cliff put a 1.7 GiB cache at 447 MiB), and the search goes on after it. A paced
    save may leave its cliff once the pacer lets the cache drain: not for those."""
    rows = _intervals(timeline)
    if not rows:
        return None
    width = max(1e-6, statistics.median(r[1] - r[0] for r in rows))
    smooth = max(1, round(warmup / width))
    run = max(2, round(hold / width))
    peak, done = 0.0, 0.0
    floor = 0  # the stretch before the cliff starts here: after the last stall
    for i, (start, _end, bps, pace) in enumerate(rows):
        expected = min(peak, pace) if pace > 0 else peak
        window = rows[i:i + run]
        # The first interval low, and the next `hold` seconds low on average (single short
        # intervals hold whole requests, so they scatter around the true rate), each interval
        # against its own pace: a pacer that slows down is not a cliff. Not inside a stall
        # the write came back from (before `floor`).
        if (i >= floor and expected > 0 and len(window) == run and bps < ratio * expected
                and _mean_rate(window) < ratio * _allowed(window, peak)):
            back = _stall_end(rows, i, smooth, peak, ratio, done) if unpaced else None
            after = rows[i:]
            if back is not None:
                floor = back
            elif _mean_rate(after) < ratio * _allowed(after, peak):
                # Means, not medians: a 50 ms interval holds a few whole requests, so single
                # intervals' rates are quantized to multiples of request size / width.
                # The first `hold` seconds in the cliff still complete requests the drive took
                # before it (they were past the throttle, or in its cache): leave them out.
                free = [r for r in rows[i + run:] if r[3] <= 0 or r[3] > 1.2 * r[2]]
                before = [r for r in rows[floor:i] if r[3] <= 0]
                start, done = _refined(rows, i, run, start, done, floor)
                return Cliff(start, done, _mean_rate(free) if len(free) >= run else None,
                             _mean_rate(before) if before else None)
        if i + 1 >= smooth:
            peak = max(peak, statistics.fmean(r[2] for r in rows[i + 1 - smooth:i + 1]))
        done += bps * (rows[i][1] - start)
    return None


def _stall_end(rows, low: int, smooth: int, peak: float, ratio: float,
               done: float) -> Optional[int]:
    """Where an unpaced write low from interval ``low`` came back from a stall, or None if the
    drop is its cliff.

    In its cliff a drive writes at its post-cache rate on average: it writes faster only for
    the room it folded while written slower (after a stall), so from the drop to the end of
    its last fast stretch it writes no more than the post-cache rate allows. Before the cache
    is full it writes the room left besides, however many stalls come between. So: the
    bytes from the drop to the end of the write's last fast stretch, less the post-cache rate
    over that time, against a margin for noise (a quarter second at that rate, 3% of the
    bytes so far). The post-cache rate is the median interval of the write's second half (a
    stall there does not move it much)."""
    post = statistics.median(r[2] for r in rows[len(rows) // 2:])
    if post >= RECOVERED * peak:
        post = ratio * peak  # no cliff at the end: any comeback is one from a stall
    fast = RECOVERED * peak

    def fast_from(j: int) -> bool:  # a fast interval, and fast on average from it
        return rows[j][2] >= fast and statistics.fmean(r[2] for r in rows[j:j + smooth]) >= fast

    back = next((j for j in range(low + 1, len(rows) - smooth + 1) if fast_from(j)), None)
    if back is None:
        return None
    last = next(j for j in range(len(rows) - smooth, back - 1, -1) if fast_from(j))
    net = sum((r[2] - post) * (r[1] - r[0]) for r in rows[low:last + smooth])
    return back if net > max(0.25 * post, 0.03 * done) else None


def _refined(rows, i: int, run: int, start: float, done: float,
             floor: int = 0) -> Tuple[float, float]:
    """Where the cliff really began: the meeting point of two straight lines fitted to the
    bytes completed over time, one before the first low interval ``i`` (from ``floor``: after
    a stall) and one after the next ``run`` (the hold). A chance dip just before the cliff, or
    one slow interval too few, then moves the estimate by less than an interval instead of by
    the dip's distance (10% of a small cache). Falls back to ``(start, done)`` where the write
    stalled after the cliff (:func:`_stalled`), where either side is too short, or where the
    lines do not meet near ``i`` and after the before-line's first point (a stall inside the
    cliff lowers the line after it until the two met inside the stall before ``floor``, at a
    negative byte count)."""
    if _stalled(rows[i:]):
        return start, done
    points, total = [(0.0, 0.0)], 0.0
    for s, e, bps, _pace in rows:
        total += bps * (e - s)
        points.append((e, total))
    before, after = points[floor:i + 1], points[i + 1 + run:]
    if len(before) < 3 or len(after) < 3:
        after = points[i + 2:]  # a short write past its cliff: all of it but its first interval
        if len(before) < 3 or len(after) < 3:
            return start, done
    fast = statistics.linear_regression(*zip(*before))
    slow = statistics.linear_regression(*zip(*after))
    if fast.slope <= slow.slope:
        return start, done
    meet = (slow.intercept - fast.intercept) / (fast.slope - slow.slope)
    width = rows[min(i + run, len(rows) - 1)][1] - rows[i][0]
    at = fast.intercept + fast.slope * meet
    if not max(start - width, before[0][0]) <= meet <= start + width or at <= 0:
        return start, done
    return meet, at


# A stall in the cliff: this many seconds in a row below this share of the cliff's mean rate
# (time-weighted: the comeback after a stall pays it back, so the mean stays near the
# post-cache rate, where a median is 0 once most intervals are empty). Noise (10% per interval
# on the emulator) stays far above it, and the block-I/O throttle's gaps are shorter: in its
# cliff the emulated drive writes in bursts every 100 ms, with up to 60 ms of empty 20 ms
# intervals between them. A pacer holding a save far below the drive (read_slo at its floor)
# for this long counts as one too; the first slow interval then stands, which costs at most
# the chance dip the refinement corrects.
STALL_SHARE = 0.25
STALL_S = 0.2


def _stalled(rows) -> bool:
    """Whether the write stalled in ``rows`` (those from the cliff on): the drive held it while
    it folded, then wrote faster for what it folded. The line fitted after the cliff then runs
    through both and meets the line before it away from the cliff (simulated 0.3-1.2 s
    stalls: a mean error of 110 ms against 23 ms for the first slow interval)."""
    typical = _mean_rate(rows)
    low = 0.0
    for start, end, bps, _pace in rows:
        low = low + (end - start) if bps < STALL_SHARE * typical else 0.0
        if low >= STALL_S * (1 - 1e-6):
            return True
    return False


def _allowed(rows, peak: float) -> float:
    """The mean bytes/s the pacing allowed over ``rows``: each interval's pace, or ``peak``
    where it was unpaced (or paced above it)."""
    seconds = sum(r[1] - r[0] for r in rows)
    allowed = sum((min(peak, r[3]) if r[3] > 0 else peak) * (r[1] - r[0]) for r in rows)
    return allowed / seconds if seconds > 0 else 0.0


def _mean_rate(rows) -> float:
    seconds = sum(r[1] - r[0] for r in rows)
    return sum(r[2] * (r[1] - r[0]) for r in rows) / seconds if seconds > 0 else 0.0


def _point_timeline(point) -> List[Tuple[float, float, float]]:
    """A ProbePoint's (end, GB/s) timeline as (end, bytes, unpaced)."""
    out, start = [], 0.0
    for end, gbps in point.timeline:
        out.append((end, gbps * 1e9 * (end - start), 0.0))
        start = end
    return out


# -- learning ---------------------------------------------------------------------------------
# The sustained probe's request shape: small requests and a fine timeline, so that what is in
# flight when the cliff comes (and counts as written before it) stays small beside the cache.
_SHAPE = {"block_size": "1MiB", "queue_depth": 8, "interval": 0.02}


_MAX_IDLE = 15.0  # seconds: the longest idle gap before a refill


def learn_sustained(directory: Union[str, os.PathLike], size: Size, *,
                    idle: Optional[float] = None, cache_dir: Optional[Path] = None,
                    progress: Callable[[str], None] = lambda _m: None) -> WriteModel:
    """Learns the drive's write model with sustained new-file writes.

    The first writes ``size`` bytes unpaced: its speed before a cliff is the new-file rate, its
    speed well after it the post-cache rate. Two more writes follow, each after an idle gap
    (``idle`` seconds, default a fifth of the cache's drain time at the post-cache rate, at
    most 15 s; then 3 x ``idle`` longer than the gap that gave the first reading) on a cache
    the previous write left full (a refill slow from its start found the drive still folding:
    it is repeated after twice the gap): each takes
    ``drain_rate x (gap + its time to the cliff)`` bytes before its cliff, plus the same
    detection lag, so the difference of the two gives the recovery rate, and with it the cache
    size (the first write's bytes before its cliff, less what drained meanwhile).
    Without a cliff in the first write the model records that ``size`` bytes went without
    one. Assumes the cache is empty when it starts.
    """
    nbytes = parse_size(size, name="size")
    model = load_model(directory, cache_dir)
    progress(f"sustained write of {format_size(nbytes)}")
    first, _, ended = _timed_write(directory, nbytes)
    cliff = find_cliff(_point_timeline(first), unpaced=True)
    model.sources.append("probe")
    model.observations += 1
    if cliff is None:
        model.fast_rate = first.bytes / first.seconds
        model.cliff_free = max(model.cliff_free, float(nbytes))
        model.cache_size = model.post_cache_rate = model.drain_rate = None
        model.set_fill(0.0)
        model.save()
        return model
    post = cliff.rate or (first.bytes - cliff.bytes_before) / max(
        1e-9, first.seconds - cliff.seconds)
    model.fast_rate = cliff.fast_rate or cliff.bytes_before / max(cliff.seconds, 1e-9)
    model.post_cache_rate = post
    guess = max(cliff.bytes_before - post * cliff.seconds, float(64 << 20))
    idle = min(_MAX_IDLE, 0.2 * guess / post) if idle is None else idle
    refills: List[Tuple[float, float]] = []
    wait, apart = idle, 3 * (idle if idle > 0 else 0.25)  # the second gap is `apart` longer
    full = True  # the cache is full as the last write left it
    while len(refills) < 2:
        progress(f"idle {wait:.1f} s, then a write up to the cliff again")
        time.sleep(max(0.0, wait - (time.monotonic() - ended)))
        refill = _refill_size(time.monotonic() - ended, model.fast_rate, post)
        point, began, written = _timed_write(directory, min(nbytes, refill))
        gap, ended = began - ended, written
        # Not unpaced=True: a refill ends about a second past its cliff, too soon for its
        # second half to give the post-cache rate the stall rule measures against.
        again = find_cliff(_point_timeline(point))
        # Slow from its first byte (below the midpoint of the two rates): the drive was still
        # folding, as one that leaves its cliff only once it has freed a margin is after a
        # short gap. The same full cache is back: a longer gap, not a reading.
        slow = point.bytes / max(point.seconds, 1e-9) < 0.5 * (model.fast_rate + post)
        full = again is not None or slow
        if again is not None:
            refills.append((gap + again.seconds, again.bytes_before))
            wait += apart  # not 4 x a retried gap: that could drain the whole cache
        elif slow and wait < _MAX_IDLE:
            wait = min(_MAX_IDLE, max(2 * wait, 0.25))
        else:
            break  # the cache drained completely (or never let go): no second reading
    if len(refills) == 2 and refills[1][0] > refills[0][0]:
        (t2, b2), (t3, b3) = refills
        model.drain_rate = min(post, max((b3 - b2) / (t3 - t2), 1.0))
    else:
        model.drain_rate = None
    recovery = model.recovery_rate or post
    model.cache_size = max(cliff.bytes_before - recovery * cliff.seconds, float(1 << 20))
    model.cliff_free = 0.0
    model.set_fill(model.cache_size if refills or full else 0.0)
    model.save()
    return model


def _refill_size(gap: float, fast: float, post: float) -> int:
    """Bytes a refill writes after ``gap`` seconds idle on a cache left full. Folding at ``d``
    frees ``d * gap``, and writing at ``fast`` fills it back after ``fast * d * gap / (fast -
    d)`` bytes; the longest of these is at the fastest fold the model allows, the post-cache
    rate. A fifth more for noise, then a second in the cliff for find_cliff's hold. (A refill
    sized from the cache instead missed its cliff whenever the disk wrote slower than at the
    first write, and the recovery rate fell back to an assumption.)"""
    to_cliff = fast * post * gap / max(fast - post, 0.1 * fast)
    return int(1.2 * to_cliff + post) + (32 << 20)


def _timed_write(directory: Union[str, os.PathLike], nbytes: int):
    """A sustained probe write: (its ProbePoint, time.monotonic() when it began, when its last
    request completed; both a few milliseconds early, the probe's own setup before its clock
    starts, the same for every write). Both leave out the file's preallocation and removal:
    the drive folds through them as it does through idle time. Removing the first write's file
    (3-4 x the cache) takes longer than removing a refill's: 0.1 s longer at test scale here,
    1.2 s for 6 GB against 1.9 GB (online discard). Left out of the idle gaps, that difference
    came off the gap difference the recovery rate is computed over (1.5-3 s), so the rate came
    out low and the cache size, which subtracts it, high."""
    with preallocated_file(directory, nbytes) as name:
        began = time.monotonic()
        point = measure(name, op="write", nbytes=nbytes, **_SHAPE)
        # The last request's completion, not the end fsync's: the fold starts there.
        ended = began + point.timeline[-1][0] if point.timeline else time.monotonic()
        return point, began, ended


def learn_from_save(model: WriteModel, timeline: Timeline, *, total: float,
                    start_fill: float, end_fill: Optional[float], ended: float) -> Optional[Cliff]:
    """Refreshes ``model`` from one save's write (its per-interval timeline) and saves it.

    ``start_fill`` is the cache estimate the save started from, ``end_fill`` the planner's
    estimate at its end (None: no planner ran; estimated here), ``ended`` the time.time() the
    write ended. A cliff in the timeline gives the cache size (the bytes before it, plus the
    fill it started from, less what drained meanwhile) and the post-cache rate; a save without
    one raises the cache size to at least the most the cache held during it.
    """
    cliff = find_cliff(timeline)
    rows = _intervals(timeline)
    unpaced = [r for r in rows if r[3] <= 0]
    if unpaced and sum(r[1] - r[0] for r in unpaced) >= 1.0 and cliff is None:
        model.fast_rate = _mean_rate(unpaced)
    elif cliff is not None and cliff.fast_rate:
        model.fast_rate = cliff.fast_rate
    model.sources.append("save")
    model.observations += 1
    recovery = model.recovery_rate
    if cliff is not None:
        # Where a pacer held the whole cliff below the drive (the adaptive detector paces at
        # a share of what it measured there), the mean in the cliff is a safe underestimate.
        in_cliff = [r for r in rows if r[0] >= cliff.seconds]
        model.post_cache_rate = cliff.rate or _mean_rate(in_cliff) or model.post_cache_rate
        recovery = model.recovery_rate or 0.0
        size = start_fill + cliff.bytes_before - recovery * cliff.seconds
        if size > 0:
            model.cache_size = size
        model.cliff_free = 0.0
        model.set_fill(model.cache_size or 0.0, ended)
    elif model.has_cliff:
        # The most the cache held, by the model's own drain: the model's size is at least that.
        # Only an unpaced save says so: a planned one stays below the size by construction,
        # and where it did not, its fill estimate (drifting with the drain's error from save
        # to save) is no evidence of a larger cache.
        held, peak = start_fill, start_fill
        for start, end, bps, _pace in rows:
            held = drained(held + bps * (end - start), recovery or 0.0, end - start)
            peak = max(peak, held)
        if unpaced and len(unpaced) == len(rows) and peak > (model.cache_size or 0.0):
            model.cache_size = peak
        fill = held if end_fill is None else end_fill
        model.set_fill(fill, ended)
    elif rows and all(r[3] <= 0 for r in rows):
        # Only an unpaced write says the drive takes this much without a cliff: a paced one
        # may have stayed below the rate at which the cache drains.
        model.cliff_free = max(model.cliff_free, float(total))
    model.save()
    return cliff
