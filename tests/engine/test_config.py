"""ConsensusConfig: each knob spelled once and read from there by the wrapper, the cross-rank agreement, the
training config and the command line; validated when made. Its defaults are the recipe, ``paper()`` the paper's
round; the knobs measured and removed are refused by name."""
import dataclasses
import inspect
import math

import pytest
import torch

import prunex_hvd as px
from models_for_tests import toy_cnn
from prunex_hvd.app import cli
from prunex_hvd.app.train import AUTO_WARMUP_EPOCHS, AUTO_WARMUP_MAX_FRACTION, TrainConfig, _lr_factor
from prunex_hvd.engine import config
from prunex_hvd.engine.config import ConsensusConfig, Structure
from prunex_hvd.engine.sparsity.projection import BUDGET_FLOOR

KNOBS = ConsensusConfig.knob_names()
# the knobs measured and removed (benchmarks/log/removed-knobs.md)
REMOVED = ("relaxation", "rho_growth", "keep_ramp_rounds", "rho2_release_round", "acceleration", "outer_momentum",
           "keep_start_norm", "sync_rounds", "sync_powersgd_rank", "overlap_after_freeze", "overlap_steps",
           "weight_decay_z", "budget_floor", "balance_rho2", "retrain", "masked_retrain", "compact_compute")


def from_flags(*argv):
    """``prunex-hvd train ARGV``'s TrainConfig, as main() builds it (no launch)."""
    return cli._train_config(cli.parse(["train", *argv]))


def test_the_defaults_are_the_recipe():
    c = ConsensusConfig()
    assert (c.rho1, c.rho2, c.rho3, c.rho_max, c.adaptive_rho) == (0.01, 0.001, None, "auto", True)
    assert (c.restart, c.node_sync, c.payload_dtype, c.freeze_round, c.channel_budget) == \
        ("global", True, "bf16", 0, "global")
    assert (c.overlap, c.overlap_steps, c.hierarchical, c.rack_tier) == (False, None, True, True)
    assert (c.sparsity, c.local_steps, c.freeze_patience, c.coupled, c.bucket_mb, c.backend) == \
        ("channel:0.5", 100, 3, False, 32.0, "auto")
    assert TrainConfig().consensus == c


def test_paper_is_the_papers_round_with_knobs_on_top():
    p = ConsensusConfig.paper()
    assert (p.rho1, p.rho2, p.rho_max, p.freeze_round, p.channel_budget) == (1.5e-3, 1.5e-4, 10.0, None, "layer")
    assert (p.restart, p.node_sync, p.payload_dtype) == ("none", False, None)
    assert p == dataclasses.replace(ConsensusConfig(), **ConsensusConfig.PAPER)   # the rest as the recipe's
    on_top = ConsensusConfig.paper(rho1=0.2, restart="global", local_steps=7)
    assert on_top == dataclasses.replace(p, rho1=0.2, restart="global", local_steps=7)
    flat = ConsensusConfig.paper(hierarchical=False)   # the paper's flat round: nothing of a node tier on
    assert (flat.hierarchical, flat.node_sync, flat.payload_dtype, flat.overlap) == (False, False, None, False)


def test_the_config_stays_small():
    """A guard on the knobs' count: a new one must earn its place, or replace one (benchmarks/log/
    removed-knobs.md); and on the refused combinations (the engine's one, overlap with the rack tier, aside)."""
    assert len(dataclasses.fields(ConsensusConfig)) <= 20
    assert len(config.REFUSED) <= 5


@pytest.mark.parametrize("name", REMOVED)
def test_a_removed_knob_is_an_unknown_one(name):
    assert name not in KNOBS
    with pytest.raises(ValueError, match=rf"unexpected keyword argument '{name}'.*its knobs are"):
        ConsensusConfig.from_knobs({name: 1})


