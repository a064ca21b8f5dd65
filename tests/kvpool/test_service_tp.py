"""Tensor parallelism over the pool service, two real rank processes (vLLM's worker-side role,
``PoolWorker``) and the scheduler side here (``RemotePool``): an MLA layout (the same latents on
every rank) is stored once, by rank 0, and loaded by both ranks byte for byte, in 1/TP of the
bytes a per-rank layout takes (per-rank shards over the service: the node benchmark's ``mla``
part; in process: ``test_tensor_parallel.py``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("vllm_kvpool._kvio")

from support.kvpool_node import run_tp, start_tp  # noqa: E402

pytestmark = pytest.mark.slow
TP = 2


def test_mla_is_stored_once_and_loaded_by_every_rank(tmp_path):
    daemon, cfg, layout, ranks = start_tp(tmp_path / "mla", True, TP)
    wrong, stored, committed = run_tp(daemon, cfg, layout, ranks)
    assert wrong == [0, 0]  # rank 1 reads rank 0's copy, byte for byte
    assert committed == [6, 0]  # one rank wrote each chunk
    assert stored == 6 * layout.slot_bytes  # one copy: 1/TP of a per-rank layout's bytes
