"""Per-device-family, per-framework, per-precision kernel efficiencies fitted on development
fleet rows.

The roofline prices a GEMM at ``FLOPs / (peak(dtype) x efficiency)``. Instead of assumed
shares of peak (:data:`predictors.analytical.MATMUL_EFFICIENCY`, the fallback), each device
family under each framework (:data:`predictors.spec.FRAMEWORKS`: ``h100/torchtitan``,
``a100/megatron``, ...) gets its own, fitted on the rows it is trained with (a framework's
fused kernels, FSDP implementation and compiler decide how much of the peak its GEMMs and
everything around them reach; a fit for one framework is not used for another):

* ``matmul:<dtype>`` per precision's GEMM dtype (``bf16``, ``fp16``), and per fp8 recipe
  ``matmul:<precision>`` (``fp8`` = TE delayed scaling, ``fp8-current`` = torchao/TE
  tensorwise current scaling, ``fp8-rowwise``): the recipes' GEMMs and casts reach different
  shares of the same fp8 peak;
* ``attention:<dtype>``: the fused attention kernel;
* ``compiled``: torch.compile's factor on the non-GEMM kernels' time;
* ``gemm_latency``: the fixed cost of a GEMM beyond ``FLOPs / rate`` (``Device.gemm_latency``),
  which makes the efficiency depend on the GEMM's size: a GEMM of ``F`` FLOPs reaches
  ``e F / (F + gemm_latency x rate x e)`` of peak, small ones far less than large ones.

A key is fitted only where the training rows exercise it; everything else keeps the
roofline default. The fit is coordinate descent over the grids below, minimising the mean
``|log(predicted / measured)|``; held-out evaluations call it inside each fold on the fold's
training rows only.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from predictors.analytical import COMPILED_KEY, default_efficiency, iteration_time
from predictors.devices import Device, get_device
from predictors.precision import RATE_COLUMNS, Precision, get_precision
from predictors.spec import TrainingOptions

# Grids of the development: the efficiency grid (shares of peak, log-spaced 0.1-1.0) was set
# before any fold was scored; the compiled grid was widened once after an in-sample fit hit
# its floor; fitting comm_latency and launch_overhead too was tried and dropped (worse
# leave-one-model-out), and the per-GEMM cost's grid cut to three values (runtime)
EFFICIENCY_GRID = tuple(round(0.1 * 10 ** (i / 15), 4) for i in range(16))
COMPILED_GRID = (0.1, 0.15, 0.2, 0.25, 0.35, 0.5, 0.7, 0.85, 1.0, 1.2)
# Device fields fitted beside the efficiencies, with their grids
DEVICE_GRIDS = {"gemm_latency": (0.0, 5e-6, 20e-6)}
GRIDS = {COMPILED_KEY: COMPILED_GRID, **DEVICE_GRIDS}
MAX_SWEEPS = 4  # coordinate descent stops earlier when a sweep improves nothing
SHIPPED = Path(__file__).parent / "models" / "efficiency.json"


def gemm_key(precision: Precision) -> str:
    """Efficiency key of the precision's GEMMs (an fp8 recipe has its own)."""
    if precision.recipe is not None:
        return f"matmul:{precision.name}"
    return f"matmul:{_dtype(precision)}"


def attention_key(precision: Precision) -> str:
    # an fp8 recipe leaves attention in its fallback's dtype
    fallback = get_precision(precision.recipe.fallback) if precision.recipe else precision
    return f"attention:{_dtype(fallback)}"


def _dtype(p: Precision) -> str:
    """The device rate column the precision's (non-fp8) GEMMs run at."""
    if p.compute_dtype == torch.bfloat16:
        return "bf16"
    if p.compute_dtype == torch.float16:
        return "fp16"
    return "tf32" if p.tf32 else "fp32"


def for_precision(device: Device, precision: Precision) -> Device:
    """``device`` with its fp8 GEMM efficiency set to the recipe's own fitted one (the traced
    fp8 GEMMs all price at the ``matmul:fp8`` / ``matmul:mxfp8`` key)."""
    if precision.recipe is None:
        return device
    fitted = device.efficiency.get(gemm_key(precision))
    if fitted is None:
        return device
    column = f"matmul:{precision.recipe.rate_column}"
    return replace(device, efficiency={**device.efficiency, column: fitted})


class EfficiencyFit:
    """Rows of one fit group, their step work traced once, priced under candidate
    efficiencies. ``rows`` need ``spec``, ``strategy``, ``precision``, ``device``,
    ``options`` and ``seconds`` (e.g. :class:`predictors.fleet.FleetRow`)."""

    def __init__(self, rows: Sequence) -> None:
        from predictors.features import step_work

        self.rows = list(rows)
        self.devices = [get_device(r.device) for r in self.rows]
        self.precisions = [get_precision(r.precision) for r in self.rows]
        self.works = [step_work(r.spec, r.strategy, p, d)
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


def fit_group(device: Device, options: TrainingOptions) -> str:
    """Key of the efficiencies that price a run: ``<device family>/<framework>``."""
    return f"{device.family}/{options.framework}"


def fit_by_group(rows: Sequence) -> dict[str, dict[str, float]]:
    """{fit group: efficiencies} fitted on ``rows``."""
    groups: dict[str, list] = {}
    for r in rows:
        groups.setdefault(fit_group(get_device(r.device), r.options), []).append(r)
    return {g: EfficiencyFit(rs).fit(range(len(rs))) for g, rs in sorted(groups.items())}


def apply(device: Device, fitted: dict[str, float]) -> Device:
    """``device`` with fitted values: the :data:`DEVICE_GRIDS` keys are the device's fields
    (``gemm_latency``), the rest its :attr:`Device.efficiency`."""
    fields = {k: v for k, v in fitted.items() if k in DEVICE_GRIDS}
    rest = {k: v for k, v in fitted.items() if k not in DEVICE_GRIDS}
    return replace(device, efficiency=rest, **fields)


@functools.lru_cache(maxsize=1)
def shipped_efficiencies() -> dict[str, dict[str, float]]:
    """{fit group: fitted values} shipped in ``predictors/models/efficiency.json`` (fitted on
    every development fleet row by ``predict train --fleet``), or {}."""
    if not SHIPPED.exists():
        return {}
    return json.loads(SHIPPED.read_text())["groups"]


def with_efficiency(device: Device, options: TrainingOptions,
                    fitted: dict[str, dict[str, float]]) -> tuple[Device, bool]:  # fmt: skip
    """``device`` with the fitted values of its family under ``options.framework`` and
    whether there were any (unchanged without a fit: the roofline's defaults)."""
    own = fitted.get(fit_group(device, options))
    return (apply(device, own), True) if own else (device, False)
