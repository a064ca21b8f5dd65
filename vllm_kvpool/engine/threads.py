"""The engine's background threads: one daemon thread per concern running tasks in FIFO order."""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any

logger = logging.getLogger("vllm_kvpool")


class TaskThread:
    """One daemon thread running tasks in FIFO order; failures are logged, never dropped.

    (Not a ThreadPoolExecutor: those refuse work during interpreter shutdown, exactly when
    vLLM asks the connector to drain.)
    """

    def __init__(self, name: str) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        future.add_done_callback(_log_failure)
        self._tasks.put((future, fn, args, kwargs))
        return future

    def drain(self) -> None:
        """Until every task submitted so far has run."""
        self.submit(lambda: None).result()

    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            future, fn, args, kwargs = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter / logged
                future.set_exception(exc)

    def shutdown(self) -> None:
        self._tasks.put(None)
        self._thread.join()


def _log_failure(future: Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.error("kvpool: background transfer task failed", exc_info=future.exception())


def pop(items: deque) -> Any:
    """Next item of a deque two threads consume (``popleft`` is atomic), or None when empty."""
    try:
        return items.popleft()
    except IndexError:
        return None
