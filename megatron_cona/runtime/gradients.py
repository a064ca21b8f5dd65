"""Gradient measurements of one iteration for the gradient noise scale.

``state.pre_reduction_hooks`` (callables ``hook(state, model_chunks)``) run after the last
backward and BEFORE the data-parallel gradient reduction (``config.finalize_model_grads_func``
is wrapped by :func:`finalize_with_hooks`); ``param.main_grad`` then holds this replica's
gradient of its local mean loss. Norms are unscaled (fp16 loss scale removed) and count
tensor-parallel duplicates and the pipeline's tied embedding copy once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core.distributed.finalize_model_grads import finalize_model_grads

if TYPE_CHECKING:
    from megatron_cona.runtime.state import TrainState


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def finalize_with_hooks(state: TrainState, model_chunks, num_tokens, pg_collection=None,
                         force_all_reduce=False):
    for hook in state.pre_reduction_hooks:
        hook(state, model_chunks)
    if state._collect.get("local"):
        state._collect["local_sq"] = replica_grad_sq_norm(state)
    finalize_model_grads(model_chunks, num_tokens, pg_collection=pg_collection,
                         force_all_reduce=force_all_reduce)


def replica_grad_sq_norm(state: TrainState) -> float:
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
    total = total.to(device())
    dist.all_reduce(total, group=state.groups.pg.mp)
    return float(total) / scale**2


