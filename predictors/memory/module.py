"""Any ``nn.Module``: trace one training step on fake tensors, predict what the GPU shows.

The module (or a zero-argument factory, cheaper for large models: nothing real is ever built)
runs the real forward, loss, backward and optimizer step under ``FakeTensorMode``; every
storage goes through the caching-allocator simulator (:mod:`allocator`), which gives
``max_memory_allocated`` and ``max_memory_reserved``. Device-level usage (``nvidia-smi``
``memory.used``) adds what lives outside the allocator: the CUDA context with the libraries'
kernels (:mod:`device`) and NCCL's buffers; DeepSpeed ZeRO's buckets are inside the allocator.

Near the card's capacity the simulator is bounded by it: like PyTorch, it frees its cached
segments and retries before it reports an out-of-memory.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from ..spec.model import ModelSpec, ModelSpecError, TransformerSpec
from ..spec.options import TrainingOptions
from ..spec.precision import Precision, get_precision
from ..spec.strategy import ParallelStrategy
from ..step import Batch, LossFn, default_loss
from .allocator import GiB, MiB, SimulatedOutOfMemoryError
from .build import make_inputs
from .config import SINGLE_GPU, ShardingError, Step, resolve_shapes
from .device import (
    DEVICES,
    TORCH_OPTIONS,
    CommBuffers,
    DeviceProfile,
    Sharding,
    get_device,
    replaces_gradients,
    unrun_precision,
)
from .optimizers import OptimizerSpec
from .presets import as_memory_model
from .simulate import Measurement, loss_from_output, prepare_model, trace_step
from .verdict import Judgement, Margin, Verdict, judge, margin_for


def _fake_like(t: torch.Tensor) -> torch.Tensor:
    """A fake ``cpu`` tensor of ``t``'s shape and dtype (call under ``FakeTensorMode``)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")


