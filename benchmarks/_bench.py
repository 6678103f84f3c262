"""Shared pieces of the benchmarks: environment header, synthetic shards, fio, tables, JSON."""

from __future__ import annotations

import io
import json
import os
import platform
import shutil
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

import flashstream


def environment(data_dir: Path) -> Dict[str, object]:
    """What a reader of the figures needs to know about where they were taken."""
    st = os.stat(data_dir)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    sys_block = Path("/sys/dev/block") / dev
    info: Dict[str, object] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "flashstream": flashstream.__version__,
        "cpus": os.cpu_count(),
        "data_dir": str(data_dir),
        "device": dev,
        "engine": flashstream.engine_name(flashstream.settings.current().engine),
        "fio": _fio_version(),
    }
    for name in ("queue/logical_block_size", "queue/max_sectors_kb", "queue/scheduler"):
        for base in (sys_block, sys_block / ".."):
            if (base / name).exists():
                info[name.split("/")[-1]] = (base / name).read_text().strip()
                break
    try:
        import webdataset

        info["webdataset"] = webdataset.__version__
    except (ImportError, AttributeError):
        info["webdataset"] = None
    return info


def print_header(info: Dict[str, object]) -> None:
    print("flashstream benchmark — " + ", ".join(f"{k}={v}" for k, v in info.items()))


# -- data ---------------------------------------------------------------------------------------
def write_synthetic_shards(directory: Path, *, sample_size: int, total_bytes: int,
                           shard_bytes: int, seed: int = 0, progress=None) -> List[Path]:
    """Shards of samples ``{key}.cls`` + ``{key}.bin`` (random bytes of ``sample_size``).

    Reuses the shards when a manifest says they were written with the same parameters."""
    directory.mkdir(parents=True, exist_ok=True)
    manifest = directory / "manifest.json"
    wanted = {"sample_size": sample_size, "total_bytes": total_bytes, "shard_bytes": shard_bytes,
              "seed": seed, "format": 1}
    if manifest.exists():
        try:
            done = json.loads(manifest.read_text())
            if done["params"] == wanted and all((directory / n).exists() for n in done["shards"]):
                return [directory / n for n in done["shards"]]
        except (ValueError, KeyError):
            pass
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
    manifest.write_text(json.dumps({"params": wanted, "shards": names}))
    return [directory / n for n in names]


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 1_700_000_000
    tar.addfile(info, io.BytesIO(data))


# -- fio ----------------------------------------------------------------------------------------
def _fio_version() -> Optional[str]:
    fio = shutil.which("fio")
    if fio is None:
        return None
    return subprocess.run([fio, "--version"], capture_output=True, text=True).stdout.strip()


def fio_sequential_read(files: Sequence[Path], *, bs: str = "1M", iodepth: int = 32,
                        engine: Optional[str] = None) -> Optional[Dict[str, float]]:
    """fio reading ``files`` one after another (--direct=1 --rw=read); None without fio."""
    fio = shutil.which("fio")
    if fio is None:
        return None
    if engine is None:
        engine = "io_uring" if flashstream.uring_available() else "libaio"
    names = ":".join(str(f).replace(":", "\\:") for f in files)
    cmd = [fio, "--name=seqread", f"--filename={names}", "--rw=read", f"--bs={bs}",
           f"--iodepth={iodepth}", "--direct=1", f"--ioengine={engine}",
           "--file_service_type=sequential", "--output-format=json"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"fio failed: {result.stderr.strip()}")
    job = json.loads(result.stdout)["jobs"][0]["read"]
    # fio's runtime is in whole milliseconds; its bandwidth is exact, so derive time from it.
    # A run too short for fio to time (tiny test data) reports 0 bandwidth: no figure then.
    if not job["bw_bytes"]:
        return None
    return {"seconds": job["io_bytes"] / job["bw_bytes"], "bytes": float(job["io_bytes"]),
            "gbps": job["bw_bytes"] / 1e9, "command": " ".join(cmd)}


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


def write_json(path: Path, payload: Dict[str, object]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path
