"""A megatron-core training state for one parallel strategy, and one training iteration on it.

Megatron-LM's ``pretrain()`` asserts CUDA and keeps model and optimizer as locals of ``train()``,
so CONA builds its loop from megatron-core's own pieces and keeps everything a strategy switch
must replace in one object, :class:`TrainState`:

* :func:`build_state` (collective) — :class:`ParallelGroups` for the strategy (explicit groups, no
  global ``parallel_state``), ``GPTModel`` with the local (non-TE) layer spec, megatron-core
  ``DistributedDataParallel``, Adam via ``get_megatron_optimizer`` (optionally the
  DistributedOptimizer; fp32, or bf16/fp16 weights with fp32 main params and, for fp16, a dynamic
  grad scaler), ``OptimizerParamScheduler`` (counted in samples, like ``--train-samples``), the
  RNG tracker (``model_parallel_cuda_manual_seed``) and the global micro-batch calculator.
* :func:`train_step` (collective) — one iteration with ``get_forward_backward_func`` (1F1B
  pipeline schedule when PP > 1) over the next ``global_batch`` samples of a
  :class:`TokenDataset`; returns a :class:`StepResult` with the loss (global token mean), the
  grad norm (post-reduction, pre-clip) and optional :class:`GradStats`.

Data position: ``state.consumed_samples`` is the only data-iterator state.  Step ``k`` reads
samples ``[consumed, consumed + global_batch)``; micro-batch ``m`` of DP rank ``d`` reads
``consumed + m*dp*mb + d*mb + [0, mb)`` (megatron's pretraining sampler order), so a switch only
has to carry the integer.

Gradient statistics for CONA's gradient-noise-scale estimate:

* ``state.pre_reduction_hooks``: callables ``hook(state, model_chunks)`` run after the last
  backward and BEFORE the data-parallel gradient reduction (``config.finalize_model_grads_func``
  is wrapped); ``param.main_grad`` then holds this replica's gradient of its local mean loss.
* ``train_step(..., grad_stats=True)`` fills ``StepResult.grad_stats``: every replica's squared
  norm of its local gradient (batch ``mb * num_microbatches``), the global squared norm after
  reduction (batch ``global_batch``) and, when PP == 1 and there are >= 2 micro-batches, the
  squared norm of the first micro-batch's gradient (batch ``mb``: the estimate for DP == 1).
  Norms are unscaled (fp16 loss scale removed) and count tensor-parallel duplicates and the
  pipeline's tied embedding copy once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import num_microbatches_calculator as mbc
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import unwrap_model

from megatron_cona.parallel import ParallelGroups, build_groups, megatron_globals
from predictors.precision import get_precision
from predictors.spec import ParallelStrategy, StrategyError, TransformerSpec

SUPPORTED_PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")


@dataclass(frozen=True)
class TrainConfig:
    """Everything about a run that does not depend on the parallel strategy."""

    model: TransformerSpec
    precision: str = "fp32"  # one of SUPPORTED_PRECISIONS (names of predictors.precision)
    distributed_optimizer: bool = False
    lr: float = 1e-3
    min_lr: float = 0.0
    lr_warmup_samples: int = 0
    lr_decay_samples: int = 1_000_000
    lr_decay_style: str = "cosine"
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    initial_loss_scale: float = 2.0**16  # fp16 dynamic loss scaling
    dropout: float = 0.0
    init_method_std: float = 0.02
    seed: int = 1234
    ddp_bucket_size: int | None = None  # elements per DDP bucket; None: megatron's default
    # Vocab is padded to a multiple of this times the WORLD size (not TP): every layout of the
    # world then has the same padded embedding shape, so weights move without re-padding.
    make_vocab_size_divisible_by: int = 128

    def __post_init__(self) -> None:
        get_precision(self.precision)  # unknown name -> UnknownPrecisionError naming it
        if self.precision not in SUPPORTED_PRECISIONS:
            raise ValueError(
                f"precision={self.precision!r} is not supported by the CONA runtime; use one of "
                f"{', '.join(SUPPORTED_PRECISIONS)}"
            )
        if self.model.family not in ("gpt", "llama"):
            raise ValueError(f"model.family={self.model.family!r}: the runtime builds GPTModel "
                             "(decoder-only: 'gpt' or 'llama')")

    @property
    def params_dtype(self) -> torch.dtype:
        return get_precision(self.precision).param_dtype

    def padded_vocab_size(self, world_size: int) -> int:
        multiple = self.make_vocab_size_divisible_by * world_size
        return math.ceil(self.model.vocab_size / multiple) * multiple


class TokenDataset:
    """Fixed-length training samples cut from one 1-D token tensor (sample i starts at i*seq).

    Sample ``i`` is ``seq_length + 1`` tokens (inputs + shifted labels), taken modulo the stream
    length so an epoch wraps around deterministically."""

    def __init__(self, tokens: torch.Tensor, seq_length: int) -> None:
        if tokens.dim() != 1 or tokens.numel() < seq_length + 1:
            raise ValueError(f"tokens must be 1-D with >= seq_length+1={seq_length + 1} entries, "
                             f"got shape {tuple(tokens.shape)}")
        self.tokens = tokens.long()
        self.seq_length = seq_length

    def samples(self, start: int, count: int) -> torch.Tensor:
        n, s = self.tokens.numel(), self.seq_length
        offsets = (torch.arange(start, start + count)[:, None] * s + torch.arange(s + 1)) % n
        return self.tokens[offsets]


@dataclass
class GradStats:
    """Squared gradient norms of one iteration (see module doc)."""

    local_sq_norms: list[float]  # one per DP replica, gradient of its local mean loss
    local_batch: int  # samples behind each local gradient
    global_sq_norm: float  # after DP reduction
    global_batch: int
    first_microbatch_sq_norm: float | None = None  # per replica 0's first micro-batch
    micro_batch: int = 1


@dataclass
class StepResult:
    iteration: int  # iterations done after this step
    consumed_samples: int
    loss: float
    grad_norm: float
    lr: float
    skipped: bool  # fp16 overflow: no update
    grad_stats: GradStats | None = None


@dataclass
class TrainState:
    """The per-rank training state of one strategy (see module doc)."""

    config: TrainConfig
    strategy: ParallelStrategy
    groups: ParallelGroups
    model: list[DistributedDataParallel]  # model chunks (one; no virtual pipeline)
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler
    transformer_config: TransformerConfig
    iteration: int = 0
    consumed_samples: int = 0
    pre_reduction_hooks: list[Callable[[TrainState, list], None]] = field(default_factory=list)
    _collect: dict = field(default_factory=dict, repr=False)

    @property
    def core_model(self) -> GPTModel:
        return unwrap_model(self.model[0])

    def destroy(self) -> None:
        """Release the process groups of this state (the tensors go with the object)."""
        self.groups.destroy()


def _skip_init(tensor: torch.Tensor) -> None:
    """Init method of a state whose weights a switch will overwrite: allocate, don't fill."""


