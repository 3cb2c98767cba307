"""H-SADMM on M×P ranks as threads of this process (prunex_hvd.dist.comm.threads), round by round against the
single-process reference: the checks test_engine_launch.py runs under mpirun on 2×2, here in seconds on any
layout, one node and one rank per node included.

Every rank builds its engine on its own (rank 0's parameters are broadcast), trains on its own data, and
snapshots its state before and after each round; the main thread then compares every rank's u, z_i, v, z, ρ,
masks and BN buffers with ``reference.reference_round``, checks the model is the same everywhere after
construction and after finalize(), and checks each rank's own ledger (tests/engine_cases.py)."""
import dataclasses
import json

import pytest
import torch
from torch import nn

import engine_cases as cases
from prunex_hvd.dist.comm.threads import thread_cluster
from prunex_hvd.engine.buckets import BucketLayout
from prunex_hvd.engine.config import ConsensusConfig, Structure
from prunex_hvd.engine import lowrank
from prunex_hvd.engine.hsadmm import HSADMM
from prunex_hvd.engine.sparsity import native
from reference import reference_masks, released_rho
from threaded import RankFailed, run_ranks

LAYOUTS = [(1, 1), (1, 3), (3, 1), (2, 2), (2, 3)]
# name: (model, sparsity argument, coupled, the specs it resolves to, the coupled pairs, the streams)
CASES = {"channel": ("chain", "channel:0.5", False, cases.CHANNEL, None, ()),
         "mixed": ("chain", cases.MIXED_SPARSITY, False, cases.MIXED, None, ()),
         "coupled": ("chain", "channel:0.5", True, cases.CHANNEL, cases.PAIR, ()),
         "coupled-shape": ("chain", cases.SHAPED_CONSUMER, True, cases.SHAPED_CONSUMER, cases.PAIR, ()),
         "streams": ("residual", "channel:0.5", "streams", cases.RESIDUAL, cases.RESIDUAL_PAIR, cases.STREAM),
         # beyond convs: heads (separate q/k/v; packed in_proj) and MLP hidden units, alone or coupled
         "vit": ("vit", "head:0.5+neuron:0.5", False, cases.VIT, None, ()),
         "vit-coupled": ("vit", "head:0.5+neuron:0.5", True, cases.VIT_COUPLED, cases.VIT_PAIR, ()),
         "mha-coupled": ("mha", "head:0.5+neuron:0.5", True, cases.MHA_COUPLED, cases.MHA_PAIR, ()),
         # every head and hidden unit of the same norm at the start: the nodes choose differently, the OR works
         "vit-even": ("vit-even", "head:0.5+neuron:0.5", True, cases.VIT_COUPLED, cases.VIT_PAIR, ())}
RUNS = [(layout, "channel") for layout in LAYOUTS] + \
       [(layout, case) for case in ("mixed", "coupled", "streams") for layout in ((2, 2), (2, 3))] + \
       [((2, 2), "coupled-shape")] + [(layout, case) for case in ("vit", "vit-coupled", "mha-coupled")
                                      for layout in ((2, 2), (2, 3))] + [((2, 2), "vit-even")]
# the accelerations (ConsensusConfig's restart, relaxation, rho_growth, keep_ramp_rounds), each against the
# reference of the modified math; a ramp of 2 rounds projects round 1 to keep 0.5 + 0.5·(1/2)³
LEVERS = {"paper-round": dict(restart="none"),   # the default restarts: this keeps θ where its steps left it
          "restart-node": dict(restart="node", relaxation=0.7),
          "relaxed": dict(relaxation=1.6),
          "all": dict(restart="global", relaxation=1.6, rho_growth=1.3, keep_ramp_rounds=2),
          # a narrow payload: the change since z, rounded, with error feedback (reference: the same rounding)
          "bf16": dict(payload_dtype="bf16"),
          "fp16-relaxed": dict(payload_dtype="fp16", relaxation=1.6, keep_ramp_rounds=2),
          # the command line's recipe with every ρ held (no residual balancing)
          "fixed-rho": dict(restart="global", node_sync=True, payload_dtype="bf16", adaptive_rho=False),
          # ... with ρ1 balanced and ρ2 held
          "hold-rho2": dict(restart="global", node_sync=True, payload_dtype="bf16", balance_rho2=False),
          # ... with ρ2 released from round 3: rounds 3-4 halve it toward its start instead of balancing it
          "release-rho2": dict(restart="global", node_sync=True, payload_dtype="bf16", rho2_release_round=3),
          # ... with one channel budget across layers: the chain's first conv keeps more channels, the second fewer
          "global-budget": dict(restart="global", node_sync=True, payload_dtype="bf16", channel_budget="global"),
          # ... with the balanced ρ's capped low (--rho-max auto's kind of cap): it binds within the 4 rounds
          "capped-rho": dict(restart="global", node_sync=True, payload_dtype="bf16", rho_max=0.07),
          # momentum across rounds: fast ADMM over 4 rounds without a freeze or a change of ρ (its momentum
          # builds); on the recipe (ρ changes and the freeze restart it); DiLoCo-like on z alone, relaxed and narrow
          "fast-admm": dict(restart="global", adaptive_rho=False, acceleration="fast-admm"),
          "fast-admm-recipe": dict(restart="global", node_sync=True, payload_dtype="bf16", acceleration="fast-admm"),
          "nesterov-relaxed": dict(restart="global", acceleration="nesterov", outer_momentum=0.5, relaxation=1.6),
          "nesterov-bf16": dict(restart="global", node_sync=True, payload_dtype="bf16", acceleration="nesterov",
                                outer_momentum=0.9),
          # the retraining phase as plain averaging: masks frozen after round 2, rounds 3-4 average
          "average": dict(retrain="average", weight_decay_z=0.0, freeze_round=2),
          "average-recipe": dict(retrain="average", weight_decay_z=0.0, freeze_round=2, node_sync=True,
                                 payload_dtype="bf16", relaxation=1.3, acceleration="nesterov"),
          # the masks chosen at the start from θ0 (freeze_round=0): every round on frozen masks, from the first;
          # on the recipe (one budget across layers), and per layer with θ left where its steps take it
          "start-frozen": dict(restart="global", node_sync=True, payload_dtype="bf16", channel_budget="global",
                               freeze_round=0),
          "start-frozen-paper": dict(restart="none", freeze_round=0, acceleration="nesterov")}
LEVER_RUNS = [((2, 2), "channel", "paper-round"), ((2, 3), "mixed", "paper-round"), ((2, 3), "channel", "restart-node"),
              ((2, 2), "mixed", "relaxed"), ((2, 3), "channel", "all"), ((1, 3), "channel", "all"),
              ((2, 2), "coupled", "all"), ((2, 2), "streams", "all"), ((2, 2), "channel", "bf16"),
              ((2, 3), "mixed", "bf16"), ((2, 2), "coupled", "fp16-relaxed"), ((2, 2), "channel", "fixed-rho"),
              ((2, 3), "mixed", "fixed-rho"), ((2, 2), "channel", "hold-rho2"), ((2, 3), "coupled", "hold-rho2"),
              ((2, 2), "channel", "release-rho2"), ((2, 3), "mixed", "release-rho2"),
              ((2, 2), "channel", "global-budget"), ((2, 3), "channel", "global-budget"),
              ((2, 2), "channel", "capped-rho"), ((2, 3), "mixed", "capped-rho"),
              ((2, 2), "channel", "fast-admm"), ((3, 1), "mixed", "fast-admm"), ((1, 3), "channel", "fast-admm"),
              ((2, 3), "coupled", "fast-admm-recipe"), ((2, 2), "mixed", "nesterov-relaxed"),
              ((2, 3), "channel", "nesterov-bf16"), ((2, 2), "channel", "average"), ((2, 3), "mixed", "average"),
              ((1, 3), "channel", "average"), ((2, 3), "coupled", "average-recipe"),
              ((2, 2), "channel", "start-frozen"), ((2, 3), "channel", "start-frozen"),
              ((2, 3), "streams", "start-frozen-paper"), ((2, 2), "mixed", "start-frozen-paper")]


