"""Running fio as the baseline that flashstream's own figures are compared with."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from typing import Dict, List, Optional, Sequence, Union

from ..engine import uring_available

__all__ = ["fio_available", "fio_command", "fio_result", "fio_version", "run_fio"]

PathLike = Union[str, os.PathLike]
RW = ("read", "write", "randread", "randwrite")


def fio_available() -> bool:
    return shutil.which("fio") is not None


def fio_version() -> Optional[str]:
    fio = shutil.which("fio")
    if fio is None:
        return None
    return subprocess.run([fio, "--version"], capture_output=True, text=True).stdout.strip()


def run_fio(files: Sequence[PathLike], *, rw: str = "read", bs: str = "1M", iodepth: int = 32,
            ioengine: Optional[str] = None, end_fsync: bool = False,
            size: Optional[Union[int, str]] = None,
            timeout: float = 600) -> Optional[Dict[str, object]]:
    """fio over ``files`` one after another with O_DIRECT; None when fio is not installed or
    the run was too short for fio to time. Returns seconds, bytes, gbps, iops, the command.

    ``size`` (bytes, or fio's own notation such as ``"2g"``) is what fio moves per file; fio
    creates a missing file of that size, so a write needs no file made beforehand."""
    _check_rw(rw)
    if not fio_available():
        return None
    cmd = fio_command(files, rw=rw, bs=bs, iodepth=iodepth, ioengine=ioengine,
                      end_fsync=end_fsync, size=size)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"fio failed ({' '.join(cmd)}): {result.stderr.strip()}")
    return fio_result(result.stdout, cmd)


def fio_command(files: Sequence[PathLike], *, rw: str = "read", bs: str = "1M",
                iodepth: int = 32, ioengine: Optional[str] = None, end_fsync: bool = False,
                size: Optional[Union[int, str]] = None, rate: Optional[float] = None,
                output: Optional[PathLike] = None) -> List[str]:
    """The fio command line :func:`run_fio` runs (JSON output), for running it some other way,
    e.g. under an emulated drive (:meth:`flashstream.emulation.DriveEmulator.run`).

    ``rate``: bytes per second fio paces itself to (``--rate``); ``output``: a file for the
    JSON instead of stdout. Raises ``RuntimeError`` when fio is not installed."""
    _check_rw(rw)
    if rate is not None and not rate > 0:
        raise ValueError(f"rate must be a positive number of bytes per second, got {rate!r}")
    fio = shutil.which("fio")
    if fio is None:
        raise RuntimeError("fio is not installed (apt-get install -y fio)")
    if ioengine is None:
        ioengine = "io_uring" if uring_available() else "libaio"
    names = ":".join(os.fspath(f).replace(":", "\\:") for f in files)
    cmd = [fio, "--name=flashstream-baseline", f"--filename={names}", f"--rw={rw}",
           f"--bs={bs}", f"--iodepth={iodepth}", "--direct=1", f"--ioengine={ioengine}",
           "--file_service_type=sequential", "--output-format=json"]
    if end_fsync:
        cmd.append("--end_fsync=1")
    if size is not None:
        cmd.append(f"--size={size}")
    if rate is not None:
        cmd.append(f"--rate={max(1, round(rate))}")
    if output is not None:
        cmd.append(f"--output={os.fspath(output)}")
    return cmd


def _check_rw(rw: str) -> None:
    if rw not in RW:
        raise ValueError(f"rw must be one of {', '.join(RW)}, got {rw!r}")


def fio_result(text: str, command: Sequence[str]) -> Optional[Dict[str, object]]:
    """seconds, bytes, gbps, iops, runtime_s (the job's wall time, I/O and waits included),
    cpu_s (the job's own user + system CPU seconds, as fio counts them: its start-up left
    out) and the command from the JSON of a :func:`fio_command` run; None when the run was
    too short for fio to time."""
    rw = next(a.split("=", 1)[1] for a in command if a.startswith("--rw="))
    jobs = json.loads(text)["jobs"][0]
    job = jobs["write" if "write" in rw else "read"]
    # fio's runtime is whole milliseconds; its bandwidth is exact, so time comes from it. A run
    # too short for fio to time (tiny test data) reports 0 bandwidth: no figure then.
    if not job["bw_bytes"]:
        return None
    runtime_s = jobs.get("job_runtime", 0) / 1e3
    cpu_share = (jobs.get("usr_cpu", 0.0) + jobs.get("sys_cpu", 0.0)) / 100
    return {"seconds": job["io_bytes"] / job["bw_bytes"], "bytes": float(job["io_bytes"]),
            "gbps": job["bw_bytes"] / 1e9, "iops": job["iops"], "runtime_s": runtime_s,
            "cpu_s": cpu_share * runtime_s, "command": " ".join(command)}
