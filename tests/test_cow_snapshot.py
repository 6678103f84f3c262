"""Copy-on-write snapshots of torch CPU tensors (flashstream.engine.cow_snapshot).

The staging buffer must end up with every tensor's bytes as of the snapshot, however training
writes to the tensors right after it returns, and no tensor may stay write-protected.
"""

from __future__ import annotations

import mmap
import threading
from typing import List, Tuple

import numpy as np
import pytest
import torch

from flashstream import engine

pytestmark = pytest.mark.skipif(not engine.cow_available(),
                                reason="userfaultfd write protection is not available here")


class Staging:
    """An anonymous mmap the snapshot copies into, laid out tensor after tensor."""

    def __init__(self, tensors: List[torch.Tensor]) -> None:
        self.offsets = []
        size = 0
        for t in tensors:
            self.offsets.append(size)
            size += t.numel() * t.element_size() + 64 + 13  # odd gaps: unaligned destinations
        self.map = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.array = np.frombuffer(self.map, dtype=np.uint8)
        self.base = self.array.ctypes.data

    def ranges(self, tensors: List[torch.Tensor]) -> List[Tuple[int, int, int]]:
        return [(t.data_ptr(), self.base + off, t.numel() * t.element_size())
                for t, off in zip(tensors, self.offsets)]

    def get(self, i: int, like: torch.Tensor) -> torch.Tensor:
        n = like.numel() * like.element_size()
        if n == 0:
            return torch.empty_like(like)
        raw = self.array[self.offsets[i]: self.offsets[i] + n].copy()
        return torch.from_numpy(raw).view(like.dtype).reshape(like.shape)


def snapshot(tensors: List[torch.Tensor], **kw):
    staging = Staging(tensors)
    snap = engine.cow_snapshot(staging.ranges(tensors), **kw)
    return staging, snap


def check_stats(snap, total: int) -> dict:
    s = snap.stats()
    assert s["eager_bytes"] + s["protected_bytes"] == total
    assert s["fault_bytes"] + s["background_bytes"] == s["protected_bytes"]
    return s


def test_in_place_writes_right_after_the_snapshot():
    torch.manual_seed(0)
    big = torch.randn(20 * 1024 * 1024)  # 80 MiB
    base = torch.randn(3 * 1024 * 1024)
    view = base[1001:500_000]  # a view of the same storage, unaligned
    tensors = [big, torch.randn(3), torch.arange(1001, dtype=torch.uint8),
               torch.randn(257, 33, dtype=torch.float64), base, view,
               torch.randint(0, 100, (5_000_001,), dtype=torch.int16), torch.empty(0)]
    before = [t.clone() for t in tensors]
    staging, snap = snapshot(tensors)
    big.add_(1)
    base.zero_()
    tensors[3].mul_(-2)
    tensors[6].fill_(7)
    snap.wait()
    assert snap.done()
    for i, t in enumerate(before):
        assert torch.equal(staging.get(i, t), t), f"tensor {i}"
    assert torch.equal(big, before[0] + 1)  # the writes went through
    assert int(base.abs().sum()) == 0
    s = check_stats(snap, sum(t.numel() * t.element_size() for t in tensors))
    assert s["protected_bytes"] > 64 << 20
    assert s["fault_copies"] > 0  # add_ overtook the background copier


