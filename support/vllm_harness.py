"""Drive vLLM's REAL Scheduler / KVCacheManager and the worker-side connector by hand on CPU.

The scheduler, its KV cache manager, requests and block hashing are vLLM's own classes; the KV
tensors are carved by vLLM's ``create_kv_cache_views``. Only the model forward is replaced: a
"forward" writes a deterministic value per (layer, token position, token id) into the slots vLLM
scheduled, then calls the connector hooks in the order vLLM's model runner does.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from support.model import TINY
from support.serving import BLOCK_SIZE, transfer_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")

NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE = TINY.layers, TINY.kv_heads, TINY.head_dim


def make_vllm_config(model_dir: Path, pool: dict[str, Any], max_batched_tokens: int = 2048,
                     extra: dict[str, Any] | None = None, prefix_caching: bool = False):  # fmt: skip
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,  # fmt: skip
        VllmConfig,
    )

    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", seed=0,
                        max_model_len=4096)  # fmt: skip
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_batched_tokens,
                            max_model_len=4096, is_encoder_decoder=False,
                            enable_chunked_prefill=True)  # fmt: skip
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching)
    transfer = KVTransferConfig(**transfer_config(pool, **(extra or {})))
    return VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache,
                      kv_transfer_config=transfer, device_config=DeviceConfig("cpu"))  # fmt: skip


def layer_names(num_layers: int = NUM_LAYERS) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]


def make_kv_cache(num_blocks: int, layout_name: str = "LBHNC", page_aligned: bool = False):
    """KVCacheConfig + per-layer KV views exactly as vLLM's worker lays them out
    (``page_aligned``: the raw tensor at a page boundary, as torch allocates it under
    THP_MEM_ALLOC_ENABLE=1, so SSD reads may land in the KV pages directly)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheLayout,
        KVCacheTensor,
        create_kv_cache_views,  # fmt: skip
    )

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                             head_size=HEAD_SIZE, dtype=torch.float32)  # fmt: skip
    page, names = spec.page_size_bytes, layer_names()
    layout = KVCacheLayout[layout_name]
    if layout.is_layer_compact:
        layer_stride, block_stride = page * num_blocks, page
    else:  # block-outermost: one block's pages of all layers are one run
        layer_stride, block_stride = page, page * len(names)
    tensor = KVCacheTensor(size=page * num_blocks * len(names), layers=names,
                           layer_stride=layer_stride, block_stride=block_stride)  # fmt: skip
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[tensor],
                           kv_cache_groups=[KVCacheGroupSpec(names, spec)])  # fmt: skip
    raw = torch.zeros(tensor.size + 8192, dtype=torch.int8)
    # Not page aligned: 64 B past a page, torch's own alignment (which may land on a page).
    start = (-raw.data_ptr()) % 4096 + (0 if page_aligned else 64)
    raw = raw[start : start + tensor.size]
    views = create_kv_cache_views(raw, spec, num_blocks, layout, tensor)
    return config, dict(zip(names, views, strict=True))


RANK_OFFSET = 1_000_000  # tensor-parallel rank r's shard holds kv_value + r * RANK_OFFSET


def kv_value(layer: int, position: int, token: int, rank: int = 0) -> float:
    return float(rank * RANK_OFFSET + layer * 100000 + position * 10 + token % 7) + 0.5


