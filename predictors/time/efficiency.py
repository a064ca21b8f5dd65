"""Per-device-family, per-framework, per-precision kernel efficiencies fitted on development
fleet rows.

The roofline prices a GEMM at ``FLOPs / (peak(dtype) x efficiency)``. Instead of assumed
shares of peak (:data:`predictors.time.analytical.MATMUL_EFFICIENCY`, the fallback), each device
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
roofline default. The fit is :mod:`predictors.time.efficiency_fit`'s; held-out evaluations
call it inside each fold on the fold's training rows only.
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path

import torch

from predictors.devices import Device
from predictors.spec import TrainingOptions
from predictors.spec.precision import Precision, get_precision

# Device fields fitted beside the efficiencies, with their grids
DEVICE_GRIDS = {"gemm_latency": (0.0, 5e-6, 20e-6)}
SHIPPED = Path(__file__).parents[1] / "models" / "efficiency.json"


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


def fit_group(device: Device, options: TrainingOptions) -> str:
    """Key of the efficiencies that price a run: ``<device family>/<framework>``."""
    return f"{device.family}/{options.framework}"


def device_group(group: str) -> str:
    """``<device family>/*`` of a fit group: the family's efficiencies fitted on the rows of
    every framework, for a framework with no fit of its own there (a device's kernels are the
    same under every framework; what a framework changes is fitted where its rows show it)."""
    return group.split("/")[0] + "/*"


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
    """``device`` with the fitted values of its family under ``options.framework`` (else those
    fitted on the family's rows of every framework) and whether there were any (unchanged
    without a fit: the roofline's defaults)."""
    group = fit_group(device, options)
    own = fitted.get(group) or fitted.get(device_group(group))
    return (apply(device, own), True) if own else (device, False)
