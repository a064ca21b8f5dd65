"""fp16 measurements of a step the GradScaler skipped are not ground truth (``evaluate.skipped_step``):
on the committed H200 rows each is below its fused-AdamW twin, which holds the Adam states."""

import csv

from predictors.memory.collect import GROUND_TRUTH_CSV
from predictors.memory.evaluate import load_rows, skipped_step


def test_skipped_fp16_steps_are_below_their_fused_twins_and_left_out():
    with GROUND_TRUTH_CSV.open() as f:
        rows = list(csv.DictReader(f))
    skipped = [r for r in rows if skipped_step(r)]
    assert skipped and all('"precision": "fp16"' in r["key"] for r in skipped)
    by_key = {r["key"]: r for r in rows}
    for r in skipped:
        twin = by_key[r["key"].rsplit("|", 1)[0] + "|fused"]
        assert int(r["peak_allocated"]) <= int(twin["peak_allocated"])
    assert len(load_rows()) == len(rows) - len(skipped)
    # bf16 autocast (no GradScaler): the optimizer implementation is measured, not skipped
    assert not any(skipped_step(r) for r in rows if '"precision": "bf16"' in r["key"])
