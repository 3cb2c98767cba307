"""Nodes lost and joined (docs/algorithm.md, "Nodes lost and joined"), on thread clusters against the
single-process reference: 3 nodes × 2 ranks train two rounds; node 2 is lost and the survivors go on over 2 nodes
from memory (``joining.reform``), their round the reference round over the survivors alone; then a new node joins
(``joining.joiner`` + ``welcome``), takes z, the masks, ρ and the round with zero duals, and the next round over 3
nodes is again the reference round, the joiner's candidate included."""
import pytest
import torch

import engine_cases as cases
from prunex_hvd.dist.comm.threads import thread_cluster
from prunex_hvd.engine import joining
from prunex_hvd.engine.config import Structure
from prunex_hvd.engine.hsadmm import HSADMM
from prunex_hvd.engine.sparsity import native
from threaded import run_ranks

P = 2   # ranks per node


def _step(eng, opt):
    def step():   # what the wrapped optimizer's step() does
        eng.sync_node_grads()
        eng.add_proximal_grad()
        opt.step()
        eng.after_step()
    return step


def _round(eng, model, opt, rank_id, steps_done):
    """Local steps, then a round; the snapshots around it."""
    x, y = cases.rank_batch(rank_id)
    cases.local_steps(model, _step(eng, opt), x, y)
    before = cases.snapshot(eng)
    eng.consensus_round(steps=steps_done + cases.LOCAL_STEPS)
    return before, cases.snapshot(eng)


def _two_rounds(config, nodes):
    """``nodes`` × P thread ranks, each with its own model (seed = rank), build their engines and run two rounds;
    returns (models, engines, optimizers, structure), by rank."""
    models = [cases.make_model("chain", r) for r in range(nodes * P)]
    structure = Structure.resolve(models[0], config)
    native.module()
    engines, opts = {}, {}

    def first(rank):
        r = rank.topo.rank
        engines[r] = HSADMM(models[r], rank.topo, rank.groups, config, structure, ledger=rank.ledger)
        opts[r] = cases.sgd(models[r])
        for k in range(2):
            _round(engines[r], models[r], opts[r], r, k * cases.LOCAL_STEPS)
    run_ranks(nodes, P, first)
    return models, engines, opts, structure


@pytest.mark.parametrize("levers", [{}, {"payload_dtype": "bf16", "node_sync": True}], ids=["float", "bf16"])
def test_a_lost_node_and_a_joining_one_go_on_as_the_reference_says(levers):
    config = cases.paper_config(sparsity="channel:0.5", freeze_round=None, **levers)
    joiner_models = [cases.make_model("chain", 50 + r) for r in range(P)]   # another start: it must not matter

    # 1. three nodes, two rounds
    models, engines, opts, structure = _two_rounds(config, 3)

    # 2. node 2 is lost: ranks 0..3 go on over two nodes from memory; their round is the reference's over them
    survivors = thread_cluster(2, P, keep_records=True)

    def after_loss(rank):
        r = rank.topo.rank
        eng = engines[r]
        kept = cases.snapshot(eng)
        joining.reform(eng, rank.topo, rank.groups)
        assert joining.welcome(eng, joined=False)["joined"] == []
        for key in ("u", "z_i", "v", "z"):   # nothing of this rank's state moved
            for name in kept[key]:
                assert torch.equal(cases.snapshot(eng)[key][name], kept[key][name]), (r, key, name)
        return _round(eng, models[r], opts[r], r, 2 * cases.LOCAL_STEPS)
    runs = run_ranks(2, P, after_loss, cluster=survivors)
    before, after = [b for b, _ in runs], [a for _, a in runs]
    assert all(b["round"] == 2 and b["anchored_at"] is None for b in before)
    cases.check_round(2, before, after, [list(range(n * P, (n + 1) * P)) for n in range(2)], engines[0])

    # 3. a new node joins as node 2 (ranks 4, 5): it takes the job's state; the round over three nodes is the
    #    reference round, the joiner's candidate from z with zero duals
    grown = thread_cluster(3, P, keep_records=True)
    z_before = {name: t.clone() for name, t in after[0]["z"].items()}

    def after_join(rank):
        r = rank.topo.rank
        if r < 2 * P:
            joining.reform(engines[r], rank.topo, rank.groups)
            report = joining.welcome(engines[r], joined=False)
        else:
            model = joiner_models[r - 2 * P]
            models[r] = model
            engines[r] = joining.joiner(HSADMM, model, rank.topo, rank.groups, config, structure, ledger=rank.ledger)
            opts[r] = cases.sgd(model)
            report = joining.welcome(engines[r], joined=True)
            got = cases.snapshot(engines[r])
            for name, z in z_before.items():   # the job's z, θ = z_i = z, zero duals
                assert torch.equal(got["z"][name], z) and torch.equal(got["z_i"][name], z), name
                assert torch.equal(got["theta"][name], z.to(got["theta"][name].dtype)), name
                assert not got["u"][name].any() and not got["v"][name].any(), name
            assert got["round"] == 3 and got["masks"].keys() == after[0]["masks"].keys()
            for name, (rows, cols) in after[0]["masks"].items():
                assert torch.equal(got["masks"][name][0], rows) and torch.equal(got["masks"][name][1], cols)
            assert got["rho1"] == after[0]["rho1"] and got["rho2"] == after[0]["rho2"]
        assert report["joined"] == [4, 5] and report["from"] == 0
        return _round(engines[r], models[r], opts[r], r, 3 * cases.LOCAL_STEPS)
    runs = run_ranks(3, P, after_join, cluster=grown)
    before, after = [b for b, _ in runs], [a for _, a in runs]
    cases.check_round(3, before, after, [list(range(n * P, (n + 1) * P)) for n in range(3)], engines[0])


