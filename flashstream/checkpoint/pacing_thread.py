"""Runs a save's :class:`~flashstream.checkpoint.save_control.SaveController` against the
write in flight: a thread that looks at the write's progress and the drive's counters
(/proc/diskstats) each tick and sets the engine's pace to the controller's answer."""

from __future__ import annotations

import threading
import time
from typing import Optional

from .. import engine
from ..telemetry.diskstats import write_read_counters
from ..telemetry.read_latency import ReadLatencyMonitor
from .save_control import SaveController, SaveRecord

__all__ = ["PacingThread"]


class PacingThread:
    """Runs a :class:`SaveController` against a write in flight (an ``engine.RateControl``),
    reading the drive's counters (``disk``: its name in /proc/diskstats; None: unknown)."""

    def __init__(self, controller: SaveController, disk: Optional[str],
                 read_slo: Optional[float] = None) -> None:
        self.controller, self.disk = controller, disk
        self.control = engine.RateControl()
        self.control.rate = controller.pace()
        self.monitor = ReadLatencyMonitor(disk) if read_slo else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flashstream-pacing",
                                        daemon=True)
        self.record: Optional[SaveRecord] = None
        self._base: Optional[tuple] = None

    def __enter__(self) -> PacingThread:
        self._t0 = time.perf_counter()
        self._base = write_read_counters(self.disk)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        drive, _, _ = self._since_start()
        self.record = self.controller.finish(time.perf_counter() - self._t0,
                                             float(self.control.done), drive)

    def _run(self) -> None:
        ctl = self.controller
        while not self._stop.wait(ctl.next_wait()):
            drive, reads, read_s = self._since_start()
            p95 = self.monitor.p95() if self.monitor is not None else None
            pace = ctl.look(time.perf_counter() - self._t0, float(self.control.done), drive,
                            reads, read_s, p95)
            self.control.rate = pace

    def _since_start(self) -> tuple:
        """The drive's bytes written, reads completed and seconds spent reading since the
        write began (None each: unknown)."""
        now = write_read_counters(self.disk)
        if now is None or self._base is None:
            return None, None, None
        return float(now[0] - self._base[0]), float(now[1] - self._base[1]), \
            (now[2] - self._base[2]) / 1e3