def _transformer_config(cfg: TrainConfig, strategy: ParallelStrategy, initialize: bool
                        ) -> TransformerConfig:
    m, prec = cfg.model, get_precision(cfg.precision)
    # initialize=False keeps megatron's init path (it is what sets the tensor-parallel
    # attributes of weights) but with an init method that does nothing.
    skip = {} if initialize else {"init_method": _skip_init, "output_layer_init_method": _skip_init,
                                  "embedding_init_method": _skip_init}
    if "embedding_init_method" not in TransformerConfig.__dataclass_fields__:
        skip.pop("embedding_init_method", None)
    return TransformerConfig(
        **skip,
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn,
        gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else F.gelu,
        normalization="RMSNorm" if m.family == "llama" else "LayerNorm",
        add_bias_linear=m.family != "llama",
        tensor_model_parallel_size=strategy.tp,
        pipeline_model_parallel_size=strategy.pp,
        hidden_dropout=cfg.dropout,
        attention_dropout=cfg.dropout,
        init_method_std=cfg.init_method_std,
        params_dtype=prec.param_dtype,
        pipeline_dtype=prec.param_dtype,
        bf16=prec.param_dtype == torch.bfloat16,
        fp16=prec.param_dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        cross_entropy_loss_fusion=False,
        calculate_per_token_loss=False,
        deallocate_pipeline_outputs=False,
    )


def seed_rng(cfg: TrainConfig, groups: ParallelGroups, iteration: int) -> None:
    """Seed torch and megatron's RNG tracker for this layout (Megatron-LM's rule: +100 per PP
    stage; TP ranks get distinct model-parallel streams).  The seed depends on the iteration so
    a state rebuilt by a switch gets the same streams as one freshly built at that iteration."""
    seed = cfg.seed + 100 * groups.coord.pp + 7919 * iteration
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, tp_rank=groups.coord.tp, ep_rank=0, etp_rank=0,
                                    force_reset_rng=True)


