"""One full training step (forward, loss, backward, optimizer) at a given :class:`Precision`.

The same :class:`TrainingStep` is timed on real tensors by ``predict collect`` and executed under
``FakeTensorMode`` by :func:`trace_training_step` (no memory, no compute), so the traced op
stream is the op stream that was measured. Extra ``TorchDispatchMode`` s (the time predictor's
op tracer, the memory predictor's storage tracker) ride along, and ``on_phase`` is told when each
phase of the step starts.

Precision semantics (what Megatron / torch.amp users run):
- autocast precisions keep fp32 weights and cast per op (CUDA rules when ``target="cuda"``);
- pure precisions store weights, grads and Adam states in the low dtype;
- ``*-mixed`` (and fp8) store weights/grads in the low dtype and keep fp32 master weights in the
  optimizer: grads are cast up to fp32, AdamW updates the master, which is cast back down;
- fp16 with autocast or fp32 masters uses dynamic loss scaling (``torch.amp.GradScaler``).
AdamW is the fused kernel (``fused=True``) by default: one multi-tensor kernel, as Apex/TE FusedAdam
on GPUs, and it needs no host sync, which fake tensors could not provide. ``make_optimizer`` swaps
in any other optimizer (the memory predictor traces torch's default foreach Adam through it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from predictors.autocast import autocast_context
from predictors.spec.precision import Precision, get_precision


def _is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


PHASES = ("forward", "loss", "backward", "optimizer")
PhaseCallback = Callable[[str], None]
LossFn = Callable[[Any, Any], torch.Tensor]


def per_pixel_classes(output: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether integer ``target`` labels ``output``'s dimension 1 (``(N, C, ...)`` logits of a
    segmentation net) rather than its last one."""
    return (output.dim() > 2 and target.dim() == output.dim() - 1
            and target.shape != output.shape[:-1]
            and target.shape == output.shape[:1] + output.shape[2:])


