"""H-SADMM on M×P ranks as threads of this process (prunex_hvd.dist.comm.threads), round by round against the
single-process reference: the checks test_engine_launch.py runs under mpirun on 2×2, here in seconds on any
layout, one node and one rank per node included.

Every rank builds its engine on its own (rank 0's parameters are broadcast), trains on its own data, and
snapshots its state before and after each round; the main thread then compares every rank's u, z_i, v, z, ρ,
masks and BN buffers with ``reference.reference_round``, checks the model is the same everywhere after
construction and after finalize(), and checks each rank's own ledger (tests/engine_cases.py)."""
import json
import time

import pytest
import torch
from torch import nn

import engine_cases as cases
from prunex_hvd.dist.comm.threads import ThreadCommunicator, thread_cluster
from prunex_hvd.engine.buckets import BucketLayout
from prunex_hvd.engine.config import ConsensusConfig, Structure
from prunex_hvd.engine.hsadmm import HSADMM
from prunex_hvd.engine.sparsity import native
from reference import reference_masks
from threaded import run_ranks

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
# the round's other knobs, each against the reference of its math (the cases run cases.paper_config: the paper's
# round restarting at z)
LEVERS = {"paper-round": dict(restart="none"),   # θ left where its steps took it
          # a narrow payload: each leader's change against its base, rounded (reference: the same rounding)
          "bf16": dict(payload_dtype="bf16"),
          "fp16": dict(payload_dtype="fp16"),
          # the recipe's round (node_sync, bf16) with every ρ held (no residual balancing)
          "fixed-rho": dict(node_sync=True, payload_dtype="bf16", adaptive_rho=False),
          # ... with one channel budget across layers: the chain's first conv keeps more channels, the second fewer
          "global-budget": dict(node_sync=True, payload_dtype="bf16", channel_budget="global"),
          # ... with the balanced ρ's capped low (--rho-max auto's kind of cap): it binds within the 4 rounds
          "capped-rho": dict(node_sync=True, payload_dtype="bf16", rho_max=0.07),
          # the masks chosen at the start from θ0 (freeze_round=0): every round on frozen masks, from the first;
          # on the recipe (one budget across layers), and per layer with θ left where its steps take it
          "start-frozen": dict(node_sync=True, payload_dtype="bf16", channel_budget="global", freeze_round=0),
          "start-frozen-paper": dict(restart="none", freeze_round=0)}
LEVER_RUNS = [((2, 2), "channel", "paper-round"), ((2, 3), "mixed", "paper-round"),
              ((2, 2), "channel", "bf16"), ((2, 3), "mixed", "bf16"), ((2, 2), "coupled", "fp16"),
              ((2, 2), "channel", "fixed-rho"), ((2, 3), "mixed", "fixed-rho"),
              ((2, 2), "channel", "global-budget"), ((2, 3), "channel", "global-budget"),
              ((2, 2), "channel", "capped-rho"), ((2, 3), "mixed", "capped-rho"),
              ((2, 2), "channel", "start-frozen"), ((2, 3), "channel", "start-frozen"),
              ((2, 3), "streams", "start-frozen-paper"), ((2, 2), "mixed", "start-frozen-paper")]


