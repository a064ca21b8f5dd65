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

import math
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


# DeepSpeed's optimizer step (ZeRO stage 2 and 3, fp32 masters). Read from DeepSpeed's source
# (``deepspeed/runtime/zero/stage3.py`` and ``stage_1_and_2.py``, v0.9.5 and v0.12.6 alike):
# the rank's gradient partitions live in one flat buffer of the model's dtype for the whole
# run (stage 3: ``grad_partitions_flat_buffer``; stage 2: ``averaged_gradients``); the step
# walks the optimizer's groups, stage 3 cut into sub-groups of ``sub_group_size`` partition
# elements (``_create_fp16_sub_groups``: parameters are added until the sum reaches it), and
# for each one flattens its gradients (``self.flatten(...)``, a model-dtype copy) and casts
# that to fp32 (``.to(fp32)``), the fp32 gradient the wrapped torch optimizer steps on, freed
# after (``_release_sub_group``). The wrapped optimizer is the client's where the config has
# no "optimizer" section (LLaVA's zero2/zero3.json, the HF Trainer's torch AdamW): torch's
# foreach AdamW on one flat tensor allocates ``exp_avg_sq.sqrt()`` of the sub-group's size.
SUB_GROUP_SIZE = 1e9  # sub_group_size (elements): DeepSpeedZeroConfig's default, LLaVA's json


def sub_groups(partition_numels: Sequence[int], sub_group_size: float = SUB_GROUP_SIZE
               ) -> list[int]:  # fmt: skip
    """Elements of each sub-group of one optimizer group's partition (``stage3.py``
    ``_create_fp16_sub_groups``): the whole group when it fits, else parameters in order
    until their partitions reach ``sub_group_size``."""
    total = sum(partition_numels)
    if total <= sub_group_size:
        return [total] if total else []
    out, acc = [], 0
    for i, n in enumerate(partition_numels):
        acc += n
        if acc >= sub_group_size or i == len(partition_numels) - 1:
            out.append(acc)
            acc = 0
    return out


@dataclass(frozen=True)
class DeepSpeedStep:
    """One rank's gradient bytes at DeepSpeed's optimizer step (ZeRO 2/3, fp32 masters)."""

    grad_buffer: int  # the model-dtype flat buffer of the rank's gradient partitions
    groups: tuple[int, ...]  # elements of each (sub-)group stepped one after another
    optimizer_temporaries: int  # parameter-sized fp32 temporaries of the wrapped optimizer

    def group_peak(self, n: int, elem: int) -> int:
        """Bytes beyond the buffer while group ``n`` elements step: the model-dtype flat copy
        beside its fp32 cast, then the fp32 gradient beside the optimizer's temporaries."""
        return max(n * (elem + 4), n * 4 * (1 + self.optimizer_temporaries))

    def peak(self, elem: int) -> int:
        return self.grad_buffer + max((self.group_peak(n, elem) for n in self.groups),
                                      default=0)


def deepspeed_step(trainable_tensors: Sequence[int], dp: int, zero: int, elem: int,
                   optimizer_temporaries: int = 1,
                   sub_group_size: float = SUB_GROUP_SIZE) -> DeepSpeedStep:  # fmt: skip
    """``trainable_tensors``: elements of each trainable parameter tensor, in model order
    (one optimizer group: the HF Trainer's no-decay group holds only biases and norms);
    ``elem``: bytes per model-dtype element. Stage 2 steps the whole partition at once."""
    if zero not in (2, 3):
        raise ValueError(f"zero={zero}: DeepSpeed's step is modelled at stages 2 and 3")
    parts = [-(-n // dp) for n in trainable_tensors]
    groups = sub_groups(parts, sub_group_size if zero == 3 else math.inf)
    return DeepSpeedStep(sum(parts) * elem, tuple(groups), optimizer_temporaries)
