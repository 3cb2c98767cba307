"""ConsensusConfig: each knob spelled once and read from there by the wrapper, the cross-rank agreement, the
training config and the command line; validated when made."""
import dataclasses
import inspect
import math

import pytest
import torch

import prunex_hvd as px
from models_for_tests import toy_cnn
from prunex_hvd.app import cli
from prunex_hvd.app.train import (AUTO_FREEZE, AUTO_RAMP, AUTO_RELEASE, AUTO_ROUND_PULL, AUTO_WARMUP_EPOCHS,
                                  AUTO_WARMUP_MAX_FRACTION, RECIPE, TrainConfig, _lr_factor)
from prunex_hvd.engine.config import ConsensusConfig, Structure

KNOBS = ConsensusConfig.knob_names()


@pytest.mark.parametrize("knobs,message", [
    ({"local_steps": 0}, r"local_steps must be an integer >= 1, got 0"),
    ({"local_steps": True}, r"local_steps must be an integer >= 1"),
    ({"rho1": 0.0}, r"rho1 must be a finite number > 0, got 0\.0"),
    ({"rho_max": math.inf}, r"rho_max must be a finite number > 0"),
    ({"rho3": -1.0}, r"rho3 must be a finite number > 0, got -1\.0"),
    ({"rho3": True}, r"rho3 must be a finite number > 0, got True"),
    ({"rack_tier": "yes"}, r"rack_tier must be True or False, got 'yes'"),
    ({"coupled": "yes"}, r"coupled must be False, True \(= 'pairs'\) or 'streams'"),
    ({"weight_decay_z": -1.0}, r"weight_decay_z must be >= 0"),
    ({"freeze_round": -1}, r"freeze_round must be None or an integer >= 0, got -1"),
    ({"freeze_round": 0, "keep_ramp_rounds": 2}, r"freeze_round=0 chooses the masks at the start.*keep_ramp_rounds=2"),
    ({"freeze_patience": 0}, r"freeze_patience must be an integer >= 1"),
    ({"keep_start_norm": 1, "freeze_round": 0}, r"keep_start_norm must be True or False, got 1"),
    ({"keep_start_norm": True, "freeze_round": 1}, r"keep_start_norm scales the start's projection.*freeze_round=0 "
                                                   r"\(got 1\)"),
    ({"keep_start_norm": True}, r"keep_start_norm .*freeze_round=0 \(got None\)"),
    ({"sync_rounds": -1}, r"sync_rounds must be an integer >= 0, got -1"),
    ({"sync_powersgd_rank": -1, "sync_rounds": 2}, r"sync_powersgd_rank must be an integer >= 0, got -1"),
    ({"sync_powersgd_rank": 4}, r"sync_powersgd_rank=4 compresses the synchronous phase's gradients, and "
                                r"sync_rounds=0 has no such phase"),
    ({"sync_rounds": 2, "freeze_round": 3, "keep_ramp_rounds": 2},
     r"sync_rounds=2 spends the first rounds synchronously.*keep_ramp_rounds=2"),
    ({"bucket_mb": 0}, r"bucket_mb must be a finite number > 0"),
    ({"backend": "tcp"}, r"unknown backend 'tcp'"),
    ({"node_sync": 1}, r"node_sync must be True or False, got 1"),
    ({"node_sync": True, "hierarchical": False}, r"node_sync=True needs hierarchical=True"),
    ({"overlap": 1}, r"overlap must be True or False, got 1"),
    ({"overlap": True, "hierarchical": False}, r"overlap=True overlaps the hierarchical consensus"),
    ({"overlap": True, "overlap_steps": 0}, r"overlap_steps must be None or an integer >= 1, got 0"),
    ({"overlap_after_freeze": "yes"}, r"overlap_after_freeze must be True or False, got 'yes'"),
    ({"overlap_steps": 3}, r"overlap_steps is when an overlapped round is folded in: it needs overlap=True"),
    ({"acceleration": "heavy-ball"}, r"acceleration must be one of none, fast-admm, nesterov, got 'heavy-ball'"),
    ({"acceleration": "nesterov", "outer_momentum": 1.0}, r"outer_momentum must be a number in \[0, 1\), got 1\.0"),
    ({"outer_momentum": True}, r"outer_momentum must be a number in \[0, 1\), got True"),
    ({"acceleration": "fast-admm", "hierarchical": False}, r"acceleration='fast-admm' acts on the inter-node tier"),
    ({"acceleration": "nesterov", "overlap": True}, r"acceleration='nesterov' is not available with overlap=True"),
    ({"retrain": "sgd"}, r"retrain must be one of admm, average, got 'sgd'"),
    ({"retrain": "average", "weight_decay_z": 0.1}, r"retrain='average' drops .* weight_decay_z=0\.1"),
    ({"retrain": "average", "acceleration": "fast-admm"}, r"acceleration='fast-admm' extrapolates the duals"),
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
    assert opt._engine.config == dataclasses.replace(config, rho2=0.005)
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
    changed = {"sparsity": {"*": "channel:0.5"}, "local_steps": 5, "rho1": 0.1, "rho2": 0.1, "rho_max": 5.0,
               "adaptive_rho": False, "balance_rho2": False, "rho2_release_round": 3, "weight_decay_z": 0.1,
               "freeze_round": 2,
               "freeze_patience": 9, "compact_compute": False,
               "masked_retrain": False, "coupled": True, "bucket_mb": 1.0, "backend": "gloo",
               "hierarchical": False, "restart": "node", "relaxation": 1.5, "rho_growth": 1.3,
               "keep_ramp_rounds": 4, "sync_rounds": 2, "node_sync": True, "payload_dtype": "bf16", "overlap": True,
               "overlap_steps": 2, "overlap_after_freeze": False, "rho3": 0.1, "rack_tier": False,
               "acceleration": "fast-admm", "outer_momentum": 0.9, "retrain": "average",
               "channel_budget": "global", "budget_floor": 0.2, "keep_start_norm": True,
               "sync_powersgd_rank": 4}
    assert set(changed) == set(KNOBS)
    # a knob that only means something with another
    needs = {"overlap_steps": {"overlap": True}, "keep_start_norm": {"freeze_round": 0},
             "sync_powersgd_rank": {"sync_rounds": 2}}
    for name, value in changed.items():
        other = dataclasses.replace(dataclasses.replace(base, **needs.get(name, {})), **{name: value})
        if name in needs:   # compared against the base with its prerequisite only
            agreed = dataclasses.replace(base, **needs[name]).agreement(Structure.resolve(model, base))
        theirs = other.agreement(Structure.resolve(model, other))
        differ = {k for k in agreed if agreed[k] != theirs[k]}
        # the same specs spelled another way resolve alike: not a disagreement
        assert differ == (set() if name == "sparsity" else {dict(rho1="rho", rho2="rho", rho_max="rho",
                          adaptive_rho="rho", balance_rho2="rho", rho2_release_round="rho", weight_decay_z="rho",
                          freeze_round="freezing",
                          freeze_patience="freezing", masked_retrain="freezing", compact_compute="freezing",
                          restart="round",
                          relaxation="round", rho_growth="rho", keep_ramp_rounds="freezing", sync_rounds="round",
                          node_sync="round", payload_dtype="round", overlap="round",
                          overlap_steps="round", overlap_after_freeze="round", rho3="rho",
                          acceleration="round", outer_momentum="round",
                          rack_tier="round", retrain="freezing", channel_budget="freezing",
                          budget_floor="freezing", keep_start_norm="freezing",
                          sync_powersgd_rank="round").get(name, name)}), name
        agreed = base.agreement(Structure.resolve(model, base))


def test_the_training_config_embeds_the_consensus_and_reads_flat_names():
    cfg = TrainConfig.from_flat(rho1=0.2, coupled="streams", local_steps=9, freeze_round=None, model="resnet_small")
    assert cfg.consensus == dataclasses.replace(RECIPE, rho1=0.2, coupled="streams", local_steps=9, freeze_round=None)
    assert (cfg.model, cfg.local_epochs, cfg.freeze_fraction) == ("resnet_small", None, None)
    flat = cfg.as_dict()
    assert "consensus" not in flat and {k: flat[k] for k in KNOBS} == cfg.consensus.knobs()
    assert TrainConfig.from_flat(**flat) == cfg   # as_dict and from_flat are each other's inverse
    default = TrainConfig.from_flat(local_steps=None, freeze_round=0, keep_ramp_rounds=0)   # the CLI's
    assert default == TrainConfig() and default.consensus == RECIPE and RECIPE.keep_ramp_rounds == 0
    assert (default.freeze_fraction, default.ramp_fraction, RECIPE.freeze_round) == (None, None, 0)
    assert TrainConfig.from_flat(freeze_round="auto").freeze_fraction == AUTO_FREEZE
    assert TrainConfig.from_flat(keep_ramp_rounds="auto", freeze_round=1).ramp_fraction == AUTO_RAMP
    assert TrainConfig.from_flat(keep_ramp_rounds=5, freeze_round=1).ramp_fraction is None   # a number asked
    # for counts; a ramp chooses the masks over its rounds, which the recipe's start does not have
    with pytest.raises(ValueError, match="freeze_round=0 chooses the masks at the start.*keep_ramp_rounds=5"):
        TrainConfig.from_flat(keep_ramp_rounds=5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'rho'"):   # neither a knob nor a field
        TrainConfig.from_flat(rho=0.1)


@pytest.mark.parametrize("epochs,steps_per_epoch,local_epochs", [(10, 7, 1.0), (9, 10, 1.0), (3, 5, 0.5),
                                                                 (1, 4, 1.0), (12, 3, 1.0)])
def test_the_schedule_in_epochs_resolves_as_before(epochs, steps_per_epoch, local_epochs):
    """local_steps from local_epochs, the masks chosen at the start by default and 'auto' at a third of the
    planned rounds (the formula the trainer used before the config was embedded), no keep ramp by default and the
    'auto' one over a quarter."""
    resolved = TrainConfig(epochs=epochs, local_epochs=local_epochs).resolved(steps_per_epoch).consensus
    assert (resolved.keep_ramp_rounds, resolved.freeze_round) == (0, 0)
    resolved = TrainConfig(epochs=epochs, local_epochs=local_epochs, freeze_fraction=AUTO_FREEZE,
                           ramp_fraction=AUTO_RAMP).resolved(steps_per_epoch).consensus
    local_steps = max(1, round(local_epochs * steps_per_epoch))
    rounds = math.ceil(max(1, round(epochs * steps_per_epoch)) / local_steps)
    assert resolved.local_steps == local_steps
    assert resolved.freeze_round == max(1, rounds // 3)
    assert resolved.keep_ramp_rounds == rounds // 4
    asked = TrainConfig.from_flat(epochs=epochs, local_steps=4, freeze_round=None,
                                  keep_ramp_rounds=3).resolved(steps_per_epoch)
    assert (asked.consensus.local_steps, asked.consensus.freeze_round, asked.consensus.keep_ramp_rounds) == \
        (4, None, 3)


def test_a_resume_names_the_settings_that_changed_but_not_how_it_is_launched():
    """What the trainer warns about on --resume: config.json as the run so far wrote it (resolved, through JSON)
    against the resumed run's settings."""
    import json

    from prunex_hvd.app.train import changed_settings
    began = json.loads(json.dumps(TrainConfig(freeze_fraction=AUTO_FREEZE).resolved(22).as_dict()))
    same = TrainConfig(freeze_fraction=AUTO_FREEZE, resume=True, threads=2, stop_after_rounds=3).resolved(22)
    assert changed_settings(began, same.as_dict()) == []
    now = TrainConfig(lr=0.1).resolved(22)   # the default since 2026-11-29: masks chosen at the start
    assert changed_settings(began, now.as_dict()) == ["freeze_fraction 0.3333333333333333 -> None",
                                                      "freeze_round 3 -> 0", "lr 0.05 -> 0.1",
                                                      "rho_max 0.09090909090909088 -> 0.04545454545454544"]
    del began["overlap"]   # a knob the earlier version did not have
    assert changed_settings(began, now.as_dict())[0] == "freeze_fraction 0.3333333333333333 -> None"


def test_every_knob_but_the_methods_own_is_a_flag_with_the_recipe_default():
    parser = cli.build_parser()
    args = parser.parse_args(["train"])
    cfg = cli._train_config(args)
    assert cfg == TrainConfig()
    auto = cli._train_config(parser.parse_args(["train", "--freeze-round", "auto"]))
    assert (auto.freeze_fraction, auto.consensus.freeze_round) == (AUTO_FREEZE, None)   # the fraction decides
    ramped = cli._train_config(parser.parse_args(["train", "--freeze-round", "auto", "--keep-ramp-rounds", "3"]))
    assert (ramped.resolved(10).consensus.freeze_round, ramped.consensus.keep_ramp_rounds) == (3, 3)
    with pytest.raises(ValueError, match="freeze_round=0 chooses the masks at the start.*keep_ramp_rounds=3"):
        cli._train_config(parser.parse_args(["train", "--keep-ramp-rounds", "3"]))   # the recipe's start: say so
    unset = cli._train_config(parser.parse_args(["train", "--freeze-round", "none"]))
    assert (unset.freeze_fraction, unset.consensus.freeze_round) == (None, None)   # only the patience
    flags = {a.dest for a in parser._subparsers._group_actions[0].choices["train"]._actions}
    assert set(KNOBS) - flags == {"hierarchical"}   # prunex or prunex-flat decides
    argv = ["train", "--rho1", "0.3", "--no-adaptive-rho", "--no-masked-retrain", "--coupled-streams",
            "--bucket-mb", "2", "--backend", "gloo", "--local-steps", "6", "--freeze-round", "4",
            "--freeze-patience", "5", "--weight-decay-z", "0.1", "--rho-max", "3", "--rho2", "0.2",
            "--sparsity", '{"*": "filter:0.5"}', "--restart", "node", "--relaxation", "1.5", "--rho-growth", "1.2",
            "--keep-ramp-rounds", "2", "--no-node-sync", "--payload-dtype", "fp16", "--no-balance-rho2",
            "--channel-budget", "layer", "--budget-floor", "0.3"]
    got = cli._train_config(parser.parse_args(argv)).consensus
    assert got == ConsensusConfig(sparsity={"*": "filter:0.5"}, local_steps=6, rho1=0.3, rho2=0.2, rho_max=3.0,
                                  adaptive_rho=False, weight_decay_z=0.1, freeze_round=4, freeze_patience=5,
                                  masked_retrain=False, coupled="streams", bucket_mb=2.0, backend="gloo",
                                  restart="node", relaxation=1.5, rho_growth=1.2, keep_ramp_rounds=2,
                                  payload_dtype="fp16", balance_rho2=False, budget_floor=0.3)
    # the recipe turns node_sync on; the last of --no-node-sync / --node-sync wins
    assert RECIPE.node_sync is True and ConsensusConfig().node_sync is False
    assert RECIPE.payload_dtype == "bf16" and ConsensusConfig().payload_dtype is None
    assert cli._train_config(parser.parse_args(["train", "--no-node-sync", "--node-sync"])).consensus.node_sync
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--restart", "sometimes"])
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--keep-ramp-rounds", "soon"])
    assert cli._train_config(parser.parse_args(["train", "--keep-ramp-rounds", "auto"])).ramp_fraction == AUTO_RAMP


def test_rho2_release_round_is_a_round_auto_or_none():
    """--rho2-release-round: N as asked, auto a third of the planned rounds (digits: 24 rounds, round 8), none
    (the default, here and in the library: balanced to the end); a bad value named."""
    parser = cli.build_parser()
    assert (TrainConfig().release_fraction, RECIPE.rho2_release_round, ConsensusConfig().rho2_release_round) == \
        (None, None, None)
    def resolved(*argv):
        return cli._train_config(parser.parse_args(["train", "--epochs", "24"] + list(argv))).resolved(10).consensus
    assert resolved().rho2_release_round is None
    assert resolved("--rho2-release-round", "auto").rho2_release_round == 24 // 3
    assert resolved("--rho2-release-round", "5").rho2_release_round == 5
    assert resolved("--rho2-release-round", "none").rho2_release_round is None
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--rho2-release-round", "later"])
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="rho2_release_round must be None or an integer >= 1"):
            ConsensusConfig(rho2_release_round=bad)


def test_channel_budget_is_layer_or_global_and_global_is_the_recipe():
    """channel_budget: 'layer' in the library (the paper's per-layer projection), 'global' in the command line's
    recipe; --channel-budget / --budget-floor reach the consensus; bad values are named."""
    parser = cli.build_parser()
    assert (ConsensusConfig().channel_budget, RECIPE.channel_budget, RECIPE.budget_floor) == ("layer", "global", 0.1)
    def consensus(*argv):
        return cli._train_config(parser.parse_args(["train"] + list(argv))).consensus
    assert consensus().channel_budget == "global"
    got = consensus("--channel-budget", "layer", "--budget-floor", "0.25")
    assert (got.channel_budget, got.budget_floor) == ("layer", 0.25)
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--channel-budget", "net"])
    with pytest.raises(ValueError, match="channel_budget must be one of layer, global, got 'net'"):
        ConsensusConfig(channel_budget="net")
    for bad in (0, 1.5, True, float("nan")):
        with pytest.raises(ValueError, match="budget_floor must be a fraction in"):
            ConsensusConfig(budget_floor=bad)


def test_rho_max_auto_caps_rho_where_a_rounds_steps_would_pull_theta_back_once():
    """--rho-max auto: ρ_max = round_pull·(1 − momentum)/(lr·local_steps), the local steps resolved from the epochs;
    never below the ρ's the run starts from; a number asked for counts as it is; momentum >= 1 has no such cap."""
    parser = cli.build_parser()
    auto = cli._train_config(parser.parse_args(["train", "--rho-max", "auto", "--lr", "0.05", "--momentum", "0.9"]))
    assert auto.round_pull == AUTO_ROUND_PULL == 1.0 and auto.consensus.rho_max == RECIPE.rho_max
    for steps_per_epoch, cap in ((22, 0.1 / (0.05 * 22)), (11, 0.1 / (0.05 * 11))):
        assert auto.resolved(steps_per_epoch).consensus.rho_max == pytest.approx(cap, rel=1e-12)
    asked = cli._train_config(parser.parse_args(["train", "--rho-max", "0.3"]))
    assert asked.round_pull is None and asked.resolved(22).consensus.rho_max == 0.3
    default = cli._train_config(parser.parse_args(["train", "--lr", "0.05"]))   # the CLI's recipe: auto
    assert default.round_pull == AUTO_ROUND_PULL and TrainConfig().round_pull == AUTO_ROUND_PULL
    assert default.resolved(22).consensus.rho_max == auto.resolved(22).consensus.rho_max
    assert TrainConfig.from_flat(round_pull=None).resolved(22).consensus.rho_max == RECIPE.rho_max   # no rule
    plain = TrainConfig.from_flat(rho_max="auto", momentum=0.0, lr=0.5, local_steps=4)
    assert plain.resolved(100).consensus.rho_max == pytest.approx(1 / (0.5 * 4))
    # a start above the cap is kept (auto only stops the growth): ρ1 0.8 against a cap of 0.5
    assert TrainConfig.from_flat(rho_max="auto", rho1=0.8, momentum=0.0, lr=0.5, local_steps=4) \
        .resolved(100).consensus.rho_max == 0.8
    written = TrainConfig.from_flat(rho_max="auto", local_steps=9)
    assert TrainConfig.from_flat(**written.as_dict()) == written   # config.json reads back
    with pytest.raises(ValueError, match="needs momentum < 1"):
        TrainConfig.from_flat(rho_max="auto", momentum=1.0).validate()
    TrainConfig.from_flat(rho_max=2.0, momentum=1.0).validate()   # a number: no gain to divide by
    with pytest.raises(ValueError, match="round_pull must be None"):
        TrainConfig(round_pull=-1.0).validate()
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--rho-max", "soon"])


def test_the_lr_warms_up_for_prunex_by_default_and_as_asked_for_any_method():
    """--warmup-epochs auto (the default): AUTO_WARMUP_EPOCHS for prunex / prunex-flat, at most
    AUTO_WARMUP_MAX_FRACTION of a short run, none for the rivals (their user's schedule as it is); a number counts
    for every method, whatever the run's length. The factor rises linearly to 1 over the warm-up's
    steps, then follows the cosine over the rest, from 1 down to 0 at the last step."""
    parser = cli.build_parser()
    auto = {m: cli._train_config(parser.parse_args(["train", "--method", m, "--epochs", "24"]))
            for m in ("prunex", "prunex-flat", "localsgd", "pactrain")}
    assert AUTO_WARMUP_EPOCHS <= AUTO_WARMUP_MAX_FRACTION * 24   # so the cap does not bite above
    assert {m: c.warmup() for m, c in auto.items()} == {"prunex": AUTO_WARMUP_EPOCHS, "prunex-flat": AUTO_WARMUP_EPOCHS,
                                                        "localsgd": 0.0, "pactrain": 0.0}
    assert auto["prunex"].warmup_epochs is None and auto["prunex"].resolved(10).warmup_epochs == AUTO_WARMUP_EPOCHS
    short = cli._train_config(parser.parse_args(["train", "--method", "prunex", "--epochs", "4"]))
    assert short.warmup() == pytest.approx(4 * AUTO_WARMUP_MAX_FRACTION) and short.warmup() < AUTO_WARMUP_EPOCHS
    asked = cli._train_config(parser.parse_args(["train", "--method", "localsgd", "--epochs", "4",
                                                 "--warmup-epochs", "2.5"]))
    assert asked.warmup() == 2.5 and TrainConfig.from_flat(method="prunex", warmup_epochs=0).warmup() == 0
    assert TrainConfig.from_flat(warmup_epochs="auto").warmup_epochs is None
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--warmup-epochs", "soon"])
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="warmup_epochs must be None"):
            TrainConfig(warmup_epochs=bad).validate()
    factor = _lr_factor(TrainConfig(epochs=4, warmup_epochs=1.0), steps_per_epoch=5)   # 20 steps, 5 warming up
    assert [factor(s) for s in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert [factor(s) for s in (5, 12, 20)] == pytest.approx([1.0, 0.5 * (1 + math.cos(math.pi * 7 / 15)), 0.0])
    assert _lr_factor(TrainConfig(epochs=4, warmup_epochs=0.0), 5)(0) == 1.0
