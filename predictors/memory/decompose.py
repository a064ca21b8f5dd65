"""Decompose a built PyTorch module into towers and layers, with exact parameter counts.

Layer names match :mod:`factorize`: ``vision.embeddings``, ``vision.layers.<i>``,
``vision.post``, ``projector``, ``llm.embed``, ``llm.layers.<i>``, ``llm.head``, ``head``.
The same mapping attributes the tracker's per-module saved bytes to layers."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from torch import nn

_RULES: list[tuple[re.Pattern, str]] = [
    (re.compile(r"(?:^|\.)vision_tower\..*?encoder\.layers\.(\d+)(?:\.|$)"), "vision.layers.{0}"),
    (re.compile(r"(?:^|\.)vision_tower\..*?(?:embeddings|pre_layrnorm)(?:\.|$)"),
     "vision.embeddings"),
    (re.compile(r"(?:^|\.)vision_tower(?:\.|$)"), "vision.post"),
    (re.compile(r"multi_modal_projector"), "projector"),
    (re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)"), "llm.layers.{0}"),
    (re.compile(r"embed_tokens|rotary_emb|^model$"), "llm.embed"),
    (re.compile(r"(?:^|\.)norm$|lm_head"), "llm.head"),
    (re.compile(r"^head$"), "head"),
]


def layer_of(module_name: str) -> str:
    """Layer a (dotted) module name belongs to; ``"loss"`` for the top level / loss code."""
    for pattern, fmt in _RULES:
        m = pattern.search(module_name)
        if m:
            return fmt.format(*m.groups())
    return "loss" if module_name == "" else "other"


@dataclass
class ModuleLayer:
    name: str
    params: int
    param_bytes: int
    trainable_params: int
    tensors: int
    numels: list[int]  # elements of each parameter tensor, in registration order


def decompose_module(model: nn.Module) -> dict[str, ModuleLayer]:
    """Exact per-layer parameter counts of ``model`` (shared parameters counted once)."""
    out: dict[str, ModuleLayer] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        layer = layer_of(name.rsplit(".", 1)[0])
        if layer == "loss":  # LLaVA's multimodal-merge level holds no parameters
            layer = "other"
        e = out.setdefault(layer, ModuleLayer(layer, 0, 0, 0, 0, []))
        e.params += p.numel()
        e.param_bytes += p.numel() * p.element_size()
        e.trainable_params += p.numel() if p.requires_grad else 0
        e.tensors += 1
        e.numels.append(p.numel())
    return out


def saved_by_layer(saved_by_module: dict[str, int]) -> dict[str, int]:
    """Aggregate the tracker's per-module saved bytes into layers."""
    out: dict[str, int] = defaultdict(int)
    for module, nbytes in saved_by_module.items():
        out[layer_of(module)] += nbytes
    return dict(out)
