"""Device-level memory: what ``nvidia-smi`` shows beyond the caching allocator, and the
buffers of distributed training (data parallelism, ZeRO, Megatron's distributed optimizer).

* Inside the allocator (so inside ``max_memory_reserved``): cuBLAS workspaces (traced, see
  :mod:`overheads`), cuDNN convolution workspaces (traced, :mod:`tracker`), DDP gradient
  buckets, DeepSpeed ZeRO reduce / all-gather buckets and stage-3 live parameters.
* Outside it: the CUDA context with the kernels of the loaded libraries, and NCCL's
  communication buffers (NCCL allocates them with ``cudaMalloc`` itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..devices import get_device as get_compute_device
from ..spec.options import TrainingOptions
from ..spec.precision import get_precision
from ..spec.strategy import ParallelStrategy
from .allocator import MiB
from .config import SINGLE_GPU, ShardingError, StrategyView
from .optimizers import OptimizerSpec
from .overheads import CONTEXTS, HOPPER, PRE_HOPPER, CudaOverheads
from .zero import zero3_params


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    capacity: int  # bytes nvidia-smi reports as total
    overheads: CudaOverheads

    def outside_allocator(self, dist: Sharding) -> dict[str, int]:
        return {"cuda_context": self.overheads.context_bytes,
                "nccl_buffers": dist.nccl_bytes()}


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
# "pytorch" is torch DDP (ZeRO-1 via ZeroRedundancyOptimizer), "deepspeed" its ZeRO with the
# documented defaults of CommBuffers, "megatron" its distributed optimizer (ZeRO-1 over a
# contiguous gradient buffer)
SHARDING_FRAMEWORKS = ("pytorch", "deepspeed", "megatron")
# The options of a plain PyTorch step (torch DDP where dp > 1): the traced paths' default
TORCH_OPTIONS = TrainingOptions(framework="pytorch")
# The optimizers (optimizers.OPTIMIZERS) a framework steps with its own fused kernel whatever
# implementation the script's optimizer would pick: Megatron builds Transformer Engine's (else
# Apex's) FusedAdam and FusedSGD (megatron/core/optimizer/__init__.py); DeepSpeed its FusedAdam
# for an Adam or AdamW "optimizer" config section (the DeepSpeed the traced paths model; another
# type is the torch optimizer of that name, as given). torch DDP steps the script's optimizer.
FRAMEWORK_FUSED = {"megatron": ("adam", "adamw", "sgd"), "deepspeed": ("adam", "adamw")}


def framework_impl(framework: str, optimizer: str) -> str | None:
    """The implementation (:data:`optimizers.IMPLEMENTATIONS`) ``framework`` steps
    ``optimizer`` (a name of :data:`optimizers.OPTIMIZERS`) with on the traced paths whatever
    the script asks, or None: the one asked (:data:`FRAMEWORK_FUSED`). The one rule of
    :meth:`Sharding.effective_optimizer` and of ``predict memory``'s refusal of another
    implementation given explicitly."""
    return "fused" if optimizer in FRAMEWORK_FUSED.get(framework, ()) else None


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


def grad_buffers(framework: str, zero: int, dp: int, grad_bytes: int) -> dict[str, int]:
    """The gradient buffers ``framework`` allocates once, when it wraps the model for ``dp``
    ranks at ZeRO stage ``zero``: each as large as every trainable gradient (``grad_bytes``,
    not the gradients live at the step's peak) and live in every phase. torch DDP's flat
    buckets at ZeRO 0/1 (``gradient_as_bucket_view=False``: the reducer's
    ``initialize_buckets`` allocates every bucket, the backward copies each gradient in), and
    Megatron's contiguous main-grad buffer. The one implementation for the traced paths
    (:class:`Sharding`) and a preset's analytical model (``api.predict_peak_memory``)."""
    if dp == 1:
        return {}
    if framework == "pytorch" and zero < 2:
        return {"ddp_grad_buckets": grad_bytes}
    if framework == "megatron":
        return {"megatron_grad_buffer": grad_bytes}
    return {}


def nccl_bytes(dp: int, buffers: CommBuffers | None = None) -> int:
    """NCCL's buffers for one communicator over ``dp`` ranks (outside the caching allocator:
    NCCL allocates them with ``cudaMalloc``): each channel keeps a send and a receive buffer of
    ``NCCL_BUFFSIZE`` per ring neighbour for the Simple protocol, plus LL (1/8) and LL128
    (~9/8) buffers (NCCL docs, NCCL_BUFFSIZE / NCCL_PROTO)."""
    if dp == 1:
        return 0
    b = buffers or CommBuffers()
    per_channel = 2 * b.nccl_buffsize * (1 + 1 / 8 + 9 / 8)
    return int(b.nccl_channels * per_channel)


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
        if self.framework == "megatron" and self.zero > 1:
            raise ShardingError("framework='megatron' shards optimizer states only (zero<=1)")

    @property
    def framework(self) -> str:
        return self.options.framework

    def describe(self) -> str:
        if self.dp == 1:
            return "one GPU"
        return f"{self.framework} dp={self.dp} zero={self.zero}"

    def effective_optimizer(self, opt: OptimizerSpec) -> OptimizerSpec:
        """``opt`` as the framework steps it: DeepSpeed's and Megatron's own fused kernels
        (in place, no temporaries) where :func:`framework_impl` names one, else as given."""
        impl = framework_impl(self.framework, opt.name)
        return opt if impl in (None, opt.impl) else replace(opt, impl=impl)

    def nccl_bytes(self) -> int:
        """NCCL's buffers for the data-parallel communicator (:func:`nccl_bytes`)."""
        return nccl_bytes(self.dp, self.buffers)

    def sharding_adjustment(self, live: dict[str, int], grad_bytes: int, opt: OptimizerSpec,
                            precision: str, peak_phase: str = "",
                            module_tensors: list[list[int]] | None = None
                            ) -> tuple[dict, list[str]]:  # fmt: skip
        """Bytes ZeRO removes from (and bucket buffers add to) one rank's traced single-GPU
        peak breakdown ``live`` (labels of :mod:`tracker`). Returns ``({"delta": bytes,
        "buffers": {name: bytes}}, notes)``; sharding is applied to the traced breakdown, it
        is not itself traced. ``grad_bytes``: every trainable gradient's bytes (what the
        framework's gradient buffers copy, :func:`grad_buffers`); ``module_tensors``: per
        module, its parameter tensors' bytes (ZeRO-3 gathers one module at a time;
        :mod:`zero`)."""
        if self.dp == 1:
            return {"delta": 0, "buffers": {}}, []
        d = self.dp
        keep = 1 / d
        buffers = grad_buffers(self.framework, self.zero, d, grad_bytes)
        params = live.get("parameter", 0)
        grads = live.get("gradient", 0)
        delta = 0
        elem = get_precision(precision).param_dtype.itemsize
        if self.zero >= 1:
            delta -= int(live.get("optimizer_state", 0) * (1 - keep))
            if peak_phase == "optimizer":  # foreach temporaries cover the shard only
                delta -= int(live.get("temporary", 0) * (1 - keep))
        if self.framework == "deepspeed" and self.zero >= 2:
            delta -= int(grads * (1 - keep))
            # stage_1_and_2.py allocates its contiguous-gradient (ipg) buffer at the full
            # reduce_bucket_size whatever the model size, a second one with overlap_comm;
            # stage 3 keeps one flat ipg buffer
            overlap = (self.buffers.overlap_comm if self.buffers.overlap_comm is not None
                       else self.zero == 3)
            n = 2 if overlap and self.zero == 2 else 1
            buffers["ds_reduce_bucket"] = int(n * self.buffers.reduce_bucket * elem)
        if self.framework == "deepspeed" and self.zero == 1:
            # the all-gather of updated parameters works in allgather_bucket_size pieces
            buffers["ds_allgather_bucket"] = int(min(self.buffers.allgather_bucket * elem,
                                                     max(params, elem)))
        if self.zero == 3:
            if self.framework != "deepspeed":
                raise ShardingError(f"zero=3 needs framework='deepspeed' (got "
                                    f"{self.framework!r})")
            z3 = zero3_params(module_tensors or [[params]], d, elem, self.buffers.prefetch_bucket)
            delta -= params - z3.shard - z3.persistent
            buffers["ds_stage3_gathered_module"] = z3.gathered
            buffers["ds_prefetch_bucket"] = z3.prefetch
        delta += sum(buffers.values())
        notes = [f"{self.framework} ZeRO-{self.zero} over dp={d} applied to the traced "
                 "single-GPU breakdown (bucket sizes from the framework's documented "
                 "defaults; sharding is modelled, not traced)"]
        return {"delta": delta, "buffers": buffers}, notes