@dataclass
class Harness:
    """One scheduler + one worker connector + the KV tensors, stepped by hand; with
    ``tensor_parallel``, one worker connector and KV shard per rank."""

    scheduler: Any
    worker: Any  # rank 0's
    kv: dict[str, torch.Tensor]  # rank 0's
    peers: list[tuple[Any, dict[str, torch.Tensor]]] = field(default_factory=list)  # ranks 1..
    aggregator: Any = None  # vLLM's KVOutputAggregator over the ranks' outputs
    requests: dict[str, Any] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    kv_stats: list[dict] = field(default_factory=list)  # what vLLM's stats logger receives
    steps: int = 0

    @classmethod
    def build(cls, vllm_config, num_blocks: int = 256, layout: str = "LBHNC",
              page_aligned: bool = False) -> Harness:  # fmt: skip
        kv_config, kv = make_kv_cache(num_blocks, layout, page_aligned)
        return cls.over(vllm_config, kv_config, kv)

    @classmethod
    def over(cls, vllm_config: Any, kv_config: Any, kv: dict[str, torch.Tensor]) -> Harness:
        """vLLM's real scheduler and a worker-role connector over these KV tensors."""
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        vllm_config.cache_config.num_gpu_blocks = kv_config.num_blocks
        scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_config, log_stats=True,
                              structured_output_manager=StructuredOutputManager(vllm_config),
                              block_size=BLOCK_SIZE)  # fmt: skip
        worker = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER,
                                                     kv_config)  # fmt: skip
        worker.register_kv_caches(kv)
        return cls(scheduler, worker, kv)

    @classmethod
    def tensor_parallel(cls, vllm_config: Any, tp: int, num_blocks: int = 256) -> Harness:
        """``tp`` ranks in one process: rank r's worker connector built as it is in rank r's
        process (where torch.distributed says r) over its own KV shard, whose forward writes
        ``kv_value(..., rank=r)``; the ranks' outputs merged by vLLM's KVOutputAggregator, as
        vLLM's multiprocess executor merges them."""
        from unittest import mock

        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        vllm_config.parallel_config.tensor_parallel_size = tp
        vllm_config.parallel_config.world_size = tp
        kv_config, kv = make_kv_cache(num_blocks)
        h = cls.over(vllm_config, kv_config, kv)
        for rank in range(1, tp):
            _, shard = make_kv_cache(num_blocks)
            with mock.patch("vllm_kvpool.connector._world", return_value=(rank, tp)):
                w = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER,
                                                        kv_config)  # fmt: skip
            w.register_kv_caches(shard)
            h.peers.append((w, shard))
        h.aggregator = KVOutputAggregator(expected_finished_count=tp)
        return h

    @property
    def ranks(self) -> list[tuple[Any, dict[str, torch.Tensor]]]:
        """(worker connector, KV) of every rank, rank 0 first."""
        return [(self.worker, self.kv), *self.peers]

    @property
    def connector(self):
        return self.scheduler.connector

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 1) -> Any:
        request = self.make_request(req_id, tokens, max_tokens)
        self.scheduler.add_request(request)
        self.requests[req_id] = request
        return request

    @staticmethod
    def make_request(req_id: str, tokens: list[int], max_tokens: int = 1) -> Any:
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return Request(req_id, list(tokens), params, None,
                       block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))  # fmt: skip

    def block_ids(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def step(self) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        workers = [w for w, _ in self.ranks]
        for w in workers:
            w.bind_connector_metadata(out.kv_connector_metadata)
            if out.has_sync_kv_loads:
                w.start_load_kv(None)
        self._forward(out)
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.requests[rid]
            done = req.num_computed_tokens >= req.num_tokens  # schedule() already advanced it
            sampled.append([7] if done else [])
        outputs = []
        for w in workers:
            if not out.has_sync_kv_loads:
                w.start_load_kv(None)
            w.wait_for_save()
            done = w.get_transfer_results(out.finished_req_ids)  # as vLLM's model runner asks
            kv_out = KVConnectorOutput(finished_sending=done.finished_sending,
                                       finished_recving=done.finished_recving,
                                       failed_recving=done.failed_recving,
                                       invalid_block_ids=w.get_block_ids_with_load_errors(),
                                       kv_connector_worker_meta=w.build_connector_worker_meta())  # fmt: skip
            w.clear_connector_metadata()
            outputs.append(ModelRunnerOutput(req_ids=req_ids,
                                             req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                             sampled_token_ids=sampled, kv_connector_output=kv_out))  # fmt: skip
        runner_out = self.aggregator.aggregate(outputs) if self.aggregator else outputs[0]
        engine_outputs = self.scheduler.update_from_output(out, runner_out)
        for eo in engine_outputs.values():
            stats = eo.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                self.kv_stats.append(stats.kv_connector_stats)
            for o in eo.outputs:
                if o.finish_reason is not None:
                    self.finished.add(o.request_id)
        self.steps += 1
        if not out.num_scheduled_tokens:
            # Idle step (waiting on the connector): let its transfers finish, so how many steps
            # a request takes does not depend on how busy the machine is.
            for w in workers:
                w.engine.wait_all()
        return out

    def _forward(self, out) -> None:
        """Write this step's KV for every scheduled token, then the per-layer save hook."""
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests[rid]
            blocks = self.block_ids(rid)
            start = req.num_computed_tokens - n  # schedule() already counted this step's tokens
            for pos in range(start, start + n):
                token = req.all_token_ids[pos]
                block, offset = blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE
                for rank, (w, kv) in enumerate(self.ranks):
                    for li, name in enumerate(kv):
                        w.wait_for_layer_load(name)
                        kv[name][block, :, offset, :] = kv_value(li, pos, token, rank)
        for w, kv in self.ranks:
            for name, tensor in kv.items():
                w.save_kv_layer(name, tensor, None)

    def run(self, until: Iterable[str], max_steps: int = 200) -> None:
        want = set(until)
        for _ in range(max_steps):
            if want <= self.finished and not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError(f"requests {want - self.finished} did not finish")

    def drain(self) -> None:
        """Let async saves finish and be acknowledged (the scheduler keeps stepping)."""
        for w, _ in self.ranks:
            w.engine.wait_all()
        for _ in range(5):
            self.step()

    def expected_block(self, tokens: list[int], block_index: int,
                       rank: int = 0) -> dict[str, torch.Tensor]:  # fmt: skip
        """The KV content a block must hold for ``tokens`` on ``rank`` (what the forward writes)."""
        out = {}
        for li, name in enumerate(self.kv):
            t = torch.empty_like(self.kv[name][0])
            for off in range(BLOCK_SIZE):
                pos = block_index * BLOCK_SIZE + off
                t[:, off, :] = kv_value(li, pos, tokens[pos], rank)
            out[name] = t
        return out


def corrupt_on_disk(handler: Any, slot: int, offset: int = 100) -> None:
    """Flip one byte of the chunk in ``slot`` of a file-backed SSD handler, behind its back."""
    with open(handler.target, "r+b") as f:  # this rank's file
        f.seek(handler.offset(slot) + offset)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


@contextlib.contextmanager
def ssd_writes_held(engine: Any) -> Iterator[None]:
    """Inside, a transfer engine's SSD writes do not complete (a busy device): its reaper
    thread waits before reaping them, host-memory writes complete as usual. They complete on
    exit (their commits reach the scheduler with a later step's worker report)."""
    saves, gate = engine.saves, threading.Event()
    reap = saves._reap_writes

    def held(device: int, *args: Any) -> None:
        if not engine.tiers[device].resident:
            gate.wait()
        reap(device, *args)

    saves._reap_writes = held
    try:
        yield
    finally:
        gate.set()
        del saves._reap_writes  # the class's again (writes already queued pass the open gate)
