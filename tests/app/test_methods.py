"""Every training method offers the trainer's contract (prunex_hvd.app.methods.Method), in one process."""
import pytest
import torch
import torch.nn as nn

from models_for_tests import toy_cnn
from prunex_hvd.app import methods
from prunex_hvd.app.train import TrainConfig

pytestmark = pytest.mark.usefixtures("single_process")   # conftest.py


@pytest.mark.parametrize("name", list(methods.METHODS))
def test_every_method_satisfies_the_contract(name):
    model = toy_cnn()
    opt = methods.wrap(name, torch.optim.SGD(model.parameters(), lr=0.05), model,
                       TrainConfig.from_flat(freeze_round=None, local_steps=2))
    assert isinstance(opt, methods.Method)
    # round-based methods log every round; those that talk every step, once an epoch
    assert opt.records_per_epoch == (name in ("dense", "topk", "pactrain"))
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))
    for _ in range(3):   # PruneX: one round after 2 steps, then a round of the last step on consensus()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    rounds = opt.rounds_done()
    report = opt.consensus()
    assert (report is None) == opt.records_per_epoch
    assert opt.rounds_done() == rounds + (0 if opt.records_per_epoch else 1)
    assert set(methods.STATS_KEYS) <= set(opt.stats())
    with opt.consensus_weights():
        pass
    opt.finalize()


def test_a_method_without_the_contract_is_refused(monkeypatch):
    monkeypatch.setitem(methods.METHODS, "bare", lambda optimizer, *args: optimizer)
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"method 'bare' does not offer what the trainer needs: \['records_per_epoch'"):
        methods.wrap("bare", torch.optim.SGD(model.parameters(), lr=0.1), model, TrainConfig())