def train_on_threads(num_nodes, local_size, kind, sparsity, coupled, nodes_per_rack=None, **knobs):
    """Every rank's snapshots, final model and result after ``cases.ROUNDS`` rounds on the thread cluster
    (``nodes_per_rack``: in racks), under :func:`engine_cases.paper_config` with ``knobs``."""
    size = num_nodes * local_size
    models = [cases.make_model(kind, r) for r in range(size)]   # here: torch's global RNG is not thread-safe
    theta0 = cases.model_state(models[0])   # what the engines broadcast
    config = cases.paper_config(sparsity=sparsity, coupled=coupled, **knobs)
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
    if levers == "capped-rho":   # balancing raised ρ1 and ρ2 onto the cap, and no further
        rhos = [v for rnd in runs[0]["after"] for key in ("rho1", "rho2") for v in rnd[key].values()]
        cap = LEVERS[levers]["rho_max"]
        assert max(rhos) == cap and sum(v == cap for v in rhos) >= 4, sorted(set(rhos))
    if levers == "global-budget":   # not the per-layer counts: conv 0 (larger weights) keeps 3 of 3
        support = runs[0]["result"]["final_support"]
        assert support["0.weight"][1] == 3 and support["3.weight"][1] < 4, support
    if levers and levers.startswith("start-frozen"):
        check_frozen_at_start(runs)
    for rank in cluster:   # every record as the ring model puts it: only the leaders' ring crosses nodes
        for rec in rank.ledger.records:
            crossing = rec.tier == "inter" and num_nodes > 1
            if rec.op == "broadcast":   # a chain from node 0's leader; the last leader sends nothing
                crossing = crossing and rank.topo.node < num_nodes - 1
                want = rec.payload_bytes if crossing else 0
            else:
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
                        payload_bytes=eng.state.payload_dtype.itemsize, freeze_round=eng.config.freeze_round,
                        global_budget=cases.global_budget(eng.config))
    return ref_rounds


def check_frozen_at_start(runs):
    """``freeze_round=0``: every engine started frozen on the reference projection's support of the broadcast θ0
    (the same on every rank: rank 0's choice), at z = z_i = θ = Π_S(θ0), the duals 0; round 1 then
    ran on those masks (the reference checked it)."""
    eng = runs[0]["engine"]
    specs = {e.name: e.spec for e in eng.structured}
    theta0 = {e.name: runs[0]["theta0"][e.name] for e in eng.entries}
    masks = reference_masks({n: theta0[n] for n in specs}, specs, eng.masks.couplings, eng.masks.streams, eng.masks.heads,
                            cases.global_budget(eng.config))
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
    heads = {n for g in eng.masks.heads for n in g.members}
    assert differ & heads and differ - heads, (sorted(differ), sorted(heads))


def train_overlapped_on_threads(num_nodes, local_size, kind, sparsity, coupled, **knobs):
    """``overlap`` (default True) on the thread cluster: every rank's :func:`engine_cases.overlapped_rounds`
    record."""
    size = num_nodes * local_size
    models = [cases.make_model(kind, r) for r in range(size)]
    config = cases.paper_config(sparsity=sparsity, coupled=coupled, **{"overlap": True, **knobs})
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


# the rounds overlap once the masks are frozen: from round 2 (frozen after round 1), from the first (frozen at
# the start), or round 4 alone (frozen after round 3); with overlap=True (a quarter of local_steps=100) each is
# folded in at the next round, with overlap=N after N of its steps
OVERLAP_RUNS = {"2x2-channel": ((2, 2), "channel", dict(freeze_round=1)),
                "2x3-mixed-bf16": ((2, 3), "mixed", dict(payload_dtype="bf16", freeze_round=1)),
                "2x2-coupled": ((2, 2), "coupled", dict(freeze_round=1)),
                "3x1-channel-paper-round": ((3, 1), "channel", dict(restart="none", freeze_round=1)),
                "2x2-recipe": ((2, 2), "channel", dict(node_sync=True, payload_dtype="bf16", freeze_round=1)),
                # folded in after the first of the next round's steps
                "2x2-fold-after-1-step": ((2, 2), "channel", dict(overlap=1, freeze_round=1)),
                "2x3-recipe-fold-after-2-steps": ((2, 3), "mixed", dict(node_sync=True, payload_dtype="bf16",
                                                                         overlap=2, freeze_round=1)),
                # rounds 1-3 blocking, round 4 (masks frozen at round 3) overlapped
                "2x2-recipe-after-freeze": ((2, 2), "channel", dict(node_sync=True, payload_dtype="bf16", overlap=1)),
                # masks chosen at the start: every round overlapped from the first
                "2x2-recipe-frozen-at-start": ((2, 2), "channel", dict(node_sync=True, payload_dtype="bf16",
                                                                        channel_budget="global", freeze_round=0,
                                                                        overlap=1))}


