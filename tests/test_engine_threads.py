"""H-SADMM on M×P ranks as threads of this process (prunex_hvd.dist.comm.threads), round by round against the
single-process reference: the checks test_engine_launch.py runs under mpirun on 2×2, here in seconds on any
layout, one node and one rank per node included.

Every rank builds its engine on its own (rank 0's parameters are broadcast), trains on its own data, and
snapshots its state before and after each round; the main thread then compares every rank's u, z_i, v, z, ρ,
masks and BN buffers with ``reference.reference_round``, checks the model is the same everywhere after
construction and after finalize(), and checks each rank's own ledger (tests/engine_cases.py)."""
import json

import pytest

import engine_cases as cases
from prunex_hvd.dist.comm.threads import thread_cluster
from prunex_hvd.engine.config import ConsensusConfig, Structure
from prunex_hvd.engine.hsadmm import HSADMM
from prunex_hvd.engine.sparsity import native
from threaded import run_ranks

LAYOUTS = [(1, 1), (1, 3), (3, 1), (2, 2), (2, 3)]
# name: (model, sparsity argument, coupled, the specs it resolves to, the coupled pairs, the streams)
CASES = {"channel": ("chain", "channel:0.5", False, cases.CHANNEL, None, ()),
         "mixed": ("chain", cases.MIXED_SPARSITY, False, cases.MIXED, None, ()),
         "coupled": ("chain", "channel:0.5", True, cases.CHANNEL, cases.PAIR, ()),
         "coupled-shape": ("chain", cases.SHAPED_CONSUMER, True, cases.SHAPED_CONSUMER, cases.PAIR, ()),
         "streams": ("residual", "channel:0.5", "streams", cases.RESIDUAL, cases.RESIDUAL_PAIR, cases.STREAM)}
RUNS = [(layout, "channel") for layout in LAYOUTS] + \
       [(layout, case) for case in ("mixed", "coupled", "streams") for layout in ((2, 2), (2, 3))] + \
       [((2, 2), "coupled-shape")]
# the accelerations (ConsensusConfig's restart, relaxation, rho_growth, keep_ramp_rounds), each against the
# reference of the modified math; a ramp of 2 rounds projects round 1 to keep 0.5 + 0.5·(1/2)³
LEVERS = {"paper-round": dict(restart="none"),   # the default restarts: this keeps θ where its steps left it
          "restart-node": dict(restart="node", relaxation=0.7),
          "relaxed": dict(relaxation=1.6),
          "all": dict(restart="global", relaxation=1.6, rho_growth=1.3, keep_ramp_rounds=2)}
LEVER_RUNS = [((2, 2), "channel", "paper-round"), ((2, 3), "mixed", "paper-round"), ((2, 3), "channel", "restart-node"),
              ((2, 2), "mixed", "relaxed"), ((2, 3), "channel", "all"), ((1, 3), "channel", "all"),
              ((2, 2), "coupled", "all"), ((2, 2), "streams", "all")]


def train_on_threads(num_nodes, local_size, kind, sparsity, coupled, **knobs):
    """Every rank's snapshots, final model and result after ``cases.ROUNDS`` rounds on the thread cluster."""
    size = num_nodes * local_size
    models = [cases.make_model(kind, r) for r in range(size)]   # here: torch's global RNG is not thread-safe
    config = ConsensusConfig(sparsity=sparsity, coupled=coupled, **dict(cases.SETTINGS, **knobs))
    structure = Structure.resolve(models[0], config)
    native.module()   # load the shrink kernel before the ranks race to its first use
    cluster = thread_cluster(num_nodes, local_size, keep_records=True)

    def rank_run(rank):
        model = models[rank.topo.rank]
        eng = HSADMM(model, rank.topo, rank.groups, config, structure, ledger=rank.ledger)
        opt = cases.sgd(model)

        def step():   # what the wrapped optimizer's step() does
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
        return {"engine": eng, "start": start, "before": befores, "after": afters,
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

    cases.assert_same_everywhere([run["start"] for run in runs], "after construction")
    node_ranks, eng = cluster[0].topo.node_ranks, runs[0]["engine"]
    ref_rounds = [cases.check_round(rnd, [run["before"][rnd] for run in runs], [run["after"][rnd] for run in runs],
                                    node_ranks, eng) for rnd in range(cases.ROUNDS)]
    cases.assert_same_everywhere([run["final"] for run in runs], "after finalize")

    results = [run["result"] for run in runs]
    results[0].update(checks=len(runs) * cases.ROUNDS, ref_rounds=ref_rounds)
    cases.check_results(results, want_specs, couplings=want_pairs, streams=want_streams)
    for rank in cluster:   # every record as the ring model puts it: only the leaders' ring crosses nodes
        for rec in rank.ledger.records:
            crossing = rec.tier == "inter" and num_nodes > 1
            want = cases.ring_allreduce_bytes(rec.payload_bytes, num_nodes) if crossing else 0
            assert rec.cross_node_bytes == want, (rank.topo.rank, rec)
