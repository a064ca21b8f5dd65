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


def _trace_linear_step(tracker: MemoryTracker, after_forward=None, after_backward=None):
    """One forward and backward of Linear(256, 512) + ReLU on 64 samples under ``tracker``;
    ``after_forward()`` runs at the forward's end, ``after_backward(lin, x)`` after the
    backward, both inside the trace. Returns ``(lin, x)``: held by the caller, their
    parameters, input and gradients stay allocated."""
    with FakeTensorMode():
        lin = torch.nn.Linear(256, 512)
        x = torch.randn(64, 256, requires_grad=True)
        with tracker:
            tracker.register(lin.parameters(), "parameter")
            tracker.register([x], "temporary")
            tracker.phase = "forward"
            y = lin(x).relu()
            tracker.end_forward()
            if after_forward:
                after_forward()
            tracker.phase = "backward"
            y.sum().backward()
            if after_backward:
                after_backward(lin, x)
            del y
    return lin, x


def test_tracker_sees_allocations_frees_and_saved_tensors():
    tracker = MemoryTracker()

    def saved() -> None:
        # Linear saves its input (registered) and weight; relu saves its output
        assert tracker.live_bytes("activation") == 64 * 512 * 4

    _held = _trace_linear_step(tracker, after_forward=saved)  # their bytes are counted below
    assert tracker.allocator.stats.allocated == round_size(256 * 512 * 4) * 2 + round_size(
        512 * 4) * 2 + round_size(64 * 256 * 4) * 2  # params, grads, x and x.grad
    assert tracker.peak.allocated >= tracker.allocator.stats.allocated


def test_phase_peaks_without_a_label_sweep_the_whole_stream():
    """What a step holds where a framework keeps some tensors elsewhere (Megatron's gradient
    buffer in place of .grad): per phase, over the whole stream, in the allocator's bytes.
    Without a label no storage has, the traced phase peaks; no gradient exists in the
    forward; the backward's gradients are left out."""
    tracker = MemoryTracker()
    _trace_linear_step(tracker, after_backward=lambda lin, x: tracker.relabel(
        [lin.weight.grad, lin.bias.grad, x.grad], "gradient"))
    assert tracker.phase_peaks_without("no such label") == tracker.phase_peaks
    without = tracker.phase_peaks_without("gradient")
    assert without["forward"] == tracker.phase_peaks["forward"]
    grads = round_size(256 * 512 * 4) + round_size(512 * 4) + round_size(64 * 256 * 4)
    assert (tracker.phase_peaks["backward"] - grads <= without["backward"]
            < tracker.phase_peaks["backward"])


@pytest.mark.parametrize("precision", ["bf16", "bf16-mixed"])
def test_replay_shards_like_the_analytical_walk(precision):
    """The tensor-level replay applies ZeRO 1/2/3 as the phase walk does: each stage lowers
    the replayed reserved peak, which stays within fragmentation range of the analytical one."""
    from predictors.memory.config import Step
    from predictors.memory.factorize import factorize
    from predictors.memory.overheads import HOPPER
    from predictors.memory.phases import walk_phases
    from predictors.memory.presets import get_preset
    from predictors.memory.replay import replay_reserved

    spec = get_preset("llava-1.5-7b-like").with_seq(1024)
    last = None
    for zero in (0, 1, 2, 3):
        cfg = Step.data_parallel(1, precision, zero=zero, dp=8)
        fz = factorize(spec, cfg)
        replayed = replay_reserved(fz, cfg, HOPPER)
        analytical = walk_phases(spec, cfg, HOPPER, fz).peak_allocated
        assert analytical * 0.98 <= replayed <= analytical * 1.3, zero
        assert last is None or replayed < last
        last = replayed


def _growing_cat(a: CachingAllocatorSim, step: int, n: int) -> list[int]:
    """DenseNet-style: each block's torch.cat output is one feature map larger than the last;
    it is allocated while the previous one is alive, then the previous one is freed.
    Returns reserved after each step."""
    prev, reserved = None, []
    for k in range(1, n + 1):
        out = a.malloc(k * step)
        if prev is not None:
            a.free(prev)
        prev = out
        reserved.append(a.stats.reserved)
    return reserved


