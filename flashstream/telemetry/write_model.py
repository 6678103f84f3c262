"""A drive's write model, learned and remembered: how fast it writes a new file, how many bytes
its write cache takes before the cliff, how fast it writes in the cliff, and how fast the cache
recovers while idle.

Each figure carries its evidence (:class:`Evidence`): *measured* where the drive showed it (a
cliff, a stretch where the drive and not a pacer set the pace, two refills of a drained
cache), a *lower bound* where only that much is known (a pacer held the write below the
drive), or *assumed*; and when. A figure measured long ago is *stale*: saves measure it again
(checkpoint/learning.py). The model is learned by ``flashstream probe --sustained`` and by
checkpoint saves (telemetry/write_learning.py); one JSON file per device lives beside the probe
cache; ``flashstream probe`` shows it, and ``CheckpointWriter(rate="auto")`` plans its saves
from it (checkpoint/pacing.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Dict, List, Optional, Union

from ..sizes import format_size
from .device import device_of
from .probe import default_cache_dir, device_ident

__all__ = ["ASSUMED", "ASSUMED_DRAIN_SHARE", "ESTIMATED", "Evidence", "LOWER_BOUND", "MEASURED",
           "ESTIMATE_SHARE", "PARAMETERS", "SIZING_DRAIN_SHARE", "SIZING_FAST_SHARE",
           "sizing_drain",
           "RECONFIRM_AFTER", "RETRY_AFTER", "WriteModel", "drained", "load_model",
           "model_path"]

MODEL_VERSION = 2

#: The figures a cliff plan rests on.
PARAMETERS = ("cache_size", "post_cache_rate", "drain_rate")
#: Evidence kinds, strongest first. *estimated*: solved from what the drive showed, given other
#: figures of the model (a recovery rate from where a cliff came, given the cache size).
MEASURED, ESTIMATED, LOWER_BOUND, ASSUMED = "measured", "estimated", "lower bound", "assumed"
#: Without a measurement, the cache is assumed to recover at this share of the post-cache rate:
#: the slow end of the drives documented in docs/emulation.md, so the guess errs safe.
ASSUMED_DRAIN_SHARE = 0.5
#: Without a measurement, a cache is sized as if it recovered at this share of the post-cache
#: rate (the fast end of the same drives): bytes before a cliff less a faster drain give the
#: smaller cache, so the guess errs safe there too. (At the post-cache rate, the fast end
#: before docs/emulation.md's family was widened to recoveries of 1.6 x it, a drive folding
#: at 1.34 x was sized at 1.37 x its cache.)
SIZING_DRAIN_SHARE = 1.6
#: ... and at most this share of the new-file rate: a cliff's bytes less 1.6 x a post-cache
#: rate read 1.67 x high came out negative, and the model kept no cache at all.
SIZING_FAST_SHARE = 0.6
#: The share of an estimated recovery rate that pacing counts on (and the cache estimate
#: drains at): an estimate carries a bias it cannot see, such as the detection lag of the one
#: cliff a single refill reading comes from, which puts it high by a window or two of a
#: reading a second or more long. Pacing's own margin for a drain too high (PlanSettings.
#: sustain) comes on top, so this one is kept to the lag's size: at 0.9 the two stacked to
#: 0.81 of the drain, and saves from a right model took 1.3 x the shortest. Single readings
#: now show no lag to speak of (0.88-1.10 x the drive's, centred on it), and every share
#: short of the drain is bought with the save's duration: replayed through the planner on
#: the models learned in three ten-drive runs, 0.95 ran one save in 76 over 1.3 x the
#: shortest, 0.98 none, with the cache at most 0.94 full (docs/emulation.md).
ESTIMATE_SHARE = 0.98
#: Seconds after which a measured (or estimated) figure is stale and a save measures it again:
#: a drive's behaviour drifts (firmware, wear, other tenants), and a model that is never
#: tested upward would stay too slow for good.
RECONFIRM_AFTER = 24 * 3600.0
#: Seconds before a figure a measurement failed to measure (a refill cut short by the next
#: save, say) is tried again: not at every save, each of which would meet the cliff.
RETRY_AFTER = 600.0


def sizing_drain(post_cache_rate: Optional[float], fast_rate: Optional[float]
                 ) -> Optional[float]:
    """The recovery rate a cache is sized by where none was measured (the fast end of
    drives: ``SIZING_DRAIN_SHARE`` of the post-cache rate, at most ``SIZING_FAST_SHARE`` of
    the new-file rate); None without a post-cache rate."""
    if not post_cache_rate:
        return None
    high = SIZING_DRAIN_SHARE * post_cache_rate
    return min(high, SIZING_FAST_SHARE * fast_rate) if fast_rate else high


def drained(fill: float, rate: float, seconds: float) -> float:
    """Bytes left in a write cache holding ``fill`` after folding at ``rate`` for
    ``seconds`` (the one arithmetic the model, the planner and the emulator share)."""
    return max(0.0, fill - rate * max(0.0, seconds))


@dataclasses.dataclass
class Evidence:
    """How one figure was learned: ``how`` (measured, lower bound, assumed), from what
    (``source``: probe, save, learning save, ...), when (``at``, time.time()), and over how
    many seconds of the drive's own pace (``seconds``; 0 where not a rate)."""

    how: str
    source: str
    at: float
    seconds: float = 0.0

    def age(self, now: Optional[float] = None) -> float:
        return (time.time() if now is None else now) - self.at


