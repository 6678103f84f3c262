"""Writing on past a save to find the drive's cliff.

A save that measures the drive (unpaced, checkpoint/save_control.py) and ends without a cliff
says only that the drive took that much. Where the cliff is near its end (a drive that folds
almost as fast as it writes, a save the size of what its cache absorbs), the save meets it in
its last request or two: the emulator, like a drive, is then in its cliff, and the save's
timeline shows nothing. So the learner writes on at once, unpaced, into scratch files it
removes, until the cliff comes and the drive has set its own pace in it long enough to read
its post-cache rate, or until a cap: then the model knows the cliff (or that the cap went
without one), and the next save is planned around it instead of meeting it unseen.

Written in chunks (a new file each), so that it stops soon after the cliff and between chunks
once a save is waiting; the chunks' timelines are joined on one clock.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import List, Optional, Tuple, Union

from .. import engine
from .cliff import CLIFF_HOLD_S, Cliff, drive_limited, find_cliff, intervals, mean_rate
from .probe import measure, preallocated_file

__all__ = ["SHAPE", "STOP_AFTER_S", "Interrupt", "WriteOn", "timed_write", "write_on_to_cliff"]

#: Seconds of writing at the fast rate per chunk: how late after the cliff it can stop.
CHUNK_S = 0.25
#: Seconds in the cliff before it stops: the hold that places the cliff, then long enough for
#: a measured post-cache rate (MIN_RATE_SECONDS in telemetry/write_learning.py, and a chunk
#: for the timeline's last interval). The refills after it are sized from that rate: with a
#: lower bound read off a few intervals instead, they came out too small to reach the cliff
#: on drives that fold fast, and the recovery stayed assumed.
IN_CLIFF_S = CLIFF_HOLD_S + 0.5 + 0.25


#: Seconds whose average below a write's ``stop_below`` end it. With ``stop_below`` midway
#: between the rates before and after a drop, the average crosses it once half the window is
#: past the drop: that half is find_cliff's hold and a few intervals more (find_cliff leaves
#: out a timeline's last interval, the queue draining).
STOP_AFTER_S = 2 * (CLIFF_HOLD_S + 0.15)


# The sustained probe's request shape: small requests and a fine timeline, so that what is in
# flight when the cliff comes (and counts as written before it) stays small beside the cache.
SHAPE = {"block_size": "1MiB", "queue_depth": 8, "interval": 0.02}


class Interrupt(threading.Event):
    """The flag that ends a measurement: ``set()`` also ends the probe write in progress
    (``engine.ProbeCancel``) of a :func:`timed_write` given it, not only the steps after."""

    def __init__(self) -> None:
        super().__init__()
        self.probe = engine.ProbeCancel()

    def set(self) -> None:
        self.probe.set()
        super().set()


def timed_write(directory: Union[str, os.PathLike], nbytes: int, seconds: float = 0.0,
                stop_below: float = 0.0, stop: Optional[threading.Event] = None):
    """A sustained probe write (at most ``seconds`` of writing, 0: no cap; ended early once
    ``STOP_AFTER_S`` seconds ran below ``stop_below`` bytes/s, 0: never): its ProbePoint,
    time.monotonic() when it began, when its last request completed; both a few milliseconds
    early, the probe's own setup before its clock starts, the same for every write. Both leave
    out the file's preallocation and removal: the drive folds through them as it does through
    idle time. Removing a large file takes longer than removing a small one (online discard):
    counted into the idle gaps, that difference would come off the gap difference the recovery
    rate is computed over, and the rate would come out low (the cache size, which subtracts
    it, high). ``stop``: an :class:`Interrupt` ends the write once set."""
    with preallocated_file(directory, nbytes) as name:
        began = time.monotonic()
        point = measure(name, op="write", nbytes=nbytes, seconds=seconds,
                        stop_below=stop_below, stop_after=STOP_AFTER_S if stop_below else 0.0,
                        cancel=stop.probe if isinstance(stop, Interrupt) else None,
                        **SHAPE)
        # The last request's completion, not the end fsync's: the fold starts there.
        ended = began + point.timeline[-1][0] if point.timeline else time.monotonic()
        return point, began, ended


@dataclasses.dataclass
class WriteOn:
    """What writing on found: the cliff (``seconds`` and ``bytes_before`` counted from the
    first chunk's start), the bytes written, and when (time.monotonic()) the first chunk began
    and the last request completed."""

    cliff: Optional[Cliff]
    written: float
    began: float
    ended: float
    timeline: List[Tuple[float, float, float]]
    interrupted: bool = False
    from_start: bool = False  # the drive was in its cliff from the first byte


def write_on_to_cliff(directory: Union[str, os.PathLike], *, fast: float, cap: float,
                      stop: Optional[threading.Event] = None, in_cliff: float = IN_CLIFF_S,
                      unpaced: bool = True) -> WriteOn:
    """Unpaced new-file writes in ``directory`` (removed after) until ``in_cliff`` seconds
    past the cliff, or ``cap`` bytes, or ``stop`` is set (checked between chunks). A drive
    below half ``fast`` from the first byte for as long (at least the hold) is in its cliff
    from there: a cliff at 0 s, 0 bytes.
    ``unpaced``: read the cliff as after a write long past it (find_cliff's stall rule)."""
    chunk = max(int(CHUNK_S * fast), 16 << 20)
    timeline: List[Tuple[float, float, float]] = []
    spans: List[Tuple[float, float, float]] = []  # each chunk's (start, end, bytes)
    written, began, ended, cliff = 0.0, time.monotonic(), time.monotonic(), None
    interrupted = from_start = False
    while written < cap:
        if stop is not None and stop.is_set():
            interrupted = True
            break
        nbytes = int(min(chunk, cap - written))
        # At most CHUNK_S of writing: in the cliff a chunk sized at the fast rate takes
        # several times as long.
        point, start, ended = timed_write(directory, nbytes, seconds=CHUNK_S)
        if not timeline:
            began = start
        offset, last = start - began, 0.0
        for end, gbps in point.timeline:
            timeline.append((offset + end, gbps * 1e9 * (end - last), 0.0))
            last = end
        if point.timeline:
            spans.append((spans[-1][1] if spans else 0.0, timeline[-1][0], point.bytes))
        written += point.bytes
        cliff = find_cliff(timeline, unpaced=unpaced)
        from_start = cliff is None
        if from_start:
            cliff = _in_cliff_from_start(timeline, fast, max(in_cliff, CLIFF_HOLD_S))
        if cliff is not None and timeline[-1][0] - cliff.seconds >= in_cliff:
            break
    if cliff is not None and cliff.rate is not None:
        cliff = _rate_in_cliff(cliff, spans, fast)
    return WriteOn(cliff, written, began, ended, timeline, interrupted,
                   from_start=cliff is not None and from_start)


def _rate_in_cliff(cliff: Cliff, spans: List[Tuple[float, float, float]], fast: float
                   ) -> Cliff:
    """The drive's pace in its cliff from the chunks after its hold that ran below half
    ``fast``, each over its own time and the gap before it. Between chunks (a file removed,
    the next one allocated) the drive folds as when idle, faster than it does written on in
    its cliff, so a drive that leaves its cliff only once it has freed a margin can leave it
    after a few chunks: a chunk back at its cache's speed is not the cliff's pace (read with
    one, the post-cache rate came out 1.3-1.7 x the drive's, and the next save met the
    cliff). Unchanged where no such chunk ran."""
    kept = [(start, end, nbytes) for start, end, nbytes in spans
            if start >= cliff.seconds + CLIFF_HOLD_S and end > start
            and nbytes / (end - start) < 0.5 * fast]
    if len(kept) == len([s for s in spans if s[0] >= cliff.seconds + CLIFF_HOLD_S]):
        return cliff
    seconds = sum(end - start for start, end, _b in kept)
    if seconds <= 0:
        return dataclasses.replace(cliff, rate=None, rate_seconds=0.0)
    return dataclasses.replace(cliff, rate=sum(b for _s, _e, b in kept) / seconds,
                               rate_seconds=seconds)


def _in_cliff_from_start(timeline, fast: float, window: float) -> Optional[Cliff]:
    """The cliff at the first byte: the save met it in its last requests, so writing on found
    the drive in it already, below half its fast rate on average for ``window`` s (a drop
    find_cliff cannot see, having no fast stretch before it). The drive's pace in it is read
    after the hold, as find_cliff reads it."""
    rows = intervals(timeline)
    if not rows or rows[-1][1] < window or mean_rate(rows) >= 0.5 * fast:
        return None
    after = drive_limited([r for r in rows if r[0] >= CLIFF_HOLD_S])
    return Cliff(0.0, 0.0, mean_rate(after) if after else None, None,
                 sum(r[1] - r[0] for r in after))
