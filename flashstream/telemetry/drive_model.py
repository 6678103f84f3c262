"""A drive's write model: what ``rate="auto"`` knows of an SLC-cache drive, learned only from
what the drive showed to the saves (checkpoint/drive_learning.py) or to ``flashstream probe
--sustained``. Each figure is a physical quantity of the drive:

- ``fast_rate``: bytes/s the drive takes while its cache has room;
- ``post_cache_rate``: bytes/s it takes once the cache is full (in its cliff);
- ``drain_rate``: bytes/s the cache frees while the drive folds;
- the cache, as the cliff that showed it (:class:`ReferenceCliff`): a write from a known fill
  met the cliff after so many bytes and seconds, so the cache's size by a drain ``d`` is
  ``start_fill + bytes - d * seconds``: the size and the drain err together, and a plan by
  them stays on the right side of the cliff seen (docs/checkpoint.md);
- ``cliff_margin``: the bytes the cache had freed when the drive was last seen out of its
  cliff (at most): a drive leaves its cliff only once folding has freed a margin.

Each figure carries how it is known (:class:`Evidence`: measured, a lower bound, assumed) and
when. One JSON file per device lives beside the probe cache; ``flashstream probe`` shows it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Union

from ..sizes import format_size
from .device import device_of
from .probe import default_cache_dir, device_ident, new_file_write

__all__ = ["ASSUMED", "ASSUMED_DRAIN_SHARE", "LOWER_BOUND", "MEASURED", "ClearSchedule",
           "DriveModel", "Evidence", "ReferenceCliff", "StartFill", "assumed_drain",
           "left_after_folding", "load_model", "model_path", "remembered_write_rate"]

MODEL_VERSION = 3
MEASURED, LOWER_BOUND, ASSUMED = "measured", "lower bound", "assumed"
#: Without a reading, the cache is assumed to drain at this share of the post-cache rate: the
#: slow end of the drives in docs/emulation.md's family (50-160%), so the guess errs safe.
ASSUMED_DRAIN_SHARE = 0.5
#: ... and, without a post-cache rate, at this share of the new-file rate: half the family's
#: slowest post-cache rate (15% of the new-file rate).
ASSUMED_FAST_DRAIN_SHARE = 0.075
#: Without a sighting, the drive is assumed to leave its cliff only once folding has freed this
#: share of its cache: the widest margin in docs/emulation.md's family.
ASSUMED_CLIFF_MARGIN = 0.25
#: The smallest cache a reference cliff sizes: below it the figures contradict each other.
MIN_CACHE = float(1 << 20)
#: Seconds two cliffs must come apart to read a drain off them: a look's error in placing
#: each moves the reading by (post-cache rate - drain) x the look over this span.
MIN_SPAN_S = 0.2


def assumed_drain(post_cache_rate: Optional[float], fast_rate: Optional[float]
                  ) -> Optional[float]:
    """The drain rate assumed without a reading: the slow end of drives (None: nothing known)."""
    if post_cache_rate:
        return ASSUMED_DRAIN_SHARE * post_cache_rate
    return ASSUMED_FAST_DRAIN_SHARE * fast_rate if fast_rate else None


def left_after_folding(fill: float, rate: float, seconds: float) -> float:
    """Bytes left in a cache holding ``fill`` after folding at ``rate`` for ``seconds`` (the
    model, the planner and the emulator share it)."""
    return max(0.0, fill - rate * max(0.0, seconds))


@dataclasses.dataclass
class Evidence:
    """How a figure was learned: ``how``, ``source`` (save or probe), ``at`` (time.time())."""

    how: str
    source: str
    at: float

    def age(self, now: Optional[float] = None) -> float:
        return (time.time() if now is None else now) - self.at


@dataclasses.dataclass(frozen=True)
class StartFill:
    """The cache's fill when a write began, by the drain: ``fill`` bytes ``before`` seconds
    earlier, plus ``since`` bytes the drive took meanwhile, less what drained."""

    fill: float = 0.0
    since: float = 0.0
    before: float = 0.0

    def __call__(self, drain: float) -> float:
        return max(0.0, self.fill + self.since - drain * self.before)


@dataclasses.dataclass
class ReferenceCliff:
    """A cliff met by a write after ``seconds`` in which the drive took ``bytes``, from a start
    fill by the drain (``fill``, ``since``, ``before`` as in :class:`StartFill`)."""

    seconds: float
    bytes: float
    fill: float = 0.0
    since: float = 0.0
    before: float = 0.0
    spread: Optional[float] = None  # seconds its placement may be off (None: not known)

    def start_fill(self, drain: float) -> float:
        return StartFill(self.fill, self.since, self.before)(drain)

    def cache(self, drain: float) -> float:
        """The cache's size, given that it drained at ``drain`` bytes/s meanwhile."""
        return max(MIN_CACHE, self.start_fill(drain) + self.bytes - drain * self.seconds)

    def latest(self, rate: float, spread: float) -> ReferenceCliff:
        """The same cliff placed ``spread`` seconds later (at ``rate``): the largest cache it
        can show, for a bound that must not overstate the drain."""
        return dataclasses.replace(self, seconds=self.seconds + spread,
                                   bytes=self.bytes + spread * rate, spread=0.0)

    def drain_to(self, seconds: float, nbytes: float, start_fill: Callable[[float], float],
                 fastest: float, bound: bool = False) -> Optional[float]:
        """The drain under which a later write from ``start_fill(drain)`` met the same cliff
        after ``seconds`` and ``nbytes``: ``start_fill(d) + nbytes - d * seconds = cache(d)``.
        None where no drain up to ``fastest`` puts it there, or within ``MIN_SPAN_S``.
        ``bound``: the write did not meet the cliff there, so the drain is at least this
        (``fastest`` where even that would not have made it meet the cliff)."""
        if seconds - self.seconds < MIN_SPAN_S:
            return None

        def excess(drain: float) -> float:
            return (start_fill(drain) + nbytes - drain * seconds
                    - (self.start_fill(drain) + self.bytes - drain * self.seconds))

        if not excess(0.0) > 0:
            return None
        if excess(fastest) >= 0:
            return fastest if bound else None
        low, high = 0.0, fastest
        for _ in range(50):  # to well under a byte per second
            middle = 0.5 * (low + high)
            low, high = (middle, high) if excess(middle) > 0 else (low, middle)
        return 0.5 * (low + high)


