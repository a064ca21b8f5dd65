"""The CONA runtime: a megatron-core training state for one parallel strategy, one iteration on
it, and the transactional switch between strategies.

Megatron-LM's ``pretrain()`` asserts CUDA and keeps model and optimizer as locals of ``train()``,
so CONA builds its loop from megatron-core's own pieces and keeps everything a strategy switch
must replace in one object, :class:`TrainState`. By concern:

* :mod:`~megatron_cona.runtime.config` -- :class:`TrainConfig` (strategy-independent), datasets;
* :mod:`~megatron_cona.runtime.state` -- :func:`build_state` (groups, GPTModel, DDP, optimizer,
  scheduler, RNG, micro-batch calculator) and the pre-reduction gradient hooks and norms;
* :mod:`~megatron_cona.runtime.step` -- :func:`train_step`, :func:`evaluate`,
  :func:`forward_logits`;
* :mod:`~megatron_cona.runtime.switch` -- :func:`switch_strategy`, atomic over the world (the
  tensors move through :func:`megatron_cona.reshard.transfer_state`);
* :mod:`~megatron_cona.runtime.executor` -- :class:`RuntimeExecutor`, how a
  :class:`~megatron_cona.session.ConaSession` acts on this runtime.
"""

from megatron_cona.gns import GradStats
from megatron_cona.runtime.config import SUPPORTED_PRECISIONS, TokenDataset, TrainConfig
from megatron_cona.runtime.state import (
    TrainState,
    activate,
    build_model,
    build_optimizer,
    build_state,
    configure_microbatches,
    seed_rng,
)
from megatron_cona.runtime.step import StepResult, evaluate, forward_logits, train_step
from megatron_cona.runtime.switch import SwitchResult, switch_strategy

__all__ = ["SUPPORTED_PRECISIONS", "GradStats", "StepResult", "SwitchResult", "TokenDataset",
           "TrainConfig", "TrainState", "activate", "build_model", "build_optimizer",
           "build_state", "configure_microbatches", "evaluate", "forward_logits", "seed_rng",
           "switch_strategy", "train_step"]
