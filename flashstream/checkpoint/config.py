"""Validated settings of a CheckpointWriter."""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

from .. import engine, settings
from ..sizes import Size, parse_size
from .pacing import PlanSettings

__all__ = ["AdaptiveSettings", "WriterConfig", "IF_BUSY", "SNAPSHOT_MODES"]

IF_BUSY = ("wait", "skip")
SNAPSHOT_MODES = ("auto", "copy", "cow")
Rate = Union[None, int, float, str]


@dataclasses.dataclass(frozen=True)
class AdaptiveSettings:
    """``rate="auto"``'s floor: min_rate, the slowest pace it sets while reads miss
    ``read_slo`` (bytes/s, or a size string per second)."""

    min_rate: Size = "16MiB"

    def __post_init__(self) -> None:
        object.__setattr__(self, "min_rate", parse_size(self.min_rate, name="min_rate"))
        if self.min_rate <= 0:
            raise ValueError(f"min_rate must be a positive number of bytes/s, got "
                             f"{self.min_rate!r}")


def parse_rate(rate: Rate) -> Union[None, float, str]:
    """None (unpaced), "auto", or bytes per second (an int/float or a size such as "500MB")."""
    if rate is None or rate == "auto":
        return rate
    if isinstance(rate, float) and rate > 0:
        return rate
    try:
        value = parse_size(rate, name="rate")
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"rate must be None (unpaced), 'auto', or a positive number of bytes "
                         f"per second such as 500_000_000 or '500MB'; got {rate!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class WriterConfig:
    """rate: None (as fast as the drive takes it), bytes/s, or "auto" (see AdaptiveSettings).
    within: spread each write over this many seconds (a completion target; with a rate, the
        slower of the two applies). With rate="auto" it is the save's deadline, counted from
        the save() call to the committed checkpoint.
    keep: complete checkpoints to keep (None: all); older ones are removed after each commit.
    recycle: with ``keep``, a pruned checkpoint's file is kept as a spare and the next save
        writes over it instead of freeing its blocks and allocating new ones: no discards and
        no block allocation while reads share the drive. Between saves the directory then
        holds ``keep`` checkpoints and one spare per rank (the same peak as without: a save
        always needs room for ``keep`` + 1); ``close()`` removes the spares.
    if_busy: what save() does while the previous save is still writing: "wait" or "skip".
    chunk_size, queue_depth: write request size and requests in flight.
    paced_chunk_size: request size while a rate is in force (a fixed rate, ``within``, or
        rate="auto" once it paces): a read on the same drive then waits behind a short
        request, not a whole chunk_size one. Past 4,000 requests a second they grow with
        the rate (up to chunk_size), so a pace near the drive's peak still holds.
    engine, direct: as for ShardStream (FLASHSTREAM_ENGINE / FLASHSTREAM_DIRECT).
    commit_timeout: seconds rank 0 waits for the other ranks' markers before giving up on
        marking a step complete (the step stays incomplete; the previous one stays latest).
    interval: resolution of the write timeline, seconds.
    snapshot: "copy" copies every tensor inside save(); "cow" write-protects contiguous CPU
        tensors instead and copies them in the background, a write to a page not yet copied
        copying its block first (userfaultfd; "copy" where the kernel refuses it); "auto"
        (default) is "cow" where :func:`flashstream.engine.cow_preferred`, else "copy", and
        "copy" for a writer with ``within`` (see :attr:`snapshot_mode`).
    read_slo: with rate="auto", a p95 in seconds for reads on the same drive; the save slows
        while reads miss it, never below what ``within`` needs.
    deadline_policy: with rate="auto", what a save does when ``within`` cannot be met without
        filling the drive's write cache: "avoid-cliff" (the fastest cliff-free flat pace;
        finish late) or "meet-deadline".
    """

    rate: Rate = None
    within: Optional[float] = None
    keep: Optional[int] = 3
    recycle: bool = True
    if_busy: str = "wait"
    chunk_size: Size = "8MiB"
    paced_chunk_size: Size = "256KiB"
    queue_depth: int = 8
    engine: Optional[str] = None
    direct: Optional[bool] = None
    commit_timeout: float = 600.0
    interval: float = 0.05
    adaptive: AdaptiveSettings = AdaptiveSettings()
    snapshot: str = "auto"
    read_slo: Optional[float] = None
    deadline_policy: str = "avoid-cliff"

    def __post_init__(self) -> None:
        object.__setattr__(self, "rate", parse_rate(self.rate))
        io = settings.resolve(engine=self.engine, direct=self.direct)
        object.__setattr__(self, "engine", io.engine)
        object.__setattr__(self, "direct", io.direct)
        chunk = parse_size(self.chunk_size, name="chunk_size")
        if chunk < 4096 or chunk % 4096 or chunk > 1 << 30:
            raise ValueError(f"chunk_size must be a multiple of 4KiB up to 1GiB, got {chunk}")
        object.__setattr__(self, "chunk_size", chunk)
        paced = parse_size(self.paced_chunk_size, name="paced_chunk_size")
        if paced < 4096 or paced % 4096 or paced > 1 << 30:
            raise ValueError("paced_chunk_size must be a multiple of 4KiB up to 1GiB, got "
                             f"{paced}")
        object.__setattr__(self, "paced_chunk_size", paced)
        if isinstance(self.queue_depth, bool) or not isinstance(self.queue_depth, int) or not (
                1 <= self.queue_depth <= 256):
            raise ValueError(f"queue_depth must be an int from 1 to 256, got {self.queue_depth!r}")
        if self.within is not None and not self.within > 0:
            raise ValueError(f"within must be a positive number of seconds, got {self.within!r}")
        if self.keep is not None and (isinstance(self.keep, bool) or not isinstance(self.keep, int)
                                      or self.keep < 1):
            raise ValueError(f"keep must be None (keep all) or an int >= 1, got {self.keep!r}")
        if not isinstance(self.recycle, bool):
            raise ValueError(f"recycle must be True or False, got {self.recycle!r}")
        if self.if_busy not in IF_BUSY:
            raise ValueError(f"if_busy must be one of {', '.join(IF_BUSY)}; got {self.if_busy!r}")
        if not self.commit_timeout > 0:
            raise ValueError(f"commit_timeout must be positive, got {self.commit_timeout!r}")
        if not 0.001 <= self.interval <= 60:
            raise ValueError(f"interval must be from 0.001 to 60 seconds, got {self.interval}")
        if self.snapshot not in SNAPSHOT_MODES:
            raise ValueError(f"snapshot must be one of {', '.join(SNAPSHOT_MODES)}; got "
                             f"{self.snapshot!r}")
        if self.read_slo is not None and not (isinstance(self.read_slo, (int, float))
                                              and self.read_slo > 0):
            raise ValueError(f"read_slo must be a positive number of seconds (a read p95), "
                             f"got {self.read_slo!r}")
        if (self.read_slo is not None or self.deadline_policy != "avoid-cliff") and \
                self.rate != "auto":
            raise ValueError("read_slo and deadline_policy apply to rate='auto' only")
        PlanSettings(deadline_policy=self.deadline_policy)  # ValueError naming the choices
        if not isinstance(self.adaptive, AdaptiveSettings):
            raise ValueError("adaptive must be an AdaptiveSettings")

    @property
    def snapshot_mode(self) -> str:
        """What a save asks the snapshot for: "copy" or "cow" ("auto" decided here, the one
        place). "auto" is "cow" where :func:`engine.cow_preferred`, but "copy" for a writer
        with a deadline (``within``): its data write starts only once a copy-on-write
        snapshot's background copy is done, which took a second of a 3.4 GiB save's 7.2 s
        deadline on the emulated qlc drive and pushed saves into the deadline's conflict with
        the write cache (late); copying inside save() leaves the whole deadline to the write."""
        if self.snapshot != "auto":
            return self.snapshot
        return "cow" if self.within is None and engine.cow_preferred() else "copy"

    @property
    def rate_mode(self) -> str:
        if self.rate == "auto":
            return "auto"
        return "fixed" if self.rate is not None or self.within is not None else "none"

    def pacing(self, data_bytes: int) -> float:
        """Bytes/s for a write of ``data_bytes`` (0: unpaced; with auto: the ceiling)."""
        limits = []
        if isinstance(self.rate, float):
            limits.append(self.rate)
        if self.within is not None:
            limits.append(max(data_bytes, 1) / self.within)
        return min(limits) if limits else 0.0
