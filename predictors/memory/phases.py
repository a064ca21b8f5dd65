"""Walk a training step's phases over the factorization and take the maximum of live bytes.

Steady state (second step): parameters, fp32 masters and Adam states are live throughout;
gradients are ``None`` until the backward creates them. Phases:

* forward: saved activations of every layer accumulate (``+`` the loss's logits/log-softmax);
* loss/backward start: the fp32 logits upcast and d(log-softmax) exist next to all activations;
* backward, layer by layer in reverse: a layer's activations are released after its backward,
  its gradients appear, and its backward transients (input gradients ~2x its largest tensor,
  plus recomputed activations under checkpointing) are live meanwhile;
* optimizer: all gradients (plus fp32 master gradients under ``*-mixed``) and states.

ZeRO/DistributedOptimizer: stage 1 shards optimizer states and fp32 masters over ``dp``,
stage 2 also gradients, stage 3 also parameters (plus one layer gathered at a time).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..spec.model import ModelSpec
from ..spec.options import TrainingOptions
from ..spec.precision import Precision, get_precision
from .config import ShardingError, Step, StrategyView
from .factorize import F32, Factorization, factorize
from .overheads import CudaOverheads
from .zero import deepspeed_step, zero3_params

ADAM_STEP_BLOCK = 512  # fused AdamW keeps a 0-d fp32 ``step`` tensor per parameter (one block)


def runs_deepspeed_engine(options: TrainingOptions) -> bool:
    """Whether a step under ``options`` runs DeepSpeed's engine (framework ``deepspeed``), at
    every ZeRO stage, one rank included: the one test of the memory predictor for DeepSpeed
    (its ZeRO step, :func:`deepspeed_zero`; its ``BF16_Optimizer``, :func:`bf16_optimizer`;
    its buckets, :func:`device.deepspeed_buckets`; ...). On the options, which every view
    (:class:`config.StrategyView`) carries and the refusals take alone."""
    return options.framework == "deepspeed"


def deepspeed_zero(cfg: Step) -> bool:
    """DeepSpeed's ZeRO 2/3 with fp32 masters (one rank included): its optimizer step is
    :func:`deepspeed_step`'s. With :func:`bf16_optimizer`, the only places the walk reads
    the framework (:func:`runs_deepspeed_engine`; the replay reads it here only): elsewhere it
    prices the generic sharded step, with no framework's data-parallel buffers."""
    return (runs_deepspeed_engine(cfg.options) and cfg.zero >= 2
            and cfg.precision.master_weights_fp32)


def zero0_wrapper_dtype(view: StrategyView, precision: str | Precision) -> torch.dtype | None:
    """The weights' dtype DeepSpeed's engine wraps ``view``'s optimizer for without ZeRO, or
    None where it wraps none: ZeRO 0 with low-precision weights and fp32 masters, DeepSpeed's
    ``"bf16"`` or ``"fp16"`` config (the ``*-mixed`` and fp8 precisions; a ``*-pure`` one
    has neither section, :func:`device.deepspeed_comm_dtype`), for which ``engine.py``'s
    ``_do_optimizer_sanity_check`` returns ``BFLOAT16`` or ``FP16``. The one condition of
    :func:`bf16_optimizer` (``BF16_Optimizer``) and :func:`device.fp16_optimizer`
    (``FP16_Optimizer``), which differ in that dtype and in the optimizer the latter needs
    (their docstrings cite the DeepSpeed sources and versions)."""
    p = get_precision(precision)
    if runs_deepspeed_engine(view.options) and view.zero == 0 and p.master_weights_fp32:
        return p.param_dtype
    return None


def bf16_optimizer(view: StrategyView, precision: str | Precision) -> bool:
    """Whether DeepSpeed wraps ``view``'s optimizer in its ``BF16_Optimizer``: ZeRO 0 with
    bf16 weights and fp32 masters (DeepSpeed's ``"bf16"`` config). ``engine.py``'s
    ``get_data_types`` makes the gradient-accumulation dtype fp32 for bf16 weights without
    ZeRO (the ``data_types.grad_accum_dtype`` default), and ``_do_optimizer_sanity_check``
    then returns ``BFLOAT16``, so ``_configure_optimizer`` builds
    ``runtime/bf16_optimizer.py``'s ``BF16_Optimizer`` (v0.9.5, v0.12.6 and v0.16 alike). Its
    gradients and sharded states are :func:`device.grad_buffers`'; the walk shards the fp32
    masters and states over ``dp`` here too."""
    return zero0_wrapper_dtype(view, precision) == torch.bfloat16


def adam_impl(cfg: Step) -> str:
    """The Adam(W) implementation (:data:`optimizers.IMPLEMENTATIONS`) the walk prices: the
    fused kernel (in place; the residual model's simulated steps run it, ``predictors.step``,
    and :data:`ADAM_STEP_BLOCK` is its step tensor), but under DeepSpeed's step torch's foreach
    AdamW on each flat sub-group (the HF Trainer's: ``options.foreach_temporaries``)."""
    return "foreach" if deepspeed_zero(cfg) else "fused"


def trainable_params(fz: Factorization) -> int:
    """Trainable elements: what a framework's gradient buffers hold
    (:func:`device.grad_buffers`)."""
    return sum(x.params for x in fz.layers if x.trainable)