@pytest.mark.parametrize("run", list(OVERLAP_RUNS))
def test_overlapped_rounds_match_the_delayed_reference(run):
    """overlap: each round started on frozen masks, once folded in, is the blocking round's math
    (reference_round); the local steps in between pull toward its z_i with its u at the previous ρ1 and start
    from z_i; θ moves by z − z_i at the fold (engine_cases.check_overlapped_round). The rounds before the freeze
    are the blocking ones. Bytes as blocking: the exchange is the same, only later."""
    (num_nodes, local_size), case, knobs = OVERLAP_RUNS[run]
    kind, sparsity, coupled, want_specs, want_pairs, want_streams = CASES[case]
    cluster, runs, _ = train_overlapped_on_threads(num_nodes, local_size, kind, sparsity, coupled, **knobs)
    node_ranks, eng = cluster[0].topo.node_ranks, runs[0]["engine"]
    ref_rounds = cases.check_overlapped_rounds(runs, node_ranks, eng)
    cases.assert_same_everywhere([run["final"] for run in runs], "after finalize")
    results = [run["result"] for run in runs]
    results[0].update(checks=len(runs) * cases.ROUNDS, ref_rounds=ref_rounds)
    cases.check_results(results, want_specs, couplings=want_pairs, streams=want_streams,
                        payload_bytes=eng.state.payload_dtype.itemsize, freeze_round=eng.config.freeze_round,
                        global_budget=cases.global_budget(eng.config))
    overlapped = [r["frozen_before"] for r in ref_rounds]   # the rounds after freeze_round
    assert [r["in_flight"] for r in runs[0]["reports"]] == overlapped
    assert overlapped.count(True) >= 1


@pytest.mark.parametrize("overlapped", [False, True], ids=["blocking", "overlapped"])
def test_a_bf16_payload_anchored_every_other_round_matches_the_reference(monkeypatch, overlapped):
    """A narrow payload anchored every 2 rounds: rounds 1 and 2 code each leader's change against its base (z at
    the start), round 3 sends whole values in float32 and every base starts again from them, round 4 codes
    changes again: the reference round by round, and the bytes of each (bf16, float32 in round 3)."""
    from prunex_hvd.engine import codec
    monkeypatch.setattr(codec, "ANCHOR_EVERY", 2)
    kind, sparsity, coupled, want_specs, want_pairs, want_streams = CASES["mixed"]
    knobs = dict(node_sync=True, payload_dtype="bf16")
    if overlapped:
        cluster, runs, _ = train_overlapped_on_threads(2, 3, kind, sparsity, coupled, freeze_round=1, **knobs)
        eng = runs[0]["engine"]
        ref_rounds = cases.check_overlapped_rounds(runs, cluster[0].topo.node_ranks, eng)
        results = [run["result"] for run in runs]
        results[0].update(checks=len(runs) * cases.ROUNDS, ref_rounds=ref_rounds)
        cases.check_results(results, want_specs, payload_bytes=2, freeze_round=1)
    else:
        cluster, runs, _ = train_on_threads(2, 3, kind, sparsity, coupled, **knobs)
        ref_rounds = check_against_the_reference(cluster, runs, want_specs, want_pairs, want_streams)
    assert [r["anchored"] for r in ref_rounds] == [False, False, True, False]


def test_overlap_with_one_node_is_the_blocking_round():
    """With one node there is no inter-node exchange to overlap: the round is the blocking one."""
    cluster, runs, _ = train_on_threads(1, 2, "chain", "channel:0.5", False, overlap=True)
    assert not runs[0]["engine"].overlap.enabled
    for rnd in range(cases.ROUNDS):
        cases.check_round(rnd, [run["before"][rnd] for run in runs], [run["after"][rnd] for run in runs],
                          cluster[0].topo.node_ranks, runs[0]["engine"])