def configure_microbatches(strategy: ParallelStrategy, consumed_samples: int) -> None:
    """(Re)configure megatron's global micro-batch calculator for ``strategy``."""
    args = dict(rank=dist.get_rank(), rampup_batch_size=None,
                global_batch_size=strategy.global_batch_size,
                micro_batch_size=strategy.micro_batch, data_parallel_size=strategy.dp,
                decrease_batch_size_if_needed=False)
    if mbc._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None:
        mbc.init_num_microbatches_calculator(**args)
    else:
        mbc.reconfigure_num_microbatches_calculator(**args)
    mbc.update_num_microbatches(consumed_samples, consistency_check=False)
    if mbc.get_num_microbatches() != strategy.num_microbatches:
        raise StrategyError(f"micro-batch calculator disagrees with strategy {strategy.name}")


def build_model(cfg: TrainConfig, strategy: ParallelStrategy, groups: ParallelGroups,
                initialize: bool = True) -> tuple[list[DistributedDataParallel], TransformerConfig]:
    tconfig = _transformer_config(cfg, strategy, initialize)
    m = cfg.model
    core = GPTModel(
        config=tconfig,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=tconfig.normalization),
        vocab_size=cfg.padded_vocab_size(strategy.world_size),
        max_sequence_length=m.seq_length,
        pre_process=groups.is_first_stage,
        post_process=groups.is_last_stage,
        share_embeddings_and_output_weights=m.tied_embeddings,
        position_embedding_type="rope" if m.family == "llama" else "learned_absolute",
        pg_collection=groups.pg,
    )
    if torch.cuda.is_available():
        core.cuda(torch.cuda.current_device())
    # As Megatron-LM's get_model(): half-precision runs wrap the model so that every module
    # (norms included) holds half weights and first/last-stage inputs/outputs are cast.
    wrapped = Float16Module(tconfig, core) if tconfig.bf16 or tconfig.fp16 else core
    ddp_kwargs = dict(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                      use_distributed_optimizer=cfg.distributed_optimizer)
    if cfg.ddp_bucket_size is not None:
        ddp_kwargs["bucket_size"] = cfg.ddp_bucket_size
    ddp = DistributedDataParallel(config=tconfig, ddp_config=DistributedDataParallelConfig(
        **ddp_kwargs), module=wrapped, pg_collection=groups.pg)
    return [ddp], tconfig


def build_optimizer(cfg: TrainConfig, model: list, groups: ParallelGroups
                    ) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    prec = get_precision(cfg.precision)
    ocfg = OptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad, bf16=prec.param_dtype == torch.bfloat16,
        fp16=prec.param_dtype == torch.float16, params_dtype=prec.param_dtype,
        initial_loss_scale=cfg.initial_loss_scale,
        use_distributed_optimizer=cfg.distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(ocfg, model, use_gloo_process_groups=False,
                                       pg_collection=groups.pg)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_samples, lr_decay_steps=cfg.lr_decay_samples,
        lr_decay_style=cfg.lr_decay_style, start_wd=cfg.weight_decay, end_wd=cfg.weight_decay,
        wd_incr_steps=cfg.lr_decay_samples, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=False,
    )
    return optimizer, scheduler


def build_state(cfg: TrainConfig, strategy: ParallelStrategy, *, iteration: int = 0,
                consumed_samples: int = 0, initialize: bool = True,
                groups: ParallelGroups | None = None, activate_now: bool = True) -> TrainState:
    """Build the full training state of ``strategy`` on the current world (collective).

    ``initialize=False`` skips weight initialization (a switch overwrites every weight);
    ``activate_now=False`` leaves the RNG and micro-batch calculator alone (see :func:`activate`).
    """
    strategy.check(dist.get_world_size(), cfg.model)
    _ensure_memory_buffer()
    own_groups = groups is None
    groups = groups or build_groups(strategy)
    try:
        # Seed before init too: TP replicas of non-split weights (position embeddings, norms)
        # must be initialized identically on every TP rank.
        seed_rng(cfg, groups, iteration)
        model, tconfig = build_model(cfg, strategy, groups, initialize)
        optimizer, scheduler = build_optimizer(cfg, model, groups)
    except Exception:
        if own_groups:
            groups.destroy()
        raise
    state = TrainState(cfg, strategy, groups, model, optimizer, scheduler, tconfig,
                       iteration=iteration, consumed_samples=consumed_samples)
    tconfig.finalize_model_grads_func = partial(_finalize_with_hooks, state)
    tconfig.no_sync_func = model[0].no_sync
    tconfig.grad_scale_func = optimizer.scale_loss
    if activate_now:
        activate(state)
    return state


def _ensure_memory_buffer() -> None:
    # The only layout-independent global megatron's local attention needs (a scratch buffer).
    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()