def test_the_one_refused_combination_says_what_to_turn_off():
    with pytest.raises(ValueError, match=r"^hierarchical=False is one flat consensus over the world, with no node "
                                         r"tier for node_sync=True, payload_dtype='bf16' to act on: turn it off "
                                         r"\(ConsensusConfig\.paper\(hierarchical=False\) is the paper's flat "
                                         r"round\)$"):
        ConsensusConfig(hierarchical=False)
    with pytest.raises(ValueError, match=r"no node tier for overlap=3 to act on"):
        ConsensusConfig.paper(hierarchical=False, overlap=3)
    with pytest.raises(ValueError, match=r"no node tier for payload_dtype='fp32' to act on"):
        ConsensusConfig(hierarchical=False, node_sync=False, payload_dtype="fp32")
    assert not ConsensusConfig(hierarchical=False, node_sync=False, payload_dtype=None).hierarchical


def test_rho_max_auto_resolves_from_the_lr_momentum_and_round_length():
    """(1 − momentum)/(lr · local_steps), the ρ at which a round's steps would pull θ back once its distance to
    the consensus; never below a starting ρ; a number asked for is kept; no lr or a momentum of 1 has no such
    cap."""
    c = ConsensusConfig(local_steps=22)
    assert c.with_rho_max_from(0.05, 0.9).rho_max == pytest.approx(0.1 / (0.05 * 22), rel=1e-12)
    assert c.with_rho_max_from(0.5).rho_max == pytest.approx(1 / (0.5 * 22), rel=1e-12)   # no momentum
    assert dataclasses.replace(c.with_rho_max_from(0.05, 0.9), rho_max="auto") == c   # nothing else moves
    # a start above the cap is kept (the cap only stops the growth): each of the ρ's
    for start in (dict(rho1=0.8), dict(rho2=0.8), dict(rho3=0.8)):
        assert ConsensusConfig(local_steps=4, **start).with_rho_max_from(0.5).rho_max == 0.8, start
    asked = ConsensusConfig(rho_max=3.0)
    assert asked.with_rho_max_from(0.05, 0.9) is asked
    assert asked.with_rho_max_from(0.0, 1.0) is asked   # a number: no gain to divide by
    for lr, momentum in ((0.0, 0.9), (-0.1, 0.0), (math.nan, 0.0), (math.inf, 0.0), (0.05, 1.0), (0.05, -0.1)):
        with pytest.raises(ValueError, match=r"rho_max='auto' is \(1 - momentum\) / \(lr x local_steps\), which "
                                             r"needs lr > 0 and 0 <= momentum < 1 .*set rho_max to a number"):
            c.with_rho_max_from(lr, momentum)


def test_overlap_is_off_on_or_a_number_of_steps():
    """overlap: False (overlap_steps None), True (a quarter of a round, at least one step) or N steps."""
    assert ConsensusConfig(overlap=False).overlap_steps is None
    assert ConsensusConfig(overlap=True).overlap_steps == 25
    assert ConsensusConfig(overlap=True, local_steps=3).overlap_steps == 1
    assert ConsensusConfig(overlap=True, local_steps=10).overlap_steps == 2
    assert ConsensusConfig(overlap=1).overlap_steps == 1 and ConsensusConfig(overlap=7).overlap_steps == 7
    with pytest.raises(AttributeError):   # read-only: overlap says it
        ConsensusConfig().overlap_steps = 3
    for bad in (0, -2, 1.5, "on", None):
        with pytest.raises(ValueError, match=rf"overlap must be True, False or a number of steps >= 1, got "
                                             rf"{bad!r}"):
            ConsensusConfig(overlap=bad)


