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
    monkeypatch.setattr(probe, "copy_gbps", lambda t, *_: tried.append(t) or gbps[t])
    monkeypatch.setattr(probe.os, "sched_getaffinity", lambda _: set(range(4)))
    assert probe.probe_copy_threads(config()) == want
    assert tried == [1, 2, 4]


def test_configured_or_unprobed_counts_skip_the_probe(monkeypatch):
    monkeypatch.setattr(probe, "copy_gbps", lambda *_: pytest.fail("probed"))
    monkeypatch.setattr(probe.os, "sched_getaffinity", lambda _: set(range(16)))
    assert probe.probe_copy_threads(config(copy_threads=3)) == 3
    assert probe.probe_copy_threads(config(probe={"enabled": False})) == 8


def test_real_probe_picks_a_tried_count():
    pytest.importorskip("vllm_kvpool._kvio")
    got = probe.probe_copy_threads(config(probe={"seconds": 0.05, "size": "8MiB"}))
    assert got in probe.copy_thread_counts(len(probe.os.sched_getaffinity(0)))