def test_half_payload_bases_are_kept_in_state_dict():
    """A narrow payload's bases (each leader's sent values, summed; nobody else keeps one) and the buffers'
    rounding errors are engine state: saved and restored; a checkpoint written without them (another payload, an
    earlier version) anchors the next round (whole values)."""
    cluster, runs, _ = train_on_threads(2, 2, "chain", "channel:0.5", False, payload_dtype="bf16")
    for rank, run in zip(cluster, runs):
        eng = run["engine"]
        sd = eng.state_dict()
        assert all((s["sent"] is not None) == rank.topo.is_leader for s in sd["entries"].values())
        assert any(bool(t.any()) for t in sd["buffer_ef"].values()) == rank.topo.is_leader
        assert sd["anchored_at"] == 0 and eng.codec.round_dtype() == torch.bfloat16   # no round anchored yet
        for e in eng.entries if rank.topo.is_leader else ():
            e.sent.fill_(7.0)
        eng.state.anchored_at = None
        eng.load_state_dict(sd)
        assert all(torch.equal(e.sent, sd["entries"][e.name]["sent"]) for e in eng.entries if e.sent is not None)
        assert eng.state.anchored_at == 0
        for s in sd["entries"].values():
            del s["sent"]
        del sd["buffer_ef"], sd["anchored_at"]
        eng.load_state_dict(sd)
        assert not any(bool(t.any()) for t in eng.state.buffer_ef)
        assert eng.state.anchored_at is None and eng.codec.round_dtype() == torch.float32


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


@pytest.mark.parametrize("layout,knobs", [((2, 2), {}), ((2, 3), dict(payload_dtype="bf16")), ((1, 3), {})],
                         ids=["2x2", "2x3-bf16", "1x3"])
def test_node_sync_steps_match_the_reference(layout, knobs):
    """node_sync: the ranks of a node take the node's mean gradient, so they hold one θ, which follows the
    single-process reference of data-parallel steps within the node; the rounds still match reference_round,
    and the node's gradient allreduces are counted on the intra tier only. 2x3-bf16 adds the recipe's narrow
    payload."""
    num_nodes, local_size = layout
    cluster, runs, _ = train_on_threads(num_nodes, local_size, "chain", "channel:0.5", False, node_sync=True,
                                        **knobs)
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
    sent = sum(rec.payload_bytes for rec in syncs) // 4   # float32, with a has-a-gradient flag per parameter
    assert frozen_rounds == 1 and sent == len(runs) * cases.LOCAL_STEPS * (
        (cases.ROUNDS - frozen_rounds) * full + frozen_rounds * compact + cases.ROUNDS * len(eng.entries))
    # one allreduce per bucket a step: the full layout's buckets, then the compact one's (the engine's last)
    full_buckets = len(BucketLayout([e.param.numel() for e in eng.entries] + [len(eng.entries)], eng.state.dtype,
                                    eng.state.device, eng.state.bucket_bytes).buffers)
    assert len(syncs) == len(runs) * cases.LOCAL_STEPS * (
        (cases.ROUNDS - frozen_rounds) * full_buckets + frozen_rounds * len(eng.steps.grad_buckets.buffers))
    for rank, run in zip(cluster, runs):   # counted in the engine's intra bytes, beside the rounds' own
        own = sum(rec.wire_bytes for rec in rank.ledger.records if rec.tag == "node-sync")
        assert run["engine"].bytes["intra"] >= own > (0 if local_size > 1 else -1)


