"""GPUMemNet's MLP dataset: 3,000 MLPs measured on an A100-40GB (a development set).

Source: github.com/itu-rad/GPUMemNet, ``Datasets/MLP/mlp_data_step2.csv``, by the GPUMemNet
authors (ITU Copenhagen), CC BY 4.0 (https://creativecommons.org/licenses/by/4.0/); shipped as
``predictors/data/gpumemnet_mlp.csv`` with ``LICENSE.gpumemnet`` beside it. Each row is
``NeuroNetGen_scripts/MLP/mlp_next.py`` of that repository trained for 60 s in fp32 with
``torch.optim.Adam(model.parameters())`` (torch's defaults: foreach on CUDA) and
``nn.CrossEntropyLoss`` (``nn.BCEWithLogitsLoss`` for one output); the target is the maximum
of ``nvidia-smi memory.used`` sampled once a second, i.e. device-level memory. Its CNN and
Transformer sets are held out and never read here.

:func:`build_mlp` re-implements that generator's layer rules (our own code, same arithmetic);
every rebuilt network is checked against the row's published per-layer parameter counts.
"""

from __future__ import annotations

import ast
import csv
import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .towers import MemorySpecError

DATA_ENV = "GPUMEMNET_DIR"
SHIPPED_CSV = Path(__file__).resolve().parent.parent / "data" / "gpumemnet_mlp.csv"
MLP_CSV = "mlp_data_step2.csv"  # the name in GPUMemNet's repository
NUM_SAMPLES = 4096  # the generator's dummy dataset; the last batch of an epoch is smaller

ACTIVATIONS = {"relu": nn.ReLU, "leaky_relu": nn.LeakyReLU, "prelu": nn.PReLU, "elu": nn.ELU,
               "selu": nn.SELU, "tanh": nn.Tanh, "softplus": nn.Softplus, "swish": nn.SiLU,
               "mish": nn.Mish, "gelu": nn.GELU, "identity": nn.Identity}
_NAME = re.compile(
    r"input:(?P<input>\d+)_output:(?P<output>\d+)_depth:(?P<depth>\d+)_arch:(?P<arch>\w+?)"
    r"_batch:(?P<batch>\d+)_act:(?P<act>\w+?)_dropout:(?P<rate>[\d.e-]+)_dropout:(?P<drop>True|"
    r"False)_batchnorm:(?P<bn>True|False)\.out$")


_COUNTED = ("linear", "batch_normalization")  # the dataset lists PReLU's weight as 0


class GpuMemNetFormatError(MemorySpecError):
    """A row whose file name or layer list does not follow the generator's format."""


@dataclass(frozen=True)
class MlpRow:
    input: int
    output: int
    depth: int
    arch: str
    batch: int
    activation: str
    dropout: float | None  # None: no dropout layers
    batchnorm: bool
    layer_params: tuple[int, ...]  # published parameters of each Linear / BatchNorm layer
    measured_mib: float  # max nvidia-smi memory.used

    @property
    def name(self) -> str:
        return (f"mlp in{self.input} out{self.output} depth{self.depth} {self.arch} "
                f"batch{self.batch} {self.activation}{' bn' if self.batchnorm else ''}"
                f"{' dropout' if self.dropout is not None else ''}")


def dataset_path() -> Path:
    """``$GPUMEMNET_DIR/mlp_data_step2.csv`` when set, else the copy shipped in
    ``predictors/data`` (licence: ``predictors/data/LICENSE.gpumemnet``)."""
    if DATA_ENV in os.environ:
        path = Path(os.environ[DATA_ENV]) / MLP_CSV
        if not path.exists():
            raise FileNotFoundError(f"{DATA_ENV}={os.environ[DATA_ENV]!r} has no {MLP_CSV}")
        return path
    return SHIPPED_CSV


def load_mlp_rows(path: Path | None = None) -> tuple[MlpRow, ...]:
    return _load(path or dataset_path())


@functools.lru_cache(maxsize=2)
def _load(path: Path) -> tuple[MlpRow, ...]:
    rows = []
    with path.open() as f:
        for i, r in enumerate(csv.DictReader(f)):
            m = _NAME.match(r["Filename"])
            if m is None:
                raise GpuMemNetFormatError(f"row {i}: Filename={r['Filename']!r} is not a "
                                           "generator name")
            layers = ast.literal_eval(r["Activations-Params"])
            rows.append(MlpRow(int(m["input"]), int(m["output"]), int(m["depth"]), m["arch"],
                               int(m["batch"]), m["act"],
                               float(m["rate"]) if m["drop"] == "True" else None,
                               m["bn"] == "True",
                               tuple(int(p) for k, _, p in layers if k in _COUNTED),
                               float(r["Max GPU Memory (MiB)"])))
    return tuple(rows)


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
