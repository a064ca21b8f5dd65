"""The guard on adaptive placement (#46, "do no harm"): a split the estimates propose is kept
only once a fetch showed it no slower; on a device whose rate drops above a knee in its share
(a token bucket) the pool settles no slower than the even split, where following the estimates
alone is slower."""

from __future__ import annotations

import random
from collections import Counter

from tests.kvpool.test_bandwidth import CHUNK, _in_process
from vllm_kvpool.placement import largest_remainder
from vllm_kvpool.protocol import WorkerReport
from vllm_kvpool.split_guard import MAX_WAIT, RETRY_AFTER, SplitGuard


def _fetch(guard: SplitGuard, counts: list[int], seconds: list[float]) -> None:
    guard.placed(counts)
    guard.observe_fetch([c * 100 for c in counts], seconds)


def test_a_faster_challenger_is_kept_a_slower_one_is_not_then_steps_halve_and_waits_double():
    g = SplitGuard([1.0, 1.0])
    assert g.choose([3.0, 1.0]) == [1.0, 1.0]  # the champion has no time yet: measure it first
    _fetch(g, [2, 2], [1.0, 1.0])
    assert g.choose([3.0, 1.0]) == [0.75, 0.25]  # the estimates' split: tried
    _fetch(g, [3, 1], [0.75, 0.5])  # faster (0.75 s vs 1.0 s for 400 bytes): kept
    assert g.champion.weights == [0.75, 0.25] and g.challenger is None
    tried, waits = [], []
    for _ in range(5):  # the estimates keep proposing a split that is slower each time it runs
        tried.append(g.choose([1.0, 3.0]))
        _fetch(g, [1, 3], [0.25, 2.0])
        assert g.champion.weights == [0.75, 0.25]  # rejected: back to the champion
        n = 0
        while g.choose([1.0, 3.0]) == [0.75, 0.25]:
            _fetch(g, [3, 1], [0.75, 0.5])
            n += 1
        waits.append(n)
    # Each rejection halves the step toward the proposal (down to 1/8) and doubles the wait.
    assert tried == [[0.25, 0.75], [0.5, 0.5], [0.625, 0.375], [0.6875, 0.3125], [0.6875, 0.3125]]
    assert waits == [RETRY_AFTER * 2**k for k in range(4)] + [MAX_WAIT]


def test_the_wait_ends_when_the_champions_own_time_moves():
    g = SplitGuard([1.0, 1.0])
    _fetch(g, [2, 2], [1.0, 1.0])
    g.choose([3.0, 1.0])
    _fetch(g, [3, 1], [1.5, 0.2])  # rejected
    assert g.choose([3.0, 1.0]) == [1.0, 1.0]
    _fetch(g, [2, 2], [1.0, 3.0])  # a device slowed: the champion is now 3x slower
    assert g.choose([3.0, 1.0]) == [0.75, 0.25]  # the old verdict is moot: the whole step again
    _fetch(g, [3, 1], [1.5, 0.2])
    assert g.champion.weights == [0.75, 0.25]


def test_the_wait_ends_when_a_device_that_is_not_the_slowest_recovers():
    """S4's loss after the restore (development run 2): the recovered device held a small
    share, the fetch's time (its slowest device) did not move, and the guard kept waiting."""
    g = SplitGuard([1.0, 1.0])
    _fetch(g, [2, 2], [1.0, 0.5])
    assert g.choose([1.0, 3.0]) == [0.25, 0.75]
    _fetch(g, [1, 3], [0.25, 1.5])  # rejected: device 1 is slow at three quarters
    _fetch(g, [2, 2], [1.0, 0.6])  # noise on a device: still waiting
    assert g.choose([1.0, 3.0]) == [1.0, 1.0]
    _fetch(g, [2, 2], [1.0, 0.125])  # device 1 four times faster, the fetch's time the same
    assert g.choose([1.0, 3.0]) == [0.25, 0.75]


def test_a_challenger_never_fetched_is_dropped_and_an_unrelated_fetch_teaches_nothing():
    g = SplitGuard([1.0, 1.0])
    _fetch(g, [2, 2], [1.0, 1.0])
    assert g.choose([3.0, 1.0]) == [0.75, 0.25]
    g.placed([3, 1])
    g.observe_fetch([0, 400], [9.0, 9.0])  # an old prefix on one device: neither's split
    assert g.challenger is not None and g.champion.seconds_per_byte == 1.0 / 400
    for _ in range(RETRY_AFTER + 1):  # only the champion's split is fetched
        g.observe_fetch([200, 200], [1.0, 1.0])
    assert g.challenger is None and g.choose([3.0, 1.0]) == [1.0, 1.0]


def test_a_challenger_placed_exactly_as_the_champion_takes_over_at_once():
    """Capacity caps can place different weights identically: a fetch could never tell them
    apart, so the challenger takes over (with the champion's time) and the next one is tried."""
    g = SplitGuard([1.0, 1.0, 1.0])
    _fetch(g, [2, 2, 4], [1.0, 1.0, 1.0])  # device 2 holds the rest once 0 and 1 are full
    assert g.choose([1.0, 1.0, 2.0]) == [0.25, 0.25, 0.5]
    g.placed([2, 2, 4])
    assert g.challenger is None and g.champion.weights == [0.25, 0.25, 0.5]
    assert g.champion.seconds_per_byte == 1.0 / 800
    assert g.choose([1.0, 3.0, 4.0]) == [0.125, 0.375, 0.5]


