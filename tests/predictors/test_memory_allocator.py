"""Caching-allocator simulator and storage tracker."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from predictors.memory.allocator import (
    CachingAllocatorSim,
    MiB,
    SimulatedOutOfMemoryError,
    UnknownBlockError,
    round_size,
    segment_size,
)
from predictors.memory.tracker import MemoryTracker


def test_rounding_and_segment_rules():
    assert round_size(1) == 512 and round_size(512) == 512 and round_size(513) == 1024
    assert segment_size(512) == 2 * MiB and segment_size(MiB) == 2 * MiB
    assert segment_size(MiB + 512) == 20 * MiB and segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(11 * MiB) == 12 * MiB


def test_small_pool_splits_and_merges():
    a = CachingAllocatorSim()
    h = [a.malloc(1000) for _ in range(4)]
    assert a.stats.reserved == 2 * MiB and a.stats.allocated == 4 * 1024
    for x in h:
        a.free(x)
    big = a.malloc(2 * MiB - 512)  # small pool? no: > 1 MiB goes to the large pool
    assert a.stats.reserved == 2 * MiB + 20 * MiB
    a.free(big)
    again = a.malloc(MiB)  # the merged 2 MiB small block is reused
    assert a.stats.reserved == 22 * MiB
    a.free(again)


def test_large_pool_shares_a_20_mib_segment_and_fragments():
    a = CachingAllocatorSim()
    x, y = a.malloc(4 * MiB), a.malloc(4 * MiB)
    assert a.stats.reserved == 20 * MiB and a.stats.num_segments == 1
    a.free(x)
    z = a.malloc(13 * MiB)  # 4 MiB hole + 12 MiB tail cannot hold it: a new segment
    assert a.stats.reserved == 20 * MiB + 14 * MiB
    assert a.fragmentation > 0
    a.free(y), a.free(z)
    with pytest.raises(UnknownBlockError):
        a.free(z)


def test_capacity_releases_cached_segments_then_ooms():
    a = CachingAllocatorSim(capacity=40 * MiB)
    h = a.malloc(30 * MiB)
    a.free(h)
    a.malloc(36 * MiB)  # needs the cached 30 MiB segment released first
    assert a.stats.num_releases == 1
    with pytest.raises(SimulatedOutOfMemoryError):
        a.malloc(8 * MiB)


def test_tracker_sees_allocations_frees_and_saved_tensors():
    tracker = MemoryTracker()
    with FakeTensorMode():
        lin = torch.nn.Linear(256, 512)
        x = torch.randn(64, 256, requires_grad=True)
        with tracker:
            tracker.register(lin.parameters(), "parameter")
            tracker.register([x], "temporary")
            tracker.phase = "forward"
            y = lin(x).relu()
            tracker.end_forward()
            # Linear saves its input (registered) and weight; relu saves its output
            assert tracker.live_bytes("activation") == 64 * 512 * 4
            tracker.phase = "backward"
            y.sum().backward()
            del y
    assert tracker.allocator.stats.allocated == round_size(256 * 512 * 4) * 2 + round_size(
        512 * 4) * 2 + round_size(64 * 256 * 4) * 2  # params, grads, x and x.grad
    assert tracker.peak.allocated >= tracker.allocator.stats.allocated


@pytest.mark.parametrize("precision", ["bf16", "bf16-mixed"])
def test_replay_shards_like_the_analytical_walk(precision):
    """The tensor-level replay applies ZeRO 1/2/3 as the phase walk does: each stage lowers
    the replayed reserved peak, which stays within fragmentation range of the analytical one."""
    from predictors.memory.factorize import factorize
    from predictors.memory.overheads import HOPPER
    from predictors.memory.phases import walk_phases
    from predictors.memory.presets import get_preset
    from predictors.memory.replay import replay_reserved
    from predictors.memory.towers import TrainConfig

    spec = get_preset("llava-1.5-7b-like")
    last = None
    for zero in (0, 1, 2, 3):
        cfg = TrainConfig(batch=1, seq=1024, precision=precision, zero=zero, dp=8)
        fz = factorize(spec, cfg)
        replayed = replay_reserved(fz, cfg, HOPPER)
        analytical = walk_phases(spec, cfg, HOPPER, fz).peak_allocated
        assert analytical * 0.98 <= replayed <= analytical * 1.3, zero
        assert last is None or replayed < last
        last = replayed
