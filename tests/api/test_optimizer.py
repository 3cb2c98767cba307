"""DistributedOptimizer in one process (a 1×1 cluster): the wrapper's behaviour, state and errors.
The multi-rank math is checked against the reference in test_engine_launch.py."""
import io
import logging
import re

import pytest
import torch
import torch.nn as nn

import prunex_hvd as px
from models_for_tests import toy_cnn, toy_train as train


pytestmark = pytest.mark.usefixtures("single_process")   # conftest.py


def make(seed=0, **kw):
    """The paper's round restarting at z (masks frozen by patience, each layer its own channel count), ``kw`` on
    top."""
    model = toy_cnn(seed)
    args = dict(sparsity="channel:0.5", local_steps=3, rho1=0.05, rho2=0.01)
    args.update(kw)
    opt = px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                                  px.ConsensusConfig.paper(restart="global"), **args)
    return model, opt


def test_wrapped_optimizer_is_still_the_users_class():
    model, opt = make()
    assert isinstance(opt, torch.optim.SGD)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(model, opt, 1)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)


def test_rounds_run_every_local_steps_and_stats_have_every_key():
    model, opt = make()
    train(model, opt, 9)
    s = opt.stats()
    assert s["rounds"] == 3 and s["steps"] == 9
    for key in ("inter_bytes", "intra_bytes", "dense_inter_bytes", "density", "mask_drift", "frozen",
                "residuals", "rho", "layer_density"):
        assert key in s
    # one node: no inter-node tier, so no inter residuals (r_inter would be 0 by construction)
    assert set(s["residuals"]["3.weight"]) == {"r_intra", "s_intra"}
    report = opt.consensus()
    assert report["round"] == 4 and opt.stats()["rounds"] == 4


def test_proximal_gradient_is_added_every_step():
    model, opt = make()
    train(model, opt, 3)   # one round: z_i and u are no longer trivial
    eng = opt._engine
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    eng.add_proximal_grad()
    for e in eng.entries:
        torch.testing.assert_close(e.param.grad, e.rho1 * (e.param.detach() - e.z_i + e.u))


def test_finalize_gives_exact_structure():
    model, opt = make()
    train(model, opt, 6)
    opt.finalize()
    w0, w1 = model[0].weight, model[3].weight
    assert int((w0.abs().sum((0, 2, 3)) != 0).sum()) == 2   # ceil(0.5 * 3) input channels kept
    assert int((w1.abs().sum((0, 2, 3)) != 0).sum()) == 4   # ceil(0.5 * 8)
    torch.testing.assert_close(w1.detach(), opt._engine.structured[1].z)   # the model is the consensus z


def test_state_dict_resume_is_bit_exact():
    model_a, opt_a = make()
    train(model_a, opt_a, 6, seed=5)
    blob = io.BytesIO()
    torch.save({"model": model_a.state_dict(), "opt": opt_a.state_dict()}, blob)
    train(model_a, opt_a, 6, seed=6)

    px.shutdown()
    model_b, opt_b = make(seed=99)    # different start: everything must come from the checkpoint
    blob.seek(0)
    ck = torch.load(blob, weights_only=False)
    model_b.load_state_dict(ck["model"])
    opt_b.load_state_dict(ck["opt"])
    train(model_b, opt_b, 6, seed=6)
    for (n, a), (_, b) in zip(model_a.state_dict().items(), model_b.state_dict().items()):
        assert torch.equal(a, b), n
    ea, eb = opt_a._engine, opt_b._engine
    for x, y in zip(ea.entries, eb.entries):
        for key in ("u", "z_i", "v", "z"):
            assert torch.equal(getattr(x, key), getattr(y, key)), (x.name, key)
        assert (x.rho1, x.rho2) == (y.rho1, y.rho2)
    assert opt_a.stats()["rounds"] == opt_b.stats()["rounds"] == 4


def test_load_state_dict_without_engine_state_is_refused():
    model, opt = make()
    with pytest.raises(ValueError, match="no 'prunex' engine state"):
        opt.load_state_dict(torch.optim.SGD(model.parameters(), lr=0.1).state_dict())


