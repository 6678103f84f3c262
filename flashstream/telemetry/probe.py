"""The device probe: what the drive itself does, measured with flashstream's own C++ engine.

Like fio, under the path: sequential O_DIRECT read GB/s over a grid of request sizes and
queue depths on a temporary file (created with random data, removed afterwards), write GB/s
over the same grid into new preallocated files (as a checkpoint writes: a rewrite of an existing
file skips block allocation and ran 1.30x fio's new-file write here), 4 KiB random-read IOPS
with latency percentiles, and optionally a sustained new-file write that records GB/s over time
so an SLC-cache cliff shows as a drop. Results are cached per device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

from .. import engine
from ..settings import resolve
from ..sizes import Size, format_size, parse_size
from .device import device_of
from .histogram import LatencyHistogram

__all__ = ["EMULATED_DRIVE_ENV", "ProbeConfig", "ProbePoint", "ProbeResult", "measure",
           "new_file_write", "preallocated_file", "probe"]

OPS = ("read", "write")
PATTERNS = ("sequential", "random")
CACHE_VERSION = 2  # 2: write points into new files (1 rewrote the probe file)


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
    """What the probe measures. Sizes accept ints or strings like ``"1MiB"``."""

    size: Size = "1GiB"                    # temp file size
    block_sizes: Tuple[Size, ...] = ("128KiB", "1MiB", "4MiB")
    queue_depths: Tuple[int, ...] = (1, 8, 32)
    random_block: Size = "4KiB"
    random_depths: Tuple[int, ...] = (1, 32)
    seconds: float = 2.0                   # time cap per grid point
    sustained: Size = 0                    # bytes written in the sustained test (0 = skip)
    interval: float = 0.25                 # sustained-write timeline resolution, seconds

    def __post_init__(self) -> None:
        norm = object.__setattr__
        norm(self, "size", parse_size(self.size, name="size"))
        norm(self, "block_sizes", tuple(parse_size(b, name="block_sizes") for b in
                                        self.block_sizes))
        norm(self, "random_block", parse_size(self.random_block, name="random_block"))
        norm(self, "sustained", parse_size(self.sustained, name="sustained"))
        if self.size < 1 << 20:
            raise ValueError(f"size must be at least 1MiB, got {self.size}")
        for bs in self.block_sizes + (self.random_block,):
            if bs < 512 or bs % 512 or bs > self.size:
                raise ValueError(f"block sizes must be multiples of 512 up to size, got {bs}")
        for qd in self.queue_depths + self.random_depths:
            if not 1 <= qd <= 256:
                raise ValueError(f"queue depths must be from 1 to 256, got {qd}")
        if self.seconds <= 0 or self.interval <= 0:
            raise ValueError("seconds and interval must be positive")


@dataclasses.dataclass(frozen=True)
class ProbePoint:
    """One measurement: a request size and queue depth, a direction and a pattern."""

    op: str
    pattern: str
    block_size: int
    queue_depth: int
    bytes: int
    seconds: float
    requests: int
    direct: bool
    latency_us: Dict[str, Optional[float]]
    timeline: Tuple[Tuple[float, float], ...] = ()  # (seconds since start, GB/s in interval)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def iops(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def to_dict(self) -> Dict[str, object]:
        out = dataclasses.asdict(self)
        out.update(gbps=self.gbps, iops=self.iops)
        return out

    @classmethod
    def from_dict(cls, data: Dict[str, object]) -> ProbePoint:
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in fields}
        values["timeline"] = tuple(tuple(p) for p in values.get("timeline", ()))
        return cls(**values)


@dataclasses.dataclass
class ProbeResult:
    device: Dict[str, object]
    engine: str
    config: Dict[str, object]
    points: List[ProbePoint]
    created: float = dataclasses.field(default_factory=time.time)
    cached: bool = False

    def select(self, op: str, pattern: str = "sequential") -> List[ProbePoint]:
        return [p for p in self.points if p.op == op and p.pattern == pattern and not p.timeline]

    def best(self, op: str) -> Optional[ProbePoint]:
        """The sequential point with the highest GB/s for ``op``."""
        points = self.select(op)
        return max(points, key=lambda p: p.gbps) if points else None

    def point(self, op: str, block_size: Size, queue_depth: int,
              pattern: str = "sequential") -> Optional[ProbePoint]:
        bs = parse_size(block_size)
        for p in self.select(op, pattern):
            if p.block_size == bs and p.queue_depth == queue_depth:
                return p
        return None

    def nearest(self, op: str, block_size: int, queue_depth: int) -> Optional[ProbePoint]:
        """The sequential ``op`` point at this shape, else the nearest one (log distance)."""
        points = self.select(op)
        if not points:
            return None
        return min(points, key=lambda p: (abs(math.log2(p.block_size / block_size))
                                          + abs(math.log2(p.queue_depth / queue_depth))))

    @property
    def sustained(self) -> Optional[ProbePoint]:
        return next((p for p in self.points if p.timeline), None)

    def to_dict(self) -> Dict[str, object]:
        best = {op: (point.to_dict() if (point := self.best(op)) else None) for op in OPS}
        return {"version": CACHE_VERSION, "device": self.device, "engine": self.engine,
                "config": self.config, "created": self.created, "best": best,
                "points": [p.to_dict() for p in self.points]}

    @classmethod
    def from_dict(cls, data: Dict[str, object], *, cached: bool = False) -> ProbeResult:
        if data.get("version") != CACHE_VERSION:
            raise ValueError(f"probe cache version {data.get('version')!r}, not {CACHE_VERSION}")
        return cls(device=data["device"], engine=data["engine"], config=data["config"],
                   points=[ProbePoint.from_dict(p) for p in data["points"]],
                   created=data["created"], cached=cached)

    def format_table(self) -> str:
        dev = self.device
        lines = [f"device {dev.get('name')} ({dev.get('model') or dev.get('transport')}), "
                 f"engine {self.engine}" + (" [cached]" if self.cached else "")]
        lines.append(f"{'test':18s} {'bs':>9s} {'qd':>4s} {'GB/s':>7s} {'IOPS':>9s} "
                     f"{'p50 us':>8s} {'p95 us':>8s} {'p99 us':>8s}")
        for p in self.points:
            if p.timeline:
                continue
            lat = p.latency_us
            lines.append(f"{p.pattern[:3] + ' ' + p.op:18s} {format_size(p.block_size):>9s} "
                         f"{p.queue_depth:4d} {p.gbps:7.3f} {p.iops:9.0f} "
                         f"{_num(lat.get('p50'))} {_num(lat.get('p95'))} {_num(lat.get('p99'))}")
        for op in OPS:
            best = self.best(op)
            if best:
                lines.append(f"best sequential {op}: {best.gbps:.3f} GB/s "
                             f"({format_size(best.block_size)} x {best.queue_depth})")
        sustained = self.sustained
        if sustained:
            rates = [g for _, g in sustained.timeline]
            lines.append(f"sustained write {format_size(sustained.bytes)}: {sustained.gbps:.3f} "
                         f"GB/s overall, intervals {min(rates):.3f}..{max(rates):.3f} GB/s")
        return "\n".join(lines)


def _num(value: Optional[float]) -> str:
    return f"{value:8.0f}" if value is not None else f"{'-':>8s}"


def measure(path: Union[str, os.PathLike], *, op: str, pattern: str = "sequential",
            block_size: Size = "1MiB", queue_depth: int = 32, nbytes: Size = 0,
            seconds: float = 0.0, interval: float = 0.0, engine_kind: Optional[str] = None,
            seed: int = 0, stop_below: float = 0.0, stop_after: float = 0.0,
            stop_smooth: float = 0.0, cancel: Optional[engine.ProbeCancel] = None
            ) -> ProbePoint:
    """One fio-like run on an existing file (``nbytes=0``: the whole file).

    ``stop_below`` (bytes/s, 0: never): stop once ``stop_after`` seconds have passed since the
    timeline (``interval`` > 0) last ran at it or faster, each rate the mean over
    ``stop_smooth`` seconds (or since the start, where it never did), as when a write meets a
    drive's cliff.
    ``cancel`` (an ``engine.ProbeCancel``): stop issuing once another thread sets it."""
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {', '.join(PATTERNS)}, got {pattern!r}")
    kind = resolve(engine=engine_kind).engine
    if kind == "python":
        raise ValueError("the probe needs a C++ engine: auto, uring or threads")
    bs = parse_size(block_size, name="block_size")
    raw = engine.run_probe(os.fspath(path), op, pattern, bs, queue_depth,
                           parse_size(nbytes, name="nbytes"), float(seconds), kind, True, seed,
                           float(interval), float(stop_below), float(stop_after),
                           float(stop_smooth), cancel)
    hist = LatencyHistogram.from_core(raw)
    return ProbePoint(op=op, pattern=pattern, block_size=bs, queue_depth=queue_depth,
                      # A write is done when it is durable: the final fdatasync counts.
                      bytes=int(raw["bytes"]),
                      seconds=float(raw["seconds"]) + float(raw.get("sync_seconds", 0.0)),
                      requests=int(raw["requests"]), direct=bool(raw["direct"]),
                      latency_us=hist.summary("us"), timeline=_rates(raw["timeline"]))


def _rates(timeline) -> Tuple[Tuple[float, float], ...]:
    """(end of interval s, bytes) points -> (end of interval s, GB/s over that interval); the
    last interval is usually shorter, so each rate uses its own width."""
    out, previous = [], 0.0
    for end, nbytes in timeline:
        width = float(end) - previous
        if width > 0:
            out.append((float(end), float(nbytes) / width / 1e9))
        previous = float(end)
    return tuple(out)


def device_ident(device: Dict[str, object]) -> str:
    """A file-name-safe name of a device (its DeviceInfo dict): name, serial and number."""
    ident = "-".join(str(device.get(k) or "x") for k in ("name", "serial", "dev"))
    return ident.replace("/", "_").replace(":", ".")


def _cache_file(cache_dir: Path, device: Dict[str, object], config: ProbeConfig,
                kind: str) -> Path:
    """One cache entry per device, engine and probe configuration (a stable digest)."""
    digest = hashlib.sha1(json.dumps(dataclasses.asdict(config), sort_keys=True).encode())
    return cache_dir / f"{device_ident(device)}-{kind}-{digest.hexdigest()[:10]}.json"


#: Set by flashstream.emulation for what it throttles: the emulated drive's tag.
EMULATED_DRIVE_ENV = "FLASHSTREAM_EMULATED_DRIVE"


def default_cache_dir() -> Path:
    """Where probe results and write models are remembered: ``$XDG_CACHE_HOME/flashstream/
    probe`` (default ``~/.cache``). Under an emulated drive (``FLASHSTREAM_EMULATED_DRIVE``
    set), a subdirectory of that drive's own: what is measured through the emulator describes
    the emulation, and must never become what the real drive is remembered as."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    out = Path(base) / "flashstream" / "probe"
    emulated = os.environ.get(EMULATED_DRIVE_ENV)
    if emulated:
        out = out / ("emulated-" + "".join(c if c.isalnum() or c in "-_." else "_"
                                           for c in emulated))
    return out


