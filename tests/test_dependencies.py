"""Coupled channel pruning: which conv pairs are found, and the joint projection they get."""
import itertools

import pytest
import torch
from torch import nn

from prunex_hvd import dependencies, sparsity
from prunex_hvd.models import build


def test_resnet_blocks_couple_inside_never_across_the_residual():
    pairs = dependencies.channel_couplings(build("resnet18", 10, 3))
    assert len(pairs) == 8   # one per BasicBlock: conv2 reads conv1 alone
    assert all(c.endswith("conv2.weight") and p == c.replace("conv2", "conv1") for c, p in pairs.items())
    pairs = dependencies.channel_couplings(build("resnet50", 10, 3))
    assert len(pairs) == 32  # two per Bottleneck: conv2 <- conv1, conv3 <- conv2
    assert pairs["layer1.0.conv3.weight"] == "layer1.0.conv2.weight"
    assert pairs["layer1.0.conv2.weight"] == "layer1.0.conv1.weight"
    assert not any("shortcut" in c or "shortcut" in p for c, p in pairs.items())


class TwoReaders(nn.Module):
    """conv a feeds conv b and a second branch: a's filters are not b's alone."""

    def __init__(self):
        super().__init__()
        self.a, self.bn, self.b = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        h = torch.relu(self.bn(self.a(x)))
        return self.b(h) + h


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.a(x) if x.sum() > 0 else x


def test_chain_through_bn_and_activations_couples():
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Dropout(0.1), nn.Conv2d(6, 5, 3),
                          nn.Flatten())
    assert dependencies.channel_couplings(model) == {"4.weight": "0.weight"}


def test_shared_output_and_grouped_convs_do_not_couple():
    assert dependencies.channel_couplings(TwoReaders()) == {}
    depthwise = nn.Sequential(nn.Conv2d(3, 6, 1), nn.ReLU(), nn.Conv2d(6, 6, 3, groups=6))
    assert dependencies.channel_couplings(depthwise) == {}


def test_untraceable_model_is_a_clear_error():
    with pytest.raises(ValueError, match="torch.fx can trace.*DataDependent"):
        dependencies.channel_couplings(DataDependent())


def test_coupled_masks_are_the_exact_projection_onto_the_coupled_set():
    """With nothing else constraining the producer, keeping the k channel groups of largest joint norm is
    the Frobenius-nearest point: check against every subset."""
    g = torch.Generator().manual_seed(3)
    producer, consumer = torch.randn(6, 2, 3, 3, generator=g), torch.randn(4, 6, 3, 3, generator=g)
    consumer[:, 1] *= 3   # the consumer alone would keep channel 1; the producer's filter 2 outweighs it
    producer[2] *= 4
    specs = {"p": sparsity.parse_spec("channel:1"), "c": sparsity.parse_spec("channel:0.5")}
    masks = sparsity.coupled_masks({"p": producer, "c": consumer}, specs, {"c": "p"})
    kept = masks["p"][0]
    assert torch.equal(masks["c"][1].view(6, 9)[:, 0], kept) and int(kept.sum()) == 3
    assert masks["p"][1].all() and masks["c"][0].all()

    def error(chs):
        m = torch.zeros(6, dtype=torch.bool)
        m[list(chs)] = True
        return float(producer[~m].pow(2).sum() + consumer[:, ~m].pow(2).sum())
    best = min(itertools.combinations(range(6), 3), key=error)
    assert kept.nonzero().flatten().tolist() == list(best)
    projected = sparsity.coupled_project({"p": producer, "c": consumer}, specs, {"c": "p"})
    assert float((producer - projected["p"]).pow(2).sum() + (consumer - projected["c"]).pow(2).sum()) == \
        pytest.approx(error(best))


def test_chains_and_no_couplings():
    g = torch.Generator().manual_seed(0)
    w = {n: torch.randn(8, 8, 1, 1, generator=g) for n in ("a", "b", "c")}
    specs = {n: sparsity.parse_spec("channel:0.5") for n in w}
    plain = sparsity.coupled_masks(w, specs, {})
    for n in w:
        assert all(torch.equal(x, y) for x, y in zip(plain[n], sparsity.structured_masks(w[n], specs[n])))
    chain = sparsity.coupled_masks(w, specs, {"c": "b", "b": "a"})   # a -> b -> c
    assert torch.equal(chain["b"][0], chain["c"][1]) and torch.equal(chain["a"][0], chain["b"][1])
    assert [int(chain[n][0].sum()) * int(chain[n][1].sum()) for n in "abc"] == [16, 16, 32]
    # a producer's own filter stage is superseded by its consumer's channels
    specs["b"] = sparsity.parse_spec("filter:0.25+channel:0.5")
    assert int(sparsity.coupled_masks(w, specs, {"c": "b"})["b"][0].sum()) == 4


def test_optimizer_coupled_needs_something_to_couple(single_process):
    import prunex_hvd as px
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="nothing to couple"):
        px.DistributedOptimizer(opt, model, sparsity="channel:0.5", coupled=True)
    with pytest.raises(ValueError, match="coupled must be True or False"):
        px.DistributedOptimizer(opt, model, sparsity="channel:0.5", coupled="yes")


def test_optimizer_coupled_finalizes_dead_filters_to_zero(single_process):
    import prunex_hvd as px
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 6, 3),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 2))
    opt = px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, sparsity="channel:0.5",
                                  local_steps=2, rho1=0.1, rho2=0.1, freeze_round=2, coupled=True)
    x, y = torch.randn(8, 3, 6, 6), torch.randint(0, 2, (8,))
    for _ in range(6):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    opt.finalize()
    dead_channels = model[3].weight.detach().abs().sum((0, 2, 3)) == 0
    dead_filters = model[0].weight.detach().reshape(8, -1).abs().sum(1) == 0
    assert int(dead_channels.sum()) == 4 and torch.equal(dead_channels, dead_filters)
    assert opt.stats()["density"] == pytest.approx((4 * 2 * 9 + 6 * 4 * 9) / (8 * 3 * 9 + 6 * 8 * 9))