def activate(state: TrainState) -> None:
    """Make ``state`` the one that trains: RNG streams and the micro-batch calculator."""
    seed_rng(state.config, state.groups, state.iteration)
    configure_microbatches(state.strategy, state.consumed_samples)


# ---------------------------------------------------------------------------------------------
# one iteration


def _causal_mask(seq: int) -> torch.Tensor:
    return torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)


def _microbatches(state: TrainState, dataset: TokenDataset, start: int, count: int
                  ) -> Iterator[dict]:
    """``count`` micro-batches of this DP rank, reading samples from ``start`` on."""
    s = state.strategy
    seq = dataset.seq_length
    device = _device()
    mask = _causal_mask(seq).to(device)
    positions = torch.arange(seq, device=device)[None].expand(s.micro_batch, seq)
    for m in range(count):
        first = start + m * s.dp * s.micro_batch + state.groups.dp_rank * s.micro_batch
        batch = dataset.samples(first, s.micro_batch).to(device)
        yield {"tokens": batch[:, :-1], "labels": batch[:, 1:], "position_ids": positions,
               "attention_mask": mask, "loss_mask": torch.ones(s.micro_batch, seq, device=device)}


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float()
    loss_sum = (losses.view(-1) * loss_mask.view(-1)).sum()
    num_tokens = loss_mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(),
                                                          num_tokens.float()])}


def _forward_step(state: TrainState, data_iterator, model):
    batch = next(data_iterator)
    collect = state._collect
    if collect.get("first_mb") and collect.setdefault("calls", 0) == 1:
        collect["first_mb_sq"] = _replica_grad_sq_norm(state) * state.strategy.num_microbatches**2
    if "calls" in collect:
        collect["calls"] += 1
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def _finalize_with_hooks(state: TrainState, model_chunks, num_tokens, pg_collection=None,
                         force_all_reduce=False):
    for hook in state.pre_reduction_hooks:
        hook(state, model_chunks)
    if state._collect.get("local"):
        state._collect["local_sq"] = _replica_grad_sq_norm(state)
    finalize_model_grads(model_chunks, num_tokens, pg_collection=pg_collection,
                         force_all_reduce=force_all_reduce)


def _replica_grad_sq_norm(state: TrainState) -> float:
    """Squared norm of this DP replica's current (unreduced) gradient over the whole model."""
    core = state.core_model
    tp_rank = state.groups.coord.tp
    total = torch.zeros((), dtype=torch.float64)
    tied = None
    for name, p in core.named_parameters():
        g = getattr(p, "main_grad", None)
        if g is None:
            continue
        if getattr(p, "shared_embedding", False) or (
                core.share_embeddings_and_output_weights and state.strategy.pp > 1
                and name in ("embedding.word_embeddings.weight", "output_layer.weight")):
            tied = g  # the two pipeline copies hold partial gradients: sum them first
            continue
        if tp_rank != 0 and not getattr(p, "tensor_model_parallel", False):
            continue
        total += g.double().pow(2).sum().cpu()
    if state.strategy.pp > 1 and core.share_embeddings_and_output_weights:
        summed = tied.clone() if tied is not None else None
        if summed is not None:
            dist.all_reduce(summed, group=state.groups.pg.embd)
            if state.groups.is_first_stage:
                total += summed.double().pow(2).sum().cpu()
    scale = float(state.optimizer.get_loss_scale())
    total = total.to(_device())
    dist.all_reduce(total, group=state.groups.pg.mp)
    return float(total) / scale**2


def train_step(state: TrainState, dataset: TokenDataset, grad_stats: bool = False) -> StepResult:
    """Run one training iteration on every rank of the world (collective)."""
    with megatron_globals(state.groups):
        return _train_step(state, dataset, grad_stats)


