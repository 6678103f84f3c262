"""Loads onto a device (checkpoint/device_feed.py): the ordering with fakes here, on CUDA there.

The fakes record every call, so the rules (the side stream waits on the current stream before
any copy, a pinned buffer is refilled only after its last copy's event, the load waits for the
side stream) are checked without a GPU, with real CPU tensors standing in for device memory.
The tests with "cuda" in their names run the real path on a device (benchmarks/gpu.py runs
them; they skip here).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import flashstream.checkpoint.reading as reading
from flashstream import CheckpointWriter, ChecksumError, load_checkpoint
from flashstream.checkpoint.device_feed import DeviceFeed, DeviceFeeds
from flashstream.checkpoint.structure import flatten, saved_devices

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class FakeEvent:
    def __init__(self, log, n):
        self.log, self.n = log, n

    def synchronize(self):
        self.log.append(("event sync", self.n))


class FakeSide:
    def __init__(self, log):
        self.log, self.events = log, 0

    def wait_stream(self, other):
        self.log.append(("wait", other))

    def record_event(self):
        self.events += 1
        self.log.append(("record", self.events))
        return FakeEvent(self.log, self.events)

    def synchronize(self):
        self.log.append(("side sync",))


class FakeStreams:
    def __init__(self):
        self.log = []
        self.sides = {}

    def current(self, device):
        return f"current:{device}"

    def side(self, device):
        return self.sides.setdefault(device, FakeSide(self.log))

    @contextlib.contextmanager
    def use(self, stream):
        self.log.append(("use",))
        yield stream


def test_feed_waits_on_the_current_stream_and_reuses_a_buffer_only_after_its_copy():
    streams = FakeStreams()
    feed = DeviceFeed("dev", 8, streams, slots=2, pin_memory=False)
    dst = torch.zeros(40, dtype=torch.uint8)
    src = torch.arange(40, dtype=torch.uint8)
    for k in range(5):
        feed.copy(dst[8 * k:8 * k + 8], src[8 * k:8 * k + 8])
    feed.finish()
    assert torch.equal(dst, src)
    log = streams.log
    assert log[0] == ("wait", "current:dev")  # before any copy
    # Two buffers: the third copy refills buffer 0 once the first copy's event is done, the
    # fourth buffer 1 after the second's, the fifth buffer 0 after the third's.
    syncs = [entry for entry in log if entry[0] == "event sync"]
    assert syncs == [("event sync", 1), ("event sync", 2), ("event sync", 3)]
    assert log.index(("event sync", 1)) > log.index(("record", 2))
    assert log[-1] == ("side sync",)


def test_feed_refuses_a_piece_larger_than_its_buffers():
    feed = DeviceFeed("dev", 8, FakeStreams(), slots=1, pin_memory=False)
    with pytest.raises(ValueError, match="exceeds the pinned buffer"):
        feed.copy(torch.zeros(9, dtype=torch.uint8), torch.zeros(9, dtype=torch.uint8))


def test_feeds_make_one_feed_per_device():
    streams = FakeStreams()
    feeds = DeviceFeeds(16, streams, pin_memory=False)
    a, b = torch.zeros(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)
    feeds.copy(a, torch.ones(4, dtype=torch.uint8))
    feeds.copy(b, torch.full((4,), 2, dtype=torch.uint8))
    feeds.finish()
    assert list(streams.sides) == [torch.device("cpu")]  # both on one device: one feed
    assert a.eq(1).all() and b.eq(2).all()


def test_saved_devices_names_each_tensors_device():
    state = {"model": {"w": torch.ones(3), "b": torch.zeros(2)}, "opt": [torch.ones(1)],
             "tied": None, "arr": np.zeros(2), "step": 7}
    state["tied"] = state["model"]["w"][1:]
    skeleton, entries = flatten(state)
    devices = saved_devices(skeleton)
    assert set(devices) == {e.name for e in entries if not e.numpy}
    assert set(devices.values()) == {None}
    skeleton = {"D": [["a", {"T": "x", "d": "cuda:1"}], ["b", {"L": [{"T": "y"}]}],
                      [{"U": [1, 2]}, {"T": "x", "d": "cuda:0", "v": [0, [1], [1]]}]]}
    assert saved_devices(skeleton) == {"x": "cuda:1", "y": None}  # the first reference decides


# -- on a GPU (skipped without CUDA; benchmarks/gpu.py runs them on the lent machine) ---------
def _big_state():
    # Several read chunks (4 MiB each), tensors that straddle chunk ends, and small ones.
    return {"big": torch.randn(5 << 20), "odd": torch.randn(3_000_001), "small": torch.arange(10),
            "half": torch.randn(1000, 999).half(), "step": 3}


@needs_cuda
@pytest.mark.parametrize("where", ["cuda", None])
def test_cuda_load_reads_through_the_pinned_feed(tmp_path, monkeypatch, where):
    state = _big_state()
    if where is None:  # saved on the device, loaded back there with no map_location
        state = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    copies = []

    class Spy(DeviceFeeds):
        def copy(self, dst, src):
            copies.append(src.numel())
            super().copy(dst, src)

    monkeypatch.setattr(reading, "DeviceFeeds", Spy)
    with CheckpointWriter(tmp_path) as writer:
        writer.save(state, step=3).result()
    loaded = load_checkpoint(tmp_path, map_location=where)
    for key in ("big", "odd", "small", "half"):
        assert loaded[key].is_cuda and torch.equal(loaded[key].cpu(), state[key].cpu())
    total = sum(v.numel() * v.element_size() for v in state.values()
                if isinstance(v, torch.Tensor))
    assert sum(copies) == total and max(copies) <= reading._CHUNK


@needs_cuda
def test_cuda_load_into_state_waits_for_queued_work(tmp_path):
    saved = torch.arange(1 << 22, dtype=torch.float32)
    with CheckpointWriter(tmp_path) as writer:
        writer.save({"w": saved}, step=1).result()
    w = torch.zeros(1 << 22, device="cuda")
    torch.cuda._sleep(200_000_000)  # keep the current stream busy (~0.1 s or more)
    w.fill_(7.0)  # queued behind the sleep: the load must land after it
    load_checkpoint(tmp_path, into={"w": w})
    assert torch.equal(w.cpu(), saved)


@needs_cuda
def test_cuda_load_of_a_corrupt_tensor_names_it(tmp_path):
    with CheckpointWriter(tmp_path) as writer:
        writer.save({"a": torch.ones(1 << 20), "b": torch.ones(1 << 20)}, step=1).result()
    file = next(tmp_path.glob("step-*/*.safetensors"))
    data = bytearray(file.read_bytes())
    data[-100] ^= 0xFF  # inside the last tensor
    file.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="checksum mismatch in '[ab]'"):
        load_checkpoint(file, map_location="cuda")
