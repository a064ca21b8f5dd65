"""Framework settings of a training job: what overlaps, what is recomputed, which framework runs
it."""

from __future__ import annotations

from dataclasses import dataclass

from .strategy import StrategyError

# Activation recomputation as Megatron (--recompute-granularity) and torchtitan
# (activation_checkpoint.mode) name it: "full" re-runs every layer's forward in backward,
# "selective" re-runs what is cheap to recompute and costly to keep (attention and the
# elementwise ops; the GEMM outputs are kept)
RECOMPUTE_MODES = ("none", "selective", "full")
# What "selective" re-runs differs by framework: Megatron-Core's --recompute-granularity
# selective re-runs the core attention only (softmax(QK^T)V, --recompute-modules core_attn)
# and keeps every other output ("core_attention"); torchtitan's op-level selective AC
# (activation_checkpoint.selective_ac_option "op", its default) keeps the attention kernels'
# outputs and every odd-numbered matmul's of a layer and re-runs every other op
# (torchtitan/models/llama3/infra/parallelize.py: _save_list, _get_custom_policy) ("ops")
SELECTIVE_RECOMPUTE = {"torchtitan": "ops"}


def selective_recompute(framework: str) -> str:
    """What ``framework``'s selective recomputation re-runs (:data:`SELECTIVE_RECOMPUTE`, else
    Megatron-Core's core attention)."""
    return SELECTIVE_RECOMPUTE.get(framework, "core_attention")

# The training stack that runs the step: the same kernels on the same device reach different
# shares of peak under Megatron-Core (Transformer Engine, fused kernels), torchtitan (PyTorch
# FSDP2, torch.compile) and LLM Foundry (Composer, FSDP1), so kernel efficiencies are fitted
# per device family and framework (predictors.time.efficiency). "pytorch" is plain PyTorch
# (torch DDP over data parallelism): this project's own training step (predictors.step: eager
# PyTorch, no fused kernels), as the GPU kit times it. "deepspeed" is DeepSpeed's ZeRO (the
# memory predictor models its buffers; no time data of its own: the time predictor prices it
# at its device family's efficiencies, as any framework without a fit of its own)
FRAMEWORKS = ("megatron", "torchtitan", "llm-foundry", "pytorch", "deepspeed")


@dataclass(frozen=True)
class Fp8Kernels:
    """How a framework's fp8 linears run: whether the recipe covers the LM head too, and
    whether each fp8 operand's transposed copy (the backward GEMMs' layout) is written by the
    fused cast-transpose kernel or is a standalone transposing copy."""

    covers_head: bool = False
    fused_transpose: bool = True
    # run as predictors.autocast's Python emulation (a TorchFunctionMode that sees every torch
    # call, an autograd.Function per linear): more host work per kernel than the plain step
    python_emulation: bool = False
    # the recipe whose GEMM efficiency each per-tensor-scaled recipe (delayed, current) prices
    # at where the framework runs them through one GEMM call (None: each recipe its own)
    tensorwise_gemm: str | None = None


# Transformer Engine (Megatron-Core, LLM Foundry) and torchao under torch.compile (torchtitan):
# te.Linear / Float8Linear on the layers only, the transposes fused into the cast (the default).
# This project's eager step (predictors.autocast.Fp8LinearEmulation, as the GPU kit times it)
# turns every F.linear into fp8 GEMMs, the LM head included, and makes each transposed operand
# with a standalone ``.t().contiguous()`` copy, all under a Python emulation; its delayed and
# current scaling differ only in the casts (one ``torch._scaled_mm`` call for both)
FP8_KERNELS = {"pytorch": Fp8Kernels(covers_head=True, fused_transpose=False,
                                     python_emulation=True, tensorwise_gemm="fp8")}


def fp8_kernels(framework: str) -> Fp8Kernels:
    """The fp8 kernels ``framework`` runs (:data:`FP8_KERNELS`, else TE's)."""
    return FP8_KERNELS.get(framework, Fp8Kernels())


def foreach_temporaries(torch_version: str) -> int:
    """Parameter-sized fp32 temporaries of torch's foreach AdamW step under ``torch_version``
    (``"2.0.1"``, ``"2.1.2+cu121"``): 1 since torch 2.1 (pytorch/pytorch#104780), 2 before
    (``exp_avg_sq.sqrt()`` and ``denom``, pytorch/pytorch#97712). The value of
    :attr:`TrainingOptions.foreach_temporaries` for a job that runs that torch."""
    try:
        major, minor = (int(part) for part in torch_version.split(".")[:2])
    except ValueError:
        raise StrategyError(f"torch_version={torch_version!r} is not MAJOR.MINOR[.PATCH]") \
            from None
    return 2 if (major, minor) < (2, 1) else 1


