"""A device's bandwidth measured in service: bytes per busy second of the pool's own transfers.

Every load and save an engine runs reports, per device, the bytes it moved and the time the
device was busy with them (overlapping waves charged once: the time since the device's previous
completion, so the figure is the throughput at the queue depth the pool really uses). The
estimate is the ratio of two exponentially decayed sums, bytes over busy seconds, decayed by
bytes moved (``half_life`` bytes halve the weight of what came before): a byte-weighted EWMA
of throughput, so many small transfers and one large one count alike, and a slow transfer
weighs in with its full (longer) time rather than as one sample among many.

The probe's figure is the prior: it stays the estimate until ``learn_after`` bytes have moved,
then the measured one replaces it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_LEARN_AFTER = 256 * 2**20  # bytes before the measured figure replaces the probe's
DEFAULT_HALF_LIFE = 1 * 2**30  # bytes after which an observation's weight has halved
OPS = ("read", "write")  # the directions measured


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
    _bytes: float = 0.0  # decayed sums
    _seconds: float = 0.0

    def observe(self, nbytes: int, seconds: float) -> None:
        """Fold one transfer in: ``nbytes`` moved in ``seconds`` of the device's busy time."""
        if (bad := check_observation(nbytes, seconds)) is not None:
            raise ValueError(f"{bad[0]}: {bad[1]}")
        if nbytes == 0:
            return  # nothing moved (every read failed): no evidence either way
        keep = 0.5 ** (nbytes / self.half_life)
        self._bytes = self._bytes * keep + nbytes
        self._seconds = self._seconds * keep + seconds
        self.moved += nbytes

    @property
    def measured_gbps(self) -> float | None:
        """The measured figure once ``learn_after`` bytes have moved, else None."""
        if self.moved < self.learn_after or self._seconds <= 0:
            return None
        return self._bytes / self._seconds / 1e9

    @property
    def gbps(self) -> float:
        """The current estimate: measured, else the probe's prior."""
        measured = self.measured_gbps
        return self.prior_gbps if measured is None else measured

    def reset(self) -> None:
        """Forget what was measured (a device that failed and came back): the prior again."""
        self.moved, self._bytes, self._seconds = 0, 0.0, 0.0
