"""The three-tier round (racks: θ → z_i → w_r → z, docs/algorithm.md "A third tier: racks") on thread clusters of
several shapes, round by round against the single-process reference (``reference.reference_round(racks=...)``),
with every tier's bytes checked exactly (``engine_cases.check_rack_ledger``); the two-tier special cases bit for
bit; the refusals; resume."""
import dataclasses

import pytest
import torch

import engine_cases as cases
from prunex_hvd.engine.config import Structure
from prunex_hvd.engine.hsadmm import HSADMM
from prunex_hvd.engine.sparsity import native
from test_engine_threads import (CASES, assert_nodes_chose_apart, check_against_the_reference, resume_on_threads,
                                 train_on_threads)
from threaded import RankFailed, run_ranks

# (nodes, ranks per node, nodes per rack), case, knobs
RACK_RUNS = [((4, 2, 2), "channel", {}),
             ((4, 1, 2), "coupled", {}),
             ((6, 1, 3), "mixed", {}),
             ((6, 1, 2), "channel", dict(rho3=0.005)),
             ((4, 2, 2), "streams", dict(restart="none", node_sync=True)),
             ((4, 1, 2), "channel", dict(adaptive_rho=False, rho3=0.1)),
             # a narrow payload: rounded changes at the rack and across the spine, each against its senders' bases
             ((4, 2, 2), "channel", dict(payload_dtype="bf16", node_sync=True)),
             ((6, 1, 2), "mixed", dict(payload_dtype="fp16")),
             ((6, 1, 3), "coupled", dict(payload_dtype="bf16")),
             # beyond convs: heads and coupled MLP hidden units through the rack tier
             ((4, 1, 2), "vit-even", dict(payload_dtype="bf16")),
             ((4, 2, 2), "mha-coupled", {})]


@pytest.mark.parametrize("shape,case,knobs", RACK_RUNS,
                         ids=[f"{m}x{p}-racks-of-{n}-{c}" + ("-" + "-".join(k) if k else "")
                              for (m, p, n), c, k in RACK_RUNS])
def test_three_tier_rounds_match_the_reference(shape, case, knobs):
    num_nodes, local_size, per_rack = shape
    kind, sparsity, coupled, want_specs, want_pairs, want_streams = CASES[case]
    cluster, runs, specs = train_on_threads(num_nodes, local_size, kind, sparsity, coupled, nodes_per_rack=per_rack,
                                            **knobs)
    eng = runs[0]["engine"]
    assert eng.state.rack_tier and eng.state.topo.num_racks == num_nodes // per_rack
    ref_rounds = check_against_the_reference(cluster, runs, want_specs, want_pairs, want_streams)
    if kind == "vit-even":   # the nodes chose apart, and the reference checked the OR up the tree
        assert_nodes_chose_apart(ref_rounds, eng)
    residuals = runs[0]["engine"].entries[0].residuals
    assert set(residuals) == {"r_intra", "s_intra", "r_inter", "s_inter", "r_spine", "s_spine"}


def test_racks_with_a_bf16_payload_anchored_every_other_round_match_the_reference(monkeypatch):
    """Anchored every 2 rounds: both levels send whole values in round 3 (the nodes' bases, the racks' sums of
    them and the rack leaders' bases start again), changes against them in rounds 1, 2 and 4."""
    from prunex_hvd.engine import codec
    monkeypatch.setattr(codec, "ANCHOR_EVERY", 2)
    kind, sparsity, coupled, want_specs, want_pairs, want_streams = CASES["channel"]
    cluster, runs, _ = train_on_threads(4, 2, kind, sparsity, coupled, nodes_per_rack=2, payload_dtype="bf16",
                                        node_sync=True)
    ref_rounds = check_against_the_reference(cluster, runs, want_specs, want_pairs, want_streams)
    assert [r["anchored"] for r in ref_rounds] == [False, False, True, False]


def _run(shape, **knobs):
    num_nodes, local_size, per_rack = shape
    return train_on_threads(num_nodes, local_size, "chain", "channel:0.5", False, nodes_per_rack=per_rack, **knobs)[1]


@pytest.mark.parametrize("shape,knobs", [((2, 2, 2), {}), ((4, 1, 1), {}), ((4, 1, 2), dict(rack_tier=False))],
                         ids=["one-rack", "one-node-per-rack", "rack-tier-off"])