@pytest.mark.parametrize("knobs,message", [
    ({"local_steps": 0}, r"local_steps must be an integer >= 1, got 0"),
    ({"local_steps": True}, r"local_steps must be an integer >= 1"),
    ({"rho1": 0.0}, r"rho1 must be a finite number > 0, got 0\.0"),
    ({"rho_max": math.inf}, r"rho_max must be a finite number > 0"),
    ({"rho_max": "soon"}, r"rho_max must be a finite number > 0, got 'soon'"),
    ({"rho3": -1.0}, r"rho3 must be a finite number > 0, got -1\.0"),
    ({"rho3": True}, r"rho3 must be a finite number > 0, got True"),
    ({"rack_tier": "yes"}, r"rack_tier must be True or False, got 'yes'"),
    ({"coupled": "yes"}, r"coupled must be False, True \(= 'pairs'\) or 'streams'"),
    ({"freeze_round": -1}, r"freeze_round must be None or an integer >= 0, got -1"),
    ({"freeze_patience": 0}, r"freeze_patience must be an integer >= 1"),
    ({"bucket_mb": 0}, r"bucket_mb must be a finite number > 0"),
    ({"backend": "tcp"}, r"unknown backend 'tcp'"),
    ({"node_sync": 1}, r"node_sync must be True or False, got 1"),
    ({"node_sync": True, "hierarchical": False}, r"hierarchical=False .* node_sync=True"),
    ({"restart": "node"}, r"restart must be one of none, global, got 'node'"),
    ({"payload_dtype": "int8"}, r"payload_dtype must be None, 'fp32', 'bf16' or 'fp16', got 'int8'"),
    ({"overlap": 0}, r"overlap must be True, False or a number of steps >= 1, got 0"),
    ({"overlap": True, "hierarchical": False, "node_sync": False, "payload_dtype": None},
     r"hierarchical=False .* overlap=True to act on"),
    ({"channel_budget": "net"}, r"channel_budget must be one of layer, global, got 'net'"),
])
def test_a_bad_knob_is_refused_when_the_config_is_made(knobs, message):
    with pytest.raises(ValueError, match=message):
        ConsensusConfig(**knobs)
    with pytest.raises(ValueError, match=message):   # a copy is validated again
        dataclasses.replace(ConsensusConfig(), **knobs)


def test_frozen_and_an_unknown_knob_names_the_one_meant():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ConsensusConfig().rho1 = 1.0
    with pytest.raises(ValueError, match=r"unexpected keyword argument 'rho_1' \(did you mean 'rho1'\?\)"):
        ConsensusConfig.from_knobs({"rho_1": 0.1})
    made = ConsensusConfig.from_knobs({"local_steps": 7}, base=ConsensusConfig(rho1=0.5))
    assert (made.local_steps, made.rho1) == (7, 0.5)


def test_the_wrapper_takes_every_knob_by_name_and_a_config_whole(single_process):
    params = inspect.signature(px.DistributedOptimizer).parameters
    assert list(params)[:3] == ["optimizer", "model", "config"]
    assert {n: p.default for n, p in params.items() if n in KNOBS} == ConsensusConfig().knobs()
    model = toy_cnn()
    config = ConsensusConfig(sparsity="channel:0.5", local_steps=3, rho1=0.02)
    opt = px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, config, rho2=0.005)
    assert opt._engine.config == dataclasses.replace(config, rho2=0.005).with_rho_max_from(0.1)
    with pytest.raises(ValueError, match="unexpected keyword argument 'local_step'"):
        px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, local_step=3)
    with pytest.raises(ValueError, match="config must be a prunex_hvd.ConsensusConfig, got dict"):
        px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, {"rho1": 0.1})


