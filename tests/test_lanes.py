"""Lanes: the sample plan's sequence interleaves contiguous runs of the rank's slice, so that
the order stays independent of the worker count while a worker count dividing the lanes reads
each of its lanes front to back (long reads, nothing read twice)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from resume_child import keys, write_uneven

from flashstream import ShardStream
from flashstream.stream.plan import lane_buffer, lanes_for, positions, rank_sequence, read_order

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

CASES = [(0, 4, 2), (5, 4, 2), (100, 16, 1), (103, 4, 8), (7, 1, 3), (64, 16, 4), (1000, 6, 5)]


@pytest.mark.parametrize("length,count,block", CASES)
def test_lanes_cut_the_slice_into_whole_blocks(length, count, block):
    lanes = lanes_for(length, count, block)
    sizes = np.diff(lanes.starts)
    assert sizes.sum() == length and len(sizes) == count
    partial = [lane for lane, size in enumerate(sizes) if size % block]
    assert len(partial) <= 1  # the one short block ...
    p = np.arange(length)
    if partial:  # ... is the sequence's last
        assert lanes.lane_of(p[-1:])[0] == partial[0]
    assert (lanes.position_of(lanes.lane_of(p), lanes.step_of(p)) == p).all()
    assert (lanes.step_of(p) < sizes[lanes.lane_of(p)]).all()


@pytest.mark.parametrize("length,count,block", CASES)
@pytest.mark.parametrize("buffer", [0, 10])
def test_each_position_takes_an_input_of_its_own_lane(length, count, block, buffer):
    lanes = lanes_for(length, count, block)
    sequence = rank_sequence(lanes, buffer, 3, 1, 0)
    assert sorted(sequence.tolist()) == list(range(length))
    lane_of_input = np.searchsorted(lanes.starts, sequence, side="right") - 1
    assert (lane_of_input == lanes.lane_of(np.arange(length))).all()
    if buffer == 0:
        assert (np.diff(sequence[lanes.lane_of(np.arange(length)) == 0]) > 0).all()
    assert (rank_sequence(lanes, buffer, 3, 1, 0) == sequence).all()  # a pure function


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
@pytest.mark.parametrize("buffer", [0, 40])
def test_reads_come_before_delivery_and_stay_close_to_it(workers, buffer):
    """Walk a worker's reads in read_order while it delivers in position order: each input is
    read by the time it is delivered, and what is read ahead stays within about a buffer and a
    run per lane."""
    length, count, block, run = 997, 4, 3, 8
    lanes = lanes_for(length, count, block)
    sequence = rank_sequence(lanes, buffer, 0, 0, 0)
    for worker in range(workers):
        mine = np.fromiter(positions(length, worker, workers, block), dtype=np.int64)
        inputs = sequence[mine]
        order = read_order(inputs, lanes, buffer, run)
        assert sorted(order.tolist()) == list(range(len(mine)))
        read_at = np.empty(len(mine), dtype=np.int64)
        read_at[order] = np.arange(len(mine))
        held = most = 0
        done = -1
        for i in range(len(mine)):  # deliver i: read up to it first
            if read_at[i] > done:
                held += read_at[i] - done
                done = read_at[i]
            held -= 1
            most = max(most, held)
        assert most <= count * (lane_buffer(buffer, count) + run + block)


def _stream(shards, **kw):
    return ShardStream(shards, shuffle=True, seed=5, index=True, chunk_size="64KiB", **kw)


@pytest.mark.parametrize("workers", [2, 4])
def test_workers_dividing_the_lanes_read_each_byte_once(tmp_path, workers):
    shards = write_uneven(tmp_path, counts=(40, 25, 60, 35), sizes=(6000, 20000))
    total = sum(os.path.getsize(s) for s in shards)
    reference = keys(_stream(shards, lanes=4))
    stream = _stream(shards, lanes=4)
    got = keys(DataLoader(stream, batch_size=None, num_workers=workers))
    assert got == reference
    stats = stream.stats()
    assert stats["bytes_read"] <= total  # no sample read by two workers, no read-through
    assert stats["shards"] <= 4 * len(shards)  # long pieces: a lane's part of a shard


def test_one_lane_is_file_order_and_many_lanes_interleave(tmp_path):
    shards = write_uneven(tmp_path, counts=(10, 10))
    in_order = keys(ShardStream(shards, index=True))
    assert in_order == keys(ShardStream(shards, index=False))  # unshuffled: one lane
    two = keys(ShardStream(shards, index=True, lanes=2))
    assert two[0::2] == in_order[:10] and two[1::2] == in_order[10:]
    with pytest.raises(ValueError, match="lanes"):
        ShardStream(shards, lanes=0)


def test_lanes_are_part_of_the_resume_identity(tmp_path):
    shards = write_uneven(tmp_path)
    stream = _stream(shards, lanes=4)
    it = iter(stream)
    next(it)
    state = stream.state_dict()
    with pytest.raises(ValueError, match="lanes=4"):
        _stream(shards, lanes=8).load_state_dict(state)


@pytest.mark.parametrize("length,workers,block,base,start", [
    (0, 1, 1, 0, 0), (10, 1, 1, 0, 0), (103, 3, 4, 0, 0), (103, 3, 4, 7, 0), (103, 3, 4, 7, 50),
    (64, 4, 16, 0, 63), (5, 8, 2, 0, 0), (50, 2, 3, 60, 0)])
def test_position_array_matches_positions(length, workers, block, base, start):
    from flashstream.stream.plan import position_array

    for worker in range(workers):
        expected = list(positions(length, worker, workers, block, base=base, start=start))
        got = position_array(length, worker, workers, block, base=base, start=start)
        assert got.dtype == np.int64 and got.tolist() == expected


def _reference_plan(refs, urls, compressed):
    """The read plan, one ref at a time: what plan_read_arrays must find with numpy."""
    from flashstream.engine import TO_END
    from flashstream.stream.samples import READ_THROUGH, Piece

    pieces, owners, run = [], [], None

    def flush():
        if run is not None:
            shard, start, end, offsets, packed = run
            pieces.append(Piece(urls[shard], 0 if packed else start, TO_END if packed else end,
                                keep=frozenset(offsets), last_end=end))
            owners.append(shard)

    for shard, offset, end in refs:
        if (run is not None and run[0] == shard and offset >= run[2]
                and (run[4] or offset - run[2] <= READ_THROUGH)):
            run[2] = end
            run[3].append(offset)
            continue
        flush()
        run = [shard, offset, end, [offset], compressed(shard)]
    flush()
    return pieces, owners


def test_read_plans_from_arrays_match_the_reference_loop():
    from flashstream.stream.samples import READ_THROUGH, plan_read_arrays, plan_reads

    rng = np.random.default_rng(0)
    urls = [f"s{i}.tar" for i in range(4)]
    for _ in range(200):
        n = int(rng.integers(0, 30))
        shards = rng.integers(0, 4, n)
        sizes = rng.integers(512, 3 * READ_THROUGH, n)
        offsets = rng.integers(0, 40, n) * 512 + np.cumsum(sizes) * rng.integers(0, 2)
        ends = offsets + sizes
        compressed = set(rng.choice(4, 2, replace=False).tolist()).__contains__
        refs = list(zip(shards.tolist(), offsets.tolist(), ends.tolist()))
        expected = _reference_plan(refs, urls, compressed)
        got = plan_read_arrays(shards.astype(np.int64), offsets.astype(np.int64),
                               ends.astype(np.int64), urls, compressed)
        assert got == expected
        assert plan_reads(refs, urls, compressed) == expected
