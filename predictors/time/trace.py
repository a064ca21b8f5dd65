"""Per-operator trace of a training step: what runs, in which dtype, how much work it is.

:class:`OpTracer` is a ``TorchDispatchMode`` that sits below autograd, so it sees every aten
kernel of forward, backward and optimizer, including the casts mixed precision inserts. For each
kernel it records the shapes, the dtype it computes in, FLOPs (torch's FlopCounter formulas plus
one we register for the CPU flash-attention kernels, which have none), bytes moved, arithmetic
intensity and whether it can use tensor cores. View ops move no data and are not recorded.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import (
    flop_registry,
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

aten = torch.ops.aten

LOW_PRECISION = (torch.float16, torch.bfloat16)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# record name of an fp8 operand's transposed copy (the backward GEMMs' layout): a standalone
# copy kernel in eager PyTorch, written by the fused cast-transpose under Transformer Engine
# (predictors.spec.options.Fp8Kernels decides per framework which one a step runs)
FP8_TRANSPOSE = "fp8_transpose"

# ---------------------------------------------------------------------------------------------
# FLOP formulas missing from torch.utils.flop_counter: the CPU flash-attention kernels.
_CPU_FLASH = aten._scaled_dot_product_flash_attention_for_cpu
_CPU_FLASH_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward

if _CPU_FLASH not in flop_registry:

    @register_flop_formula(_CPU_FLASH)
    def _cpu_flash_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kw) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    @register_flop_formula(_CPU_FLASH_BWD)
    def _cpu_flash_bwd_flop(grad_out_shape, query_shape, key_shape, value_shape, *args,
                            out_shape=None, **kw) -> int:  # fmt: skip
        return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# ---------------------------------------------------------------------------------------------
# Op classes (what roofline regime and what kernel library an op falls into).
MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "matmul", "addmv", "mv", "dot"}
CONV_OPS = {"convolution", "convolution_backward", "_convolution", "mkldnn_convolution"}
NORM_OPS = {
    "native_layer_norm", "native_layer_norm_backward", "native_group_norm",
    "native_group_norm_backward", "native_batch_norm", "native_batch_norm_backward",
    "_native_batch_norm_legit", "_native_batch_norm_legit_functional", "_fused_rms_norm",
    "_fused_rms_norm_backward",
}  # fmt: skip
SOFTMAX_OPS = {"_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data"}
REDUCTION_OPS = {"sum", "mean", "amax", "amin", "max", "min", "var_mean", "var", "std", "norm",
                 "linalg_vector_norm", "prod", "argmax", "logsumexp"}  # fmt: skip
LOSS_OPS = {"nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward", "nll_loss2d_backward",
            "mse_loss", "mse_loss_backward"}  # fmt: skip
EMBEDDING_OPS = {"embedding", "embedding_dense_backward"}
OPTIMIZER_OPS = {"_fused_adamw_", "_fused_adam_", "_amp_foreach_non_finite_check_and_unscale_",
                 "_amp_update_scale_"}  # fmt: skip
FREE_OPS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach",
            "_unsafe_view", "alias", "lift_fresh_copy",
            "lift_fresh", "_local_scalar_dense", "set_", "resize_"}  # fmt: skip
OP_CLASSES = ("matmul", "conv", "attention", "norm", "softmax", "reduction", "loss", "embedding",
              "cast", "copy", "optimizer", "elementwise")  # fmt: skip
TENSOR_CORE_CLASSES = ("matmul", "conv", "attention")


def classify(name: str, phase: str, casts: bool) -> str:
    if "attention" in name:
        return "attention"
    if name in MATMUL_OPS:
        return "matmul"
    if name in CONV_OPS:
        return "conv"
    if name in OPTIMIZER_OPS or (phase == "optimizer" and name.startswith("_foreach")):
        return "optimizer"
    if name in ("_to_copy", "copy_", "clone", "contiguous", "_copy_from", FP8_TRANSPOSE):
        return "cast" if casts else "copy"
    for cls, names in (("norm", NORM_OPS), ("softmax", SOFTMAX_OPS), ("loss", LOSS_OPS),
                       ("embedding", EMBEDDING_OPS), ("reduction", REDUCTION_OPS)):  # fmt: skip
        if name in names:
            return cls
    return "elementwise"


def dtype_class(dtype: torch.dtype | None, tf32: bool = False, fp8_column: str = "fp8") -> str:
    """Which peak-FLOP/s column of a device an op's math uses (``fp8_column``: the column
    of the precision's fp8 recipe, ``fp8`` or ``mxfp8``)."""
    if dtype in FP8:
        return fp8_column
    if dtype in LOW_PRECISION:
        return "fp16"  # bf16 and fp16 have the same tensor-core rate on every listed GPU
    if dtype == torch.float64:
        return "fp64"
    return "tf32" if tf32 else "fp32"


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class OpRecord:
    name: str
    phase: str
    op_class: str
    dtype: str  # dtype the op computes in, e.g. "bfloat16"
    dtype_class: str  # fp32 | tf32 | fp16 | fp8 | mxfp8 | fp64 (peak-rate column)
    in_shapes: tuple[tuple[int, ...], ...]
    out_shapes: tuple[tuple[int, ...], ...]
    flops: float
    bytes: float
    tensor_core: bool  # matmul-class op in a tensor-core dtype with 8-aligned dims
    causal: bool = False

    @property
    def intensity(self) -> float:
        """Arithmetic intensity (FLOP per byte moved)."""
        return self.flops / self.bytes if self.bytes else 0.0