def _train_step(state: TrainState, dataset: TokenDataset, grad_stats: bool) -> StepResult:
    s = state.strategy
    if dataset.seq_length != state.config.model.seq_length:
        raise ValueError(f"dataset.seq_length={dataset.seq_length} != model.seq_length="
                         f"{state.config.model.seq_length}")
    for chunk in state.model:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()
    state._collect = {"local": grad_stats,
                      "first_mb": grad_stats and s.pp == 1 and s.num_microbatches > 1}
    fwd_bwd = get_forward_backward_func(pp_size=s.pp, vp_size=None)
    losses = fwd_bwd(
        forward_step_func=partial(_forward_step, state),
        data_iterator=_microbatches(state, dataset, state.consumed_samples, s.num_microbatches),
        model=state.model,
        num_microbatches=s.num_microbatches,
        seq_length=state.config.model.seq_length,
        micro_batch_size=s.micro_batch,
        forward_only=False,
        pg_collection=state.groups.pg,
        **_p2p(state),
    )
    update_ok, grad_norm, _ = state.optimizer.step()
    if update_ok:
        state.scheduler.step(increment=s.global_batch_size)
    loss = _reduce_loss(state, losses)
    state.iteration += 1
    state.consumed_samples += s.global_batch_size
    stats = None
    if grad_stats:
        local = torch.tensor([state._collect["local_sq"]], dtype=torch.float64,
                             device=_device())
        gathered = [torch.zeros_like(local) for _ in range(s.dp)]
        dist.all_gather(gathered, local, group=state.groups.pg.dp)
        stats = GradStats(
            local_sq_norms=[float(x) for x in gathered],
            local_batch=s.micro_batch * s.num_microbatches,
            global_sq_norm=float(grad_norm) ** 2 if grad_norm is not None else float("nan"),
            global_batch=s.global_batch_size,
            first_microbatch_sq_norm=state._collect.get("first_mb_sq"),
            micro_batch=s.micro_batch,
        )
    state._collect = {}
    return StepResult(
        iteration=state.iteration, consumed_samples=state.consumed_samples, loss=loss,
        grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
        lr=state.optimizer.param_groups[0]["lr"], skipped=not update_ok, grad_stats=stats)


def evaluate(state: TrainState, dataset: TokenDataset, start: int, num_samples: int) -> float:
    """Token-mean loss of samples ``[start, start + num_samples)`` without updating anything
    (identical on every rank; collective).  ``num_samples`` must be a multiple of dp * mb."""
    s = state.strategy
    if num_samples <= 0 or num_samples % (s.dp * s.micro_batch):
        raise ValueError(f"num_samples={num_samples} must be a positive multiple of "
                         f"dp*micro_batch={s.dp * s.micro_batch}")
    count = num_samples // (s.dp * s.micro_batch)
    with torch.no_grad(), megatron_globals(state.groups):
        losses = get_forward_backward_func(pp_size=s.pp, vp_size=None)(
            forward_step_func=partial(_forward_step, state), data_iterator=_microbatches(state, dataset, start,
                                                                      count),
            model=state.model, num_microbatches=count, seq_length=dataset.seq_length,
            micro_batch_size=s.micro_batch, forward_only=True, pg_collection=state.groups.pg,
            **_p2p(state))
        return _reduce_loss(state, losses)


def _p2p(state: TrainState) -> dict:
    if state.strategy.pp == 1:
        return {}
    return {"p2p_communicator": P2PCommunicator(pp_group=state.groups.pg.pp,
                                                config=state.transformer_config)}


def _reduce_loss(state: TrainState, losses: list) -> float:
    """Global token-mean loss, identical on every rank."""
    total = torch.zeros(2, dtype=torch.float64, device=_device())
    if state.groups.is_last_stage:
        for item in losses:
            total += item["lm loss"].double()
        dist.all_reduce(total, group=state.groups.pg.dp)
    if state.strategy.pp > 1:
        last = state.groups.ranks["pp"][-1]
        dist.broadcast(total, src=last, group=state.groups.pg.pp)
    return float(total[0] / total[1])


def forward_logits(state: TrainState, tokens: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits ``[batch, seq, vocab]`` of ``tokens`` on the last pipeline stage
    (``None`` on other stages); collective over the world.  Used to check a reshard."""
    seq = tokens.shape[1]
    device = _device()
    batch = {"tokens": tokens.to(device),
             "position_ids": torch.arange(seq, device=device)[None].expand_as(tokens),
             "attention_mask": _causal_mask(seq).to(device)}

    def step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], b["attention_mask"])
        return out, lambda output, non_loss_data=True: output

    fwd_bwd = get_forward_backward_func(pp_size=state.strategy.pp, vp_size=None)
    with torch.no_grad(), megatron_globals(state.groups):
        out = fwd_bwd(forward_step_func=step, data_iterator=iter([batch]), model=state.model,
                      num_microbatches=1, seq_length=seq, micro_batch_size=tokens.shape[0],
                      forward_only=True, collect_non_loss_data=True,
                      pg_collection=state.groups.pg, **_p2p(state))
    if not state.groups.is_last_stage:
        return None
    logits = out[0].float()  # [b, s, v/tp]
    parts = [torch.empty_like(logits) for _ in range(state.strategy.tp)]
    dist.all_gather(parts, logits.contiguous(), group=state.groups.pg.tp)
    return torch.cat(parts, dim=-1)[..., : state.config.model.vocab_size].cpu()
