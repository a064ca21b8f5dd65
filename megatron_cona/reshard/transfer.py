"""Move weights and optimizer state between two built model/optimizer sets (collective).

:func:`transfer_state` describes both sets as boxes of global tensors, all-gathers the
descriptions, plans the move (:mod:`~megatron_cona.reshard.plan`), streams it in buckets over
the process group and copies the scalar optimizer state (Adam step, grad scaler, LR scheduler).
It builds nothing and destroys nothing: the caller owns both sets (the CONA runtime's
transactional switch builds the destination and keeps the source as its rollback).

Every step that can fail on one rank runs through ``phase(name, body, collective)``, and every
transfer bucket ends with ``vote(error_or_None)``; the defaults run the steps plainly and raise
the local error. A caller that needs atomicity passes a voting ``phase``/``vote`` pair (every
rank learns of any rank's failure before the next collective).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from megatron_cona.reshard import layout, optimizer_state
from megatron_cona.reshard.copy_service import TorchDistCopyService
from megatron_cona.reshard.execute import run_plan
from megatron_cona.reshard.plan import build_plan
from megatron_cona.reshard.state import ModelOptimizerSet

DEFAULT_BUCKET_BYTES = 64 * 2**20

Phase = Callable[[str, Callable[[], Any], bool], Any]


def _plain_phase(name: str, body: Callable[[], Any], collective: bool = False) -> Any:
    return body()


def _plain_vote(error: BaseException | None) -> None:
    if error is not None:
        raise error


@dataclass
class TransferStats:
    bytes_sent: int  # remote bytes this rank sent
    bytes_total: int  # remote bytes of the whole plan
    num_buckets: int
    peak_buffer_bytes: int  # this rank's largest bucket (send + receive buffers)


def _gather(obj) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def transfer_state(src: ModelOptimizerSet, dst: ModelOptimizerSet, *,
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES, group: dist.ProcessGroup | None = None,
                   phase: Phase = _plain_phase,
                   vote: Callable[[BaseException | None], None] = _plain_vote,
                   on_bucket: Callable[[int], None] | None = None) -> TransferStats:
    """Fill ``dst`` (weights, fp32 main weights, Adam moments, scalar state) from ``src``.

    Collective over ``group`` (default: the world), whose ranks hold ``src`` and ``dst`` in
    their two layouts; ``src`` is only read.  Phase names: ``plan:source``,
    ``plan:destination``, ``plan``, ``finalize``; ``on_bucket(i)`` before bucket ``i``."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")

    def describe_source():
        kinds, step, in_groups = optimizer_state.adam_kinds(src)
        return [s.meta for s in layout.state_segments(src, kinds)], kinds, step, in_groups

    gathered = _gather(phase("plan:source", describe_source, False))

    def describe_destination():
        kind_sets = {tuple(k) for _, k, _, _ in gathered if k}
        if len(kind_sets) > 1:
            raise RuntimeError(f"optimizer state kinds differ across ranks: {kind_sets}")
        kinds = list(kind_sets.pop()) if kind_sets else []
        steps = [st for _, _, st, _ in gathered if st is not None]
        step = max(steps) if steps else None
        optimizer_state.init_optimizer_state(dst, kinds, step, any(g for *_, g in gathered))
        return [s.meta for s in layout.state_segments(dst, kinds)], kinds

    dst_meta, kinds = phase("plan:destination", describe_destination, False)
    dst_all = _gather(dst_meta)
    plan = phase("plan", lambda: build_plan([g[0] for g in gathered], dst_all, bucket_bytes),
                 False)
    src_segs, dst_segs = layout.state_segments(src, kinds), layout.state_segments(dst, kinds)
    rank = dist.get_rank()
    sent = run_plan(plan, src_segs, dst_segs, rank, TorchDistCopyService(group), vote, on_bucket)
    phase("finalize", lambda: optimizer_state.copy_scalar_state(src, dst), False)
    return TransferStats(sent, plan.bytes_moved(), len(plan.buckets),
                         plan.peak_bucket_bytes(rank))