def probe(path: Union[str, os.PathLike] = ".", *, config: Optional[ProbeConfig] = None,
          engine_kind: Optional[str] = None, refresh: bool = False,
          cache_dir: Optional[Union[str, os.PathLike]] = None,
          progress: Optional[Callable[[str], None]] = None, **config_kw) -> ProbeResult:
    """Measure the drive behind ``path`` (a directory on it); cached per device and config.

    Keyword arguments not listed here build the :class:`ProbeConfig` (``size="256MiB"``,
    ``sustained="8GiB"``, ...). ``refresh=True`` measures again even when a cached result
    exists.
    """
    config = config or ProbeConfig(**config_kw)
    directory = Path(path)
    if not directory.is_dir():
        raise NotADirectoryError(f"probe needs a directory on the drive, got {path!s}")
    device = device_of(directory, health=False).to_dict()
    kind = engine.engine_name(resolve(engine=engine_kind).engine)
    cache = _cache_file(Path(cache_dir) if cache_dir else default_cache_dir(), device, config,
                        kind)
    if not refresh and cache.exists():
        try:
            return ProbeResult.from_dict(json.loads(cache.read_text()), cached=True)
        except (ValueError, KeyError, TypeError):
            pass  # an unreadable cache entry is measured again
    points = _run_grid(directory, config, kind, progress or (lambda _msg: None))
    result = ProbeResult(device=device, engine=kind, config=_config_dict(config), points=points)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(result.to_dict(), indent=1))
    return result