class TokenBucket:
    """A device whose rate depends on its share: ``knee`` bytes a fetch at ``fast`` GB/s (the
    bucket's burst), the rest at ``slow`` (+-3% noise, seeded)."""

    def __init__(self, fast: float, slow: float, knee: int, seed: int) -> None:
        self.fast, self.slow, self.knee = fast, slow, knee
        self.rng = random.Random(seed)

    def exact(self, nbytes: int) -> float:
        burst = min(nbytes, self.knee)
        return burst / (self.fast * 1e9) + (nbytes - burst) / (self.slow * 1e9)

    def busy_seconds(self, nbytes: int) -> float:
        return self.exact(nbytes) * self.rng.uniform(0.97, 1.03)


FETCHES = 24
SETTLED_BY = 8  # fetches after which the split in use is no slower than the even one


def _fetches(devices: list[TokenBucket], n: int, change=None):
    """``n`` fetches, each of a new 16-chunk request placed by the pool (two equal priors) and
    read back from ``devices`` (``change(f)`` called before fetch ``f``): each fetch's time over
    the even split's on the devices as they are then, and the pool."""
    plan, apply, _ = _in_process()
    times = []
    for f in range(n):
        if change is not None:
            change(f)
        even = max(d.exact(8 * CHUNK) for d in devices)
        hs = [f"r{f}-{i}".encode() for i in range(32)]
        counts = Counter(plan(f"r{f}", [(i, hs[i:i + 2]) for i in range(0, 32, 2)]))
        times.append(max(devices[d].exact(k * CHUNK) for d, k in counts.items()) / even)
        apply(WorkerReport(observations=[(d, "read", k * CHUNK, devices[d].busy_seconds(k * CHUNK))
                                         for d, k in sorted(counts.items())]))  # fmt: skip
    return times, apply.__self__  # the UnifiedPool the bound method belongs to


def test_a_device_slow_above_a_knee_settles_no_slower_than_the_even_split():
    """h1 reads 8 chunks a fetch at 8 GB/s (its burst), the rest at 0.5; h0 4 GB/s throughout.
    At the even split (8 + 8 of 16) h1 is measured at 8 GB/s, so the estimates propose giving
    it about two thirds, which crosses its knee (2.5x the even split's time); measured there it
    is proposed less, then more again: following the estimates alone, one fetch in two is 1.5x
    slower than the even split. Within ``SETTLED_BY`` fetches the guarded pool is back on a
    split no slower than the even one and stays there but for rare, ever rarer trials."""
    devices = [TokenBucket(4.0, 4.0, 0, seed=1), TokenBucket(8.0, 0.5, 8 * CHUNK, seed=2)]
    times, pool = _fetches(devices, FETCHES)
    settled = times[SETTLED_BY:]
    assert max(times) > 1.2, times  # a challenger crossed the knee (the test has teeth)...
    assert sorted(settled)[len(settled) // 2] <= 1.0 + 1e-9, times  # ...and was not kept
    assert sum(t > 1.0 + 1e-9 for t in settled) <= 2, times  # trials back off
    assert sum(settled) / len(settled) <= 1.05, times  # the estimates alone: 1.25
    # What the estimates propose now still crosses the knee: the guard holds placement back.
    follow = largest_remainder(16, pool.weights.estimates(), [16, 16])
    even = max(d.exact(8 * CHUNK) for d in devices)
    assert follow[1] > 8
    assert max(d.exact(k * CHUNK) for d, k in zip(devices, follow, strict=True)) / even > 1.2


def test_a_knee_above_the_even_split_is_found_and_kept():
    """The same devices with h1's knee at 10 chunks: the estimates' split (10 on h1) is faster
    than the even one (3/4 of its time) and the guard keeps it from the first trial on."""
    devices = [TokenBucket(4.0, 4.0, 0, seed=1), TokenBucket(8.0, 1.0, 10 * CHUNK, seed=2)]
    times, _ = _fetches(devices, 8)
    assert times[0] == 1.0 and all(t <= 0.8 for t in times[1:]), times


def test_a_knee_device_slowed_then_recovered_costs_no_more_than_the_even_split_over_the_run():
    """S4 in small: h1 (8 chunks at 8 GB/s, the rest at 2) slowed to 4/3 GB/s for fetches 5-10,
    then back. Over the whole run the pool's fetches take no longer than round robin's would
    (summed, as a server waits), though the slowdown is learned and unlearned step by step."""
    devices = [TokenBucket(4.0, 4.0, 0, seed=1), TokenBucket(8.0, 2.0, 8 * CHUNK, seed=2)]

    def change(f: int) -> None:
        if f in (5, 11):
            devices[1].fast, devices[1].slow = (4 / 3, 4 / 3) if f == 5 else (8.0, 2.0)

    times, _ = _fetches(devices, 20, change)
    assert sum(times[5:11]) / 6 < 0.85, times  # slowed: fewer chunks on h1 pays off
    assert sum(times) <= len(times), times  # each time is over the even split's: mean <= 1
    assert all(t <= 1.0 + 1e-9 for t in times[-4:]), times  # recovered: no slower than even
