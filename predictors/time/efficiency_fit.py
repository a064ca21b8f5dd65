"""Fitting the kernel efficiencies of :mod:`predictors.time.efficiency` on measured rows: a
coordinate descent over the grids below, minimising the mean ``|log(predicted / measured)|``.
Held-out evaluations call it inside each fold on the fold's training rows only."""

from __future__ import annotations

import math
from collections.abc import Sequence

from predictors.devices import Device, get_device
from predictors.spec.precision import RATE_COLUMNS, get_precision
from predictors.time.analytical import COMPILED_KEY, default_efficiency, iteration_time
from predictors.time.efficiency import (
    DEVICE_GRIDS,
    apply,
    attention_key,
    device_group,
    fit_group,
    for_precision,
    gemm_key,
)
from predictors.time.features import step_work

# Grids of the development: the efficiency grid (shares of peak, log-spaced 0.1-1.0) was set
# before any fold was scored; the compiled grid was widened once after an in-sample fit hit
# its floor; fitting comm_latency and launch_overhead too was tried and dropped (worse
# leave-one-model-out), and the per-GEMM cost's grid cut to three values (runtime)
EFFICIENCY_GRID = tuple(round(0.1 * 10 ** (i / 15), 4) for i in range(16))
COMPILED_GRID = (0.1, 0.15, 0.2, 0.25, 0.35, 0.5, 0.7, 0.85, 1.0, 1.2)
GRIDS = {COMPILED_KEY: COMPILED_GRID, **DEVICE_GRIDS}
MAX_SWEEPS = 4  # coordinate descent stops earlier when a sweep improves nothing


class EfficiencyFit:
    """Rows of one fit group, their step work traced once, priced under candidate
    efficiencies. ``rows`` need ``spec``, ``strategy``, ``precision``, ``device``,
    ``options`` and ``seconds`` (e.g. :class:`predictors.datasets.fleet.FleetRow`)."""

    def __init__(self, rows: Sequence) -> None:
        self.rows = list(rows)
        self.devices = [get_device(r.device) for r in self.rows]
        self.precisions = [get_precision(r.precision) for r in self.rows]
        self.works = [step_work(r.spec, r.strategy, p, d, r.options)
                      for r, p, d in zip(self.rows, self.precisions, self.devices, strict=True)]  # fmt: skip

    def predict(self, efficiency: dict[str, float], index: Sequence[int]) -> list[float]:
        out = []
        for i in index:
            r, p = self.rows[i], self.precisions[i]
            dev = for_precision(apply(self.devices[i], efficiency), p)
            out.append(iteration_time(self.works[i], r.strategy, dev, r.options).total)
        return out

    def keys(self, index: Sequence[int]) -> list[str]:
        keys: list[str] = []
        for i in index:
            p = self.precisions[i]
            for k in (gemm_key(p), attention_key(p)):
                if k not in keys:
                    keys.append(k)
            if self.rows[i].options.compiled and COMPILED_KEY not in keys:
                keys.append(COMPILED_KEY)
        return keys + list(DEVICE_GRIDS)

    def loss(self, efficiency: dict[str, float], index: Sequence[int]) -> float:
        pred = self.predict(efficiency, index)
        return sum(abs(math.log(p / self.rows[i].seconds))
                   for p, i in zip(pred, index, strict=True)) / len(index)  # fmt: skip

    def fit(self, index: Sequence[int]) -> dict[str, float]:
        """Efficiencies fitted on the rows ``index`` only."""
        index = list(index)
        if not index:
            return {}
        keys = self.keys(index)
        current = {k: _default(k, self.devices[index[0]]) for k in keys}
        best = self.loss(current, index)
        for _ in range(MAX_SWEEPS):
            start = best
            for k in keys:
                for v in GRIDS.get(k, EFFICIENCY_GRID):
                    cand = {**current, k: v}
                    score = self.loss(cand, index)
                    if score < best:
                        best, current = score, cand
            if best >= start:
                break
        return current


def _default(key: str, device: Device) -> float:
    if key == COMPILED_KEY:
        return 1.0
    if key in DEVICE_GRIDS:
        return getattr(device, key)
    op_class, dtype = key.split(":", 1)
    if dtype not in RATE_COLUMNS:  # an fp8 recipe's own key: its rate column's default
        dtype = get_precision(dtype).recipe.rate_column
    return default_efficiency(op_class, dtype)


def fit_by_group(rows: Sequence) -> dict[str, dict[str, float]]:
    """{fit group: efficiencies} fitted on ``rows``, and per device family ``<family>/*``
    fitted on its rows of every framework (what a framework without rows there is priced
    with)."""
    groups: dict[str, list] = {}
    for r in rows:
        group = fit_group(get_device(r.device), r.options)
        groups.setdefault(group, []).append(r)
        groups.setdefault(device_group(group), []).append(r)
    return {g: EfficiencyFit(rs).fit(range(len(rs))) for g, rs in sorted(groups.items())}
