"""The copy threads of a fetch's host share come from the memcpy probe (issue #24 item 1)."""

from __future__ import annotations

import pytest

from vllm_kvpool import probe
from vllm_kvpool.config import load_pool_config


def config(**extra):
    return load_pool_config({"devices": [{"host": {"capacity": "64MiB"}}], **extra})


@pytest.mark.parametrize(("cpus", "counts"), [(1, [1]), (2, [1, 2]), (6, [1, 2, 4, 6]),
                                              (64, [1, 2, 4, 8])])  # fmt: skip
def test_thread_counts_tried(cpus, counts):
    assert probe.copy_thread_counts(cpus) == counts


@pytest.mark.parametrize(("gbps", "want"), [({1: 5.0, 2: 9.5, 4: 10.0}, 2),  # 2 reach 90%
                                            ({1: 5.0, 2: 8.0, 4: 10.0}, 4),
                                            ({1: 9.9, 2: 9.0, 4: 10.0}, 1)])  # fmt: skip
def test_fewest_threads_near_the_best_bandwidth(monkeypatch, gbps, want):
    tried = []
    monkeypatch.setattr(probe, "copy_gbps", lambda ts, *_: tried.append(ts) or gbps)
    monkeypatch.setattr(probe.os, "sched_getaffinity", lambda _: set(range(4)))
    assert probe.probe_copy_threads(config()) == want
    assert tried == [[1, 2, 4]]


def test_copy_probe_interleaves_the_counts_and_takes_each_ones_median(monkeypatch):
    """Each count is timed in turns (order reversed every other round) and gets its median: a
    neighbour's burst during one count's turn no longer decides the choice."""
    pytest.importorskip("vllm_kvpool._kvio")
    calls = []
    real = probe.kvio()

    class Spy:
        def copy_many(self, ops, threads=1):
            calls.append(threads)
            return real.copy_many(ops, threads=threads)

    monkeypatch.setattr(probe, "kvio", lambda: Spy())
    got = probe.copy_gbps([1, 2], 2 * 2**20, 0.02, rounds=4)
    assert sorted(got) == [1, 2] and all(v > 0 for v in got.values())
    timed = calls[1:]  # the first call touches the pages
    stretches = [t for i, t in enumerate(timed) if i == 0 or timed[i - 1] != t]
    assert stretches == [1, 2, 1, 2, 1]  # rounds 1,2 | 2,1 | 1,2 | 2,1


def test_configured_or_unprobed_counts_skip_the_probe(monkeypatch):
    monkeypatch.setattr(probe, "copy_gbps", lambda *_: pytest.fail("probed"))
    monkeypatch.setattr(probe.os, "sched_getaffinity", lambda _: set(range(16)))
    assert probe.probe_copy_threads(config(copy_threads=3)) == 3
    assert probe.probe_copy_threads(config(probe={"enabled": False})) == 8


def test_real_probe_picks_a_tried_count():
    pytest.importorskip("vllm_kvpool._kvio")
    got = probe.probe_copy_threads(config(probe={"seconds": 0.05, "size": "8MiB"}))
    assert got in probe.copy_thread_counts(len(probe.os.sched_getaffinity(0)))
