"""H-SADMM on a real launch, checked round by round against a single-process reference.

Each rank trains a small CNN on its own data. Before and after every consensus round the ranks' states are
gathered to rank 0 over the launcher's control plane (never through the accounted groups), and rank 0 runs
`reference_round` — the round's math written out plainly over all M×P ranks — and compares. Writes
OUT/rank{R}.json with the ledger, stats and final model digest for the parent test. The models, settings and
checks are tests/engine_cases.py's, shared with the thread-tier test (test_engine_threads.py)."""
import argparse
import json
import os
import sys

import torch

import worker_io

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import engine_cases as cases  # noqa: E402

COUPLED = {"pairs": True, "streams": "streams"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--sparsity", default="channel:0.5")
    ap.add_argument("--rounds", type=int, default=cases.ROUNDS)
    ap.add_argument("--local-steps", type=int, default=cases.LOCAL_STEPS)
    ap.add_argument("--freeze-round", type=int, default=cases.SETTINGS["freeze_round"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--coupled", nargs="?", const=True, default=False, type=lambda t: COUPLED[t],
                    metavar="{pairs,streams}", help="coupled channel pruning (alone: pairs)")
    ap.add_argument("--model", default="chain", choices=("chain", "residual", "vit", "mha"))
    ap.add_argument("--node-sync", action="store_true", help="the node's ranks average gradients every step")
    ap.add_argument("--payload-dtype", default=None, choices=("bf16", "fp16"),
                    help="the inter-node exchange's payload: the rounded change since z, with error feedback")
    ap.add_argument("--overlap", nargs="?", const=True, default=False, type=int, metavar="N",
                    help="rounds overlapped once the masks are frozen, folded in after N steps (alone: a quarter "
                         "of local_steps, here at the next round); checked against the delayed math "
                         "(engine_cases.check_overlapped_round), the rounds before the freeze as blocking ones")
    ap.add_argument("--amp-inf", default=None, metavar="RANK:STEP,...",
                    help="local steps under CPU autocast and a GradScaler, an inf in a gradient of RANK at STEP")
    ap.add_argument("--amp-pattern", default="scaler.step", choices=cases.AMP_PATTERNS,
                    help="with --amp-inf: the calls around the step (engine_cases.amp_step)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import prunex_hvd as px
    from prunex_hvd.dist.runtime import state
    topo = px.init(backend=a.backend)
    control = state()[1]
    if a.device == "cuda":
        torch.cuda.set_device(topo.local_rank % torch.cuda.device_count())
    model = cases.make_model(a.model, topo.rank).to(a.device)
    spec = json.loads(a.sparsity) if a.sparsity.startswith("{") else a.sparsity
    # the engine cases' round (each layer its own channel count, no lr warm-up) with this launch's knobs
    opt = px.DistributedOptimizer(cases.sgd(model), model, cases.paper_config(freeze_round=a.freeze_round),
                                  sparsity=spec, local_steps=10**6, backend=a.backend, coupled=a.coupled,
                                  node_sync=a.node_sync, payload_dtype=a.payload_dtype, overlap=a.overlap)
    eng = opt._engine
    cases.assert_same_everywhere(control.allgather_object(cases.model_state(model)), "after construction")
    px.comm.reset()
    x, y = cases.rank_batch(topo.rank, a.device)   # different data on every rank
    reports, checks, ref_rounds = [], 0, []
    if a.amp_inf is not None:
        scaler = torch.amp.GradScaler("cpu")
        inf_steps = {int(st) for r, st in (pair.split(":") for pair in a.amp_inf.split(",")) if int(r) == topo.rank}
        moved = []
    if a.overlap:
        rec = cases.overlapped_rounds(eng, model, opt.step, x, y, opt.consensus, a.rounds, a.local_steps)
        reports = rec.pop("reports")
        recs = control.allgather_object(rec)
        if topo.rank == 0:
            ref_rounds = cases.check_overlapped_rounds(recs, topo.node_ranks, eng, a.rounds)
            checks = len(recs) * a.rounds
    for rnd in range(0 if a.overlap else a.rounds):
        if a.amp_inf is not None:
            moved += cases.amp_local_steps(model, opt, scaler, x, y, a.local_steps, rnd * a.local_steps, inf_steps,
                                           a.amp_pattern)
        else:
            cases.local_steps(model, opt.step, x, y, a.local_steps)
        before = control.allgather_object(cases.snapshot(eng))
        reports.append(opt.consensus())
        after = control.allgather_object(cases.snapshot(eng))
        if topo.rank == 0:
            if a.node_sync:   # one θ per node: its ranks took the node's mean gradient every step
                for ranks in topo.node_ranks:
                    cases.assert_same_everywhere([before[r]["theta"] for r in ranks], f"in a node before round {rnd}")
            ref_rounds.append(cases.check_round(rnd, before, after, topo.node_ranks, eng))
            checks += len(after)
    opt.finalize()
    cases.assert_same_everywhere(control.allgather_object(cases.model_state(model)), "after finalize")
    stats = {k: v for k, v in opt.stats().items() if k != "residuals"}
    result = cases.rank_result(eng, model, topo, reports, stats, px.comm.summary(by_op=True))
    result.update(checks=checks, ref_rounds=ref_rounds)
    if a.amp_inf is not None:
        result.update(moved=moved, scale=scaler.get_scale())
    worker_io.report(a.out, topo.rank, result, checks)


if __name__ == "__main__":
    worker_io.run(main, "engine")
