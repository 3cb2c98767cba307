"""Small models shared by the tests, and a few steps of training for them."""
import torch
import torch.nn as nn


def toy_cnn(seed=0):
    """A two-conv chain for 3-channel inputs (the tests use 6×6): 3 → 8 channels (BatchNorm, ReLU) → 6, pooled,
    a linear head to 4 classes; torch's global RNG seeded with ``seed`` first, so the weights are fixed."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 6, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 4))


def toy_train(model, opt, steps, seed=1):
    """``steps`` steps of ``opt`` on random 6×6 batches of 8 for :func:`toy_cnn` (its own generator: ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
