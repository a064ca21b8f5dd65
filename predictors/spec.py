"""Shared descriptions of a model and a parallel strategy.

Both the predictors and CONA speak these, so they live in the lowest layer (``predictors``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace


class StrategyError(ValueError):
    """A strategy that does not fit the world size, the model or the batch sizes."""


ATTENTION_IMPLS = ("flash", "unfused")
# Activation recomputation as Megatron (--recompute-granularity) and torchtitan
# (activation_checkpoint.mode) name it: "full" re-runs every layer's forward in backward,
# "selective" re-runs what is cheap to recompute and costly to keep (attention and the
# elementwise ops; the GEMM outputs are kept)
RECOMPUTE_MODES = ("none", "selective", "full")
# The training stack that runs the step: the same kernels on the same device reach different
# shares of peak under Megatron-Core (Transformer Engine, fused kernels), torchtitan (PyTorch
# FSDP2, torch.compile) and LLM Foundry (Composer, FSDP1), so kernel efficiencies are fitted
# per device family and framework (predictors.efficiency)
FRAMEWORKS = ("megatron", "torchtitan", "llm-foundry")


@dataclass(frozen=True)
class TransformerSpec:
    """A decoder (GPT/Llama-like) or encoder (BERT-like) transformer stack."""

    family: str  # "gpt" | "llama" | "bert" | ...
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    ffn_hidden_size: int | None = None  # default 4*hidden (gpt/bert) or SwiGLU 8/3*hidden
    num_query_groups: int | None = None  # GQA; None = multi-head
    swiglu: bool = False
    tied_embeddings: bool = True
    # "flash": one fused attention kernel (SDPA / flash-attn); "unfused": Megatron's classic
    # core attention (no --use-flash-attn): a [b*heads, s, s] scores GEMM, one fused
    # scale-mask-softmax kernel, dropout on the probabilities and a second batched GEMM
    attention: str = "flash"

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention={self.attention!r} must be one of {ATTENTION_IMPLS}")

    @property
    def ffn(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return 4 * self.hidden_size

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    def num_parameters(self) -> int:
        h, f, v = self.hidden_size, self.ffn, self.vocab_size
        head_dim = h // self.num_attention_heads
        attn = h * h + 2 * h * self.kv_heads * head_dim + h * h
        mlp = (3 if self.swiglu else 2) * h * f
        per_layer = attn + mlp + 4 * h
        emb = v * h * (1 if self.tied_embeddings else 2) + self.seq_length * h
        return self.num_layers * per_layer + emb


@dataclass(frozen=True)
class TrainingOptions:
    """Framework settings that decide how much communication hides under compute (Megatron's
    flags of the same names). Defaults are Megatron's defaults."""

    overlap_grad_reduce: bool = False  # DP all-reduce per bucket during the last backward
    tp_comm_overlap: bool = False  # TP collectives overlapped with the layer's GEMMs
    virtual_pipeline: int = 1  # model chunks per pipeline stage (interleaved 1F1B)
    distributed_optimizer: bool = False  # ZeRO-1: reduce-scatter grads, all-gather params
    overlap_param_gather: bool = False  # the all-gather runs under the next forward
    # PyTorch FSDP FULL_SHARD / ZeRO-3 over the DP group: parameters all-gathered before each
    # micro-batch's forward and again before its backward, gradients reduce-scattered
    fsdp: bool = False
    recompute: str = "none"  # one of RECOMPUTE_MODES
    # torch.compile (Inductor): elementwise chains fused into fewer kernels
    compiled: bool = False
    framework: str = "megatron"  # one of FRAMEWORKS

    def __post_init__(self) -> None:
        if self.framework not in FRAMEWORKS:
            raise StrategyError(f"framework={self.framework!r} must be one of {FRAMEWORKS}")
        if self.recompute not in RECOMPUTE_MODES:
            raise StrategyError(f"recompute={self.recompute!r} must be one of {RECOMPUTE_MODES}")
        if self.virtual_pipeline < 1:
            raise StrategyError(f"virtual_pipeline={self.virtual_pipeline} must be >= 1")
        if self.fsdp and self.distributed_optimizer:
            raise StrategyError("fsdp=True and distributed_optimizer=True are two ZeRO modes; "
                                "choose one")
        if self.overlap_param_gather and not self.distributed_optimizer:
            raise StrategyError("overlap_param_gather=True needs distributed_optimizer=True")


