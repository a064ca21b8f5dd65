"""Loaders of the measured data sets in ``predictors/data`` (vTrain, the public fleet tables,
Megatron's weak-scaling table): each row becomes a run in the one vocabulary of
:mod:`predictors.spec` with its measured time. Nothing here predicts or fetches anything."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def data_path(name: str) -> Path:
    """A file shipped in ``predictors/data``."""
    return Path(str(resources.files("predictors") / "data" / name))
