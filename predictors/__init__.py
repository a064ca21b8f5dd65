"""Precision-aware training-time and multimodal peak-memory predictors.

Importing the package is cheap; the time predictor (torch, LightGBM) loads on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["predict_iteration_time"]


def __getattr__(name: str) -> Any:
    if name == "predict_iteration_time":
        from predictors.time.predictor import predict_iteration_time

        return predict_iteration_time
    raise AttributeError(f"module 'predictors' has no attribute {name!r}")