@dataclass
class Trace:
    records: list[OpRecord] = field(default_factory=list)
    _unique: list[tuple[OpRecord, int]] | None = field(default=None, repr=False, compare=False)

    def total(self, attr: str = "flops", **match: Any) -> float:
        return sum(
            getattr(r, attr)
            for r in self.records
            if all(getattr(r, k) == v for k, v in match.items())
        )

    def by(self, *keys: str) -> dict[tuple, dict[str, float]]:
        """Aggregate flops / bytes / kernel count grouped by record attributes."""
        out: dict[tuple, dict[str, float]] = defaultdict(lambda: {"flops": 0.0, "bytes": 0.0,
                                                                  "count": 0.0})  # fmt: skip
        for r in self.records:
            agg = out[tuple(getattr(r, k) for k in keys)]
            agg["flops"] += r.flops
            agg["bytes"] += r.bytes
            agg["count"] += 1
        return dict(out)

    def scaled(self, other: Trace, factor: float) -> Trace:
        """Per-op affine extrapolation ``self + factor * (other - self)`` of flops and bytes.

        Two traces of the same model at batch 1 and 2 give the trace at any batch b with
        ``factor = b - 1``: every kernel's work is affine in the batch size.
        """
        if len(self.records) != len(other.records):
            raise ValueError("traces differ in their op sequence; cannot extrapolate")
        recs = []
        for a, b in zip(self.records, other.records, strict=True):
            r = OpRecord(**{**a.__dict__})
            r.flops = max(0.0, a.flops + factor * (b.flops - a.flops))
            r.bytes = max(0.0, a.bytes + factor * (b.bytes - a.bytes))
            recs.append(r)
        return Trace(recs)

    def unique(self) -> list[tuple[OpRecord, int]]:
        """Each distinct record object once with its count: a layer repeated ``n`` times
        repeats the same objects, so pricing is per distinct record (cached; a trace's records
        are not changed after it is built)."""
        if self._unique is None:
            counts: dict[int, list] = {}
            for r in self.records:
                slot = counts.get(id(r))
                if slot is None:
                    counts[id(r)] = [r, 1]
                else:
                    slot[1] += 1
            self._unique = [(r, n) for r, n in counts.values()]
        return self._unique

    def __add__(self, other: Trace) -> Trace:
        return Trace(self.records + other.records)

    def repeated(self, n: int) -> Trace:
        return Trace(self.records * n)


