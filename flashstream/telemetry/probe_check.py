"""The probe against fio: the same file and request shape, measured in back-to-back pairs.

Used by ``benchmarks/probe_vs_fio.py`` (how close the probe's figures are to fio's) and by
``tests/test_probe.py`` (that the probe measures the drive at all, not the page cache).
"""

from __future__ import annotations

import os
import statistics
from typing import Callable, List, Tuple, Union

from .fio import run_fio
from .probe import measure, new_file_write

__all__ = ["OPS", "paired_ratio"]

#: "read" and "write" rewrite an existing file; "write-new" writes a new preallocated file of
#: the same size, as the probe's write points and checkpoints do.
OPS = ("read", "write", "write-new")


def paired_ratio(path: Union[str, os.PathLike], op: str, pairs: int
                 ) -> Tuple[float, List[float], List[float]]:
    """(median of probe/fio GB/s ratios, probe GB/s, fio GB/s) over ``pairs`` x 2 runs of
    1 MiB x 32 O_DIRECT requests over the whole file at ``path`` (writes synced).

    The two tools alternate in ABBA order: on a virtual disk the second writer pays for the
    first one's backlog in the host's cache, so a fixed order biases the comparison, and the
    ratio of runs made back to back cancels the host's slow drifts.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}; got {op!r}")
    path = os.fspath(path)
    size = os.path.getsize(path)
    ours: List[float] = []
    theirs: List[float] = []

    def fio_new_file() -> None:
        target = os.path.join(os.path.dirname(path), "fio-new.bin")
        theirs.append(run_fio([target], rw="write", bs="1M", iodepth=32, end_fsync=True,
                              size=size)["gbps"])
        os.unlink(target)

    runs: List[Callable[[], None]]
    if op == "write-new":
        runs = [lambda: ours.append(new_file_write(os.path.dirname(path), size,
                                                   block_size="1MiB", queue_depth=32,
                                                   interval=0.0).gbps),
                fio_new_file]
    else:
        runs = [lambda: ours.append(measure(path, op=op, block_size="1MiB",
                                            queue_depth=32).gbps),
                lambda: theirs.append(run_fio([path], rw=op, bs="1M", iodepth=32,
                                              end_fsync=op == "write")["gbps"])]
    for i in range(2 * pairs):
        for run in runs if i % 2 == 0 else reversed(runs):
            run()
    return statistics.median(a / b for a, b in zip(ours, theirs)), ours, theirs