def default_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for integer targets (language models and classifiers: classes last;
    segmentation: ``(N, C, H, W)`` logits for ``(N, H, W)`` labels), MSE otherwise."""
    if hasattr(output, "logits"):
        output = output.logits
    if not target.is_floating_point():
        if per_pixel_classes(output, target):
            return F.cross_entropy(output, target)
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
    return F.mse_loss(output, target)


@dataclass
class Batch:
    """Model inputs (positional and keyword) and the loss target."""

    inputs: Sequence[Any]
    target: torch.Tensor
    kwargs: dict[str, Any] | None = None


def cast_floating_(model: nn.Module, dtype: torch.dtype) -> None:
    """``model.to(dtype)`` for floating parameters/buffers that also works on fake tensors
    (``Module.to`` swaps tensors there, which fake-tensor weakrefs forbid).

    Shared parameters (tied embeddings / LM head) stay shared: each distinct tensor is cast once.
    """
    cast: dict[int, tuple[torch.Tensor, nn.Parameter]] = {}  # holds the old tensor: ids stay unique
    with torch.no_grad():
        for module in model.modules():
            for name, q in module._parameters.items():
                if q is not None and q.is_floating_point() and q.dtype != dtype:
                    if id(q) not in cast:
                        cast[id(q)] = (q, nn.Parameter(q.to(dtype), q.requires_grad))
                    module._parameters[name] = cast[id(q)][1]
            for name, b in module._buffers.items():
                if b is not None and b.is_floating_point() and b.dtype != dtype:
                    module._buffers[name] = b.to(dtype)


def optimizer_step(
    optimizer: torch.optim.Optimizer | None,
    scaler: torch.amp.GradScaler | None,
    params: list[torch.Tensor],
    masters: list[torch.Tensor],
) -> None:
    """The optimizer's part of a training step, as the precision stores its state: with fp32
    ``masters`` (one per trainable parameter in ``params``, the tensors ``optimizer`` updates)
    the low-precision grads are cast up into them and freed before the update, and the updated
    masters are copied back down into the weights; ``scaler`` (dynamic loss scaling) unscales
    and skips a step whose grads overflowed. Every grad is freed afterwards. ``optimizer`` is
    None for a fully frozen model (nothing to do). :class:`TrainingStep` and the GPU kit's real
    step (``gpucheck.steps.RealStep``) both run it, so the kit measures the step predicted."""
    if optimizer is None:
        return
    if masters:  # low-precision grads -> fp32 master grads (a cast kernel per tensor)
        for q, m in zip(params, masters, strict=True):
            m.grad = None if q.grad is None else q.grad.to(torch.float32)
            q.grad = None
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if masters:  # fp32 master -> low-precision model weights
        with torch.no_grad():
            for q, m in zip(params, masters, strict=True):
                q.copy_(m)
    else:
        for q in params:
            q.grad = None


class TrainingStep:
    """Callable that performs one optimizer step on ``model`` for a :class:`Batch`."""

    def __init__(
        self,
        model: nn.Module,
        precision: str | Precision,
        *,
        target: str = "cuda",
        lr: float = 1e-4,
        weight_decay: float = 0.01,
        loss_fn: LossFn = default_loss,
        on_phase: PhaseCallback | None = None,
        make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
    ) -> None:
        self.precision = get_precision(precision)
        self.target = target
        self.model = model
        self.loss_fn = loss_fn
        self.on_phase = on_phase or (lambda phase: None)
        p = self.precision
        if p.param_dtype != torch.float32:
            cast_floating_(model, p.param_dtype)
        self.params = [q for q in model.parameters() if q.requires_grad]
        if p.master_weights_fp32:
            self.masters = [q.detach().to(torch.float32) for q in self.params]
            opt_params = self.masters
        else:
            self.masters = []
            opt_params = self.params
        # An empty optimizer is legal (fully frozen model): the step is then forward+backward.
        if make_optimizer is None:
            def make_optimizer(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
                return torch.optim.AdamW(ps, lr=lr, weight_decay=weight_decay, fused=True)
        self.optimizer = make_optimizer(opt_params) if opt_params else None
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16) if p.grad_scaler else None

    def __call__(self, batch: Batch) -> torch.Tensor:
        self.on_phase("forward")
        inputs, kwargs = (
            self._cast_inputs(list(batch.inputs)),
            self._cast_inputs(batch.kwargs or {}),
        )
        with autocast_context(self.precision, self.target):
            out = self.model(*inputs, **kwargs)
            self.on_phase("loss")
            loss = self.loss_fn(out, batch.target)
        self.on_phase("backward")
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        self.on_phase("optimizer")
        optimizer_step(self.optimizer, self.scaler, self.params, self.masters)
        return loss.detach()

    def inference(self, batch: Batch) -> None:
        """One forward of ``batch`` in eval mode under ``no_grad`` (as ``torchinfo.summary``
        runs it before training); the model's previous mode is restored."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), autocast_context(self.precision, self.target):
                self.model(*self._cast_inputs(list(batch.inputs)),
                           **self._cast_inputs(batch.kwargs or {}))
        finally:
            self.model.train(was_training)

    def _cast_inputs(self, tree: Any) -> Any:
        """Floating inputs (images, embeddings) enter a low-precision model in its dtype."""
        dtype = self.precision.param_dtype
        if dtype == torch.float32:
            return tree
        return tree_map(lambda x: x.to(dtype) if _is_float(x) else x, tree)


def trace_training_step(
    build_model: Callable[[], nn.Module],
    build_batch: Callable[[], Batch],
    precision: str | Precision,
    *,
    target: str = "cuda",
    modes: Sequence[Any] = (),
    on_phase: PhaseCallback | None = None,
    steps: int = 1,
    loss_fn: LossFn = default_loss,
) -> TrainingStep:
    """Build the model and run ``steps`` training steps on fake ``cpu`` tensors.

    ``modes`` are entered inside the fake mode (so they see every aten op, including the
    parameter initialisation, first) and stay active for the whole run; ``on_phase`` receives
    ``"init"`` before the model is built and then each of :data:`PHASES` per step. The returned
    :class:`TrainingStep` holds fake tensors (parameters, optimizer state) for inspection.
    """
    phase = on_phase or (lambda name: None)
    with FakeTensorMode(), contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        phase("init")
        model = build_model()
        step = TrainingStep(model, precision, target=target, loss_fn=loss_fn, on_phase=phase)
        for _ in range(steps):
            step(build_batch())
    return step
