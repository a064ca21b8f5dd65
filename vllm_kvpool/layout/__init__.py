"""The chunk layout: one shape for every model (a model without vLLM's hybrid manager is a
layout with one KV cache group), built by one factory (``build``) and bound to vLLM's KV tensors
on the worker (``kv``)."""

from vllm_kvpool.layout.build import (
    ModelGeometry,
    from_kv_caches,
    from_model,
    from_vllm,
    layout_fingerprint,
)
from vllm_kvpool.layout.chunk import (
    SLOT_ALIGNMENT,
    ChunkLayout,
    GroupLayout,
    Section,
    align_up,
    cdiv,
)
from vllm_kvpool.layout.kv import ChunkKV, GroupKV

__all__ = ["SLOT_ALIGNMENT", "ChunkKV", "ChunkLayout", "GroupKV", "GroupLayout", "ModelGeometry",
           "Section", "align_up", "cdiv", "from_kv_caches", "from_model", "from_vllm",
           "layout_fingerprint"]  # fmt: skip
