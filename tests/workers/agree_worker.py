"""Ranks that disagree about what they wrap: every rank must raise the same clear error, none may hang.

    mpirun -np 4 python agree_worker.py --cases model,spec,keep,rho,model-dense,glob,... --out DIR
    mpirun -np 4 python agree_worker.py --case model|spec|keep|rho [--method prunex|dense|topk|pactrain] --out DIR

Rank 2 differs from the others in the way the case names (see ``CASES``). ``--cases`` tries several in one job,
one after the other (an error raised on every rank leaves them all in step for the next), writing
OUT/CASE/error.rank{R}.txt ("[rank R] prunex_hvd error: ...") for each error caught; then every rank wraps the
same model once more, which must succeed (the failed attempts left nothing behind), and reports ok.
``--case`` tries one and exits 3 on the error, writing OUT/error.rank{R}.txt (OUT/rank{R}.json when
construction wrongly succeeds)."""
import argparse
import os
import sys
import time

import torch
from torch import nn

import worker_io

# rank 2's odd input per case: (conv width, sparsity, keyword arguments of prunex_hvd.DistributedOptimizer);
# the others wrap width 8 with "channel:0.5" and no keyword arguments
ODD_RANK = 2
DISAGREE = {"model": (10, "channel:0.5", {}), "spec": (8, "filter:0.5", {}), "keep": (8, "channel:1.5", {}),
            "rho": (8, "channel:0.5", {"rho1": 0.02})}
# local checks that fail on rank 2 only (the others would accept them)
ODD_LOCAL = {"glob": (8, {"nope.*": "channel:0.5"}, {}), "nonconv": (8, {"1.weight": "channel:0.5"}, {}),
             "rho0": (8, "channel:0.5", {"rho1": 0.0}), "steps0": (8, "channel:0.5", {"local_steps": 0})}
METHODS = ("prunex", "dense", "topk", "pactrain")
# the round-based rivals: rank 2 alone passes a bad setting (the others period 4, node period 2, outer lr 0.7)
RIVALS = {"rival-localsgd": ("LocalSGD", {"period": 0}),
          "rival-localsgd-hier": ("HierarchicalLocalSGD", {"period": 4, "intra_period": 3}),
          "rival-diloco": ("DiLoCo", {"period": 4, "outer_lr": 0.0})}
RIVAL_GOOD = {"LocalSGD": {"period": 4}, "HierarchicalLocalSGD": {"period": 4, "intra_period": 2},
              "DiLoCo": {"period": 4, "outer_lr": 0.7}}
SAME = (8, "channel:0.5", {})


def parse_case(case):
    """CASE (prunex_hvd.DistributedOptimizer) or CASE-METHOD (a baseline's optimizer, which takes no rho and,
    but for PacTrain, no sparsity): (rank 2's input, method)."""
    if case in RIVALS:
        return None, case
    name, _, method = case.partition("-")
    if name in ODD_LOCAL and not method:
        return ODD_LOCAL[name], "prunex"
    if name not in DISAGREE or method not in ("",) + METHODS:
        raise ValueError(f"unknown case {case!r}: choose from {', '.join(CASES)}")
    return DISAGREE[name], method or "prunex"


# what the tests try
CASES = (*DISAGREE, *ODD_LOCAL, *(f"model-{m}" for m in METHODS[1:]), *RIVALS)


def construct(case, rank):
    """Wrap a fresh model as ``case`` says for this rank (rank 2 is the odd one; ``None``: every rank alike);
    raises what the wrapper raises."""
    odd, method = parse_case(case) if case else (SAME, "prunex")
    if method in RIVALS:
        from prunex_hvd.baselines import averaging
        factory, bad = RIVALS[method]
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3))
        kw = bad if rank == ODD_RANK else RIVAL_GOOD[factory]
        return getattr(averaging, factory)(torch.optim.SGD(model.parameters(), lr=0.1), model, **kw)
    width, spec, kw = odd if rank == ODD_RANK else SAME
    model = nn.Sequential(nn.Conv2d(3, width, 3), nn.BatchNorm2d(width), nn.ReLU(), nn.Conv2d(width, 4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if method == "prunex":
        import prunex_hvd as px
        return px.DistributedOptimizer(opt, model, sparsity=spec, **{"rho1": 0.01, **kw})
    from prunex_hvd.baselines import dense, pactrain, topk
    wrap = {"dense": dense, "topk": topk, "pactrain": pactrain}[method].DistributedOptimizer
    return wrap(opt, model, **({"sparsity": spec} if method == "pactrain" else {}))


def write_error(folder, rank, exc):
    with open(os.path.join(folder, f"error.rank{rank}.txt"), "w") as f:
        f.write(f"[rank {rank}] prunex_hvd error: {exc}")


def several(cases, out):
    import prunex_hvd as px
    topo = px.init()
    for case in cases:
        os.makedirs(os.path.join(out, case), exist_ok=True)
        try:
            construct(case, topo.rank)
        except ValueError as exc:
            write_error(os.path.join(out, case), topo.rank, exc)
    construct(None, topo.rank)   # all ranks alike after all those refusals: must work
    worker_io.report(out, topo.rank, {"cases": cases, "constructed_after": True}, len(cases) + 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=tuple(DISAGREE))
    ap.add_argument("--cases", help="comma-separated: " + ", ".join(CASES))
    ap.add_argument("--method", default="prunex", choices=METHODS)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.cases:
        for case in a.cases.split(","):
            try:
                parse_case(case)
            except ValueError as exc:
                ap.error(str(exc))
        return several(a.cases.split(","), a.out)
    if a.case is None:
        ap.error("give --case or --cases")
    import prunex_hvd as px
    topo = px.init()
    try:
        construct(a.case if a.method == "prunex" else f"{a.case}-{a.method}", topo.rank)
    except ValueError as exc:
        write_error(a.out, topo.rank, exc)
        print(f"[rank {topo.rank}] prunex_hvd error: {exc}", flush=True)
        time.sleep(1)
        sys.exit(3)
    worker_io.report(a.out, topo.rank, {"constructed": True}, 0)


if __name__ == "__main__":
    worker_io.run(main, "agree")
