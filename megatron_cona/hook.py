"""Thin CONA hook for users who keep Megatron-LM's own training loop.

Megatron-LM keeps model and optimizer as locals of ``train()``, so an in-memory reshard cannot
happen from outside it. The hook does what fits into that loop:

* measures the gradient noise scale (squared norms of each data-parallel replica's gradient
  before the reduction and of the reduced one, by wrapping ``config.finalize_model_grads_func``;
  norms follow Megatron's own grad-norm convention: shared and tensor-parallel duplicate
  parameters counted once),
* ranks candidates every ``--cona-interval`` iterations and logs every decision (``--cona-log``),
* applies switches that Megatron-LM's loop supports in place: a new global batch with the same
  layout and micro-batch (the micro-batch calculator is reconfigured; the learning rate follows
  ``--cona-lr-scaling``),
* reports other switches (layout or micro-batch changes) as recommendations: relaunch with the
  new flags, or train with ``megatron_cona.pretrain_gpt``, which reshards in memory.

Use in Megatron-LM (``megatron/training/training.py``)::

    from megatron_cona.arguments import add_cona_args
    from megatron_cona.hook import ConaHook
    pretrain(..., extra_args_provider=add_cona_args)
    # in train(), after setup:      hook = ConaHook(args, model, opt_param_scheduler)
    # after each train_step(...):    hook.on_step(iteration, elapsed_seconds)
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from megatron.core import num_microbatches_calculator as mbc
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from megatron_cona.arguments import static_strategy, validate_cona_args
from megatron_cona.controller import ConaController, controller_from_args
from megatron_cona.policy import Decision
from predictors.spec import TransformerSpec

log = logging.getLogger("megatron_cona.hook")


def _grad_sq_norm(model_chunks) -> float:
    """Squared norm of the current ``main_grad`` over the whole model (model-parallel sum)."""
    total = torch.zeros((), dtype=torch.float64)
    for chunk in model_chunks:
        for p in chunk.parameters():
            g = getattr(p, "main_grad", None)
            if g is not None and param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
                total += g.double().pow(2).sum().cpu()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    total = total.to(device)
    dist.all_reduce(total, group=ps.get_model_parallel_group())
    return float(total)


class _GradStats:
    """The fields ``controller.gradient_sample`` reads, filled by the finalize wrapper."""

    def __init__(self, local: list[float], local_batch: int, global_sq: float) -> None:
        self.local_sq_norms, self.local_batch, self.global_sq_norm = local, local_batch, global_sq
        self.global_batch = local_batch * len(local)
        self.first_microbatch_sq_norm, self.micro_batch = None, local_batch


class ConaHook:
    def __init__(self, args, model_chunks, opt_param_scheduler, *, loss_scale=lambda: 1.0,
                 controller: ConaController | None = None) -> None:
        world = dist.get_world_size()
        model = TransformerSpec("gpt", args.num_layers, args.hidden_size,
                                args.num_attention_heads, args.seq_length,
                                getattr(args, "padded_vocab_size", None) or 50304)
        settings = validate_cona_args(args, world, model)
        self.args = args
        self.strategy = static_strategy(args, world)
        self.controller = controller or controller_from_args(
            args, settings, model, world, "bf16-mixed" if args.bf16 else
            "fp16-mixed" if args.fp16 else "fp32", write_log=dist.get_rank() == 0)
        self.scheduler = opt_param_scheduler
        self.base_lr, self.base_min_lr = opt_param_scheduler.max_lr, opt_param_scheduler.min_lr
        self.loss_scale = loss_scale
        self.recommendation: Decision | None = None
        self._stats: _GradStats | None = None
        self._model = model_chunks
        config = model_chunks[0].config
        inner = config.finalize_model_grads_func

        def finalize(chunks, *a, **k):
            local = _grad_sq_norm(chunks) / self.loss_scale() ** 2
            out = inner(chunks, *a, **k)
            global_sq = _grad_sq_norm(chunks) / self.loss_scale() ** 2
            mine = torch.tensor([local], dtype=torch.float64, device=(
                "cuda" if torch.cuda.is_available() else "cpu"))
            gathered = [torch.zeros_like(mine) for _ in range(ps.get_data_parallel_world_size())]
            dist.all_gather(gathered, mine, group=ps.get_data_parallel_group())
            s = self.strategy
            self._stats = _GradStats([float(x) for x in gathered],
                                     s.micro_batch * s.num_microbatches, global_sq)
            return out

        config.finalize_model_grads_func = finalize

    def on_step(self, iteration: int, seconds: float) -> Decision | None:
        """Call after every training step; returns the decision on ranking iterations."""
        stats, self._stats = self._stats, None
        if stats is not None and not math.isfinite(stats.global_sq_norm):
            stats = None
        self.controller.observe(self.strategy, seconds, stats)
        if not self.controller.due(iteration):
            return None
        decision = self.controller.decide(iteration, self.strategy)
        target = decision.target
        if target == self.strategy:
            return decision
        if target.layout == self.strategy.layout and target.micro_batch == self.strategy.micro_batch:
            mbc.reconfigure_num_microbatches_calculator(
                dist.get_rank(), None, target.global_batch_size, target.micro_batch, target.dp,
                decrease_batch_size_if_needed=False)
            self.controller.record_switch(iteration, self.strategy, target, 0.0)
            scale = self.controller.lr_scale(target)
            self.scheduler.max_lr = self.base_lr * scale
            self.scheduler.min_lr = self.base_min_lr * scale
            self.strategy = target
            log.info("iteration %d: global batch -> %d in place", iteration,
                     target.global_batch_size)
        else:
            self.recommendation = decision
            log.warning("iteration %d: CONA recommends %s (layout/micro-batch change): relaunch "
                        "with its flags or train with megatron_cona.pretrain_gpt to reshard in "
                        "memory", iteration, target.name)
        return decision
