"""Loss as the state: the per-batch real curves of one case, stitched.

Every chain of the TTP evaluation decides at interval boundaries (every ``interval`` samples).
Within one global batch a chain follows that batch's real curve exactly (position ``x``
samples into it). Changing the global batch at loss ``L`` continues on the new batch's curve
at the first position where that curve reaches ``L`` (its running-minimum envelope, so the map
is monotone): the training state is summarized by its validation loss. Static chains are the
real curves themselves; the DP bound (:mod:`megatron_cona.ttp.bound`), CONA and Pollux move in
this same model, so the bound is a true bound for all of them.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass

from megatron_cona.ttp.curves import Curve


class StitchError(ValueError):
    """Curves that cannot be stitched (names the batch)."""


@dataclass
class Track:
    """One batch's curve as (samples, running-min validation loss)."""

    xs: list[float]
    env: list[float]
    curve: Curve | None = None

    @classmethod
    def of(cls, samples: list[float], val_loss: list[float], curve: Curve | None = None):
        env, low = [], math.inf
        for v in val_loss:
            low = min(low, v)
            env.append(low)
        return cls(list(samples), env, curve)

    @property
    def end(self) -> float:
        return self.xs[-1]

    def loss_at(self, x: float) -> float:
        if not 0 <= x <= self.end + 1e-9:
            raise StitchError(f"position {x} outside the curve [0, {self.end}]")
        k = bisect.bisect_right(self.xs, x) - 1
        if k >= len(self.xs) - 1:
            return self.env[-1]
        x0, x1 = self.xs[k], self.xs[k + 1]
        return self.env[k] + (self.env[k + 1] - self.env[k]) * (x - x0) / (x1 - x0)

    def position(self, loss: float) -> float | None:
        """First position where the envelope reaches ``loss`` (None: never)."""
        if loss >= self.env[0]:
            return 0.0
        for k in range(1, len(self.env)):
            if self.env[k] <= loss:
                a, b = self.env[k - 1], self.env[k]
                return self.xs[k - 1] + (self.xs[k] - self.xs[k - 1]) * (a - loss) / (a - b)
        return None

    def interval_index(self, x: float) -> int:
        """Index of the measured interval that training from ``x`` runs through."""
        return min(max(bisect.bisect_right(self.xs, x + 1e-9) - 1, 0), len(self.xs) - 2)


class CurveSet:
    """The static curves of one case (one LR variant), by global batch."""

    def __init__(self, curves: Mapping[int, Curve], interval: int) -> None:
        if not curves:
            raise StitchError("no curves")
        self.interval = interval
        self.tracks = {b: Track.of(c.samples, c.val_loss, c) for b, c in curves.items()}
        start = {round(t.env[0], 6) for t in self.tracks.values()}
        if len(start) != 1:
            raise StitchError(f"curves start from different losses {sorted(start)}: not the "
                              "same initial weights")

    @classmethod
    def from_points(cls, points: Mapping[int, tuple[list[float], list[float]]], interval: int):
        """From raw (samples, losses) per batch (tests)."""
        self = cls.__new__(cls)
        self.interval = interval
        self.tracks = {b: Track.of(xs, vs) for b, (xs, vs) in points.items()}
        return self

    @property
    def batches(self) -> list[int]:
        return sorted(self.tracks)

    @property
    def initial_loss(self) -> float:
        return next(iter(self.tracks.values())).env[0]

    def enter(self, batch: int, loss: float) -> float | None:
        """Position on ``batch``'s curve for a chain arriving at ``loss``."""
        return self.tracks[batch].position(loss)

    def advance(self, batch: int, x: float) -> float | None:
        """Loss after one more interval from ``x`` (None: the curve ends before)."""
        track = self.tracks[batch]
        if x + self.interval > track.end + 1e-9:
            return None
        return track.loss_at(x + self.interval)


def crossing(t0: float, t1: float, v0: float, v1: float, target: float) -> float | None:
    """Time the segment (t0, v0) -> (t1, v1) reaches ``target`` (linear), None if it does not."""
    if v0 <= target:
        return t0
    if v1 > target:
        return None
    return t0 + (t1 - t0) * (v0 - target) / (v0 - v1)
