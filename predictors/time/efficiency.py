"""Kernel efficiencies of a device family, shared by every framework, and the few factors a
framework adds, fitted on development fleet rows.

The roofline prices a GEMM at ``FLOPs / (peak(dtype) x efficiency)``. Instead of assumed
shares of peak (:data:`predictors.time.analytical.MATMUL_EFFICIENCY`, the fallback), each device
family (``h100``, ``a100``, ...) gets its own, fitted jointly on the rows of every framework
(a device's kernels are hardware facts: the same cuBLAS / cuDNN / flash kernels under each):

* ``matmul:<dtype>`` per precision's GEMM dtype (``bf16``, ``fp16``), and per fp8 recipe
  ``matmul:<precision>`` (``fp8`` = TE delayed scaling, ``fp8-current`` = torchao/TE
  tensorwise current scaling, ``fp8-rowwise``): the recipes' GEMMs and casts reach different
  shares of the same fp8 peak;
* ``attention:<dtype>``: the fused attention kernel;
* ``memory``: the share of the datasheet bandwidth memory-bound kernels reach;
* ``compiled``: torch.compile's factor on the non-GEMM kernels' time;
* ``overlap:fsdp``: the share of FSDP's per-micro-batch communication that hides under
  compute (where the family has FSDP rows);
* ``overlap:tp:<framework>``: the share of the TP collectives a framework's TP overlap hides
  under the GEMMs (its own implementation; where it has TP-overlap rows);
* ``gemm_latency``: the fixed cost of a GEMM beyond ``FLOPs / rate`` (``Device.gemm_latency``),
  which makes the efficiency depend on the GEMM's size: a GEMM of ``F`` FLOPs reaches
  ``e F / (F + gemm_latency x rate x e)`` of peak, small ones far less than large ones.

What a framework changes (:data:`FRAMEWORK_FACTORS`, keys ``framework:<name>:<factor>``) is
fitted beside them where the family's rows span more than one framework: ``gemm`` (its GEMM and
attention kernels' speed relative to the family's: Transformer Engine's kernels, FSDP's
contention), ``fusion`` (its memory-bound kernels' time: fused kernels, copies) and ``fp8`` (its
fp8 library's GEMMs and casts relative to the recipe's efficiency; fitted where two or more
frameworks have fp8 rows). The factors
are normalised to a geometric mean of 1 over the fitted frameworks, so the family's own
efficiencies are a typical framework's and a framework without a fit of its own (a new one, or
one held out) is priced as that typical framework: factors 1.

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
from predictors.spec.options import fp8_kernels
from predictors.spec.precision import Precision, get_precision

# Device fields fitted beside the efficiencies, with their grids
# (launch_overhead: the host's cost per kernel of an eager step, which sets the time of the
# GPU kit's small steps: they are host-bound)
DEVICE_GRIDS = {"gemm_latency": (0.0, 5e-6, 20e-6),
                "launch_overhead": (10e-6, 15e-6, 20e-6, 30e-6, 40e-6, 60e-6, 80e-6)}
# Device.efficiency key of the factor on the host's cost per kernel while a step runs under a
# Python emulation of its precision's library (predictors.spec.options.Fp8Kernels); unfitted: 1
EMULATION_HOST_KEY = "host:emulation"
# What the framework running the step adds to its device's efficiencies, as factors resolved
# into Device.efficiency for one framework (resolve; unfitted: 1, the typical framework's):
# its GEMM/attention kernels' speed relative to the device family's efficiencies, its fusion
# of the memory-bound kernels (their time multiplied), its fp8 GEMMs' on top of "gemm"
FRAMEWORK_GEMM_KEY = "framework:gemm"
FRAMEWORK_FUSION_KEY = "framework:fusion"
FRAMEWORK_FP8_KEY = "framework:fp8"
# {factor: the Device.efficiency key the roofline (predictors.time.analytical) reads it from}
FRAMEWORK_FACTORS = {"gemm": FRAMEWORK_GEMM_KEY, "fusion": FRAMEWORK_FUSION_KEY,
                     "fp8": FRAMEWORK_FP8_KEY}
# Fitted overlap shares (predictors.time.analytical.exposed: what of a communication can hide
# under compute; unfitted: 1, all of it as far as the compute reaches).
# Device.efficiency key of the share of FSDP's per-micro-batch communication (parameter
# all-gathers, gradient reduce-scatters) that hides under the micro-batch's compute: NCCL's
# kernels run beside the GEMMs on the same SMs and memory, and a unit's gather cannot start
# before its memory is freed (the rate limiters of FSDP1's limit_all_gathers and FSDP2), so at
# small micro-batches part of it stays exposed; a device family's (where it has FSDP rows)
FSDP_OVERLAP_KEY = "overlap:fsdp"
# Device.efficiency key of the share of the TP collectives that hides under the layer's GEMMs
# with TP overlap (predictors.time.analytical; unfitted: 1, all of it). The chunked
# collective-matmul runs its transfers beside smaller GEMMs on the same SMs and memory, so it
# does not hide all of it: torchtitan's published async-TP runs are 4-14% faster than without,
# where the TP collectives are ~20% of the step. Each framework has its own implementation
# (Transformer Engine's userbuffers under Megatron, symmetric-memory async TP under
# torchtitan), so the share is fitted per framework (tp_overlap_key); a framework without a
# fit of its own hides all of it
TP_OVERLAP_KEY = "overlap:tp"
SHIPPED = Path(__file__).parents[1] / "models" / "efficiency.json"


def tp_overlap_key(framework: str) -> str:
    """Fitted key of ``framework``'s TP-overlap share, read by the roofline as
    :data:`TP_OVERLAP_KEY` (:func:`resolve`)."""
    return f"{TP_OVERLAP_KEY}:{framework}"


def gemm_key(precision: Precision, framework: str = "megatron") -> str:
    """Efficiency key of the precision's GEMMs (an fp8 recipe has its own, unless
    ``framework`` runs it through another's GEMM: ``Fp8Kernels.tensorwise_gemm``)."""
    if precision.recipe is not None:
        shared = fp8_kernels(framework).tensorwise_gemm
        if shared and precision.recipe.scaling in ("delayed", "current"):
            return f"matmul:{shared}"
        return f"matmul:{precision.name}"
    return f"matmul:{_dtype(precision)}"


