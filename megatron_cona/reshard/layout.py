"""Describe what a model/optimizer set holds as boxes of global tensors (engine glue).

For every model parameter the canonical name is the one it would have with PP = 1 (transformer
layers renamed by their global ``layer_number``; the last stage's tied ``output_layer.weight``
is a replica of ``embedding.word_embeddings.weight``) and its global shape is the local shape
times TP along ``partition_dim``.  Each returned :class:`Segment` pairs the picklable
:class:`SegmentMeta` with a live tensor view of exactly that box.

Kinds of tensors:

* ``w`` — model weights (full local tensors; every DP replica holds them);
* ``main`` — fp32 main weights of bf16/fp16 runs (fp32 runs update the weights themselves);
* Adam state keys (``exp_avg``, ``exp_avg_sq``) — per parameter, shaped like the main weight.

With the DistributedOptimizer, ``main`` and the Adam states exist only for this DP rank's flat
range of each parameter; :func:`~megatron_cona.reshard.boxes.flat_range_boxes` turns that range
into boxes, so the same planner moves them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from megatron_cona.reshard.boxes import (
    Box,
    box_shape,
    flat_range_boxes,
    intersect,
    relative_slices,
    volume,
)
from megatron_cona.reshard.plan import SegmentMeta
from megatron_cona.reshard.state import ModelOptimizerSet

_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..*)$")
TIED_EMBEDDING = "embedding.word_embeddings.weight"


@dataclass
class Segment:
    meta: SegmentMeta
    view: torch.Tensor  # shape == box_shape(meta.box), aliases the holder's storage


@dataclass(frozen=True)
class _Placement:
    """How a local tensor maps into its global tensor: ``chunks`` of (local box, global box)."""

    name: str
    global_shape: tuple[int, ...]
    chunks: tuple[tuple[Box, Box], ...]


def named_parameters(state: ModelOptimizerSet) -> list[tuple[str, torch.nn.Parameter]]:
    """Model parameters of this rank under their canonical (PP = 1) names."""
    core = state.core_model
    offsets = {}
    for mod_name, module in core.named_modules():
        number = getattr(module, "layer_number", None)
        m = _LAYER.match(mod_name + ".")
        if isinstance(number, int) and m and mod_name.count(".") == 2:
            offsets[int(m.group(2))] = number - 1
    out = []
    for name, p in core.named_parameters():
        m = _LAYER.match(name)
        if m:
            name = f"{m.group(1)}{offsets[int(m.group(2))]}{m.group(3)}"
        elif name == "output_layer.weight" and core.share_embeddings_and_output_weights:
            name = TIED_EMBEDDING
        out.append((name, p))
    return out


def _placement(name: str, p: torch.Tensor, state: ModelOptimizerSet) -> _Placement:
    shape = tuple(p.shape)
    if not getattr(p, "tensor_model_parallel", False) or state.tp_size == 1:
        box = tuple((0, n) for n in shape)
        return _Placement(name, shape, ((box, box),))
    tp, tp_rank = state.tp_size, state.tp_rank
    dim, stride = int(p.partition_dim), int(getattr(p, "partition_stride", 1))
    local = shape[dim]
    if local % stride:
        raise ValueError(f"{name}: local size {local} on dim {dim} not divisible by stride "
                         f"{stride}")
    piece = local // stride
    global_shape = tuple(n * tp if d == dim else n for d, n in enumerate(shape))
    chunks = []
    for j in range(stride):
        lo, go = j * piece, (j * tp + tp_rank) * piece
        local_box = tuple((lo, lo + piece) if d == dim else (0, n) for d, n in enumerate(shape))
        global_box = tuple((go, go + piece) if d == dim else (0, n) for d, n in enumerate(shape))
        chunks.append((local_box, global_box))
    return _Placement(name, global_shape, tuple(chunks))


def _segments_of(placement: _Placement, kind: str, local: torch.Tensor,
                 flat: tuple[int, int] | None = None) -> list[Segment]:
    """Segments of ``local`` (full local tensor, or the 1-D shard of flat range ``flat``)."""
    key = f"{placement.name}:{kind}"
    itemsize = local.element_size()
    local_shape = tuple(_local_shape(placement))
    if flat is None:
        pieces = [(tuple((0, n) for n in local_shape), local.view(local_shape))]
    else:
        start, end = flat
        pieces = [(b, local[off:off + volume(b)].view(box_shape(b)))
                  for b, off in flat_range_boxes(local_shape, start, end)]
    out = []
    for local_box, view in pieces:
        for chunk_local, chunk_global in placement.chunks:
            part = intersect(local_box, chunk_local)
            if part is None:
                continue
            global_box = tuple((s - cl + cg, e - cl + cg) for (s, e), (cl, _), (cg, _) in
                               zip(part, chunk_local, chunk_global, strict=True))
            meta = SegmentMeta(key, placement.global_shape, global_box, itemsize)
            out.append(Segment(meta, view[relative_slices(part, local_box)]))
    return out


def _local_shape(placement: _Placement) -> list[int]:
    shape = [0] * len(placement.global_shape)
    for local_box, _ in placement.chunks:
        for d, (_, e) in enumerate(local_box):
            shape[d] = max(shape[d], e)
    return shape


def weight_segments(state: ModelOptimizerSet) -> list[Segment]:
    segs = []
    for name, p in named_parameters(state):
        segs += _segments_of(_placement(name, p, state), "w", p.data)
    return segs


def megatron_optimizers(state: ModelOptimizerSet) -> list:
    opt = state.optimizer
    return list(getattr(opt, "chained_optimizers", [opt]))


def main_params(state: ModelOptimizerSet) -> dict[int, tuple[torch.Tensor, tuple[int, int] | None]]:
    """id(model param) -> (main param, flat range or None) for every param this rank optimizes.

    ``flat`` is the DistributedOptimizer shard's range in the flattened local parameter."""
    out: dict[int, tuple[torch.Tensor, tuple[int, int] | None]] = {}
    for opt in megatron_optimizers(state):
        if hasattr(opt, "model_param_group_index_map"):  # DistributedOptimizer
            for model_param, (g, o) in opt.model_param_group_index_map.items():
                gi, dtype, bi = opt.model_param_gbuf_map[model_param]
                rng = opt.gbuf_ranges[gi][dtype][bi]["param_map"][model_param]["param"]
                main = opt.optimizer.param_groups[g]["params"][o]
                out[id(model_param)] = (main, (rng.start, rng.end))
        elif hasattr(opt, "float16_groups"):  # Float16OptimizerWithFloat16Params
            for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups,
                                               strict=True):
                for model_param, main in zip(model_group, main_group, strict=True):
                    out[id(model_param)] = (main, None)
            for group in opt.fp32_from_fp32_groups:
                for model_param in group:
                    out[id(model_param)] = (model_param, None)
        else:  # FP32Optimizer
            for group in opt.optimizer.param_groups:
                for model_param in group["params"]:
                    out[id(model_param)] = (model_param, None)
    return out


def inner_optimizer_states(state: ModelOptimizerSet) -> list[tuple[torch.optim.Optimizer, dict]]:
    return [(opt.optimizer, opt.optimizer.state) for opt in megatron_optimizers(state)]


def optimizer_segments(state: ModelOptimizerSet, kinds: list[str]) -> list[Segment]:
    """Segments of the fp32 main weights (mixed precision only) and of the Adam ``kinds``."""
    mains = main_params(state)
    adam_state = {}
    for _, st in inner_optimizer_states(state):
        adam_state.update(st)
    mixed = state.mixed_precision
    segs = []
    for name, p in named_parameters(state):
        if id(p) not in mains:
            continue
        main, flat = mains[id(p)]
        placement = _placement(name, p, state)
        if mixed:
            segs += _segments_of(placement, "main", main.data.view(-1) if flat else main.data,
                                 flat)
        for kind in kinds:
            tensor = adam_state[main][kind]
            segs += _segments_of(placement, kind, tensor.view(-1) if flat else tensor, flat)
    return segs


def state_segments(state: ModelOptimizerSet, kinds: list[str]) -> list[Segment]:
    """Everything a switch moves: weights, then main weights and the Adam ``kinds``."""
    return weight_segments(state) + optimizer_segments(state, kinds)
