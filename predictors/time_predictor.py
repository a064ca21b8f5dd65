"""Public API: ``predict_iteration_time(model_spec, strategy, precision, device) -> seconds``.

The model is traced once per distinct layer shape (cached), so after warm-up a call costs the
roofline composition plus one LightGBM row (well under 10 ms). The learned correction is the
shipped model of the device's family (``predictors/models/time_<family>.json``). GPUs of a
family with no shipped model borrow the A100 (vTrain) correction, which mostly captures
Megatron's kernel efficiencies and framework overheads; other devices without one get the
analytical estimate alone (``PredictionResult.calibrated`` False).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from predictors.analytical import Breakdown, iteration_time
from predictors.devices import Device, get_device, require_precision_support
from predictors.features import features, step_work
from predictors.model import TimeModel, shipped_model_path
from predictors.precision import Precision, get_precision
from predictors.spec import ParallelStrategy, StrategyError, TransformerSpec
from predictors.zoo import ModelSpec

GPU_FALLBACK_FAMILY = "a100"


@dataclass(frozen=True)
class PredictionResult:
    seconds: float
    analytical_seconds: float
    breakdown: Breakdown
    calibrated: bool  # a learned model for this device family was applied
    device: str
    model_file: str | None


@functools.lru_cache(maxsize=16)
def _family_model(family: str) -> TimeModel | None:
    path = shipped_model_path(family)
    return TimeModel.load(path) if path else None


def _validate(spec: ModelSpec, strategy: ParallelStrategy, p: Precision, dev: Device) -> None:
    require_precision_support(dev, p)
    if not isinstance(strategy, ParallelStrategy):
        raise StrategyError(f"strategy={strategy!r} must be a ParallelStrategy")
    if isinstance(spec, TransformerSpec):
        strategy.check(strategy.world_size, spec)
    elif strategy.tp != 1 or strategy.pp != 1:
        raise StrategyError(
            f"strategy {strategy.name}: model family {spec.family!r} supports data parallelism only"
        )


@functools.lru_cache(maxsize=65536)
def _predict(spec: ModelSpec, strategy: ParallelStrategy, precision: str,
             device_name: str) -> PredictionResult:  # fmt: skip
    dev = get_device(device_name)
    p = get_precision(precision)
    _validate(spec, strategy, p, dev)
    row = features(spec, strategy, p, dev)
    breakdown = iteration_time(step_work(spec, strategy, p, dev), strategy, dev)
    family = dev.family
    if _family_model(family) is None and dev.kind == "gpu":
        family = GPU_FALLBACK_FAMILY
    model = _family_model(family)
    seconds = model.predict_one(row) if model else row["analytical_s"]
    path = shipped_model_path(family) if model else None
    return PredictionResult(seconds, row["analytical_s"], breakdown, model is not None, dev.name,
                            str(path) if path else None)  # fmt: skip


def predict(model_spec: ModelSpec, strategy: ParallelStrategy, precision: str | Precision,
            device: str | Device = "a100-80gb") -> PredictionResult:  # fmt: skip
    """Full prediction with the analytical breakdown (compute, TP, PP, bubble, DP, optimizer)."""
    p = get_precision(precision)
    name = device.name if isinstance(device, Device) else device
    get_device(name)  # raises UnknownDeviceError for a bad name before any work
    return _predict(model_spec, strategy, p.name, name)


def predict_iteration_time(model_spec: ModelSpec, strategy: ParallelStrategy,
                           precision: str | Precision,
                           device: str | Device = "a100-80gb") -> float:  # fmt: skip
    """Seconds per training iteration (forward+backward of all micro-batches + optimizer).

    Raises ``UnknownPrecisionError``, ``UnknownDeviceError``, ``StrategyError`` (strategy does
    not divide the model) and ``UnsupportedPrecisionError`` (fp8 on a device without it).
    """
    return predict(model_spec, strategy, precision, device).seconds
