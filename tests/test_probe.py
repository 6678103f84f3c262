"""The device probe: fields present and consistent, cache, errors, and agreement with fio."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import child_env

from flashstream import engine
from flashstream.telemetry.fio import fio_available
from flashstream.telemetry.probe import ProbeConfig, measure, probe

SMALL = dict(size="16MiB", block_sizes=("64KiB", "1MiB"), queue_depths=(1, 8),
             random_depths=(4,), seconds=0.5, sustained="48MiB", interval=0.02)


def test_small_probe_is_consistent_and_cleans_up(tmp_path):
    data = tmp_path / "drive"
    data.mkdir()
    result = probe(data, cache_dir=tmp_path / "cache", **SMALL)
    assert list(data.iterdir()) == []  # the temp file is gone
    assert len(result.select("read")) == len(result.select("write")) == 4
    assert len(result.select("read", "random")) == 1
    for point in result.points:
        assert point.bytes > 0 and point.seconds > 0 and point.requests > 0
        assert point.gbps == pytest.approx(point.bytes / point.seconds / 1e9)
        assert point.direct  # tmp_path's disk takes O_DIRECT
        lat = point.latency_us
        assert lat["count"] == point.requests
        assert lat["p50"] <= lat["p95"] <= lat["p99"] <= lat["max"] * 1.01
    assert result.best("read").gbps == max(p.gbps for p in result.select("read"))
    sustained = result.sustained
    assert sustained.bytes == 48 << 20 and len(sustained.timeline) >= 1
    assert "best sequential read" in result.format_table()


def test_write_points_write_new_files(tmp_path, monkeypatch):
    """As a checkpoint writes: each write point (and the sustained write) into its own new,
    preallocated file, never over the read points' probe file."""
    from flashstream.telemetry import probe as probe_mod

    seen, real = [], probe_mod.measure

    def measure_spy(path, **kw):
        if kw["op"] == "write":
            seen.append((os.path.basename(path), os.path.getsize(path)))
        return real(path, **kw)

    monkeypatch.setattr(probe_mod, "measure", measure_spy)
    probe(tmp_path, cache_dir=tmp_path / "cache", **dict(SMALL, sustained="20MiB"))
    names = [name for name, _ in seen]
    assert len(names) == 5 and len(set(names)) == 5
    assert all(name.startswith(".flashstream-write-") for name in names)
    assert [size for _, size in seen] == [16 << 20] * 4 + [20 << 20]  # preallocated
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def test_probe_results_are_cached_per_device(tmp_path):
    kw = dict(SMALL, sustained=0, block_sizes=("1MiB",), queue_depths=(4,))
    first = probe(tmp_path, cache_dir=tmp_path / "c", **kw)
    again = probe(tmp_path, cache_dir=tmp_path / "c", **kw)
    assert not first.cached and again.cached
    assert [p.gbps for p in again.points] == [p.gbps for p in first.points]
    assert not probe(tmp_path, cache_dir=tmp_path / "c", refresh=True, **kw).cached


def test_probe_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="multiples of 512"):
        ProbeConfig(block_sizes=(1000,))
    with pytest.raises(ValueError, match="queue depths"):
        ProbeConfig(queue_depths=(0,))
    with pytest.raises(NotADirectoryError):
        probe(tmp_path / "missing")
    path = tmp_path / "f"
    engine.create_probe_file(str(path), 1 << 20)
    with pytest.raises(ValueError, match="read, write"):
        measure(path, op="append")
    with pytest.raises(ValueError, match="sequential, random"):
        measure(path, op="read", pattern="zigzag")


# Runs in a fresh interpreter: after the rest of the suite, this process's own state (its heap,
# a gigabyte of page cache it wrote) made the in-process probe read 1.4-1.7x faster than fio
# in two clean CI runs, while the same comparison alone gave ratios around 1.
_PAIRED = """
import json, os, statistics, sys
from flashstream.telemetry.fio import run_fio
from flashstream.telemetry.probe import measure, new_file_write
path, op, pairs = sys.argv[1], sys.argv[2], int(sys.argv[3])
ours, theirs = [], []

def fio_new_file():
    target = os.path.join(os.path.dirname(path), "fio-new.bin")
    theirs.append(run_fio([target], rw="write", bs="1M", iodepth=32, end_fsync=True,
                          size=os.path.getsize(path))["gbps"])
    os.unlink(target)

for i in range(2 * pairs):
    if op == "write-new":  # both write a new preallocated file of the same size
        runs = [lambda: ours.append(new_file_write(os.path.dirname(path), os.path.getsize(path),
                                                   block_size="1MiB", queue_depth=32,
                                                   interval=0.0).gbps),
                fio_new_file]
    else:
        runs = [lambda: ours.append(measure(path, op=op, block_size="1MiB",
                                            queue_depth=32).gbps),
                lambda: theirs.append(run_fio([path], rw=op, bs="1M", iodepth=32,
                                              end_fsync=op == "write")["gbps"])]
    for run in runs if i % 2 == 0 else reversed(runs):
        run()
print(json.dumps([statistics.median(a / b for a, b in zip(ours, theirs)), ours, theirs]))
"""


def _paired_ratio(path, op, pairs):
    """Probe and fio in ABBA order (the second writer pays for the first one's backlog in a
    virtual disk's cache, so a fixed order biases the comparison); the median of the ratios
    of runs made back to back, so that the host's slow drifts cancel within each pair."""
    # cwd outside the checkout: "python -c" puts it first on sys.path, and the source folder
    # has no built extension.
    out = subprocess.run([sys.executable, "-c", _PAIRED, str(path), op, str(pairs)],
                         capture_output=True, text=True, env=child_env(), timeout=600,
                         cwd=os.path.dirname(path))
    assert out.returncode == 0, out.stderr
    return tuple(json.loads(out.stdout))


@pytest.mark.skipif(not fio_available(), reason="fio is not installed")
@pytest.mark.parametrize("op", ["read", "write", "write-new"])
def test_probe_within_15_percent_of_fio(tmp_path, op):
    """Same file, same shape (1 MiB x 32, O_DIRECT, whole file, writes synced; "write-new":
    each writes a new file of that size, as the probe's write points do). Single runs on
    our shared virtual disk swing by +-30%, so the figure is the median of 8 back-to-back
    pairs, and four more rounds are allowed: a real bias of over 15% fails every round (with
    two more, a noisy hour on the disk failed CI once: rounds at 1.26, then 0.78)."""
    path = tmp_path / "probe.bin"
    engine.create_probe_file(str(path), 512 << 20)
    attempts = []
    for _ in range(5):
        ratio, ours, theirs = _paired_ratio(path, op, pairs=4)
        attempts.append((round(ratio, 3), ours, theirs))
        if abs(ratio - 1) <= 0.15:
            break
    assert abs(attempts[-1][0] - 1) <= 0.15, attempts
    os.unlink(path)