@dataclass(frozen=True)
class TrainingOptions:
    """Framework settings that decide how much communication hides under compute (Megatron's
    flags of the same names). Defaults are Megatron's defaults."""

    overlap_grad_reduce: bool = False  # DP all-reduce per bucket during the last backward
    tp_comm_overlap: bool = False  # TP collectives overlapped with the layer's GEMMs
    virtual_pipeline: int = 1  # model chunks per pipeline stage (interleaved 1F1B)
    distributed_optimizer: bool = False  # ZeRO-1: reduce-scatter grads, all-gather params
    overlap_param_gather: bool = False  # the all-gather runs under the next forward
    # interleaved 1F1B: each chunk's pipeline sends/receives overlap the next chunk's compute
    # (Megatron-LM's default; --no-overlap-p2p-communication turns it off; without
    # interleaving Megatron runs them blocking whatever the flag says)
    overlap_p2p_comm: bool = True
    # Megatron's --sequence-parallel (required by its --tp-comm-overlap; torchtitan's TP plan
    # always): with tp > 1 the norms, dropout and residual adds run on seq / tp tokens
    sequence_parallel: bool = False
    # PyTorch FSDP FULL_SHARD / ZeRO-3 over the DP group: parameters all-gathered before each
    # micro-batch's forward and again before its backward, gradients reduce-scattered
    fsdp: bool = False
    # DeepSpeed ZeRO-2 on top of the distributed optimizer: gradients partitioned too, each
    # rank keeping only its shard (Megatron's distributed optimizer keeps the full gradient
    # buffer and reduce-scatters it; with this flag the memory predictor drops the rest)
    shard_gradients: bool = False
    recompute: str = "none"  # one of RECOMPUTE_MODES
    # torch.compile (Inductor): elementwise chains fused into fewer kernels
    compiled: bool = False
    framework: str = "megatron"  # one of FRAMEWORKS
    # Megatron-LM's --accumulate-allreduce-grads-in-fp32 (ddp_config.grad_reduce_in_fp32): the
    # gradient buffer in fp32. Off, as Megatron-LM's flag is; its --bf16 turns it on whatever
    # is given (validate_args), so it decides the buffer's dtype at fp16 weights only
    # (predictors.memory.device.megatron_grad_dtype); no other framework has the flag
    accumulate_allreduce_grads_in_fp32: bool = False
    # parameter-sized fp32 temporaries of torch's foreach AdamW where a framework steps it on
    # one flat tensor (DeepSpeed ZeRO without an "optimizer" config section: the HF Trainer's
    # AdamW); the torch version decides it: :func:`foreach_temporaries`
    foreach_temporaries: int = 1

    def __post_init__(self) -> None:
        if self.framework not in FRAMEWORKS:
            raise StrategyError(f"framework={self.framework!r} must be one of {FRAMEWORKS}")
        if self.recompute not in RECOMPUTE_MODES:
            raise StrategyError(f"recompute={self.recompute!r} must be one of {RECOMPUTE_MODES}")
        if self.accumulate_allreduce_grads_in_fp32 and self.framework != "megatron":
            raise StrategyError("accumulate_allreduce_grads_in_fp32=True is Megatron-LM's "
                                "--accumulate-allreduce-grads-in-fp32, which "
                                f"framework={self.framework!r} does not run; drop it or set "
                                "framework='megatron'")
        if self.foreach_temporaries < 0:
            raise StrategyError(f"foreach_temporaries={self.foreach_temporaries} must be >= 0")
        if self.virtual_pipeline < 1:
            raise StrategyError(f"virtual_pipeline={self.virtual_pipeline} must be >= 1")
        if self.fsdp and self.distributed_optimizer:
            raise StrategyError("fsdp=True and distributed_optimizer=True are two ZeRO modes; "
                                "choose one")
        if self.shard_gradients and not self.distributed_optimizer:
            raise StrategyError("shard_gradients=True (ZeRO-2) needs distributed_optimizer=True")
        if self.overlap_param_gather and not self.distributed_optimizer:
            raise StrategyError("overlap_param_gather=True needs distributed_optimizer=True")

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage these options amount to: 0 none, 1 optimizer states and fp32 masters
        sharded (distributed optimizer), 2 + gradients, 3 + parameters (FSDP)."""
        if self.fsdp:
            return 3
        return 2 if self.shard_gradients else int(self.distributed_optimizer)

    @classmethod
    def for_zero_stage(cls, stage: int, **kw) -> TrainingOptions:
        """Options of ZeRO stage ``stage`` (0-3; see :attr:`zero_stage`), other fields ``kw``."""
        if stage not in (0, 1, 2, 3):
            raise StrategyError(f"zero={stage} must be one of 0, 1, 2, 3")
        return cls(distributed_optimizer=stage in (1, 2), shard_gradients=stage == 2,
                   fsdp=stage == 3, **kw)


DEFAULT_OPTIONS = TrainingOptions()