def test_freezing_by_patience_and_by_round():
    model, opt = make(sparsity="channel:1", freeze_patience=2)   # keep all: the mask never drifts
    train(model, opt, 6)
    assert opt.stats()["frozen"] and opt.stats()["mask_drift"] == 0.0
    model, opt = make(freeze_round=1)
    train(model, opt, 3)
    assert opt.stats()["frozen"]
    layout = opt._engine.masks.compact_layout()
    train(model, opt, 6)
    assert opt._engine.masks.compact_layout() is layout   # buffers allocated once after freezing


@pytest.mark.parametrize("kw,message", [
    ({"rho1": 0}, "rho1 must be a finite number > 0"),
    ({"rho2": -1.0}, "rho2 must be a finite number > 0"),
    ({"local_steps": 0}, "local_steps must be an integer >= 1"),
    ({"sparsity": "channel:1.5"}, r"keep ratio must be in \(0, 1\]"),
    ({"sparsity": "columns:0.5"}, "unknown"),
    ({"sparsity": {"nope.*": "channel:0.5"}}, "nope"),
    ({"sparsity": {"6.weight": "channel:0.5"}}, "not a conv weight"),
    ({"freeze_patience": 0}, "freeze_patience must be an integer >= 1"),
])
def test_bad_arguments_are_clear_value_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        make(**kw)


def test_closure_is_refused():
    model, opt = make()
    with pytest.raises(ValueError, match="does not take a closure"):
        opt.step(lambda: 0.0)


def test_projection_is_public():
    w = torch.randn(4, 6, 3, 3)
    p = px.sparsity.project(w, "filter:0.5")
    assert int((p.reshape(4, -1).abs().sum(1) != 0).sum()) == 2


def test_retraining_phase_keeps_theta_on_the_frozen_structure():
    model, opt = make(freeze_round=1)
    train(model, opt, 3)                      # round 1 freezes the masks at exactly channel keep 0.5
    eng = opt._engine
    for e in eng.structured:   # exactly the requested structure, even if the OR of nodes kept more
        c_in = e.param.shape[1]
        assert int(e.rows.sum()) == e.param.shape[0] and int(e.cols.sum()) == -(-c_in // 2) * 9, e.name
    train(model, opt, 5)                      # momentum alone would move pruned weights; they stay 0
    for e in eng.structured:
        outside = ~(e.rows[:, None] & e.cols[None, :]).reshape(e.param.shape)
        assert torch.count_nonzero(e.param.detach()[outside]) == 0, e.name
        assert e.param.detach()[~outside].abs().sum() > 0
    with opt.consensus_weights():             # the pruned model is what is being trained
        z = [e.param.detach().clone() for e in eng.entries]
    assert all(torch.equal(a, e.z) for a, e in zip(z, eng.entries))
    assert not torch.equal(z[0], eng.entries[0].param.detach())   # θ is back after the context


def test_one_process_sends_nothing_across_nodes():
    model, opt = make()
    train(model, opt, 6)
    s = opt.stats()
    assert s["rounds"] == 2 and s["inter_bytes"] == s["dense_inter_bytes"] == s["inter_consensus_bytes"] == 0


@pytest.mark.parametrize("where,named", [("param", r"inf or NaN in 3\.weight, from θ \+ u of rank 0"),
                                         ("buffer", r"inf or NaN in the float buffers \(BatchNorm running statistics\)")])
def test_inf_or_nan_stops_the_round_before_any_state_changes(where, named):
    model, opt = make(freeze_round=None, freeze_patience=100)
    train(model, opt, 3)                                   # round 1: masks moved off all-ones
    eng = opt._engine
    before = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in eng.state_dict()["entries"]["3.weight"].items()
              if k != "residuals"}
    masks = [(e.rows.clone(), e.cols.clone()) for e in eng.structured]
    with torch.no_grad():
        if where == "param":   # in a pruned input channel: the projection alone would hide it
            pruned = int((~eng.structured[1].cols).nonzero()[0]) // 9
            model[3].weight[2, pruned, 1, 1] = float("nan")
        else:
            model[1].running_var[0] = float("inf")
    with pytest.raises(FloatingPointError, match=named + r".*state of round 1"):
        opt.consensus()
    assert eng.round == 1
    after = eng.state_dict()["entries"]["3.weight"]
    assert all(torch.equal(after[k], v) if torch.is_tensor(v) else after[k] == v for k, v in before.items())
    assert all(torch.equal(e.rows, r) and torch.equal(e.cols, c) for e, (r, c) in zip(eng.structured, masks))
    assert torch.isfinite(model[1].running_mean).all()     # buffers not overwritten from the bad round
    with torch.no_grad():                                  # put it right: the next round runs
        model[3].weight.nan_to_num_(0.0)
        model[1].running_var.clamp_(max=1.0)
    opt.consensus()
    assert eng.round == 2


