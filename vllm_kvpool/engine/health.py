"""Device health on the worker: a medium that errs is marked failed (its chunks become misses
upstream) and is retried every ``retry_seconds`` off the step, on the reaper thread; once it
works again the scheduler is told and it takes new chunks."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from vllm_kvpool.engine.accounting import Accounts
from vllm_kvpool.engine.threads import TaskThread
from vllm_kvpool.handlers import MediumHandler

logger = logging.getLogger("vllm_kvpool")


class DeviceHealth:
    def __init__(self, tiers: Sequence[MediumHandler], accounts: Accounts, reaper: TaskThread,
                 retry_seconds: float) -> None:  # fmt: skip
        self.tiers = tiers
        self.accounts = accounts
        self.reaper = reaper
        self.retry_seconds = retry_seconds
        self._lock = threading.Lock()
        self._failed_at: dict[int, float] = {}  # failed device -> last recovery attempt
        self._recovering = False

    def failed(self, device: int, reason: str) -> None:
        handler = self.tiers[device]
        if handler.mark_failed(reason):
            logger.error("kvpool: device %s failed: %s", handler.name, reason)
        with self._lock:
            self._failed_at.setdefault(device, time.monotonic())
        self.accounts.device_failed(device, reason)

    def retry_due(self) -> None:
        """Give failed media a chance to come back (on the reaper thread, off the step)."""
        now = time.monotonic()
        with self._lock:
            due = [d for d, t in self._failed_at.items() if now - t >= self.retry_seconds]
            if not due or self._recovering:
                return
            self._recovering = True
            for d in due:
                self._failed_at[d] = now
        self.reaper.submit(self._recover, due)

    def _recover(self, devices: list[int]) -> None:
        try:
            for d in devices:
                if self.tiers[d].try_recover():
                    with self._lock:
                        self._failed_at.pop(d, None)
                    self.accounts.device_recovered(d)
        finally:
            with self._lock:
                self._recovering = False
