"""The allocator simulator on real CUDA event streams: 30 conv-net training steps recorded on
an H200 by the GPU kit (predictors/data/gpu/h200-2026-12-04-run5), replayed from their
recorded starting segments, must give the peaks PyTorch reported for the same steps."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from predictors.memory.cuda_events import RecordedStep, compact, load_steps, replay

RUN = Path(__file__).resolve().parents[2] / "predictors/data/gpu/h200-2026-12-04-run5"


def _measured() -> dict[tuple[str, str], dict]:
    with (RUN / "memory.csv").open() as f:
        return {(r["model"], r["precision"]): r for r in csv.DictReader(f)}


def test_replaying_real_streams_gives_the_real_peaks():
    measured = _measured()
    steps = [s for s in load_steps(RUN / "memory_events.jsonl.gz")
             if s.point["family"] == "vision"]
    assert len(steps) == 30
    grew = 0
    for step in steps:
        p = step.point
        real = measured[(f"{p['model']}-b{p['batch']}", p["precision"])]
        stats = replay(step)
        allocated, reserved = int(real["peak_allocated"]), int(real["peak_reserved"])
        assert stats.peak_allocated == pytest.approx(allocated, rel=0.005), p
        assert stats.peak_reserved == pytest.approx(reserved, rel=0.04), p
        assert stats.peak_reserved >= allocated
        before = sum(seg[1] for seg in step.segments_before)
        grew += reserved > before * 1.05
    assert grew >= 2  # some steps grow the cache: the replay reproduces that growth too


def test_compact_keeps_addresses_sizes_and_states():
    mib = 1 << 20
    snapshot = {"segments": [{"address": 4096, "total_size": 40 * mib, "stream": 0,
                              "segment_type": "large",
                              "blocks": [{"size": 20 * mib, "state": "active_allocated",
                                          "requested_size": 20 * mib - 100},
                                         {"size": 20 * mib, "state": "inactive"}]}],
                "device_traces": [[{"action": "alloc", "addr": 8192, "size": 20 * mib,
                                    "stream": 0, "frames": []},
                                   {"action": "free_completed", "addr": 8192,
                                    "size": 20 * mib, "stream": 0, "frames": []}]]}
    segments, events = compact(snapshot)
    assert segments == [[4096, 40 * mib, 0, "large", [[20 * mib, "active_allocated",
                                                       20 * mib - 100],
                                                      [20 * mib, "inactive", None]]]]
    assert events == [["alloc", 8192, 20 * mib, 0], ["free_completed", 8192, 20 * mib, 0]]
    # seeded with that segment, the step's 20 MiB reuses its free block: no new segment
    stats = replay(RecordedStep({}, segments, events))
    assert stats.peak_reserved == 40 * mib and stats.peak_allocated == 40 * mib
    assert stats.allocated == 20 * mib
