"""Wrapper overhead: one local step with ``px.DistributedOptimizer`` vs the bare optimizer; prints JSON.

    python benchmarks/bench_overhead.py [--model resnet18] [--batch-size 32] [--image-size 32] [--reps 15]
        [--device cpu|cuda] [--rounds 5]

One process (a 1×1 cluster), same model and batch. A local step is forward, backward and ``step()``; the
wrapped step adds ρ1(θ − z_i + u) to every gradient (two fused foreach adds) and, in the retraining phase (the
recipe's: masks chosen at the start), masks gradients and weights, its convs multiplying only their kept
channels; phase ``discovery`` steps before any masks are frozen (``freeze_round=None``). Rounds are excluded
(``local_steps`` is set beyond the run; the volume benchmark measures them). Bare and wrapped steps alternate, so load on the host hits both alike; the figure is
the median of the per-pair ratios. Target ≤ 1.05. It also times ``consensus()`` itself in one process
(projection, shrink, recover, residuals and dual updates: the round's compute without the network), the median of
``--rounds`` rounds while masks still move. On CUDA every timing is synchronised.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--sparsity", default="channel:0.5")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--rounds", type=int, default=5, help="consensus rounds timed (0: none)")
    args = ap.parse_args()
    for var in [v for v in os.environ if v.startswith(("OMPI_", "PMIX_", "HOROVOD_", "PRUNEX_"))]:
        del os.environ[var]   # a 1×1 cluster, whatever launched us
    if args.threads:
        torch.set_num_threads(args.threads)

    import prunex_hvd as px
    from prunex_hvd.app.models import build

    px.init(backend="auto")
    torch.manual_seed(0)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    bare_model = build(args.model, num_classes=10, in_channels=3).to(device)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    y = torch.randint(0, 10, (args.batch_size,), device=device)
    runs = {}
    for phase in ("discovery", "retraining"):
        model = copy.deepcopy(bare_model)
        wrapped = px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4),
                                          model, sparsity=args.sparsity, local_steps=10**9,
                                          freeze_round=0 if phase == "retraining" else None)
        bare_copy = copy.deepcopy(bare_model)
        bare = torch.optim.SGD(bare_copy.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)

        def step(m, opt):
            sync()
            t0 = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
            sync()
            return time.perf_counter() - t0

        for _ in range(2):   # warm-up: allocator, momentum buffers
            step(bare_copy, bare), step(model, wrapped)
        pairs = []
        for i in range(args.reps):
            if i % 2:   # alternate which goes first, so neither always gets the warmer cache
                tw, tb = step(model, wrapped), step(bare_copy, bare)
            else:
                tb, tw = step(bare_copy, bare), step(model, wrapped)
            pairs.append((tb, tw))
        ratios = [tw / tb for tb, tw in pairs]
        runs[phase] = {"median_ratio": statistics.median(ratios),
                       "ratio_quartiles": statistics.quantiles(ratios, n=4) if len(ratios) > 3 else None,
                       "median_step_s_bare": statistics.median(tb for tb, _ in pairs),
                       "median_step_s_wrapped": statistics.median(tw for _, tw in pairs)}
        if phase == "discovery" and args.rounds:
            rounds = []
            for _ in range(args.rounds + 1):   # the first builds buckets and plans: not timed
                sync()
                t0 = time.perf_counter()
                wrapped.consensus()
                sync()
                rounds.append(time.perf_counter() - t0)
            runs[phase]["median_round_s"] = statistics.median(rounds[1:])
    print(json.dumps({"benchmark": "wrapper_overhead", "model": args.model, "batch_size": args.batch_size,
                      "image_size": args.image_size, "sparsity": args.sparsity, "reps": args.reps,
                      "threads": torch.get_num_threads(), "device": args.device,
                      "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None, "target_ratio_max": 1.05,
                      "phases": runs,
                      "meets_target": all(r["median_ratio"] <= 1.05 for r in runs.values())}, indent=2))


if __name__ == "__main__":
    main()
