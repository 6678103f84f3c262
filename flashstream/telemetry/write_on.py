"""Writing on past a save to find the drive's cliff.

A save that measures the drive (unpaced, checkpoint/save_control.py) and ends without a cliff
says only that the drive took that much. Where the cliff is near its end (a drive that folds
almost as fast as it writes, a save the size of what its cache absorbs), the save meets it in
its last request or two: the emulator, like a drive, is then in its cliff, and the save's
timeline shows nothing. So the learner writes on at once, unpaced, into scratch files it
removes, until the cliff comes and the drive has set its own pace in it long enough to read
its post-cache rate, or until a cap: then the model knows the cliff (or that the cap went
without one), and the next save is planned around it instead of meeting it unseen.

One write, not chunks: between chunks (a file removed, the next one allocated) a drive folds as
when idle, faster than it does written on in its cliff, and one that leaves its cliff once it
has freed a small margin left it at nearly every chunk. It then wrote at 1.3-1.6 x its
post-cache rate on average, which the model took for that rate, and the refills sized from it
found the drive still in its cliff. The write ends by its own rate (``stop_below``) soon
enough after the cliff, and at once where a save is waiting (:class:`Interrupt`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
import time
from typing import List, Optional, Tuple, Union

from .. import engine
from .cliff import CLIFF_HOLD_S, Cliff, drive_limited, find_cliff, intervals, mean_rate
from .probe import measure, preallocated_file

__all__ = ["SHAPE", "STOP_AFTER_S", "WRITE_ON_AFTER_S", "Interrupt", "WriteOn", "point_timeline",
           "timed_write", "write_on_to_cliff"]

#: Writing on ends this many seconds after it last ran at half the new-file rate (over
#: ``STOP_SMOOTH_S``): the hold that places the cliff, then long enough for a measured
#: post-cache rate (MIN_RATE_SECONDS in telemetry/write_learning.py) and the timeline's last
#: interval. The refills after it are sized from that rate: with a lower bound read off a few
#: intervals instead, they came out too small to reach the cliff on drives that fold fast, and
#: the recovery stayed assumed.
WRITE_ON_AFTER_S = CLIFF_HOLD_S + 0.5 + 0.15
#: Seconds below half the new-file rate from writing on's first byte that say the drive was
#: in its cliff already (the save met it in its last requests): writing on ends
#: ``WRITE_ON_AFTER_S`` after its start then, and its timeline leaves out the last interval.
IN_CLIFF_S = CLIFF_HOLD_S + 0.5
#: The most of the free space writing on's file may take.
FREE_SHARE = 0.5


#: A write given ``stop_below`` ends this many seconds after it last ran that fast: where
#: that is the midpoint of the rates before and after the cliff, the moment the drop passes
#: it, plus find_cliff's hold and a few intervals more (find_cliff leaves out a timeline's
#: last interval, the queue draining). (Ended instead once a window of twice that averaged
#: below the midpoint, a write that reached its cliff soon, as a refill after a short gap
#: does, had to fill the window first and wrote on in its cliff for over a second.)
STOP_AFTER_S = CLIFF_HOLD_S + 0.1
#: Seconds each rate that rule judges is the mean over: the block-I/O throttle that emulates
#: a cliff, and drives themselves, complete requests in bursts every 0.05-0.1 s.
STOP_SMOOTH_S = 0.2


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
                stop_below: float = 0.0, stop: Optional[threading.Event] = None,
                stop_after: float = STOP_AFTER_S):
    """A sustained probe write (at most ``seconds`` of writing, 0: no cap; ended early once
    ``stop_after`` seconds have passed since it last ran at ``stop_below`` bytes/s, each rate
    over ``STOP_SMOOTH_S``, 0: never): its ProbePoint, time.monotonic() when it began, when
    its last request completed; both a few milliseconds early, the probe's own setup before
    its clock starts, the same for every write. Both leave out the file's preallocation and
    removal: the drive folds through them as it does through idle time. Removing a large file
    takes longer than removing a small one (online discard): counted into the idle gaps, that
    difference would come off the gap difference the recovery rate is computed over, and the
    rate would come out low (the cache size, which subtracts it, high). ``stop``: an
    :class:`Interrupt` ends the write once set."""
    with preallocated_file(directory, nbytes) as name:
        began = time.monotonic()
        point = measure(name, op="write", nbytes=nbytes, seconds=seconds,
                        stop_below=stop_below, stop_after=stop_after if stop_below else 0.0,
                        stop_smooth=STOP_SMOOTH_S,
                        cancel=stop.probe if isinstance(stop, Interrupt) else None,
                        **SHAPE)
        # The last request's completion, not the end fsync's: the fold starts there.
        ended = began + point.timeline[-1][0] if point.timeline else time.monotonic()
        return point, began, ended


@dataclasses.dataclass
class WriteOn:
    """What writing on found: the cliff (``seconds`` and ``bytes_before`` counted from the
    write's start), the bytes written, its timeline, and when (time.monotonic()) it began and
    its last request completed."""

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
    """One unpaced new-file write in ``directory`` (removed after) until the drive has been in
    its cliff long enough to read its pace there (:data:`WRITE_ON_AFTER_S`), or ``cap``
    bytes (at most ``FREE_SHARE`` of the free space), or ``stop`` is set (an
    :class:`Interrupt` ends the write in progress). A drive below half ``fast`` from the
    first byte for ``in_cliff`` seconds is in its cliff from there: a cliff at 0 s, 0 bytes.
    ``unpaced``: read the cliff as after a write long past it (find_cliff's stall rule)."""
    # One file, so at most a share of the free space: chunks freed theirs as they went, and a
    # checkpoint's size in scratch at once could fill the disk its checkpoints need.
    size = min(int(cap), int(FREE_SHARE * shutil.disk_usage(directory).free))
    point, began, ended = timed_write(directory, max(size, 1 << 20),
                                      stop_below=0.5 * fast, stop_after=WRITE_ON_AFTER_S,
                                      stop=stop)
    timeline = point_timeline(point)
    cliff = find_cliff(timeline, unpaced=unpaced)
    from_start = cliff is None
    if from_start:
        cliff = _in_cliff_from_start(timeline, fast, max(in_cliff, CLIFF_HOLD_S))
    return WriteOn(cliff, float(point.bytes), began, ended, timeline,
                   interrupted=stop is not None and stop.is_set(),
                   from_start=cliff is not None and from_start)


def point_timeline(point) -> List[Tuple[float, float, float]]:
    """A ProbePoint's (end, GB/s) timeline as (end, bytes, unpaced)."""
    out, start = [], 0.0
    for end, gbps in point.timeline:
        out.append((end, gbps * 1e9 * (end - start), 0.0))
        start = end
    return out


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