def trainable_tensors(fz: Factorization) -> list[int]:
    """Elements of each trainable parameter tensor, in model order."""
    return [n for x in fz.layers if x.trainable for n in (x.tensor_params or (x.params,))]


@dataclass
class PeakEstimate:
    peak_allocated: int
    peak_phase: str
    components: dict[str, int]  # live bytes by kind at the peak
    phase_peaks: dict[str, int] = field(default_factory=dict)


def walk_phases(spec: ModelSpec, cfg: Step, overheads: CudaOverheads,
                fz: Factorization | None = None, *, grad_buffer: dict[str, int] | None = None,
                step_copy: int = 0) -> PeakEstimate:
    """The step's phases over ``fz`` and their peak. ``grad_buffer``: a framework's buffers
    that hold every gradient in place of the per-layer ones (Megatron's, DeepSpeed's
    ``BF16_Optimizer``'s, by :func:`device.grad_buffers`; :func:`device.replaces_gradients`):
    live, full size, in every phase (their own components), and no per-layer gradient appears
    in the backward; ``step_copy``: the fp32 gradient bytes the framework's optimizer casts
    for its step (:func:`device.step_copy`), beside those buffers or, without them, beside
    every per-layer gradient (DeepSpeed's ``FP16_Optimizer`` frees them after its copy).
    Without them the walk prices the plain PyTorch step the residual model was trained on."""
    fz = fz or factorize(spec, cfg)
    held = dict(grad_buffer or {})  # in every phase
    p = cfg.precision
    w = fz.layers[0].param_bytes // max(fz.layers[0].params, 1) if fz.layers else F32
    dp = cfg.dp
    # DeepSpeed's BF16_Optimizer keeps the fp32 masters (and so the states) of its 1/dp
    # partition only, as ZeRO 1 does
    shard_opt = dp if cfg.zero >= 1 or bf16_optimizer(cfg, p) else 1
    shard_grad = dp if cfg.zero >= 2 else 1
    shard_param = dp if cfg.zero >= 3 else 1
    trainable = trainable_params(fz)
    if cfg.zero and trainable and cfg.dp > trainable:
        raise ShardingError(f"zero={cfg.zero}: dp={cfg.dp} exceeds the {trainable} trainable "
                            "parameters to shard")
    params = sum(x.param_bytes for x in fz.layers) // shard_param
    if cfg.zero >= 3:  # the one ZeRO-3 model (zero.py): shard + gathered layer + prefetch
        params = zero3_params([[x.param_bytes] for x in fz.layers], dp, w).total
    state_bytes = F32 if p.master_weights_fp32 else w
    states = (trainable * 2 * state_bytes + (trainable * F32 if p.master_weights_fp32 else 0))
    states = states // shard_opt + fz.num_trainable_tensors * ADAM_STEP_BLOCK
    base = params + states + fz.input_bytes + sum(held.values())
    ws = overheads.cublas_workspace_bytes
    acts = [x.saved for x in fz.layers]
    # a buffer that holds the gradients leaves none to appear layer by layer
    grads = [0 if held or not x.trainable else x.param_bytes // shard_grad for x in fz.layers]
    phase_peaks: dict[str, int] = {}
    best = (0, "", {})

    def visit(phase: str, act: int, grad: int, transient: int, workspaces: int) -> None:
        nonlocal best
        total = base + act + grad + transient + workspaces * ws
        phase_peaks[phase] = max(phase_peaks.get(phase, 0), total)
        if total > best[0]:
            best = (total, phase, {
                "parameters": params, "optimizer_states": states, "inputs": fz.input_bytes,
                "activations": act, "gradients": grad, "transient": transient,
                "workspace": workspaces * ws, **held,
            })

    all_acts = sum(acts) + fz.loss_saved
    visit("forward", all_acts, 0, fz.loss_transient // 2, 1)
    visit("backward", all_acts, 0, fz.loss_transient, 2)
    live_grad = 0
    remaining = all_acts - fz.loss_saved + fz.held_output
    # a checkpointed layer re-materializes its un-checkpointed saves during its backward
    full = factorize(spec, replace(cfg, options=replace(cfg.options, recompute="none"))).layers \
        if cfg.checkpointing == "full" else None
    for i in range(len(fz.layers) - 1, -1, -1):
        layer = fz.layers[i]
        recompute = full[i].saved if full is not None and layer.largest else 0
        transient = 2 * layer.largest + recompute
        live_grad += grads[i]
        visit("backward", remaining, live_grad, transient, 2)
        remaining -= acts[i]
    if held:  # the optimizer steps the buffer (or its fp32 cast)
        opt_grads = step_copy
    elif step_copy:  # the framework's fp32 copies beside every gradient of the backward
        opt_grads = live_grad + step_copy
    elif deepspeed_zero(cfg):  # its flat buffer + one sub-group's step
        opt_grads = deepspeed_step(trainable_tensors(fz), dp, cfg.zero, w,
                                   cfg.options.foreach_temporaries).peak(w)
    elif p.master_weights_fp32:  # low-precision grads are cast to fp32 and dropped one by one
        largest_grad = max((g for g in grads if g), default=0)
        opt_grads = trainable * F32 // shard_grad + largest_grad // len(fz.layers)
    else:
        opt_grads = live_grad
    visit("optimizer", fz.held_output, opt_grads, 0, 2)
    total, phase, comps = best
    return PeakEstimate(total, phase, comps, phase_peaks)

