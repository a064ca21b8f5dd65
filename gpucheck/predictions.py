"""Predictions computed beside the measurements.

A prediction is CPU work (the predictors trace a step on fake tensors) that must not hold up
the GPU, whose minutes are the scarce resource: on a GPU run it runs in worker processes while
the part measures; on the dry run (2 cores) inline. Measured rows are written in grid order as
soon as their prediction is in; whatever is still missing when the part's budget runs out is
written without it (``pred_note`` says so; the row's spec and config are there to predict it
offline).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from gpucheck.common import Budget, RowWriter

Merge = Callable[[dict, dict], dict]


class Predictions:
    def __init__(self, predict: Callable[..., dict], merge: Merge, writer: RowWriter,
                 parallel: bool, max_workers: int = 6) -> None:
        self.predict, self.merge, self.writer = predict, merge, writer
        self.pool = None
        if parallel:  # leave cores to the measuring process and the GPU driver's threads
            workers = max(1, min(max_workers, (os.cpu_count() or 2) - 4))
            self.pool = ProcessPoolExecutor(workers,
                                            mp_context=multiprocessing.get_context("spawn"))
        self.futures: dict[Hashable, Future] = {}
        self.args: dict[Hashable, tuple] = {}
        self.pending: list[tuple[Hashable, dict]] = []

    def submit(self, key: Hashable, *args: Any) -> None:
        """Ask for a prediction now (before its measurement) so it overlaps with the GPU."""
        self.args[key] = args
        if self.pool is not None:
            self.futures[key] = self.pool.submit(self.predict, *args)

    def measured(self, key: Hashable, row: dict) -> None:
        self.pending.append((key, row))
        self.flush()

    def flush(self, wait_s: float = 0.0) -> None:
        """Write the measured rows, in order, whose prediction is ready (waiting ``wait_s``
        for each)."""
        while self.pending:
            key, row = self.pending[0]
            fut = self.futures.get(key)
            if fut is None:
                pred = self.predict(*self.args[key])
            elif not fut.done() and wait_s <= 0:
                return
            else:
                try:
                    pred = fut.result(timeout=wait_s)
                except Exception as exc:  # noqa: BLE001 - budget spent, or a worker died
                    pred = {"pred_note": "prediction not finished within the time budget "
                                         f"({type(exc).__name__}); predict offline"}
            self.writer.write(**self.merge(row, pred))
            self.pending.pop(0)

    def drain(self, budget: Budget, reserve: float = 3.0) -> None:
        while self.pending:
            self.flush(wait_s=max(0.5, budget.left() - reserve) / len(self.pending))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
