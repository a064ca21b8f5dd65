"""Precision settings of a training step: what dtype weights live in, what matmuls run in,
whether autocast inserts casts, whether fp32 master weights and a grad scaler exist."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class UnknownPrecisionError(ValueError):
    """Raised for a precision name that is not in :data:`PRECISIONS`."""


@dataclass(frozen=True)
class Precision:
    name: str
    param_dtype: torch.dtype  # dtype the model's weights are stored in during forward/backward
    compute_dtype: torch.dtype  # dtype matmul-class ops run in
    autocast: bool  # ops are cast per op by (CUDA) autocast rules
    master_weights_fp32: bool  # optimizer keeps an fp32 copy of low-precision weights
    grad_scaler: bool  # dynamic loss scaling (fp16)
    tf32: bool = False  # fp32 matmuls on tensor cores with tf32 inputs
    fp8: bool = False  # matmuls through torch._scaled_mm in float8_e4m3fn

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.param_dtype

    @property
    def is_mixed(self) -> bool:
        return self.autocast or self.master_weights_fp32


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp32", torch.float32, torch.float32, False, False, False),
        Precision("tf32", torch.float32, torch.float32, False, False, False, tf32=True),
        Precision("bf16", torch.float32, torch.bfloat16, True, False, False),
        Precision("bf16-pure", torch.bfloat16, torch.bfloat16, False, False, False),
        Precision("fp16", torch.float32, torch.float16, True, False, True),
        Precision("fp16-pure", torch.float16, torch.float16, False, False, False),
        # Megatron-style mixed precision: bf16 weights/grads, fp32 master copy in the optimizer.
        Precision("bf16-mixed", torch.bfloat16, torch.bfloat16, False, True, False),
        Precision("fp16-mixed", torch.float16, torch.float16, False, True, True),
        Precision("fp8", torch.bfloat16, torch.bfloat16, False, True, False, fp8=True),
    )
}


def get_precision(name: str | Precision) -> Precision:
    """Look a precision up by name; an unknown name raises :class:`UnknownPrecisionError`."""
    if isinstance(name, Precision):
        return name
    try:
        return PRECISIONS[name]
    except KeyError:
        raise UnknownPrecisionError(
            f"precision={name!r} is unknown; choose one of {', '.join(PRECISIONS)}"
        ) from None
