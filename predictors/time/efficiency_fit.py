"""Fitting a device family's kernel efficiencies and its frameworks' factors
(:mod:`predictors.time.efficiency`) on measured rows: a coordinate descent over the grids below,
minimising the mean ``|log(predicted / measured)|``. Held-out evaluations call it inside each
fold on the fold's training rows only."""

from __future__ import annotations

import math
from collections.abc import Sequence

from predictors.devices import Device, get_device
from predictors.spec.options import fp8_kernels
from predictors.spec.precision import RATE_COLUMNS, get_precision
from predictors.time.analytical import (
    COMPILED_KEY,
    FP8_KEYS,
    MATMUL_CLASSES,
    MEMORY_KEY,
    TRANSPOSE_EFFICIENCY,
    TRANSPOSE_KEY,
    default_efficiency,
    iteration_time,
)
from predictors.time.efficiency import (
    DEVICE_GRIDS,
    EMULATION_HOST_KEY,
    FRAMEWORK_FACTORS,
    FSDP_OVERLAP_KEY,
    TP_OVERLAP_KEY,
    apply,
    attention_key,
    for_precision,
    framework_key,
    gemm_key,
    resolve,
    tp_overlap_key,
)
from predictors.time.features import step_work
from predictors.time.trace import FP8_TRANSPOSE

# Grids of the development: the efficiency grid (shares of peak, log-spaced 0.1-1.0) was set
# before any fold was scored; the compiled grid was widened once after an in-sample fit hit
# its floor; fitting comm_latency and launch_overhead too was tried and dropped (worse
# leave-one-model-out) before the GPU kit's host-bound rows joined; launch_overhead is fitted
# since (#44 F: better M, G, X), and the per-GEMM cost's grid cut to three values (runtime). A
# framework's factors span 1/4-4x the family's (log-spaced, set with the joint fit, #44)
EFFICIENCY_GRID = tuple(round(0.1 * 10 ** (i / 15), 4) for i in range(16))
COMPILED_GRID = (0.1, 0.15, 0.2, 0.25, 0.35, 0.5, 0.7, 0.85, 1.0, 1.2)
FACTOR_GRID = tuple(round(0.25 * 2 ** (i / 4), 4) for i in range(17))
# standalone fp8 transposes: from the no-reuse sector bound's neighbourhood (1/50) to full
# bandwidth, log-spaced (#44 item F)
TRANSPOSE_GRID = tuple(round(0.02 * 50 ** (i / 15), 4) for i in range(16))
# the emulation's host cost: 1-4x the plain step's per kernel
EMULATION_HOST_GRID = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0)
# the share of FSDP's (#44 G/X) or TP overlap's communication hidden under compute: none to
# all of it
OVERLAP_GRID = (0.0, 0.2, 0.4, 0.6, 0.7, 0.8, 0.9, 1.0)
GRIDS = {COMPILED_KEY: COMPILED_GRID, TRANSPOSE_KEY: TRANSPOSE_GRID,
         FSDP_OVERLAP_KEY: OVERLAP_GRID,
         EMULATION_HOST_KEY: EMULATION_HOST_GRID, **DEVICE_GRIDS}
# coordinate descent stops earlier when a sweep improves nothing. 4 (until #44 F) stopped some
# folds' fits before they had converged, so a change that moved a few rows' prices could shift
# every fold's fit to another point of its unfinished descent (development, leave-one-model-
# out: M 9.25 -> 8.71%, F 8.28 -> 6.84% with 10; X 11.79 -> 11.86%, G and V unchanged)
MAX_SWEEPS = 10
COARSE_STEP = 3  # the first sweep scans every third grid value, then walks to a neighbour


