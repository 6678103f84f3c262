"""What one ``rate="auto"`` save showed of the drive (:class:`SaveRecord`), which
checkpoint/drive_learning.py learns from, and the modes a save's controller goes through
(save_control.py)."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

__all__ = ["PLAN", "BURST", "PAUSE", "REFILL", "RECOVER", "REPEAT", "TEST", "SaveRecord",
           "SeenCliff", "describe"]

#: The modes of a save (save_control.py's docstring says what each does).
PLAN, BURST, PAUSE, REFILL, RECOVER, TEST, REPEAT = (
    "plan", "burst", "pause", "refill", "recover", "test", "repeat")


@dataclasses.dataclass
class SeenCliff:
    """A cliff the save met: when it began (seconds into the write), the write's bytes and
    the drive's bytes then, what showed it, and what the save was doing."""

    seconds: float
    done: float
    drive: float
    shown_by: str   # "writes" or "reads"
    during: str     # the mode it came in
    spread: float = 0.0  # seconds its placement may be off (cliff_watch.placed)


@dataclasses.dataclass
class SaveRecord:
    """What one save showed of the drive (checkpoint/drive_learning.py learns from it)."""

    cliffs: List[SeenCliff] = dataclasses.field(default_factory=list)
    fast_rate: Optional[float] = None      # the drive's own pace before a cliff
    post_cache_rate: Optional[float] = None  # ... and in it (unpaced)
    drain: Optional[float] = None          # bytes/s between the anchor and the next cliff
    drain_how: Optional[str] = None        # MEASURED, or LOWER_BOUND (no cliff came)
    drain_from: Optional[str] = None       # "refill" or "two cliffs"
    exit_s: Optional[float] = None         # the drive was out of its cliff this long after
    exit_bytes: float = 0.0                # the first anchor (at most), these bytes since
    end_fill: Optional[float] = None       # the cache's fill at the end, by what was learned
    full_before: Optional[tuple] = None    # (seconds, drive bytes) from the last moment seen
    #                                        in the cliff (the cache full) to the end
    ends_full: bool = False                # the save ended in its cliff
    unpaced: bool = True                   # no pace held the write back anywhere
    modes: List[tuple] = dataclasses.field(default_factory=list)  # (seconds, mode) changes
    slo_misses: int = 0
    conflict: bool = False
    others_bytes: float = 0.0              # the drive's bytes from other writers meanwhile
    test_pace: Optional[float] = None      # the pace a test save wrote its tail at
    clear: Optional[tuple] = None          # (burst, pace, start fill): the schedule, where
    #                                        it stayed clear


def describe(record: SaveRecord) -> Dict[str, object]:
    """The record as plain values, for the save's report."""
    return dataclasses.asdict(record)
