"""Transfer plan between two layouts of the same logical tensors (pure logic).

Inputs are, for every rank, the list of :class:`SegmentMeta` it holds in the source layout and
the list it must fill in the destination layout.  A segment is one box of one logical tensor
(``key`` = canonical parameter name + state kind, e.g. ``decoder.layers.3.mlp.linear_fc1.weight
:exp_avg``) in that tensor's global index space.  The plan is computed identically on every rank
from the all-gathered metadata, so no plan has to be broadcast.

Rules:

* every destination element must be covered exactly once by source boxes, and both layouts
  must agree on each tensor's global shape (otherwise :class:`ReshardPlanError` names it);
* replicas (the same box on several source ranks: data-parallel copies, TP-duplicated norms,
  the pipeline's tied embedding copy) are read from the destination rank itself when it has one,
  else from the least-loaded holder, so reads spread over the replicas;
* ops larger than ``bucket_bytes`` are split row-major, and ops are packed into buckets such that
  no rank sends plus receives more than ``bucket_bytes`` of remote data per bucket.  That is the
  bound on transient transfer memory per rank (local copies need no buffer).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from megatron_cona.reshard.boxes import Box, intersect, split_box, volume


class ReshardPlanError(RuntimeError):
    """The two layouts do not describe the same tensors (names the tensor and ranks)."""


@dataclass(frozen=True)
class SegmentMeta:
    key: str
    global_shape: tuple[int, ...]
    box: Box
    itemsize: int

    @property
    def nbytes(self) -> int:
        return volume(self.box) * self.itemsize


@dataclass(frozen=True)
class TransferOp:
    src_rank: int
    src_index: int  # index into the source rank's segment list
    dst_rank: int
    dst_index: int
    box: Box  # global coordinates, inside both segments' boxes
    nbytes: int

    @property
    def is_local(self) -> bool:
        return self.src_rank == self.dst_rank


@dataclass
class ReshardPlan:
    buckets: list[list[TransferOp]]
    bucket_bytes: int

    @property
    def num_ops(self) -> int:
        return sum(len(b) for b in self.buckets)

    def bytes_moved(self, remote_only: bool = True) -> int:
        return sum(op.nbytes for b in self.buckets for op in b if not (remote_only and op.is_local))

    def peak_bucket_bytes(self, rank: int) -> int:
        """Largest remote send+recv volume of ``rank`` in any bucket."""
        return max((_rank_load(b, rank) for b in self.buckets), default=0)


def _rank_load(bucket: list[TransferOp], rank: int) -> int:
    return sum(op.nbytes for op in bucket
               if not op.is_local and rank in (op.src_rank, op.dst_rank))


def build_plan(src: list[list[SegmentMeta]], dst: list[list[SegmentMeta]],
               bucket_bytes: int) -> ReshardPlan:
    """Plan moving every destination segment's data from the source segments (see module doc)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
    # key -> distinct source box -> holders [(rank, index)]
    sources: dict[str, dict[Box, list[tuple[int, int]]]] = defaultdict(dict)
    shapes: dict[str, tuple[int, ...]] = {}
    for rank, segs in enumerate(src):
        for i, seg in enumerate(segs):
            _check_shape(shapes, seg, rank, "source")
            sources[seg.key].setdefault(seg.box, []).append((rank, i))
    send_load: dict[int, int] = defaultdict(int)
    ops: list[TransferOp] = []
    for rank, segs in enumerate(dst):
        for i, seg in enumerate(segs):
            if seg.key not in sources:
                raise ReshardPlanError(f"tensor {seg.key!r} needed on destination rank {rank} "
                                       "exists on no source rank")
            if shapes[seg.key] != seg.global_shape:
                raise ReshardPlanError(
                    f"tensor {seg.key!r}: global shape {seg.global_shape} on destination rank "
                    f"{rank} != source global shape {shapes[seg.key]}")
            covered = 0
            for box, holders in sources[seg.key].items():
                part = intersect(box, seg.box)
                if part is None:
                    continue
                covered += volume(part)
                src_rank, src_index = _pick(holders, rank, send_load)
                for piece in split_box(part, max(1, bucket_bytes // seg.itemsize)):
                    op = TransferOp(src_rank, src_index, rank, i, piece,
                                    volume(piece) * seg.itemsize)
                    if not op.is_local:
                        send_load[src_rank] += op.nbytes
                    ops.append(op)
            if covered != volume(seg.box):
                raise ReshardPlanError(
                    f"tensor {seg.key!r}: destination box {seg.box} on rank {rank} is covered by "
                    f"{covered} of {volume(seg.box)} elements in the source layout")
    return ReshardPlan(_pack(ops, bucket_bytes), bucket_bytes)


def _check_shape(shapes: dict, seg: SegmentMeta, rank: int, side: str) -> None:
    known = shapes.setdefault(seg.key, seg.global_shape)
    if known != seg.global_shape:
        raise ReshardPlanError(f"tensor {seg.key!r}: global shape {seg.global_shape} on {side} "
                               f"rank {rank} != {known} on another rank")


def _pick(holders: list[tuple[int, int]], dst_rank: int, load: dict[int, int]) -> tuple[int, int]:
    for holder in holders:
        if holder[0] == dst_rank:
            return holder
    return min(holders, key=lambda h: (load[h[0]], h[0]))


def _pack(ops: list[TransferOp], bucket_bytes: int) -> list[list[TransferOp]]:
    buckets: list[list[TransferOp]] = []
    current: list[TransferOp] = []
    load: dict[int, int] = defaultdict(int)
    for op in ops:
        if not op.is_local and current and (load[op.src_rank] + op.nbytes > bucket_bytes
                                            or load[op.dst_rank] + op.nbytes > bucket_bytes):
            buckets.append(current)
            current, load = [], defaultdict(int)
        current.append(op)
        if not op.is_local:
            load[op.src_rank] += op.nbytes
            load[op.dst_rank] += op.nbytes
    if current:
        buckets.append(current)
    return buckets

