"""Plain networks the ``predict memory`` CLI can describe in flags: MLPs and CNNs.

Anything else goes in as a module: ``--module package.module:factory`` (a zero-argument
callable returning an ``nn.Module``) or :func:`module.predict_module_memory` from Python.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..spec.model import ModelSpecError, UnknownModelError

ACTIVATIONS: dict[str, type[nn.Module]] = {
    "relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "tanh": nn.Tanh, "leaky_relu": nn.LeakyReLU,
    "elu": nn.ELU, "selu": nn.SELU, "softplus": nn.Softplus, "mish": nn.Mish, "prelu": nn.PReLU,
    "identity": nn.Identity}


def _activation(name: str) -> type[nn.Module]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ModelSpecError(f"activation={name!r} unknown; choose {', '.join(ACTIVATIONS)}"
                              ) from None


def _positive(**values: int) -> None:
    for k, v in values.items():
        if v < 1:
            raise ModelSpecError(f"{k}={v} must be >= 1")


@dataclass(frozen=True)
class MlpSpec:
    """Linear -> [BatchNorm1d] -> activation -> [Dropout] per hidden width, then a classifier."""

    input: int
    hidden: tuple[int, ...]
    classes: int
    activation: str = "relu"
    batchnorm: bool = False
    dropout: float = 0.0

    def __post_init__(self) -> None:
        _positive(input=self.input, classes=self.classes, **{
            f"hidden[{i}]": h for i, h in enumerate(self.hidden)})
        _activation(self.activation)

    def build(self) -> nn.Module:
        layers: list[nn.Module] = []
        width = self.input
        for h in self.hidden:
            layers.append(nn.Linear(width, h))
            if self.batchnorm:
                layers.append(nn.BatchNorm1d(h))
            layers.append(_activation(self.activation)())
            if self.dropout:
                layers.append(nn.Dropout(self.dropout))
            width = h
        layers.append(nn.Linear(width, self.classes))
        return nn.Sequential(*layers)

    def example(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.empty(batch, self.input, device="meta"),
                torch.empty(batch, dtype=torch.long, device="meta"))


@dataclass(frozen=True)
class CnnSpec:
    """Per stage: Conv2d(kernel, padding same) -> [BatchNorm2d] -> activation -> MaxPool(2);
    then global average pooling and a linear classifier (a VGG-style CNN)."""

    channels: tuple[int, ...]
    image_res: int = 224
    in_channels: int = 3
    kernel: int = 3
    classes: int = 1000
    activation: str = "relu"
    batchnorm: bool = True

    def __post_init__(self) -> None:
        _positive(image_res=self.image_res, in_channels=self.in_channels, kernel=self.kernel,
                  classes=self.classes, **{f"channels[{i}]": c
                                           for i, c in enumerate(self.channels)})
        _activation(self.activation)
        if self.image_res >> len(self.channels) < 1:
            raise ModelSpecError(f"image_res={self.image_res} is too small for "
                                  f"{len(self.channels)} pooling stages")

    def build(self) -> nn.Module:
        layers: list[nn.Module] = []
        c = self.in_channels
        for out in self.channels:
            layers.append(nn.Conv2d(c, out, self.kernel, padding=self.kernel // 2))
            if self.batchnorm:
                layers.append(nn.BatchNorm2d(out))
            layers += [_activation(self.activation)(), nn.MaxPool2d(2)]
            c = out
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, self.classes)]
        return nn.Sequential(*layers)

    def example(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.empty(batch, self.in_channels, self.image_res, self.image_res,
                            device="meta"),
                torch.empty(batch, dtype=torch.long, device="meta"))


def load_factory(path: str) -> Callable[[], nn.Module]:
    """``package.module:callable`` -> the callable (it must return an ``nn.Module``)."""
    mod_name, _, attr = path.partition(":")
    if not mod_name or not attr:
        raise UnknownModelError(f"module={path!r} must look like package.module:factory")
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UnknownModelError(f"module={path!r} cannot be loaded: {exc}") from None
    if not callable(factory):
        raise UnknownModelError(f"module={path!r} is not callable")
    return factory


def parse_shape(text: str) -> tuple[int, ...]:
    """``3x224x224`` -> (3, 224, 224)."""
    try:
        shape = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ModelSpecError(f"input_shape={text!r} must look like 3x224x224") from None
    _positive(**{f"input_shape[{i}]": d for i, d in enumerate(shape)})
    return shape


def parse_widths(text: str, field: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise ModelSpecError(f"{field}={text!r} must be a comma list of integers") from None
