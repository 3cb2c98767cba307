"""A Horovod user's script with only its wrap line changed: ``examples/horovod_mnist.py`` under
``hvd.DistributedOptimizer`` and under ``px.DistributedOptimizer`` (the library's defaults), side by side, seed by
seed; prints JSON.

    python benchmarks/bench_dropin.py --seeds 1,2,3,4,5,6,7,8 [--epochs 10] [--out runs/dropin.json]
    python benchmarks/bench_dropin.py --seeds 1,2 --library other=/path/to/another/checkout

Each run is ``horovodrun --gloo -np 4 -H localhost:2,127.0.0.1:2`` (2 nodes × 2 ranks) of the example as it is:
Horovod's lr × size, no warm-up, the script's own epochs. ``--library NAME=PATH`` adds a variant that runs the
same script with another checkout's ``prunex_hvd`` on ``PYTHONPATH`` (e.g. an earlier commit's defaults). The JSON
has every run's final test accuracy and, per variant, the mean and the paired difference from Horovod's.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchjson import emit  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "examples", "horovod_mnist.py")


def run(optimizer: str, seed: int, args, library: str = REPO) -> float:
    bin_dir = os.path.dirname(sys.executable)
    env = dict(os.environ, PYTHONPATH=library, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [os.path.join(bin_dir, "horovodrun"), "--gloo", "-np", "4", "-H", "localhost:2,127.0.0.1:2", sys.executable,
           SCRIPT, "--optimizer", optimizer, "--seed", str(seed), "--epochs", str(args.epochs)] + args.extra.split()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.run_timeout)
    found = re.search(r"final accuracy ([0-9.]+)%", proc.stdout)
    if proc.returncode or not found:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return float(found.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1,2,3,4")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--library", action="append", default=[], metavar="NAME=PATH",
                    help="another checkout whose prunex_hvd the script imports, as variant NAME")
    ap.add_argument("--extra", default="", help="more arguments for the script (every variant)")
    ap.add_argument("--run-timeout", type=float, default=1800)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s]
    variants = [("horovod", "horovod", REPO), ("prunex", "prunex", REPO)] + \
        [(name, "prunex", path) for name, path in (v.split("=", 1) for v in args.library)]
    acc = {name: {} for name, _, _ in variants}
    for seed in seeds:   # variants interleaved, so load on the host hits them alike
        for name, optimizer, library in variants:
            acc[name][seed] = run(optimizer, seed, args, library)
            print(f"seed {seed} {name}: {acc[name][seed]:.2f}%", file=sys.stderr, flush=True)
    summary = {}
    for name in acc:
        diffs = [acc[name][s] - acc["horovod"][s] for s in seeds]
        summary[name] = {"mean": statistics.mean(acc[name].values()), "min": min(acc[name].values()),
                         "minus_horovod": statistics.mean(diffs),
                         "minus_horovod_sd": statistics.stdev(diffs) if len(diffs) > 1 else None}
    emit({"bench": "dropin", "script": "examples/horovod_mnist.py", "epochs": args.epochs, "extra": args.extra,
          "seeds": seeds, "libraries": {name: lib for name, _, lib in variants}, "accuracy": acc,
          "summary": summary}, args.out)


if __name__ == "__main__":
    main()
