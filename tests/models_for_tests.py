"""Small models shared by the one-process tests."""
import torch
import torch.nn as nn


def toy_cnn(seed=0):
    """A two-conv chain for 3-channel inputs (the tests use 6×6): 3 → 8 channels (BatchNorm, ReLU) → 6, pooled,
    a linear head to 4 classes; torch's global RNG seeded with ``seed`` first, so the weights are fixed."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 6, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 4))
