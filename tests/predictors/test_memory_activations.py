"""The traced (CPU, fake-tensor) step saves for backward what CUDA's autograd saves for each of
GPUMemNet's activations (``tools/autograd/derivatives.yaml``, the same formulas on both devices):
relu and tanh keep their output (the next conv's input, no extra bytes); elu/selu, gelu,
leaky_relu, mish, silu, softplus and prelu keep their input, one more layer-sized tensor. Issue
#45 suspected mish/selu/softplus/prelu/swish of under-saving in the trace; this pins that they
do not."""

import pytest
import torch
from torch import nn

from predictors.memory.gpumemnet import ACTIVATIONS
from predictors.memory.overheads import NONE
from predictors.memory.simulate import trace_step
from predictors.step import Batch

N, C, H = 4, 8, 16
LAYER = N * C * H * H * 4  # one fp32 layer output: 32 KiB, a multiple of the 512 B block


def _saved(activation: str) -> dict[str, int]:
    def build() -> nn.Module:
        return nn.Sequential(nn.Conv2d(C, C, 3, 1, 1, bias=False), ACTIVATIONS[activation](),
                             nn.Conv2d(C, C, 3, 1, 1, bias=False), nn.Flatten())

    def batch(model: nn.Module) -> Batch:
        return Batch((torch.empty(N, C, H, H),), torch.empty(N, C * H * H), {})

    m = trace_step(build, batch, "fp32", overheads=NONE, steps=1,
                   loss_fn=lambda out, target: (out * target).sum())
    return m.saved_by_module


@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_output_saving_activations_add_no_tensor(activation):
    # conv0's output dies in the activation; the activation's output is saved once (by itself
    # and conv1), conv1's output by the loss
    assert _saved(activation) == {"1": LAYER, "2": LAYER}


@pytest.mark.parametrize("activation",
                         ["elu", "selu", "gelu", "leaky_relu", "mish", "swish", "softplus",
                          "prelu"])
def test_input_saving_activations_keep_the_conv_output(activation):
    assert _saved(activation) == {"0": LAYER, "1": LAYER, "2": LAYER}
