"""The one table of precisions: each entry owns everything that depends on it.

An entry declares where weights, gradients and optimizer states live (dtypes, fp32 masters,
loss scaling), which peak-rate column of a device its matmuls run at and which it requires,
how a step at this precision is reproduced (autocast casts and the emulation mode that stands
in for a library such as Transformer Engine), the recipe's extra kernels (fp8 scaling), the
numbers the learned correction sees (:meth:`Precision.encoding`) and how frameworks name it.
Trace, analytical, devices, features, collect, gpucheck and CONA's runtime read this table;
adding a precision is one :func:`register_precision` call plus a retrain.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class UnknownPrecisionError(ValueError):
    """Raised for a precision name that is not in :data:`PRECISIONS`."""


RATE_COLUMNS = ("fp32", "tf32", "bf16", "fp16", "fp8", "mxfp8")
EMULATIONS = (None, "te_fp8")  # modes predictors.autocast knows how to enter


@dataclass(frozen=True)
class Fp8Recipe:
    """Transformer Engine's fp8 recipe (``transformer_engine.common.recipe``) as costs.

    * ``delayed``: ``DelayedScaling`` — the scale comes from an amax history; each cast is one
      fused cast(-transpose) kernel that also records the amax; once per step one fused
      ``amax_and_scale_update`` kernel over all fp8 tensors and, with ``reduce_amax`` (TE's
      default), one all-reduce of the amax buffers across the data/tensor-parallel group.
    * ``current``: ``Float8CurrentScaling`` — each cast first reduces the tensor's amax (one
      extra read of the tensor), and the amax is all-reduced per tensor across TP.
    * ``rowwise``: torchao's float8 rowwise scaling — one scale per row of each operand,
      computed in the cast (an extra amax read like current scaling), no amax history.
    * ``mxfp8``: ``MXFP8BlockScaling`` — 1x32 blocks with e8m0 scales computed inside the cast
      kernel; needs the device's ``mxfp8`` column (Blackwell), no amax history.
    """

    scaling: str  # delayed | current | rowwise | mxfp8
    amax_history_len: int = 1024  # DelayedScaling default
    # layers the recipe does not cover run at this precision instead (TE: the LM head,
    # embeddings and attention BMMs stay in the high-precision dtype unless asked otherwise)
    fallback: str = "bf16-mixed"

    @property
    def rate_column(self) -> str:
        """Peak-rate column of the device the recipe's GEMMs run at."""
        return "mxfp8" if self.scaling == "mxfp8" else "fp8"

    @property
    def extra_amax_pass(self) -> bool:
        return self.scaling in ("current", "rowwise")

    @property
    def requantize_backward(self) -> bool:
        """Per-row scales are along one axis of an operand, and backward's GEMMs contract over
        the other axis: torchao's rowwise recipe saves the high-precision input and weight and
        casts again in backward (the gradient once per axis, the weight and the input once
        more), six casts per linear instead of three (pytorch/ao
        ``torchao/float8/float8_linear.py``, ``manual_float8_matmul_with_args_in_hp``)."""
        return self.scaling == "rowwise"

    @property
    def per_step_update(self) -> bool:
        return self.scaling == "delayed"


