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

import math
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


def local_grad_sq(named_params: Iterable[tuple[str, torch.Tensor]], groups: ProbeGroups
                  ) -> tuple[float, torch.Tensor | None]:
    """This rank's part of the squared norm, without any collective (safe inside autograd):
    the sum over its parameters by the convention above, and a copy of its tied embedding's
    gradient (None when untied) for :func:`reduce_grad_sq` to combine across stages."""
    tied = groups.embd_group is not None
    total = 0.0
    tied_grad = None
    for name, p in named_params:
        g = getattr(p, "main_grad", None)
        if g is None:
            continue
        if _is_tied(name, p, tied):
            tied_grad = g.detach().clone()
            continue
        if groups.tp_rank != 0 and not getattr(p, "tensor_model_parallel", False):
            continue
        total += float(g.double().pow(2).sum())
    return total, tied_grad


def reduce_grad_sq(local: float, tied_grad: torch.Tensor | None, groups: ProbeGroups, *,
                   loss_scale: float = 1.0, reduced: bool = False) -> float:
    """The whole model's squared norm from every rank's :func:`local_grad_sq` (collective over
    the model-parallel group, and the embedding group when tied). ``reduced``: the
    data-parallel reduction already ran (tied copies already summed)."""
    total = torch.tensor(local, dtype=torch.float64)
    if groups.embd_group is not None:
        if tied_grad is not None and not reduced:
            dist.all_reduce(tied_grad, group=groups.embd_group)
        if tied_grad is not None and groups.is_first_stage:
            total += tied_grad.double().pow(2).sum().cpu()
    total = total.to(device())
    dist.all_reduce(total, group=groups.mp_group)
    return float(total) / float(loss_scale) ** 2


def grad_sq_norm(named_params: Iterable[tuple[str, torch.Tensor]], groups: ProbeGroups, *,
                 loss_scale: float = 1.0, reduced: bool = False) -> float:
    """Squared norm of the current gradient over the whole model (see module doc; collective).
    ``reduced``: the data-parallel reduction already ran (tied copies already summed)."""
    return reduce_grad_sq(*local_grad_sq(named_params, groups), groups, loss_scale=loss_scale,
                          reduced=reduced)


@dataclass
class GradProbe:
    """One iteration's gradient readings of this rank: the local (pre-reduction) squared norm
    and, with >= 2 micro-batches, the first micro-batch's (the small batch when DP = 1), on
    every pipeline depth.

    The first micro-batch's reading: the output of this rank's second forward gets an autograd
    hook; it fires when that micro-batch's backward starts on this rank, after the first
    micro-batch's backward has finished (1F1B and the no-pipelining schedule run a stage's
    backwards in order), so ``main_grad`` then holds the first micro-batch's gradient on every
    stage. The hook only reads this rank's part (no collective inside autograd);
    :meth:`before_reduction` combines the parts over the pipeline and tensor groups. A loop
    calls :meth:`start` before the iteration, :meth:`after_forward` with every micro-batch's
    forward output (or :meth:`attach` to a module) and :meth:`before_reduction` before the DP
    reduction. Not for interleaved (virtual) pipelines, whose backwards interleave chunks."""

    local: bool = False  # measure the local norm this iteration
    first_micro: bool = False  # measure the first micro-batch's norm this iteration
    local_sq: float | None = None
    first_micro_sq: float | None = None
    forwards: int = 0
    num_microbatches: int = 1
    _first_parts: tuple[float, torch.Tensor | None] | None = None

    def start(self, measure: bool, strategy: ParallelStrategy) -> None:
        self.local = measure
        self.first_micro = measure and strategy.num_microbatches > 1
        self.num_microbatches = strategy.num_microbatches
        self.local_sq = self.first_micro_sq = self._first_parts = None
        self.forwards = 0

    def after_forward(self, output, parts: Callable[[], tuple[float, torch.Tensor | None]]
                      ) -> None:
        """A training forward finished with ``output``; ``parts`` reads this rank's
        :func:`local_grad_sq`."""
        if not self.first_micro or not torch.is_grad_enabled():
            return
        self.forwards += 1
        tensor = output[0] if isinstance(output, (tuple, list)) else output
        if self.forwards == 2 and isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            def read(grad):
                if self._first_parts is None:
                    self._first_parts = parts()
            tensor.register_hook(read)

    def attach(self, module: torch.nn.Module,
               parts: Callable[[], tuple[float, torch.Tensor | None]]):
        """Read every forward of ``module`` (a loop whose forward step is not ours, e.g.
        Megatron-LM's); returns the hook handle."""
        return module.register_forward_hook(lambda m, args, out: self.after_forward(out, parts))

    def before_reduction(self, parts: Callable[[], tuple[float, torch.Tensor | None]],
                         reduce: Callable[[float, torch.Tensor | None], float]) -> None:
        """After the last backward, before the DP reduction (collective over the model-
        parallel group when measuring): the local and the first micro-batch's norms."""
        if self.local:
            self.local_sq = reduce(*parts())
        if self.first_micro:
            # main_grad held the first micro-batch's gradient scaled by 1/num_microbatches
            first = self._first_parts if self._first_parts is not None else (math.nan, None)
            self.first_micro_sq = reduce(*first) * self.num_microbatches**2
        self._first_parts = None
        self.forwards = 0


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
