"""Traced FLOPs / bytes / dtypes against closed forms."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from predictors.step import Batch
from predictors.time.trace import Trace, trace_step


def _trace(model_fn, batch_fn, precision="fp32", target="cuda", loss=None) -> Trace:
    kw = {"loss_fn": loss} if loss else {}
    return trace_step(model_fn, batch_fn, precision, target=target, **kw)


def _sum_loss(out, _):
    return out.float().sum()


def test_linear_flops_closed_form():
    n, i, o = 32, 64, 48
    tr = _trace(
        lambda: nn.Linear(i, o),
        lambda: Batch([torch.randn(n, i)], torch.randn(n, o)),
        loss=_sum_loss,
    )
    fwd = tr.total(op_class="matmul", phase="forward")
    bwd = tr.total(op_class="matmul", phase="backward")
    assert fwd == 2 * n * i * o
    assert bwd == 2 * n * i * o  # weight grad only: the input is data, it needs no grad


def test_two_linears_backward_includes_input_grad():
    n, i, h, o = 16, 32, 64, 8
    tr = _trace(
        lambda: nn.Sequential(nn.Linear(i, h), nn.Linear(h, o)),
        lambda: Batch([torch.randn(n, i)], torch.randn(n, o)),
        loss=_sum_loss,
    )
    assert tr.total(op_class="matmul", phase="forward") == 2 * n * (i * h + h * o)
    # first layer: weight grad; second: weight grad + input grad
    assert tr.total(op_class="matmul", phase="backward") == 2 * n * (i * h + 2 * h * o)


class _Attention(nn.Module):
    def __init__(self, d: int, causal: bool) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.causal = causal

    def forward(self, q):
        q = q * self.scale
        return F.scaled_dot_product_attention(q, q, q, is_causal=self.causal)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cpu_flash_attention_flops_registered(precision):
    b, h, s, d = 2, 4, 64, 32
    tr = _trace(
        lambda: _Attention(d, causal=False),
        lambda: Batch([torch.randn(b, h, s, d)], torch.randn(b, h, s, d)),
        precision=precision,
        target="cpu",
        loss=_sum_loss,
    )
    attn = [r for r in tr.records if r.op_class == "attention"]
    assert {r.name for r in attn} == {
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
    }
    fwd = tr.total(op_class="attention", phase="forward")
    bwd = tr.total(op_class="attention", phase="backward")
    assert fwd == 4 * b * h * s * s * d  # QK^T and PV
    assert bwd == 10 * b * h * s * s * d  # flash recomputes QK^T, then dV, dP, dQ, dK
    expected = "bfloat16" if precision == "bf16" else "float32"
    assert all(r.dtype == expected for r in attn)


def test_causal_flag_recorded():
    tr = _trace(
        lambda: _Attention(16, causal=True),
        lambda: Batch([torch.randn(1, 2, 32, 16)], torch.randn(1, 2, 32, 16)),
        target="cpu",
        loss=_sum_loss,
    )
    assert all(r.causal for r in tr.records if r.op_class == "attention")


def test_conv_flops_closed_form():
    n, cin, cout, hw, k = 4, 3, 8, 16, 3
    tr = _trace(
        lambda: nn.Conv2d(cin, cout, k, padding=1),
        lambda: Batch([torch.randn(n, cin, hw, hw)], torch.randn(n, cout, hw, hw)),
        loss=_sum_loss,
    )
    fwd = 2 * n * cout * hw * hw * cin * k * k
    assert tr.total(op_class="conv", phase="forward") == fwd
    assert tr.total(op_class="conv", phase="backward") == fwd  # weight grad only


def test_mixed_precision_inserts_casts_and_uses_tensor_cores():
    model = lambda: nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 16))  # noqa: E731
    batch = lambda: Batch([torch.randn(32, 64)], torch.randint(0, 16, (32,)))  # noqa: E731
    fp32, bf16 = _trace(model, batch, "fp32"), _trace(model, batch, "bf16")
    assert fp32.total("bytes", op_class="cast") == 0
    assert bf16.total("bytes", op_class="cast") > 0
    mm = [r for r in bf16.records if r.op_class == "matmul"]
    assert all(r.dtype == "bfloat16" and r.tensor_core for r in mm)
    norms = [r for r in bf16.records if r.op_class == "norm"]
    assert norms and all(r.dtype == "float32" for r in norms)  # CUDA autocast: layer_norm fp32
    assert not any(r.tensor_core for r in fp32.records)
    # same math, half the matmul operand bytes
    assert bf16.total("flops", op_class="matmul") == fp32.total("flops", op_class="matmul")
    assert bf16.total("bytes", op_class="matmul") < fp32.total("bytes", op_class="matmul")


def test_optimizer_work_on_master_weights():
    model = lambda: nn.Linear(64, 32)  # noqa: E731
    batch = lambda: Batch([torch.randn(8, 64)], torch.randn(8, 32))  # noqa: E731
    n = 64 * 32 + 32
    pure = _trace(model, batch, "bf16-pure", loss=_sum_loss)
    mixed = _trace(model, batch, "bf16-mixed", loss=_sum_loss)
    adam = [r for r in mixed.records if r.name == "_fused_adamw_"]
    assert len(adam) == 1 and adam[0].dtype == "float32"  # AdamW on the fp32 masters
    # read p, g, m, v and write p, m, v: 7 fp32 tensors of n elements (+ step counters)
    assert adam[0].bytes == pytest.approx(7 * 4 * n, rel=0.01)
    pure_adam = [r for r in pure.records if r.name == "_fused_adamw_"]
    assert pure_adam[0].bytes == pytest.approx(7 * 2 * n, rel=0.01)
    # masters cost casts: grads up to fp32, weights back down
    casts = [r for r in mixed.records if r.phase == "optimizer" and r.op_class == "cast"]
    assert len(casts) == 4


def test_batch_extrapolation_matches_direct_trace():
    model = lambda: nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))  # noqa: E731
    t = {b: _trace(model, lambda b=b: Batch([torch.randn(b, 32)], torch.randn(b, 8)),
                   loss=_sum_loss) for b in (1, 2, 5)}  # fmt: skip
    est = t[1].scaled(t[2], 4)
    assert est.total("flops") == pytest.approx(t[5].total("flops"))
    assert est.total("bytes") == pytest.approx(t[5].total("bytes"))


def test_intensity():
    tr = _trace(lambda: nn.Linear(256, 256), lambda: Batch([torch.randn(256, 256)],
                torch.randn(256, 256)), loss=_sum_loss)  # fmt: skip
    mm = next(r for r in tr.records if r.op_class == "matmul")
    assert mm.intensity == pytest.approx(mm.flops / mm.bytes)
    assert mm.intensity > 10  # a square GEMM is compute-bound; elementwise ops are not
    assert all(r.intensity < 1 for r in tr.records if r.op_class == "elementwise")