def _config_dict(config: ProbeConfig) -> Dict[str, object]:
    return {k: list(v) if isinstance(v, tuple) else v
            for k, v in dataclasses.asdict(config).items()}


def _run_grid(directory: Path, config: ProbeConfig, kind: str,
              progress: Callable[[str], None]) -> List[ProbePoint]:
    fd, name = tempfile.mkstemp(prefix=".flashstream-probe-", dir=directory)
    os.close(fd)
    points: List[ProbePoint] = []
    try:
        progress(f"writing a {format_size(config.size)} probe file")
        engine.create_probe_file(name, config.size)
        for op in OPS:
            for bs in config.block_sizes:
                for qd in config.queue_depths:
                    progress(f"sequential {op} {format_size(bs)} x {qd}")
                    if op == "write":
                        points.append(new_file_write(directory, config.size, block_size=bs,
                                                     queue_depth=qd, seconds=config.seconds,
                                                     interval=0.0, engine_kind=kind))
                    else:
                        points.append(measure(name, op=op, block_size=bs, queue_depth=qd,
                                              seconds=config.seconds, engine_kind=kind))
        for qd in config.random_depths:
            progress(f"random read {format_size(config.random_block)} x {qd}")
            points.append(measure(name, op="read", pattern="random",
                                  block_size=config.random_block, queue_depth=qd,
                                  nbytes=config.size, seconds=config.seconds, engine_kind=kind))
        if config.sustained:
            points.append(_sustained_write(directory, config, kind, progress))
    finally:
        os.unlink(name)
    return points


