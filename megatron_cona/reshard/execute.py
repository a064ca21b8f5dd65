"""Execute a :class:`ReshardPlan` bucket by bucket over a CopyService.

Per bucket every rank (1) allocates its receive buffers and contiguous send copies — the only
step that can fail locally (e.g. out of memory) — then (2) votes; only if every rank is ready
are (3) the point-to-point ops posted and (4) received data written into the destination views.
So a local failure never leaves a peer blocked in a send/recv, and peak transient memory is the
bucket's buffers (at most ``plan.bucket_bytes`` of remote data per rank).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_cona.reshard.boxes import box_shape, relative_slices
from megatron_cona.reshard.copy_service import TorchDistCopyService
from megatron_cona.reshard.layout import Segment
from megatron_cona.reshard.plan import ReshardPlan, TransferOp


def _view(seg: Segment, op: TransferOp) -> torch.Tensor:
    return seg.view[relative_slices(op.box, seg.meta.box)]


def run_plan(plan: ReshardPlan, src: list[Segment], dst: list[Segment], rank: int,
             service: TorchDistCopyService, vote: Callable[[BaseException | None], None],
             on_bucket: Callable[[int], None] | None = None) -> int:
    """Move this rank's share of ``plan``; returns the remote bytes this rank sent.

    ``vote(error_or_None)`` must be a collective that raises on every rank when any rank
    reported an error."""
    sent = 0
    for index, bucket in enumerate(plan.buckets):
        error = None
        writebacks: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            if on_bucket is not None:
                on_bucket(index)
            for op in bucket:
                if op.src_rank == rank and op.dst_rank == rank:
                    with torch.no_grad():
                        _view(dst[op.dst_index], op).copy_(_view(src[op.src_index], op))
                elif op.src_rank == rank:
                    service.submit_send(_view(src[op.src_index], op).contiguous(), op.dst_rank)
                    sent += op.nbytes
                elif op.dst_rank == rank:
                    target = _view(dst[op.dst_index], op)
                    # Both layouts of a run share the precision: a tensor keeps its dtype.
                    buffer = torch.empty(box_shape(op.box), dtype=target.dtype,
                                         device=target.device)
                    service.submit_recv(buffer, op.src_rank)
                    writebacks.append((target, buffer))
        except Exception as exc:  # noqa: BLE001 - reported through the vote
            error = exc
        vote(error)
        service.run()
        with torch.no_grad():
            for target, buffer in writebacks:
                target.copy_(buffer)
    return sent