def test_ranks_compare_every_knob():
    """Each knob is in what ranks compare (a knob added later is compared without another line), grouped as
    the error reports it; sparsity and coupled as they resolved on the model."""
    model = toy_cnn()
    base = ConsensusConfig(sparsity="channel:0.5")
    agreed = base.agreement(Structure.resolve(model, base))
    assert set(agreed) == {"sparsity", "local_steps", "rho", "freezing", "coupled", "bucket_mb", "backend",
                           "hierarchical", "round"}
    changed = {"sparsity": {"*": "channel:0.5"}, "local_steps": 5, "rho1": 0.1, "rho2": 0.1, "rho3": 0.1,
               "rho_max": 5.0, "adaptive_rho": False, "freeze_round": 2, "freeze_patience": 9, "coupled": True,
               "channel_budget": "layer", "bucket_mb": 1.0, "backend": "gloo", "hierarchical": False,
               "restart": "none", "node_sync": False, "payload_dtype": "fp16", "overlap": True, "rack_tier": False}
    assert set(changed) == set(KNOBS)
    # a knob that only means something with others
    needs = {"hierarchical": {"node_sync": False, "payload_dtype": None}}
    for name, value in changed.items():
        other = dataclasses.replace(dataclasses.replace(base, **needs.get(name, {})), **{name: value})
        if name in needs:   # compared against the base with its prerequisites only
            agreed = dataclasses.replace(base, **needs[name]).agreement(Structure.resolve(model, base))
        theirs = other.agreement(Structure.resolve(model, other))
        differ = {k for k in agreed if agreed[k] != theirs[k]}
        # the same specs spelled another way resolve alike: not a disagreement
        assert differ == (set() if name == "sparsity" else {dict(
            rho1="rho", rho2="rho", rho3="rho", rho_max="rho", adaptive_rho="rho", freeze_round="freezing",
            freeze_patience="freezing", channel_budget="freezing", restart="round", node_sync="round",
            payload_dtype="round", overlap="round", rack_tier="round").get(name, name)}), name
        agreed = base.agreement(Structure.resolve(model, base))


def test_the_training_config_embeds_the_consensus_and_reads_flat_names():
    cfg = TrainConfig.from_flat(rho1=0.2, coupled="streams", local_steps=9, freeze_round=None, model="resnet_small")
    assert cfg.consensus == ConsensusConfig(rho1=0.2, coupled="streams", local_steps=9, freeze_round=None)
    assert (cfg.model, cfg.local_epochs) == ("resnet_small", None)
    flat = cfg.as_dict()
    assert "consensus" not in flat and {k: flat[k] for k in KNOBS} == cfg.consensus.knobs()
    assert TrainConfig.from_flat(**flat) == cfg   # as_dict and from_flat are each other's inverse
    default = TrainConfig.from_flat(local_steps=None, freeze_round=0)   # the CLI's
    assert default == TrainConfig() and default.consensus == ConsensusConfig()
    paper = TrainConfig.from_flat(paper=True, rho1=0.2, local_steps=9)   # the paper's round, knobs on top
    assert paper.consensus == ConsensusConfig.paper(rho1=0.2, local_steps=9)
    assert TrainConfig.from_flat(**paper.as_dict()) == paper   # its config.json reads back without the flag
    with pytest.raises(TypeError, match="unexpected keyword argument 'rho'"):   # neither a knob nor a field
        TrainConfig.from_flat(rho=0.1)


@pytest.mark.parametrize("epochs,steps_per_epoch,local_epochs", [(10, 7, 1.0), (9, 10, 1.0), (3, 5, 0.5),
                                                                 (1, 4, 1.0), (12, 3, 1.0)])
def test_the_schedule_in_epochs_resolves_as_before(epochs, steps_per_epoch, local_epochs):
    """local_steps from local_epochs and the masks chosen at the start by default; steps asked for count as they
    are."""
    resolved = TrainConfig(epochs=epochs, local_epochs=local_epochs).resolved(steps_per_epoch).consensus
    local_steps = max(1, round(local_epochs * steps_per_epoch))
    assert (resolved.local_steps, resolved.freeze_round) == (local_steps, 0)
    asked = TrainConfig.from_flat(epochs=epochs, local_steps=4, freeze_round=None).resolved(steps_per_epoch)
    assert (asked.consensus.local_steps, asked.consensus.freeze_round) == (4, None)