@dataclasses.dataclass
class WriteModel:
    """What is known of one drive's writes; None where not yet measured."""

    device: str
    fast_rate: Optional[float] = None        # bytes/s into a new file, cache not full
    cache_size: Optional[float] = None       # bytes the write cache holds
    post_cache_rate: Optional[float] = None  # bytes/s once it is full
    drain_rate: Optional[float] = None       # bytes/s it recovers (None: assumed, see below)
    cliff_free: float = 0.0                  # the most bytes seen written without a cliff
    fill: float = 0.0                        # estimated bytes in the cache at fill_time
    fill_time: float = 0.0                   # time.time() of that estimate
    observations: int = 0
    updated: float = 0.0
    sources: List[str] = dataclasses.field(default_factory=list)
    evidence: Dict[str, Evidence] = dataclasses.field(default_factory=dict)
    path: Optional[str] = dataclasses.field(default=None, compare=False)

    @property
    def has_cliff(self) -> bool:
        return self.cache_size is not None and self.post_cache_rate is not None

    @property
    def recovery_rate(self) -> Optional[float]:
        """Bytes/s the cache drains: measured, else assumed at ``ASSUMED_DRAIN_SHARE`` of the
        post-cache rate."""
        if self.drain_rate is not None:
            return self.drain_rate
        return None if self.post_cache_rate is None else (
            ASSUMED_DRAIN_SHARE * self.post_cache_rate)

    @property
    def sizing_recovery(self) -> Optional[float]:
        """The recovery rate a cache is sized by (bytes written less what drained): measured
        or estimated within ``RECONFIRM_AFTER`` (or set with no evidence recorded), else
        ``SIZING_DRAIN_SHARE`` of the post-cache rate, at most ``SIZING_FAST_SHARE`` of the
        new-file rate (a post-cache rate read high would otherwise leave no cache), or a
        lower bound above that. A stale or assumed figure may be several times off either
        way; sized by one too slow, a cache came out 1.9 x the drive's, and every later
        measurement of the drive was sized by it. The fast end errs to the smaller cache."""
        found = self.evidence.get("drain_rate")
        if self.drain_rate is None:
            return sizing_drain(self.post_cache_rate, self.fast_rate)
        if found is None or (found.how in (MEASURED, ESTIMATED)
                             and "drain_rate" not in self.unconfirmed()):
            return self.drain_rate
        high = sizing_drain(self.post_cache_rate, self.fast_rate)
        if high is None:
            return self.drain_rate
        return max(self.drain_rate, high) if found.how == LOWER_BOUND else high

    @property
    def planning_recovery(self) -> Optional[float]:
        """The recovery rate pacing counts on: :attr:`recovery_rate`, an estimated one at
        ``ESTIMATE_SHARE`` of it."""
        rate = self.recovery_rate
        if rate is not None and self.how("drain_rate") == ESTIMATED:
            return ESTIMATE_SHARE * rate
        return rate

    # -- evidence --------------------------------------------------------------------------
    def note(self, name: str, how: str, source: str, seconds: float = 0.0,
             when: Optional[float] = None) -> None:
        """Record how ``name`` (one of :data:`PARAMETERS`) was just learned."""
        self.evidence[name] = Evidence(how, source, time.time() if when is None else when,
                                       seconds)

    def how(self, name: str) -> str:
        found = self.evidence.get(name)
        if found is not None:
            return found.how
        return ASSUMED if name == "drain_rate" or getattr(self, name) is None else LOWER_BOUND

    def unconfirmed(self, now: Optional[float] = None, max_age: float = RECONFIRM_AFTER,
                    retry_after: float = RETRY_AFTER) -> List[str]:
        """The figures of the cliff plan to measure again: never tried, measured more than
        ``max_age`` seconds ago, or not measured by a try more than ``retry_after`` ago."""
        out = []
        for name in PARAMETERS:
            found = self.evidence.get(name)
            if found is None or found.age(now) > (
                    max_age if found.how in (MEASURED, ESTIMATED) else retry_after):
                out.append(name)
        return out

    # -- the cache estimate ----------------------------------------------------------------
    def fill_at(self, when: Optional[float] = None, written: float = 0.0) -> float:
        """Estimated bytes in the cache at ``when`` (default now): the last estimate, drained
        at the recovery rate since. ``written``: bytes the drive took since that estimate from
        anything else (other processes, this one's smaller writes). Spread evenly over the
        time since, they fill the cache as a slower drain would, which ends where adding them
        to the estimate and then draining does (until the cache fills: capped at its size)."""
        if not self.has_cliff or not (self.fill or written):
            return 0.0
        now = time.time() if when is None else when
        fill = drained(self.fill + max(0.0, written), self.planning_recovery or 0.0,
                       now - self.fill_time)
        return min(fill, float(self.cache_size))

    def set_fill(self, fill: float, when: Optional[float] = None) -> None:
        cap = self.cache_size if self.cache_size is not None else fill
        self.fill = min(max(0.0, fill), cap)
        self.fill_time = time.time() if when is None else when

    # -- persistence and display -------------------------------------------------------------
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

    def to_dict(self) -> Dict[str, object]:
        """The model as plain values, with each figure's evidence and its age in seconds."""
        data = {k: v for k, v in dataclasses.asdict(self).items() if k != "path"}
        now = time.time()
        for name, found in self.evidence.items():
            data["evidence"][name]["age_s"] = found.age(now)
        data["recovery_rate"] = self.recovery_rate
        return data

    def describe(self) -> str:
        def rate(v: Optional[float]) -> str:
            return f"{v / 1e9:.3f} GB/s" if v else "not measured"

        now = time.time()

        def known(name: str) -> str:
            found = self.evidence.get(name)
            if found is None:
                return f"  [{self.how(name)}]"
            aged = found.how in (MEASURED, ESTIMATED) and found.age(now) > RECONFIRM_AFTER
            stale = ", stale" if aged else ""
            return f"  [{found.how}, {found.source}, {_age(found.age(now))} ago{stale}]"

        lines = [f"write model of {self.device} ({self.observations} observations: "
                 f"{', '.join(sorted(set(self.sources))) or 'none'})",
                 f"  new-file write     {rate(self.fast_rate)}"]
        if self.has_cliff:
            lines += [f"  write cache        {format_size(int(self.cache_size))}"
                      f"{known('cache_size')}",
                      f"  in the cliff       {rate(self.post_cache_rate)}"
                      f"{known('post_cache_rate')}",
                      f"  recovery           {rate(self.recovery_rate)}{known('drain_rate')}",
                      f"  cache fill now     {format_size(int(self.fill_at()))} (estimate)"]
        else:
            seen = format_size(int(self.cliff_free)) if self.cliff_free else "nothing yet"
            lines.append(f"  write cliff        none seen (largest write watched: {seen})")
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


def load_model(path: Union[str, os.PathLike], cache_dir: Optional[Path] = None) -> WriteModel:
    """The remembered write model of the drive that holds ``path`` (an empty one if none). A
    model of the previous format keeps its figures, with no evidence (so saves confirm them)."""
    target = model_path(path, cache_dir)
    try:
        data = json.loads(target.read_text())
        if data.pop("version", None) not in (1, MODEL_VERSION):
            raise ValueError("unknown version")
        fields = {f.name for f in dataclasses.fields(WriteModel)}
        evidence = {name: Evidence(**{k: v for k, v in found.items() if k != "age_s"})
                    for name, found in (data.pop("evidence", None) or {}).items()}
        model = WriteModel(**{k: v for k, v in data.items() if k in fields},
                           evidence=evidence)
    except (OSError, ValueError, TypeError):
        model = WriteModel(device=target.stem[len("write-model-"):])
    model.path = str(target)
    return model
