"""GPUMemNet's networks rebuilt from its rows (:mod:`predictors.datasets.gpumemnet`: the MLP set
and the CNN development rows, measured on an A100-40GB). Each MLP row is
``NeuroNetGen_scripts/MLP/mlp_next.py`` of github.com/itu-rad/GPUMemNet trained for 60 s in
fp32 with ``torch.optim.Adam(model.parameters())`` (torch's defaults: foreach on CUDA) and
``nn.CrossEntropyLoss`` (``nn.BCEWithLogitsLoss`` for one output).

:func:`build_mlp` and :func:`build_cnn` re-implement that generator's layer rules (our own code,
same arithmetic); every rebuilt network is checked against the row's published parameter
counts.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..datasets.gpumemnet import CNN_ARCHS, CnnRow, GpuMemNetFormatError, MlpRow

NUM_SAMPLES = 4096  # the generator's dummy dataset; the last batch of an epoch is smaller

ACTIVATIONS = {"relu": nn.ReLU, "leaky_relu": nn.LeakyReLU, "prelu": nn.PReLU, "elu": nn.ELU,
               "selu": nn.SELU, "tanh": nn.Tanh, "softplus": nn.Softplus, "swish": nn.SiLU,
               "mish": nn.Mish, "gelu": nn.GELU, "identity": nn.Identity}


def _widths(row: MlpRow) -> list[int]:
    """Output widths of the hidden Linear layers (the generator's rules per architecture)."""
    out, width, n = [], row.input, row.depth
    if row.arch == "uniform":
        return [row.input] * n
    if row.arch in ("pyramid", "bottleneck"):
        for _ in range(n + (row.arch == "bottleneck")):  # bottleneck: one more halving
            width = max(int(width * 0.5), row.output)
            out.append(width)
        return out
    if row.arch == "gradual":
        dec = (row.input - row.output) // n
        for _ in range(n):
            width = max(width - dec, row.output)
            out.append(width)
        return out
    raise GpuMemNetFormatError(f"arch={row.arch!r} is not one of the generator's architectures")


class GeneratedMLP(nn.Module):
    def __init__(self, row: MlpRow) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = row.input
        for w in _widths(row):
            layers.append(nn.Linear(width, w))
            if row.batchnorm:
                layers.append(nn.BatchNorm1d(w))
            layers.append(ACTIVATIONS[row.activation]())
            if row.dropout is not None:
                layers.append(nn.Dropout(row.dropout))
            width = w
        layers.append(nn.Linear(width, row.output))
        # one output: the generator picks Sigmoid or Identity at random (same memory class)
        layers.append(nn.Softmax(dim=1) if row.output > 1 else nn.Identity())
        self.model = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.view(x.size(0), -1))


def build_mlp(row: MlpRow) -> nn.Module:
    """The row's network; its per-layer parameter counts must equal the published ones."""
    model = GeneratedMLP(row)
    counts = tuple(sum(p.numel() for p in m.parameters()) for m in model.model
                   if isinstance(m, (nn.Linear, nn.BatchNorm1d)))
    if counts != row.layer_params:
        raise GpuMemNetFormatError(f"{row.name}: rebuilt layer parameters {counts[:6]}... differ "
                                   f"from the published {row.layer_params[:6]}...")
    return model


def network_elements(row: MlpRow) -> int:
    """Parameters plus one batch of layer outputs: how far a row is from an empty process."""
    return sum(row.layer_params) + row.batch * (row.input + sum(_widths(row)) + row.output)


def smallest_network(rows: tuple[MlpRow, ...]) -> int:
    """Index of the row closest to an empty process (CUDA + cuBLAS initialised, almost
    nothing allocated): the measurement the ``ampere`` CUDA-context size is read from."""
    return min(range(len(rows)), key=lambda i: (network_elements(rows[i]), i))


def bce_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The generator's loss for one output: BCE-with-logits on float labels."""
    return nn.functional.binary_cross_entropy_with_logits(output, target)