def test_a_joiner_with_another_model_or_no_holder_is_refused_on_every_rank():
    rows = torch.tensor([[1, 4, 7], [1, 4, 7], [0, 0, 9], [0, 0, 9]])
    assert "rank(s) 2,3 joined with another model" in joining.refusal(rows)
    assert "no rank holds" in joining.refusal(torch.tensor([[0, 0, 7], [0, 0, 7]]))
    assert "different rounds ([3, 4])" in joining.refusal(torch.tensor([[1, 3, 7], [1, 4, 7]]))
    assert joining.refusal(torch.tensor([[1, 4, 7], [0, 0, 7]])) is None

    config = cases.paper_config(sparsity="channel:0.5")
    models = [cases.make_model("chain", r) for r in range(2)] + [cases.make_model("vit", 2), cases.make_model("vit", 3)]
    structures = [Structure.resolve(m, config) for m in models]
    native.module()
    engines = {}

    def start(rank):
        r = rank.topo.rank
        engines[r] = HSADMM(models[r], rank.topo, rank.groups, config, structures[r], ledger=rank.ledger)
    run_ranks(1, 2, start)

    def grow(rank):
        r = rank.topo.rank
        if r < 2:
            joining.reform(engines[r], rank.topo, rank.groups)
            return joining.welcome(engines[r], joined=False)
        eng = joining.joiner(HSADMM, models[r], rank.topo, rank.groups, config, structures[r], ledger=rank.ledger)
        return joining.welcome(eng, joined=True)
    with pytest.raises(Exception) as err:
        run_ranks(2, 2, grow)
    assert "rank(s) 2,3 joined with another model or structure" in str(err.value.__cause__)


@pytest.mark.parametrize("levers", [{}, {"payload_dtype": "bf16", "node_sync": True, "channel_budget": "global",
                                         "freeze_round": 0}], ids=["paper", "default"])
def test_down_to_one_node_the_dual_across_nodes_is_dropped_and_the_round_is_the_one_node_round(levers):
    config = cases.paper_config(**{"sparsity": "channel:0.5", "freeze_round": None, **levers})
    models, engines, opts, _ = _two_rounds(config, 2)
    assert any(e.v.any() for e in engines[0].entries)   # two nodes left node 0 with a dual

    def after_loss(rank):
        r = rank.topo.rank
        z_i = {e.name: e.z_i.clone() for e in engines[r].entries}
        joining.reform(engines[r], rank.topo, rank.groups)
        assert not any(e.v.any() for e in engines[r].entries)
        assert all(torch.equal(e.z_i, z_i[e.name]) for e in engines[r].entries)   # the rest kept
        return _round(engines[r], models[r], opts[r], r, 2 * cases.LOCAL_STEPS)
    runs = run_ranks(1, P, after_loss, cluster=thread_cluster(1, P, keep_records=True))
    before, after = [b for b, _ in runs], [a for _, a in runs]
    cases.check_round(2, before, after, [list(range(P))], engines[0])
    for got in after:   # the one-node round: z is the node's z_i
        for name in got["z"]:
            assert torch.equal(got["z"][name], got["z_i"][name]), name
