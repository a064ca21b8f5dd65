"""The traced step's dropout is CUDA's (``tracker.CudaDropout``): a bool mask saved, as the fused
``native_dropout`` keeps on the GPU, not the CPU path's fp32 noise."""

import torch
import torch.nn.functional as F

from predictors.memory.tracker import CudaDropout


def test_training_dropout_saves_a_bool_mask_like_cuda():
    x = torch.randn(64, 32, requires_grad=True)
    plain = F.dropout(x, 0.3, training=True)
    assert plain.grad_fn.name() == "MulBackward0"  # the CPU path: input * fp32 noise
    with CudaDropout():
        out = F.dropout(x, 0.3, training=True)
        layer = torch.nn.Dropout(0.3)(x)
        same = F.dropout(x, 0.0, training=True)
        evaluated = F.dropout(x, 0.3, training=False)
    for y in (out, layer):
        assert y.grad_fn.name() == "NativeDropoutBackward0"
        assert y.grad_fn._saved_result1.dtype == torch.bool  # the mask: 1 B per element
    assert same is x and evaluated is x
    out.sum().backward()
    kept = out != 0
    assert torch.allclose(x.grad[kept], torch.full_like(x.grad[kept], 1 / 0.7))
