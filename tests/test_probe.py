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

# The probe measures with a C++ engine (the python engine is refused): not rerun on it.
pytestmark = pytest.mark.native_engine

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


# The comparison runs in a fresh interpreter, as the benchmark does: after the rest of the suite
# this process's own state made the in-process probe faster than fio by more than the bound in
# clean CI runs, while a fresh one agrees (0b5fafb has the figures; 30f7495 dropped the child).
_PAIRED = """
import json, sys
from flashstream.telemetry.probe_check import paired_ratio
print(json.dumps(paired_ratio(sys.argv[1], sys.argv[2], pairs=int(sys.argv[3]))))
"""


def _paired_ratio(path, op, pairs):
    # From the file's folder: a source checkout in the current folder would shadow the
    # installed package (and its built core) for `python -c`.
    out = subprocess.run([sys.executable, "-c", _PAIRED, str(path), op, str(pairs)],
                         capture_output=True, text=True, env=child_env(), timeout=600,
                         cwd=os.path.dirname(path))
    assert out.returncode == 0, out.stderr
    return tuple(json.loads(out.stdout))


@pytest.mark.skipif(not fio_available(), reason="fio is not installed")
@pytest.mark.parametrize("op", ["read", "write", "write-new"])
def test_probe_measures_the_drive_as_fio_does(tmp_path, op):
    """Same file, same shape (1 MiB x 32, O_DIRECT, whole file, writes synced; "write-new":
    each writes a new file of that size, as the probe's write points do). A behaviour check,
    not a speed claim: a probe that read the page cache, skipped O_DIRECT or miscounted bytes
    would be off by 2x or more. How close the two are is benchmarks/probe_vs_fio.py's figure
    (15% there): as a test that bound failed CI on noisy hours (all five rounds at 1.24-1.40
    once), since single runs on this shared virtual disk swing by 30% and more. The attempts
    are spread over half a minute: a slow phase of the disk once outlasted three attempts
    back to back (the commit that spread them has the figures)."""
    import time

    path = tmp_path / "probe.bin"
    engine.create_probe_file(str(path), 256 << 20)
    attempts = []
    for attempt in range(3):
        if attempt:
            time.sleep(15)  # past a passing slow phase of the shared disk
        ratio, ours, theirs = _paired_ratio(path, op, pairs=3)
        attempts.append((round(ratio, 3), ours, theirs))
        if 0.6 <= ratio <= 1 / 0.6:
            break
    assert 0.6 <= attempts[-1][0] <= 1 / 0.6, attempts
    os.unlink(path)


def test_a_probe_run_ends_when_another_thread_cancels_it(tmp_path):
    """A refill measurement must give way to a save at once: measure(cancel=) stops issuing
    when the token is set, and what it did so far is its result."""
    import threading

    path = tmp_path / "c.bin"
    engine.create_probe_file(str(path), 16 << 20)
    cancel = engine.ProbeCancel()
    timer = threading.Timer(0.1, cancel.set)
    timer.start()
    point = measure(path, op="read", block_size="256KiB", queue_depth=4, nbytes=1 << 40,
                    interval=0.01, cancel=cancel)
    timer.join()
    assert cancel.is_set() and 0 < point.bytes < 1 << 40
    assert point.seconds < 10.0
