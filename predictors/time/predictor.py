"""Public API: ``predict_iteration_time(model_spec, strategy, precision, device) -> seconds``.

The model is traced once per distinct layer shape (cached), so after warm-up a call costs the
roofline composition plus one LightGBM row (well under 10 ms). The learned correction is the
shipped model of the device's family (``predictors/models/time_<family>.json``). A device
family without one (H100 and H200) gets the roofline with the kernel efficiencies fitted for
its family under the run's framework (``TrainingOptions.framework``) on the development fleet
rows (``predictors/models/efficiency.json``, ``PredictionResult.fitted_efficiency``), or the
roofline's defaults where none were fitted, e.g. H100 under Megatron-Core (``calibrated``
False either way): the A100 correction encodes the efficiency vTrain's software
reached on A100s and does not transfer to other families.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from predictors.devices import Device, get_device, require_precision_support
from predictors.spec import (
    DEFAULT_OPTIONS,
    ModelSpec,
    ModelSpecError,
    ParallelStrategy,
    StrategyError,
    TrainingOptions,
    TransformerSpec,
)
from predictors.spec.precision import Precision, get_precision
from predictors.time.analytical import Breakdown
from predictors.time.calibrate import with_constants
from predictors.time.efficiency import SHIPPED, shipped_efficiencies, with_efficiency
from predictors.time.features import features, features_and_breakdown
from predictors.time.model import TimeModel, shipped_model_path
from predictors.time.network import Topology
from predictors.time.zoo import ZooModel


@dataclass(frozen=True)
class PredictionResult:
    seconds: float
    analytical_seconds: float
    breakdown: Breakdown
    calibrated: bool  # a learned model for this device family was applied
    device: str
    model_file: str | None
    fitted_efficiency: bool = False  # the family's fleet-fitted kernel efficiencies priced it


def _traced(model_spec: ZooModel | ModelSpec) -> ZooModel:
    """The text tower of a :class:`ModelSpec` (the time predictor prices text towers only)."""
    if not isinstance(model_spec, ModelSpec):
        return model_spec
    if model_spec.vision is not None:
        raise ModelSpecError(f"model {model_spec.name!r} has a vision tower; the time predictor "
                             "prices a text tower only")
    return model_spec.text


@functools.lru_cache(maxsize=16)
def _family_model(family: str) -> TimeModel | None:
    path = shipped_model_path(family)
    return TimeModel.load(path) if path else None


def _validate(spec: ZooModel, strategy: ParallelStrategy, p: Precision, dev: Device,
              options: TrainingOptions) -> None:  # fmt: skip
    require_precision_support(dev, p)
    if not isinstance(strategy, ParallelStrategy):
        raise StrategyError(f"strategy={strategy!r} must be a ParallelStrategy")
    if isinstance(spec, TransformerSpec):
        strategy.check(strategy.world_size, spec)
        vp = options.virtual_pipeline
        if vp > 1 and strategy.uneven:
            raise StrategyError(
                f"strategy {strategy.name}: virtual_pipeline={vp} with an uneven pipeline split "
                "(first_stage_layers/last_stage_layers) is not modelled"
            )
        if vp > 1 and (strategy.pp == 1 or spec.num_layers % (strategy.pp * vp)):
            raise StrategyError(
                f"strategy {strategy.name}: virtual_pipeline={vp} needs pp > 1 and pp*vp "
                f"dividing num_layers={spec.num_layers}"
            )
    elif strategy.tp != 1 or strategy.pp != 1:
        raise StrategyError(
            f"strategy {strategy.name}: model family {spec.family!r} supports data parallelism only"
        )


@functools.lru_cache(maxsize=65536)
def _predict(spec: ZooModel, strategy: ParallelStrategy, precision: str, device_name: str,
             options: TrainingOptions, topology: Topology | None) -> PredictionResult:  # fmt: skip
    dev = get_device(device_name)
    p = get_precision(precision)
    _validate(spec, strategy, p, dev, options)
    family = dev.family
    model = _family_model(family)
    fitted = False
    if model:  # the constants the correction was trained with
        dev = with_constants(dev, model.meta.get("device_constants"))
    else:  # the LightGBM corrections were trained on default-efficiency features
        dev, fitted = with_efficiency(dev, options, shipped_efficiencies())
    row, breakdown = features_and_breakdown(spec, strategy, p, dev, options=options,
                                            topology=topology)  # fmt: skip
    seconds = model.predict_one(row) if model else row["analytical_s"]
    path = shipped_model_path(family) if model else (SHIPPED if fitted else None)
    return PredictionResult(seconds, row["analytical_s"], breakdown, model is not None, dev.name,
                            str(path) if path else None, fitted)  # fmt: skip


def predict(model_spec: ZooModel | ModelSpec, strategy: ParallelStrategy, precision: str | Precision,
            device: str | Device = "a100-80gb", *, options: TrainingOptions | None = None,
            topology: Topology | None = None) -> PredictionResult:  # fmt: skip
    """Full prediction with the analytical breakdown (compute, TP, PP, bubble, DP, optimizer,
    bytes over NVLink / InfiniBand, nodes each group spans).

    ``topology`` describes the node (GPUs, NICs, NVLink and per-NIC rates); by default the
    device table's DGX/HGX node (8 GPUs, one NIC each). ``options`` are Megatron's overlap and
    interleaving flags (default: Megatron's defaults, nothing overlapped)."""
    p = get_precision(precision)
    name = device.name if isinstance(device, Device) else device
    get_device(name)  # raises UnknownDeviceError for a bad name before any work
    return _predict(_traced(model_spec), strategy, p.name, name, options or DEFAULT_OPTIONS,
                    topology)


def predict_iteration_time(model_spec: ZooModel | ModelSpec, strategy: ParallelStrategy,
                           precision: str | Precision, device: str | Device = "a100-80gb", *,
                           options: TrainingOptions | None = None,
                           topology: Topology | None = None) -> float:  # fmt: skip
    """Seconds per training iteration (forward+backward of all micro-batches + optimizer).

    Raises ``UnknownPrecisionError``, ``UnknownDeviceError``, ``StrategyError`` (strategy does
    not divide the model) and ``UnsupportedPrecisionError`` (fp8 on a device without it).
    """
    return predict(model_spec, strategy, precision, device, options=options,
                   topology=topology).seconds  # fmt: skip


def predict_with_model(model: TimeModel | None, model_spec: ZooModel | ModelSpec,
                       strategy: ParallelStrategy,
                       precision: str | Precision, device: str | Device = "a100-80gb", *,
                       options: TrainingOptions | None = None,
                       topology: Topology | None = None) -> float:  # fmt: skip
    """Seconds per iteration under a caller's correction (e.g. one trained with
    :func:`predictors.time.train.train_vtrain_model` and ``exclude``); ``None``: analytical only."""
    p = get_precision(precision)
    dev = get_device(device)
    options = options or DEFAULT_OPTIONS
    model_spec = _traced(model_spec)
    _validate(model_spec, strategy, p, dev, options)
    if model:
        dev = with_constants(dev, model.meta.get("device_constants"))
    row = features(model_spec, strategy, p, dev, options=options, topology=topology)
    return model.predict_one(row) if model else row["analytical_s"]
