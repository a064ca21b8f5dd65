"""The one ZeRO-3 parameter model, used by the preset path (:mod:`phases`) and the
``nn.Module`` path (:class:`device.Sharding`).

DeepSpeed stage 3 keeps a ``1/dp`` shard of every parameter, gathers a module's full
parameters just before its forward (and again before its backward) and frees them after, and
prefetches the next modules' parameters up to ``stage3_prefetch_bucket_size`` elements
(``deepspeed/runtime/zero/partitioned_param_coordinator.py``); parameters smaller than
``stage3_param_persistence_threshold`` elements stay gathered. ``stage3_max_live_parameters``
(1e9) only caps what may be gathered at once, which one module plus the prefetch bucket stays
under for the models here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PREFETCH_BUCKET = 5e7  # stage3_prefetch_bucket_size (elements)
PERSISTENCE_THRESHOLD = 1e5  # stage3_param_persistence_threshold (elements)


@dataclass(frozen=True)
class Zero3Params:
    shard: int  # the rank's 1/dp of every parameter
    persistent: int  # small parameters kept whole (the part beyond their shard)
    gathered: int  # the largest module's full parameters, gathered for its compute
    prefetch: int  # the prefetch bucket

    @property
    def total(self) -> int:
        return self.shard + self.persistent + self.gathered + self.prefetch


def zero3_params(module_tensors: Sequence[Sequence[int]], dp: int, elem: int,
                 prefetch_bucket: float = PREFETCH_BUCKET,
                 persistence_threshold: float = PERSISTENCE_THRESHOLD) -> Zero3Params:  # fmt: skip
    """One rank's parameter bytes. ``module_tensors``: per module (layer), the byte sizes of
    its parameter tensors; ``elem``: bytes per parameter element."""
    if dp < 1:
        raise ValueError(f"dp={dp} must be >= 1")
    sizes = [s for m in module_tensors for s in m]
    total = sum(sizes)
    small = sum(s for s in sizes if s < persistence_threshold * elem)
    persistent = small - small // dp
    gathered = max((sum(m) for m in module_tensors), default=0) if dp > 1 else 0
    prefetch = int(min(prefetch_bucket * elem, total)) if dp > 1 else 0
    return Zero3Params(total // dp, persistent, gathered, prefetch)
