"""benchmarks/checkpoint.py --emulate random --learning, its accounting without a drive: the
shortest cliff-free save it judges against, which seconds in the cliff each save is charged
with, and which runs and saves each of issue 48's targets counts."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import _learning  # noqa: E402

from flashstream.emulation import DriveSettings  # noqa: E402

pytestmark = pytest.mark.engine_independent

MB = 1e6


def _drive(**kw) -> DriveSettings:
    settings = dict(cache_size=int(1000 * MB), fast_rate=2000 * MB, post_cache_rate=400 * MB,
                    drain_rate=500 * MB)
    settings.update(kw)
    return DriveSettings(**settings)


def test_the_shortest_save_fills_the_cache_unpaced_then_writes_at_the_drain():
    drive = _drive()
    # From empty, the cache takes 1000 MB x 2000 / (2000 - 500) = 1333 MB before it is full.
    burst = 1000 * MB * 2000 / 1500
    assert _learning.shortest_cliff_free(drive, 0.0, 1000 * MB) == pytest.approx(0.5)
    assert _learning.shortest_cliff_free(drive, 0.0, 2000 * MB) == pytest.approx(
        burst / (2000 * MB) + (2000 * MB - burst) / (500 * MB))
    # From a full cache, all of it at the drain; from half full, half the burst.
    assert _learning.shortest_cliff_free(drive, 1000 * MB, 1000 * MB) == pytest.approx(2.0)
    assert _learning.shortest_cliff_free(drive, 500 * MB, 2000 * MB) == pytest.approx(
        burst / 2 / (2000 * MB) + (2000 * MB - burst / 2) / (500 * MB))
    # A drive that folds as fast as it writes (outside the family) has no cliff to plan
    # around.
    folds_all = SimpleNamespace(fast_rate=2000 * MB, cache_size=1000 * MB, drain_rate=2000 * MB)
    assert _learning.shortest_cliff_free(folds_all, 1000 * MB, 1000 * MB) == pytest.approx(0.5)


class _Emulator:
    """The emulator's cliff record: in the cliff over ``spans`` ((start, end) seconds)."""

    def __init__(self, spans):
        self.spans = spans

    def cliff_seconds(self, start: float, end: float) -> float:
        return sum(max(0.0, min(end, b) - max(start, a)) for a, b in self.spans)


def test_a_cliff_counts_to_the_save_whose_write_or_measurement_left_it():
    # Saves due every 10 s; each write starts 0.3 s after its save is called (the snapshot)
    # and takes 2 s. The first save's measurement after it (writing on, a refill) is in the
    # cliff from 8 s to 10.2 s: into the second save's snapshot, not its write.
    rows = [{"due_s": 10.0 * k, "write_start_s": 0.3, "write_s": 2.0} for k in range(3)]
    _learning._attribute_cliffs(_Emulator([(8.0, 10.2), (10.5, 11.0)]), rows, gap=10.0)
    first, second, third = rows
    assert first["cliff_s"] == pytest.approx(2.2) and first["cliff_write_s"] == 0.0
    assert second["cliff_before_s"] == pytest.approx(0.2)  # shown, charged to the first
    assert second["cliff_s"] == pytest.approx(0.5)  # in its own write
    assert second["cliff_write_s"] == pytest.approx(0.5)
    assert third["cliff_s"] == 0.0 and third["cliff_before_s"] == 0.0


def _run(cliffs, ratios, after, written=1.0):
    return {"saves": [{"step": k, "cliff_s": c, "ratio": r}
                      for k, (c, r) in enumerate(zip(cliffs, ratios))],
            "cliff_after_first_s": after, "written_share": written}


def test_the_targets_count_the_runs_and_saves_issue_48_names():
    drives = [{"name": "seed 7", "seed": 7, "scenarios": {
        # Fresh: the first save's cliff is free, 0.4 s after it is within 0.5; from the third
        # save on, each within 1.3 x (a cliff then counts only through the 0.5 s).
        "fresh": _run([3.0, 0.4, 0.0, 0.0], [0.6, 2.0, 1.1, 1.31], after=0.4),
        # A wrong model: at most 1 s after the first save, and from the third out of the cliff.
        "slow": _run([2.0, 0.5, 0.0, 0.1], [5.0, 1.0, 1.3, 1.2], after=0.6),
        "fast": _run([1.0, 0.0, 0.0, 0.0], [0.9, 1.0, 1.1, 1.1], after=1.2, written=1.07),
    }}]
    verdicts = _learning.check_targets(drives)

    def misses(name):
        return verdicts[name]["misses"]

    assert misses("fresh: runs over 0.5 s in the cliff after the first save") == []
    assert misses("fresh: saves from the third over 1.3 x the shortest") == [
        "seed 7 save 3: 1.31 x"]  # save 1's 2.0 x is free
    assert misses("slow: saves from the third in the cliff") == ["seed 7 save 3: 0.10 s"]
    assert misses("slow: saves from the third over 1.3 x the shortest") == []  # 1.3 is within
    assert misses("fast: runs over 1 s in the cliff after the first save") == ["seed 7: 1.20 s"]
    assert misses("fast: runs writing over 1.05 x the checkpoints") == ["seed 7: 1.070 x"]
    assert verdicts["fresh: runs writing over 1.05 x the checkpoints"]["met"]
