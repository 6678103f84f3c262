"""fio writing a checkpoint's bytes at a given pace, under an emulated drive: a reference.

checkpoint.py --emulate runs it as the ``fio-paced`` writer: the same schedule as the
checkpoint writers, each save replaced by fio writing as many bytes as auto's saves did, with
O_DIRECT, at the pace auto averaged in the same run (``--rate``; requests of the checkpoint
writer's paced request size, ``WriterConfig.paced_chunk_size``, with the benchmark's
``--queue-depth``, though fio waits for its queue to drain before each pause, so while on pace
it has about one request in flight), and an fsync at the end. The first save lays out a new
file (``fallocate``, as the checkpoint writer reserves one), the later ones write over it in
place, as a recycling writer's saves do. What
the reader suffers beside it is what a plain write of those bytes at that pace, by the field's
standard tool, costs reads on this drive: auto's reader ratio is set against it. A reference,
not a proven lower bound: a flatter or finer-grained write could cost the reads less.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Dict, Tuple

from flashstream.checkpoint import WriterConfig
from flashstream.emulation import DriveEmulator
from flashstream.sizes import parse_size
from flashstream.telemetry.fio import fio_command, fio_result

# The checkpoint writer's paced request size: the request size, not the writer, can set most of
# what a paced write costs the reads (docs/emulation.md gives the figures).
REQUEST = parse_size(WriterConfig.paced_chunk_size)  # the field's default


@dataclasses.dataclass(frozen=True)
class FioSave:
    """The fields of a flashstream SaveReport the emulated benchmark reads, for one fio run.
    ``write_start_s``: from the call to fio's first write (the process's start and setup)."""

    step: int
    bytes: int
    write_s: float
    write_start_s: float
    pacing: Dict[str, object]
    stall_s: float = 0.0
    timeline: Tuple[Tuple[float, int, float], ...] = ()


class FioPacedWriter:
    """Each :meth:`save` runs fio under ``drive`` and returns once its write is synced."""

    def __init__(self, directory: Path, nbytes: int, rate: float, drive: DriveEmulator,
                 queue_depth: int = 8) -> None:
        self.path = Path(directory) / "fio-save.bin"
        # fio moves whole requests only: rounded up, at most one request more than asked
        self.size = max(REQUEST, -(-int(nbytes) // REQUEST) * REQUEST)
        self.rate = float(rate)
        self.queue_depth = queue_depth
        self.drive = drive

    def save(self, step: int) -> FioSave:
        output = self.path.with_suffix(f".{step}.json")
        command = fio_command([self.path], rw="write", bs=str(REQUEST),
                              iodepth=self.queue_depth, end_fsync=True, size=self.size,
                              rate=self.rate, output=output)
        new_file = not self.path.exists()
        start = time.perf_counter()
        status = self.drive.run(command)
        seconds = time.perf_counter() - start
        if status != 0:
            raise RuntimeError(f"fio failed with status {status}: {' '.join(command)}")
        result = fio_result(output.read_text(), command)
        output.unlink()
        # fio's runtime is its jobs' I/O time; what comes before it is the spawn and setup
        running = result["runtime_s"] if result else seconds
        return FioSave(step=step, bytes=self.size, write_s=running,
                       write_start_s=max(0.0, seconds - running),
                       pacing={"writer": "fio", "rate": self.rate, "new_file": new_file,
                               "inode": os.stat(self.path).st_ino,
                               "fio_gbps": result["gbps"] if result else None})
