"""Shared pieces of the benchmarks: environment header, synthetic shards, fio, the device probe,
DataLoader collates, tables, JSON."""

from __future__ import annotations

import io
import json
import os
import platform
import resource
import statistics
import sys
import tarfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import psutil
from tqdm import tqdm

import flashstream
from flashstream.sizes import format_size
from flashstream.telemetry.fio import fio_version, run_fio
from flashstream.telemetry.probe import ProbeResult, probe


def environment(data_dir: Path) -> Dict[str, object]:
    """What a reader of the figures needs to know about where they were taken."""
    st = os.stat(data_dir)
    info: Dict[str, object] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "flashstream": flashstream.__version__,
        "cpus": os.cpu_count(),
        "data_dir": str(data_dir),
        "device": f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}",
        **_device_fields(data_dir),
        "engine": flashstream.engine_name(flashstream.settings.current().engine),
        "fio": fio_version(),
    }
    try:
        import webdataset

        info["webdataset"] = webdataset.__version__
    except (ImportError, AttributeError):
        info["webdataset"] = None
    return info


def _device_fields(data_dir: Path) -> Dict[str, object]:
    """The drive's name (as /proc/diskstats lists it), model and queue settings."""
    try:
        dev = flashstream.device_of(data_dir, health=False)
    except OSError:
        return {"device_name": None, "device_model": None}
    return {"device_name": dev.name, "device_model": dev.model or dev.transport,
            "logical_block_size": dev.logical_block_size,
            "max_request_bytes": dev.max_request_bytes, "scheduler": dev.scheduler}


def print_header(info: Dict[str, object]) -> None:
    print("flashstream benchmark — " + ", ".join(f"{k}={v}" for k, v in info.items()))


