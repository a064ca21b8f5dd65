"""CUDA kernel choices whose memory differs from what the CPU kernels allocate, emulated.

``attention="flash"`` registers a ``transformers`` attention implementation, ``"cuda_fa2_memory"``,
that models FlashAttention-2 on CUDA: it saves q, k, v (GQA: k and v at their own head count,
no repeat), the output and the fp32 log-sum-exp ``(B, H, S)``; its backward allocates dq, dk,
dv and FA2's fp32 workspaces (``dq_accum`` of ``(B, S_round128, H, D)``, ``softmax_d`` of
``(B, H, S_round128)``). Like HF's flash-attention path it takes no mask (the traced inputs
are unpadded, so the mask is pure causal or none). The CPU kernels instead materialize a mask,
repeat k/v for GQA and keep other temporaries. Values are meaningless; only sizes matter.
"""

from __future__ import annotations

import torch
from torch.overrides import handle_torch_function, has_torch_function

ATTN_IMPL = "cuda_fa2_memory"  # no "flash" in the name: HF reserves those for hub kernels


def _round(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class _FlashAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        b, h, s, d = q.shape
        out = torch.empty(b, s, h, d, dtype=q.dtype, device=q.device)
        lse = torch.empty(b, h, s, dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        b, h, s, d = q.shape
        softmax_d = torch.empty(b, h, _round(s, 128), dtype=torch.float32, device=q.device)
        dq_accum = torch.empty(b, _round(s, 128), h, d, dtype=torch.float32, device=q.device)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del softmax_d, dq_accum
        return dq, dk, dv


def scaled_dot_product_attention(q, k, v):
    """Flash SDPA as a torch function, so autocast (and its CUDA emulation) casts its inputs to
    the low dtype by name, exactly as it casts ``F.scaled_dot_product_attention``."""
    if has_torch_function((q, k, v)):
        return handle_torch_function(scaled_dot_product_attention, (q, k, v), q, k, v)
    return _FlashAttentionFn.apply(q, k, v)


def cuda_flash_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                         is_causal=None, **kwargs):
    """HF attention-interface function: (B, H, S, D) inputs -> ((B, S, H, D) output, None)."""
    return scaled_dot_product_attention(query, key, value), None


def _no_mask(*args, **kwargs):
    return None


def register() -> str:
    """Register the emulation with transformers (idempotent); returns its implementation name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTN_IMPL, cuda_flash_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPL, _no_mask)
    return ATTN_IMPL
