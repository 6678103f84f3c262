"""DriveEmulator: makes the drive under a path behave like a dense drive with an SLC cache.

A control thread reads the drive's completed writes from /proc/diskstats every ``tick``
seconds, steps the cache model (model.py) and rewrites the limits of a block-I/O throttling
group (cgroup.py). Processes or threads placed in the group are slowed as the emulated drive
would slow them: writes to the post-cache rate once the cache is full, reads held back while it
folds. The emulator always restores the limits and removes its group on exit, failed runs and
Ctrl-C included.

It is an emulation, not a model of flash: see docs/emulation.md for what it leaves out.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

from ..sizes import Size
from ..telemetry.device import device_of
from ..telemetry.drive_model import remembered_write_rate
from ..telemetry.probe import EMULATED_DRIVE_ENV
from .cgroup import SLICE_S, ThrottleGroup
from .model import CacheModel, DriveSettings, profile_settings

__all__ = ["DriveEmulator", "EmulatorPoint", "disk_sectors"]

_UNSET = object()


def disk_sectors(name: str, proc_root: str = "/proc") -> tuple:
    """(sectors read, sectors written) that the disk ``name`` completed (512-byte units)."""
    with open(os.path.join(proc_root, "diskstats")) as f:
        for line in f:
            fields = line.split()
            if len(fields) > 9 and fields[2] == name:
                return int(fields[5]), int(fields[9])
    raise FileNotFoundError(f"disk {name!r} is not in {proc_root}/diskstats")


@dataclasses.dataclass(frozen=True)
class EmulatorPoint:
    """The emulated drive at the end of one timeline interval."""

    seconds: float       # since the emulator started
    fill: float          # bytes in the emulated cache
    cliff: bool          # in the cliff (cache full, folding)
    write_rate: float    # bytes/s the drive completed over the interval
    read_rate: float
    write_limit: float   # bytes/s throttle in force (0: none)
    read_limit: float


class DriveEmulator:
    """Emulate a dense drive on the drive that holds ``path``.

    >>> with DriveEmulator("/mnt/data", profile="plc") as drive:
    ...     drive.add_process()            # this process; or run(["python", "train.py"])
    ...     ...                            # its writes now meet an SLC-cache cliff
    >>> drive.summary()["cliff_seconds"]

    ``settings`` gives the drive outright; else ``profile`` ("plc" or "qlc") is scaled to
    ``write_rate`` (bytes/s; default: the drive's remembered write model, else measured with a
    short new-file write), with ``overrides`` replacing single fields (``cache_size="1GiB"``).
    Raises :class:`~flashstream.emulation.cgroup.ThrottleUnavailable` without root or a cgroup
    block-I/O controller.
    """

    def __init__(self, path: Union[str, os.PathLike] = ".",
                 settings: Optional[DriveSettings] = None, *, profile: str = "plc",
                 write_rate: Optional[float] = None, tick: float = 0.01,
                 interval: float = 0.05, **overrides: Size) -> None:
        if not 0.001 <= tick <= 1 or not tick <= interval <= 60:
            raise ValueError("tick must be from 0.001 to 1 s and interval from tick to 60 s")
        info = device_of(path, health=False)
        if not info.name:
            raise ValueError(f"no block device behind {path!s}: the emulator throttles a disk")
        self.disk = info.name
        self.device = Path(f"/sys/block/{info.name}/dev").read_text().strip()
        if settings is None:
            if write_rate is None:
                write_rate = remembered_write_rate(path)
            settings = profile_settings(profile, write_rate, **overrides)
        elif overrides:
            settings = dataclasses.replace(settings, **overrides)
        self.settings = settings
        self.tick, self.interval = tick, interval
        self.model = CacheModel(settings, horizon=tick, release=SLICE_S)
        self.timeline: List[EmulatorPoint] = []
        self.group: Optional[ThrottleGroup] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._error: Optional[BaseException] = None
        self._t0 = 0.0
        # What its members remember of the drive (probe results, the write model) is kept
        # apart under this tag: the emulation must not become the real drive's model.
        digest = hashlib.sha1(json.dumps(settings.to_dict(), sort_keys=True).encode())
        self.tag = f"{info.name}-{digest.hexdigest()[:10]}"
        self._env_before: object = _UNSET  # the variable's value before _mark_env

    @property
    def started(self) -> float:
        """time.perf_counter() when the emulator started: the timeline's zero."""
        return self._t0

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> DriveEmulator:
        if self.group is not None:
            raise RuntimeError("the emulator is already running")
        self.group = ThrottleGroup(self.device)
        try:
            self.group.set_limits(self.model.read_limit(), self.model.write_limit())
            self._t0 = time.perf_counter()
            self._stop.clear()
            self._thread = threading.Thread(target=self._control, name="flashstream-emulator",
                                            daemon=True)
            self._thread.start()
        except BaseException:
            self.group.remove()
            self.group = None
            raise
        return self

    def stop(self) -> None:
        """Stops the control thread, moves every task back and removes the group."""
        self._restore_env()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.group is not None:
            group, self.group = self.group, None
            group.remove()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the drive emulator's control thread failed: {error}") from error

    def __enter__(self) -> DriveEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- members ---------------------------------------------------------------------------
    def add_process(self, pid: Optional[int] = None) -> None:
        """Places a process (default: this one), all its threads, under the emulated drive.

        This process also gets ``FLASHSTREAM_EMULATED_DRIVE`` (until :meth:`stop`), so the
        probe results and write model it learns are kept apart from the real drive's. A process
        placed by pid keeps its own environment: start it with that variable set to
        :attr:`tag` (as :meth:`run` does)."""
        self._running().add_process(os.getpid() if pid is None else pid)
        if pid is None or pid == os.getpid():
            self._mark_env()

    def add_thread(self, tid: Optional[int] = None) -> None:
        """Places one thread (default: the calling one) under it; cgroup v1 only. Marks this
        process's environment as :meth:`add_process` does."""
        self._running().add_thread(threading.get_native_id() if tid is None else tid)
        self._mark_env()

    def _mark_env(self) -> None:
        if self._env_before is _UNSET:
            self._env_before = os.environ.get(EMULATED_DRIVE_ENV)
        os.environ[EMULATED_DRIVE_ENV] = self.tag

    def _restore_env(self) -> None:
        before, self._env_before = self._env_before, _UNSET
        if before is _UNSET:
            return
        if before is None:
            os.environ.pop(EMULATED_DRIVE_ENV, None)
        else:
            os.environ[EMULATED_DRIVE_ENV] = before

    def run(self, command: Sequence[str], **popen_kw) -> int:
        """Runs ``command`` under the emulated drive; returns its exit status."""
        group = self._running()
        procs = group.path / "cgroup.procs"

        def enter() -> None:  # in the child, before exec: nothing it does escapes the group
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        env = dict(popen_kw.pop("env", None) or os.environ)
        env[EMULATED_DRIVE_ENV] = self.tag  # what it learns of the drive is the emulation's
        with subprocess.Popen(list(command), preexec_fn=enter, env=env, **popen_kw) as proc:
            try:
                return proc.wait()
            except BaseException:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                raise

    def _running(self) -> ThrottleGroup:
        if self.group is None:
            raise RuntimeError("start the emulator first (use it as a context manager)")
        return self.group

    # -- control ---------------------------------------------------------------------------
    def _control(self) -> None:
        try:
            self._loop()
        except BaseException as exn:  # surfaces in stop(); the limits are lifted there
            self._error = exn

    def _loop(self) -> None:
        read0, written0 = disk_sectors(self.disk)
        last_t = mark_t = time.perf_counter()
        last_w, mark_r, mark_w = written0, read0, written0
        group = self._running()
        while not self._stop.wait(self.tick):
            now = time.perf_counter()
            sectors_read, sectors_written = disk_sectors(self.disk)
            state = self.model.step((sectors_written - last_w) * 512.0, now - last_t)
            last_w, last_t = sectors_written, now
            write_limit, read_limit = self.model.write_limit(), self.model.read_limit()
            group.set_limits(read_limit, _rounded(write_limit, group.limits[1]))
            if now - mark_t >= self.interval:
                width = now - mark_t
                self.timeline.append(EmulatorPoint(
                    now - self._t0, state.fill, state.cliff,
                    (sectors_written - mark_w) * 512.0 / width,
                    (sectors_read - mark_r) * 512.0 / width, float(group.limits[1]),
                    float(group.limits[0])))
                mark_t, mark_r, mark_w = now, sectors_read, sectors_written

    # -- results ---------------------------------------------------------------------------
    def summary(self) -> Dict[str, object]:
        """Seconds in the cliff, bytes written and read, the largest fill, the settings."""
        points = self.timeline
        starts = [0.0] + [p.seconds for p in points[:-1]]
        widths = [p.seconds - start for p, start in zip(points, starts)]
        return {
            "settings": self.settings.to_dict(), "device": self.device, "disk": self.disk,
            "seconds": points[-1].seconds if points else 0.0,
            "cliff_seconds": self.cliff_seconds(),
            "written_bytes": sum(w * p.write_rate for w, p in zip(widths, points)),
            "read_bytes": sum(w * p.read_rate for w, p in zip(widths, points)),
            "max_fill": max((p.fill for p in points), default=0.0),
        }

    def cliff_seconds(self, start: float = 0.0, end: float = math.inf) -> float:
        """Seconds in the cliff among the timeline's intervals that end in [start, end]
        (seconds since the emulator started)."""
        total, last = 0.0, 0.0
        for point in self.timeline:
            if point.cliff and start <= point.seconds <= end:
                total += point.seconds - last
            last = point.seconds
        return total

    def save_timeline(self, path: Union[str, os.PathLike]) -> None:
        """Writes the summary and the timeline as JSON."""
        Path(path).write_text(json.dumps({
            "summary": self.summary(),
            "timeline": [dataclasses.asdict(p) for p in self.timeline]}, indent=1))


def _rounded(limit: float, current: float) -> float:
    """Keeps the limit in force unless it moved by more than 5%: rewriting a throttle restarts
    the kernel's accounting slice, so it is not rewritten every tick for a tiny change."""
    if limit and current and abs(limit - current) <= 0.05 * current:
        return current
    return limit
