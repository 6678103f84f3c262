"""The emulated drive's SLC cache: a clock-free model the emulator steps with measured bytes.

A dense (PLC/QLC) drive takes writes into a fast SLC cache and folds them into dense cells in
the background. The model keeps one number, the bytes in the cache (``fill``):

- every byte the drive writes enters the cache; the drive folds ``drain_rate`` bytes/s out of
  it whenever it is not empty, writing or not;
- while the cache has room, writes run at ``fast_rate`` (0: as fast as the real drive goes);
- once it is full the drive is *in the cliff*: writes run at ``post_cache_rate`` and reads are
  held back to ``fold_read_rate`` while it folds; it leaves the cliff once folding has freed
  ``hysteresis`` bytes (so a writer that keeps writing at the post-cache rate stays in it).
  A drive may fold faster when idle than it writes in the cliff (``drain_rate`` above
  ``post_cache_rate``): written in the cliff, it folds no faster than it is written, so it
  stays there while written at the post-cache rate, and folds at the full rate when idle
  (in between, in proportion to the time it spent writing). In the cliff the bytes a step
  brings enter the cache at the post-cache rate, and what a burst brings beyond the step
  enters in the next steps (at most ``BUSY_CARRY_S`` of writing): the block-I/O throttle
  that emulates the cliff releases a steady writer's requests in bursts, every other step.
  Judged step by step, such a writer left the drive idle half the time: it folded at the
  mean of the two rates and left a "full" cache tens of MB short of full after a few seconds
  in the cliff; and a burst's bytes, cut off at the full cache, left the empty step after it
  a burst's worth below full, out of the cliff where its margin is that small (5% of a
  cache written at 0.9 GB/s), so that the drive went in and out of its cliff every few
  steps, and the throttle, its limit rewritten each time, held nothing.

So a write at any rate below ``drain_rate`` never fills the cache, and from an empty cache a
write at rate ``w > drain_rate`` reaches the cliff after ``cache_size * w / (w - drain_rate)``
bytes.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Dict, Optional, Tuple

from ..sizes import Size, format_size, parse_size
from ..telemetry.drive_model import left_after_folding

__all__ = ["CacheModel", "CacheState", "DriveSettings", "PROFILES", "RANDOM_RANGES",
           "profile_settings", "random_settings"]


def _rate(value: Size, name: str) -> float:
    if isinstance(value, float):  # bytes/s; parse_size takes ints and size strings
        if value < 0 or value != value:
            raise ValueError(f"{name} must be a non-negative number of bytes/s, got {value!r}")
        return value
    return float(parse_size(value, name=name))


@dataclasses.dataclass(frozen=True)
class DriveSettings:
    """An emulated dense drive. Sizes are bytes (or strings like ``"1.2GiB"``), rates bytes/s
    (or ``"300MB"`` meaning per second).

    cache_size: bytes the SLC cache holds.
    fast_rate: write bytes/s while the cache has room; 0 leaves writes at the real drive's
        speed.
    post_cache_rate: write bytes/s once the cache is full (in the cliff).
    drain_rate: bytes/s folded out of the cache whenever it holds data (in the cliff, no
        faster than it is written: see the module docstring); below ``fast_rate``.
    fold_read_rate: read bytes/s allowed while in the cliff; 0: reads are not held back.
    hysteresis_share: the share of the cache folding must free before the drive leaves the
        cliff; default (None) 2% of the cache, at least a quarter second of folding.
    """

    cache_size: Size
    post_cache_rate: Size
    drain_rate: Optional[Size] = None  # default: the post-cache rate
    fast_rate: Size = 0
    fold_read_rate: Size = 0
    hysteresis_share: Optional[float] = None

    def __post_init__(self) -> None:
        put = object.__setattr__
        size = self.cache_size
        put(self, "cache_size", parse_size(int(size) if isinstance(size, float) else size,
                                           name="cache_size"))
        put(self, "post_cache_rate", _rate(self.post_cache_rate, "post_cache_rate"))
        put(self, "drain_rate", self.post_cache_rate if self.drain_rate is None
            else _rate(self.drain_rate, "drain_rate"))
        put(self, "fast_rate", _rate(self.fast_rate, "fast_rate"))
        put(self, "fold_read_rate", _rate(self.fold_read_rate, "fold_read_rate"))

        if self.cache_size < 1 << 20:
            raise ValueError(f"cache_size must be at least 1MiB, got {self.cache_size}")
        if self.post_cache_rate < 1 << 20:
            raise ValueError(f"post_cache_rate must be at least 1MiB/s, got "
                             f"{self.post_cache_rate:.0f}")
        if not self.drain_rate > 0:
            raise ValueError(f"drain_rate must be positive, got {self.drain_rate:.0f}")
        if self.fast_rate and self.fast_rate <= max(self.post_cache_rate, self.drain_rate):
            raise ValueError("fast_rate must be 0 (the real drive's speed) or above "
                             "post_cache_rate and drain_rate")
        if self.hysteresis_share is not None and not 0 < self.hysteresis_share < 1:
            raise ValueError(f"hysteresis_share must be in (0, 1), got "
                             f"{self.hysteresis_share!r}")

    @property
    def hysteresis(self) -> float:
        """Bytes folding must free before the drive leaves the cliff."""
        if self.hysteresis_share is not None:
            return self.hysteresis_share * self.cache_size
        return min(max(0.02 * self.cache_size, 0.25 * self.drain_rate), 0.5 * self.cache_size)

    def to_dict(self) -> Dict[str, float]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        fast = f"{format_size(self.fast_rate)}/s" if self.fast_rate else "the drive's speed"
        held = (f"reads held to {format_size(self.fold_read_rate)}/s in the cliff"
                if self.fold_read_rate else "reads not held back")
        return (f"SLC cache {format_size(self.cache_size)}, writes at {fast} until full, then "
                f"{format_size(self.post_cache_rate)}/s; folds "
                f"{format_size(self.drain_rate)}/s, leaves the cliff "
                f"{format_size(self.hysteresis)} below full; {held}")


# Shapes of real dense drives, as shares of their cache-fresh sequential write rate (the seeds'
# figures: PLC ~3.2 GB/s falling to ~0.8 GB/s, QLC ~2.9 falling to ~1.1 GB/s). The cache is
# given as seconds of writing at the fast rate, so a scaled profile keeps the drive's timing.
PROFILES: Dict[str, Dict[str, float]] = {
    "plc": {"post_cache": 0.8 / 3.2, "cache_seconds": 1.25, "fold_read": 0.025},
    "qlc": {"post_cache": 1.1 / 2.9, "cache_seconds": 1.5, "fold_read": 0.04},
}


def _fast_rate(write_rate: float) -> float:
    """An emulated drive's fast rate: 90% of the real drive's new-file write rate, so the real
    drive, not its noise, sets the pace before the cliff."""
    if not write_rate > 0 or not math.isfinite(write_rate):
        raise ValueError(f"write_rate must be a positive number of bytes/s, got {write_rate!r}")
    return 0.9 * write_rate


def profile_settings(name: str, write_rate: float, **overrides: Size) -> DriveSettings:
    """The profile ``name`` scaled to a drive that writes ``write_rate`` bytes/s: the fast rate
    is 90% of it (so the real drive, not its noise, sets the pace before the cliff), the
    post-cache and fold rates the profile's share of it, the cache its seconds of fast writing;
    reads in the cliff are held to a small share of the fast rate. ``overrides`` replace any
    :class:`DriveSettings` field."""
    if name not in PROFILES:
        raise ValueError(f"profile must be one of {', '.join(PROFILES)}, got {name!r}")
    shape, fast = PROFILES[name], _fast_rate(write_rate)
    fields = {"cache_size": int(shape["cache_seconds"] * fast),
              "post_cache_rate": shape["post_cache"] * fast,
              "drain_rate": shape["post_cache"] * fast,
              "fast_rate": fast, "fold_read_rate": shape["fold_read"] * fast}
    unknown = set(overrides) - set(fields)
    if unknown:
        raise ValueError(f"unknown setting(s) {sorted(unknown)}; allowed: {sorted(fields)}")
    fields.update({k: v for k, v in overrides.items() if v is not None})
    if "post_cache_rate" in overrides and "drain_rate" not in overrides:
        fields["drain_rate"] = min(fields["drain_rate"],
                                   _rate(fields["post_cache_rate"], "post_cache_rate"))
    return DriveSettings(**fields)


# The family random_settings draws from (uniformly), as shares of the fast rate like PROFILES; it
# spans both profiles and the behaviours real dense drives show beyond them: post-cache 15-45%
# of fast (plc 25%, qlc 38%); 0.15-2.5 s of fast writing in the cache (a few hundred MiB to
# several GiB on a drive writing a few GB/s); idle folding at 50-160% of the post-cache rate
# (slower than writing in the cliff, or faster: the profiles fold at 100%); the cliff left only
# once 2-25% of the cache is free again; reads held to 2-5% of fast in the cliff.
RANDOM_RANGES: Dict[str, Tuple[float, float]] = {
    "post_cache": (0.15, 0.45), "cache_seconds": (0.15, 2.5), "drain_share": (0.5, 1.6),
    "hysteresis_share": (0.02, 0.25), "fold_read": (0.02, 0.05)}


def random_settings(write_rate: float, rng: random.Random) -> DriveSettings:
    """A drive drawn from :data:`RANDOM_RANGES`, scaled to ``write_rate`` as
    :func:`profile_settings` scales a profile: for checks on parameters nobody tuned for."""
    fast = _fast_rate(write_rate)
    draw = {name: rng.uniform(lo, hi) for name, (lo, hi) in RANDOM_RANGES.items()}
    post = draw["post_cache"] * fast
    cache = int(draw["cache_seconds"] * fast)
    return DriveSettings(cache_size=cache, post_cache_rate=post,
                         drain_rate=draw["drain_share"] * post, fast_rate=fast,
                         fold_read_rate=draw["fold_read"] * fast,
                         hysteresis_share=draw["hysteresis_share"])


@dataclasses.dataclass
class CacheState:
    fill: float = 0.0
    cliff: bool = False


#: Seconds of writing in the cliff a burst may carry into the steps after it (see the module
#: docstring): the throttle's slice (cgroup.SLICE_S), whose bytes a burst brings at once, and
#: half as much again for requests in flight with it. A writer that stops after its last
#: burst stood for that slice of writing at most: carried over 0.25 s, a drive that folds
#: faster idle than written in its cliff stayed in it 0.15 s too long after each write, and
#: the next save began there.
BUSY_CARRY_S = 0.15


class CacheModel:
    """Steps the cache with the bytes the drive wrote; says what to throttle to."""

    def __init__(self, settings: DriveSettings, horizon: float = 0.05,
                 release: float = 0.0) -> None:
        self.settings = settings
        self.horizon = horizon  # seconds until a new limit holds (the next step, or later)
        # Seconds of writing at a newly set limit that the throttle lets through at once
        # (0: an ideal throttle, as in the clock-free simulations of the tests).
        self.release = release
        self.state = CacheState()
        self._owed = 0.0  # bytes in the cliff owed to the cache from earlier bursts
        # Held at the post-cache rate ahead of the full cache (_taking_hold): the room left
        # then, the bytes written since, the seconds since; None: not held.
        self._hold: Optional[Tuple[float, float, float]] = None
        self._let_go = False  # a hold let go: not again until the cache drains or fills
        self._rate = 0.0  # bytes/s written, averaged over about a slice

    def step(self, written: float, seconds: float) -> CacheState:
        s, st = self.settings, self.state
        if seconds > 0:  # the write rate over about a slice: the throttle's own bursts in it
            weight = min(1.0, seconds / self.release) if self.release else 1.0
            self._rate += weight * (written / seconds - self._rate)
        entering = self._entering(written, seconds)
        st.fill = min(float(s.cache_size), left_after_folding(st.fill + entering, self.fold_rate(
            entering, seconds), seconds))
        if st.cliff:
            if st.fill <= s.cache_size - s.hysteresis:
                st.cliff = False
        elif st.fill >= s.cache_size * 0.999:
            st.cliff, self._hold = True, None
        elif self._hold is not None:
            # Held ahead of the full cache: in the cliff once the writer has written the room
            # there was and half a burst beyond the limit's steady share (the throttle's
            # first burst brings both at once to a writer it holds back); else, a release
            # later, it was writing no faster than the limit: let go, and not held again
            # before the cache has drained that far once more or filled (a paced writer
            # near full, held and let go by turns, had its reads held half the time).
            room, taken, age = self._hold
            taken, age = taken + written, age + seconds
            self._hold = (room, taken, age)
            beyond = taken - s.post_cache_rate * age
            if taken >= room and beyond >= 0.5 * s.post_cache_rate * self.release:
                st.cliff, st.fill, self._hold = True, float(s.cache_size), None
            elif age >= self.release:
                self._hold, self._let_go = None, True
        elif self._let_go:
            self._let_go = s.cache_size - st.fill <= s.post_cache_rate * self.release
        elif self._taking_hold(written, seconds):
            self._hold = (s.cache_size - st.fill, 0.0, 0.0)
        if st.cliff:
            self._let_go = False
        return st

    def _taking_hold(self, written: float, seconds: float) -> bool:
        """Whether a throttle that releases ``release`` seconds of writing at once must take
        hold now, before the cache is full, for the writer's bytes to follow a real drive's.

        In the cliff that throttle lets a burst of ``release`` seconds' worth through at the
        start of each of its slices, so the bytes written follow a staircase whose mean line
        lies half a burst above its first step. It takes hold that much before the full cache
        (:meth:`_lead`: about half a burst for a fast writer), less the half step
        (``horizon / 2``) it takes on average to see the room gone, so that the line of a
        writer's bytes in the cliff starts where a real drive's would.
        Taken at the full cache, every writer saw the fast rate for a burst and more beyond
        it, and read the cache that much larger: tens of MB at a few GB/s, more than a paced
        save leaves spare. The drive is in its cliff once the writer has written the room
        left and half a burst beyond the limit's steady share (:meth:`step`): the
        throttle's bursts stand for the writing that fills it."""
        s = self.settings
        if not self.release or written <= 0 or seconds <= 0:
            return False
        rate = min(self._rate, s.fast_rate) if s.fast_rate else self._rate
        return s.cache_size - self.state.fill <= self._lead(rate)

    def _lead(self, rate: float) -> float:
        """The room left at which the throttle takes hold for a writer at ``rate`` bytes/s:
        none for one that a real drive's cliff would not slow, or whose writing the drive
        folds as fast (at most the post-cache rate, or the drain: the normal rule at the full
        cache serves it). Else the room the writer fills, net of folding, in the time the
        staircase's mean line needs to meet the real drive's: ``burst / 2 / (rate - post)``;
        about half a burst for a writer several times faster than the post-cache rate."""
        s = self.settings
        post, drain = s.post_cache_rate, s.drain_rate
        if rate <= max(post, drain):
            return 0.0
        burst = post * self.release
        return min(burst, 0.5 * burst * (rate - drain) / (rate - post)) + \
            0.5 * rate * self.horizon

    def fold_rate(self, written: float, seconds: float) -> float:
        """Bytes/s folded over a step whose writes brought ``written`` bytes into the cache:
        the drain rate, but in the cliff no faster than the post-cache rate while written at
        it (in proportion to the share of the step spent writing)."""
        s = self.settings
        if not self.state.cliff or s.drain_rate <= s.post_cache_rate or seconds <= 0:
            return s.drain_rate
        busy = min(1.0, written / (s.post_cache_rate * seconds))
        return s.drain_rate - (s.drain_rate - s.post_cache_rate) * busy

    def _entering(self, written: float, seconds: float) -> float:
        """The bytes that enter the cache over a step that completed ``written``: all of them
        out of the cliff; in it, at most the post-cache rate's worth of the step, the rest
        owed to the next steps (at most ``BUSY_CARRY_S`` of writing). The block-I/O throttle
        releases a steady writer in bursts: counted in the step they came, a burst's bytes
        were cut off at the full cache, and the empty step after it folded the cache a
        burst's worth below full, which left the cliff where its margin is that small."""
        s = self.settings
        if not self.state.cliff or seconds <= 0:
            self._owed = 0.0
            return written
        owed = self._owed + written
        entering = min(owed, s.post_cache_rate * seconds)
        self._owed = min(BUSY_CARRY_S * s.post_cache_rate, owed - entering)
        return entering

    def write_limit(self) -> float:
        """Bytes/s writes may run at now (0: unlimited). With an ideal throttle (``release``
        0) the limit tapers before the cliff, so that no more than the room left can be
        written before the next step; a real one releases a burst at each new limit, so the
        limit steps straight down as the cliff takes hold (see :meth:`_taking_hold`)."""
        s, st = self.settings, self.state
        if self._held:
            return s.post_cache_rate
        if self.release:  # one step down, not a taper: each new limit releases a burst
            return s.fast_rate
        room_rate = max(s.post_cache_rate, (s.cache_size - st.fill) / self.horizon)
        return min(s.fast_rate, room_rate) if s.fast_rate else room_rate

    def read_limit(self) -> float:
        """Bytes/s reads may run at now (0: unlimited). Held from the moment writes are
        (:meth:`_taking_hold`): each new limit, read or write, restarts the throttle's
        slices in both directions, and with it the burst the writer gets."""
        return self.settings.fold_read_rate if self._held else 0.0

    @property
    def _held(self) -> bool:
        """In the cliff, or held at the post-cache rate ahead of it."""
        return self.state.cliff or self._hold is not None