def _sustained_write(directory: Path, config: ProbeConfig, kind: str,
                     progress: Callable[[str], None]) -> ProbePoint:
    """Write a new file of ``sustained`` bytes with the largest write shape of the grid."""
    progress(f"sustained write of {format_size(config.sustained)}")
    return new_file_write(directory, config.sustained, block_size=max(config.block_sizes),
                          queue_depth=max(config.queue_depths), interval=config.interval,
                          engine_kind=kind)


def new_file_write(directory: Union[str, os.PathLike], size: Size, *, block_size: Size = "8MiB",
                   queue_depth: int = 8, interval: float = 0.05, seconds: float = 0.0,
                   engine_kind: Optional[str] = None) -> ProbePoint:
    """One sequential O_DIRECT write of a new, preallocated file of ``size`` bytes (as a
    checkpoint writes), timed to its end fsync (at most ``seconds`` of writing, 0: no cap);
    the file is removed afterwards."""
    nbytes = parse_size(size, name="size")
    with preallocated_file(directory, nbytes) as name:
        return measure(name, op="write", block_size=block_size, queue_depth=queue_depth,
                       nbytes=nbytes, seconds=seconds, interval=interval,
                       engine_kind=engine_kind)


@contextlib.contextmanager
def preallocated_file(directory: Union[str, os.PathLike], nbytes: int) -> Iterator[str]:
    """A new file of ``nbytes`` preallocated bytes in ``directory`` (its path), removed on
    exit."""
    fd, name = tempfile.mkstemp(prefix=".flashstream-write-", dir=directory)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        os.close(fd)
        fd = -1
        yield name
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(name)
