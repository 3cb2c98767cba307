"""What the library logs on rank 0 (freezing, ρ changes, refused rounds), and that it stays silent unless the
application configures logging."""
import logging
import subprocess
import sys

import pytest
import torch

import prunex_hvd as px
from models_for_tests import toy_cnn, toy_train as train

pytestmark = pytest.mark.usefixtures("single_process")   # conftest.py


def make():
    model = toy_cnn()
    opt = px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, sparsity="channel:0.5",
                                  local_steps=2, rho1=0.05, rho2=0.01, freeze_round=2, channel_budget="layer")
    return model, opt


def test_freezing_rho_changes_and_refused_rounds_are_logged(caplog):
    model, opt = make()
    with caplog.at_level(logging.INFO, logger="prunex_hvd"):
        train(model, opt, 4)
        with torch.no_grad():
            model[0].weight[0, 0, 0, 0] = float("nan")
        with pytest.raises(FloatingPointError):
            opt.consensus()
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name.startswith("prunex_hvd")]
    # the stem keeps 2 of 3 input channels, the other conv 4 of 8: (2·8·9 + 6·4·9) / (8·3·9 + 6·8·9)
    assert (logging.INFO, "round 2: masks frozen, density 0.556 of the structured weights") in said
    assert any(level == logging.INFO and msg.startswith("round 1: rho changed") and "rho1" in msg
               for level, msg in said), said
    assert (logging.ERROR, "round 3 refused (FloatingPointError): every rank keeps the state of round 2") in said


def test_silent_without_logging_configured():
    """A refused round logs an error; with no handler configured by the application none of the log reaches
    stderr (the package's NullHandler keeps Python's last-resort handler quiet): the exception says it all. What
    reaches it is the wrapper's one line, what it took from the optimizer (tests/api/test_optimizer.py)."""
    script = (
        "import torch, torch.nn as nn, prunex_hvd as px\n"
        "m = nn.Sequential(nn.Conv2d(3, 4, 3))\n"
        "o = px.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, local_steps=1, freeze_round=1)\n"
        "m(torch.randn(2, 3, 5, 5)).sum().backward(); o.step()\n"
        "with torch.no_grad(): m[0].weight[0, 0, 0, 0] = float('nan')\n"
        "try:\n    o.consensus()\nexcept FloatingPointError:\n    print('refused')\n")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("OMPI_", "PMIX_", "HOROVOD_"))}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "refused", proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("prunex_hvd: DistributedOptimizer: rho balanced up to"), lines