def test_growing_cat_outputs_hand_traced():
    """4 MiB steps, traced by hand through get_free_block / should_split / get_allocation_size:
    4 MiB -> new 20 MiB segment A, split (16 MiB rest); 8 -> A's 16 MiB rest, split (8 rest);
    free 4 -> A = [4 free][8][8 free]; 12 -> no free block fits -> new 12 MiB segment B
    (>= 10 MiB: rounded to 2 MiB); free 8 -> A merges into one free 20 MiB block; 16 -> A,
    split (4 rest); free 12 -> B free; 20 -> neither 4 nor 12 fits -> new 20 MiB segment C."""
    a = CachingAllocatorSim()
    assert _growing_cat(a, 4 * MiB, 5) == [20 * MiB, 20 * MiB, 32 * MiB, 32 * MiB, 52 * MiB]
    assert a.stats.peak_allocated == (16 + 20) * MiB
    # expandable segments: one large-pool range mapped in 20 MiB pages. 4 -> map a page,
    # split (16 rest); 8 -> the 16 rest, split (8 free tail); 12 -> free 4 and 8 do not fit:
    # the free 8 MiB tail grows by one page to 28, split (16 rest); free 8 merges with 4;
    # 16 -> the 16 rest exactly (the free 12 is too small); free 12 merges: 24 free; 20 ->
    # the 24 free block, split. No third segment: 40 MiB instead of 52.
    e = CachingAllocatorSim(expandable_segments=True)
    assert _growing_cat(e, 4 * MiB, 5) == [20 * MiB, 20 * MiB, 40 * MiB, 40 * MiB, 40 * MiB]


def test_remainder_split_again_only_above_one_mib():
    a = CachingAllocatorSim()
    x = a.malloc(18 * MiB + 512)  # 20 MiB segment? no: >= 10 MiB -> 20 MiB rounded segment
    assert a.stats.reserved == 20 * MiB
    # the 1.5 MiB rest is > 1 MiB: it was split off and can serve a 1.2 MiB request
    y = a.malloc(MiB + 200 * 1024)
    assert a.stats.reserved == 20 * MiB
    # its 0.3 MiB rest is not > 1 MiB: not split, so the next large request needs a segment
    z = a.malloc(MiB + 512)
    assert a.stats.reserved == 40 * MiB
    for h in (x, y, z):
        a.free(h)


def test_max_split_size_oversize_rules():
    a = CachingAllocatorSim(max_split_size=32 * MiB)
    big = a.malloc(40 * MiB)
    a.free(big)
    small = a.malloc(8 * MiB)  # an oversize cached block is never used for a smaller request
    assert a.stats.reserved == 40 * MiB + 20 * MiB
    again = a.malloc(36 * MiB)  # oversize request: the 40 MiB block is < 36 + 20 MiB: reused
    assert a.stats.reserved == 60 * MiB
    a.free(again)
    a.malloc(60 * MiB + 512)  # 40 MiB block too small: a new 62 MiB segment
    assert a.stats.reserved == 122 * MiB
    a.free(small)
    with pytest.raises(ValueError, match="max_split_size"):
        CachingAllocatorSim(max_split_size=20 * MiB)


def test_release_available_cached_blocks_before_release_all():
    """With max_split_size a cudaMalloc failure first frees one covering cached oversize
    block (not every cached segment), then retries."""
    a = CachingAllocatorSim(capacity=100 * MiB, max_split_size=32 * MiB)
    h1, h2 = a.malloc(34 * MiB), a.malloc(40 * MiB)
    keep = a.malloc(2 * MiB)  # 20 MiB segment, split: stays cached after free (partly live)
    a.free(h1), a.free(h2)
    assert a.stats.reserved == 94 * MiB
    a.malloc(38 * MiB)  # 34 cannot serve it (too small), 40 can: reused, no release
    assert a.stats.num_releases == 0
    a.malloc(36 * MiB)  # 34 too small; cudaMalloc of 36 fails (94 + 36 > 100): free 34, retry
    assert a.stats.num_releases == 1 and a.stats.reserved == 96 * MiB
    a.free(keep)


