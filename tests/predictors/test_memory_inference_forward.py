"""``inference_forward``: the forward ``torchinfo.summary(model, input_size=...)`` runs before
training (GPUMemNet's ``cnn.py`` calls it at the training batch on the GPU): eval mode under
``no_grad`` (torchinfo/torchinfo.py, ``summary``), the model's mode restored after. Nothing is
saved, but its blocks stay in the cache."""

import torch
from torch import nn

from predictors.memory.overheads import NONE
from predictors.memory.simulate import trace_step
from predictors.step import Batch

MiB = 2**20
B, N = 3072, 1024  # fp32 input 12 MiB; Linear(N, 2N) weight 8 MiB, output 24 MiB


class _Recorder(nn.Module):
    """A Linear that records the mode and grad state of every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(N, 2 * N, bias=False)
        self.calls: list[tuple[bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append((self.training, torch.is_grad_enabled()))
        return self.fc(x)


def _trace(steps: int, inference_forward: bool) -> tuple:
    built: list[_Recorder] = []

    def build() -> nn.Module:
        built.append(_Recorder())
        return built[-1]

    def batch(model: nn.Module) -> Batch:
        return Batch((torch.empty(B, N),), torch.empty(()), {})

    m = trace_step(build, batch, "fp32", overheads=NONE, steps=steps,
                   loss_fn=lambda out, target: out.sum() * target,
                   inference_forward=inference_forward)
    return m, built[0]


def test_runs_in_eval_mode_without_grad_and_restores_training():
    _, model = _trace(steps=1, inference_forward=True)
    assert model.calls == [(False, False), (True, True)]
    assert model.training


def test_its_blocks_stay_cached():
    # by hand, CUDACachingAllocator.cpp's rules: the 8 MiB weight opens a 20 MiB segment
    # (1-10 MiB requests, kLargeBuffer) and is split off it; the 12 MiB input takes the 12 MiB
    # remainder (best fit); the 4 B target (the batch function's; torchinfo makes none) a
    # 2 MiB small-pool segment; the 24 MiB output a segment of its own. The forward returns,
    # its blocks are freed, and stay reserved.
    m, _ = _trace(steps=0, inference_forward=True)
    assert m.peak_allocated == (8 + 12 + 24) * MiB + 512
    assert m.peak_reserved == (20 + 2 + 24) * MiB


def test_saves_nothing_for_the_training_step():
    with_it, _ = _trace(steps=1, inference_forward=True)
    without, _ = _trace(steps=1, inference_forward=False)
    assert with_it.peak_allocated == without.peak_allocated
    assert with_it.breakdown == without.breakdown