class EfficiencyFit:
    """Rows of one device family (any frameworks), their step work traced once, priced under
    candidate efficiencies. ``rows`` need ``spec``, ``strategy``, ``precision``, ``device``,
    ``options`` and ``seconds`` (e.g. :class:`predictors.datasets.fleet.FleetRow`)."""

    def __init__(self, rows: Sequence) -> None:
        self.rows = list(rows)
        self.devices = [get_device(r.device) for r in self.rows]
        self.precisions = [get_precision(r.precision) for r in self.rows]
        self.frameworks = [r.options.framework for r in self.rows]
        self.works = [step_work(r.spec, r.strategy, p, d, r.options)
                      for r, p, d in zip(self.rows, self.precisions, self.devices, strict=True)]  # fmt: skip

    def predict(self, efficiency: dict[str, float], index: Sequence[int]) -> list[float]:
        return [self._price(efficiency, i) for i in index]

    def _price(self, efficiency: dict[str, float], i: int) -> float:
        r, p = self.rows[i], self.precisions[i]
        framework = self.frameworks[i]
        dev = for_precision(apply(self.devices[i], resolve(efficiency, framework)), p, framework)
        return iteration_time(self.works[i], r.strategy, dev, r.options).total

    def _error(self, efficiency: dict[str, float], i: int) -> float:
        return abs(math.log(self._price(efficiency, i) / self.rows[i].seconds))

    def frameworks_of(self, index: Sequence[int], factor: str) -> list[str]:
        """Frameworks whose ``factor`` the rows ``index`` fit (``fp8``: those with fp8 rows):
        none unless two or more (one framework's factor cannot be told from the family's
        efficiencies)."""
        names = sorted({self.frameworks[i] for i in index
                        if factor != "fp8" or self.precisions[i].fp8})  # fmt: skip
        return names if len(names) > 1 else []

    def keys(self, index: Sequence[int]) -> list[str]:
        keys: list[str] = []
        for i in index:
            p = self.precisions[i]
            for k in (gemm_key(p, self.frameworks[i]), attention_key(p)):
                if k not in keys:
                    keys.append(k)
            if self.rows[i].options.compiled and COMPILED_KEY not in keys:
                keys.append(COMPILED_KEY)
            if self.rows[i].options.fsdp and FSDP_OVERLAP_KEY not in keys:
                keys.append(FSDP_OVERLAP_KEY)
            tp_share = tp_overlap_key(self.frameworks[i])
            if (self.rows[i].options.tp_comm_overlap and self.rows[i].strategy.tp > 1
                    and tp_share not in keys):
                keys.append(tp_share)
            if (p.recipe and fp8_kernels(self.frameworks[i]).python_emulation
                    and EMULATION_HOST_KEY not in keys):
                keys.append(EMULATION_HOST_KEY)
            if TRANSPOSE_KEY not in keys and any(
                    r.name == FP8_TRANSPOSE for r, _ in self.works[i].fwd_bwd.unique()):
                keys.append(TRANSPOSE_KEY)
        factors = [framework_key(f, x) for x in FRAMEWORK_FACTORS
                   for f in self.frameworks_of(index, x)]  # fmt: skip
        return keys + [MEMORY_KEY] + factors + list(DEVICE_GRIDS)

    def loss(self, efficiency: dict[str, float], index: Sequence[int]) -> float:
        return sum(self._error(efficiency, i) for i in index) / len(index)

    def _dependents(self, current: dict[str, float], keys: list[str], index: list[int],
                    errors: dict[int, float]) -> dict[str, list[int]]:  # fmt: skip
        """{key: rows of ``index`` whose price moves with it}: a key is re-priced on its rows
        only (an fp8 recipe's key, one framework's factors touch a few)."""
        out = {}
        for k in keys:
            grid = _grid(k)
            probes = (grid[0], grid[-1])
            out[k] = [i for i in index
                      if any(abs(self._error({**current, k: v}, i) - errors[i]) > 1e-12
                             for v in probes)]  # fmt: skip
        return out

    def fit(self, index: Sequence[int]) -> dict[str, float]:
        """Efficiencies (and, over two or more frameworks, their factors) fitted on the rows
        ``index`` only."""
        index = list(index)
        if not index:
            return {}
        keys = self.keys(index)
        current = {k: _default(k, self.devices[index[0]]) for k in keys}
        errors = {i: self._error(current, i) for i in index}
        deps = self._dependents(current, keys, index, errors)
        for sweep in range(MAX_SWEEPS):
            improved = False
            for k in keys:
                rows = deps[k]
                if not rows:
                    continue
                grid = _grid(k)
                memo: dict[int, tuple[float, dict[int, float]]] = {}

                def score(j: int, k=k, rows=rows, grid=grid, memo=memo) -> float:
                    if j not in memo:
                        errs = {i: self._error({**current, k: grid[j]}, i) for i in rows}
                        memo[j] = (sum(errs.values()), errs)
                    return memo[j][0]

                base = sum(errors[i] for i in rows)
                best = _nearest(grid, current[k])
                if sweep == 0:  # coarse scan first, then walk from its best
                    best = min([best, *range(0, len(grid), COARSE_STEP)], key=score)
                best = _walk(score, best, len(grid))
                if score(best) < base - 1e-12:
                    current[k] = grid[best]
                    errors.update(memo[best][1])
                    improved = True
            if not improved:
                break
        return _normalised(current, {x: self.frameworks_of(index, x) for x in FRAMEWORK_FACTORS})


