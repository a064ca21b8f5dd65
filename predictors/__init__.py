"""Precision-aware training-time and multimodal peak-memory predictors."""
