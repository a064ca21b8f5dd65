"""Gradient measurements of one iteration for the gradient noise scale.

``state.pre_reduction_hooks`` (callables ``hook(state, model_chunks)``) run after the last
backward and BEFORE the data-parallel gradient reduction (``config.finalize_model_grads_func``
is wrapped by :func:`finalize_with_hooks`); ``param.main_grad`` then holds this replica's
gradient of its local mean loss. The norm convention is :mod:`megatron_cona.grad_probe`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron.core.distributed.finalize_model_grads import finalize_model_grads

from megatron_cona.grad_probe import ProbeGroups, grad_sq_norm

if TYPE_CHECKING:
    from megatron_cona.runtime.state import TrainState


def finalize_with_hooks(state: TrainState, model_chunks, num_tokens, pg_collection=None,
                         force_all_reduce=False):
    for hook in state.pre_reduction_hooks:
        hook(state, model_chunks)
    state.probe.before_reduction(lambda: replica_grad_sq_norm(state))
    finalize_model_grads(model_chunks, num_tokens, pg_collection=pg_collection,
                         force_all_reduce=force_all_reduce)


def probe_groups(state: TrainState) -> ProbeGroups:
    core = state.core_model
    tied = core.share_embeddings_and_output_weights and state.strategy.pp > 1
    return ProbeGroups(state.groups.coord.tp, state.groups.pg.mp,
                       state.groups.pg.embd if tied else None, state.groups.is_first_stage)


def replica_grad_sq_norm(state: TrainState) -> float:
    """Squared norm of this DP replica's current (unreduced) gradient over the whole model."""
    return grad_sq_norm(state.core_model.named_parameters(), probe_groups(state),
                        loss_scale=float(state.optimizer.get_loss_scale()))
