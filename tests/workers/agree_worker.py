"""Ranks that disagree about what they wrap: every rank must raise the same clear error, none may hang.

    mpirun -np 4 python agree_worker.py --case model|spec|keep|rho [--method prunex|dense|topk|pactrain] --out DIR
    mpirun -np 4 python agree_worker.py --cases glob,nonconv,rho0,steps0 --out DIR

Rank 2 differs from the others in the way ``--case`` names. Writes OUT/error.rank{R}.txt ("[rank R] prunex_hvd
error: ...") for the parent test, or OUT/rank{R}.json when construction (wrongly) succeeds. ``--cases`` tries
several in one job, one after the other (an error raised on every rank leaves them all in step for the next),
writing OUT/CASE/error.rank{R}.txt, and reports ok at the end."""
import argparse
import os
import sys
import time

import torch
from torch import nn

import worker_io


# local checks that fail on rank 2 only: (sparsity, keyword arguments) of prunex_hvd.DistributedOptimizer
ODD_LOCAL = {"glob": ({"nope.*": "channel:0.5"}, {}), "nonconv": ({"1.weight": "channel:0.5"}, {}),
             "rho0": ("channel:0.5", {"rho1": 0.0}), "steps0": ("channel:0.5", {"local_steps": 0})}


def several(cases, out):
    import prunex_hvd as px
    topo = px.init()
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3))
    for case in cases:
        spec, kw = ODD_LOCAL[case] if topo.rank == 2 else ("channel:0.5", {})
        os.makedirs(os.path.join(out, case), exist_ok=True)
        try:
            px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, sparsity=spec, **kw)
        except ValueError as exc:
            with open(os.path.join(out, case, f"error.rank{topo.rank}.txt"), "w") as f:
                f.write(f"[rank {topo.rank}] prunex_hvd error: {exc}")
    worker_io.report(out, topo.rank, {"cases": cases}, len(cases))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=("model", "spec", "keep", "rho"))
    ap.add_argument("--cases", help="comma-separated: " + ", ".join(ODD_LOCAL))
    ap.add_argument("--method", default="prunex", choices=("prunex", "dense", "topk", "pactrain"))
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.cases:
        return several(a.cases.split(","), a.out)
    import prunex_hvd as px
    topo = px.init()
    odd = topo.rank == 2
    width = 10 if a.case == "model" and odd else 8
    model = nn.Sequential(nn.Conv2d(3, width, 3), nn.BatchNorm2d(width), nn.ReLU(), nn.Conv2d(width, 4, 3))
    spec = {"spec": "filter:0.5", "keep": "channel:1.5"}.get(a.case, "channel:0.5") if odd else "channel:0.5"
    rho1 = 0.02 if a.case == "rho" and odd else 0.01
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if a.method == "prunex":
            px.DistributedOptimizer(opt, model, sparsity=spec, rho1=rho1)
        else:
            from prunex_hvd.baselines import dense, pactrain, topk
            wrap = {"dense": dense, "topk": topk, "pactrain": pactrain}[a.method].DistributedOptimizer
            wrap(opt, model, **({"sparsity": spec} if a.method == "pactrain" else {}))
    except ValueError as exc:
        with open(os.path.join(a.out, f"error.rank{topo.rank}.txt"), "w") as f:
            f.write(f"[rank {topo.rank}] prunex_hvd error: {exc}")
        print(f"[rank {topo.rank}] prunex_hvd error: {exc}", flush=True)
        time.sleep(1)
        sys.exit(3)
    worker_io.report(a.out, topo.rank, {"constructed": True}, 0)


if __name__ == "__main__":
    worker_io.run(main, "agree")