def test_node_sync_without_it_is_local():
    """Without node_sync the ranks of a node step apart (the paper's local steps), so the test above can fail."""
    cluster, runs, _ = train_on_threads(2, 2, "chain", "channel:0.5", False)
    before = [run["before"][0]["theta"] for run in runs]
    assert any(not torch.equal(before[0][n], before[1][n]) for n in before[0])
    assert not any(rec.tag == "node-sync" for rank in cluster for rec in rank.ledger.records)


def node_synced_grads(layers, set_grads):
    """One node of 2 ranks, each with a chain of ``layers`` linear layers (node_sync, dense): ``set_grads(model,
    rank)`` sets this rank's gradients, then the node syncs them. Each rank's gradients after, None where none."""
    models = [nn.Sequential(nn.Linear(3, 2), *(nn.Linear(2, 2) for _ in range(layers - 1))) for _ in range(2)]
    config = ConsensusConfig.paper(sparsity="dense", node_sync=True)
    structure = Structure.resolve(models[0], config)

    def rank_run(rank):
        model = models[rank.topo.rank]
        eng = HSADMM(model, rank.topo, rank.groups, config, structure, ledger=rank.ledger)
        set_grads(model, rank.topo.rank)
        eng.sync_node_grads()
        return [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return run_ranks(1, 2, rank_run)


def test_node_sync_gives_a_missing_gradient_the_nodes_mean():
    """A parameter one rank did not use (grad None) takes the node's mean, so both ranks step it alike; one
    no rank used stays without a gradient (the optimizer skips it, as without node_sync)."""
    def one_layer_each(model, rank):
        for p in model.parameters():
            p.grad = None
        head = model[0] if rank == 1 else model[1]   # rank 0 uses layer 1, rank 1 only layer 0
        head.weight.grad = torch.full_like(head.weight, 2.0 + rank)
    grads = node_synced_grads(3, one_layer_each)
    assert torch.equal(grads[0][0], torch.full((2, 3), 1.5)) and torch.equal(grads[1][0], grads[0][0])   # (0 + 3) / 2
    assert torch.equal(grads[0][2], torch.full((2, 2), 1.0)) and torch.equal(grads[1][2], grads[0][2])   # (2 + 0) / 2
    assert all(g[i] is None for g in grads for i in (1, 3, 4, 5))   # biases, and the layer nobody used


def test_node_sync_treats_a_missing_gradient_and_a_zero_one_alike():
    """One rank has no gradient for a parameter, the other an exactly zero one: both step it, with the mean (0),
    so weight decay and momentum move it alike on both and the node keeps one θ; stepped alone, one rank would
    skip it and the other not."""
    def none_or_zero(model, rank):
        for p in model.parameters():
            p.grad = None if rank == 0 else torch.zeros_like(p)
    grads = node_synced_grads(2, none_or_zero)
    assert all(g is not None and not g.any() for rank in grads for g in rank), grads


def chain_engines(**knobs):
    """For a 2×2 thread cluster: a rank's model and a function making its engine under ``knobs``
    (:func:`engine_cases.paper_config`)."""
    models = [cases.make_model("chain", r) for r in range(4)]
    structure = Structure.resolve(models[0], cases.paper_config(sparsity="channel:0.5"))
    native.module()

    def engine(rank, **more):
        config = cases.paper_config(sparsity="channel:0.5", **dict(knobs, **more))
        return HSADMM(models[rank.topo.rank], rank.topo, rank.groups, config, structure, ledger=rank.ledger)
    return models, engine


def test_an_overlapped_round_refused_at_its_fold_leaves_the_previous_state():
    """overlap (masks frozen at the start, so round 1 overlaps): NaN in one rank's θ when round 1 starts is only
    seen when round 1 is folded in (at round 2): every rank refuses it there, with the same error, and keeps the
    committed state of round 0 (masks included); nothing stays in flight."""
    models, engine = chain_engines(overlap=True, freeze_round=0)

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
            return str(exc), before, after, eng.overlap.in_flight, eng.round
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


@pytest.mark.parametrize("freeze_round", [0, 1], ids=["at-the-start", "at-round-1"])
def test_masks_chosen_apart_at_a_tie_are_rank_0_s_on_every_rank(monkeypatch, freeze_round):
    """Rank 3 sees the strongest input channel its second conv drops tie with the weakest one it keeps, a hair
    larger (another BLAS path, another thread count), and keeps it instead. Whether the masks are chosen from θ0
    at the start or from z at the freeze, every rank takes rank 0's choice."""
    from prunex_hvd.engine.masks import MaskPolicy
    models, engine = chain_engines(freeze_round=freeze_round)
    chosen, masks = {}, MaskPolicy.masks

    def seen_apart(self, weights):
        if self.state.topo.rank == 3:
            names = [e.name for e in self.state.structured]
            w = weights["3.weight"].clone()
            kept = masks(self, weights)[names.index("3.weight")][1].view(w.shape[1], -1).any(1)   # channels
            norms = w.pow(2).sum((0, 2, 3))
            weakest_kept = int(norms.masked_fill(~kept, float("inf")).argmin())
            strongest_dropped = int(norms.masked_fill(kept, -1).argmax())
            w[:, strongest_dropped] = w[:, weakest_kept] * (1 + 2 ** -20)
            weights = dict(weights, **{"3.weight": w})
        got = masks(self, weights)
        chosen[self.state.topo.rank] = dict(zip([e.name for e in self.state.structured], got))
        return got
    monkeypatch.setattr(MaskPolicy, "masks", seen_apart)

    def rank_run(rank):
        model = models[rank.topo.rank]
        eng, opt = engine(rank), cases.sgd(model)
        if freeze_round:
            cases.local_steps(model, lambda: (opt.step(), eng.after_step()), *cases.rank_batch(rank.topo.rank))
            eng.consensus_round(steps=cases.LOCAL_STEPS)
        return {e.name: (e.rows.clone(), e.cols.clone()) for e in eng.structured}
    out = run_ranks(2, 2, rank_run)
    assert not torch.equal(chosen[3]["3.weight"][1], chosen[0]["3.weight"][1])   # the ranks chose apart
    assert torch.equal(out[0]["3.weight"][1], chosen[0]["3.weight"][1])
    for rank_masks in out[1:]:
        for name, (rows, cols) in rank_masks.items():
            assert torch.equal(rows, out[0][name][0]) and torch.equal(cols, out[0][name][1]), name


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
    """overlap (the recipe's round, masks frozen at the start so every round overlaps): state_dict() with a round
    in flight completes its exchange (not its fold) and records it, with the flight's steps so far (folded after
    ``fold`` of them, else at the next round); an engine loaded from it (a fresh cluster, fresh models given θ and
    the optimizer's state) ends bit for bit where the run that took it ends, and where a run that took none ends
    (taking it changes nothing)."""
    config = cases.paper_config(sparsity="channel:0.5", payload_dtype="bf16", node_sync=True, freeze_round=0,
                                overlap=fold or True)
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


def test_the_next_round_s_guard_meets_the_leaders_only_after_their_average_in_flight(monkeypatch):
    """overlap=True with node_sync: the round in flight is folded in at the next round, after that round's guard has
    summed over the leaders. When one leader's average finishes late (here node 0's, by 0.3 s), the other's
    guard must not meet it on the leaders' group: a group's collectives complete in the order they were issued,
    and the run ends bit for bit where the run without the delay does."""
    config = cases.paper_config(sparsity="channel:0.5", payload_dtype="bf16", node_sync=True, freeze_round=0,
                                overlap=True)
    native.module()
    prompt = resume_on_threads(config, 2, 2, take_at=None)
    original = ThreadCommunicator._allreduce_in_background

    def late_on_node_0(self, tensor, op):
        if self.tier == "inter" and self.rank == 0:
            time.sleep(0.3)
        original(self, tensor, op)
    monkeypatch.setattr(ThreadCommunicator, "_allreduce_in_background", late_on_node_0)
    late = resume_on_threads(config, 2, 2, take_at=None)
    for r in range(4):
        assert all(torch.equal(prompt[r][0][k], late[r][0][k]) for k in prompt[r][0]), f"rank {r}"
        assert prompt[r][1] == late[r][1], r


@pytest.mark.parametrize("model_first", [False, True], ids=["engine-first", "model-first"])
def test_masks_frozen_at_the_start_resume_bit_for_bit(model_first):
    """freeze_round=0 (the recipe's other knobs, 2×2): state_dict() after round 2 of 4, loaded into fresh engines,
    ends bit for bit where the uninterrupted run ends, whether the engine is built on a fresh model (its start
    masks chosen again) or on the model already loaded (chosen from trained weights, then replaced by the
    saved ones)."""
    native.module()
    config = cases.paper_config(sparsity="channel:0.5", node_sync=True, payload_dtype="bf16", channel_budget="global",
                                freeze_round=0)
    whole = resume_on_threads(config, 2, 2)
    resumed = resume_on_threads(config, 2, 2, saved=[r[2] for r in whole], model_first=model_first)
    for r in range(4):
        assert all(torch.equal(whole[r][0][k], resumed[r][0][k]) for k in whole[r][0]), f"rank {r}"
    assert whole[0][2]["engine"]["frozen"] and whole[0][2]["engine"]["round"] == 2


def test_a_round_in_flight_is_refused_by_an_engine_without_overlap():
    """A checkpoint taken mid-flight holds a round whose fold an engine without overlap would not run: loading
    it there is a clear error, not a silent loss of the round."""
    _, engine = chain_engines()

    def rank_run(rank):
        eng = engine(rank, overlap=True, freeze_round=0)
        eng.consensus_round(steps=0)
        saved = eng.state_dict()
        plain = engine(rank, freeze_round=0)
        with pytest.raises(ValueError, match="holds a round in flight .* resume it with overlap=True"):
            plain.load_state_dict(saved)
        return True
    assert all(run_ranks(2, 2, rank_run))


@pytest.mark.parametrize("knobs", [dict(node_sync=True, payload_dtype="bf16", overlap=1),
                                   dict(restart="none", overlap=2),
                                   # frozen after round 1, rounds 2-4 overlapped, each folded in at the next
                                   # round (no step reaches a quarter of local_steps=100)
                                   dict(overlap=True, freeze_round=1, node_sync=True)])
def test_compact_compute_trains_the_same_overlapped_model(knobs, monkeypatch):
    """Compact compute with overlapped rounds after the masks froze: the layers turn compact only once θ is on
    the frozen structure, so the run ends where the dense-compute run (no layer taken for compact compute) does
    (float rounding apart), on every rank. So do the optimizer's momentum buffers, which alone see whether a
    step's gradient was masked outside the structure (θ is masked after every step): with node_sync and θ on the
    structure the mask pass is skipped, every term of the gradient being zero there already."""
    from prunex_hvd.engine import compact_compute as cc
    calls, plain = [], cc.conv2d_on_support
    monkeypatch.setattr(cc, "conv2d_on_support", lambda *a: calls.append(1) or plain(*a))
    finals = {}
    for compact in (True, False):
        calls.clear()
        with pytest.MonkeyPatch.context() as mp:
            if not compact:   # the dense-compute run: every layer multiplies in full, every gradient is masked
                mp.setattr(cc, "supports", lambda layer: False)
            _, runs, _ = train_overlapped_on_threads(2, 2, "chain", "channel:0.5", False, **knobs)
        assert bool(calls) == compact and runs[0]["engine"].frozen
        assert any(r["in_flight"] for r in runs[0]["reports"])
        finals[compact] = [dict(run["final"], **{f"momentum {k}": v for k, v in run["momentum"].items()})
                           for run in runs]
    for got, want in zip(finals[True], finals[False]):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)