def _walk(score, start: int, n: int) -> int:
    """From grid index ``start``, step to the better neighbour while the score falls."""
    best = start
    while True:
        nxt = min((j for j in (best - 1, best + 1) if 0 <= j < n), key=score, default=best)
        if score(nxt) >= score(best):
            return best
        best = nxt


def _nearest(grid: Sequence[float], value: float) -> int:
    return min(range(len(grid)), key=lambda j: abs(math.log(grid[j] or 1e-12)
                                                    - math.log(value or 1e-12)))  # fmt: skip


def _grid(key: str) -> tuple[float, ...]:
    if key.startswith("framework:"):
        return FACTOR_GRID
    if key.startswith(f"{TP_OVERLAP_KEY}:"):
        return OVERLAP_GRID
    return GRIDS.get(key, EFFICIENCY_GRID)


def _normalised(fitted: dict[str, float], frameworks: dict[str, list[str]]) -> dict[str, float]:
    """``fitted`` with each factor's geometric mean over its ``frameworks`` moved into the
    family's own values (the same prices: a GEMM's rate is the product of its efficiency,
    ``gemm`` and, in fp8, ``fp8``; a memory-bound kernel's time divides by ``memory`` and
    multiplies by ``fusion``), so a framework without a fit of its own prices as the typical
    framework."""
    out = dict(fitted)
    for factor, names in frameworks.items():
        if not names:
            continue
        keys = [framework_key(f, factor) for f in names]
        mean = math.exp(sum(math.log(out[k]) for k in keys) / len(keys))
        for k in keys:
            out[k] = round(out[k] / mean, 4)
        if factor == "fusion":
            out[MEMORY_KEY] = round(out[MEMORY_KEY] / mean, 4)
            continue
        for k in out:
            op_class, _, dtype = k.partition(":")
            if op_class in MATMUL_CLASSES and (factor == "gemm" or _is_fp8(dtype)):
                out[k] = round(out[k] * mean, 4)
    return out


def _is_fp8(dtype: str) -> bool:
    """A GEMM key's dtype part is an fp8 rate column or an fp8 recipe's precision."""
    if dtype in RATE_COLUMNS:
        return dtype in FP8_KEYS
    return get_precision(dtype).fp8


def _default(key: str, device: Device) -> float:
    if (key in (COMPILED_KEY, MEMORY_KEY, EMULATION_HOST_KEY, FSDP_OVERLAP_KEY)
            or key.startswith(("framework:", f"{TP_OVERLAP_KEY}:"))):
        return 1.0
    if key in DEVICE_GRIDS:
        return getattr(device, key)
    if key == TRANSPOSE_KEY:
        return TRANSPOSE_EFFICIENCY
    op_class, dtype = key.split(":", 1)
    if dtype not in RATE_COLUMNS:  # an fp8 recipe's own key: its rate column's default
        dtype = get_precision(dtype).recipe.rate_column
    return default_efficiency(op_class, dtype)


def fit_by_family(rows: Sequence) -> dict[str, dict[str, float]]:
    """{device family: its efficiencies and its frameworks' factors} fitted on ``rows``."""
    families: dict[str, list] = {}
    for r in rows:
        families.setdefault(get_device(r.device).family, []).append(r)
    return {f: EfficiencyFit(rs).fit(range(len(rs))) for f, rs in sorted(families.items())}