@dataclasses.dataclass
class ClearSchedule:
    """A write the drive took without a cliff: ``burst`` bytes unpaced, then at ``pace`` bytes/s
    (0: unpaced throughout), ``total`` in all, from ``start_fill`` in the cache. Written so
    again from a cache that holds no more, it stays clear: nothing needs inferring."""

    burst: float
    pace: float
    total: float
    start_fill: float = 0.0

    def covers(self, total: float, fill: float) -> bool:
        """Whether a write of ``total`` bytes from ``fill`` is one this schedule took clear."""
        return self.total >= total and fill <= self.start_fill


@dataclasses.dataclass
class DriveModel:
    """What is known of one drive's writes; None where nothing was seen yet."""

    device: str
    fast_rate: Optional[float] = None
    post_cache_rate: Optional[float] = None
    drain_rate: Optional[float] = None
    cliff: Optional[ReferenceCliff] = None
    cliff_margin: Optional[float] = None
    crossed: Optional[float] = None  # the slowest tail pace a test saw meet the cliff
    clear: Optional[ClearSchedule] = None  # the last write the drive took without a cliff
    fill: float = 0.0          # estimated bytes in the cache at fill_time ...
    fill_time: float = 0.0     # ... (time.time())
    fill_disk: Optional[int] = None  # the drive's written-bytes counter then (None: unknown)
    evidence: Dict[str, Evidence] = dataclasses.field(default_factory=dict)
    sources: List[str] = dataclasses.field(default_factory=list)
    path: Optional[str] = dataclasses.field(default=None, compare=False)

    # -- derived figures -------------------------------------------------------------------
    @property
    def has_cliff(self) -> bool:
        return self.cliff is not None

    @property
    def drain(self) -> Optional[float]:
        """The drain rate plans count on: measured or bounded, else assumed."""
        if self.drain_rate is not None:
            return self.drain_rate
        return assumed_drain(self.post_cache_rate, self.fast_rate)

    @property
    def cache_size(self) -> Optional[float]:
        """The cache's size by :attr:`drain` (None without a cliff)."""
        if self.cliff is None:
            return None
        return self.cliff.cache(self.drain or 0.0)

    @property
    def margin(self) -> Optional[float]:
        """Bytes the drive frees before it leaves its cliff (seen, else assumed)."""
        size = self.cache_size
        if size is None:
            return None
        if self.cliff_margin is not None:
            return min(self.cliff_margin, size)
        return ASSUMED_CLIFF_MARGIN * size

    def how(self, name: str) -> str:
        found = self.evidence.get(name)
        return found.how if found is not None else ASSUMED

    def note(self, name: str, how: str, source: str, when: Optional[float] = None) -> None:
        self.evidence[name] = Evidence(how, source, time.time() if when is None else when)

    # -- the cache estimate ----------------------------------------------------------------
    def fill_at(self, when: Optional[float] = None, disk: Optional[int] = None) -> float:
        """Estimated bytes in the cache at ``when`` (default now): the last estimate, plus what
        the drive took since (``disk``: its counter now), drained at :attr:`drain`."""
        size = self.cache_size
        if size is None or not (self.fill or self._written_since(disk)):
            return 0.0
        now = time.time() if when is None else when
        fill = left_after_folding(self.fill + self._written_since(disk), self.drain or 0.0,
                       now - self.fill_time)
        return min(fill, size)

    def _written_since(self, disk: Optional[int]) -> float:
        if disk is None or self.fill_disk is None or disk < self.fill_disk:
            return 0.0  # unknown, or the counter started again (a reboot)
        return float(disk - self.fill_disk)

    def start_fill(self, when: float, disk: Optional[int]) -> StartFill:
        """The fill of a write beginning at ``when`` (counter ``disk``), by the drain."""
        if self.cliff is None:
            return StartFill()
        return StartFill(self.fill, self._written_since(disk), max(0.0, when - self.fill_time))

    def set_full(self, when: float, disk: int) -> None:
        """The cache was full at ``when`` (counter ``disk``): the fill is anchored where the
        reference cliff's write began, so that every later fill stays the one function of the
        drain that the cliff's reading is."""
        ref = self.cliff
        if ref is None:
            raise ValueError("a full cache needs a cliff to size it")
        self.fill = ref.fill + ref.since + ref.bytes
        self.fill_time, self.fill_disk = when - ref.before - ref.seconds, disk

    def set_fill(self, fill: float, when: float, disk: Optional[int]) -> None:
        size = self.cache_size
        self.fill = max(0.0, fill if size is None else min(fill, size))
        self.fill_time, self.fill_disk = when, disk

    # -- persistence and display -----------------------------------------------------------
    def save(self) -> None:
        """Writes the model to its file atomically (none: a no-op)."""
        if not self.path:
            return
        target = Path(self.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dict(self.to_dict(ages=False), version=MODEL_VERSION),
                                  indent=1))
        os.replace(tmp, target)

    def to_dict(self, ages: bool = True) -> Dict[str, object]:
        """The model as plain values (each figure's age in seconds where ``ages``)."""
        data = {k: v for k, v in dataclasses.asdict(self).items() if k != "path"}
        if ages:
            now = time.time()
            for name, found in self.evidence.items():
                data["evidence"][name]["age_s"] = found.age(now)
            data.update(cache_size=self.cache_size, drain=self.drain)
        return data

    def describe(self) -> str:
        def rate(v: Optional[float]) -> str:
            return f"{v / 1e9:.3f} GB/s" if v else "not measured"

        def known(name: str) -> str:
            found = self.evidence.get(name)
            if found is None:
                return f"  [{ASSUMED}]"
            return f"  [{found.how}, {found.source}, {_age(found.age())} ago]"

        seen = ", ".join(sorted(set(self.sources))) or "nothing yet"
        lines = [f"write model of {self.device} (from {seen})",
                 f"  new-file write     {rate(self.fast_rate)}"]
        if self.clear is not None:
            paced = (f", {format_size(int(self.clear.burst))} unpaced then "
                     f"{rate(self.clear.pace)}" if self.clear.pace else " unpaced")
            lines.append(f"  taken clear        {format_size(int(self.clear.total))}{paced}")
        if self.cliff is None:
            if self.clear is None:
                lines.append("  write cliff        none seen (no write watched yet)")
            return "\n".join(lines)
        lines += [f"  write cache        {format_size(int(self.cache_size))}"
                  f"{known('drain_rate')} (sized by the drain)",
                  f"  in the cliff       {rate(self.post_cache_rate)}{known('post_cache_rate')}",
                  f"  drain              {rate(self.drain)}{known('drain_rate')}",
                  f"  leaves the cliff   {format_size(int(self.margin))} below full"
                  f"{known('cliff_margin')}",
                  f"  cache fill now     {format_size(int(self.fill_at()))} (estimate)"]
        return "\n".join(lines)


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{max(0.0, seconds):.0f} s"


