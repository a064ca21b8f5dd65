"""GPUMemNet's data sets as rows: its MLP set (3,000 MLPs measured on an A100-40GB) and the
development rows of its CNN set (a development set; the networks are rebuilt by
:mod:`predictors.memory.gpumemnet`).

Source: github.com/itu-rad/GPUMemNet, ``Datasets/MLP/mlp_data_step2.csv`` and the CNN set's
dense/residual/uniform runs, by the GPUMemNet authors (ITU Copenhagen), CC BY 4.0
(https://creativecommons.org/licenses/by/4.0/); shipped as ``predictors/data/gpumemnet_mlp.csv``
and ``gpumemnet_cnn_dev.csv`` with ``LICENSE.gpumemnet`` beside them. The target of each row is
the maximum of ``nvidia-smi memory.used`` sampled once a second, i.e. device-level memory. Its
Transformer set and the other CNN rows are held out and never read here.
"""

from __future__ import annotations

import ast
import csv
import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

from predictors.datasets import data_path
from predictors.spec.model import ModelSpecError

DATA_ENV = "GPUMEMNET_DIR"
SHIPPED_CSV = data_path("gpumemnet_mlp.csv")
MLP_CSV = "mlp_data_step2.csv"  # the name in GPUMemNet's repository
CNN_CSV = data_path("gpumemnet_cnn_dev.csv")
CNN_ARCHS = ("dense", "residual", "uniform")
_NAME = re.compile(
    r"input:(?P<input>\d+)_output:(?P<output>\d+)_depth:(?P<depth>\d+)_arch:(?P<arch>\w+?)"
    r"_batch:(?P<batch>\d+)_act:(?P<act>\w+?)_dropout:(?P<rate>[\d.e-]+)_dropout:(?P<drop>True|"
    r"False)_batchnorm:(?P<bn>True|False)\.out$")

_CNN_NAME = re.compile(
    r"input_channels:(?P<ch>\d+)_num_classes:(?P<classes>\d+)_depth:(?P<depth>\d+)"
    r"_arch:(?P<arch>\w+?)_base_filters:(?P<base>\d+)_batch:(?P<batch>\d+)"
    r"_input_size:(?P<size>\d+)_act:(?P<act>\w+?)_dropout:(?P<rate>[\d.e-]+)"
    r"_dropout:(?P<drop>True|False)_batchnorm:(?P<bn>True|False)\.out$")

_COUNTED = ("linear", "batch_normalization")  # the dataset lists PReLU's weight as 0


class GpuMemNetFormatError(ModelSpecError):
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


@dataclass(frozen=True)
class CnnRow:
    channels: int
    classes: int
    depth: int
    arch: str
    base: int
    batch: int
    size: int  # square input side
    activation: str
    dropout: float | None
    batchnorm: bool
    params: int  # published total parameters
    measured_mib: float
    oom: bool  # Status OOM_CRASH

    @property
    def name(self) -> str:
        return (f"cnn {self.arch} depth{self.depth} base{self.base} {self.channels}x{self.size}"
                f"^2 batch{self.batch} {self.activation}{' bn' if self.batchnorm else ''}"
                f"{' dropout' if self.dropout is not None else ''}")

    @property
    def runs(self) -> bool:
        """The generator raises before training for inputs under 7 pixels (``log2`` of
        ``size // 7`` = 0) and for one class (``BCELoss`` on integer labels)."""
        return self.size >= 7 and self.classes > 1


def load_cnn_rows(path: Path = CNN_CSV) -> tuple[CnnRow, ...]:
    return _load_cnn(path)


@functools.lru_cache(maxsize=2)
def _load_cnn(path: Path) -> tuple[CnnRow, ...]:
    rows = []
    with path.open() as f:
        for i, r in enumerate(csv.DictReader(f)):
            m = _CNN_NAME.match(r["Filename"])
            if m is None or m["arch"] not in CNN_ARCHS:
                raise GpuMemNetFormatError(f"row {i}: Filename={r['Filename']!r} is not a "
                                           "development-set generator name")
            rows.append(CnnRow(int(m["ch"]), int(m["classes"]), int(m["depth"]), m["arch"],
                               int(m["base"]), int(m["batch"]), int(m["size"]), m["act"],
                               float(m["rate"]) if m["drop"] == "True" else None,
                               m["bn"] == "True", int(r["Total Parameters"]),
                               float(r["Max GPU Memory (MiB)"]), r["Status"] == "OOM_CRASH"))
    return tuple(rows)
