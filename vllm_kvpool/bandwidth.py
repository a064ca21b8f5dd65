"""A device's bandwidth measured in service: bytes per busy second of the pool's own transfers.

Every load and save an engine runs reports, per device, the bytes it moved and the time the
device was busy with them (overlapping waves charged once: the time since the device's previous
completion, so the figure is the throughput at the queue depth the pool really uses). The
estimate is the ratio of two exponentially decayed sums, bytes over busy seconds: a
byte-weighted EWMA of throughput, so many small transfers and one large one count alike, and a
slow transfer weighs in with its full (longer) time rather than as one sample among many.

What came before is decayed by the bytes the whole pool moved in that direction (``half_life``
bytes halve its weight; ``DeviceWeights`` ages every device by each observation), not by the
device's own bytes: a device that placement gave a small share would otherwise keep a slow spell
for many fetches (a device slowed, given fewer chunks, then recovered, never won its share back).

The probe's figure is the prior: until ``learn_after`` bytes have moved it counts as the bytes
still missing, at its rate, beside those measured (so the estimate moves from the prior to the
measurement as bytes come in, at the pace of the device's own share), then the measured figure
replaces it. When a device's recent evidence runs thin (its decayed bytes
below ``learn_after / STALE_DIVISOR``: placement gave it next to nothing for several half-lives),
the prior fills in the missing bytes, so a starved device's estimate drifts back toward the
probe's figure and it is tried again instead of keeping a stale figure forever.

A device that changed is not averaged with what it was: when one fetch reads a device's share
(at least ``learn_after / STALE_DIVISOR`` bytes) ``CHANGED`` times faster or slower than its
estimate, :meth:`RateEstimate.restart` drops the older evidence and the estimate is that
fetch's rate (``DeviceWeights.observe_fetch``). Decay alone follows a change over several
half-lives, and the slow spell's busy seconds outweigh a recovered device's few new bytes (issue
#46: S4's second SSD, cut to 64 MiB while slowed, was still rated at half its speed three
fetches after it recovered, so placement kept the cut split); a probe's prior that is wrong by
more than ``CHANGED`` is replaced by the first fetch that shows it. A device whose rate depends
on its share (a token bucket) can be restarted back and forth as its share crosses the knee;
the split guard (``split_guard.py``) measures what those estimates propose before placement
keeps it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_LEARN_AFTER = 256 * 2**20  # bytes before the measured figure replaces the probe's
DEFAULT_HALF_LIFE = 1 * 2**30  # bytes the pool moves (in that direction) that halve a weight
OPS = ("read", "write")  # the directions measured
STALE_DIVISOR = 8  # recent evidence below learn_after / this: blended back toward the prior
CHANGED = 2.0  # one fetch's rate this many times above or below the estimate: the device changed


def check_observation(nbytes: object, seconds: object) -> tuple[str, str] | None:
    """(the bad field, why) when an observation is unusable, else None."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        return "bytes", f"{nbytes!r} is not an integer >= 0"
    if (not isinstance(seconds, int | float) or isinstance(seconds, bool)
            or not math.isfinite(seconds) or seconds <= 0):  # fmt: skip
        return "seconds", f"{seconds!r} is not a finite number > 0"
    return None


@dataclass
class RateEstimate:
    """One device's throughput in one direction (GB/s): the probe's prior, then measured."""

    prior_gbps: float
    learn_after: int = DEFAULT_LEARN_AFTER
    half_life: int = DEFAULT_HALF_LIFE
    moved: int = 0  # bytes observed since the start (or the last reset)
    restarted: bool = False  # a fetch showed the device changed: its rate is measured now
    _bytes: float = 0.0  # decayed sums
    _seconds: float = 0.0

    def observe(self, nbytes: int, seconds: float) -> None:
        """Fold one transfer in: ``nbytes`` moved in ``seconds`` of the device's busy time
        (what came before ages by ``nbytes``, as :meth:`age`)."""
        if (bad := check_observation(nbytes, seconds)) is not None:
            raise ValueError(f"{bad[0]}: {bad[1]}")
        if nbytes == 0:
            return  # nothing moved (every read failed): no evidence either way
        self.age(nbytes)
        self._bytes += nbytes
        self._seconds += seconds
        self.moved += nbytes

    def age(self, nbytes: int) -> None:
        """``nbytes`` moved somewhere in the pool: what this device showed before weighs less."""
        keep = 0.5 ** (nbytes / self.half_life)
        self._bytes *= keep
        self._seconds *= keep

    def changed(self, nbytes: int, seconds: float, expected_gbps: float) -> bool:
        """Whether one fetch that read ``nbytes`` in ``seconds`` says the device changed: enough
        bytes to trust (``learn_after / STALE_DIVISOR``) at ``CHANGED`` times
        ``expected_gbps`` (the estimate before the fetch) or less than its ``1 / CHANGED``."""
        if nbytes < self.learn_after / STALE_DIVISOR or seconds <= 0 or expected_gbps <= 0:
            return False
        ratio = nbytes / seconds / 1e9 / expected_gbps
        return ratio >= CHANGED or ratio <= 1 / CHANGED

    def restart(self, nbytes: int, seconds: float) -> None:
        """The device changed: the estimate is ``nbytes`` in ``seconds`` alone (older evidence,
        and the prior if it was still in use, are dropped)."""
        if (bad := check_observation(nbytes, seconds)) is not None:
            raise ValueError(f"{bad[0]}: {bad[1]}")
        self._bytes, self._seconds, self.restarted = float(nbytes), float(seconds), True

    @property
    def measured_gbps(self) -> float | None:
        """The measured figure once ``learn_after`` bytes have moved (or a fetch showed the
        device changed), else None."""
        if (self.moved < self.learn_after and not self.restarted) or self._seconds <= 0:
            return None
        return self._bytes / self._seconds / 1e9

    @property
    def gbps(self) -> float:
        """The current estimate: measured (the prior filling in what recent evidence lacks
        when it is thin); before ``learn_after`` bytes have moved, the prior counted as the
        bytes still missing at its rate beside those measured, so the estimate moves from the
        prior to the measured figure as the bytes come in. Each device learns at the pace of
        its own share, so an estimate that held the prior whole until then mixed one device's
        prior with another's measurement in the split they propose (issue #46, S4 before the
        slowdown: the SSD file, given 224 of the 256 MiB ``learn_after`` a fetch, kept its
        prior 1.2 GB/s for two fetches beside the other SSD measured at 1.4, while it read at
        1.6: the prior's uneven split was proposed again and kept, 0.83x round robin)."""
        if self.prior_gbps <= 0 or self._bytes <= 0:
            return self.measured_gbps or self.prior_gbps
        if self.measured_gbps is None:
            missing = self.learn_after - self._bytes
        else:
            missing = self.learn_after / STALE_DIVISOR - self._bytes
        if missing <= 0:
            return self._bytes / self._seconds / 1e9
        return (self._bytes + missing) / (self._seconds + missing / (self.prior_gbps * 1e9)) / 1e9

    def reset(self) -> None:
        """Forget what was measured (a device that failed and came back): the prior again."""
        self.moved, self._bytes, self._seconds, self.restarted = 0, 0.0, 0.0, False