class OpTracer(TorchDispatchMode):
    """Record every non-view aten kernel; set :attr:`phase` (or pass it as ``on_phase``)."""

    def __init__(self, tf32: bool = False, fp8_column: str = "fp8") -> None:
        super().__init__()
        self.tf32 = tf32
        self.fp8_column = fp8_column
        self.phase = "init"
        self.trace = Trace()

    def on_phase(self, phase: str) -> None:
        if phase == "forward":  # a new step starts: keep only the last (steady-state) step
            self.trace = Trace()
        self.phase = phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.phase != "init":
            self._record(func, args, kwargs, out)
        return out

    def _record(self, func, args, kwargs, out) -> None:
        name = func.__name__.split(".")[0]
        if func.is_view or name in FREE_OPS:
            return
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outs and not name.endswith("_"):
            return
        if not ins and all(t.dim() == 0 for t in outs):
            return  # a scalar constant (fp8 scale): a persistent buffer in real code
        if name in ("clone", "contiguous") and ins and ins[0].dtype in FP8:
            name = FP8_TRANSPOSE
        floats = [t for t in ins + outs if t.is_floating_point()]
        pool = [t for t in ins if t.is_floating_point()] or floats
        if not pool:
            compute = (ins or outs)[0].dtype
        elif name in MATMUL_OPS or name in CONV_OPS or "attention" in name:
            compute = max(pool, key=lambda t: t.numel()).dtype  # the operands, not the lse/scales
        else:
            compute = max((t.dtype for t in pool), key=lambda d: torch.finfo(d).bits)
        in_dtypes = {t.dtype for t in ins if t.is_floating_point()}
        out_dtypes = {t.dtype for t in outs if t.is_floating_point()}
        casts = bool(in_dtypes and out_dtypes and in_dtypes != out_dtypes)
        if name == "copy_" and len(ins) >= 2:
            casts = ins[0].dtype != ins[1].dtype
        op_class = classify(name, self.phase, casts)
        packet = func.overloadpacket
        flops = 0.0
        if packet in flop_registry:
            flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
        elif name in ("_fused_adamw_", "_fused_adam_"):  # ~16 FLOP per parameter element
            flops = 16.0 * sum(t.numel() for t in tree_leaves(args[0]))
        elif op_class not in ("cast", "copy", "embedding"):
            flops = float(sum(t.numel() for t in (outs or tree_leaves(args[0]))))
        moved = sum(_bytes(t) for t in ins) + sum(map(_bytes, outs))
        if name.endswith("_"):  # in-place: the mutated operands are written back
            mutated = [args[0], args[2], args[3]] if "adam" in name else [args[0]]
            moved += sum(_bytes(t) for t in tree_leaves(mutated) if isinstance(t, torch.Tensor))
        dclass = dtype_class(compute, self.tf32 and compute == torch.float32, self.fp8_column)
        aligned = all(d % 8 == 0 for t in ins[:2] for d in t.shape[-2:]) if ins else False
        tensor_core = op_class in TENSOR_CORE_CLASSES and dclass != "fp32" and aligned
        causal = op_class == "attention" and _is_causal(args, kwargs)
        self.trace.records.append(
            OpRecord(
                name=name,
                phase=self.phase,
                op_class=op_class,
                dtype=str(compute).removeprefix("torch."),
                dtype_class=dclass,
                in_shapes=tuple(tuple(t.shape) for t in ins),
                out_shapes=tuple(tuple(t.shape) for t in outs),
                flops=flops,
                bytes=float(moved),
                tensor_core=tensor_core,
                causal=causal,
            )
        )


def _is_causal(args: tuple, kwargs: dict) -> bool:
    if "is_causal" in kwargs:
        return bool(kwargs["is_causal"])
    bools = [a for a in args if isinstance(a, bool)]
    return bool(bools and bools[0])


def trace_step(build_model, build_batch, precision, *, target: str = "cuda", **kw) -> Trace:
    """Trace a steady-state training step (the second one: the first allocates the optimizer
    state); see :func:`predictors.step.trace_training_step`."""
    from predictors.spec.precision import get_precision
    from predictors.step import trace_training_step

    p = get_precision(precision)
    tracer = OpTracer(tf32=p.tf32, fp8_column=p.recipe.rate_column if p.recipe else "fp8")
    trace_training_step(
        build_model, build_batch, precision, target=target, modes=[tracer],
        on_phase=tracer.on_phase, steps=2, **kw,
    )  # fmt: skip
    return tracer.trace