def test_a_resume_names_the_settings_that_changed_but_not_how_it_is_launched():
    """What the trainer warns about on --resume: config.json as the run so far wrote it (resolved, through JSON)
    against the resumed run's settings."""
    import json

    from prunex_hvd.app.train import changed_settings
    later = ConsensusConfig(freeze_round=3)
    began = json.loads(json.dumps(TrainConfig(consensus=later).resolved(22).as_dict()))
    same = TrainConfig(consensus=later, resume=True, threads=2, stop_after_rounds=3).resolved(22)
    assert changed_settings(began, same.as_dict()) == []
    now = TrainConfig(lr=0.1).resolved(22)   # the default: masks chosen at the start
    assert changed_settings(began, now.as_dict()) == ["freeze_round 3 -> 0", "lr 0.05 -> 0.1"]
    del began["overlap"]   # a knob the earlier version did not have
    assert changed_settings(began, now.as_dict()) == ["freeze_round 3 -> 0", "lr 0.05 -> 0.1"]


def test_the_consensus_flags_default_to_the_recipe_and_reach_it():
    """The flags of the consensus's knobs show the recipe's values; the method decides hierarchical, and the rest
    is set in a --config file."""
    assert from_flags() == TrainConfig()
    flags = {a.dest for a in cli.build_parser()._subparsers._group_actions[0].choices["train"]._actions}
    assert set(KNOBS) - flags == {"hierarchical"} | (set(cli.CONFIG_ONLY) & set(KNOBS))
    assert set(cli.CONFIG_ONLY) & set(KNOBS) == {"restart", "adaptive_rho", "freeze_patience", "rack_tier", "rho3",
                                                 "bucket_mb"}
    got = from_flags("--rho1", "0.3", "--coupled", "streams", "--backend", "gloo", "--local-steps", "6",
                     "--freeze-round", "4", "--rho-max", "3", "--rho2", "0.2", "--sparsity", '{"*": "filter:0.5"}',
                     "--no-node-sync", "--payload-dtype", "fp16", "--channel-budget", "layer", "--overlap", "2")
    assert got.consensus == ConsensusConfig(sparsity={"*": "filter:0.5"}, local_steps=6, rho1=0.3, rho2=0.2,
                                            rho_max=3.0, freeze_round=4, coupled="streams", backend="gloo",
                                            node_sync=False, payload_dtype="fp16", channel_budget="layer", overlap=2)
    assert from_flags("--freeze-round", "none").consensus.freeze_round is None   # only the patience
    assert from_flags("--payload-dtype", "none", "--overlap", "on").consensus.payload_dtype is None
    assert from_flags("--overlap", "on").consensus.overlap is True
    assert from_flags("--overlap", "off").consensus.overlap is False
    assert from_flags("--coupled").consensus.coupled is True and from_flags("--coupled", "off").consensus.coupled \
        is False
    # the last of --no-node-sync / --node-sync wins
    assert from_flags("--no-node-sync", "--node-sync").consensus.node_sync
    assert from_flags("--paper").consensus == ConsensusConfig.paper()
    assert from_flags("--paper", "--rho1", "0.3").consensus == ConsensusConfig.paper(rho1=0.3)
    for argv in (["--freeze-round", "soon"], ["--payload-dtype", "int8"], ["--overlap", "sometimes"],
                 ["--coupled", "both"], ["--channel-budget", "net"], ["--rho-max", "soon"]):
        with pytest.raises(SystemExit):
            from_flags(*argv)


def test_channel_budget_is_layer_or_global_and_global_is_the_recipe():
    """channel_budget: 'global' in the recipe (each layer keeps at least BUDGET_FLOOR of its channels), 'layer'
    in the paper's round; --channel-budget reaches the consensus."""
    assert (ConsensusConfig().channel_budget, ConsensusConfig.paper().channel_budget, BUDGET_FLOOR) == \
        ("global", "layer", 0.1)
    assert from_flags().consensus.channel_budget == "global"
    assert from_flags("--channel-budget", "layer").consensus.channel_budget == "layer"
    assert from_flags("--paper", "--channel-budget", "global").consensus.channel_budget == "global"