@dataclass(frozen=True)
class Precision:
    name: str
    param_dtype: torch.dtype  # dtype the model's weights are stored in during forward/backward
    compute_dtype: torch.dtype  # dtype matmul-class ops run in
    autocast: bool  # ops are cast per op by (CUDA) autocast rules
    master_weights_fp32: bool  # optimizer keeps an fp32 copy of low-precision weights
    grad_scaler: bool  # dynamic loss scaling (fp16)
    tf32: bool = False  # fp32 matmuls on tensor cores with tf32 inputs
    emulation: str | None = None  # a mode of predictors.autocast (e.g. TE-style fp8 linears)
    recipe: Fp8Recipe | None = None
    # a device must have a non-zero peak in this column to run it (None: any device)
    requires_rate: str | None = None
    measurable_on_cpu: bool = True  # `predict collect` can time it on this machine's CPU
    megatron_flag: str | None = None  # Megatron-LM argument selecting it (``--bf16``)
    extra_features: dict[str, float] = field(default_factory=dict)  # a new precision's encoding

    def __post_init__(self) -> None:
        if self.emulation not in EMULATIONS:
            raise ValueError(f"precision {self.name!r}: emulation={self.emulation!r} must be "
                             f"one of {EMULATIONS}")  # fmt: skip
        if self.requires_rate is not None and self.requires_rate not in RATE_COLUMNS:
            raise ValueError(f"precision {self.name!r}: requires_rate={self.requires_rate!r} "
                             f"must be one of {RATE_COLUMNS}")  # fmt: skip
        if (self.emulation == "te_fp8") != (self.recipe is not None):
            raise ValueError(f"precision {self.name!r}: emulation='te_fp8' and recipe go together")

    @property
    def fp8(self) -> bool:
        return self.recipe is not None

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.param_dtype

    @property
    def is_mixed(self) -> bool:
        return self.autocast or self.master_weights_fp32

    def encoding(self) -> dict[str, float]:
        """What the learned correction sees of the precision itself (the traced kernels add
        per-dtype FLOPs and bytes)."""
        return {
            "param_bits": float(torch.finfo(self.param_dtype).bits),
            "compute_bits": float(torch.finfo(self.compute_dtype).bits),
            "autocast": float(self.autocast),
            "master_fp32": float(self.master_weights_fp32),
            "grad_scaler": float(self.grad_scaler),
            "tf32": float(self.tf32),
            "fp8": float(self.fp8),
            "fp8_current_scaling": float(bool(self.recipe and self.recipe.extra_amax_pass)),
            **self.extra_features,
        }


PRECISIONS: dict[str, Precision] = {}


def register_precision(p: Precision, *, replace: bool = False) -> Precision:
    """Add ``p`` to the table (``replace``: overwrite an entry of the same name)."""
    if p.name in PRECISIONS and not replace:
        raise ValueError(f"precision name={p.name!r} is already registered")
    if p.recipe is not None and p.recipe.fallback not in PRECISIONS:
        raise UnknownPrecisionError(
            f"precision {p.name!r}: recipe.fallback={p.recipe.fallback!r} is not registered")
    PRECISIONS[p.name] = p
    return p


def unregister_precision(name: str) -> None:
    get_precision(name)
    del PRECISIONS[name]


_F32, _BF16, _F16 = torch.float32, torch.bfloat16, torch.float16
for _p in (
    Precision("fp32", _F32, _F32, False, False, False, megatron_flag=""),
    Precision("tf32", _F32, _F32, False, False, False, tf32=True, requires_rate="tf32",
              measurable_on_cpu=False),  # fmt: skip
    Precision("bf16", _F32, _BF16, True, False, False),
    Precision("bf16-pure", _BF16, _BF16, False, False, False),
    Precision("fp16", _F32, _F16, True, False, True),
    Precision("fp16-pure", _F16, _F16, False, False, False),
    # Megatron-style mixed precision: low-precision weights/grads, fp32 master copy.
    Precision("bf16-mixed", _BF16, _BF16, False, True, False, megatron_flag="--bf16"),
    Precision("fp16-mixed", _F16, _F16, False, True, True, megatron_flag="--fp16"),
    # Transformer Engine fp8 (bf16 weights, fp32 masters; the covered linears in fp8).
    Precision("fp8", _BF16, _BF16, False, True, False, emulation="te_fp8",
              recipe=Fp8Recipe("delayed"), requires_rate="fp8", measurable_on_cpu=False),
    Precision("fp8-current", _BF16, _BF16, False, True, False, emulation="te_fp8",
              recipe=Fp8Recipe("current"), requires_rate="fp8", measurable_on_cpu=False),
    # torchao float8 training with rowwise scales (torchtitan's "float8 rowwise")
    Precision("fp8-rowwise", _BF16, _BF16, False, True, False, emulation="te_fp8",
              recipe=Fp8Recipe("rowwise"), requires_rate="fp8", measurable_on_cpu=False),
    Precision("mxfp8", _BF16, _BF16, False, True, False, emulation="te_fp8",
              recipe=Fp8Recipe("mxfp8"), requires_rate="mxfp8", measurable_on_cpu=False),
):
    register_precision(_p)


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


def cpu_precisions() -> tuple[str, ...]:
    """Precisions ``predict collect`` can measure on a CPU."""
    return tuple(n for n, p in PRECISIONS.items() if p.measurable_on_cpu)


def megatron_precisions() -> tuple[str, ...]:
    """Precisions Megatron-LM selects with one flag (``--bf16``/``--fp16``; fp32: none)."""
    return tuple(n for n, p in PRECISIONS.items() if p.megatron_flag is not None)
