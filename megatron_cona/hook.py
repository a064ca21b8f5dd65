"""Thin CONA hook for users who keep Megatron-LM's own training loop.

Megatron-LM keeps model and optimizer as locals of ``train()``, so an in-memory reshard cannot
happen from outside it. The hook does what fits into that loop:

* measures the gradient noise scale (squared norms of each data-parallel replica's gradient
  before the reduction and of the reduced one, by wrapping ``config.finalize_model_grads_func``,
  and of the first micro-batch's gradient on every stage, by a forward hook on the first model
  chunk; the same :class:`~megatron_cona.grad_probe.GradProbe` and convention as the runtime,
  so DP = 1 is measured whenever there are >= 2 micro-batches, at any PP),
* ranks candidates every ``--cona-interval`` iterations and logs every decision (``--cona-log``),
* acts through the same :class:`~megatron_cona.session.ConaSession` as ``pretrain_gpt``, with
  :class:`MegatronLMExecutor`: a new global batch with the same layout and micro-batch is applied
  in place (the micro-batch calculator is reconfigured; the learning rate follows
  ``--cona-lr-scaling``). A layout or micro-batch change it cannot make (``why_not`` says why,
  below): the session decides among the global batches of the running layout and micro-batch,
  and a better strategy beyond them is kept as a recommendation (``hook.recommendation``,
  logged when it changes): relaunch with the new flags, or train with
  ``megatron_cona.pretrain_gpt``, which reshards in memory.

Use in Megatron-LM (``megatron/training/training.py``)::

    from megatron_cona.arguments import add_cona_args
    from megatron_cona.hook import ConaHook
    pretrain(..., extra_args_provider=add_cona_args)
    # in train(), after setup:      hook = ConaHook(args, model, opt_param_scheduler)
    # after each train_step(...):    hook.on_step(iteration, elapsed_seconds)
"""

from __future__ import annotations

import logging

import torch.distributed as dist
from megatron.core import num_microbatches_calculator as mbc
from megatron.core import parallel_state as ps

from megatron_cona.arguments import (
    precision_from_args,
    static_strategy,
    validate_cona_args,
)
from megatron_cona.executor import ExecutorBase, SwitchOutcome, SwitchUnsupported
from megatron_cona.gns import GradStats
from megatron_cona.grad_probe import (
    GradProbe,
    ProbeGroups,
    gather_grad_stats,
    grad_sq_norm,
    local_grad_sq,
    reduce_grad_sq,
)
from megatron_cona.policy import Decision
from megatron_cona.session import ConaSession, session_from_args
from predictors.spec import ParallelStrategy
from predictors.spec.engines import text_spec_from_megatron_args

log = logging.getLogger("megatron_cona.hook")


def _probe_groups() -> ProbeGroups:
    tied = ps.get_pipeline_model_parallel_world_size() > 1
    return ProbeGroups(ps.get_tensor_model_parallel_rank(), ps.get_model_parallel_group(),
                       ps.get_embedding_group() if tied else None,
                       ps.is_pipeline_first_stage(ignore_virtual=True))


def _named_grads(model_chunks):
    return [(n, p) for chunk in model_chunks for n, p in chunk.named_parameters()]


LAYOUT_UNSUPPORTED = (
    "Megatron-LM's train() holds the model, optimizer and data iterator as locals built for one "
    "(DP, TP, PP) layout and micro-batch, so a hook cannot replace them; relaunch with the new "
    "flags or train with megatron_cona.pretrain_gpt, which reshards in memory")


class MegatronLMExecutor(ExecutorBase):
    """Acts inside Megatron-LM's loop: global-batch changes in place, nothing else."""

    def __init__(self, strategy: ParallelStrategy, scheduler) -> None:
        self.scheduler = scheduler
        self._strategy = strategy
        self.capture_lr()

    @property
    def strategy(self) -> ParallelStrategy:
        return self._strategy

    def why_not(self, target: ParallelStrategy) -> str | None:
        old = self._strategy
        if target.layout != old.layout or target.micro_batch != old.micro_batch:
            return f"{old.name} -> {target.name}: {LAYOUT_UNSUPPORTED}"
        return None

    def switch(self, target: ParallelStrategy) -> SwitchOutcome:
        old = self._strategy
        if why := self.why_not(target):
            raise SwitchUnsupported(why)
        mbc.reconfigure_num_microbatches_calculator(
            dist.get_rank(), None, target.global_batch_size, target.micro_batch, target.dp,
            decrease_batch_size_if_needed=False)
        self._strategy = target
        log.info("global batch %d -> %d in place", old.global_batch_size,
                 target.global_batch_size)
        return SwitchOutcome(True, 0.0)


class ConaHook:
    def __init__(self, args, model_chunks, opt_param_scheduler, *, loss_scale=lambda: 1.0,
                 session: ConaSession | None = None) -> None:
        world = dist.get_world_size()
        model = text_spec_from_megatron_args(args)
        settings = validate_cona_args(args, world, model)
        self.args = args
        self.executor = MegatronLMExecutor(static_strategy(args, world), opt_param_scheduler)
        self.session = session or session_from_args(
            args, settings, model, world, precision_from_args(args), self.executor,
            write_log=dist.get_rank() == 0)
        self.session.begin()  # before train() runs its first iteration (a batch-only switch)
        self.loss_scale = loss_scale
        self._stats: GradStats | None = None
        self.probe = GradProbe()
        # with a virtual pipeline the chunks' backwards interleave: no first-micro reading
        single_chunk = len(model_chunks) == 1

        def next_iteration():
            self.probe.start(True, self.executor.strategy)
            self.probe.first_micro &= single_chunk

        next_iteration()

        def parts():
            return local_grad_sq(_named_grads(model_chunks), _probe_groups())

        def reduce(local, tied):
            return reduce_grad_sq(local, tied, _probe_groups(), loss_scale=self.loss_scale())

        if single_chunk:
            self.probe.attach(model_chunks[0], parts)
        config = model_chunks[0].config
        inner = config.finalize_model_grads_func

        def finalize(chunks, *a, **k):
            self.probe.before_reduction(parts, reduce)
            out = inner(chunks, *a, **k)
            global_sq = grad_sq_norm(_named_grads(chunks), _probe_groups(),
                                     loss_scale=self.loss_scale(), reduced=True)
            self._stats = gather_grad_stats(self.probe.local_sq, global_sq,
                                            self.executor.strategy,
                                            ps.get_data_parallel_group(),
                                            self.probe.first_micro_sq)
            next_iteration()
            return out

        config.finalize_model_grads_func = finalize

    @property
    def strategy(self) -> ParallelStrategy:
        return self.executor.strategy

    @property
    def recommendation(self) -> ParallelStrategy | None:
        """The last strategy CONA chose that Megatron-LM's loop cannot switch to."""
        return self.session.unsupported[-1].target if self.session.unsupported else None

    def on_step(self, iteration: int, seconds: float, loss: float | None = None
                ) -> Decision | None:
        """Call after every training step (``loss``: its training loss, which lets CONA check
        each batch switch against measured progress); returns the decision on ranking
        iterations."""
        stats, self._stats = self._stats, None
        return self.session.after_step(iteration, seconds, stats, loss=loss)