def model_path(path: Union[str, os.PathLike], cache_dir: Optional[Path] = None) -> Path:
    """Where the write model of the drive that holds ``path`` is kept."""
    ident = device_ident(device_of(path, health=False).to_dict())
    return Path(cache_dir or default_cache_dir()) / f"write-model-{ident}.json"


def load_model(path: Union[str, os.PathLike], cache_dir: Optional[Path] = None) -> DriveModel:
    """The remembered write model of the drive that holds ``path`` (empty if none or of
    another layout: the saves learn the drive again)."""
    target = model_path(path, cache_dir)
    try:
        data = json.loads(target.read_text())
        if data.pop("version", None) != MODEL_VERSION:
            raise ValueError("another layout")
        evidence = {k: Evidence(**{f: v for f, v in e.items() if f != "age_s"})
                    for k, e in (data.pop("evidence", None) or {}).items()}
        cliff, clear = data.pop("cliff", None), data.pop("clear", None)
        fields = {f.name for f in dataclasses.fields(DriveModel)}
        model = DriveModel(**{k: v for k, v in data.items() if k in fields},
                           evidence=evidence,
                           cliff=ReferenceCliff(**cliff) if cliff else None,
                           clear=ClearSchedule(**clear) if clear else None)
    except (OSError, ValueError, TypeError, KeyError):
        model = DriveModel(device=target.stem[len("write-model-"):])
    model.path = str(target)
    return model


def remembered_write_rate(path: Union[str, os.PathLike], cache_dir: Optional[Path] = None
                          ) -> float:
    """The drive's new-file write bytes/s: remembered, else measured (a 1 GiB write, at most
    3 s, for the emulator's scaling) and remembered."""
    model = load_model(path, cache_dir)
    if not model.fast_rate:
        point = new_file_write(path, "1GiB", seconds=3.0)
        model.fast_rate = point.bytes / point.seconds
        model.sources.append("write probe")
        model.save()
    return float(model.fast_rate)
