"""fio writing a checkpoint's bytes at a given pace, under an emulated drive: the floor.

checkpoint.py --emulate runs it as the ``fio-paced`` writer: the same schedule as the
checkpoint writers, each save replaced by fio writing as many bytes with O_DIRECT at the pace
``auto`` averaged in the same run (1 MiB requests, 8 in flight, as the checkpoint writer's paced
requests; fsync at the end). The first save lays out a new file, the later ones write over it,
as a recycling writer's do. What the reader suffers beside it is what any write of those bytes
at that pace costs reads on this drive, so auto's reader ratio can be set against it.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from flashstream.emulation import DriveEmulator
from flashstream.telemetry.fio import fio_command, fio_result

REQUEST = 1 << 20   # the checkpoint writer's paced_chunk_size default
DEPTH = 8           # its queue_depth default


@dataclasses.dataclass(frozen=True)
class FioSave:
    """The fields of a flashstream SaveReport the emulated benchmark reads, for one fio run."""

    step: int
    bytes: int
    write_s: float
    pacing: Dict[str, object]
    stall_s: float = 0.0
    write_start_s: float = 0.0
    timeline: Tuple[Tuple[float, int, float], ...] = ()


class FioPacedWriter:
    """Each :meth:`save` runs fio under ``drive`` and returns when its write is synced."""

    def __init__(self, directory: Path, nbytes: int, rate: float, drive: DriveEmulator) -> None:
        if not rate > 0:
            raise ValueError(f"rate must be positive bytes per second, got {rate!r}")
        self.path = Path(directory) / "fio-save.bin"
        self.size = max(REQUEST, -(-int(nbytes) // REQUEST) * REQUEST)  # whole requests
        self.rate = float(rate)
        self.drive = drive
        self.results: List[Optional[Dict[str, object]]] = []

    def save(self, step: int) -> FioSave:
        output = self.path.with_suffix(f".{step}.json")
        command = fio_command([self.path], rw="write", bs=str(REQUEST), iodepth=DEPTH,
                              end_fsync=True, size=self.size, rate=self.rate, output=output)
        new_file = not self.path.exists()
        start = time.perf_counter()
        status = self.drive.run(command)
        seconds = time.perf_counter() - start
        if status != 0:
            raise RuntimeError(f"fio failed with status {status}: {' '.join(command)}")
        result = fio_result(output.read_text(), command)
        output.unlink()
        self.results.append(result)
        return FioSave(step=step, bytes=self.size, write_s=seconds,
                       pacing={"writer": "fio", "rate": self.rate, "new_file": new_file,
                               "fio_gbps": result["gbps"] if result else None})
