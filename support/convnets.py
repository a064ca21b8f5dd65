"""Conv nets as torchvision defines them, for memory ground truth and the predictor's tests.

torchvision cannot be installed beside this project's CPU torch (PyPI has only its CUDA build,
whose ``import torchvision`` fails on a CPU torch: ``operator torchvision::nms does not
exist``), so the architectures are written here layer for layer after torchvision 0.26's
``models/resnet.py`` (v1.5: stride on the 3x3 conv), ``models/densenet.py`` (the memory-hungry
default, ``memory_efficient=False``: every dense layer concatenates all earlier features) and
``models/vgg.py``, with the same in-place ReLUs and bias flags, so the parameter counts equal
torchvision's documented ones (the tests check them) and a GPU run with torchvision can compare
them too. ``unet`` is the common U-Net of Ronneberger et al. 2015 as most PyTorch ports write it
(double 3x3 conv + BN + ReLU, max-pool down, transposed-conv up, ``torch.cat`` skips).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# torchvision's documented parameter counts (weights' ``num_params`` in its model docs)
TORCHVISION_PARAMS = {"resnet18": 11_689_512, "resnet50": 25_557_032,
                      "densenet121": 7_978_856, "vgg16": 138_357_544}


def _conv_bn(cin: int, cout: int, k: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout)]


class _Residual(nn.Module):
    """A residual block: ``body`` plus the input (through a 1x1 conv + BN where the shape
    changes), summed in place as torchvision does, then ReLU."""

    def __init__(self, body: list[nn.Module], cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*body)
        self.down = (nn.Sequential(*_conv_bn(cin, cout, 1, stride))
                     if stride != 1 or cin != cout else None)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.down is None else self.down(x)
        out = self.body(x)
        out += identity
        return self.relu(out)


def _basic(cin: int, width: int, stride: int) -> _Residual:
    return _Residual([*_conv_bn(cin, width, 3, stride), nn.ReLU(inplace=True),
                      *_conv_bn(width, width, 3)], cin, width, stride)


def _bottleneck(cin: int, width: int, stride: int) -> _Residual:
    """v1.5: the stride on the 3x3 conv; output 4 x width."""
    return _Residual([*_conv_bn(cin, width, 1), nn.ReLU(inplace=True),
                      *_conv_bn(width, width, 3, stride), nn.ReLU(inplace=True),
                      *_conv_bn(width, 4 * width, 1)], cin, 4 * width, stride)


class ResNet(nn.Module):
    def __init__(self, block: Callable[[int, int, int], _Residual], expansion: int,
                 layers: tuple[int, ...], classes: int = 1000) -> None:
        super().__init__()
        mods: list[nn.Module] = [*_conv_bn(3, 64, 7, 2), nn.ReLU(inplace=True),
                                 nn.MaxPool2d(3, 2, 1)]
        cin = 64
        for i, n in enumerate(layers):
            width = 64 * 2 ** i
            for j in range(n):
                mods.append(block(cin, width, 2 if (i > 0 and j == 0) else 1))
                cin = width * expansion
        self.features = nn.Sequential(*mods)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1))


class _DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int, bn_size: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(inplace=True),
                                  nn.Conv2d(cin, bn_size * growth, 1, bias=False),
                                  nn.BatchNorm2d(bn_size * growth), nn.ReLU(inplace=True),
                                  nn.Conv2d(bn_size * growth, growth, 3, 1, 1, bias=False))

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        return self.body(torch.cat(features, 1))


class _DenseBlock(nn.Module):
    def __init__(self, layers: int, cin: int, growth: int, bn_size: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_DenseLayer(cin + i * growth, growth, bn_size)
                                    for i in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(features))
        return torch.cat(features, 1)


class DenseNet(nn.Module):
    def __init__(self, growth: int = 32, blocks: tuple[int, ...] = (6, 12, 24, 16),
                 init_features: int = 64, bn_size: int = 4, classes: int = 1000) -> None:
        super().__init__()
        mods: list[nn.Module] = [nn.Conv2d(3, init_features, 7, 2, 3, bias=False),
                                 nn.BatchNorm2d(init_features), nn.ReLU(inplace=True),
                                 nn.MaxPool2d(3, 2, 1)]
        c = init_features
        for i, n in enumerate(blocks):
            mods.append(_DenseBlock(n, c, growth, bn_size))
            c += n * growth
            if i != len(blocks) - 1:
                mods += [nn.BatchNorm2d(c), nn.ReLU(inplace=True),
                         nn.Conv2d(c, c // 2, 1, bias=False), nn.AvgPool2d(2, 2)]
                c //= 2
        mods.append(nn.BatchNorm2d(c))
        self.features = nn.Sequential(*mods)
        self.classifier = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.relu(self.features(x), inplace=True)
        out = torch.flatten(nn.functional.adaptive_avg_pool2d(out, 1), 1)
        return self.classifier(out)


class VGG(nn.Module):
    def __init__(self, cfg: tuple[int | str, ...], classes: int = 1000) -> None:
        super().__init__()
        mods: list[nn.Module] = []
        c = 3
        for v in cfg:
            if v == "M":
                mods.append(nn.MaxPool2d(2, 2))
            else:
                mods += [nn.Conv2d(c, int(v), 3, padding=1), nn.ReLU(inplace=True)]
                c = int(v)
        self.features = nn.Sequential(*mods)
        self.avgpool = nn.AdaptiveAvgPool2d(7)
        self.classifier = nn.Sequential(
            nn.Linear(c * 49, 4096), nn.ReLU(True), nn.Dropout(),
            nn.Linear(4096, 4096), nn.ReLU(True), nn.Dropout(), nn.Linear(4096, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def _double_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(*_conv_bn(cin, cout, 3), nn.ReLU(inplace=True),
                         *_conv_bn(cout, cout, 3), nn.ReLU(inplace=True))


class UNet(nn.Module):
    """Segmentation U-Net: ``depth`` poolings, widths ``base * 2**i``, one output map per
    class at the input's resolution."""

    def __init__(self, base: int = 64, depth: int = 4, classes: int = 2) -> None:
        super().__init__()
        widths = [base * 2 ** i for i in range(depth + 1)]
        self.down = nn.ModuleList([_double_conv(3, widths[0])] +
                                  [_double_conv(widths[i], widths[i + 1]) for i in range(depth)])
        self.up = nn.ModuleList(nn.ConvTranspose2d(widths[i + 1], widths[i], 2, 2)
                                for i in reversed(range(depth)))
        self.merge = nn.ModuleList(_double_conv(2 * widths[i], widths[i])
                                   for i in reversed(range(depth)))
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else nn.functional.max_pool2d(x, 2))
            skips.append(x)
        skips.pop()
        for up, merge in zip(self.up, self.merge, strict=True):
            x = merge(torch.cat([skips.pop(), up(x)], 1))
        return self.head(x)


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "resnet18": lambda: ResNet(_basic, 1, (2, 2, 2, 2)),
    "resnet50": lambda: ResNet(_bottleneck, 4, (3, 4, 6, 3)),
    "densenet121": lambda: DenseNet(),
    "vgg16": lambda: VGG((64, 64, "M", 128, 128, "M", 256, 256, 256, "M",
                          512, 512, 512, "M", 512, 512, 512, "M")),
    "unet": lambda: UNet(),
}


def build(name: str) -> nn.Module:
    if name not in BUILDERS:
        raise ValueError(f"model={name!r}: not one of {sorted(BUILDERS)}")
    return BUILDERS[name]()


def batch(name: str, size: int, image: int, device: str | torch.device = "cpu"
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """A training batch: images and class labels (per pixel for the U-Net)."""
    x = torch.randn(size, 3, image, image, device=device)
    if name == "unet":
        return x, torch.randint(0, 2, (size, image, image), device=device)
    return x, torch.randint(0, 1000, (size,), device=device)
