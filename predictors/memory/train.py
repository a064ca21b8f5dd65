"""Train the shipped residual model on all collected ground truth, and register its margins
(the presets' families of work) in the shipped margins file."""

from __future__ import annotations

from pathlib import Path

from .collect import GROUND_TRUTH_CSV
from .evaluate import load_rows
from .model import POOLED, MemoryModel
from .verdict import MARGINS_JSON, MARGINS_NOTE, save_margins


def train_and_save(data: Path = GROUND_TRUTH_CSV) -> MemoryModel:
    rows = load_rows(data)
    gts = "+".join(sorted({r.ground_truth for r in rows}))
    model = MemoryModel.fit([(r.spec, r.cfg, r.measured) for r in rows],
                            trained_on=f"{data.name} ({len(rows)} rows, ground truth: {gts})")
    model.save()
    save_margins([m for f, m in model.margins.items() if f != POOLED], MARGINS_JSON, MARGINS_NOTE)
    return model


if __name__ == "__main__":
    print(train_and_save().trained_on)
