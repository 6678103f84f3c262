"""Device copies into checkpoint staging: the stream ordering, with fakes here and on CUDA.

The fakes record every call, so the ordering (wait on the producer's stream, copies on the side
stream, wait for that stream alone) is checked without a GPU; the tests marked by "cuda" in
their names run the same on a real device (benchmarks/gpu.py runs them; they skip here).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from flashstream import CheckpointWriter, load_checkpoint
from flashstream.checkpoint.device_copy import enqueue_copies, wait_copies

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class FakeStream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_stream(self, other):
        self.log.append(("wait", self.name, other.name))

    def synchronize(self):
        self.log.append(("sync", self.name))


class FakeStreams:
    def __init__(self):
        self.log, self.active, self.sides = [], "default", {}

    def current(self, device):
        return FakeStream(self.log, f"current:{device}")

    def side(self, device):
        self.log.append(("side", device))
        return self.sides.setdefault(device, FakeStream(self.log, f"side:{device}"))

    @contextlib.contextmanager
    def use(self, stream):
        before, self.active = self.active, stream.name
        try:
            yield stream
        finally:
            self.active = before


class FakeTensor:
    def __init__(self, streams, device, name):
        self.streams, self.device, self.name = streams, device, name

    def copy_(self, src, non_blocking=False):
        self.streams.log.append(("copy", src.name, self.streams.active, non_blocking))


def test_copies_wait_on_the_producer_then_run_on_the_side_stream():
    streams = FakeStreams()
    jobs = [(FakeTensor(streams, "cpu", f"d{i}"), FakeTensor(streams, dev, f"s{i}"))
            for i, dev in enumerate(["cuda:0", "cuda:1", "cuda:0"])]
    sides = enqueue_copies(jobs, streams)
    assert streams.log == [
        ("side", "cuda:0"), ("wait", "side:cuda:0", "current:cuda:0"),
        ("copy", "s0", "side:cuda:0", True), ("copy", "s2", "side:cuda:0", True),
        ("side", "cuda:1"), ("wait", "side:cuda:1", "current:cuda:1"),
        ("copy", "s1", "side:cuda:1", True),
    ]
    assert streams.active == "default"  # the caller's stream is current again
    streams.log.clear()
    wait_copies(sides)
    # The side streams alone: never the producer's stream, never the whole device.
    assert streams.log == [("sync", "side:cuda:0"), ("sync", "side:cuda:1")]


def test_side_streams_are_reused_and_nothing_to_copy_touches_no_stream():
    streams = FakeStreams()
    assert enqueue_copies([], streams) == [] and streams.log == []
    job = [(FakeTensor(streams, "cpu", "d"), FakeTensor(streams, "cuda:0", "s"))]
    first, second = enqueue_copies(job, streams), enqueue_copies(job, streams)
    assert first[0] is second[0]


def test_cpu_snapshot_never_asks_for_streams(tmp_path, monkeypatch):
    import flashstream.checkpoint.staging as staging

    def refuse(*_args, **_kwargs):
        raise AssertionError("a CPU-only save queued device copies")

    monkeypatch.setattr(staging, "enqueue_copies", refuse)
    state = {"w": torch.arange(10.0), "t": torch.arange(12.0).view(3, 4).t()}
    with CheckpointWriter(tmp_path, snapshot="copy", pinned=False) as writer:
        writer.save(state, step=1).result()
    loaded = load_checkpoint(tmp_path)
    assert loaded["w"].equal(state["w"]) and loaded["t"].equal(state["t"])


# -- on a GPU (skipped without CUDA; benchmarks/gpu.py runs them on the lent machine) ---------
@needs_cuda
def test_cuda_snapshot_is_ordered_after_queued_work(tmp_path):
    w = torch.zeros(1 << 22, device="cuda")
    with CheckpointWriter(tmp_path, snapshot="copy") as writer:
        torch.cuda._sleep(200_000_000)  # keep the producer's stream busy (~0.1 s or more)
        w.fill_(3.0)  # queued behind the sleep: the save must see it
        handle = writer.save({"w": w}, step=1)
        w.fill_(5.0)  # after save returns: must not reach the checkpoint
        handle.result()
    assert torch.equal(load_checkpoint(tmp_path, map_location="cpu")["w"],
                       torch.full((1 << 22,), 3.0))


@needs_cuda
def test_cuda_snapshot_uses_pinned_staging_and_a_side_stream(tmp_path, monkeypatch):
    import flashstream.checkpoint.staging as staging

    seen = []
    real = staging.enqueue_copies

    def spy(jobs, streams):
        sides = real(jobs, streams)
        seen.extend(sides)
        return sides

    monkeypatch.setattr(staging, "enqueue_copies", spy)
    with CheckpointWriter(tmp_path) as writer:
        assert writer._staging.pinned
        writer.save({"w": torch.ones(1000, device="cuda")}, step=1).result()
    assert seen and all(s != torch.cuda.current_stream() for s in seen)


@needs_cuda
@pytest.mark.parametrize("where", ["cuda", "cuda:0", torch.device("cuda", 0), {"cpu": "cuda:0"},
                                   lambda storage, _loc: storage.cuda()])
def test_cuda_map_location_forms(tmp_path, where):
    state = {"w": torch.arange(6.0).view(2, 3), "tied": None}
    state["tied"] = state["w"][1]
    with CheckpointWriter(tmp_path) as writer:
        writer.save(state, step=1).result()
    loaded = load_checkpoint(tmp_path, map_location=where)
    assert loaded["w"].is_cuda and torch.equal(loaded["w"].cpu(), state["w"])
    assert loaded["tied"].untyped_storage().data_ptr() == loaded["w"].untyped_storage().data_ptr()


@needs_cuda
def test_cuda_load_into_device_state(tmp_path):
    model = torch.nn.Linear(64, 32).cuda()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with CheckpointWriter(tmp_path) as writer:
        writer.save(model.state_dict(), step=1).result()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    load_checkpoint(tmp_path, into=model.state_dict())
    for key, value in model.state_dict().items():
        assert value.data_ptr() == before[key] and torch.equal(value, expected[key])