class _Mixed(nn.Module):
    """A 1-channel stem, a depthwise conv, an optional transposed conv or grouped conv."""

    def __init__(self, last=None):
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.mix = nn.Conv2d(8, 8, 1)
        self.last = last if last is not None else nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.last(self.mix(torch.relu(self.depthwise(torch.relu(self.stem(x))))))


def _wrap(model, **kw):
    return px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, **kw)


def test_layers_the_gemm_view_does_not_fit_are_refused_with_what_to_write():
    with pytest.raises(ValueError, match=r"'last\.weight' belongs to a ConvTranspose2d.*"
                                         r"sparsity=\{'last\.weight': 'dense', '\*': 'channel:0\.5'\}"):
        _wrap(_Mixed(nn.ConvTranspose2d(8, 4, 2, stride=2)), sparsity="channel:0.5")
    with pytest.raises(ValueError, match=r"'last\.weight' belongs to a grouped Conv2d \(groups=2.*"
                                         r"sparsity=\{'last\.weight': 'filter:0\.5', 'stem\.\*': 'dense', "
                                         r"'\*': 'channel:0\.5'\}"):
        _wrap(_Mixed(nn.Conv2d(8, 4, 1, groups=2)), sparsity={"stem.*": "dense", "*": "channel:0.5"})
    # what the message says to write works
    _wrap(_Mixed(nn.ConvTranspose2d(8, 4, 2, stride=2)), sparsity={"last.weight": "dense", "*": "filter:0.5"})
    _wrap(_Mixed(nn.Conv2d(8, 4, 1, groups=2)), sparsity={"last.weight": "filter:0.5", "*": "filter:0.5"})


def test_stages_that_remove_nothing_are_one_warning_naming_the_layers():
    """'channel:0.5' over every conv reaches the 1-channel stem and the depthwise conv, where it can drop
    nothing: one warning naming both, on rank 0 (here the only one), and the optimizer is built."""
    with pytest.warns(UserWarning, match=r"can remove nothing") as record:
        opt = _wrap(_Mixed(), sparsity="channel:0.5")
    messages = [str(w.message) for w in record if "can remove nothing" in str(w.message)]
    assert len(messages) == 1
    assert "stem.weight (8, 1, 3, 3): channel:0.5" in messages[0]
    assert "depthwise.weight (8, 1, 3, 3): channel:0.5" in messages[0]
    assert "mix.weight" not in messages[0] and "last.weight" not in messages[0]
    assert opt.stats()["rounds"] == 0
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # nothing to report: no warning at all
        _wrap(_Mixed(), sparsity={"stem.*": "dense", "depthwise.*": "filter:0.5", "*": "channel:0.5"})


def test_a_global_channel_budget_names_the_layers_that_keep_their_own_count():
    """channel_budget='global' shares one budget among the layers pruned by input channel alone; one with a
    composite spec keeps its own count, and one warning (rank 0) names it. None when every such layer is in, or
    when none is (the budget changes nothing)."""
    sparsity = {"stem.*": "dense", "depthwise.*": "filter:0.5", "mix.*": "channel:0.5",
                "last.*": "filter:0.5+channel:0.5"}
    with pytest.warns(UserWarning, match=r"channel_budget='global': 1 layers share one budget") as record:
        opt = _wrap(_Mixed(), sparsity=sparsity, channel_budget="global")
    messages = [str(w.message) for w in record if "channel_budget" in str(w.message)]
    assert len(messages) == 1 and messages[0].endswith("residual stream): last.weight"), messages
    assert opt.stats()["rounds"] == 0
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _wrap(_Mixed(), sparsity=dict(sparsity, **{"last.*": "channel:0.5"}), channel_budget="global")
        _wrap(_Mixed(), sparsity=dict(sparsity, **{"mix.*": "filter:0.5"}), channel_budget="global")


# -- what the recipe takes from the wrapped optimizer: rho_max -----------------------------------------------------

