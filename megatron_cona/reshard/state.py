"""What resharding needs to know about a model/optimizer set (one parallel layout's half of a
switch). Any object with these attributes can be a source or destination of
:func:`~megatron_cona.reshard.transfer.transfer_state`; the CONA runtime's ``TrainState`` is one.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class ModelOptimizerSet(Protocol):
    @property
    def core_model(self) -> torch.nn.Module:
        """The unwrapped megatron-core model chunk of this rank (GPTModel)."""

    @property
    def optimizer(self) -> Any:
        """megatron-core ``MegatronOptimizer`` (or a ``ChainedOptimizer``) over ``core_model``."""

    @property
    def scheduler(self) -> Any:
        """megatron-core ``OptimizerParamScheduler``."""

    @property
    def tp_size(self) -> int: ...

    @property
    def tp_rank(self) -> int: ...

    @property
    def mixed_precision(self) -> bool:
        """Half-precision weights with fp32 main weights in the optimizer."""