def test_optimizer_step_after_the_snapshot():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(1000, 3000), torch.nn.ReLU(),
                                torch.nn.Linear(3000, 17))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(64, 1000)
    model(x).square().mean().backward()
    opt.step()  # creates the optimizer state
    state = list(model.parameters())
    state += [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
    before = [t.detach().clone() for t in state]
    staging, snap = snapshot([t.detach() for t in state], block=256 << 10)
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    snap.wait()
    for i, t in enumerate(before):
        assert torch.equal(staging.get(i, t), t), f"tensor {i}"
    assert not torch.equal(state[0].detach(), before[0])
    check_stats(snap, sum(t.numel() * t.element_size() for t in state))


def test_writes_from_another_thread_and_no_wait():
    t = torch.randn(32 * 1024 * 1024)  # 128 MiB
    before = t.clone()
    staging, snap = snapshot([t])
    worker = threading.Thread(target=lambda: t.mul_(3))
    worker.start()
    worker.join()
    del snap  # the destructor waits: nothing stays protected
    t.add_(1)
    assert torch.equal(staging.get(0, before), before)


def test_invalid_ranges_raise_before_protecting():
    t = torch.randn(4 * 1024 * 1024)
    ptr, n = t.data_ptr(), t.numel() * 4
    with pytest.raises(ValueError):
        engine.cow_snapshot([(ptr, ptr + 4096, n)])  # destination overlaps the source
    with pytest.raises(ValueError):
        engine.cow_snapshot([(ptr, ptr + n, -1)])
    with pytest.raises(ValueError):
        engine.cow_snapshot([(ptr, 0, n)])  # null destination
    with pytest.raises(ValueError):
        engine.cow_snapshot([(ptr, ptr + n)])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        engine.cow_snapshot([], block=1000)
    t.add_(1)  # still writable
    u = torch.randn(1024)
    staging, snap = snapshot([u])
    snap.wait()
    snap.wait()  # twice is fine
    u.zero_()


def test_stats_and_mode():
    assert engine.cow_mode() == "full"
    t = torch.randn(1024 * 1024 + 3)
    staging, snap = snapshot([t])
    snap.wait()
    s = check_stats(snap, t.numel() * 4)
    assert s["protected_bytes"] > 0 and s["eager_bytes"] > 0  # the unaligned tail page
    assert set(s) >= {"protect_seconds", "eager_seconds", "copy_seconds", "fault_copies"}


def _outside(ranges: List[Tuple[int, int]], start: int, length: int) -> bool:
    return all(a + n <= start or start + length <= a for a, n in ranges)


def test_sources_released_during_the_copy_are_reported_not_copied_or_crashed():
    # FSDP frees an unsharded parameter's storage with resize_(0) right after using it. 64 MiB
    # sources are mmap'd by malloc, so the free unmaps them under the background copier: that
    # was a SIGSEGV. Now their blocks are reported lost; the rest is copied exactly.
    torch.manual_seed(1)
    tensors = [torch.randn(16 << 20) for _ in range(6)]  # 6 x 64 MiB
    before = [t.clone() for t in tensors]
    staging, snap = snapshot(tensors)
    for t in tensors[1:]:
        t.untyped_storage().resize_(0)
    snap.wait()
    stats = snap.stats()
    lost = snap.lost()
    assert stats["lost_bytes"] == sum(n for _, n in lost) > 0
    for i, t in enumerate(before):
        n = t.numel() * t.element_size()
        dst = staging.base + staging.offsets[i]
        assert all(dst <= a and a + m <= dst + n for a, m in lost
                   if not _outside([(a, m)], dst, n)), "a lost range spans two tensors"
        if _outside(lost, dst, n):
            assert torch.equal(staging.get(i, t), t), f"tensor {i} copied wrong"
    assert _outside(lost, staging.base, before[0].numel() * 4)  # never released: whole


def test_a_file_mapped_between_the_sources_during_the_copy():
    # Two sources in one anonymous mapping are registered as one span covering the gap
    # between them. Mapping a file into that gap made the final unregister fail (EINVAL) and
    # with it a snapshot whose data was copied correctly.
    import ctypes
    import tempfile

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    part, gap = 64 << 20, 1 << 20
    area = mmap.mmap(-1, 2 * part + gap, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(area, dtype=torch.uint8)
    whole.random_(0, 256)
    first, second = whole[:part], whole[part + gap:]
    expected = [first.clone(), second.clone()]
    staging, snap = snapshot([first, second])
    with tempfile.TemporaryFile() as f:
        f.truncate(gap)
        at = libc.mmap(whole.data_ptr() + part, gap, mmap.PROT_READ,
                       mmap.MAP_SHARED | 0x10, f.fileno(), 0)  # 0x10: MAP_FIXED
        assert at == whole.data_ptr() + part, ctypes.get_errno()
        first.add_(1)  # writes during the copy still see the old bytes in the snapshot
        snap.wait()
    assert snap.stats()["lost_bytes"] == 0
    for i, t in enumerate(expected):
        assert torch.equal(staging.get(i, t), t)
    del first, second, whole
    area.close()
