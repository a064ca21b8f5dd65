"""A user's model factory, loaded by ``predict memory --model module --module ...:make``."""

from torch import nn


def make() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 10))