# -- data ---------------------------------------------------------------------------------------
def write_synthetic_shards(directory: Path, *, sample_size: int, total_bytes: int,
                           shard_bytes: int, seed: int = 0, progress=None) -> List[Path]:
    """Shards of samples ``{key}.cls`` + ``{key}.bin`` (random bytes of ``sample_size``).

    Reuses the shards when a manifest says they were written with the same parameters."""
    wanted = {"sample_size": sample_size, "total_bytes": total_bytes, "shard_bytes": shard_bytes,
              "seed": seed, "format": 1}
    made = _made_before(directory, wanted)
    if made is not None:
        return made
    rng = np.random.default_rng(seed)
    pool = rng.bytes(16 << 20)  # slices of a random pool: incompressible, fast to make
    per_shard = max(1, shard_bytes // (sample_size + 1536))
    n_samples = max(1, total_bytes // (sample_size + 1536))
    names: List[str] = []
    index = 0
    while index < n_samples:
        name = f"shard-{len(names):06d}.tar"
        with tarfile.open(directory / name, "w", format=tarfile.GNU_FORMAT) as tar:
            for _ in range(min(per_shard, n_samples - index)):
                key = f"sample{index:09d}"
                start = int(rng.integers(0, len(pool) - sample_size))
                _add(tar, f"{key}.cls", str(index % 1000).encode())
                _add(tar, f"{key}.bin", pool[start:start + sample_size])
                index += 1
        names.append(name)
        if progress is not None:
            progress.update(1)
    (directory / "manifest.json").write_text(json.dumps({"params": wanted, "shards": names}))
    return [directory / n for n in names]


def _made_before(directory: Path, wanted: Dict[str, object]) -> Optional[List[Path]]:
    """The shards in ``directory`` if its manifest says they were written with ``wanted``
    (and they are all there); the directory is created otherwise."""
    directory.mkdir(parents=True, exist_ok=True)
    manifest = directory / "manifest.json"
    if manifest.exists():
        try:
            done = json.loads(manifest.read_text())
            if done["params"] == wanted and all((directory / n).exists() for n in done["shards"]):
                return [directory / n for n in done["shards"]]
        except (ValueError, KeyError):
            pass
    return None


def write_jpeg_shards(directory: Path, *, total_bytes: int, shard_bytes: int, side: int = 96,
                      seed: int = 0, progress=None) -> List[Path]:
    """Shards of small JPEGs (``{key}.jpg``, ``side`` x ``side``, smooth shapes and noise, as
    photos compress) and a label (``{key}.cls``); reused when a manifest matches."""
    from PIL import Image

    wanted = {"kind": "jpeg", "side": side, "total_bytes": total_bytes,
              "shard_bytes": shard_bytes, "seed": seed, "format": 1}
    made = _made_before(directory, wanted)
    if made is not None:
        return made
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:side, 0:side].astype(np.float32) / side

    def jpeg() -> bytes:
        a, b, c = rng.random(3)
        base = np.stack([np.sin(6 * (x * a + y * b) + 3 * c), np.cos(5 * x * c + 4 * y * a),
                         x * b + y * (1 - b)], axis=-1)
        pixels = np.clip((base * 0.5 + 0.5) * 255 + rng.normal(0, 12, base.shape), 0, 255)
        out = io.BytesIO()
        Image.fromarray(pixels.astype(np.uint8)).save(out, format="JPEG", quality=85)
        return out.getvalue()

    names: List[str] = []
    written = index = 0
    while written < total_bytes:
        names.append(f"jpeg-{len(names):06d}.tar")
        with tarfile.open(directory / names[-1], "w", format=tarfile.GNU_FORMAT) as tar:
            while written < total_bytes and tar.fileobj.tell() < shard_bytes:
                data = jpeg()
                _add(tar, f"image{index:09d}.jpg", data)
                _add(tar, f"image{index:09d}.cls", str(index % 1000).encode())
                written += len(data) + 1536
                index += 1
        if progress is not None:
            progress.update(1)
    (directory / "manifest.json").write_text(json.dumps({"params": wanted, "shards": names}))
    return [directory / n for n in names]


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 1_700_000_000
    tar.addfile(info, io.BytesIO(data))


# -- fio ----------------------------------------------------------------------------------------
def fio_sequential_read(files: Sequence[Path]) -> Optional[Dict[str, float]]:
    """fio --direct=1 --rw=read --bs=1M --iodepth=32 over the files, one after another."""
    return run_fio(files, rw="read", bs="1M", iodepth=32)


def fio_sequential_write(path: Path, nbytes: int) -> Optional[Dict[str, object]]:
    """fio --direct=1 --rw=write --bs=8M --iodepth=8 --end_fsync=1 of ``nbytes``, twice: into
    a new file at ``path``, then over the file just written (no allocation left to do); removed
    afterwards. The figures are the new file's: every save of checkpoint.py's writers is a new
    file (reserved with fallocate, like fio's; each save's output is deleted before the next,
    so none writes over a recycled one), so that is the same work. Both runs are kept as
    ``new_file`` and ``overwrite``. None without fio or when the runs are too short to time."""
    size = -(-max(int(nbytes), 1) // (8 << 20)) * (8 << 20)  # whole requests
    path.unlink(missing_ok=True)
    try:
        new, over = (run_fio([path], rw="write", bs="8M", iodepth=8, end_fsync=True, size=size)
                     for _ in range(2))
    finally:
        path.unlink(missing_ok=True)
    if not new:
        return None
    return {**new, "new_file": new, "overwrite": over}


# -- device probe -------------------------------------------------------------------------------
def run_probe(directory: Path, size: str) -> Optional[ProbeResult]:
    """The drive's own figures (cached per device and size); None, with a note, if it fails."""
    with tqdm(desc="device probe", unit="test", leave=False, disable=None) as bar:
        def progress(message: str) -> None:
            bar.set_postfix_str(message)
            bar.update(1)

        try:
            return probe(directory, size=size, progress=progress)
        except (OSError, ValueError) as e:  # no C++ engine, a full disk, a size it refuses
            print(f"device probe failed ({e}): no drive figures to compare with",
                  file=sys.stderr)
            return None


def probe_summary(result: Optional[ProbeResult]) -> Optional[Dict[str, object]]:
    """What the JSON keeps of the probe: the best points, and every point for the record."""
    if result is None:
        return None
    best = result.best("read")
    full = result.to_dict()
    return {"device": result.device.get("name"), "engine": result.engine,
            "cached": result.cached, "size": result.config.get("size"),
            "best_read_gbps": best.gbps if best else None,
            "best_read": full["best"]["read"], "best_write": full["best"]["write"],
            "points": full["points"]}


def format_probe(result: ProbeResult, op: str = "read") -> str:
    best = result.best(op)
    size = format_size(int(result.config.get("size", 0)))
    head = (f"probe of {result.device.get('name')} ({size} file, "
            f"{'cached' if result.cached else 'measured now'}): ")
    if best is None:
        return head + f"no sequential {op} figure"
    return (head + f"best sequential {op} {best.gbps:.3f} GB/s "
            f"({format_size(best.block_size)} x {best.queue_depth})")


# -- CPU ----------------------------------------------------------------------------------------
def _rusage_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _threads_on_cpu_s(pid: int) -> float:
    """Seconds on CPU of the live threads of ``pid``, from /proc/PID/task/*/schedstat
    (nanoseconds, where /proc/PID/stat counts whole 10 ms ticks)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            pass
    return total / 1e9


def _descendants() -> Dict[int, Tuple[float, float]]:
    """pid -> (on-CPU seconds of its live threads plus its reaped children, the same counted
    in ticks with its ended threads) for every live process below this one."""
    out: Dict[int, Tuple[float, float]] = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        reaped = times.children_user + times.children_system
        out[proc.pid] = (_threads_on_cpu_s(proc.pid) + reaped,
                         times.user + times.system + reaped)
    return out


class CpuMeter:
    """Core-seconds (user + system) spent between construction and :meth:`stop` by this
    process and every process below it: DataLoader workers, persistent ones included (alive
    throughout, so never reaped: they are read from /proc), and children that ended (fio,
    workers of a loader that is not persistent: from ``RUSAGE_CHILDREN``)."""

    def __init__(self) -> None:
        self._self = _rusage_s(resource.RUSAGE_SELF)
        self._reaped = _rusage_s(resource.RUSAGE_CHILDREN)
        self._live = _descendants()

    def stop(self) -> Dict[str, float]:
        """``cpu_s`` in all, ``cpu_main_s`` of this process, ``cpu_others_s`` of the rest."""
        main = _rusage_s(resource.RUSAGE_SELF) - self._self
        others = _rusage_s(resource.RUSAGE_CHILDREN) - self._reaped
        live = _descendants()
        for pid, (exact, ticks) in live.items():
            exact0, ticks0 = self._live.get(pid, (0.0, 0.0))
            # The exact figure misses threads that ended meanwhile (a thread engine's pool
            # goes with its reader): then the tick count, which keeps them, is the larger.
            exact, ticks = exact - exact0, ticks - ticks0
            others += ticks if ticks - exact > 0.02 else exact
        for pid, (_exact, ticks0) in self._live.items():
            if pid not in live:  # ended and reaped since: RUSAGE_CHILDREN has its whole life
                others -= ticks0
        others = max(others, 0.0)
        return {"cpu_s": main + others, "cpu_main_s": main, "cpu_others_s": others}


# -- DataLoader collates (module level, so worker processes can unpickle them) ------------------
# None of them converts to tensors: that cost is the model's, not the loader's. "count" sends
# only the number of samples back from a worker; "list" sends the samples themselves (pickled
# through a pipe, which then usually bounds the epoch).
def count_batch(batch: list) -> int:
    return len(batch)


def count_sample(sample: dict) -> int:
    return 1


def as_list(batch: list) -> list:
    return batch


def as_is(sample: dict) -> dict:
    return sample


COLLATES = {("count", True): count_batch, ("count", False): count_sample,
            ("list", True): as_list, ("list", False): as_is}  # (mode, batched) -> collate_fn


def median_round(rounds: Sequence[Dict[str, object]], key: str = "cold_shardstream") -> int:
    """Index of the round whose ``key`` time is the median: the one to show."""
    seconds = [r[key]["seconds"] for r in rounds if r.get(key)]
    if not seconds:
        return 0
    return [r.get(key, {}).get("seconds") for r in rounds].index(
        statistics.median_low(seconds))


# -- output -------------------------------------------------------------------------------------
def print_table(rows: List[Dict[str, object]], columns: Sequence[str]) -> None:
    cells = [[_fmt(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def print_verdicts(verdicts: Dict[str, Dict[str, object]]) -> None:
    """One line per target: met or not, the measured value and the target."""
    for label, v in verdicts.items():
        print(f"  {'met    ' if v['met'] else 'NOT met'}  {label}: {v['value']:.3f} "
              f"(target {v['target']})")


def write_json(path: Path, payload: Dict[str, object]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def write_outputs(payload: Dict[str, object], json_path: Path,
                  plot: Callable[[Dict[str, object], Path], Optional[Path]],
                  plot_path: Path) -> None:
    """Write the run's JSON and draw its figure, printing where each went (or why the figure
    was skipped)."""
    print(f"\nJSON: {write_json(json_path, payload)}")
    drawn = plot(payload, plot_path)
    print(f"plot: {drawn}" if drawn else "plot skipped: matplotlib is not installed "
                                         "(pip install matplotlib)")
