"""Device-level memory: what ``nvidia-smi`` shows beyond the caching allocator, and the
buffers of distributed training (data parallelism, ZeRO, Megatron's distributed optimizer).

* Inside the allocator (so inside ``max_memory_reserved``): cuBLAS workspaces (traced, see
  :mod:`overheads`), cuDNN convolution workspaces (traced, :mod:`tracker`), DDP gradient
  buckets, Megatron's gradient buffer (one rank included), DeepSpeed ZeRO reduce /
  all-gather buckets and stage-3 live parameters.
* Outside it: the CUDA context with the kernels of the loaded libraries, and NCCL's
  communication buffers (NCCL allocates them with ``cudaMalloc`` itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from ..devices import get_device as get_compute_device
from ..spec.options import TrainingOptions
from ..spec.precision import Precision, get_precision
from ..spec.strategy import ParallelStrategy
from .allocator import MiB
from .config import SINGLE_GPU, ShardingError, Step, StrategyView
from .optimizers import TORCH_IMPL, OptimizerSpec
from .overheads import CONTEXTS, HOPPER, PRE_HOPPER, CudaOverheads
from .phases import bf16_optimizer, deepspeed_zero, runs_deepspeed_engine, zero0_wrapper_dtype
from .zero import zero3_params


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    capacity: int  # bytes nvidia-smi reports as total
    overheads: CudaOverheads

    def outside_allocator(self, dist: Sharding) -> dict[str, int]:
        """The CUDA context and NCCL's buffers, one entry per communicator
        (:func:`nccl_communicators`)."""
        return {"cuda_context": self.overheads.context_bytes, **dist.nccl()}


def get_device(name: str, stack: str | None = None) -> DeviceProfile:
    """Memory profile of a GPU of :data:`predictors.devices.DEVICES` (``a100-40gb``, ``h100``,
    ``h200``, ...). ``stack`` picks a measured CUDA-context size of :data:`overheads.CONTEXTS`
    (default: the card's architecture with the current PyTorch stack)."""
    dev = get_compute_device(name)
    if dev.kind != "gpu":
        raise ShardingError(f"device={name!r} is not a GPU")
    hopper = dev.family in ("h100",)
    base = HOPPER if hopper else PRE_HOPPER
    key = stack or ("hopper" if hopper else "ampere")
    if key not in CONTEXTS:
        raise ShardingError(f"stack={key!r} unknown; choose one of {', '.join(CONTEXTS)}")
    return DeviceProfile(dev.name, int(dev.memory_bytes),
                         replace(base, context_bytes=CONTEXTS[key].bytes,
                                 cudnn_context_bytes=CONTEXTS[key].cudnn_bytes,
                                 cudnn_workspaces=True))


DEVICES = ("a100-40gb", "a100-80gb", "h100-80gb", "h200", "l40s", "v100")

# The frameworks whose data-parallel buffers are modelled (TrainingOptions.framework):
# "pytorch" is torch DDP (ZeRO-1 via ZeroRedundancyOptimizer; its FSDP is not modelled:
# unmodelled_zero), "deepspeed" its ZeRO with the documented defaults of CommBuffers,
# "megatron" its distributed optimizer (ZeRO-1 over a contiguous gradient buffer)
SHARDING_FRAMEWORKS = ("pytorch", "deepspeed", "megatron")
# The options of a plain PyTorch step (torch DDP where dp > 1): the traced paths' default
TORCH_OPTIONS = TrainingOptions(framework="pytorch")
# The optimizers (optimizers.OPTIMIZERS) a framework steps with its own fused kernel whatever
# implementation the script's optimizer would pick: Megatron builds Transformer Engine's (else
# Apex's) FusedAdam and FusedSGD (megatron/core/optimizer/__init__.py); DeepSpeed its FusedAdam
# for an Adam or AdamW "optimizer" config section (the DeepSpeed the traced paths model; another
# type is the torch optimizer of that name, as given). torch DDP steps the script's optimizer.
FRAMEWORK_FUSED = {"megatron": ("adam", "adamw", "sgd"), "deepspeed": ("adam", "adamw")}
# what a framework of FRAMEWORK_FUSED steps an optimizer (OPTIMIZER_SAID) with, in words: the
# refusal of another implementation given explicitly (unrun_impl)
FRAMEWORK_OWN = {"deepspeed": "DeepSpeed steps {} with its own fused kernel (the FusedAdam of "
                              "an \"optimizer\" config section, the DeepSpeed the traced path "
                              "models)",
                 "megatron": "Megatron steps {} with its own fused kernel (Transformer "
                             "Engine's or Apex's) whatever the script asks"}
OPTIMIZER_SAID = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD"}


def framework_impl(framework: str, optimizer: str) -> str | None:
    """The implementation (:data:`optimizers.IMPLEMENTATIONS`) ``framework`` steps
    ``optimizer`` (a name of :data:`optimizers.OPTIMIZERS`) with on the traced paths whatever
    the script asks, or None: the one asked (:data:`FRAMEWORK_FUSED`)."""
    return "fused" if optimizer in FRAMEWORK_FUSED.get(framework, ()) else None


def unrun_impl(framework: str, opt: OptimizerSpec) -> str | None:
    """What ``framework`` steps ``opt`` with instead of the implementation ``opt`` names, in
    words (:data:`FRAMEWORK_OWN`), or None: it names none, or the one the framework runs
    (:func:`framework_impl`). Pricing the framework's kernel instead was silent: the one rule
    of :meth:`Sharding.effective_optimizer`'s refusal and of ``predict memory``'s."""
    own = framework_impl(framework, opt.name)
    if opt.impl is None or own in (None, opt.impl):
        return None
    return FRAMEWORK_OWN[framework].format(OPTIMIZER_SAID[opt.name])


@dataclass(frozen=True)
class CommBuffers:
    """Sizes of a framework's communication buffers (only the framework's implementation
    decides them; the ZeRO stage, ``dp`` and framework are the strategy's and options').

    DeepSpeed defaults from https://www.deepspeed.ai/docs/config-json/ (ZeRO optimizations) and
    ``deepspeed/runtime/zero/config.py`` (``DeepSpeedZeroConfig``): ``reduce_bucket_size`` 5e8
    and ``allgather_bucket_size`` 5e8 elements, ``stage3_prefetch_bucket_size`` 5e7,
    ``stage3_param_persistence_threshold`` 1e5 (ZeRO-3's parameters: :mod:`zero`),
    ``overlap_comm`` on at stage 3 only, ``contiguous_gradients`` on."""

    reduce_bucket: float = 5e8
    allgather_bucket: float = 5e8
    prefetch_bucket: float = 5e7
    overlap_comm: bool | None = None  # DeepSpeed: on by default at stage 3 only
    nccl_channels: int = 16  # NCCL rings per communicator (NVLink A100/H100 nodes: 16-32)
    nccl_buffsize: int = 4 * MiB  # NCCL_BUFFSIZE default (Simple protocol, per channel/peer)


def unmodelled_zero(options: TrainingOptions) -> str | None:
    """Why ``options``' ZeRO stage (:attr:`TrainingOptions.zero_stage`) is not modelled under
    its framework, naming the fields and ``predict memory``'s flags, or None. The one rule of
    the traced paths (:class:`Sharding`), a preset's analytical model
    (``api.predict_peak_memory``) and ``predict memory``'s refusal. Megatron's gradient buffer
    (:func:`grad_buffers`) is priced at ZeRO 0/1 only, its distributed optimizer's: at 2/3
    the walk priced the generic sharded step without it, so at dp 1, where there is nothing to
    shard, zero 2 fit where zero 1 was tight. torch's ZeroRedundancyOptimizer is ZeRO-1 only
    (``torch/distributed/optim/zero_redundancy_optimizer.py``: it shards optimizer states;
    DDP still all-reduces full gradients): at 2/3 the traced path kept every gradient and
    dropped DDP's buckets, the analytical one sharded the gradients (and at 3 the parameters,
    by DeepSpeed's stage-3 model, :mod:`zero`), both below zero 1's price. Sharding gradients in
    PyTorch is its FSDP, which neither path models."""
    zero, framework = options.zero_stage, options.framework
    if framework == "megatron" and zero > 1:
        return (f"zero={zero} with framework='megatron' (--zero {zero} --framework megatron): "
                "Megatron shards optimizer states only (zero 1, its distributed optimizer) and "
                "its gradient buffer is priced at zero 0 or 1; choose one of them")
    if framework == "pytorch" and zero > 1:
        return (f"zero={zero} with framework='pytorch' (--zero {zero} --framework pytorch): "
                "torch DDP shards optimizer states only (zero 1, torch's "
                "ZeroRedundancyOptimizer); sharding gradients in PyTorch is its FSDP, which is "
                "not modelled; choose zero 0 or 1, or framework 'deepspeed' for its ZeRO 2/3")
    return None


def deepspeed_comm_dtype(precision: str | Precision) -> torch.dtype:
    """The dtype DeepSpeed's engine reduces ZeRO 0's gradients in at ``precision`` (its
    ``communication_data_type`` without a config key: ``engine.py``, v0.9.5 and v0.12.6): the
    ``"fp16"`` or ``"bf16"`` config section's dtype, which ``fp16-mixed`` and ``bf16-mixed``
    (and fp8) are, else fp32. Without either section the engine leaves the weights as given
    (``_configure_distributed_model``'s ``__check_params`` returns at once) and steps them
    with no wrapper (``get_data_types`` -> fp32, ``_do_optimizer_sanity_check`` -> None): the
    one DeepSpeed job of a ``*-pure`` precision, at ZeRO 0 only (:func:`unrun_precision`),
    whose gradients are then cast to fp32 for the reduce."""
    p = get_precision(precision)
    return p.param_dtype if p.master_weights_fp32 else torch.float32


def unrun_precision(options: TrainingOptions, precision: str | Precision) -> str | None:
    """Why no DeepSpeed job runs ``precision`` at ``options``' ZeRO stage, naming the fields
    and ``predict memory``'s flags, or None. DeepSpeed's ZeRO optimizer copies low-precision
    weights to fp32 masters whatever its config: ``stage_1_and_2.py`` (stages 1 and 2:
    ``single_partition_of_fp32_groups``, ``.clone().float()`` of the rank's partition) and
    ``stage3.py`` (``_create_fp32_partitions``: ``fp32_partitioned_groups_flat``), v0.9.5 and
    v0.12.6 alike; ``fp16_master_weights_and_gradients`` keeps fp16 masters only with
    ZeRO-Offload and ``DeepSpeedCPUAdam`` (asserted there), which neither path models. So a
    ``*-pure`` precision (no fp32 masters) at ZeRO 1-3 was priced as a step DeepSpeed never
    runs, its masters missing; at ZeRO 0 it is a real job (:func:`deepspeed_comm_dtype`). The
    one rule of the traced paths (``module.predict_module_memory``), a preset's analytical
    model (``api.predict_peak_memory``) and ``predict memory``'s refusal."""
    p, zero = get_precision(precision), options.zero_stage
    if (not runs_deepspeed_engine(options) or zero == 0 or p.param_dtype == torch.float32
            or p.master_weights_fp32):
        return None
    mixed = "bf16-mixed" if p.param_dtype == torch.bfloat16 else "fp16-mixed"
    return (f"precision={p.name!r} with framework='deepspeed' at zero={zero} (--precision "
            f"{p.name} --framework deepspeed --zero {zero}): DeepSpeed's ZeRO optimizer keeps "
            f"fp32 masters of {p.name.split('-')[0]} weights whatever its config (fp16 masters "
            "only with ZeRO-Offload, not modelled), so no DeepSpeed job steps without them; "
            f"choose {mixed}, or zero 0 (a model cast to {p.name.split('-')[0]} without a "
            "\"bf16\"/\"fp16\" config section, stepped as it is)")


# What neither path models of a framework's sharded data parallelism beyond one rank, in
# words (unpriced_framework): torchtitan shards with FSDP2 (torch's fully_shard: per-layer
# all-gather output and reduce-scatter input buffers, the next layer's prefetched), LLM
# Foundry with FSDP1 through Composer (flat parameters all-gathered per wrapped module)
UNMODELLED_SHARDING = {"torchtitan": "torchtitan's FSDP2 (fully_shard: its all-gather and "
                                     "reduce-scatter buffers)",
                       "llm-foundry": "LLM Foundry's FSDP1 through Composer (its flat "
                                      "parameters' all-gather and reduce-scatter buffers)"}


def unpriced_framework(cfg: Step) -> str | None:
    """Why a preset's analytical model (``api.predict_peak_memory``) does not price ``cfg``'s
    framework beyond one rank, naming the fields and ``predict memory``'s flags, or None. It
    prices the data-parallel buffers of ``pytorch`` (torch DDP's gradient buckets,
    :func:`grad_buffers`), ``megatron`` (its gradient buffer) and ``deepspeed`` where it reads
    DeepSpeed's step (ZeRO 2/3 with fp32 masters, :func:`phases.deepspeed_zero`; its buckets,
    :func:`deepspeed_buckets`), and NCCL's of every framework; another framework beyond one
    rank was priced as one rank's step plus NCCL's buffers, none of its own. The one rule of
    the API's refusal and ``predict memory``'s."""
    framework, dp = cfg.options.framework, cfg.dp
    if dp == 1 or framework in ("pytorch", "megatron") or deepspeed_zero(cfg):
        return None
    head = (f"framework={framework!r} at dp={dp} (--framework {framework} --dp {dp}): beyond "
            "one rank the analytical model prices the data-parallel buffers of pytorch and "
            "megatron (torch DDP's gradient buckets, Megatron's gradient buffer) and of "
            "deepspeed at its ZeRO 2/3 step with fp32 masters (a *-mixed or fp8 precision; its "
            "buckets), and NCCL's buffers of every framework")
    if framework in UNMODELLED_SHARDING:
        return (f"{head}; {UNMODELLED_SHARDING[framework]} is not modelled on either path "
                "(the traced path runs pytorch, deepspeed and megatron)")
    return f"{head}; the traced path (--trace, predict_spec_memory) prices this one"


def megatron_grad_dtype(precision: str | Precision, options: TrainingOptions) -> torch.dtype:
    """The dtype of Megatron-Core's gradient buffer (``main_grad``) at ``precision`` under
    ``options``: ``DistributedDataParallel`` groups parameters by (param dtype, grad dtype) with
    grad dtype fp32 where ``ddp_config.grad_reduce_in_fp32``, else the parameter's
    (``megatron/core/distributed/distributed_data_parallel.py``,
    ``_allocate_buffers_for_parameters``). Megatron-LM sets that flag from
    ``--accumulate-allreduce-grads-in-fp32``
    (:attr:`TrainingOptions.accumulate_allreduce_grads_in_fp32`), which ``--bf16`` turns on
    whatever is given (``validate_args``: bf16 gradients are accumulated and reduced in fp32)
    and ``--fp16`` leaves as given: fp32 but for fp16 weights without the flag."""
    p = get_precision(precision)
    fp16 = p.param_dtype == torch.float16 and not options.accumulate_allreduce_grads_in_fp32
    return torch.float16 if fp16 else torch.float32


def replaces_gradients(view: StrategyView, precision: str | Precision) -> bool:
    """Whether ``view``'s framework holds the gradients in buffers of its own
    (:func:`grad_buffers`) IN PLACE of the per-layer ``.grad`` a plain step frees at its end,
    live full size in every phase. Megatron-Core's backward hook adds each ``param.grad`` into
    ``param.main_grad`` (a view of the buffer) and drops it
    (``DistributedDataParallel._make_backward_post_hook``; with gradient-accumulation fusion
    the weight gradient is written into ``main_grad`` directly), and its optimizer steps
    ``main_grad`` (``optimizer.py`` / ``distrib_optimizer.py``,
    ``_copy_model_grads_to_main_grads``). DeepSpeed's ``BF16_Optimizer``
    (:func:`phases.bf16_optimizer`) steps its fp32 buffer and keeps the bf16 ``.grad`` from
    one backward to the next. torch DDP's buckets are a copy beside ``.grad``."""
    return view.options.framework == "megatron" or bf16_optimizer(view, precision)


def grad_buffers(view: StrategyView, grad_params: int,
                 precision: str | Precision) -> dict[str, int]:
    """The gradient buffers ``view``'s framework allocates once, when it wraps the model for
    its ``dp`` ranks at its ZeRO stage, for ``grad_params`` trainable elements (every trainable
    gradient, not the gradients live at the step's peak); live in every phase. torch DDP's
    flat buckets beyond one rank, in the gradients' dtype (``gradient_as_bucket_view=False``:
    the reducer's ``initialize_buckets`` allocates every bucket, the backward copies each
    gradient in). Megatron-Core's contiguous ``main_grad`` buffer (without or with the
    distributed optimizer) at any ``dp``, one rank included (Megatron-LM's ``get_model`` wraps
    every model chunk in its ``DistributedDataParallel``), in :func:`megatron_grad_dtype`:
    ``_ParamAndGradBuffer`` allocates ``grad_data`` for every parameter that requires a
    gradient (``param_and_grad_buffer.py``), full size under the distributed optimizer too (its
    reduce-scatter writes each rank's shard into a view of the same buffer); the distributed
    optimizer's ``param_data`` buffer takes the parameters' own storage (each ``param.data`` is
    moved into it), so it adds nothing. Both at ZeRO 0/1: their ZeRO 2/3 is refused
    (:func:`unmodelled_zero`). DeepSpeed's ``BF16_Optimizer`` at ZeRO 0 with bf16 weights
    (:func:`phases.bf16_optimizer`; ``deepspeed/runtime/bf16_optimizer.py``,
    ``_setup_for_real_optimizer``, v0.9.5, v0.12.6 and v0.16 alike) at any ``dp``, one rank
    included: an fp32 gradient-accumulation buffer of every trainable element, full size
    whatever ``dp`` (``fp32_groups_gradients_flat``, ``torch.zeros_like`` of the flat bf16
    group, allocated at init; only the fp32 masters and the optimizer's states are the
    rank's 1/``dp`` partition, ``fp32_groups_flat_partition``), ``ds_fp32_grad_buffer``; and
    the bf16 ``.grad`` tensors, ``ds_bf16_grads``: ``backward`` adds them into the buffer
    (``update_hp_grads``) but frees them only at the next backward's start
    (``clear_lp_grads``; v0.12.6 zeroes and keeps them) and the engine's
    ``_take_model_step`` leaves them (``pass`` for bf16 without ZeRO), so under DeepSpeed's
    own loop every one is live in every phase of the steady state, the forward included (a
    loop that sets them to None after the step, as the HF Trainer's ``model.zero_grad()``
    does, holds them from the backward on: an upper bound there). The one implementation for
    the traced paths (:class:`Sharding`) and a preset's analytical model
    (``api.predict_peak_memory``: :class:`config.Step`)."""
    framework = view.options.framework
    if bf16_optimizer(view, precision):
        return {"ds_fp32_grad_buffer": grad_params * 4,
                "ds_bf16_grads": grad_params * get_precision(precision).param_dtype.itemsize}
    if framework == "pytorch" and view.dp > 1:
        return {"ddp_grad_buckets": grad_params * get_precision(precision).param_dtype.itemsize}
    if framework == "megatron":
        dtype = megatron_grad_dtype(precision, view.options)
        return {"megatron_grad_buffer": grad_params * dtype.itemsize}
    return {}


def fp16_optimizer(view: StrategyView, precision: str | Precision,
                   optimizer: str = "adamw") -> bool:
    """Whether DeepSpeed wraps ``view``'s optimizer in ``runtime/fp16/fused_optimizer.py``'s
    ``FP16_Optimizer``: ZeRO 0 with fp16 weights and fp32 masters (DeepSpeed's ``"fp16"``
    config: ``fp16-mixed``; the ``fp16`` precision is fp32 weights under autocast, which that
    config does not run) stepping its ``FusedAdam`` (``optimizer``, a name of
    :data:`optimizers.OPTIMIZERS`: Adam or AdamW, :data:`FRAMEWORK_FUSED`; the analytical path
    prices Adam(W)). ``engine.py``'s ``get_data_types`` leaves the gradient-accumulation dtype
    fp16 for fp16 weights, ``_do_optimizer_sanity_check`` then returns ``FP16`` without ZeRO,
    and ``_configure_fp16_optimizer`` builds ``FP16_Optimizer`` for a ``FusedAdam`` (another
    optimizer gets ``FP16_UnfusedOptimizer``), v0.9.5 and v0.12.6 alike. It keeps flat fp32
    masters and its optimizer's states of every trainable element (not partitioned), as the
    plain mixed step does; its step is :func:`step_copy`'s."""
    return (zero0_wrapper_dtype(view, precision) == torch.float16
            and optimizer in FRAMEWORK_FUSED["deepspeed"])


def step_copy(view: StrategyView, grad_tensors: Sequence[int],
              precision: str | Precision, optimizer: str = "adamw") -> int:
    """The fp32 gradient bytes the framework casts for the step beside the gradients it
    holds, live together at the step's highest moment (priced in the optimizer phase), for
    trainable tensors of ``grad_tensors`` elements stepped by ``optimizer`` (a name of
    :data:`optimizers.OPTIMIZERS`); none where the framework steps as the plain PyTorch step
    does. Beside its gradient buffers (:func:`replaces_gradients`): Megatron's
    (:func:`megatron_step_copy`); DeepSpeed's ``BF16_Optimizer`` casts one bf16 gradient at a
    time after the backward (``update_hp_grads``: ``lp.grad.data.to(hp_grad.dtype)`` added
    into the buffer), the largest tensor's, and steps the buffer itself. Beside every
    per-layer fp16 ``.grad``: DeepSpeed's ``FP16_Optimizer`` (:func:`fp16_optimizer`;
    ``runtime/fp16/fused_optimizer.py``, ``step``, v0.9.5 and v0.12.6 alike) casts every fp16
    ``.grad`` of an optimizer group to fp32 in one list (``p.grad.to(data_type)``) and
    concatenates the list into a new flat fp32 tensor (``_flatten_dense_tensors``) before it
    frees the fp16 ones (``p.grad = None``): both, 8 B per trainable element, beside the fp16
    ``.grad``'s 2 (one optimizer group, as a config's ``"optimizer"`` section builds it from
    the trainable parameters: several hold less, the earlier groups' fp16 gradients freed);
    the flat tensor is what its ``FusedAdam`` steps, in place."""
    if bf16_optimizer(view, precision):
        return max(grad_tensors, default=0) * 4
    if fp16_optimizer(view, precision, optimizer):
        return 2 * sum(grad_tensors) * 4
    if view.options.framework == "megatron":
        return megatron_step_copy(view, sum(grad_tensors), precision)
    return 0


def megatron_step_copy(view: StrategyView, grad_params: int, precision: str | Precision) -> int:
    """The fp32 gradient bytes Megatron's optimizer casts from its buffer for the step, live
    while it steps: none where the buffer is fp32 (:func:`megatron_grad_dtype` under
    ``view.options``; ``main_grad.float()`` of an fp32 tensor is the tensor itself; fp32
    weights step on ``main_grad`` directly), else with fp32 masters every gradient
    (``Float16OptimizerWithFloat16Params._copy_model_grads_to_main_grads``) or, under the
    distributed optimizer, the rank's 1/``dp`` shard
    (``DistributedOptimizer._copy_model_grads_to_main_grads``)."""
    p = get_precision(precision)
    if not p.master_weights_fp32 or megatron_grad_dtype(p, view.options) == torch.float32:
        return 0
    return grad_params * 4 // (view.dp if view.zero >= 1 else 1)


# The elements of the flat buckets DeepSpeed's engine all-reduces a ZeRO-0 step's gradients in:
# engine.backward calls allreduce_gradients() with its default bucket_size,
# MEMORY_OPT_ALLREDUCE_SIZE (deepspeed/runtime/engine.py, v0.9.5 and v0.12.6 alike; no config
# key sets it)
ALLREDUCE_BUCKET = 500_000_000


def allreduce_bucket(grad_tensors: Sequence[int], bucket: int = ALLREDUCE_BUCKET) -> int:
    """Elements of the largest flat tensor DeepSpeed's ZeRO-0 all-reduce allocates for
    gradients of ``grad_tensors`` elements each, in parameter order: ``allreduce_no_retain``
    takes them in order until their elements exceed ``bucket`` (so a bucket can pass it by
    one tensor), flattens them into a new tensor (``_flatten_dense_tensors``), all-reduces it
    and copies it back, then starts the next."""
    largest = run = 0
    for n in grad_tensors:
        run += n
        if run > bucket:
            largest, run = max(largest, run), 0
    return max(largest, run)


def deepspeed_buckets(view: StrategyView, param_bytes: int, precision: str | Precision,
                      buffers: CommBuffers | None = None,
                      grad_tensors: Sequence[int] = ()) -> dict[str, int]:
    """The bucket buffers DeepSpeed's engine and ZeRO optimizer allocate inside the caching
    allocator on one rank of ``view`` (framework ``deepspeed``, :func:`runs_deepspeed_engine`;
    none otherwise), by name, at ``buffers``' sizes in the weights' dtype at ``precision`` (the
    optimizer's ``self.dtype``); ``param_bytes``: the rank's parameter bytes (what the
    all-gather bucket is capped at); ``grad_tensors``: the elements of each trainable
    gradient, in parameter order (what ZeRO 0 buckets). ZeRO 0 is DeepSpeed's own data
    parallelism: the engine's ``allreduce_gradients`` runs ``buffered_allreduce_fallback``
    after every backward at a gradient-accumulation boundary, at any ``dp``, which flattens
    the gradients (``param.grad``, in the weights' dtype) into buckets of
    :data:`ALLREDUCE_BUCKET` elements one after another (:func:`allreduce_bucket`: the largest
    is priced, ``ds_allreduce_bucket``, live after the backward beside every gradient; it was
    priced as a plain step, no bucket), each all-reduced in :func:`deepspeed_comm_dtype`: the
    weights' dtype but for a ``*-pure`` precision, whose bucket is cast to an fp32 copy
    beside it (``ds_allreduce_cast``). Stages 1 and 2 (one optimizer class,
    ``deepspeed/runtime/zero/stage_1_and_2.py``) allocate the contiguous-gradient (ipg) buffer
    at the full ``reduce_bucket_size`` whatever the model size, a second one with
    ``overlap_comm``, at each backward's start wherever ``contiguous_gradients`` (on by
    default) holds, stage 1 too (``backward`` in v0.9.5 and
    v0.12.6, ``setup_buckets`` since); stage 3 one flat ipg buffer of it (``stage3.py``,
    allocated at init); stage 1's all-gather of the updated parameters works in
    ``allgather_bucket_size`` pieces. DeepSpeed's ZeRO optimizer
    runs at one rank too, so these are priced at any ``dp``. The one rule of the traced paths
    (:meth:`Sharding.sharding_adjustment`) and a preset's analytical model
    (``api.predict_peak_memory``), which price them live in every phase of the step."""
    if not runs_deepspeed_engine(view.options):
        return {}
    elem = get_precision(precision).param_dtype.itemsize
    if view.zero == 0:
        bucket = allreduce_bucket(grad_tensors)
        out = {"ds_allreduce_bucket": bucket * elem}
        comm = deepspeed_comm_dtype(precision).itemsize
        if comm != elem:  # allreduce_bucket: tensor.to(communication_data_type), reduced
            out["ds_allreduce_cast"] = bucket * comm  # beside the flat bucket, copied back
        return out
    b = buffers or CommBuffers()
    overlap = b.overlap_comm if b.overlap_comm is not None else view.zero == 3
    n = 2 if overlap and view.zero < 3 else 1
    out = {"ds_reduce_bucket": int(n * b.reduce_bucket * elem)}
    if view.zero == 1:
        out["ds_allgather_bucket"] = int(min(b.allgather_bucket * elem, max(param_bytes, elem)))
    return out


def pipeline_buffers(cfg: Step, seq_length: int, hidden: int, stage: int,
                     inflight: int) -> dict[str, int]:
    """The p2p tensors Megatron-Core 0.16's 1F1B schedule holds on one rank of pipeline stage
    ``stage`` (0-based) of ``cfg``'s strategy besides its ``inflight`` micro-batches'
    activations, by name, each of the p2p shape (``pipeline_parallel/schedules.py``,
    ``get_tensor_shapes``: ``seq_length / cp`` tokens, ``/ tp`` with sequence parallelism, x
    the micro-batch x ``hidden``) in ``config.pipeline_dtype``, which Megatron-LM sets to the
    weights' dtype (``arguments.py``: ``args.params_dtype``). On every stage but the last the
    output gradient received from the next stage (``p2p_communication.py``, ``_communicate``:
    ``torch.empty`` of ``recv_next_shape`` in ``send_forward_recv_backward`` /
    ``recv_backward``), which the schedule's ``output_tensor_grad`` holds through that
    micro-batch's backward and the next forward; on every stage but the first the gradient of
    the stage's input (``backward_step`` returns ``input_tensor.grad``), which the schedule's
    ``input_tensor_grad`` holds after it is sent, through the next forward and backward, until
    the next ``backward_step`` returns: live at the most-in-flight backward where the stage
    runs more micro-batches than it holds in flight (``forward_backward_pipelining_without_
    interleaving``: from the second 1F1B iteration on). The forward receive is the first
    layer's input, already the walk's activations; the sent outputs are freed
    (``deallocate_pipeline_outputs``, on in Megatron-LM). Live in the forward and backward, so
    priced at the peak whatever its phase (at an optimizer peak, after the schedule returns,
    an upper bound). None at pp = 1."""
    s = cfg.strategy
    if s.pp == 1:
        return {}
    tokens = seq_length // s.cp // (s.tp if cfg.options.sequence_parallel else 1)
    size = tokens * cfg.batch * hidden * cfg.precision.param_dtype.itemsize
    out = {}
    if stage < s.pp - 1:
        out["pp_output_grad_recv"] = size
    if stage > 0 and s.num_microbatches > inflight:
        out["pp_input_grad"] = size
    return out


def nccl_bytes(ranks: int, buffers: CommBuffers | None = None) -> int:
    """NCCL's buffers for one communicator over ``ranks`` ranks (outside the caching
    allocator: NCCL allocates them with ``cudaMalloc``): each channel keeps a send and a receive
    buffer of ``NCCL_BUFFSIZE`` per ring neighbour for the Simple protocol, plus LL (1/8) and
    LL128 (~9/8) buffers (NCCL docs, NCCL_BUFFSIZE / NCCL_PROTO)."""
    if ranks == 1:
        return 0
    b = buffers or CommBuffers()
    per_channel = 2 * b.nccl_buffsize * (1 + 1 / 8 + 9 / 8)
    return int(b.nccl_channels * per_channel)


def nccl_communicators(strategy: ParallelStrategy, options: TrainingOptions,
                       buffers: CommBuffers | None = None, *, embedding_stage: bool = False
                       ) -> dict[str, int]:
    """NCCL's buffers of each communicator one rank of ``strategy`` runs a collective on in
    the step under ``options``' framework, by :func:`nccl_bytes`: one per group of more than
    one rank, named ``nccl_<group>``. Megatron-Core's ``parallel_state.
    initialize_model_parallel`` creates the groups, each a ``torch.distributed.new_group`` of
    the NCCL backend (torch DDP and DeepSpeed use the data-parallel one); NCCL allocates a
    communicator's buffers lazily, when the group runs its first collective
    (``ProcessGroupNCCL`` creates the communicator on first use), so a group is priced where
    a rank uses it. Every framework: ``dp`` (the gradients' all-reduce or reduce-scatter),
    ``tp`` (the layers' all-reduces), ``pp`` (the activations' send/recv between stages).
    Megatron (Megatron-LM with Megatron-Core 0.16) also: the world group of every rank
    (``world``: torch's default process group, not one of Megatron-Core's groups: Megatron-LM's
    ``megatron/training/initialize.py``, ``_compile_dependencies``, ends with a
    ``torch.distributed.barrier()`` on it, and ``training.py``'s ``pretrain`` all-reduces the
    start time over it; ``init_process_group`` is given no ``device_id``, so its communicator
    too is created at that first collective); the model-parallel group of tp x pp ranks
    (``mp``), whatever the optimizer: ``training.py``'s ``train_step`` all-reduces the step's
    success and gradient norm over it every step (``logical_and_across_model_parallel_group``,
    ``reduce_max_stat_across_model_parallel_group``), and it is the optimizer's
    gradient-statistics group without the distributed optimizer; the optimizer's gradient
    statistics (the gradient norm, and fp16's found-inf check) are all-reduced over
    ``MegatronOptimizer.get_grad_stats_parallel_group``, with the distributed optimizer the
    intra-distributed-optimizer instance group of every rank (``dist_opt``:
    ``optimizer/__init__.py`` sets ``grad_stats_parallel_group`` to ``intra_dist_opt_group``,
    one instance by default, built over all 'tp-ep-pp' groups of the data-parallel ranks); and,
    on an ``embedding_stage`` (the first or last pipeline stage of a model with tied word
    embeddings), the embedding group of the first and last stage (``embd``: ``LanguageModule.
    setup_embeddings_and_output_layer`` all-reduces the shared weight over it at init,
    ``finalize_model_grads`` its gradient every step; ``default_embedding_ranks``), at pp > 1.
    DeepSpeed also holds the world group's: without an ``mpu`` its data-parallel group is a
    clone of the world group (``deepspeed/utils/groups.py``, ``_get_data_parallel_group`` ->
    ``_clone_world_group``: ``dist.new_group`` of every rank, since ``dist.get_global_rank``
    does not work on ``group.WORLD``), over which the engine broadcasts the model and reduces
    the gradients (``nccl_dp``), while torch's default group runs ZeRO-3's parameter
    all-gathers every step (``zero/partition_parameters.py``, ``Init``: ``ds_process_group =
    dist.get_world_group()`` without a ``data_parallel_group``, as the HF integration's
    ``zero.Init`` and the engine's ``_convert_to_zero_parameters`` without an ``mpu`` call
    it) and, at every stage, ``engine.save_checkpoint``'s ``dist.barrier()`` and the
    checkpoint tag's all-reduce (``_checkpoint_tag_validation``, on by default): v0.9.5,
    v0.12.6 and v0.16 alike (``world``).
    Groups of the same ranks are distinct communicators (each ``new_group`` its own
    ``ProcessGroupNCCL``): at tp = pp = 1 the world, data-parallel and distributed-optimizer
    groups hold the same ranks and are three.
    The one implementation of the traced paths (:class:`Sharding`) and a preset's analytical
    model (``api.predict_peak_memory``)."""
    s = strategy
    sizes = {"dp": s.dp, "tp": s.tp, "pp": s.pp}
    if options.framework == "megatron" or runs_deepspeed_engine(options):
        sizes["world"] = s.world_size
    if options.framework == "megatron":
        sizes["mp"] = s.tp * s.pp
        if options.distributed_optimizer:
            sizes["dist_opt"] = s.world_size
        if embedding_stage:
            sizes["embd"] = min(s.pp, 2)
    return {f"nccl_{group}": nccl_bytes(ranks, buffers)
            for group, ranks in sizes.items() if ranks > 1}


@dataclass(frozen=True)
class Sharding(StrategyView):
    """Data parallelism as the traced paths apply it to one rank: ``strategy.dp`` ranks, the
    options' ZeRO stage (:attr:`TrainingOptions.zero_stage`: 0 none, 1 optimizer states and
    fp32 masters, 2 + gradients, 3 + parameters) under ``options.framework`` (one of
    :data:`SHARDING_FRAMEWORKS`), with that framework's ``buffers``. Only ties the three
    together; every fact lives in its own vocabulary type."""

    strategy: ParallelStrategy = SINGLE_GPU
    options: TrainingOptions = TORCH_OPTIONS
    buffers: CommBuffers = field(default_factory=CommBuffers)

    def __post_init__(self) -> None:
        s = self.strategy
        if (s.tp, s.pp, s.cp) != (1, 1, 1):
            raise ShardingError(f"strategy {s.name}: the traced path runs data parallelism "
                                "only (tp=pp=cp=1)")
        if self.framework not in SHARDING_FRAMEWORKS:
            raise ShardingError(f"framework={self.framework!r}: the traced path models "
                                f"{SHARDING_FRAMEWORKS}")
        if problem := unmodelled_zero(self.options):
            raise ShardingError(problem)

    @property
    def framework(self) -> str:
        return self.options.framework

    def describe(self) -> str:
        if self.dp == 1:
            return "one GPU"
        return f"{self.framework} dp={self.dp} zero={self.zero}"

    def effective_optimizer(self, opt: OptimizerSpec) -> OptimizerSpec:
        """``opt`` as the framework steps it: DeepSpeed's and Megatron's own fused kernels
        (in place, no temporaries) where :func:`framework_impl` names one, else as given (not
        named: torch's default, :data:`optimizers.TORCH_IMPL`). Another implementation named
        explicitly is refused, naming the field (:func:`unrun_impl`)."""
        if own := unrun_impl(self.framework, opt):
            raise ShardingError(f"optimizer '{opt.name}:{opt.impl}' with "
                                f"framework={self.framework!r}: {own}, which the traced path "
                                f"prices; give the optimizer without ':{opt.impl}' "
                                f"('{opt.name}')")
        return replace(opt, impl=opt.impl or framework_impl(self.framework, opt.name)
                       or TORCH_IMPL)

    def nccl(self) -> dict[str, int]:
        """NCCL's buffers by communicator (:func:`nccl_communicators`: tp = pp = 1 here, so the
        data-parallel one, Megatron's and DeepSpeed's world group's and Megatron's distributed
        optimizer's), with this framework's buffer sizes."""
        return nccl_communicators(self.strategy, self.options, self.buffers)

    @property
    def changes_step(self) -> bool:
        """Whether the framework changes what the traced single-GPU step holds: beyond one
        rank, and at one rank too under Megatron (its gradient buffer, :func:`grad_buffers`)
        and DeepSpeed (its buckets, :func:`deepspeed_buckets`)."""
        return self.dp > 1 or self.framework == "megatron" or runs_deepspeed_engine(self.options)

    def sharding_adjustment(self, live: dict[str, int], grad_tensors: Sequence[int],
                            opt: OptimizerSpec,
                            precision: str, peak_phase: str = "",
                            module_tensors: list[list[int]] | None = None, *,
                            peak_allocated: int, peaks_without_gradients: dict[str, int]
                            ) -> tuple[dict, list[str]]:  # fmt: skip
        """Bytes ZeRO removes from (and bucket buffers add to) one rank's traced single-GPU
        peak breakdown ``live`` (labels of :mod:`tracker`; ``peak_allocated`` its total).
        Returns ``({"delta": bytes, "buffers": {name: bytes}}, notes)``; sharding is applied
        to the traced breakdown, it is not itself traced. ``grad_tensors``: the elements of
        each trainable parameter, in order (what the framework's gradient buffers hold,
        :func:`grad_buffers`, and DeepSpeed's ZeRO-0 buckets, :func:`deepspeed_buckets`);
        ``module_tensors``: per module, its parameter tensors' bytes (ZeRO-3 gathers one
        module at a time; :mod:`zero`); ``peaks_without_gradients``: per phase, the trace's
        most bytes live at once outside its gradients (``.grad`` and fp32 master gradients),
        what a buffer that replaces them (:func:`replaces_gradients`) adds to."""
        if not self.changes_step:
            return {"delta": 0, "buffers": {}}, []
        d = self.dp
        keep = 1 / d
        grad_params = sum(grad_tensors)
        buffers = grad_buffers(self, grad_params, precision)
        params = live.get("parameter", 0)
        grads = live.get("gradient", 0)
        delta = 0
        elem = get_precision(precision).param_dtype.itemsize
        replaced = replaces_gradients(self, precision)
        cast = step_copy(self, grad_tensors, precision, opt.name)
        if replaced:  # Megatron at zero <= 1 (__post_init__), DeepSpeed's BF16_Optimizer
            # the buffers, live from wrap time, hold the gradients: none of the traced ones
            # (.grad, fp32 master gradients) is held, so the step peaks at its highest moment
            # without them (not necessarily the traced peak's), plus the optimizer's fp32
            # cast of the buffer while it steps
            delta += max(v + (cast if phase == "optimizer" else 0)
                         for phase, v in peaks_without_gradients.items()) - peak_allocated
        elif cast:  # DeepSpeed's FP16_Optimizer
            # its step holds every fp16 .grad beside its fp32 copies, where the traced step
            # casts and frees them one at a time: beside the step's highest moment without
            # the traced gradients (the other phases as traced)
            step = peaks_without_gradients.get("optimizer", 0) + grad_params * elem + cast
            delta += max(step - peak_allocated, 0)
        if self.zero >= 1 or bf16_optimizer(self, precision):
            # BF16_Optimizer keeps the masters and states of its 1/dp partition (grad_buffers)
            delta -= int(live.get("optimizer_state", 0) * (1 - keep))
            if peak_phase == "optimizer":  # foreach temporaries cover the shard only
                delta -= int(live.get("temporary", 0) * (1 - keep))
        if runs_deepspeed_engine(self.options) and self.zero >= 2:
            delta -= int(grads * (1 - keep))
        buffers.update(deepspeed_buckets(self, params, precision, self.buffers, grad_tensors))
        if self.zero == 3:  # DeepSpeed's: the others' are refused (unmodelled_zero)
            z3 = zero3_params(module_tensors or [[params]], d, elem, self.buffers.prefetch_bucket)
            delta -= params - z3.shard - z3.persistent
            buffers["ds_stage3_gathered_module"] = z3.gathered
            buffers["ds_prefetch_bucket"] = z3.prefetch
        delta += sum(buffers.values())
        notes = [f"{self.framework} ZeRO-{self.zero} over dp={d} applied to the traced "
                 "single-GPU breakdown (bucket sizes from the framework's documented "
                 "defaults; sharding is modelled, not traced)"]
        if replaced:
            notes.append(f"{self.framework}'s gradient buffers hold the gradients: the traced "
                         ".grad tensors are not held (the breakdown is the traced peak's)")
        elif cast:
            notes.append("DeepSpeed's FP16_Optimizer steps a flat fp32 copy of the gradients, "
                         "cast in one list beside every fp16 .grad (the breakdown is the "
                         "traced peak's)")
        return {"delta": delta, "buffers": buffers}, notes

