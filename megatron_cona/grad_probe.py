"""The one gradient probe: the squared norm of a model's current gradient, with the norm
convention every CONA loop shares (the runtime's pre-reduction hook and the Megatron-LM hook);
:class:`GradProbe` holds one iteration's readings (the local, first-micro-batch and squared-norm
values) and :func:`gather_grad_stats` turns them into :class:`~megatron_cona.gns.GradStats` for
both loops.

Convention (Megatron's own grad-norm convention): ``main_grad`` of every parameter, unscaled by
the fp16 loss scale; tensor-parallel duplicates (parameters not split across TP) counted once
(on TP rank 0); the pipeline's tied word embedding / output weight counted once -- before the
data-parallel reduction its two copies hold partial gradients and are summed first, after the
reduction (``finalize_model_grads`` all-reduces them) they are equal and the first stage's is
counted. Collective over the model-parallel group (and the embedding group when tied).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_cona.gns import GradStats
from predictors.spec import ParallelStrategy

TIED_NAMES = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True)
class ProbeGroups:
    """Where this rank sits: what the convention needs to know."""

    tp_rank: int
    mp_group: object  # tensor x pipeline model-parallel group
    embd_group: object | None  # first + last pipeline stage (tied embedding), None when untied
    is_first_stage: bool


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def _is_tied(name: str, param: torch.Tensor, tied: bool) -> bool:
    return tied and (getattr(param, "shared_embedding", False) or name.endswith(TIED_NAMES))


def grad_sq_norm(named_params: Iterable[tuple[str, torch.Tensor]], groups: ProbeGroups, *,
                 loss_scale: float = 1.0, reduced: bool = False) -> float:
    """Squared norm of the current gradient over the whole model (see module doc).
    ``reduced``: the data-parallel reduction already ran (tied copies already summed)."""
    tied = groups.embd_group is not None
    total = torch.zeros((), dtype=torch.float64)
    tied_grad = None
    for name, p in named_params:
        g = getattr(p, "main_grad", None)
        if g is None:
            continue
        if _is_tied(name, p, tied):
            tied_grad = g
            continue
        if groups.tp_rank != 0 and not getattr(p, "tensor_model_parallel", False):
            continue
        total += g.double().pow(2).sum().cpu()
    if tied:
        summed = tied_grad.clone() if tied_grad is not None else None
        if summed is not None and not reduced:
            dist.all_reduce(summed, group=groups.embd_group)
        if summed is not None and groups.is_first_stage:
            total += summed.double().pow(2).sum().cpu()
    total = total.to(device())
    dist.all_reduce(total, group=groups.mp_group)
    return float(total) / float(loss_scale) ** 2


@dataclass
class GradProbe:
    """One iteration's gradient readings of this rank: the local (pre-reduction) squared norm
    and, with one stage and >= 2 micro-batches, the first micro-batch's (the small batch when
    DP = 1). A loop calls :meth:`start` before the iteration, :meth:`before_forward` before every
    micro-batch's forward and :meth:`before_reduction` before the DP reduction."""

    local: bool = False  # measure the local norm this iteration
    first_micro: bool = False  # measure the first micro-batch's norm this iteration
    local_sq: float | None = None
    first_micro_sq: float | None = None
    forwards: int = 0

    def start(self, measure: bool, strategy: ParallelStrategy) -> None:
        self.local = measure
        self.first_micro = measure and strategy.pp == 1 and strategy.num_microbatches > 1
        self.local_sq = self.first_micro_sq = None
        self.forwards = 0

    def before_forward(self, sq_norm: Callable[[], float], num_microbatches: int) -> None:
        # the second forward starts after the first micro-batch's backward (PP = 1): the
        # accumulated gradient is then that micro-batch's, scaled by 1/num_microbatches
        if self.first_micro and self.forwards == 1:
            self.first_micro_sq = sq_norm() * num_microbatches**2
        self.forwards += 1

    def before_reduction(self, sq_norm: Callable[[], float]) -> None:
        if self.local:
            self.local_sq = sq_norm()


def gather_grad_stats(local_sq: float, global_sq: float, strategy: ParallelStrategy, dp_group,
                      first_micro_sq: float | None = None) -> GradStats:
    """Every replica's local squared norm gathered over ``dp_group`` (collective) with the
    reduced one: the iteration's :class:`GradStats`, as every CONA loop reports it."""
    mine = torch.tensor([local_sq], dtype=torch.float64, device=device())
    gathered = [torch.zeros_like(mine) for _ in range(strategy.dp)]
    dist.all_gather(gathered, mine, group=dp_group)
    local_batch = strategy.micro_batch * strategy.num_microbatches
    return GradStats([float(x) for x in gathered], local_batch, global_sq,
                     strategy.global_batch_size, first_microbatch_sq_norm=first_micro_sq,
                     micro_batch=strategy.micro_batch)