def test_rho_max_auto_is_left_to_the_wrapper():
    """--rho-max auto (the default) stays "auto" through the trainer's config (the wrapper resolves it from the
    optimizer it wraps); a number counts as it is; momentum >= 1 has no such cap for PruneX's methods."""
    auto = from_flags("--rho-max", "auto", "--lr", "0.05", "--momentum", "0.9")
    assert auto.consensus.rho_max == "auto" == from_flags().consensus.rho_max
    assert auto.resolved(22).consensus.rho_max == "auto"
    assert from_flags("--rho-max", "0.3").resolved(22).consensus.rho_max == 0.3
    written = TrainConfig.from_flat(rho_max="auto", local_steps=9)
    assert TrainConfig.from_flat(**written.as_dict()) == written   # config.json reads back
    with pytest.raises(ValueError, match="needs momentum < 1.*pass --rho-max N"):
        TrainConfig.from_flat(rho_max="auto", momentum=1.0).validate()
    TrainConfig.from_flat(rho_max=2.0, momentum=1.0).validate()   # a number: no gain to divide by
    TrainConfig.from_flat(method="localsgd", momentum=1.0).validate()   # no consensus to cap


def test_the_lr_warms_up_for_prunex_by_default_and_as_asked_for_any_method():
    """--warmup-epochs auto (the default): AUTO_WARMUP_EPOCHS for prunex / prunex-flat, at most
    AUTO_WARMUP_MAX_FRACTION of a short run, none for the rivals (their user's schedule as it is) nor for the
    paper's round unless asked; a number counts for every method, whatever the run's length. The factor rises
    linearly to 1 over the warm-up's steps, then follows the cosine over the rest, from 1 down to 0 at the last
    step."""
    auto = {m: from_flags("--method", m, "--epochs", "24") for m in ("prunex", "prunex-flat", "localsgd", "pactrain")}
    assert AUTO_WARMUP_EPOCHS <= AUTO_WARMUP_MAX_FRACTION * 24   # so the cap does not bite above
    assert {m: c.warmup() for m, c in auto.items()} == {"prunex": AUTO_WARMUP_EPOCHS, "prunex-flat": AUTO_WARMUP_EPOCHS,
                                                        "localsgd": 0.0, "pactrain": 0.0}
    assert auto["prunex"].warmup_epochs is None and auto["prunex"].resolved(10).warmup_epochs == AUTO_WARMUP_EPOCHS
    assert from_flags("--paper", "--epochs", "24").warmup() == 0.0
    assert from_flags("--paper", "--epochs", "24", "--warmup-epochs", "1").warmup() == 1.0
    short = from_flags("--method", "prunex", "--epochs", "4")
    assert short.warmup() == pytest.approx(4 * AUTO_WARMUP_MAX_FRACTION) and short.warmup() < AUTO_WARMUP_EPOCHS
    asked = from_flags("--method", "localsgd", "--epochs", "4", "--warmup-epochs", "2.5")
    assert asked.warmup() == 2.5 and TrainConfig.from_flat(method="prunex", warmup_epochs=0).warmup() == 0
    assert TrainConfig.from_flat(warmup_epochs="auto").warmup_epochs is None
    with pytest.raises(SystemExit):
        from_flags("--warmup-epochs", "soon")
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="warmup_epochs must be None"):
            TrainConfig(warmup_epochs=bad).validate()
    for method in ("localsgd", "prunex"):
        factor = _lr_factor(TrainConfig(method=method, epochs=4, warmup_epochs=1.0), steps_per_epoch=5)   # 20 steps
        assert [factor(s) for s in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0]), method
        assert [factor(s) for s in (5, 12, 20)] == pytest.approx([1.0, 0.5 * (1 + math.cos(math.pi * 7 / 15)), 0.0])
        assert _lr_factor(TrainConfig(method=method, epochs=4, warmup_epochs=0.0), 5)(0) == 1.0
