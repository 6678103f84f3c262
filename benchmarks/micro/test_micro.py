"""Micro-benchmarks (pytest-benchmark) of the costs a whole-run benchmark hides.

- the tar scanner's throughput on 8 KB and 100 KB members (memory in, samples out);
- the stream's Python cost per sample (a small shard in the page cache: CPU, not the drive);
- the latency histogram's cost per recorded value (one call, and vectorized);
- checkpoint layout planning per tensor (a first save, and a later one reusing the plan).

CI runs each once as a smoke test (``--benchmark-disable`` is in the pytest options). Measure
and compare runs as docs/benchmarks.md shows::

    pytest benchmarks/micro --benchmark-enable --benchmark-autosave
    pytest benchmarks/micro --benchmark-enable --benchmark-compare   # against the last save
"""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest
import torch

from flashstream import ShardStream
from flashstream.engine import LatencyRecorder, Scanner
from flashstream.telemetry.histogram import LatencyHistogram

PIECE = 4 << 20  # what the reader hands the scanner per chunk


def tar_bytes(member_size: int, total: int) -> tuple:
    """An archive of about ``total`` bytes of samples with a label and a ``member_size``
    payload, and its number of samples."""
    out = io.BytesIO()
    payload = (bytes(range(256)) * (member_size // 256 + 1))[:member_size]
    count = max(1, total // (member_size + 1024))
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(count):
            for ext, data in (("cls", b"%d" % (i % 10)), ("bin", payload)):
                info = tarfile.TarInfo(f"s{i:07d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue(), count


def mean_seconds(benchmark) -> float:
    """The measured mean, or 0 under --benchmark-disable (ran once, nothing measured)."""
    return benchmark.stats.stats.mean if benchmark.stats is not None else 0.0


def rate(benchmark, key: str, units: float) -> None:
    """Units per second into the saved run's extra_info."""
    if mean := mean_seconds(benchmark):
        benchmark.extra_info[key] = units / mean


def cost(benchmark, key: str, units: float, scale: float) -> None:
    """Seconds per unit, times ``scale`` (1e6: microseconds), into extra_info."""
    if mean := mean_seconds(benchmark):
        benchmark.extra_info[key] = mean / units * scale


@pytest.mark.parametrize("member_size", [8 << 10, 100 << 10], ids=["8KB", "100KB"])
def test_scanner_throughput(benchmark, member_size):
    data, count = tar_bytes(member_size, 32 << 20)
    view = memoryview(data)

    def scan() -> int:
        scanner = Scanner()
        scanner.begin_shard("bench", None, 0)
        samples = 0
        for at in range(0, len(data), PIECE):
            scanner.feed(view[at:at + PIECE])
            samples += len(scanner.take())
        scanner.end_shard()
        return samples + len(scanner.take())

    assert benchmark(scan) == count
    rate(benchmark, "MB/s", len(data) / 1e6)


def test_stream_python_cost_per_sample(benchmark, tmp_path):
    path = tmp_path / "small.tar"
    path.write_bytes(tar_bytes(1000, 4 << 20)[0])
    stream = ShardStream(str(path))
    count = sum(1 for _ in stream)  # warm: page cache, imports, index cache

    def epoch() -> int:
        return sum(1 for _ in stream)

    assert benchmark(epoch) == count
    cost(benchmark, "us/sample", count, scale=1e6)


def test_histogram_record_per_call(benchmark):
    recorder = LatencyRecorder()
    values = [int(v) for v in np.random.default_rng(0).lognormal(11, 1, 10_000)]

    def record() -> None:
        for v in values:
            recorder.record(v)

    benchmark(record)
    cost(benchmark, "ns/record", len(values), scale=1e9)


def test_histogram_record_vectorized(benchmark):
    values = np.random.default_rng(0).lognormal(11, 1, 1_000_000).astype(np.uint64)

    def record() -> None:
        LatencyHistogram().record_many(values)

    benchmark(record)
    cost(benchmark, "ns/value", len(values), scale=1e9)


@pytest.mark.parametrize("reuse", [False, True], ids=["first-save", "reused-plan"])
def test_checkpoint_layout_per_tensor(benchmark, reuse):
    from flashstream.checkpoint.writer import _layout

    state = {f"layer{i}.weight": torch.zeros(16) for i in range(10_000)}
    _, plan = _layout(state, 0, 0, 1)

    def layout() -> None:
        _layout(state, 1, 0, 1, plan if reuse else None)

    benchmark(layout)
    cost(benchmark, "us/tensor", len(state), scale=1e6)
