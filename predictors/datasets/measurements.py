"""Reading ``predict collect`` measurement files (this machine's CPU times, the GPU kit's H200
times): one row per grid point, its fastest pass outside contention."""

from __future__ import annotations

from pathlib import Path

# the columns naming one grid point (a configuration measured several times)
KEY_COLUMNS = ["model", "seq", "precision", "micro_batch", "dp"]


def load_measurements(path: str | Path, max_canary_ratio: float = 3.0):
    """One row per grid point (pandas): its fastest pass, ignoring passes taken during a
    contention episode (canary slower than ``max_canary_ratio`` x the session's best)."""
    import pandas as pd

    df = pd.read_csv(path)
    df = df[df["canary_ratio"] <= max_canary_ratio]
    best = df.loc[df.groupby(KEY_COLUMNS)["seconds"].idxmin()]
    return best.sort_values(KEY_COLUMNS).reset_index(drop=True)
