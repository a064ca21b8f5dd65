"""The roofline's non-datasheet constants, fitted on training rows only.

Three constants are not datasheet numbers: the effective host cost per kernel (launch + Python
dispatch + sync points; ``Device.launch_overhead``), the latency per collective step
(``Device.comm_latency``) and the fixed cost of a GEMM beyond FLOPs / rate
(``Device.gemm_latency``: why small GEMMs run far from peak). They are chosen from a small grid
to minimise the spread of ``log(measured / roofline)`` over the rows a model is trained on, so
a held-out evaluation fits them inside each fold and never sees the rows it scores. The shipped
GPU defaults in :mod:`predictors.devices` are this fit on all vTrain rows.

On a CPU only the per-kernel cost is fitted: the device profile's own figure times a tiny
autograd chain (~3 us a kernel), while a real training step's kernels carry module calls,
hooks, allocation and the optimizer's Python (on the shipped CPU data a per-precision linear
fit of measured time on kernel count reads 15-33 us a kernel, every precision alike).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from predictors.devices import Device
from predictors.time.analytical import iteration_time

KERNEL_OVERHEAD_GRID = (20e-6, 40e-6, 60e-6, 80e-6, 100e-6)
COMM_LATENCY_GRID = (5e-6, 20e-6)
GEMM_LATENCY_GRID = (0.0, 5e-6, 10e-6, 20e-6)
GPU_GRID = {"launch_overhead": KERNEL_OVERHEAD_GRID, "comm_latency": COMM_LATENCY_GRID,
            "gemm_latency": GEMM_LATENCY_GRID}  # fmt: skip
# log-spaced, set before looking at any fold (a CPU's per-kernel host cost)
CPU_GRID = {"launch_overhead": (2.5e-6, 5e-6, 10e-6, 20e-6, 40e-6, 80e-6)}
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


def fit_constants(works: Sequence, strategies: Sequence, seconds: Sequence[float],
                  groups: Sequence[str], device: Device,
                  grid: dict[str, Sequence[float]]) -> dict[str, float]:  # fmt: skip
    """Grid point of ``grid`` minimising the median absolute deviation of the log ratio
    measured / roofline around each group's own median (``groups``: the precision of each row;
    the learned correction absorbs a constant offset per precision, not a spread)."""
    measured = np.log(np.asarray(seconds, dtype=float))
    labels = np.asarray(groups)
    best, best_spread = {}, math.inf
    for values in itertools.product(*grid.values()):
        cand = dict(zip(grid, values, strict=True))
        dev = replace(device, **cand)
        resid = measured - np.log([iteration_time(w, s, dev).total
                                   for w, s in zip(works, strategies, strict=True)])  # fmt: skip
        for g in set(groups):
            resid[labels == g] -= np.median(resid[labels == g])
        spread = float(np.median(np.abs(resid)))
        if spread < best_spread:
            best, best_spread = cand, spread
    return best


def _picked(rows: Sequence, sample: int) -> list:
    if not rows:
        raise ValueError("fit_gpu_constants: rows is empty; nothing to fit on")
    return list(rows)[:: max(1, len(rows) // sample)]


def fit_gpu_constants(rows: Sequence, precision: str, device: Device,
                      sample: int = FIT_SAMPLE) -> dict[str, float]:  # fmt: skip
    """Grid fit of the GPU constants on ``rows`` (objects with ``spec``, ``strategy``,
    ``seconds``) measured at one ``precision``."""
    from predictors.spec.precision import get_precision
    from predictors.time.features import step_work

    picked = _picked(rows, sample)
    p = get_precision(precision)
    works = [step_work(r.spec, r.strategy, p, device) for r in picked]
    grid = GPU_GRID
    if all(r.strategy.world_size <= device.devices_per_node for r in picked):
        # one node each: every collective is priced at NCCL's NVLink latency
        # (predictors.time.network), so the per-step latency across nodes cannot be told
        # from these rows; the device keeps its own
        grid = {k: v for k, v in GPU_GRID.items() if k != "comm_latency"}
    return fit_constants(works, [r.strategy for r in picked], [r.seconds for r in picked],
                         [precision] * len(picked), device, grid)  # fmt: skip


def fit_cpu_constants(df, device: Device, precision_aware: bool = True,
                      sample: int = FIT_SAMPLE) -> dict[str, float]:  # fmt: skip
    """Grid fit of the CPU's per-kernel cost on measured rows (a ``predict collect`` frame);
    ``precision_aware=False`` prices every row at fp32, as the ablation's features do."""
    from predictors.spec.precision import get_precision
    from predictors.time.collect import row_spec_strategy
    from predictors.time.features import step_work

    # sorted by precision so the even stride takes every precision alike
    picked = _picked([r for _, r in df.sort_values("precision", kind="stable").iterrows()], sample)
    specs = [row_spec_strategy(r) for r in picked]
    precisions = [r["precision"] if precision_aware else "fp32" for r in picked]
    works = [step_work(spec, st, get_precision(p), device)
             for (spec, st), p in zip(specs, precisions, strict=True)]  # fmt: skip
    return fit_constants(works, [st for _, st in specs], [r["seconds"] for r in picked],
                         precisions, device, CPU_GRID)  # fmt: skip
