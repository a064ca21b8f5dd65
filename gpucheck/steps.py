"""The training step the kit measures: what a PyTorch user runs, on the real device.

The predictors trace their own ``TrainingStep``, which emulates CUDA autocast per op (a
``TorchFunctionMode``) so it can run under fake tensors on a CPU. Ground truth must not share
that emulation, so this step uses the real ``torch.autocast(device)``, a real
``torch.amp.GradScaler(device)``, the TF32 switch, and fused or foreach AdamW. The precision
names and their storage rules (weights, fp32 master copies, loss scaling, fp8 GEMMs through
``torch._scaled_mm``) are the predictors' (:mod:`predictors.spec.precision`), so a row's precision
means the same thing on both sides, and so is the optimizer update that applies them
(:func:`predictors.step.optimizer_step`: fp32 master grads, the scaler's step, the copy back),
which is real PyTorch on both sides, not an emulation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

OPTIMIZERS = ("fused", "foreach")


def _loss(out: Any, target: Any) -> torch.Tensor:
    from predictors.step import per_pixel_classes  # the rule, not the step
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    if getattr(out, "loss", None) is not None:
        return out.loss
    logits = getattr(out, "logits", out)
    if target is not None and not target.is_floating_point():
        if per_pixel_classes(logits, target):
            return F.cross_entropy(logits.float(), target)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))
    return F.mse_loss(logits.float(), target.float())


class RealStep:
    """One optimizer step of ``model`` at a predictors precision name, on ``device``."""

    def __init__(self, model: nn.Module, precision: str, device: str,
                 optimizer: str = "fused") -> None:
        from predictors.autocast import emulation_mode
        from predictors.spec.precision import get_precision
        from predictors.step import optimizer_step

        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r} must be one of {OPTIMIZERS}")
        self.p = get_precision(precision)
        self.device, self.model = device, model
        self._emulation, self._optimizer_step = emulation_mode, optimizer_step
        if self.p.param_dtype != torch.float32:
            model.to(self.p.param_dtype)
        self.params = [q for q in model.parameters() if q.requires_grad]
        self.masters = ([q.detach().float() for q in self.params]
                        if self.p.master_weights_fp32 else [])
        kw = {"fused": True} if optimizer == "fused" else {"foreach": True}
        opt_params = self.masters or self.params
        self.optimizer = torch.optim.AdamW(opt_params, lr=1e-4, **kw) if opt_params else None
        self.scaler = torch.amp.GradScaler(device) if self.p.grad_scaler else None

    def _context(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if self.device == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = self.p.tf32
            torch.backends.cudnn.allow_tf32 = self.p.tf32
        if self.p.emulation is not None:
            stack.enter_context(self._emulation(self.p))
        if self.p.autocast:
            stack.enter_context(torch.autocast(self.device, dtype=self.p.compute_dtype))
        return stack

    def _cast(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(self.p.param_dtype)
        return x

    def __call__(self, inputs: Sequence[Any], kwargs: dict | None = None,
                 target: Any = None) -> torch.Tensor:
        inputs = [self._cast(x) for x in inputs]
        kwargs = {k: self._cast(v) for k, v in (kwargs or {}).items()}
        with self._context():
            loss = _loss(self.model(*inputs, **kwargs), target)
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        self._optimizer_step(self.optimizer, self.scaler, self.params, self.masters)
        return loss.detach()


class MLP(nn.Module):
    """A plain MLP (the model class of GPUMemNet's ground truth), optionally checkpointed."""

    def __init__(self, inputs: int, hidden: int, layers: int, classes: int,
                 checkpointing: bool = False) -> None:
        super().__init__()
        dims = [inputs] + [hidden] * layers
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(a, b), nn.GELU())
                                    for a, b in zip(dims[:-1], dims[1:], strict=True))
        self.head = nn.Linear(hidden, classes)
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        return self.head(x)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
