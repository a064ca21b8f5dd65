"""Which optimizer a traced step runs, and how it is implemented.

The implementation changes the peak: torch's default Adam/AdamW on CUDA is the *foreach*
(multi-tensor) one, whose update allocates ``exp_avg_sq.sqrt()`` for every parameter at once
(``torch/optim/adam.py``, ``_multi_tensor_adam``: one parameter-sized fp32 temporary); the
*fused* kernel (``fused=True``, Apex/TE FusedAdam) updates in place; the *for-loop* one
(``foreach=False``) allocates that temporary one parameter at a time. The traced step runs the
real torch optimizer with the chosen flags, so these temporaries are seen, not assumed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..spec.model import ModelSpecError

OPTIMIZERS = ("adam", "adamw", "sgd")
IMPLEMENTATIONS = ("foreach", "fused", "for-loop")
TORCH_IMPL = "foreach"  # what torch.optim builds on CUDA when no implementation is asked


@dataclass(frozen=True)
class OptimizerSpec:
    """``name``: adam | adamw | sgd; ``impl``: foreach | fused | for-loop, or None: not named,
    the step's own (:data:`TORCH_IMPL`, torch's CUDA default, or the framework's kernel where
    it runs one, ``device.Sharding.effective_optimizer``); one named that the framework does
    not run is refused there. Other defaults are ``torch.optim.Adam()``'s (what a plain
    PyTorch script gets)."""

    name: str = "adam"
    impl: str | None = None
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.0  # sgd only (0: no momentum buffer)

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ModelSpecError(f"optimizer={self.name!r} is unknown; choose {OPTIMIZERS}")
        if self.impl is not None and self.impl not in IMPLEMENTATIONS:
            raise ModelSpecError(
                f"optimizer_impl={self.impl!r} is unknown; choose {IMPLEMENTATIONS}")

    @classmethod
    def parse(cls, text: str) -> OptimizerSpec:
        """``"adam"``, ``"adamw:fused"``, ``"sgd:for-loop"``."""
        name, _, impl = text.partition(":")
        return cls(name=name, impl=impl or None,
                   weight_decay=0.01 if name == "adamw" else 0.0)

    @property
    def states_per_param(self) -> int:
        if self.name == "sgd":
            return int(self.momentum > 0)
        return 2

    def build(self, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        impl = self.impl or TORCH_IMPL
        flags = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum,
                                   weight_decay=self.weight_decay, **flags)
        cls = torch.optim.Adam if self.name == "adam" else torch.optim.AdamW
        return cls(params, lr=self.lr, weight_decay=self.weight_decay, **flags)