def test_two_tier_shapes_are_the_two_tier_round_bit_for_bit(shape, knobs):
    """One rack, one node per rack, or ``rack_tier=False``: the two-tier round, bit for bit the run without racks
    (every round's state on every rank, the final model, the bytes on the leaders' group)."""
    with_racks, without = _run(shape, **knobs), _run(shape[:2] + (None,))
    assert not with_racks[0]["engine"].state.rack_tier
    for a, b in zip(with_racks, without):
        for snaps_a, snaps_b in ((a["before"], b["before"]), (a["after"], b["after"])):
            for sa, sb in zip(snaps_a, snaps_b):
                for key in ("theta", "u", "z_i", "v", "z", "buffers"):
                    for name in sa[key]:
                        assert torch.equal(sa[key][name], sb[key][name]), (key, name)
                assert sa["rho1"] == sb["rho1"] and sa["rho2"] == sb["rho2"] and not sa["w"]
        assert a["final"].keys() == b["final"].keys()
        assert all(torch.equal(a["final"][k], b["final"][k]) for k in a["final"])
        ledger_a, ledger_b = a["result"]["ledger"], b["result"]["ledger"]
        for tier in ("intra", "inter"):   # the same collectives and bytes (not the same seconds)
            for op, rec in ledger_b[tier].get("by_op", {}).items():
                assert {k: v for k, v in ledger_a[tier]["by_op"][op].items() if k not in ("seconds", "cross_rack_bytes")} \
                    == {k: v for k, v in rec.items() if k not in ("seconds", "cross_rack_bytes")}, (tier, op)
            assert ledger_a[tier].get("by_op", {}).keys() == ledger_b[tier].get("by_op", {}).keys(), tier
    if knobs:   # two tiers on racks (0, 0, 1, 1): the leaders' ring 0→1→2→3→0 leaves a rack at nodes 1 and 3
        crossing = [run["result"]["stats"]["cross_rack_bytes"] for run in with_racks]
        assert all(crossing[r] == with_racks[r]["result"]["stats"]["inter_bytes"] > 0 for r in (1, 3)), crossing
        assert crossing[0] == crossing[2] == 0


@pytest.mark.parametrize("knobs,named", [(dict(overlap=True), "overlap=True"), (dict(overlap=2), "overlap=2"),
                                         # refused whether or not the masks are frozen yet
                                         (dict(overlap=1, freeze_round=0), "overlap=1")])
def test_what_the_rack_tier_lacks_is_refused_on_every_rank(knobs, named):
    models = [cases.make_model("chain", r) for r in range(4)]
    config = cases.paper_config(sparsity="channel:0.5", **knobs)
    structure = Structure.resolve(models[0], config)
    errors = []

    def rank_run(rank):
        try:
            HSADMM(models[rank.topo.rank], rank.topo, rank.groups, config, structure, ledger=rank.ledger)
        except ValueError as exc:
            errors.append(str(exc))
    from prunex_hvd.dist.comm.threads import thread_cluster
    run_ranks(4, 1, rank_run, cluster=thread_cluster(4, 1, nodes_per_rack=2))
    assert len(errors) == 4 and len(set(errors)) == 1
    assert f"the rack tier (2 racks of 2 nodes) does not support {named}: turn it off" in errors[0]
    assert "rack_tier=False" in errors[0]


def test_three_tier_state_dict_resumes_bit_for_bit_and_fits_only_three_tiers():
    """state_dict() after round 2 of 4 on 2 racks × 2 nodes × 2 ranks (bf16 payload: both levels' bases are
    state), loaded into fresh engines: the resumed run ends bit for bit where the uninterrupted one does. An
    engine without the rack tier refuses that state."""
    config = cases.paper_config(sparsity="channel:0.5", node_sync=True, payload_dtype="bf16", rho3=0.01)
    native.module()

    def job(saved=None, per_rack=2, rack_tier=True):
        from prunex_hvd.dist.comm.threads import thread_cluster
        conf = dataclasses.replace(config, rack_tier=rack_tier)
        return resume_on_threads(conf, 4, 2, saved, cluster=thread_cluster(4, 2, nodes_per_rack=per_rack))
    whole = job()
    resumed = job(saved=[r[2] for r in whole])
    for r in range(8):
        assert all(torch.equal(whole[r][0][k], resumed[r][0][k]) for k in whole[r][0]), f"rank {r}"
    saved = whole[0][2]["engine"]
    assert {"w", "t", "rho3", "sent_spine", "rack_sum"} <= set(saved["entries"]["0.weight"])
    assert saved["entries"]["0.weight"]["sent_spine"].abs().sum() > 0 and saved["buffer_ef_spine"]
    assert saved["entries"]["0.weight"]["rack_sum"].abs().sum() > 0
    with pytest.raises(RankFailed, match="saved with the rack tier, resumed without it"):
        job(saved=[r[2] for r in whole], rack_tier=False)