def _recipe(optimizer_of=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9), **kw):
    """The recipe (the library's defaults) around ``optimizer_of(model.parameters())``."""
    model = toy_cnn(0)
    return model, px.DistributedOptimizer(optimizer_of(model.parameters()), model, sparsity="channel:0.5",
                                          local_steps=3, **kw)


def test_rho_max_auto_is_derived_from_the_wrapped_optimizers_lr_and_momentum():
    """rho_max="auto" (the default): (1 − momentum)/(lr · local_steps) from the optimizer wrapped, the lr it
    starts from where a scheduler attached before wrapping already moved it ("initial_lr"); an optimizer
    without momentum counts 0; a number is kept."""
    _, opt = _recipe()
    assert opt._engine.config.rho_max == pytest.approx((1 - 0.9) / (0.05 * 3))

    def scheduled(params):
        sgd = torch.optim.SGD(params, lr=0.05, momentum=0.5)
        torch.optim.lr_scheduler.LambdaLR(sgd, lambda step: 0.1)   # lr 0.005 now, initial_lr 0.05
        assert sgd.param_groups[0]["lr"] == pytest.approx(0.005)
        return sgd
    px.shutdown()
    _, opt = _recipe(scheduled)
    assert opt._engine.config.rho_max == pytest.approx((1 - 0.5) / (0.05 * 3))
    px.shutdown()
    _, opt = _recipe(lambda params: torch.optim.Adam(params, lr=0.01))
    assert opt._engine.config.rho_max == pytest.approx(1 / (0.01 * 3))
    px.shutdown()
    _, opt = _recipe(rho_max=2.5)
    assert opt._engine.config.rho_max == 2.5
    px.shutdown()
    with pytest.raises(ValueError, match=r"rho_max='auto'.*needs lr > 0 and 0 <= momentum < 1.*set rho_max to a "
                                         r"number"):
        _recipe(lambda params: torch.optim.SGD(params, lr=0.05, momentum=1.0))


SAID = (r"DistributedOptimizer: rho balanced up to rho_max 0\.667 = \(1 - momentum 0\.9\) / \(lr 0\.05 x 3 local "
        r"steps\), from the optimizer \(rho_max='auto'; a number sets it\)")


def _unconfigured_library_logger(monkeypatch):
    """The ``prunex_hvd`` logger with no handler of its own and none above it, as in a script that never set up
    logging, whatever pytest (which attaches its own handlers as the test starts) or another test added."""
    logger = logging.getLogger("prunex_hvd")
    monkeypatch.setattr(logger, "handlers", [logging.NullHandler()])
    monkeypatch.setattr(logger, "propagate", False)
    return logger


def test_what_the_recipe_took_is_said_once_on_stderr_without_logging(monkeypatch, capsys):
    _unconfigured_library_logger(monkeypatch)
    capsys.readouterr()
    model, opt = _recipe()
    assert re.fullmatch("prunex_hvd: " + SAID, capsys.readouterr().err.rstrip("\n"))
    train(model, opt, 4)   # steps and a round: said at construction only
    assert "DistributedOptimizer" not in capsys.readouterr().err
    px.shutdown()
    _recipe(rho_max=10.0)   # nothing derived: only the cap
    assert capsys.readouterr().err == "prunex_hvd: DistributedOptimizer: rho balanced up to rho_max 10\n"
    px.shutdown()
    _recipe(rho1=1.0)   # a start above the derived cap: the start is the cap
    assert capsys.readouterr().err == "prunex_hvd: DistributedOptimizer: rho balanced up to rho_max 1 (the starting " \
        "rho: (1 - momentum 0.9) / (lr 0.05 x 3 local steps) = 0.667 is below it), from the optimizer " \
        "(rho_max='auto'; a number sets it)\n"


def test_what_the_recipe_took_goes_to_the_logger_where_logging_is_set_up(monkeypatch, capsys):
    library_logger = _unconfigured_library_logger(monkeypatch)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    library_logger.addHandler(handler)
    level = library_logger.level
    library_logger.setLevel(logging.INFO)
    try:
        capsys.readouterr()
        _recipe()
    finally:
        library_logger.setLevel(level)
    said = [r for r in records if r.getMessage().startswith("DistributedOptimizer")]
    assert len(said) == 1 and said[0].levelno == logging.INFO and re.fullmatch(SAID, said[0].getMessage())
    assert capsys.readouterr().err == ""
