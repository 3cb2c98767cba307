"""The round-based rivals in one process: bad settings refused, rounds counted where PruneX's fall, and the
model a round leaves (tests/launch/test_averaging_launch.py checks their math across ranks against a reference)."""
import pytest
import torch
import torch.nn as nn

from models_for_tests import toy_cnn
from prunex_hvd.baselines import averaging

pytestmark = pytest.mark.usefixtures("single_process")   # conftest.py


def wrapped(factory, **kw):
    model = toy_cnn()
    return model, factory(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, **kw)


@pytest.mark.parametrize("factory,kw,message", [
    (averaging.LocalSGD, {"period": 0}, r"period must be an integer >= 1, got 0"),
    (averaging.HierarchicalLocalSGD, {"period": 6, "intra_period": 4}, r"intra_period 4 must divide period 6"),
    (averaging.HierarchicalLocalSGD, {"period": 6, "intra_period": 0}, r"intra_period must be an integer >= 1"),
    (averaging.DiLoCo, {"period": 2, "outer_lr": 0.0}, r"outer_lr must be a number > 0"),
    (averaging.DiLoCo, {"period": 2, "outer_momentum": 1.0}, r"outer_momentum must be in \[0, 1\)"),
])
def test_bad_settings_are_clear_errors(factory, kw, message):
    with pytest.raises(ValueError, match=message):
        wrapped(factory, **kw)


def test_default_node_period_divides_the_round():
    for period, want in ((100, 25), (12, 3), (7, 1), (1, 1)):
        _, opt = wrapped(averaging.HierarchicalLocalSGD, period=period)
        assert opt._intra_period == want


@pytest.mark.parametrize("factory", [averaging.LocalSGD, averaging.HierarchicalLocalSGD, averaging.DiLoCo])
def test_rounds_fall_every_period_and_finalize_keeps_the_last_rounds_model(factory):
    model, opt = wrapped(factory, period=3)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))
    for step in range(1, 8):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        assert opt.rounds_done() == step // 3
        if step == 6:
            at_round = [p.detach().clone() for p in model.parameters()]
    assert opt.stats()["rounds"] == 2 and opt.stats()["steps"] == 7 and opt.stats()["inter_bytes"] == 0
    with opt.consensus_weights():   # the round's model, not the step after it
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), at_round))
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), at_round))
    opt.finalize()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), at_round))


def test_diloco_with_outer_lr_one_and_no_momentum_is_local_sgd():
    """θ_global − 1·(θ_global − mean θ_r) = mean θ_r: the outer step then lands where local SGD does."""
    runs = []
    for factory, kw in ((averaging.LocalSGD, {}), (averaging.DiLoCo, {"outer_lr": 1.0, "outer_momentum": 0.0})):
        torch.manual_seed(0)
        model, opt = wrapped(factory, period=2, **kw)
        x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))
        for _ in range(5):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b)


def test_state_dict_round_trip():
    model, opt = wrapped(averaging.DiLoCo, period=2)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    sd = opt.state_dict()
    model2, opt2 = wrapped(averaging.DiLoCo, period=2)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(sd)
    assert opt2.rounds_done() == 1 and opt2.stats()["steps"] == 3
    assert all(torch.equal(a, b) for a, b in zip(opt2._global, opt._global))
    assert opt2._outer.state_dict()["state"].keys() == opt._outer.state_dict()["state"].keys()


def test_a_round_counts_the_bytes_that_leave_the_rack():
    """World ring 0→1→2→3→0 on racks (0, 0, 1, 1): every rank's allreduce share leaves its node, only ranks 1's
    and 3's leave the rack (the ledger's cross_rack_bytes, not its cross_node_bytes again)."""
    from types import SimpleNamespace
    from prunex_hvd.dist.comm.accounting import CommLedger

    _, opt = wrapped(averaging.LocalSGD, period=2)
    params = [torch.zeros(100)]   # 400 bytes: each rank sends 2·3/4 of them
    for rank, leaves_rack in ((0, False), (1, True), (2, False), (3, True)):
        group = SimpleNamespace(ledger=CommLedger(), tier="world", backend="gloo", rank=rank, size=4,
                                nodes=(0, 1, 2, 3), racks=(0, 0, 1, 1))
        opt._record(params, group, 0.0)
        world = group.ledger.summary()["world"]
        assert world["cross_node_bytes"] == 600 and world["cross_rack_bytes"] == (600 if leaves_rack else 0)
