"""The GPU roofline's non-datasheet constants, fitted on training rows only.

Three constants are not datasheet numbers: the effective host cost per kernel (launch + Python
dispatch + sync points; ``Device.launch_overhead``), the latency per collective step
(``Device.comm_latency``) and the fixed cost of a GEMM beyond FLOPs / rate
(``Device.gemm_latency``: why small GEMMs run far from peak). They are chosen from a small grid to minimise the spread of
``log(measured / roofline)`` over the rows a model is trained on, so a held-out evaluation
fits them inside each fold and never sees the rows it scores. The shipped defaults in
:mod:`predictors.devices` are this fit on all vTrain rows.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from predictors.analytical import iteration_time
from predictors.devices import Device

KERNEL_OVERHEAD_GRID = (20e-6, 40e-6, 60e-6, 80e-6, 100e-6)
COMM_LATENCY_GRID = (5e-6, 20e-6)
GEMM_LATENCY_GRID = (0.0, 5e-6, 10e-6, 20e-6)
FIELDS = ("launch_overhead", "comm_latency", "gemm_latency")
FIT_SAMPLE = 80  # rows scored per grid point (an even stride over the training rows)


def with_constants(device: Device, constants: dict[str, float] | None) -> Device:
    """``device`` with fitted ``launch_overhead`` / ``comm_latency`` (None: unchanged)."""
    if not constants:
        return device
    unknown = set(constants) - set(FIELDS)
    if unknown:
        raise ValueError(f"device_constants has unknown field(s) {sorted(unknown)}")
    return replace(device, **constants)


def fit_gpu_constants(rows: Sequence, precision: str, device: Device,
                      sample: int = FIT_SAMPLE) -> dict[str, float]:  # fmt: skip
    """Grid fit of the constants on ``rows`` (objects with ``spec``, ``strategy``,
    ``seconds``): minimise the median absolute deviation of the log ratio measured/roofline
    (the learned correction absorbs a constant offset, not a spread)."""
    from predictors.features import step_work
    from predictors.precision import get_precision

    if not rows:
        raise ValueError("fit_gpu_constants: rows is empty; nothing to fit on")
    stride = max(1, len(rows) // sample)
    picked = list(rows)[::stride]
    p = get_precision(precision)
    works = [step_work(r.spec, r.strategy, p, device) for r in picked]
    measured = np.log([r.seconds for r in picked])
    best, best_spread = {}, math.inf
    for values in itertools.product(KERNEL_OVERHEAD_GRID, COMM_LATENCY_GRID, GEMM_LATENCY_GRID):
        cand = dict(zip(FIELDS, values, strict=True))
        dev = replace(device, **cand)
        est = np.log([iteration_time(w, r.strategy, dev).total
                      for w, r in zip(works, picked, strict=True)])  # fmt: skip
        resid = measured - est
        spread = float(np.median(np.abs(resid - np.median(resid))))
        if spread < best_spread:
            best, best_spread = cand, spread
    return best