def attention_key(precision: Precision) -> str:
    # an fp8 recipe leaves attention in its fallback's dtype
    fallback = get_precision(precision.recipe.fallback) if precision.recipe else precision
    dtype = _dtype(fallback)
    # fp32 operands: the memory-efficient kernel's 3xTF32 in fp32 and tf32 runs alike
    # (analytical.attention_rate_key)
    return f"attention:{'tf32' if dtype == 'fp32' else dtype}"


def _dtype(p: Precision) -> str:
    """The device rate column the precision's (non-fp8) GEMMs run at."""
    if p.compute_dtype == torch.bfloat16:
        return "bf16"
    if p.compute_dtype == torch.float16:
        return "fp16"
    return "tf32" if p.tf32 else "fp32"


def for_precision(device: Device, precision: Precision, framework: str = "megatron") -> Device:
    """``device`` with its fp8 GEMM efficiency set to the recipe's own fitted one (the traced
    fp8 GEMMs all price at the ``matmul:fp8`` / ``matmul:mxfp8`` key), and the host's cost per
    kernel of ``framework``'s step at ``precision`` (a Python emulation costs more)."""
    if precision.recipe is None:
        return device
    if fp8_kernels(framework).python_emulation:
        host = device.launch_overhead * device.efficiency.get(EMULATION_HOST_KEY, 1.0)
        device = replace(device, launch_overhead=host)
    fitted = device.efficiency.get(gemm_key(precision, framework))
    if fitted is None:
        return device
    column = f"matmul:{precision.recipe.rate_column}"
    return replace(device, efficiency={**device.efficiency, column: fitted})


def fit_group(device: Device, options: TrainingOptions) -> str:
    """``<device family>/<framework>``: the device's shared efficiencies and the framework's
    factors that price a run."""
    return f"{device.family}/{options.framework}"


def framework_key(framework: str, factor: str) -> str:
    """Fitted key of one of :data:`FRAMEWORK_FACTORS` for ``framework``."""
    return f"framework:{framework}:{factor}"


def resolve(fitted: dict[str, float], framework: str) -> dict[str, float]:
    """A family's fitted values as one framework's run sees them: the shared efficiencies, and
    the framework's factors under the keys the roofline reads (absent: the typical
    framework's, 1)."""
    out = {k: v for k, v in fitted.items()
           if not k.startswith(("framework:", f"{TP_OVERLAP_KEY}:"))}  # fmt: skip
    for factor, key in FRAMEWORK_FACTORS.items():
        value = fitted.get(framework_key(framework, factor))
        if value is not None:
            out[key] = value
    share = fitted.get(tp_overlap_key(framework))
    if share is not None:
        out[TP_OVERLAP_KEY] = share
    return out


def apply(device: Device, fitted: dict[str, float]) -> Device:
    """``device`` with fitted values: the :data:`DEVICE_GRIDS` keys are the device's fields
    (``gemm_latency``), the rest its :attr:`Device.efficiency`."""
    fields = {k: v for k, v in fitted.items() if k in DEVICE_GRIDS}
    rest = {k: v for k, v in fitted.items() if k not in DEVICE_GRIDS}
    return replace(device, efficiency=rest, **fields)


@functools.lru_cache(maxsize=1)
def shipped_efficiencies() -> dict[str, dict[str, float]]:
    """{device family: fitted values} shipped in ``predictors/models/efficiency.json`` (fitted
    on every development fleet row by ``predict train --fleet``), or {}."""
    if not SHIPPED.exists():
        return {}
    return json.loads(SHIPPED.read_text())["families"]


def with_efficiency(device: Device, options: TrainingOptions,
                    fitted: dict[str, dict[str, float]]) -> tuple[Device, bool]:  # fmt: skip
    """``device`` with its family's fitted values as ``options.framework`` sees them
    (:func:`resolve`) and whether there were any (unchanged without a fit: the roofline's
    defaults)."""
    own = fitted.get(device.family)
    return (apply(device, resolve(own, options.framework)), True) if own else (device, False)
