"""The kit's conv nets are torchvision's architectures (parameter counts as torchvision
documents them) and train through the kit's real step and the predictor's default loss."""

import pytest
import torch

from gpucheck.steps import RealStep
from predictors.step import default_loss, per_pixel_classes
from support import convnets


@pytest.mark.parametrize("name", sorted(convnets.TORCHVISION_PARAMS))
def test_parameter_counts_equal_torchvisions(name):
    with torch.device("meta"):
        model = convnets.build(name)
    assert sum(p.numel() for p in model.parameters()) == convnets.TORCHVISION_PARAMS[name]


def test_densenet_concatenates_every_earlier_feature_map():
    block = convnets.DenseNet(growth=4, blocks=(3,), init_features=8).features[4]
    seen = []
    handle = block.layers[2].body[0].register_forward_hook(
        lambda m, i, o: seen.append(i[0].shape[1]))
    block(torch.randn(1, 8, 4, 4))
    handle.remove()
    assert seen == [8 + 2 * 4]  # the input and both earlier layers' outputs


def test_unet_segments_at_input_resolution_and_its_loss_is_per_pixel():
    model = convnets.UNet(base=4, depth=2)
    x, y = convnets.batch("unet", 2, 16)
    out = model(x)
    assert out.shape == (2, 2, 16, 16) and y.shape == (2, 16, 16)
    assert per_pixel_classes(out, y)
    ref = torch.nn.functional.cross_entropy(out.permute(0, 2, 3, 1).reshape(-1, 2),
                                            y.reshape(-1))
    torch.testing.assert_close(default_loss(out, y), ref)
    # a language model's (B, S, V) logits keep classes last
    assert not per_pixel_classes(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long))


def test_a_kit_step_trains_a_convnet():
    torch.manual_seed(0)
    model = convnets.build("resnet18")
    x, y = convnets.batch("resnet18", 2, 32)
    before = [p.detach().clone() for p in model.parameters()]
    loss = RealStep(model, "fp32", "cpu", "foreach")([x], None, y)
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_unknown_model_is_named():
    with pytest.raises(ValueError, match="model='resnet7'"):
        convnets.build("resnet7")