def train_on_threads(num_nodes, local_size, kind, sparsity, coupled, nodes_per_rack=None, **knobs):
    """Every rank's snapshots, final model and result after ``cases.ROUNDS`` rounds on the thread cluster
    (``nodes_per_rack``: in racks)."""
    size = num_nodes * local_size
    models = [cases.make_model(kind, r) for r in range(size)]   # here: torch's global RNG is not thread-safe
    theta0 = cases.model_state(models[0])   # what the engines broadcast
    config = ConsensusConfig(sparsity=sparsity, coupled=coupled, **dict(cases.SETTINGS, **knobs))
    structure = Structure.resolve(models[0], config)
    native.module()   # load the shrink kernel before the ranks race to its first use
    cluster = thread_cluster(num_nodes, local_size, keep_records=True, nodes_per_rack=nodes_per_rack)

    def rank_run(rank):
        model = models[rank.topo.rank]
        eng = HSADMM(model, rank.topo, rank.groups, config, structure, ledger=rank.ledger)
        opt = cases.sgd(model)

        def step():   # what the wrapped optimizer's step() does
            eng.sync_node_grads()
            eng.add_proximal_grad()
            opt.step()
            eng.after_step()
        start = cases.model_state(model)
        rank.ledger.reset()   # the rounds' traffic only, not the initial broadcast
        x, y = cases.rank_batch(rank.topo.rank)
        befores, afters, reports = [], [], []
        for rnd in range(cases.ROUNDS):
            cases.local_steps(model, step, x, y)
            befores.append(cases.snapshot(eng))
            reports.append(eng.consensus_round(steps=(rnd + 1) * cases.LOCAL_STEPS))
            afters.append(cases.snapshot(eng))
        eng.finalize()
        result = cases.rank_result(eng, model, rank.topo, reports, cases.engine_stats(eng),
                                   rank.ledger.summary(by_op=True))
        return {"engine": eng, "theta0": theta0, "start": start, "before": befores, "after": afters,
                "final": cases.model_state(model), "result": json.loads(json.dumps(result))}   # as a worker sends it
    return cluster, run_ranks(num_nodes, local_size, rank_run, cluster=cluster), structure.specs


@pytest.mark.parametrize("layout,case,levers", [(la, c, None) for la, c in RUNS] + LEVER_RUNS,
                         ids=[f"{m}x{p}-{c}" for (m, p), c in RUNS] + [f"{m}x{p}-{c}-{lv}" for (m, p), c, lv in LEVER_RUNS])
def test_rounds_match_the_reference(layout, case, levers):
    kind, sparsity, coupled, want_specs, want_pairs, want_streams = CASES[case]
    num_nodes, local_size = layout
    cluster, runs, specs = train_on_threads(num_nodes, local_size, kind, sparsity, coupled,
                                            **LEVERS.get(levers, {}))
    assert {n: str(s) for n, s in specs.items()} == want_specs

    ref_rounds = check_against_the_reference(cluster, runs, want_specs, want_pairs, want_streams)
    if kind == "vit-even":
        assert_nodes_chose_apart(ref_rounds, runs[0]["engine"])
    if levers == "fast-admm" and num_nodes > 1:
        # round 1 starts the sequence (γ = 0); in round 2 momentum builds on the tensors whose combined residual
        # fell and restarts the others; the freeze after round 3 restarts all
        assert not any(ref_rounds[0]["gamma"].values()), ref_rounds[0]["gamma"]
        round2 = list(ref_rounds[1]["gamma"].values())
        assert 0.0 in round2 and max(round2) > 0.28, round2
        assert not any(ref_rounds[2]["gamma"].values()), ref_rounds[2]["gamma"]
    if levers == "capped-rho":   # balancing raised ρ1 and ρ2 onto the cap, and no further
        rhos = [v for rnd in runs[0]["after"] for key in ("rho1", "rho2") for v in rnd[key].values()]
        cap = LEVERS[levers]["rho_max"]
        assert max(rhos) == cap and sum(v == cap for v in rhos) >= 4, sorted(set(rhos))
    if levers == "release-rho2":   # balanced up in rounds 1-2, then halved: down, never below the start
        rho2 = [rnd["rho2"] for rnd in runs[0]["after"]]
        start = LEVERS[levers].get("rho2", cases.SETTINGS["rho2"])
        assert any(rho2[1][n] > start for n in rho2[1]), rho2[1]
        assert any(rho2[1][n] > rho2[0][n] for n in rho2[1]), (rho2[0], rho2[1])   # round 2 balanced, not released
        for before, after in zip(rho2[1:], rho2[2:]):
            assert all(after[n] == released_rho(before[n], start) for n in after)
        assert any(rho2[3][n] < rho2[1][n] for n in rho2[1])
    if levers == "global-budget":   # not the per-layer counts: conv 0 (larger weights) keeps 3 of 3
        support = runs[0]["result"]["final_support"]
        assert support["0.weight"][1] == 3 and support["3.weight"][1] < 4, support
    if levers and levers.startswith("start-frozen"):
        check_frozen_at_start(runs)
    if levers and levers.startswith("average"):   # the rounds after the freeze averaged: no penalty, no dual left
        last = runs[0]["after"][-1]
        assert last["frozen"] and not any(last["rho1"].values()) and not any(last["rho2"].values())
        assert not any(bool(t.any()) for key in ("u", "v") for t in last[key].values())
    for rank in cluster:   # every record as the ring model puts it: only the leaders' ring crosses nodes
        for rec in rank.ledger.records:
            crossing = rec.tier == "inter" and num_nodes > 1
            want = cases.ring_allreduce_bytes(rec.payload_bytes, num_nodes) if crossing else 0
            assert rec.cross_node_bytes == want, (rank.topo.rank, rec)


def check_against_the_reference(cluster, runs, want_specs, want_pairs, want_streams):
    """:func:`train_on_threads`' runs: the same model everywhere after construction and after finalize(), every
    round of every rank against the reference, every rank's bytes and final structure (engine_cases)."""
    cases.assert_same_everywhere([run["start"] for run in runs], "after construction")
    node_ranks, eng = cluster[0].topo.node_ranks, runs[0]["engine"]
    ref_rounds = [cases.check_round(rnd, [run["before"][rnd] for run in runs], [run["after"][rnd] for run in runs],
                                    node_ranks, eng) for rnd in range(cases.ROUNDS)]
    cases.assert_same_everywhere([run["final"] for run in runs], "after finalize")
    results = [run["result"] for run in runs]
    results[0].update(checks=len(runs) * cases.ROUNDS, ref_rounds=ref_rounds)
    cases.check_results(results, want_specs, couplings=want_pairs, streams=want_streams,
                        payload_bytes=eng.payload_dtype.itemsize, freeze_round=eng.config.freeze_round,
                        budget_floor=cases.budget_floor(eng.config))
    return ref_rounds


