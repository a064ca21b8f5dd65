"""Test support for hybrid models (sliding-window + full-attention layers, vLLM's HMA).

* ``write_tiny_hybrid``: a local Llama config whose ``layer_types`` alternate
  ``sliding_attention`` / ``full_attention`` (vLLM's Llama reads ``layer_types`` and gives those
  layers a per-layer sliding window), with the seeded random O(1) weights of ``support.model``.
* ``HybridHarness``: vLLM's real Scheduler / KVCacheManager with the hybrid manager ON, the KV
  cache config grouped by vLLM's own ``get_kv_cache_groups`` and allocated by its worker's
  ``allocate_kv_cache`` (groups alias one backing buffer, as on a real worker); the fake forward
  writes every group's KV through that group's own block table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from support.model import write_tiny_llama
from support.vllm_harness import BLOCK_SIZE, HEAD_SIZE, NUM_KV_HEADS, Harness, kv_value

HYBRID_LAYERS = 4
SLIDING_WINDOW = 64  # tokens: with 32-token blocks the window needs 2 blocks at a hit position


def layer_types(num_layers: int = HYBRID_LAYERS) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def write_tiny_hybrid(directory: Path, num_layers: int = HYBRID_LAYERS,
                      sliding_window: int = SLIDING_WINDOW) -> Path:  # fmt: skip
    write_tiny_llama(directory, num_layers)
    config = json.loads((directory / "config.json").read_text())
    config.update(layer_types=layer_types(num_layers), sliding_window=sliding_window)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def hybrid_layer_names(num_layers: int = HYBRID_LAYERS) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]


def layer_specs(num_layers: int = HYBRID_LAYERS, sliding_window: int = SLIDING_WINDOW,
                hma: bool = True) -> dict[str, Any]:  # fmt: skip
    """Per-layer KV specs as the model's attention layers report them to vLLM."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    specs: dict[str, Any] = {}
    for name, kind in zip(hybrid_layer_names(num_layers), layer_types(num_layers), strict=True):
        common = dict(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                      dtype=torch.float32)  # fmt: skip
        if kind == "sliding_attention" and hma:
            specs[name] = SlidingWindowSpec(sliding_window=sliding_window, **common)
        else:  # HMA off: vLLM allocates sliding layers as full attention
            specs[name] = FullAttentionSpec(
                sliding_window=sliding_window if kind == "sliding_attention" else None, **common)
    return specs


def make_hybrid_kv_cache(vllm_config: Any, num_blocks: int, hma: bool = True):
    """(KVCacheConfig, per-layer KV views) exactly as vLLM groups and allocates them."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    vllm_config.cache_config.num_gpu_blocks_override = num_blocks
    vllm_config.cache_config.kv_cache_layout = "LBHNC"  # the engine core resolves it on CPU
    groups = get_kv_cache_groups(vllm_config, layer_specs(hma=hma))
    page = groups[0].kv_cache_spec.page_size_bytes
    config = get_kv_cache_config_from_groups(vllm_config, groups,
                                             page * num_blocks * HYBRID_LAYERS)  # fmt: skip
    assert config.num_blocks == num_blocks, config.num_blocks
    kv = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC)
    return config, kv


class HybridHarness(Harness):
    """``Harness`` over a multi-group KV cache: each group writes through its own blocks."""

    kv_config: Any = None

    @classmethod
    def build_hybrid(cls, vllm_config: Any, num_blocks: int = 256, hma: bool = True,
                     worker: bool = True) -> HybridHarness:  # fmt: skip
        kv_config, kv = make_hybrid_kv_cache(vllm_config, num_blocks, hma)
        h = cls.over(vllm_config, kv_config, kv)
        h.kv_config = kv_config
        return h

    @property
    def groups(self) -> list[Any]:
        return self.kv_config.kv_cache_groups

    def group_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return tuple(list(b) for b in self.scheduler.kv_cache_manager.get_block_ids(req_id))

    def _forward(self, out) -> None:
        """Every scheduled token's KV, per group into that group's block (never the null block)."""
        layer_index = {name: i for i, name in enumerate(hybrid_layer_names(len(self.kv)))}
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests[rid]
            per_group = self.group_block_ids(rid)
            start = req.num_computed_tokens - n
            for pos in range(start, start + n):
                token = req.all_token_ids[pos]
                for group, blocks in zip(self.groups, per_group, strict=True):
                    block = blocks[pos // BLOCK_SIZE]
                    assert block != 0, "vLLM scheduled a token into the null block"
                    for name in group.layer_names:
                        self.worker.wait_for_layer_load(name)
                        value = kv_value(layer_index[name], pos, token)
                        self.kv[name][block, :, pos % BLOCK_SIZE, :] = value
        for name, tensor in self.kv.items():
            self.worker.save_kv_layer(name, tensor, None)

    def expected_layer_block(self, name: str, tokens: list[int], block_index: int) -> torch.Tensor:
        li = hybrid_layer_names(len(self.kv)).index(name)
        t = torch.empty_like(self.kv[name][0])
        for off in range(BLOCK_SIZE):
            pos = block_index * BLOCK_SIZE + off
            t[:, off, :] = kv_value(li, pos, tokens[pos])
        return t