def _fake_module(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are fake tensors (no data is copied;
    tied parameters stay tied; meta-device models work too). Call under ``FakeTensorMode``."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        if id(t) not in memo:
            fake = _fake_like(t)
            memo[id(t)] = nn.Parameter(fake, t.requires_grad) if isinstance(
                t, nn.Parameter) else fake
    return copy.deepcopy(model, memo)


@dataclass
class DeviceMemoryPrediction:
    """One GPU's memory in a steady-state training step. Bytes; every part is named."""

    device: str
    precision: str
    optimizer: OptimizerSpec
    sharding: Sharding  # dp, ZeRO stage and framework the prediction applied
    max_memory_allocated: int  # torch.cuda.max_memory_allocated
    max_memory_reserved: int  # torch.cuda.max_memory_reserved
    inside_allocator: dict[str, int]  # live bytes by kind at the allocated peak
    outside_allocator: dict[str, int]  # cuda_context, cudnn, nccl_<group> by communicator
    capacity: int
    margin: Margin  # bounds of the reserved bytes the verdict compares (verdict.py)
    out_of_memory: bool = False  # the capacity-bounded simulation failed even after freeing
    segments_released: int = 0  # cached segments the allocator freed under pressure
    notes: list[str] = field(default_factory=list)

    @property
    def device_used(self) -> int:
        """What ``nvidia-smi`` shows as ``memory.used`` at the step's peak."""
        return self.max_memory_reserved + sum(self.outside_allocator.values())

    @property
    def nccl_bytes(self) -> int:
        """NCCL's buffers: the communicators' entries of ``outside_allocator``."""
        return sum(v for k, v in self.outside_allocator.items() if k.startswith("nccl_"))

    @property
    def judgement(self) -> Judgement:
        return judge(self.max_memory_reserved, sum(self.outside_allocator.values()),
                     self.capacity, self.margin, self.out_of_memory)

    @property
    def verdict(self) -> Verdict:
        return self.judgement.verdict

    @property
    def fits(self) -> bool:
        """Only a ``fits`` verdict: a ``tight`` job is not promised to fit."""
        return self.verdict is Verdict.FITS

    def as_dict(self) -> dict[str, Any]:
        return {"device": self.device, "max_memory_allocated": self.max_memory_allocated,
                "max_memory_reserved": self.max_memory_reserved,
                **{f"allocator.{k}": v for k, v in self.inside_allocator.items()},
                **self.outside_allocator,
                "nccl_buffers": self.nccl_bytes,
                "device_used": self.device_used,
                "capacity": self.capacity, **self.judgement.as_dict()}

    def format(self) -> str:
        g = lambda b: f"{b / GiB:8.3f} GiB"  # noqa: E731
        d = self.sharding
        lines = [f"device {self.device}: {self.precision}, optimizer {self.optimizer.name} "
                 f"({self.optimizer.impl}), {d.describe()}",
                 "inside the caching allocator (live at the allocated peak):"]
        lines += [f"  {k:24s}{g(v)}" for k, v in self.inside_allocator.items() if v]
        lines += [f"  {'max_memory_allocated':24s}{g(self.max_memory_allocated)}",
                  f"  {'max_memory_reserved':24s}{g(self.max_memory_reserved)}"
                  + (f"  ({self.segments_released} cached segments freed under pressure)"
                     if self.segments_released else ""),
                  "outside the allocator:"]
        lines += [f"  {k:24s}{g(v)}" for k, v in self.outside_allocator.items()]
        lines += [f"device-level (nvidia-smi memory.used) {g(self.device_used)}"]
        lines += [f"note: {n}" for n in self.notes]
        lines.append(self.judgement.describe())
        return "\n".join(lines)


def _as_batch(inputs: Any, target: Any, kwargs: dict | None,
              sizes: list[int | None]) -> Callable[[nn.Module], Batch]:
    """Fresh fake copies of the user's example tensors each step (a GPU step's host-to-device
    copies are new allocations too); a tensor passed twice (labels as target and input) is
    one copy, as in the user's loop. ``sizes`` gives each step's batch size (None: as given);
    tensors whose first dimension is the example's batch size are cut to it."""
    args = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    first = next((t for t in tree_leaves([args, target, kwargs]) if isinstance(t, torch.Tensor)
                  and t.dim() > 0), None)
    full = None if first is None else first.shape[0]
    steps = iter(sizes)

    def batch(model: nn.Module) -> Batch:
        size = next(steps)
        memo: dict[int, torch.Tensor] = {}

        def fake(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            if id(x) not in memo:
                cut = size is not None and x.dim() > 0 and x.shape[0] == full
                memo[id(x)] = torch.empty((size, *x.shape[1:]), dtype=x.dtype,
                                          device="cpu") if cut else _fake_like(x)
            return memo[id(x)]

        return Batch(tuple(tree_map(fake, list(args))), tree_map(fake, target),
                     tree_map(fake, kwargs or {}))

    return batch


def predict_module_memory(
    model: nn.Module | Callable[[], nn.Module],
    inputs: Any,
    target: torch.Tensor,
    *,
    kwargs: dict[str, Any] | None = None,
    loss_fn: LossFn = default_loss,
    optimizer: OptimizerSpec | str = "adam",
    precision: str = "fp32",
    strategy: ParallelStrategy = SINGLE_GPU,
    options: TrainingOptions = TORCH_OPTIONS,
    buffers: CommBuffers | None = None,
    device: str | DeviceProfile = "a100-40gb",
    capacity_gib: float | None = None,
    margin: float | None = None,
    context_mib: float | None = None,
    last_batch: int | None = None,
    inference_forward: bool = False,
) -> DeviceMemoryPrediction:
    """Predict ``max_memory_allocated``, ``max_memory_reserved`` and device-level memory of one
    training step of ``model`` (an ``nn.Module``, real or on the meta device, or a factory
    called under ``FakeTensorMode``) on ``inputs`` (a tensor, tuple or list of positional
    inputs; ``kwargs`` keyword inputs) with ``loss_fn(output, target)``.

    ``optimizer``: an :class:`OptimizerSpec` or ``"adam"``, ``"adamw:fused"``, ...; not
    named, the implementation is torch's default or the framework's own kernel where it runs
    one (DeepSpeed's and Megatron's fused Adam(W), Megatron's fused SGD), and another one named
    for such a framework is refused (:func:`device.unrun_impl`, the CLI's rule too);
    ``precision``: a name of :data:`predictors.spec.precision.PRECISIONS` (one the framework
    runs no job of at the ZeRO stage is refused, :func:`device.unrun_precision`, the CLI's rule
    too); ``strategy``: its
    ``dp`` is the data-parallel degree (tp = pp = cp = 1: only data parallelism is applied; the
    batch is the inputs'); ``options``: the ZeRO stage (:attr:`TrainingOptions.zero_stage`) and
    framework (``pytorch``: torch DDP, ``deepspeed``, ``megatron``: distributed optimizer);
    ``buffers``: the framework's bucket and NCCL buffer sizes (default: documented defaults);
    ``device``: a key of :data:`device.DEVICES` (its capacity unless ``capacity_gib``);
    ``context_mib``: your stack's measured CUDA context (``nvidia-smi`` used after
    ``torch.cuda.init()`` and one matmul, minus ``torch.cuda.memory_reserved()``) instead of
    the device's default from :data:`overheads.CONTEXTS`; ``last_batch``: a data loader's
    smaller last batch of an epoch (``len(dataset) % batch`` with ``drop_last=False``), traced
    between two full steps, since its differently sized blocks fragment the cache;
    ``inference_forward``: the job runs one forward at the full batch in eval mode under
    ``no_grad`` before training, as ``torchinfo.summary(model, input_size=...)`` does (the
    blocks it allocates stay cached and shape the training steps' cache);
    ``margin``: a fixed relative margin +-``margin`` on the reserved bytes instead of the
    family's calibrated one (:mod:`verdict`: ``conv`` when the step ran a convolution, else
    ``dense``)."""
    opt = OptimizerSpec.parse(optimizer) if isinstance(optimizer, str) else optimizer
    get_precision(precision)
    dist = Sharding(strategy, options, buffers or CommBuffers())
    if problem := unrun_precision(options, precision):
        raise ShardingError(problem)
    prof = get_device(device) if isinstance(device, str) else device
    if context_mib is not None:
        if context_mib < 0:
            raise ModelSpecError(f"context_mib={context_mib} must be >= 0")
        prof = replace(prof, overheads=replace(prof.overheads,
                                               context_bytes=int(context_mib * MiB)))
    capacity = prof.capacity if capacity_gib is None else int(capacity_gib * GiB)
    if capacity <= 0:
        raise ModelSpecError(f"capacity_gib={capacity_gib} must be positive")
    if isinstance(model, nn.Module):
        build: Callable[[], nn.Module] = lambda: _fake_module(model)  # noqa: E731
    elif callable(model):
        build = model
    else:
        raise ModelSpecError(f"model={type(model).__name__} is neither an nn.Module nor a "
                              "factory returning one")
    if last_batch is not None and last_batch < 1:
        raise ModelSpecError(f"last_batch={last_batch} must be >= 1")
    sizes: list[int | None] = [None, last_batch, None] if last_batch else [None, None]
    outside = prof.outside_allocator(dist)
    opt = dist.effective_optimizer(opt)

    def run(limit: int | None) -> Measurement:
        batches = _as_batch(inputs, target, kwargs,
                             ([None] if inference_forward else []) + sizes)
        return trace_step(build, batches, precision, loss_fn=loss_fn, make_optimizer=opt.build,
                          overheads=prof.overheads, capacity=limit, steps=len(sizes),
                          inference_forward=inference_forward)

    meas = run(None)
    if meas.convolutions and prof.overheads.cudnn_context_bytes:
        outside = {**outside, "cudnn": prof.overheads.cudnn_context_bytes}
    m = (Margin.fixed(margin) if margin is not None
         else margin_for("conv" if meas.convolutions else "dense"))
    module_tensors, grad_tensors = (_parameter_bytes(build, precision) if dist.changes_step
                                    else ([], []))
    extra, notes = dist.sharding_adjustment(
        meas.breakdown, grad_tensors, opt, precision, meas.peak_phase, module_tensors,
        peak_allocated=meas.peak_allocated,
        peaks_without_gradients=meas.phase_peaks_without_gradients)
    pred = DeviceMemoryPrediction(
        prof.name, precision, opt, dist,
        max_memory_allocated=meas.peak_allocated + extra["delta"],
        max_memory_reserved=meas.peak_reserved + extra["delta"],
        # Megatron's buffer (DeepSpeed's BF16_Optimizer's) holds the gradients: the traced
        # ones are not held
        inside_allocator={**meas.breakdown, **({"gradient": 0} if replaces_gradients(
            dist, precision) else {}), **extra["buffers"]},
        outside_allocator=outside, capacity=capacity, margin=m, notes=notes)
    if pred.fits:
        return pred
    # Near or over the capacity: replay again with the allocator bounded by the usable capacity
    # over the upper margin, so cached blocks are freed and retried as PyTorch does; if that
    # replay runs, its reserved peak's upper bound fits by construction.
    limit = m.largest_fitting(capacity - sum(outside.values())) - extra["delta"]
    try:
        bounded = run(max(limit, 0))
    except SimulatedOutOfMemoryError as exc:
        pred.out_of_memory = True
        pred.notes.append(f"capacity-bounded replay: {exc}")
        return pred
    pred.max_memory_reserved = bounded.peak_reserved + extra["delta"]
    pred.segments_released = bounded.segments_released
    pred.notes.append(f"reserved bytes bounded by the card: {bounded.segments_released} cached "
                      f"segments freed and retried ({meas.peak_reserved / MiB:.0f} MiB "
                      "unbounded)")
    return pred


def _parameter_bytes(build: Callable[[], nn.Module], precision: str
                     ) -> tuple[list[list[int]], list[int]]:  # fmt: skip
    """Per module with parameters of its own, their bytes at the precision's weight dtype
    (what ZeRO-3 gathers one module at a time), and the elements of each trainable parameter
    in ``named_parameters`` order (what a framework's gradient buffers hold,
    device.grad_buffers, and DeepSpeed's ZeRO-0 all-reduce buckets, device.deepspeed_buckets)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    elem = get_precision(precision).param_dtype.itemsize
    with FakeTensorMode():
        model = build()
        return ([[q.numel() * elem for q in m.parameters(recurse=False)]
                 for m in model.modules() if any(True for _ in m.parameters(recurse=False))],
                [q.numel() for q in model.parameters() if q.requires_grad])


def predict_spec_memory(model: str | ModelSpec | TransformerSpec,
                        strategy: ParallelStrategy = SINGLE_GPU,
                        options: TrainingOptions = TORCH_OPTIONS,
                        precision: str | Precision = "bf16",
                        device: str | DeviceProfile = "h100-80gb", *,
                        optimizer: OptimizerSpec | str = "adamw",
                        capacity_gib: float | None = None, margin: float | None = None,
                        context_mib: float | None = None) -> DeviceMemoryPrediction:
    """A preset or :class:`ModelSpec` (LLaVA-like, LLM, ViT) through the traced path: the same
    ``transformers`` module the presets build, with the chosen optimizer implementation and
    device-level output, one rank of ``strategy.dp`` under the options' ZeRO stage and
    framework (``tp`` and ``pp`` are not traced). Traces the full depth (seconds to a minute for
    7B models)."""
    Sharding(strategy, options)  # refuses what the traced path does not model, naming it
    cfg = Step(strategy, options, precision)
    spec = as_memory_model(model)
    resolve_shapes(spec, cfg)
    with torch.device("meta"):
        kw = make_inputs(spec, _TokenIds(), cfg.batch, spec.seq_length or 0,
                         spec.images_per_sample)
    return predict_module_memory(
        lambda: prepare_model(spec, cfg), (), kw["labels"], kwargs=kw,
        loss_fn=loss_from_output, optimizer=optimizer, precision=cfg.precision.name,
        strategy=strategy, options=options,
        device=device, capacity_gib=capacity_gib, margin=margin, context_mib=context_mib)


class _TokenIds:
    """Stands in for the built model in :func:`make_inputs` (only the image token id is read;
    token values do not matter on meta/fake tensors)."""

    class config:  # noqa: N801
        image_token_id = 0


__all__ = ["DEVICES", "CommBuffers", "DeviceMemoryPrediction", "OptimizerSpec", "Sharding",
           "predict_module_memory", "predict_spec_memory"]
