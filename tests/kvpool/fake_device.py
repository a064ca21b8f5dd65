"""A fake accelerator for ``device_copy``: the real ``DeviceCopier`` plans and dispatch, its
device calls recorded and performed on CPU tensors."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import torch

from vllm_kvpool.device_copy import DeviceCopier


class FakeDevice(DeviceCopier):
    def __init__(self, short_run_bytes: int | None = None) -> None:
        super().__init__()
        if short_run_bytes is not None:
            self.short_run_bytes = short_run_bytes
        self.calls: list[tuple[Any, ...]] = []
        self.pinned: dict[int, int] = {}  # address -> bytes, registered now
        self._events = itertools.count(1)
        self._rec = threading.Lock()
        self._local = threading.local()

    def _log(self, *call: Any) -> None:
        with self._rec:
            self.calls.append(call)

    def of(self, kind: str) -> list[tuple[Any, ...]]:
        with self._rec:
            return [c for c in self.calls if c[0] == kind]

    def clear(self) -> None:
        with self._rec:
            self.calls.clear()

    # -- device calls ------------------------------------------------------------------------
    def fence(self) -> Any:
        mark = ("fence", next(self._events))
        self._log("fence", mark)
        return mark

    def _register(self, address: int, nbytes: int) -> bool:
        self._log("register", address, nbytes)
        self.pinned[address] = nbytes
        return True

    def _unregister(self, address: int, nbytes: int) -> None:
        self._log("unregister", address, nbytes)
        assert self.pinned.pop(address) == nbytes

    @contextlib.contextmanager
    def _side(self) -> Iterator[None]:
        self._local.side = True
        try:
            yield
        finally:
            self._local.side = False

    def _on_side(self) -> bool:
        return getattr(self._local, "side", False)

    def _record(self) -> Any:
        assert self._on_side()
        mark = ("event", next(self._events))
        self._log("record", mark)
        return mark

    def _wait_mark(self, mark: Any) -> None:
        self._log("wait", mark, "side" if self._on_side() else "forward")

    def _sync(self) -> None:
        self._log("sync")

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        assert self._on_side() and src.is_contiguous() and dst.shape == src.shape
        lo = src.data_ptr()
        hi = lo + src.numel() * src.element_size()
        pinned = any(a <= lo and hi <= a + n for a, n in self.pinned.items())
        self._log("copy", dst.untyped_storage().data_ptr(), hi - lo, pinned)
        dst.copy_(src)

    def _gather(self, kv: torch.Tensor, pages: torch.Tensor, stage: torch.Tensor) -> None:
        assert self._on_side()
        self._log("gather", kv.untyped_storage().data_ptr(), len(pages))
        super()._gather(kv, pages, stage)
