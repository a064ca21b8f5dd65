"""Per-op casting policy of mixed precision, reproduced while tracing on CPU.

CUDA autocast and CPU autocast cast different ops (CPU autocast leaves softmax, layer_norm,
exp, sum... in the low dtype; CUDA runs them in fp32), so a CPU trace made with
``torch.autocast("cpu")`` would mispredict a GPU step. :class:`CudaAutocastEmulation` applies
CUDA's op lists (``aten/src/ATen/autocast_mode.h``) as a ``TorchFunctionMode``: it acts above
autograd, exactly where real autocast acts, so casts are recorded in the graph and tensors saved
for backward have the dtype they would have on the GPU (which the memory predictor relies on).

:class:`Fp8LinearEmulation` turns every ``F.linear`` into Transformer-Engine-style fp8 GEMMs
(``torch._scaled_mm`` on e4m3 inputs in forward, e5m2 gradients in backward) with the cast
kernels of the precision's recipe; :func:`emulation_mode` maps a precision's ``emulation``
field to its mode.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from predictors.spec.precision import Fp8Recipe, Precision, get_precision

# CUDA autocast op lists (names of the Python-visible torch functions / Tensor methods).
CUDA_LOWER_PRECISION_OPS = frozenset(
    {
        "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
        "conv_transpose2d", "conv_transpose3d", "convolution", "prelu", "addmm", "addmv",
        "addr", "matmul", "__matmul__", "__rmatmul__", "einsum", "mm", "mv", "linalg_vecdot",
        "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
        "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
        "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
    }
)  # fmt: skip
# Python-level composites whose internals are matmuls (their body runs outside the mode).
CUDA_LOWER_PRECISION_OPS = CUDA_LOWER_PRECISION_OPS | {"multi_head_attention_forward"}
CUDA_FP32_OPS = frozenset(
    {
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
        "reciprocal", "rsqrt", "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus",
        "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm", "nuclear_norm",
        "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
        "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss",
        "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
        "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
        "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
        "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
        "upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d",
        "upsample_bicubic2d",
        # aten::cross_entropy_loss is composite; under CUDA autocast its log_softmax and
        # nll_loss both run in fp32, so the whole op does.
        "cross_entropy_loss", "cross_entropy",
    }
)  # fmt: skip
# fp32 unless the caller passed an explicit dtype; the kernel upcasts internally (no cast kernel).
CUDA_FP32_SET_OPT_DTYPE_OPS = frozenset(
    {"prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
     "linalg_matrix_norm", "sum"}
)  # fmt: skip
CUDA_PROMOTE_OPS = frozenset(
    {"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
     "index_put", "tensordot", "scatter_add"}
)  # fmt: skip

POLICY_LOWER, POLICY_FP32, POLICY_FP32_OPT_DTYPE, POLICY_PROMOTE = (
    "lower_precision_fp",
    "fp32",
    "fp32_set_opt_dtype",
    "promote",
)


def cuda_policy(op_name: str) -> str | None:
    """CUDA autocast's policy for a torch function / Tensor method name (None: not listed)."""
    if op_name in CUDA_LOWER_PRECISION_OPS:
        return POLICY_LOWER
    if op_name in CUDA_FP32_OPS:
        return POLICY_FP32
    if op_name in CUDA_FP32_SET_OPT_DTYPE_OPS:
        return POLICY_FP32_OPT_DTYPE
    if op_name in CUDA_PROMOTE_OPS:
        return POLICY_PROMOTE
    return None


def _eligible(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64


class CudaAutocastEmulation(TorchFunctionMode):
    """``torch.autocast("cuda", dtype)`` semantics for tensors on any device (here: CPU/fake).

    Like the real thing, lower-precision casts of fp32 leaf parameters are cached until the
    outermost region exits, so each weight is cast once per forward.
    """

    def __init__(self, dtype: torch.dtype = torch.float16, cache_enabled: bool = True) -> None:
        super().__init__()
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"autocast dtype={dtype} must be torch.float16 or torch.bfloat16")
        self.dtype = dtype
        self.cache_enabled = cache_enabled
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._depth = 0

    def __enter__(self):  # nesting depth decides when the weight cache is dropped
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            self._cache.clear()
        return super().__exit__(*exc)

    def _cast(self, x: Any, dtype: torch.dtype) -> Any:
        if not _eligible(x) or x.dtype == dtype:
            return x
        cacheable = (
            self.cache_enabled
            and dtype == self.dtype
            and x.dtype == torch.float32
            and x.requires_grad
            and x.is_leaf
            and torch.is_grad_enabled()
        )
        if cacheable:
            hit = self._cache.get(id(x))
            if hit is not None and hit[0] is x:
                return hit[1]
        y = x.to(dtype)
        if cacheable:
            self._cache[id(x)] = (x, y)
        return y

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        policy = cuda_policy(name)
        if policy is None:
            # Unlisted ops run in their inputs' dtype. (A Python-level composite re-dispatches to
            # this mode before its body runs, so its body runs outside it; the composites that
            # matter are listed by their own name, e.g. layer_norm, softmax, cross_entropy.)
            return func(*args, **kwargs)
        if policy == POLICY_LOWER:
            args, kwargs = tree_map(lambda x: self._cast(x, self.dtype), (args, kwargs))
        elif policy == POLICY_FP32:
            args, kwargs = tree_map(lambda x: self._cast(x, torch.float32), (args, kwargs))
        elif policy == POLICY_FP32_OPT_DTYPE:
            has_dtype = "dtype" in kwargs or any(isinstance(a, torch.dtype) for a in args)
            if not has_dtype and any(_eligible(a) for a in args[:1]):
                kwargs = {**kwargs, "dtype": torch.float32}
        else:  # promote to the widest floating dtype among the inputs
            dtypes = [a.dtype for a in tree_leaves((args, kwargs)) if _eligible(a)]
            if dtypes:
                widest = torch.float32 if torch.float32 in dtypes else self.dtype
                args, kwargs = tree_map(lambda x: self._cast(x, widest), (args, kwargs))
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# fp8: Transformer Engine's te.Linear, per recipe (predictors.spec.precision.Fp8Recipe).