def check_frozen_at_start(runs):
    """``freeze_round=0``: every engine started frozen on the reference projection's support of the broadcast θ0
    (the same on every rank, chosen with no collective), at z = z_i = θ = Π_S(θ0), the duals 0; round 1 then
    ran on those masks (the reference checked it)."""
    eng = runs[0]["engine"]
    specs = {e.name: e.spec for e in eng.structured}
    theta0 = {e.name: runs[0]["theta0"][e.name] for e in eng.entries}
    masks = reference_masks({n: theta0[n] for n in specs}, specs, eng.couplings, eng.streams, eng.heads,
                            cases.budget_floor(eng.config))
    assert any(not bool(rows.all()) or not bool(cols.all()) for rows, cols in masks.values())
    for run in runs:
        first = run["before"][0]   # after round 1's local steps: the masks and the consensus as they started
        assert first["frozen"]
        for name, w in theta0.items():
            want = w * torch.outer(*masks[name]).reshape(w.shape) if name in specs else w
            assert torch.equal(run["start"][name], want.to(run["start"][name].dtype)), name
            for key in ("z", "z_i"):
                assert torch.equal(first[key][name], want.to(first[key][name].dtype)), (key, name)
            assert not first["v"][name].any() and not first["u"][name].any(), name
            if name in specs:
                assert all(torch.equal(a, b) for a, b in zip(first["masks"][name], masks[name])), name


def assert_nodes_chose_apart(ref_rounds, eng):
    """The nodes chose different heads and different MLP hidden units in some round: the mask OR had work to do."""
    differ = {n for rnd in ref_rounds for n in rnd["nodes_differ"]}
    heads = {n for g in eng.heads for n in g.members}
    assert differ & heads and differ - heads, (sorted(differ), sorted(heads))


def train_overlapped_on_threads(num_nodes, local_size, kind, sparsity, coupled, **knobs):
    """``overlap=True`` on the thread cluster: every rank's :func:`engine_cases.overlapped_rounds` record."""
    size = num_nodes * local_size
    models = [cases.make_model(kind, r) for r in range(size)]
    config = ConsensusConfig(sparsity=sparsity, coupled=coupled, overlap=True,
                             **dict(cases.SETTINGS, **dict(dict(overlap_after_freeze=False), **knobs)))   # default:
                                                                                            # every round
    structure = Structure.resolve(models[0], config)
    native.module()
    cluster = thread_cluster(num_nodes, local_size, keep_records=True)

    def rank_run(rank):
        model = models[rank.topo.rank]
        eng = HSADMM(model, rank.topo, rank.groups, config, structure, ledger=rank.ledger)
        opt = cases.sgd(model)

        def step():
            eng.sync_node_grads()
            eng.add_proximal_grad(grads_on_structure=True)   # as DistributedOptimizer.step
            opt.step()
            eng.after_step()
        rank.ledger.reset()
        x, y = cases.rank_batch(rank.topo.rank)
        rounds = iter(range(1, cases.ROUNDS + 1))
        rec = cases.overlapped_rounds(eng, model, step, x, y,
                                      lambda: eng.consensus_round(steps=next(rounds) * cases.LOCAL_STEPS))
        eng.finalize()
        result = cases.rank_result(eng, model, rank.topo, rec["reports"], cases.engine_stats(eng),
                                   rank.ledger.summary(by_op=True))
        momentum = {name: opt.state[p]["momentum_buffer"].clone() for name, p in model.named_parameters()}
        return dict(rec, engine=eng, final=cases.model_state(model), momentum=momentum,
                    result=json.loads(json.dumps(result)))
    return cluster, run_ranks(num_nodes, local_size, rank_run, cluster=cluster), structure.specs


OVERLAP_RUNS = {"2x2-channel": ((2, 2), "channel", {}),
                "2x3-mixed-bf16": ((2, 3), "mixed", dict(payload_dtype="bf16")),
                "2x2-coupled-node-relaxed": ((2, 2), "coupled", dict(restart="node", relaxation=1.6)),
                "3x1-channel-paper-round": ((3, 1), "channel", dict(restart="none")),
                "2x2-recipe": ((2, 2), "channel", dict(node_sync=True, keep_ramp_rounds=2, payload_dtype="bf16")),
                # folded in after the first of the next round's steps (freezing mid-round included)
                "2x2-fold-after-1-step": ((2, 2), "channel", dict(overlap_steps=1)),
                "2x3-recipe-fold-after-2-steps": ((2, 3), "mixed", dict(node_sync=True, keep_ramp_rounds=2,
                                                                         payload_dtype="bf16", overlap_steps=2)),
                # the default: rounds 1-3 blocking, round 4 (masks frozen at round 3) overlapped
                "2x2-recipe-after-freeze": ((2, 2), "channel", dict(node_sync=True, payload_dtype="bf16",
                                                                     overlap_after_freeze=True, overlap_steps=1)),
                # ... retraining by averaging: frozen after round 2, rounds 3-4 overlapped averages
                "2x3-recipe-average": ((2, 3), "mixed", dict(node_sync=True, payload_dtype="bf16", retrain="average",
                                                              keep_ramp_rounds=2, weight_decay_z=0.0, freeze_round=2,
                                                              overlap_after_freeze=True, overlap_steps=1)),
                # ... masks chosen at the start: every round overlapped from the first
                "2x2-recipe-frozen-at-start": ((2, 2), "channel", dict(node_sync=True, payload_dtype="bf16",
                                                                        channel_budget="global", freeze_round=0,
                                                                        overlap_after_freeze=True, overlap_steps=1))}


@pytest.mark.parametrize("run", list(OVERLAP_RUNS))
def test_overlapped_rounds_match_the_delayed_reference(run):
    """overlap=True: each round, once folded in, is the blocking round's math (reference_round); the local steps
    in between pull toward its z_i with its u at the previous ρ1 and start from z_i; θ moves by z − z_i at the
    fold (engine_cases.check_overlapped_round). Bytes as blocking: the exchange is the same, only later."""
    (num_nodes, local_size), case, knobs = OVERLAP_RUNS[run]
    kind, sparsity, coupled, want_specs, want_pairs, want_streams = CASES[case]
    cluster, runs, _ = train_overlapped_on_threads(num_nodes, local_size, kind, sparsity, coupled, **knobs)
    node_ranks, eng = cluster[0].topo.node_ranks, runs[0]["engine"]
    ref_rounds = cases.check_overlapped_rounds(runs, node_ranks, eng)
    cases.assert_same_everywhere([run["final"] for run in runs], "after finalize")
    results = [run["result"] for run in runs]
    results[0].update(checks=len(runs) * cases.ROUNDS, ref_rounds=ref_rounds)
    cases.check_results(results, want_specs, couplings=want_pairs, streams=want_streams,
                        payload_bytes=eng.payload_dtype.itemsize, freeze_round=eng.config.freeze_round,
                        budget_floor=cases.budget_floor(eng.config))
    overlapped = [True] * cases.ROUNDS if not knobs.get("overlap_after_freeze") else \
        [r["frozen_before"] for r in ref_rounds]   # the rounds after freeze_round
    assert [r["in_flight"] for r in runs[0]["reports"]] == overlapped
    assert overlapped.count(True) >= 1


