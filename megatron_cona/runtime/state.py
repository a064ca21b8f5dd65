"""The per-rank training state of one parallel strategy, and how it is built (collective).

:func:`build_state` creates :class:`ParallelGroups` for the strategy (explicit groups, no global
``parallel_state``), ``GPTModel`` with the local (non-TE) layer spec, megatron-core
``DistributedDataParallel``, Adam via ``get_megatron_optimizer`` (optionally the
DistributedOptimizer; fp32, or bf16/fp16 weights with fp32 main params and, for fp16, a dynamic
grad scaler), ``OptimizerParamScheduler`` (counted in samples, like ``--train-samples``), the
RNG tracker (``model_parallel_cuda_manual_seed``) and the global micro-batch calculator.
"""

from __future__ import annotations

from collections.abc import Callable
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
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import unwrap_model

from megatron_cona.grad_probe import GradProbe, ProbeGroups, local_grad_sq, reduce_grad_sq
from megatron_cona.parallel import ParallelGroups, build_groups
from megatron_cona.runtime.config import TrainConfig
from predictors.spec import ParallelStrategy, StrategyError
from predictors.spec.precision import get_precision


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
    probe: GradProbe = field(default_factory=GradProbe, repr=False)  # this iteration's norms

    @property
    def core_model(self) -> GPTModel:
        return unwrap_model(self.model[0])

    # what megatron_cona.reshard needs to know about a model/optimizer set
    @property
    def tp_size(self) -> int:
        return self.strategy.tp

    @property
    def tp_rank(self) -> int:
        return self.groups.coord.tp

    @property
    def mixed_precision(self) -> bool:
        return get_precision(self.config.precision).is_mixed

    def destroy(self) -> None:
        """Release the process groups of this state (the tensors go with the object)."""
        self.groups.destroy()

    # the gradient probe's view of this state (megatron_cona.grad_probe's convention)
    def probe_groups(self) -> ProbeGroups:
        tied = self.core_model.share_embeddings_and_output_weights and self.strategy.pp > 1
        return ProbeGroups(self.groups.coord.tp, self.groups.pg.mp,
                           self.groups.pg.embd if tied else None, self.groups.is_first_stage)

    def grad_parts(self) -> tuple[float, torch.Tensor | None]:
        """This rank's part of its replica's current gradient's squared norm (no collective)."""
        return local_grad_sq(self.core_model.named_parameters(), self.probe_groups())

    def reduce_grad_parts(self, local: float, tied: torch.Tensor | None) -> float:
        """The replica's whole squared norm from every rank's parts, unscaled (collective)."""
        return reduce_grad_sq(local, tied, self.probe_groups(),
                              loss_scale=float(self.optimizer.get_loss_scale()))


def finalize_with_hooks(state: TrainState, model_chunks, num_tokens, pg_collection=None,
                        force_all_reduce=False):
    """megatron's ``finalize_model_grads`` with the probe and ``state.pre_reduction_hooks``
    (callables ``hook(state, model_chunks)``) run first: after the last backward and BEFORE
    the data-parallel reduction, when ``param.main_grad`` holds this replica's gradient of its
    local mean loss."""
    for hook in state.pre_reduction_hooks:
        hook(state, model_chunks)
    state.probe.before_reduction(state.grad_parts, state.reduce_grad_parts)
    finalize_model_grads(model_chunks, num_tokens, pg_collection=pg_collection,
                         force_all_reduce=force_all_reduce)



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
    tconfig.finalize_model_grads_func = partial(finalize_with_hooks, state)
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


