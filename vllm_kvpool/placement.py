"""Placement: which device each new chunk of a request goes to.

``bandwidth`` stripes a request's chunks over the devices in proportion to their bandwidth, so
that when the prefix is fetched back every device finishes its share at about the same time
(fetch time = max_d(bytes_d / bw_d), minimised when bytes_d is proportional to bw_d).
Shares come from the largest-remainder method with capacity caps (water filling); the order
within a request interleaves devices (smooth weighted round robin) so any prefix of the request
is striped too. ``round_robin`` uses equal weights; ``single_tier_serial`` fills devices in
config order (host first, then SSD) like a tiered cache, for comparison.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_kvpool.bandwidth import DEFAULT_HALF_LIFE, DEFAULT_LEARN_AFTER, OPS, RateEstimate
from vllm_kvpool.config import PlacementPolicy
from vllm_kvpool.split_guard import SplitGuard, shares


def largest_remainder(total: int, weights: Sequence[float], caps: Sequence[int]) -> list[int]:
    """Split ``total`` items proportionally to ``weights`` without exceeding ``caps``.

    Water filling: devices whose proportional share exceeds their cap get the cap and the rest
    is re-split over the others. Returns fewer than ``total`` only if all caps are reached.
    """
    n = len(weights)
    shares = [0] * n
    open_devs = [i for i in range(n) if weights[i] > 0 and caps[i] > 0]
    remaining = min(total, sum(caps[i] for i in open_devs))
    while remaining > 0 and open_devs:
        wsum = sum(weights[i] for i in open_devs)
        ideal = {i: remaining * weights[i] / wsum for i in open_devs}
        capped = [i for i in open_devs if shares[i] + ideal[i] >= caps[i]]
        if capped:  # give capped devices everything they can take, re-split the rest
            for i in capped:
                remaining -= caps[i] - shares[i]
                shares[i] = caps[i]
            open_devs = [i for i in open_devs if i not in capped]
            continue
        floors = {i: math.floor(ideal[i]) for i in open_devs}
        for i in open_devs:
            shares[i] += floors[i]
        leftover = remaining - sum(floors.values())
        by_remainder = sorted(open_devs, key=lambda i: (-(ideal[i] - floors[i]), -weights[i], i))
        for i in by_remainder[:leftover]:
            shares[i] += 1
        remaining = 0
    return shares


def interleave(counts: Sequence[int]) -> list[int]:
    """Device order for ``counts[d]`` chunks per device, spread evenly (smooth weighted RR)."""
    total = sum(counts)
    current = [0] * len(counts)
    order: list[int] = []
    left = list(counts)
    for _ in range(total):
        for d, c in enumerate(counts):
            if left[d] > 0:
                current[d] += c
        best = max((d for d in range(len(counts)) if left[d] > 0), key=lambda d: current[d])
        current[best] -= total
        left[best] -= 1
        order.append(best)
    return order


@dataclass
class RequestStripe:
    """Chunks of one request placed so far, per device (placement continues across steps)."""

    counts: list[int]


@dataclass
class Placement:
    policy: PlacementPolicy
    num_devices: int
    stripes: dict[str, RequestStripe] = field(default_factory=dict)

    def assign(
        self, req_id: str, num_chunks: int, weights: Sequence[float], free: Sequence[int]
    ) -> list[int]:
        """Devices for the next ``num_chunks`` chunks of ``req_id`` (may be shorter when full).

        ``weights``: current bandwidth weights (0 for failed devices); ``free``: free slots.
        """
        stripe = self.stripes.setdefault(req_id, RequestStripe([0] * self.num_devices))
        if self.policy == "single_tier_serial":
            devices = self._fill_in_order(num_chunks, weights, free)
        else:
            w = [1.0 if x > 0 else 0.0 for x in weights] if self.policy == "round_robin" else weights
            devices = self._continue_stripe(stripe.counts, num_chunks, w, free)
        for d in devices:
            stripe.counts[d] += 1
        return devices

    def forget(self, req_id: str) -> None:
        self.stripes.pop(req_id, None)

    @staticmethod
    def _fill_in_order(num_chunks: int, weights: Sequence[float], free: Sequence[int]) -> list[int]:
        devices: list[int] = []
        for d, (w, f) in enumerate(zip(weights, free, strict=True)):
            if w > 0:
                devices += [d] * min(f, num_chunks - len(devices))
        return devices

    def _continue_stripe(
        self, prior: list[int], num_chunks: int, weights: Sequence[float], free: Sequence[int]
    ) -> list[int]:
        # Target shares for the whole request so far, then hand the new chunks to the devices
        # furthest below their target: the request as a whole stays bandwidth-proportional.
        caps = [p + f for p, f in zip(prior, free, strict=True)]
        target = largest_remainder(sum(prior) + num_chunks, weights, caps)
        deficit = [max(t - p, 0) for t, p in zip(target, prior, strict=True)]
        new = [min(x, f) for x, f in zip(deficit, free, strict=True)]
        excess = sum(new) - num_chunks
        while excess > 0:  # prior over-shoot elsewhere can make deficits sum above num_chunks
            d = max(range(len(new)), key=lambda i: (new[i] - (target[i] - prior[i]), new[i]))
            new[d] -= 1
            excess -= 1
        return interleave(new)


class DeviceWeights:
    """Placement weights (GB/s): each device's read bandwidth, the probe's figure until the
    pool's own reads have measured it (``bandwidth.RateEstimate``), and failure marking.
    Writes are measured too (shown beside the reads); placement follows reads, because it
    balances the fetch (fetch time = max_d(bytes_d / read_bw_d)). The estimates only propose
    a split: ``split_guard.SplitGuard`` keeps one only once a fetch showed it is not slower
    than the split it replaces (a device's rate can depend on its share)."""

    def __init__(self, probe_gbps: Sequence[float], learn_after: int = DEFAULT_LEARN_AFTER,
                 half_life: int = DEFAULT_HALF_LIFE) -> None:  # fmt: skip
        self.probe_gbps = list(probe_gbps)
        self.reads = [RateEstimate(g, learn_after, half_life) for g in self.probe_gbps]
        self.writes = [RateEstimate(g, learn_after, half_life) for g in self.probe_gbps]
        self.failed = [False] * len(self.probe_gbps)
        self.guard = SplitGuard(self.probe_gbps)
        # each device's read estimate before the first transfer observe_fetch has not seen yet
        self._expected: list[float | None] = [None] * len(self.probe_gbps)

    @property
    def gbps(self) -> list[float]:
        """The current read estimates (measured, else the probe's)."""
        return [r.gbps for r in self.reads]

    def estimates(self) -> list[float]:
        """The read estimates, 0 for failed devices: the split they propose."""
        return [0.0 if f else r.gbps for r, f in zip(self.reads, self.failed, strict=True)]

    def for_placement(self) -> list[float]:
        """The weights new chunks are placed by: the guard's champion, or the estimates' split
        on trial (``split_guard``); call :meth:`placed` with what placement did."""
        return self._healthy(self.guard.choose(self.estimates()))

    def kept_shares(self) -> list[float]:
        """Each device's share of the split the guard keeps (its champion), failed ones 0."""
        return shares(self._healthy(self.guard.champion.weights))

    def _healthy(self, weights: Sequence[float]) -> list[float]:
        w = [0.0 if f else x for x, f in zip(weights, self.failed, strict=True)]
        return w if any(w) else self.estimates()

    def placed(self, counts: Sequence[int]) -> None:
        """A request's chunks per device, as placed by the last :meth:`for_placement`."""
        self.guard.placed(counts)

    def observe_fetch(self, nbytes: Sequence[int], seconds: Sequence[float]) -> None:
        """One report's reads per device (bytes, busy seconds; each transfer already folded in
        by :meth:`observe`): a device read ``bandwidth.CHANGED`` times faster or slower than
        its estimate restarts from this fetch (``RateEstimate.restart``), and the guard
        measures the split they were placed by."""
        for d, (est, n, s) in enumerate(zip(self.reads, nbytes, seconds, strict=True)):
            expected = self._expected[d]
            if not self.failed[d] and expected is not None and est.changed(n, s, expected):
                est.restart(n, s)
        self._expected = [None] * len(self.reads)
        if not any(f and n for f, n in zip(self.failed, nbytes, strict=True)):
            self.guard.observe_fetch(nbytes, seconds)

    def observe(self, device: int, op: str, nbytes: int, seconds: float) -> bool:
        """Fold one transfer in (``op`` "read" or "write"); True when this made the device's
        read estimate switch from the probe's figure to the measured one."""
        if op not in OPS:
            raise ValueError(f"op: {op!r} is not one of {', '.join(OPS)}")
        if self.failed[device]:
            return False  # a failing device's timings describe its errors, not its speed
        estimates = self.reads if op == "read" else self.writes
        est = estimates[device]
        if op == "read" and self._expected[device] is None:
            self._expected[device] = est.gbps
        before = est.measured_gbps is None
        est.observe(nbytes, seconds)
        if nbytes:  # every other device's evidence ages by the pool's bytes, not only its own
            for other in estimates:
                if other is not est:
                    other.age(nbytes)
        return op == "read" and before and est.measured_gbps is not None

    def fail(self, device: int) -> None:
        self.failed[device] = True
        self.guard.reset(self.probe_gbps)  # the splits' times were measured with it

    def restore(self, device: int) -> None:
        if self.failed[device]:
            self.failed[device] = False
            self.reads[device].reset()  # re-learn its throughput from the prior
            self.writes[device].reset()
            self.guard.reset(self.probe_gbps)