def test_overlap_with_one_node_is_the_blocking_round():
    """With one node there is no inter-node exchange to overlap: the round is the blocking one."""
    cluster, runs, _ = train_on_threads(1, 2, "chain", "channel:0.5", False, overlap=True)
    assert not runs[0]["engine"].overlap
    for rnd in range(cases.ROUNDS):
        cases.check_round(rnd, [run["before"][rnd] for run in runs], [run["after"][rnd] for run in runs],
                          cluster[0].topo.node_ranks, runs[0]["engine"])


def test_half_payload_errors_are_kept_in_state_dict():
    """The leaders' rounding errors (error feedback) are engine state: saved, restored, zero on the ranks that
    send nothing across and in a checkpoint written without them."""
    cluster, runs, _ = train_on_threads(2, 2, "chain", "channel:0.5", False, payload_dtype="bf16")
    for rank, run in zip(cluster, runs):
        eng = run["engine"]
        sd = eng.state_dict()
        errors = [s["ef"] for s in sd["entries"].values()] + list(sd["buffer_ef"].values())
        assert any(bool(t.any()) for t in errors) == rank.topo.is_leader
        for e in eng.entries:
            e.ef.fill_(7.0)
        eng.load_state_dict(sd)
        assert all(torch.equal(e.ef, sd["entries"][e.name]["ef"]) for e in eng.entries)
        for s in sd["entries"].values():
            del s["ef"]
        del sd["buffer_ef"]
        eng.load_state_dict(sd)
        assert not any(bool(e.ef.any()) for e in eng.entries) and not any(bool(t.any()) for t in eng._buffer_ef)


def reference_node_steps(runs, node_ranks, kind, rho_of):
    """node_sync's local steps in one process: per node one model and one SGD, each step the mean of the node's
    ranks' data gradients (each on its own batch) plus ρ1(θ − z_i + u), masked once frozen, as in Eq. 8; the
    rounds themselves come from the engine's own snapshots (θ restarts at the round's θ). Returns, per round
    and node, θ just before the round."""
    out = []
    models = {i: cases.make_model(kind, 0) for i in range(len(node_ranks))}
    for i, ranks in enumerate(node_ranks):
        models[i].load_state_dict(runs[ranks[0]]["start"])
    opts = {i: cases.sgd(m) for i, m in models.items()}
    batches = {r: cases.rank_batch(r) for ranks in node_ranks for r in ranks}
    eng = runs[0]["engine"]
    state = {i: None for i in models}   # the node's state after the last round (None: the initial one)
    for rnd in range(cases.ROUNDS):
        out.append({})
        for i, ranks in enumerate(node_ranks):
            model, opt, prev = models[i], opts[i], state[i]
            params = dict(model.named_parameters())
            for _ in range(cases.LOCAL_STEPS):
                model.zero_grad()
                grads = {n: torch.zeros_like(p) for n, p in params.items()}
                for r in ranks:
                    x, y = batches[r]
                    g = torch.autograd.grad(nn.functional.cross_entropy(model(x), y), list(params.values()))
                    for n, gn in zip(params, g):
                        grads[n] += gn / len(ranks)
                for n, p in params.items():
                    u = prev["u"][n] if prev else torch.zeros_like(p)
                    z_i = prev["z_i"][n] if prev else runs[ranks[0]]["start"][n]
                    rho1 = prev["rho1"][n] if prev else rho_of
                    p.grad = grads[n] + rho1 * (p.detach() - z_i + u)
                    if prev and prev["frozen"] and n in prev["masks"]:
                        p.grad.mul_(_support(p, prev["masks"][n]))
                opt.step()
                if prev and prev["frozen"]:
                    with torch.no_grad():
                        for n, (rows, cols) in prev["masks"].items():
                            params[n].mul_(_support(params[n], (rows, cols)))
            out[rnd][i] = {n: p.detach().clone() for n, p in params.items()}
            state[i] = runs[ranks[0]]["after"][rnd]
            with torch.no_grad():   # the next round's steps start where the engine's round left θ
                for n, p in params.items():
                    p.copy_(state[i]["theta"][n])
    return out


def _support(p, masks):
    from prunex_hvd.engine.sparsity import apply_masks
    return apply_masks(torch.ones_like(p), *masks)


@pytest.mark.parametrize("layout,ramp", [((2, 2), 0), ((2, 3), 2), ((1, 3), 0)],
                         ids=["2x2", "2x3-ramp", "1x3"])
def test_node_sync_steps_match_the_reference(layout, ramp):
    """node_sync: the ranks of a node take the node's mean gradient, so they hold one θ, which follows the
    single-process reference of data-parallel steps within the node; the rounds still match reference_round,
    and the node's gradient allreduces are counted on the intra tier only. 2x3-ramp adds the keep ramp: the
    command line's recipe (restart, node_sync, keep ramp)."""
    num_nodes, local_size = layout
    cluster, runs, _ = train_on_threads(num_nodes, local_size, "chain", "channel:0.5", False, node_sync=True,
                                        keep_ramp_rounds=ramp)
    node_ranks, eng = cluster[0].topo.node_ranks, runs[0]["engine"]
    want = reference_node_steps(runs, node_ranks, "chain", cases.SETTINGS["rho1"])
    for rnd in range(cases.ROUNDS):
        for i, ranks in enumerate(node_ranks):
            for r in ranks:
                for name, theta in runs[r]["before"][rnd]["theta"].items():
                    cases.compare(f"round {rnd} rank {r} theta[{name}] before the round", theta, want[rnd][i][name])
        cases.check_round(rnd, [run["before"][rnd] for run in runs], [run["after"][rnd] for run in runs],
                          node_ranks, eng)
    syncs = [rec for rank in cluster for rec in rank.ledger.records if rec.tag == "node-sync"]
    assert all(rec.tier == "intra" and rec.cross_node_bytes == 0 for rec in syncs)
    # each step sends every gradient, once the masks froze only the structured weights' kept blocks (the
    # pruned entries are masked right after): the last round's steps carry the compact model
    full = sum(e.param.numel() for e in eng.entries)
    compact = sum(e.compact_numel() for e in eng.entries)
    assert eng.frozen and compact < full
    frozen_rounds = sum(runs[0]["before"][rnd]["frozen"] for rnd in range(cases.ROUNDS))
    sent = sum(rec.payload_bytes for rec in syncs) // 4   # float32
    assert frozen_rounds == 1 and sent == len(runs) * cases.LOCAL_STEPS * (
        (cases.ROUNDS - frozen_rounds) * full + frozen_rounds * compact)
    # one allreduce per bucket a step: the full layout's buckets, then the compact one's (the engine's last)
    full_buckets = len(BucketLayout([e.param.numel() for e in eng.entries], eng.dtype, eng.device,
                                    eng.bucket_bytes).buffers)
    assert len(syncs) == len(runs) * cases.LOCAL_STEPS * (
        (cases.ROUNDS - frozen_rounds) * full_buckets + frozen_rounds * len(eng._grads.buffers))
    for rank, run in zip(cluster, runs):   # counted in the engine's intra bytes, beside the rounds' own
        own = sum(rec.wire_bytes for rec in rank.ledger.records if rec.tag == "node-sync")
        assert run["engine"].bytes["intra"] >= own > (0 if local_size > 1 else -1)


