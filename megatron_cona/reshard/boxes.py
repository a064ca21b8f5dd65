"""Axis-aligned boxes of a tensor's index space (pure logic, no torch.distributed).

A box is a tuple of half-open ``(start, stop)`` ranges, one per dimension.  Every shard CONA
moves is described as boxes of the tensor's GLOBAL index space: a TP shard is one box (or
``stride`` boxes for strided partitions), a DistributedOptimizer shard — a flat range of the
local tensor — is the few boxes :func:`flat_range_boxes` cuts it into.
"""

from __future__ import annotations

import math

Box = tuple[tuple[int, int], ...]


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def volume(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return out if all(start < stop for start, stop in out) else None


def relative_slices(inner: Box, outer: Box) -> tuple[slice, ...]:
    """Slices selecting ``inner`` from a tensor that holds exactly ``outer``."""
    return tuple(slice(i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(inner, outer, strict=True))


def shift(box: Box, dim: int, offset: int) -> Box:
    return tuple((s + offset, e + offset) if d == dim else (s, e) for d, (s, e) in enumerate(box))


def flat_range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[Box, int]]:
    """Cut the row-major flat range ``[start, end)`` of ``shape`` into boxes.

    Returns ``(box, flat_offset)`` pairs in order; each box is contiguous in flat order and
    starts ``flat_offset`` elements after ``start``.  At most ``2 * ndim - 1`` boxes."""
    if not 0 <= start <= end <= math.prod(shape):
        raise ValueError(f"flat range [{start}, {end}) outside shape {shape}")
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    boxes: list[Box] = []
    _cut(tuple(shape), start, end, (), boxes)
    return [(b, sum(lo * st for (lo, _), st in zip(b, strides, strict=True)) - start)
            for b in boxes]


def _cut(shape: tuple[int, ...], start: int, end: int, prefix: Box, out: list[Box]) -> None:
    """Append the boxes of flat range [start, end) of ``shape`` (under the row path ``prefix``)."""
    if start >= end:
        return
    if len(shape) == 1:
        out.append(prefix + ((start, end),))
        return
    row = math.prod(shape[1:])
    r0, c0 = divmod(start, row)
    r1, c1 = divmod(end, row)
    if r0 == r1:
        _cut(shape[1:], c0, c1, prefix + ((r0, r0 + 1),), out)
        return
    if c0:
        _cut(shape[1:], c0, row, prefix + ((r0, r0 + 1),), out)
        r0 += 1
    if r0 < r1:
        out.append(prefix + ((r0, r1),) + tuple((0, n) for n in shape[1:]))
    if c1:
        _cut(shape[1:], 0, c1, prefix + ((r1, r1 + 1),), out)


def split_box(box: Box, max_elements: int) -> list[Box]:
    """Split ``box`` into row-major pieces of at most ``max_elements`` elements each."""
    if max_elements < 1:
        raise ValueError(f"max_elements={max_elements} must be >= 1")
    if volume(box) <= max_elements:
        return [box]
    dim = next(d for d, (s, e) in enumerate(box) if e - s > 1)
    inner = volume(box[dim + 1:])
    s, e = box[dim]
    if inner > max_elements:  # even one slab along `dim` is too big: split inside each slab
        return [piece for i in range(s, e)
                for piece in split_box(box[:dim] + ((i, i + 1),) + box[dim + 1:], max_elements)]
    rows = max(1, max_elements // inner)
    return [box[:dim] + ((i, min(i + rows, e)),) + box[dim + 1:] for i in range(s, e, rows)]
