"""One training iteration (:func:`train_step`), evaluation and logits on a :class:`TrainState`.

Data position: ``state.consumed_samples`` is the only data-iterator state.  Step ``k`` reads
samples ``[consumed, consumed + global_batch)``; micro-batch ``m`` of DP rank ``d`` reads
``consumed + m*dp*mb + d*mb + [0, mb)`` (megatron's pretraining sampler order), so a switch only
has to carry the integer.

``train_step(..., grad_stats=True)`` fills ``StepResult.grad_stats`` (:class:`GradStats`): every
replica's squared norm of its local gradient (batch ``mb * num_microbatches``), the global squared
norm after reduction (batch ``global_batch``) and, with >= 2 micro-batches (any PP), the squared
norm of the first micro-batch's gradient (batch ``mb``: the estimate for DP == 1).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from megatron_cona.gns import GradStats
from megatron_cona.grad_probe import device as _device
from megatron_cona.grad_probe import gather_grad_stats
from megatron_cona.parallel import megatron_globals
from megatron_cona.runtime.config import TokenDataset
from megatron_cona.runtime.state import TrainState


@dataclass
class StepResult:
    iteration: int  # iterations done after this step
    consumed_samples: int
    loss: float
    grad_norm: float
    lr: float
    skipped: bool  # fp16 overflow: no update
    grad_stats: GradStats | None = None


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


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float()
    loss_sum = (losses.view(-1) * loss_mask.view(-1)).sum()
    num_tokens = loss_mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(),
                                                          num_tokens.float()])}


def _forward_step(state: TrainState, data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])
    state.probe.after_forward(output, state.grad_parts)
    return output, partial(_loss_func, batch["loss_mask"])


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
    state.probe.start(grad_stats, s)
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
        stats = gather_grad_stats(
            state.probe.local_sq,
            float(grad_norm) ** 2 if grad_norm is not None else float("nan"), s,
            state.groups.pg.dp, state.probe.first_micro_sq)
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
