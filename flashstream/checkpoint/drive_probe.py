"""``flashstream probe --sustained SIZE``: the drive's write model measured ahead, on purpose,
with new files it removes: the one place flashstream writes to learn.

Saves learn the same figures from their own bytes (save_control.py); this is for a set-up step
before the first save, or to check a drive. Two unpaced writes of at most ``SIZE`` bytes each,
read as the saves read their own:

1. into the cliff and on to its end: the new-file rate before the cliff, the post-cache rate
   in it, and the cliff itself (from an empty cache: the drive should be idle);
2. after an idle gap, until its cliff comes back: the bytes the drive took over the seconds
   since the first write's last request are its drain (nothing else entered the cache), and
   with it the cache's size. A second write slow from its first bytes found the drive still
   in its cliff (it leaves it only once it has freed a margin): it is tried again after twice
   the gap.
"""

from __future__ import annotations

import os
import time
from typing import Callable, List, Optional, Tuple, Union

from ..sizes import Size, format_size, parse_size
from ..telemetry.drive_model import (
    ASSUMED_CLIFF_MARGIN,
    ASSUMED_DRAIN_SHARE,
    MEASURED,
    ClearSchedule,
    DriveModel,
    ReferenceCliff,
    load_model,
)
from ..telemetry.probe import measure, preallocated_file
from .cliff_watch import CLIFF_SHARE, HOLD_S, SLICE_S, Look, bytes_at, dropped, placed, rate_between

__all__ = ["measure_sustained"]

#: The longest idle gap before the second write (seconds).
MAX_GAP_S = 15.0
#: Second writes tried, each after twice the last gap, while the drive is still in its cliff.
TRIES = 3
#: Seconds of the second write that tell whether the drive was out of its cliff.
FIRST_S = 0.15
#: The probe's request shape: small requests and a fine timeline, so that what is in flight
#: when the cliff comes stays small beside the cache.
SHAPE = {"block_size": "1MiB", "queue_depth": 8, "interval": 0.02}


def measure_sustained(directory: Union[str, os.PathLike], size: Size, *,
                      progress: Callable[[str], None] = lambda _m: None) -> DriveModel:
    """Measures the drive under ``directory`` (see the module docstring); returns its model,
    saved. ``size`` must take the drive past its cliff: 3-4 x its cache."""
    nbytes = parse_size(size, name="size")
    model = load_model(directory)
    progress(f"unpaced write of {format_size(nbytes)}")
    looks, _began, full_at = _write(directory, nbytes)
    found = find_cliff(looks)
    model.sources = (model.sources + ["probe"])[-20:]
    if found is None:
        model.fast_rate = rate_between(looks, 0.0, looks[-1][0])
        model.clear, model.cliff = ClearSchedule(float(nbytes), 0.0, float(nbytes)), None
        model.save()
        return model
    t1, fast, post = found
    model.fast_rate, model.post_cache_rate = fast, post
    model.note("post_cache_rate", MEASURED, "probe")
    first = (t1, bytes_at(looks, t1))
    guess = max(first[1] - post * t1, float(64 << 20))
    gap = min(MAX_GAP_S, ASSUMED_CLIFF_MARGIN * guess / (ASSUMED_DRAIN_SHARE * post))
    for _ in range(TRIES):
        progress(f"idle {gap:.1f} s, then a write until the cliff comes back")
        time.sleep(max(0.0, gap - (time.monotonic() - full_at)))
        below = 0.5 * (fast + post)
        again, began, ended = _write(directory, nbytes, stop_below=below)
        if rate_between(again, 0.0, FIRST_S) >= below:
            cliff = find_cliff(again)
            if cliff is not None:
                since = began - full_at
                drain = bytes_at(again, cliff[0]) / (since + cliff[0])
                model.drain_rate = drain
                model.note("drain_rate", MEASURED, "probe")
                model.cliff = ReferenceCliff(first[0], first[1])
                model.cliff_margin = drain * since
                model.note("cliff_margin", MEASURED, "probe")
                model.set_fill(float(model.cache_size), time.time() - (time.monotonic()
                                                                       - ended), None)
                model.save()
                return model
            break  # out of the cliff, and no cliff within the write: the drive drained whole
        full_at, gap = ended, min(MAX_GAP_S, 2 * gap)
    model.drain_rate = None  # the slow end of drives, until a save reads it
    model.cliff = ReferenceCliff(first[0], first[1])
    model.set_fill(float(model.cache_size), time.time(), None)
    model.save()
    return model


def find_cliff(looks: List[Look]) -> Optional[Tuple[float, float, float]]:
    """The first cliff in an unpaced write's looks: (when it began, the rate before, the rate
    in it); None where the write never fell below half its rate for a hold."""
    for k, (t, _done, _drive) in enumerate(looks):
        low_from = dropped(looks[:k + 1], 0.0, t)
        if low_from is not None:
            at = placed(looks[:k + 1], low_from, 0.0,
                        CLIFF_SHARE * rate_between(looks, 0.0, low_from))[0]
            after = rate_between(looks, at + SLICE_S, looks[-1][0])
            return at, rate_between(looks, 0.0, low_from), \
                after or rate_between(looks, at, looks[-1][0])
    return None


def _write(directory: Union[str, os.PathLike], nbytes: int, stop_below: float = 0.0
           ) -> Tuple[List[Look], float, float]:
    """One unpaced write of a new file (removed after), ended ``HOLD_S`` and a slice after it
    last ran at ``stop_below`` (0: at its end): its looks, and when (time.monotonic()) it began
    and its last request completed. The file's allocation and removal lie outside both: the
    drive folds through them as through idle time."""
    with preallocated_file(directory, nbytes) as name:
        began = time.monotonic()
        point = measure(name, op="write", nbytes=nbytes, stop_below=stop_below,
                        stop_after=HOLD_S + SLICE_S if stop_below else 0.0,
                        stop_smooth=SLICE_S, **SHAPE)
        looks: List[Look] = [(0.0, 0.0, 0.0)]
        for end, gbps in point.timeline:
            done = looks[-1][1] + gbps * 1e9 * (end - looks[-1][0])
            looks.append((end, done, done))
        return looks, began, began + looks[-1][0]

