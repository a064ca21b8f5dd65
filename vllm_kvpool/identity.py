"""What a stored chunk's bytes depend on besides the KV layout: the model and the block hashing.

Two engines may only share chunks (across a restart too) when the same token prefix produces
the same KV bytes and the same block hashes: same weights, dtype/quantization, tensor and
pipeline parallel layout, and the same hash function and seed. ``engine_identity`` lists those
facts; the connector folds them into the pool fingerprint that every SSD index record carries,
so a chunk written under another model, dtype, block size or TP layout is never served.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _local_model_files(model: str) -> list[tuple[str, int, int]]:
    """(name, size, mtime_ns) of a local model directory's config and weight files: a model
    re-exported into the same directory gets a new identity."""
    path = Path(model)
    if not path.is_dir():
        return []
    out = []
    for f in sorted(path.iterdir()):
        if f.is_file() and (f.suffix in WEIGHT_SUFFIXES or f.name == "config.json"):
            st = f.stat()
            out.append((f.name, st.st_size, st.st_mtime_ns))
    return out


def block_hash_identity(vllm_config: Any) -> str:
    """The hash function and the seed vLLM derives its block-hash chain from. Cryptographic
    hashes use a fixed default seed unless PYTHONHASHSEED is set; non-cryptographic ones draw a
    random seed per process unless it is set, so their chunks cannot outlive the process."""
    algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        seed = "default" if algo.startswith("sha256") else "random:" + os.urandom(16).hex()
    return f"{algo}:{seed}"


def engine_identity(vllm_config: Any) -> list[object]:
    """Facts that change the KV bytes or the block hashes of a prefix (hashed by the caller)."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    files = _local_model_files(str(model.model))
    return [
        str(model.model), str(getattr(model, "revision", None)), str(model.dtype),
        str(getattr(model, "quantization", None)),
        str(getattr(vllm_config.cache_config, "cache_dtype", None)),
        hashlib.sha256(repr(files).encode()).hexdigest(),
        parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
        block_hash_identity(vllm_config),
    ]  # fmt: skip
