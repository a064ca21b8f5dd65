"""CUDA autocast emulation: which dtype each op runs in while tracing on CPU."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from predictors.autocast import CudaAutocastEmulation, autocast_context, cuda_policy
from predictors.spec.precision import UnknownPrecisionError
from predictors.step import Batch, TrainingStep, trace_training_step


@pytest.fixture
def fake():
    with FakeTensorMode() as mode:
        yield mode


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matmuls_low_precision_reductions_fp32(fake, dtype):
    lin, norm = nn.Linear(16, 32), nn.LayerNorm(32)
    x = torch.randn(4, 16)
    with CudaAutocastEmulation(dtype):
        y = lin(x)
        mm = torch.matmul(y, y.t())
        bmm = torch.bmm(y[None], y.t()[None])
        attn = F.scaled_dot_product_attention(y[None, None], y[None, None], y[None, None])
        conv = F.conv2d(torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3))
        soft, total, normed = y.softmax(-1), y.sum(), norm(y)
        ce = F.cross_entropy(y, torch.zeros(4, dtype=torch.long))
        expo, relu = y.exp(), torch.relu(y)
    for t in (y, mm, bmm, attn, conv, relu):
        assert t.dtype == dtype
    for t in (soft, total, normed, ce, expo):
        assert t.dtype == torch.float32


def test_cpu_autocast_differs_from_cuda_rules(fake):
    """The reason the emulation exists: CPU autocast keeps softmax in bf16, CUDA does not."""
    x = torch.randn(4, 16)
    w = torch.randn(16, 16)
    with autocast_context("bf16", "cpu"):
        cpu_soft = (x @ w).softmax(-1)
    with autocast_context("bf16", "cuda"):
        cuda_soft = (x @ w).softmax(-1)
    assert cpu_soft.dtype == torch.bfloat16 and cuda_soft.dtype == torch.float32


def test_weight_cast_cached_once_per_region(fake):
    lin = nn.Linear(8, 8)
    casts = []
    mode = CudaAutocastEmulation(torch.bfloat16)
    with mode:
        lin(torch.randn(2, 8))
        casts.append(len(mode._cache))
        lin(torch.randn(2, 8))
        casts.append(len(mode._cache))
    assert casts == [2, 2] and not mode._cache  # weight+bias, reused, dropped at exit


def test_explicit_dtype_is_respected(fake):
    y = torch.randn(4, 4, dtype=torch.bfloat16)
    with CudaAutocastEmulation(torch.bfloat16):
        assert y.sum(dtype=torch.bfloat16).dtype == torch.bfloat16
    assert cuda_policy("linear") == "lower_precision_fp"
    assert cuda_policy("layer_norm") == "fp32"
    assert cuda_policy("relu") is None


def test_autocast_saves_low_precision_activations_for_backward():
    """Casts act above autograd: backward sees the bf16 copies, grads come back in fp32."""
    step = trace_training_step(
        lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)),
        lambda: Batch([torch.randn(2, 8)], torch.randint(0, 4, (2,))),
        "bf16",
    )
    assert all(p.dtype == torch.float32 for p in step.model.parameters())
    assert all(s["exp_avg"].dtype == torch.float32 for s in step.optimizer.state.values())


@pytest.mark.parametrize("name", ["bf16-pure", "fp16-mixed", "fp8"])
def test_step_dtypes_per_precision(name):
    step = trace_training_step(
        lambda: nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4)),
        lambda: Batch([torch.randn(4, 16)], torch.randint(0, 4, (4,))),
        name,
        steps=2,
    )
    low = step.precision.param_dtype
    assert all(p.dtype == low for p in step.model.parameters())
    state_dtype = torch.float32 if step.precision.master_weights_fp32 else low
    assert all(s["exp_avg"].dtype == state_dtype for s in step.optimizer.state.values())
    assert (step.scaler is not None) == step.precision.grad_scaler


def test_real_step_trains():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    step = TrainingStep(model, "fp16", target="cpu", lr=1e-2)
    x = torch.randn(64, 8)
    y = x.sum(1, keepdim=True)
    losses = [float(step(Batch([x], y))) for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]


def test_unknown_precision_named():
    with pytest.raises(UnknownPrecisionError, match="precision='int3'"):
        autocast_context("int3")


class _TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight  # tie_word_embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


@pytest.mark.parametrize("name", ["bf16-pure", "bf16-mixed"])
def test_low_precision_step_keeps_tied_weights_shared(name):
    step = trace_training_step(
        _TiedLM,
        lambda: Batch([torch.randint(0, 32, (2, 4))], torch.randint(0, 32, (2, 4))),
        name,
        steps=1,
    )
    model = step.model
    assert model.head.weight is model.embed.weight
    assert model.head.weight.dtype == torch.bfloat16
    assert len(step.params) == 1  # one tensor to optimize (and one fp32 master), not two copies
    assert len(step.optimizer.state) == 1


def _fp8_linear_kernels(name: str):
    """The aten ops of one fp8 linear's forward and backward under ``name``'s recipe, and the
    input's gradient."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from predictors.autocast import Fp8LinearEmulation
    from predictors.spec.precision import get_precision

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    lin = nn.Linear(32, 16).bfloat16()
    x = torch.randn(8, 32, dtype=torch.bfloat16, requires_grad=True)
    rec = Record()
    with rec, Fp8LinearEmulation(get_precision(name).recipe):
        lin(x).float().sum().backward()
    return rec.ops, x.grad


def test_rowwise_recipe_casts_again_in_backward():
    """torchao's rowwise scales lie along one axis, so backward re-casts the input, the weight
    and the gradient (once per axis): six amax passes and casts per linear where tensorwise
    current scaling has three; the GEMMs and their results are the same."""
    current, g_current = _fp8_linear_kernels("fp8-current")
    rowwise, g_rowwise = _fp8_linear_kernels("fp8-rowwise")
    assert current.count("linalg_vector_norm.default") == 3
    assert rowwise.count("linalg_vector_norm.default") == 6
    assert rowwise.count("_scaled_mm.default") == current.count("_scaled_mm.default") == 3
    assert torch.equal(g_current, g_rowwise)