def test_empty_cache_with_expandable_segments_unmaps_the_free_tail():
    e = CachingAllocatorSim(expandable_segments=True)
    x, y = e.malloc(30 * MiB), e.malloc(30 * MiB)
    assert e.stats.reserved == 60 * MiB  # 3 pages of 20 MiB, one range
    e.free(y)
    e.empty_cache()
    # the free tail [30, 60) MiB: the page [40, 60) is unmapped, [30, 40) shares a page
    # with x and stays mapped
    assert e.stats.reserved == 40 * MiB
    y = e.malloc(10 * MiB)  # fits the still-mapped rest of x's page: nothing new mapped
    assert e.stats.reserved == 40 * MiB
    e.free(x), e.free(y)


# --- DenseNet-, U-Net- and ResNet-style nets through the module path ---------------------------
class Dense(torch.nn.Module):
    """DenseNet-style: every layer concatenates its output to a growing feature map."""

    def __init__(self, c0: int = 32, g: int = 32, n: int = 6) -> None:
        super().__init__()
        nn = torch.nn
        self.stem = nn.Conv2d(3, c0, 3, padding=1)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.BatchNorm2d(c0 + i * g), nn.ReLU(),
                          nn.Conv2d(c0 + i * g, g, 3, padding=1)) for i in range(n))  # fmt: skip
        self.head = nn.Linear(c0 + n * g, 10)

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = torch.cat([x, layer(x)], 1)
        return self.head(x.mean((2, 3)))


class UNet(torch.nn.Module):
    """U-Net-style: two downsampling stages, two upsampling stages with skip concatenation."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        nn = torch.nn
        self.d1 = nn.Conv2d(3, c, 3, padding=1)
        self.d2 = nn.Conv2d(c, 2 * c, 3, padding=1, stride=2)
        self.d3 = nn.Conv2d(2 * c, 4 * c, 3, padding=1, stride=2)
        self.u2 = nn.ConvTranspose2d(4 * c, 2 * c, 2, stride=2)
        self.c2 = nn.Conv2d(4 * c, 2 * c, 3, padding=1)
        self.u1 = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.c1 = nn.Conv2d(2 * c, c, 3, padding=1)
        self.out = nn.Conv2d(c, 3, 1)

    def forward(self, x):
        a = torch.relu(self.d1(x))
        b = torch.relu(self.d2(a))
        c = torch.relu(self.d3(b))
        b2 = torch.relu(self.c2(torch.cat([self.u2(c), b], 1)))
        a2 = torch.relu(self.c1(torch.cat([self.u1(b2), a], 1)))
        return self.out(a2)


class Res(torch.nn.Module):
    """ResNet-style: residual blocks of two convolutions."""

    def __init__(self, c: int = 32, n: int = 4) -> None:
        super().__init__()
        nn = torch.nn
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
                          nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c))
            for _ in range(n))  # fmt: skip
        self.head = nn.Linear(c, 10)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = torch.relu(x + block(x))
        return self.head(x.mean((2, 3)))


@pytest.mark.parametrize("net,target", [
    (Dense, lambda: torch.randint(0, 10, (8,))),
    (UNet, lambda: torch.randn(8, 3, 64, 64)),
    (Res, lambda: torch.randint(0, 10, (8,))),
])  # fmt: skip
def test_cnn_reserved_over_allocated_stays_bounded(net, target):
    """The issue's example read reserved 3.6x allocated on a DenseNet-style net; with the
    allocator's rules followed (growing cat outputs reuse merged free blocks) the ratio of
    these nets stays below 2 (a regression bound: no GPU measured here)."""
    from predictors.memory.module import predict_module_memory

    p = predict_module_memory(net, torch.randn(8, 3, 64, 64), target())
    assert p.max_memory_allocated <= p.max_memory_reserved <= 2 * p.max_memory_allocated