def example_batch(row: MlpRow) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) on the meta device, as the training loop moves them to the GPU."""
    x = torch.empty(row.batch, row.input, device="meta")
    if row.output > 1:
        return x, torch.empty(row.batch, dtype=torch.long, device="meta")
    return x, torch.empty(row.batch, 1, device="meta")


# --------------------------------------------------------------------------- conv nets
# GPUMemNet's CNN set, development rows only (dense, residual, uniform: 833 runs on the same
# A100-40GB, fp32 with PyTorch's defaults, Adam, ``nvidia-smi`` peaks), shipped as
# ``predictors/data/gpumemnet_cnn_dev.csv`` (CC BY 4.0, ``LICENSE.gpumemnet``). The networks are
# rebuilt by :func:`build_cnn` from the rules of the repository's ``cnn.py`` at commit f5a3f5d
# (our code, the same arithmetic), launched as its ``launcher_cnn.py`` does (no pooling flag).
MAX_FILTERS = 2048  # the generator's cap
DENSE_GROWTH = 32  # the generator's default growth rate, 4 layers per dense block


def _block(row: CnnRow, cin: int, cout: int, k: int = 3, stride: int = 1,
           act: str | None = None, dropout: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, stride, k // 2)]
    if row.batchnorm:
        layers.append(nn.BatchNorm2d(cout))
    layers.append(ACTIVATIONS[act or row.activation]())
    if dropout and row.dropout is not None:
        layers.append(nn.Dropout(row.dropout))
    return nn.Sequential(*layers)


class _Residual(nn.Module):
    def __init__(self, row: CnnRow, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(_block(row, cin, cout, stride=stride), _block(row, cout, cout))
        self.shortcut: nn.Module = nn.Identity()
        if cin != cout or stride != 1:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride),
                                          nn.BatchNorm2d(cout) if row.batchnorm else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the generator's order (ResidualBlock.forward): the shortcut first, then the body; it
        # decides the backward's order too (autograd runs the later branch first), so the
        # body's backward runs before the shortcut's and no partial input gradient waits
        # through it
        residual = self.shortcut(x)
        return self.body(x) + residual


class _Dense(nn.Module):
    def __init__(self, row: CnnRow, cin: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_block(row, cin + i * DENSE_GROWTH, DENSE_GROWTH)
                                    for i in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(torch.cat(features, 1)))
        return torch.cat(features, 1)


class _Transition(nn.Module):
    def __init__(self, row: CnnRow, cin: int) -> None:
        super().__init__()
        self.conv = _block(row, cin, cin // 2, k=1, act="relu", dropout=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        return nn.functional.avg_pool2d(x, 2) if x.shape[2] > 1 and x.shape[3] > 1 else x


class GeneratedCNN(nn.Module):
    def __init__(self, row: CnnRow, dense_pooling: int = 5) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        cin, side = row.channels, row.size
        if row.arch == "residual":
            growth = (MAX_FILTERS / row.base) ** (1 / row.depth)
            for i in range(row.depth // 2):
                cout = min(int(row.base * growth ** i), MAX_FILTERS)
                stride = 2 if i % 2 == 1 and side > 7 else 1
                blocks.append(_Residual(row, cin, cout, stride))
                cin = cout
                side = side // 2 if stride == 2 else side
                if side <= 7:
                    break
        elif row.arch == "dense":
            count = row.depth // 4
            for i in range(count):
                blocks.append(_Dense(row, cin))
                cin += 4 * DENSE_GROWTH
                if i % dense_pooling == 0 and i != count - 1:
                    blocks.append(_Transition(row, cin))
                    cin //= 2
        elif row.arch == "uniform":
            for _ in range(row.depth):
                blocks.append(_block(row, cin, row.base))
                cin = row.base
        else:
            raise GpuMemNetFormatError(f"arch={row.arch!r} is not one of {CNN_ARCHS}")
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, row.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.adaptive_avg_pool2d(self.blocks(x), 1)
        return torch.softmax(self.fc(torch.flatten(x, 1)), dim=1)


def build_cnn(row: CnnRow) -> nn.Module:
    """The row's network with the published total parameter count. A dense net's transition
    frequency was drawn at random by the generator (every ``ceil(depth / poolings)`` blocks or
    every 5, ``poolings = max(1, int(log2(size // 7)))``): the variant whose count matches."""
    if not row.runs:
        raise GpuMemNetFormatError(f"{row.name}: the generator fails before training")
    poolings = max(1, int(math.log2(row.size // 7)))
    variants = [5, max(1, math.ceil(row.depth / poolings))] if row.arch == "dense" else [5]
    for every in variants:
        with torch.device("meta"):
            model = GeneratedCNN(row, every)
        # the dataset counts PReLU's weight as 0 (as in its MLP set); a net without conv
        # blocks has an empty layer list there (0 parameters)
        if row.params == 0 and not len(model.blocks):
            return model
        if sum(p.numel() for m in model.modules() if not isinstance(m, nn.PReLU)
               for p in m.parameters(recurse=False)) == row.params:
            return model
    raise GpuMemNetFormatError(f"{row.name}: no rebuild has the published {row.params} "
                               "parameters")


def example_cnn_batch(row: CnnRow) -> tuple[torch.Tensor, torch.Tensor]:
    """(images, labels) on the meta device, as the training loop moves them to the GPU."""
    return (torch.empty(row.batch, row.channels, row.size, row.size, device="meta"),
            torch.empty(row.batch, dtype=torch.long, device="meta"))