def test_node_sync_without_it_is_local():
    """Without node_sync the ranks of a node step apart (the paper's local steps), so the test above can fail."""
    cluster, runs, _ = train_on_threads(2, 2, "chain", "channel:0.5", False)
    before = [run["before"][0]["theta"] for run in runs]
    assert any(not torch.equal(before[0][n], before[1][n]) for n in before[0])
    assert not any(rec.tag == "node-sync" for rank in cluster for rec in rank.ledger.records)


def test_node_sync_gives_a_missing_gradient_the_nodes_mean():
    """A parameter one rank did not use (grad None) takes the node's mean, so both ranks step it alike; one
    no rank used stays without a gradient (the optimizer skips it, as without node_sync)."""
    models = [nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2), nn.Linear(2, 2)) for _ in range(2)]
    config = ConsensusConfig(sparsity="dense", node_sync=True)
    structure = Structure.resolve(models[0], config)

    def rank_run(rank):
        model = models[rank.topo.rank]
        eng = HSADMM(model, rank.topo, rank.groups, config, structure, ledger=rank.ledger)
        for p in model.parameters():
            p.grad = None
        head = model[0] if rank.topo.rank == 1 else model[1]   # rank 0 uses layer 1, rank 1 only layer 0
        head.weight.grad = torch.full_like(head.weight, 2.0 + rank.topo.rank)
        eng.sync_node_grads()
        return [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    grads = run_ranks(1, 2, rank_run)
    assert torch.equal(grads[0][0], torch.full((2, 3), 1.5)) and torch.equal(grads[1][0], grads[0][0])   # (0 + 3) / 2
    assert torch.equal(grads[0][2], torch.full((2, 2), 1.0)) and torch.equal(grads[1][2], grads[0][2])   # (2 + 0) / 2
    assert all(g[i] is None for g in grads for i in (1, 3, 4, 5))   # biases, and the layer nobody used


# post-local SGD's synchronous phase (sync_rounds=2 of the 4 rounds): the recipe with its masks at the start, the
# paper's round with nesterov freezing at the phase's last round (masks chosen from the synchronous θ), one node,
# one rank per node with a narrow payload, θ trained dense on frozen masks (only z masked), a model without float
# buffers (the ViT's LayerNorms)
SYNC_RUNS = {"2x2-recipe": ((2, 2), "channel", dict(restart="global", node_sync=True, payload_dtype="bf16",
                                                     channel_budget="global", freeze_round=0)),
             "2x3-paper-freeze2": ((2, 3), "mixed", dict(restart="none", freeze_round=2, acceleration="nesterov")),
             "1x3": ((1, 3), "channel", {}),
             "3x1-bf16": ((3, 1), "channel", dict(payload_dtype="bf16")),
             "2x2-dense-theta": ((2, 2), "channel", dict(freeze_round=0, masked_retrain=False)),
             "2x2-vit": ((2, 2), "vit", dict(freeze_round=0)),
             # racks (nodes, ranks per node, nodes per rack): the steps' means go up the rack tier and the spine
             "4x2-racks-of-2": ((4, 2, 2), "channel", dict(payload_dtype="bf16", freeze_round=0))}
SYNC = 2


def powersgd_mean(node_grads, masks, rank, memory):
    """PowerSGD's mean of the nodes' gradients at ``rank``, written out for one process (Vogels et al. 2019, with
    error feedback and Q carried from step to step): each gradient's GEMM view, its kept block where ``masks``
    has the layer, is sent at rank ``rank`` if (rows + cols)·rank at most halves it, else whole. ``memory``
    holds each node's error and the shared Q per parameter, across calls."""
    out = {}
    for k, name in enumerate(node_grads[0]):
        full = node_grads[0][name]
        keep = masks.get(name)
        def block(g):
            view = g.reshape(g.shape[0] if g.dim() else 1, -1)
            return view[keep[0]][:, keep[1]] if keep is not None else view
        blocks = [block(g[name]) for g in node_grads]
        rows, cols = blocks[0].shape
        if min(rows, cols) > rank and 2 * (rows + cols) * rank <= rows * cols:
            if name not in memory:
                memory[name] = ([torch.zeros(rows, cols) for _ in node_grads],
                                torch.randn(cols, rank, generator=torch.Generator().manual_seed(k)))
            errors, q = memory[name]
            ms = [b + e for b, e in zip(blocks, errors)]
            p = torch.linalg.qr(sum(m @ q for m in ms) / len(ms)).Q
            q = sum(m.t() @ p for m in ms) / len(ms)
            mean = p @ q.t()
            memory[name] = ([m - mean for m in ms], q)
        else:
            mean = sum(blocks) / len(blocks)
        if keep is not None:
            grad = torch.zeros(full.shape[0], full.numel() // full.shape[0])
            grad[keep[0].nonzero()[:, 0].unsqueeze(1), keep[1].nonzero()[:, 0]] = mean
            out[name] = grad.view_as(full)
        else:
            out[name] = mean.reshape(full.shape)
    return out


def reference_sync_steps(runs, kind, masks, masked_steps, restart, nodes=None, powersgd_rank=0):
    """The synchronous phase in one process: one model and one SGD, each step on the mean of every rank's data
    gradient (each on its own batch), no proximal term; with ``masks`` (the structure frozen at the start) θ and the
    gradient on them after every step if ``masked_steps`` (``masked_retrain``), else θ put on them at each round
    when it restarts. With ``powersgd_rank`` the mean is :func:`powersgd_mean` of the ``nodes``' means. Returns θ
    before each of its rounds."""
    model = cases.make_model(kind, 0)
    model.load_state_dict(runs[0]["start"])
    opt, params = cases.sgd(model), dict(model.named_parameters())
    batches = [cases.rank_batch(r) for r in range(len(runs))]
    out, memory = [], {}
    for _ in range(SYNC):
        for _ in range(cases.LOCAL_STEPS):
            grads = {n: torch.zeros_like(p) for n, p in params.items()}
            per_rank = []
            for x, y in batches:
                g = torch.autograd.grad(nn.functional.cross_entropy(model(x), y), list(params.values()))
                per_rank.append(dict(zip(params, g)))
                for n, gn in zip(params, g):
                    grads[n] += gn / len(batches)
            if powersgd_rank:
                node_grads = [{n: sum(per_rank[r][n] for r in ranks) / len(ranks) for n in params} for ranks in nodes]
                grads = powersgd_mean(node_grads, masks if masked_steps else {}, powersgd_rank, memory)
            for n, p in params.items():
                p.grad = grads[n] * _support(p, masks[n]) if masked_steps and n in masks else grads[n]
            opt.step()
            with torch.no_grad():
                for n, m in masks.items() if masked_steps else ():
                    params[n].mul_(_support(params[n], m))
        out.append({n: p.detach().clone() for n, p in params.items()})
        with torch.no_grad():   # the round: θ at z, on the structure
            for n, m in masks.items() if masked_steps or restart != "none" else ():
                params[n].mul_(_support(params[n], m))
    return out


@pytest.mark.parametrize("run", list(SYNC_RUNS))
def test_sync_rounds_are_synchronous_sgd_then_admm_from_there(run):
    """sync_rounds: in the first rounds every rank steps on the world's mean gradient with no proximal term, so
    every rank holds the single-process reference's θ; each such round takes θ as the consensus (z = z_i = θ, on
    the structure if it freezes there, the duals 0, ẑ = z) and the float buffers' mean over the job; the rounds
    after it match the reference ADMM round from that state. The steps' gradients cross nodes on the leaders'
    tier only, compact once the masks are frozen."""
    layout, case, knobs = SYNC_RUNS[run]
    kind, sparsity, coupled, *_ = CASES[case]
    per_rack = layout[2] if len(layout) == 3 else None
    cluster, runs, _ = train_on_threads(*layout[:2], kind, sparsity, coupled, nodes_per_rack=per_rack,
                                        sync_rounds=SYNC, **knobs)
    node_ranks, eng = cluster[0].topo.node_ranks, runs[0]["engine"]
    assert eng.rack_tier == bool(per_rack)
    first = runs[0]["before"][0]
    want = reference_sync_steps(runs, kind, first["masks"] if first["frozen"] else {}, eng.config.masked_retrain,
                                eng.config.restart)
    for rnd in range(SYNC):
        befores, afters = [run["before"][rnd] for run in runs], [run["after"][rnd] for run in runs]
        cases.check_sync_round(rnd, befores, afters)
        assert all(bool(a["w"]) == bool(per_rack) for a in afters), rnd   # the rack state, where there are racks
        for r, before in enumerate(befores):
            for name, theta in before["theta"].items():
                cases.compare(f"round {rnd} rank {r} theta[{name}]", theta, want[rnd][name])
        assert afters[0]["frozen"] == (eng.config.freeze_round <= rnd + 1), rnd
    for rnd in range(SYNC, cases.ROUNDS):
        cases.check_round(rnd, [run["before"][rnd] for run in runs], [run["after"][rnd] for run in runs],
                          node_ranks, eng)
    cases.assert_same_everywhere([run["final"] for run in runs], "after finalize")
    compact = first["frozen"] and eng.config.masked_retrain   # (θ on the structure: only its blocks travel)
    grads = sum(e.compact_numel() if compact else e.param.numel() for e in eng.entries)
    buffer_numel = sum(b.numel() for _, b in eng.buffers)
    for rank in cluster:
        phase = [rec for rec in rank.ledger.records if rec.tag == "sync-phase"]
        crossing = [rec for rec in phase if rec.tier in ("inter", "rack", "spine")]
        if layout[0] == 1 or rank.topo.local_rank:   # one node, or not a leader: nothing crosses
            assert not crossing and not any(rec.cross_node_bytes for rec in phase), rank.topo.rank
            continue
        # every step's gradients, then every synchronous round's buffers, averaged across nodes by the leaders
        # (with racks: summed over the rack and handed back down it, the racks' sums averaged by their leaders)
        each = SYNC * (cases.LOCAL_STEPS * grads + buffer_numel) * cases.FLOAT_BYTES
        if per_rack:
            by_tier_op = {}
            for rec in crossing:
                by_tier_op[rec.tier, rec.op] = by_tier_op.get((rec.tier, rec.op), 0) + rec.payload_bytes
            want = {("rack", "allreduce"): each, ("rack", "broadcast"): each}
            if rank.topo.is_rack_leader:
                want["spine", "allreduce"] = each
            assert by_tier_op == want, (rank.topo.rank, by_tier_op)
            continue
        sent = sum(rec.payload_bytes for rec in crossing)
        assert sent == each, (rank.topo.rank, sent)


# sync_powersgd_rank: rank 2 sends the chain's convs as P and Q and its 5×12 head whole; rank 1 the head too
POWERSGD_RUNS = {"2x2-recipe-r2": ((2, 2), 2, dict(restart="global", node_sync=True, payload_dtype="bf16",
                                                  channel_budget="global", freeze_round=0)),
                 "3x1-r1-dense-grads": ((3, 1), 1, {}),   # masks not frozen in the phase: whole gradients' views
                 "4x2-racks-of-2-r1": ((4, 2, 2), 1, dict(freeze_round=0))}


@pytest.mark.parametrize("run", list(POWERSGD_RUNS))
def test_sync_powersgd_rank_is_powersgd_of_the_nodes_means(run):
    """sync_powersgd_rank: in the synchronous phase every rank steps on PowerSGD's rank-r mean of the nodes' mean
    gradients with error feedback (the single-process reference, :func:`powersgd_mean`), so every rank still holds
    one θ, and the phase's rounds and the ADMM rounds after it are what they are without it; across nodes the
    leaders send each compressed matrix's P and Q, (rows + cols)·r numbers, instead of its rows·cols."""
    layout, rank, knobs = POWERSGD_RUNS[run]
    per_rack = layout[2] if len(layout) == 3 else None
    cluster, runs, _ = train_on_threads(*layout[:2], "chain", cases.CHANNEL, False, nodes_per_rack=per_rack,
                                        sync_rounds=SYNC, sync_powersgd_rank=rank, **knobs)
    node_ranks, eng = cluster[0].topo.node_ranks, runs[0]["engine"]
    first = runs[0]["before"][0]
    compact = first["frozen"] and eng.config.masked_retrain
    want = reference_sync_steps(runs, "chain", first["masks"] if first["frozen"] else {}, eng.config.masked_retrain,
                                eng.config.restart, nodes=node_ranks, powersgd_rank=rank)
    plain = reference_sync_steps(runs, "chain", first["masks"] if first["frozen"] else {},
                                 eng.config.masked_retrain, eng.config.restart)
    for rnd in range(SYNC):
        befores, afters = [run["before"][rnd] for run in runs], [run["after"][rnd] for run in runs]
        cases.check_sync_round(rnd, befores, afters)
        for r, before in enumerate(befores):
            for name, theta in before["theta"].items():
                cases.compare(f"round {rnd} rank {r} theta[{name}]", theta, want[rnd][name])
    assert not torch.allclose(want[SYNC - 1]["3.weight"], plain[SYNC - 1]["3.weight"])   # it is not the plain mean
    for rnd in range(SYNC, cases.ROUNDS):
        cases.check_round(rnd, [run["before"][rnd] for run in runs], [run["after"][rnd] for run in runs],
                          node_ranks, eng)
    assert eng._lowrank is None   # the phase's error memory went with it
    sent_per_step = 0
    for e in eng.entries:
        rows, cols = (len(e.row_idx), len(e.col_idx)) if compact and e.structured else \
            lowrank.matrix_shape(e.param.shape)
        sent_per_step += (rows + cols) * rank if lowrank.compressible(rows, cols, rank) else rows * cols
    assert sent_per_step < sum(e.compact_numel() if compact else e.param.numel() for e in eng.entries)
    each = SYNC * (cases.LOCAL_STEPS * sent_per_step + sum(b.numel() for _, b in eng.buffers)) * cases.FLOAT_BYTES
    for rank_ in cluster:
        if per_rack or rank_.topo.local_rank:
            continue
        crossing = [rec for rec in rank_.ledger.records if rec.tag == "sync-phase" and rec.tier == "inter"]
        assert sum(rec.payload_bytes for rec in crossing) == each, rank_.topo.rank


def chain_engines(**knobs):
    """For a 2×2 thread cluster: a rank's model and a function making its engine under ``knobs``."""
    models = [cases.make_model("chain", r) for r in range(4)]
    structure = Structure.resolve(models[0], ConsensusConfig(sparsity="channel:0.5", **cases.SETTINGS))
    native.module()

    def engine(rank, **more):
        config = ConsensusConfig(sparsity="channel:0.5", **dict(cases.SETTINGS, **dict(knobs, **more)))
        return HSADMM(models[rank.topo.rank], rank.topo, rank.groups, config, structure, ledger=rank.ledger)
    return models, engine


def test_an_overlapped_round_refused_at_its_fold_leaves_the_previous_state():
    """overlap: NaN in one rank's θ when round 1 starts is only seen when round 1 is folded in (at round 2): every
    rank refuses it there, with the same error, and keeps the committed state of round 0 (masks included);
    nothing stays in flight."""
    models, engine = chain_engines(overlap=True, overlap_after_freeze=False)

    def rank_run(rank):
        model = models[rank.topo.rank]
        eng = engine(rank)
        if rank.topo.rank == 3:
            with torch.no_grad():
                next(model.parameters())[0].fill_(float("nan"))
        before = cases.snapshot(eng)
        eng.consensus_round(steps=0)   # round 1 starts; its NaN travels
        try:
            eng.consensus_round(steps=0)
        except FloatingPointError as exc:
            after = cases.snapshot(eng)
            return str(exc), before, after, eng._in_flight, eng.round
        return None
    out = run_ranks(2, 2, rank_run)
    assert all(o is not None for o in out), "a rank did not refuse the round"
    assert len({o[0] for o in out}) == 1 and "consensus round 1: inf or NaN in 0.weight" in out[0][0], out[0][0]
    for msg, before, after, in_flight, rounds in out:
        assert in_flight is None and rounds == 0
        for key in ("u", "z_i", "v", "z"):
            for name, t in before[key].items():
                assert torch.equal(t, after[key][name]), (key, name)
        for name, (rows, cols) in before["masks"].items():
            assert torch.equal(rows, after["masks"][name][0]) and torch.equal(cols, after["masks"][name][1])


def resume_on_threads(config, num_nodes, local_size, saved=None, cluster=None, take_at=2 * cases.LOCAL_STEPS,
                      model_first=False):
    """Every rank trains the chain model for ``cases.ROUNDS`` rounds (:func:`cases.run_with_snapshot`), taking a
    snapshot at step ``take_at`` (default: after round 2; None: none), or resuming there from ``saved`` (the
    snapshots of such a run; ``model_first``: the model loaded before the engine is built, as a script that loads
    its checkpoint and then wraps the optimizer does). Returns each rank's (final model state, bytes, snapshot)."""
    total = cases.ROUNDS * cases.LOCAL_STEPS
    models = [cases.make_model("chain", r) for r in range(num_nodes * local_size)]
    structure = Structure.resolve(models[0], config)

    def rank_run(rank):
        model = models[rank.topo.rank]
        if model_first:
            model.load_state_dict(saved[rank.topo.rank]["model"])
        eng = HSADMM(model, rank.topo, rank.groups, config, structure, ledger=rank.ledger)
        return cases.run_with_snapshot(eng, model, cases.sgd(model), rank.topo.rank, total, take_at,
                                       None if saved is None else saved[rank.topo.rank])
    return run_ranks(num_nodes, local_size, rank_run, cluster=cluster)


@pytest.mark.parametrize("at_round,at_step,fold", [(1, 0, None), (3, 0, None), (1, 1, 2)],
                         ids=["round-1", "round-3", "round-1-one-step-into-the-flight"])
def test_overlapped_state_dict_mid_flight_resumes_bit_for_bit(at_round, at_step, fold):
    """overlap: state_dict() with a round in flight completes its exchange (not its fold) and records it, with
    the flight's steps so far (folded after ``fold`` of them); an engine loaded from it (a fresh cluster, fresh
    models given θ and the optimizer's state) ends bit for bit where the run that took it ends, and where a
    run that took none ends (taking it changes nothing)."""
    knobs = dict(payload_dtype="bf16", node_sync=True, keep_ramp_rounds=2, overlap_steps=fold)
    config = ConsensusConfig(sparsity="channel:0.5", overlap=True, overlap_after_freeze=False,
                             **dict(cases.SETTINGS, **knobs))
    native.module()
    take_at = at_round * cases.LOCAL_STEPS + at_step
    plain = resume_on_threads(config, 2, 2, take_at=None)
    took = resume_on_threads(config, 2, 2, take_at=take_at)
    assert all(t[2]["engine"]["in_flight"]["steps_since"] == at_step for t in took)
    resumed = resume_on_threads(config, 2, 2, saved=[t[2] for t in took], take_at=take_at)
    for r in range(4):
        for k in plain[r][0]:
            assert torch.equal(plain[r][0][k], took[r][0][k]), f"taking state_dict changed rank {r}'s {k}"
            assert torch.equal(took[r][0][k], resumed[r][0][k]), f"rank {r}'s {k} differs after the resume"
        assert plain[r][1] == took[r][1], r


@pytest.mark.parametrize("acceleration", ["fast-admm", "nesterov"])
def test_accelerated_state_dict_resumes_bit_for_bit_and_fits_only_its_acceleration(acceleration):
    """The momentum is state (ẑ, the last z and v, a and the last combined residual): state_dict() after round 2 of
    4 (2×2, the recipe's bf16 payload and node_sync, ρ held so fast ADMM's momentum builds), loaded into fresh
    engines, ends bit for bit where the uninterrupted run ends. An engine with another acceleration (or none)
    refuses that state, and an accelerated one refuses a state saved without it."""
    native.module()

    def job(acc, saved=None):
        config = ConsensusConfig(sparsity="channel:0.5", node_sync=True, payload_dtype="bf16", acceleration=acc,
                                 **dict(cases.SETTINGS, adaptive_rho=False))
        return resume_on_threads(config, 2, 2, saved)
    whole = job(acceleration)
    resumed = job(acceleration, saved=[r[2] for r in whole])
    for r in range(4):
        assert all(torch.equal(whole[r][0][k], resumed[r][0][k]) for k in whole[r][0]), f"rank {r}"
    saved = whole[0][2]["engine"]["entries"]["3.weight"]
    assert not torch.equal(saved["z_hat"], saved["z"])   # the momentum moved ẑ off z by round 2
    other = "nesterov" if acceleration == "fast-admm" else "fast-admm"
    for resumed_with, saved_with, state in ((other, acceleration, whole), ("none", acceleration, whole),
                                            (acceleration, "none", job("none"))):
        with pytest.raises(RankFailed, match=f"saved with acceleration='{saved_with}', resumed with "
                                             f"'{resumed_with}'"):
            job(resumed_with, saved=[r[2] for r in state])


@pytest.mark.parametrize("model_first", [False, True], ids=["engine-first", "model-first"])
def test_masks_frozen_at_the_start_resume_bit_for_bit(model_first):
    """freeze_round=0 (the recipe's other knobs, 2×2): state_dict() after round 2 of 4, loaded into fresh engines,
    ends bit for bit where the uninterrupted run ends, whether the engine is built on a fresh model (its start
    masks chosen again) or on the model already loaded (chosen from trained weights, then replaced by the
    saved ones)."""
    native.module()
    config = ConsensusConfig(sparsity="channel:0.5", node_sync=True, payload_dtype="bf16", channel_budget="global",
                             **dict(cases.SETTINGS, freeze_round=0))
    whole = resume_on_threads(config, 2, 2)
    resumed = resume_on_threads(config, 2, 2, saved=[r[2] for r in whole], model_first=model_first)
    for r in range(4):
        assert all(torch.equal(whole[r][0][k], resumed[r][0][k]) for k in whole[r][0]), f"rank {r}"
    assert whole[0][2]["engine"]["frozen"] and whole[0][2]["engine"]["round"] == 2


@pytest.mark.parametrize("powersgd_rank", [0, 1], ids=["whole", "powersgd-rank-1"])
@pytest.mark.parametrize("take_at", [cases.LOCAL_STEPS, cases.LOCAL_STEPS + 1], ids=["round-1", "mid-round-2"])
def test_sync_rounds_resume_bit_for_bit(take_at, powersgd_rank):
    """sync_rounds=3 of 4, then an overlapped ADMM round (the recipe's other knobs, 2×2): state_dict() taken in
    the synchronous phase, after its first round or one step into its second, loaded into fresh engines, ends bit
    for bit where the uninterrupted run ends; with ``sync_powersgd_rank`` its Q and error memory are saved and
    loaded with it (a resume at another rank is refused on every rank)."""
    native.module()
    config = ConsensusConfig(sparsity="channel:0.5", node_sync=True, payload_dtype="bf16", channel_budget="global",
                             sync_rounds=3, overlap=True, overlap_after_freeze=False, sync_powersgd_rank=powersgd_rank,
                             **dict(cases.SETTINGS, freeze_round=0))
    plain = resume_on_threads(config, 2, 2, take_at=None)
    whole = resume_on_threads(config, 2, 2, take_at=take_at)
    resumed = resume_on_threads(config, 2, 2, saved=[r[2] for r in whole], take_at=take_at)
    for r in range(4):
        assert all(torch.equal(plain[r][0][k], whole[r][0][k]) for k in whole[r][0]), f"rank {r}: taking it"
        assert all(torch.equal(whole[r][0][k], resumed[r][0][k]) for k in whole[r][0]), f"rank {r}"
        assert plain[r][1] == whole[r][1], r
    assert whole[0][2]["engine"]["round"] == 1
    saved = whole[0][2]["engine"]["sync_lowrank"]
    assert (saved is not None) == bool(powersgd_rank)
    if powersgd_rank:
        assert saved["3.weight"]["q"].shape[1] == 1 and saved["3.weight"]["error"].abs().sum() > 0
        other = dataclasses.replace(config, sync_powersgd_rank=2)
        with pytest.raises(RankFailed, match="saved in the synchronous phase with sync_powersgd_rank=1, resumed "
                                             "with 2"):
            resume_on_threads(other, 2, 2, saved=[r[2] for r in whole], take_at=take_at)


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlapped"])
def test_averaged_retraining_resumes_bit_for_bit_and_only_with_its_retrain(overlap):
    """retrain="average": state_dict() after round 3 of 4 (masks frozen after round 2, the duals and ρ at 0),
    loaded into fresh engines, ends bit for bit where the uninterrupted run ends; an engine with retrain="admm"
    refuses that state on every rank, while a state from before the freeze loads into either."""
    native.module()

    def job(retrain, saved=None, take_at=3 * cases.LOCAL_STEPS):
        config = ConsensusConfig(sparsity="channel:0.5", node_sync=True, payload_dtype="bf16", retrain=retrain,
                                 overlap=overlap, **dict(cases.SETTINGS, weight_decay_z=0.0, freeze_round=2))
        return resume_on_threads(config, 2, 2, saved, take_at=take_at)
    whole = job("average")
    resumed = job("average", saved=[r[2] for r in whole])
    for r in range(4):
        assert all(torch.equal(whole[r][0][k], resumed[r][0][k]) for k in whole[r][0]), f"rank {r}"
    entries = whole[0][2]["engine"]["entries"]
    assert whole[0][2]["engine"]["frozen"] and not any(e["rho1"] or e["rho2"] for e in entries.values())
    with pytest.raises(RankFailed, match="saved after the masks froze with retrain='average', resumed with "
                                         "retrain='admm'"):
        job("admm", saved=[r[2] for r in whole])
    early = job("admm", take_at=cases.LOCAL_STEPS)   # round 1: nothing differs yet
    resumed = job("average", saved=[r[2] for r in early], take_at=cases.LOCAL_STEPS)
    assert all(torch.equal(whole[r][0][k], resumed[r][0][k]) for r in range(4) for k in whole[r][0])


def test_a_round_in_flight_is_refused_by_an_engine_without_overlap():
    """A checkpoint taken mid-flight holds a round whose fold an engine without overlap would not run: loading
    it there is a clear error, not a silent loss of the round."""
    _, engine = chain_engines()

    def rank_run(rank):
        eng = engine(rank, overlap=True, overlap_after_freeze=False)
        eng.consensus_round(steps=0)
        saved = eng.state_dict()
        plain = engine(rank)
        with pytest.raises(ValueError, match="holds a round in flight .* resume it with overlap=True"):
            plain.load_state_dict(saved)
        return True
    assert all(run_ranks(2, 2, rank_run))


@pytest.mark.parametrize("knobs", [dict(node_sync=True, payload_dtype="bf16", overlap_after_freeze=True,
                                        overlap_steps=1),
                                   dict(restart="none", overlap_after_freeze=True, overlap_steps=2),
                                   # every round overlapped, each folded in at the next round (no step reaches
                                   # overlap_steps): round 3's fold moves θ off the structure again (by z − θ_sent,
                                   # θ_sent from before the first masked step), and round 4's steps start there
                                   dict(overlap_after_freeze=False, overlap_steps=10 * cases.LOCAL_STEPS,
                                        freeze_round=1, node_sync=True)])
def test_compact_compute_trains_the_same_overlapped_model(knobs, monkeypatch):
    """compact_compute with overlapped rounds, the masks freezing at a fold mid-round: the layers turn compact
    only once θ is on the frozen structure, so the run ends where the dense-compute run does (float rounding
    apart), on every rank. So do the optimizer's momentum buffers, which alone see whether a step's gradient was
    masked outside the structure (θ is masked after every step): with node_sync and θ on the structure the mask
    pass is skipped, every term of the gradient being zero there already."""
    from prunex_hvd.engine import compact_compute as cc
    calls, plain = [], cc.conv2d_on_support
    monkeypatch.setattr(cc, "conv2d_on_support", lambda *a: calls.append(1) or plain(*a))
    finals = {}
    for compact in (True, False):
        calls.clear()
        _, runs, _ = train_overlapped_on_threads(2, 2, "chain", "channel:0.5", False, compact_compute=compact,
                                                 **knobs)
        assert bool(calls) == compact and runs[0]["engine"].frozen
        finals[compact] = [dict(run["final"], **{f"momentum {k}": v for k, v in run["momentum"].items()})
                           for run in runs]
    for got, want in zip(finals[True], finals[False]):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)
