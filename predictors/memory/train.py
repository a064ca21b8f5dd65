"""Train the shipped residual model on all collected ground truth."""

from __future__ import annotations

from pathlib import Path

from .collect import GROUND_TRUTH_CSV
from .evaluate import load_rows
from .model import MemoryModel


def train_and_save(data: Path = GROUND_TRUTH_CSV) -> MemoryModel:
    rows = load_rows(data)
    gts = "+".join(sorted({r.ground_truth for r in rows}))
    model = MemoryModel.fit([(r.spec, r.cfg, r.measured) for r in rows],
                            trained_on=f"{data.name} ({len(rows)} rows, ground truth: {gts})")
    model.save()
    return model


if __name__ == "__main__":
    print(train_and_save().trained_on)