DEFAULT_OPTIONS = TrainingOptions()


@dataclass(frozen=True)
class ParallelStrategy:
    """DP x TP x PP (x CP) degrees plus micro- and global-batch sizes (in sequences).

    ``cp`` is context parallelism (Megatron ``--context-parallel-size``, torchtitan
    ``context_parallel_degree``): each of ``cp`` ranks holds ``seq_length / cp`` tokens of every
    sequence and attends to all of them (ring attention); the ranks of a CP group share the
    data-parallel batch, and gradients are reduced over DP x CP."""

    dp: int
    tp: int
    pp: int
    micro_batch: int = 1
    global_batch: int | None = None  # None: dp * micro_batch (one micro-batch per step)
    cp: int = 1

    _NAME = re.compile(r"^dp(\d+)tp(\d+)pp(\d+)(?:cp(\d+))?(?:mb(\d+))?(?:gb(\d+))?$")

    def __post_init__(self) -> None:
        for field in ("dp", "tp", "pp", "cp", "micro_batch"):
            if getattr(self, field) < 1:
                raise StrategyError(f"{field}={getattr(self, field)} must be >= 1")
        if self.global_batch is not None and self.global_batch % (self.dp * self.micro_batch):
            raise StrategyError(
                f"global_batch={self.global_batch} is not divisible by dp*micro_batch="
                f"{self.dp * self.micro_batch}"
            )

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def global_batch_size(self) -> int:
        return self.global_batch if self.global_batch is not None else self.dp * self.micro_batch

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.dp * self.micro_batch)

    @property
    def layout(self) -> tuple[int, int, int]:
        return (self.dp, self.tp, self.pp)

    @property
    def name(self) -> str:
        cp = f"cp{self.cp}" if self.cp > 1 else ""
        return f"dp{self.dp}tp{self.tp}pp{self.pp}{cp}mb{self.micro_batch}gb{self.global_batch_size}"

    def with_batch(self, micro_batch: int, global_batch: int) -> ParallelStrategy:
        return replace(self, micro_batch=micro_batch, global_batch=global_batch)

    @classmethod
    def parse(cls, text: str) -> ParallelStrategy:
        """Parse ``dp2tp2pp1`` (optionally ``...cp2mb2gb16``)."""
        m = cls._NAME.match(text.strip().lower())
        if not m:
            raise StrategyError(
                f"strategy {text!r} is not of the form dp<D>tp<T>pp<P>[cp<C>][mb<M>][gb<G>]")
        dp, tp, pp, cp, mb, gb = m.groups()
        return cls(int(dp), int(tp), int(pp), int(mb or 1), int(gb) if gb else None, int(cp or 1))

    def check(self, world_size: int, model: TransformerSpec | None = None) -> None:
        """Raise :class:`StrategyError` naming the field when this strategy cannot run."""
        if self.world_size != world_size:
            raise StrategyError(
                f"strategy {self.name}: dp*tp*pp*cp={self.world_size} != world_size={world_size}"
            )
        if model is None:
            return
        if model.num_attention_heads % self.tp or model.hidden_size % self.tp:
            raise StrategyError(
                f"strategy {self.name}: tp={self.tp} does not divide num_attention_heads="
                f"{model.num_attention_heads} and hidden_size={model.hidden_size}"
            )
        if model.kv_heads % self.tp:
            raise StrategyError(
                f"strategy {self.name}: tp={self.tp} does not divide num_query_groups={model.kv_heads}"
            )
        # ring attention splits each sequence into 2*cp chunks (two per rank, balancing the
        # causal mask's work), so 2*cp must divide it
        if self.cp > 1 and model.seq_length % (2 * self.cp):
            raise StrategyError(
                f"strategy {self.name}: cp={self.cp} needs 2*cp dividing seq_length="
                f"{model.seq_length}"
            )
        if self.cp > 1 and model.attention != "flash":
            raise StrategyError(
                f"strategy {self.name}: cp={self.cp} needs attention='flash' (ring attention "
                f"runs on fused attention kernels), not {model.attention!r}"
            )
        if model.num_layers % self.pp:
            raise StrategyError(
                f"strategy {self.name}: pp={self.pp} does not divide num_layers={model.num_layers}"
            )