FP8_FORWARD = torch.float8_e4m3fn
FP8_BACKWARD = torch.float8_e5m2


def _quantize(t: torch.Tensor, dtype, recipe: Fp8Recipe) -> torch.Tensor:
    """One fused cast(-transpose) kernel per tensor, as TE runs it. Current scaling first
    reduces the tensor's amax (TE docs, "FP8 Current Scaling requires two tensor reads per
    quantization: one to compute amax, one to cast";
    nvidia.github.io/TransformerEngine/features/low_precision_training/fp8_delayed_scaling);
    delayed scaling records the amax inside the cast and MXFP8 computes its 1x32 block scales
    inside it."""
    if recipe.extra_amax_pass:
        torch.linalg.vector_norm(t, float("inf"))
    return t.to(dtype)


def _scaled_mm(qa: torch.Tensor, qb: torch.Tensor, out_dtype, bias=None) -> torch.Tensor:
    # TE keeps scales in persistent buffers; this scalar is not a kernel (the tracer skips it)
    one = torch.ones((), dtype=torch.float32, device=qa.device)
    return torch._scaled_mm(qa, qb, scale_a=one, scale_b=one, bias=bias, out_dtype=out_dtype)


class _Fp8Linear(torch.autograd.Function):
    """Transformer-Engine-style fp8 linear: forward casts the input and the weight once and
    saves the fp8 copies (TE keeps the fp8 input and weight, with their transposes, for
    backward); backward casts only the incoming gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe):
        ctx.has_bias = bias is not None
        ctx.dtypes = (x.dtype, weight.dtype)
        ctx.recipe = recipe
        x2 = x.reshape(-1, x.shape[-1])
        qx, qw = _quantize(x2, FP8_FORWARD, recipe), _quantize(weight, FP8_FORWARD, recipe)
        # per-row scales do not serve backward's other contraction axis: keep the originals
        ctx.save_for_backward(*((x2, weight) if recipe.requantize_backward else (qx, qw)))
        ctx.x_shape = x.shape
        y = _scaled_mm(qx, qw.t(), x.dtype, bias)  # bias in the GEMM epilogue, as TE
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        saved_x, saved_w = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        recipe = ctx.recipe
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        qg = _quantize(g2, FP8_BACKWARD, recipe)
        if recipe.requantize_backward:  # scales along the other axis: cast each again
            qw = _quantize(saved_w, FP8_FORWARD, recipe)
            qg_w, qx = _quantize(g2, FP8_BACKWARD, recipe), _quantize(saved_x, FP8_FORWARD, recipe)
        else:
            qw, qg_w, qx = saved_w, qg, saved_x
        grad_x = _scaled_mm(qg, qw.t().contiguous().t(), x_dtype).reshape(ctx.x_shape)
        grad_w = _scaled_mm(qg_w.t().contiguous(), qx.t().contiguous().t(), w_dtype)
        grad_b = g2.sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


class Fp8LinearEmulation(TorchFunctionMode):
    """Run every ``F.linear`` of the covered layers as fp8 GEMMs (forward e4m3 x e4m3,
    backward e5m2 x e4m3); attention BMMs are not linears and stay in the high dtype, and
    layers the recipe does not cover (the LM head) are traced at ``recipe.fallback``."""

    def __init__(self, recipe: Fp8Recipe) -> None:
        super().__init__()
        self.recipe = recipe

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear or getattr(func, "__name__", "") == "linear":
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return _Fp8Linear.apply(x, weight, bias, self.recipe)
        return func(*args, **kwargs)


# Emulation modes by the name a Precision entry declares (Precision.emulation).
EMULATION_MODES = {"te_fp8": lambda p: Fp8LinearEmulation(p.recipe)}


def emulation_mode(precision: str | Precision) -> TorchFunctionMode:
    """The mode that stands in for ``precision``'s library (its ``emulation`` field)."""
    p = get_precision(precision)
    if p.emulation not in EMULATION_MODES:
        raise ValueError(f"precision {p.name!r}: emulation={p.emulation!r} has no mode; "
                         f"known: {', '.join(EMULATION_MODES)}")  # fmt: skip
    return EMULATION_MODES[p.emulation](p)


TARGETS = ("cuda", "cpu")


def autocast_context(
    precision: str | Precision, target: str = "cuda"
) -> contextlib.AbstractContextManager:
    """The casting context a forward pass at ``precision`` runs under on ``target``.

    ``target="cuda"`` emulates CUDA rules on whatever device the tensors live on (tracing for a
    GPU prediction); ``target="cpu"`` uses the real CPU autocast (measuring/tracing for a CPU).
    """
    p = get_precision(precision)
    if target not in TARGETS:
        raise ValueError(f"target={target!r} must be one of {TARGETS}")
    stack = contextlib.ExitStack()
    if p.emulation is not None:
        stack.enter_context(emulation_mode(p))
    if p.autocast:
        if target == "cpu":
            stack.enter_context(torch.autocast("cpu", dtype=p.compute_dtype))
        else:
            stack.enter_context(CudaAutocastEmulation(p.compute_dtype))
    return stack
