"""Accuracy per epoch: PruneX (the recipe, the paper's round, a lever at a time) against local SGD, hierarchical
local SGD, DiLoCo, PacTrain and dense.

    python benchmarks/bench_learning.py --tasks digits --variants prunex,prunex-paper,localsgd \
        --seeds 0,1 [--jobs 2] [--launcher mpirun|torchrun] [--out runs/learning]
    python benchmarks/bench_learning.py --list          # the tasks and variants

Every run is ``prunex-hvd train`` on 4 ranks as 2 emulated nodes × 2 (``PRUNEX_RANKS_PER_NODE=2``), one round
per epoch, with its task's shared recipe (model, data, epochs, batch, lr): a variant only adds its own flags, so
every method sees the same round period and the same user recipe. ``--jobs N`` runs N jobs side by side (on a
16-core host 4 jobs of 4 single-thread ranks fill it; here keep 1).

Per run the JSON has the test accuracy of the consensus model after every round (``curve``: epoch, accuracy;
its BatchNorm statistics measured again, the trainer's ``bn_recalibrate``, and in ``curve_no_recal`` as the
round left them), the first epoch reaching each of the task's targets (``epochs_to``; null if never), the final
accuracy, the density and the inter-node bytes. Per (task, variant) it has the mean over seeds (``summary``). Each run's
folder (``<out>/<task>/<variant>-s<seed>``) is a normal run; at the end ``prunex-hvd report`` draws every
run in each task's folder into ``<out>/<task>/report`` (accuracy at equal epochs with the seeds as a band,
epochs to the task's targets, and the table).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchjson import emit  # noqa: E402
from prunex_hvd.app.cli import flags_for_method  # noqa: E402
from prunex_hvd.app.report import epochs_to_target, load_run, make_report  # noqa: E402

# the shared recipe of each task: what a user would run, the same for every method. None pins the round the masks
# freeze after: the recipe chooses them at the start (freeze_round=0), and a variant that wants another freeze says
# so. Settings without a flag of their own go to the run through a --config file (``settings``).
TASKS: Dict[str, dict] = {
    # make demo's task: 1,797 real handwritten digits, 16×16
    "digits": dict(args="--model resnet_small --dataset digits --epochs 24 --batch-size 16 --lr 0.05 "
                        "--local-epochs 1", targets=(0.90, 0.95, 0.97)),
    # a CIFAR-size input and a deeper net on generated data: noisy low-frequency templates, 32×32×3
    "synthetic": dict(args="--model resnet_small --dataset synthetic --image-size 16 --epochs 16 --batch-size 32 "
                           "--lr 0.05 --local-epochs 1", targets=(0.5, 0.7, 0.8)),
    # the emulated cluster's task: ResNet-18 on digits at 8×8, two rounds an epoch (benchmarks/README.md)
    "digits8-r18": dict(args="--model resnet18 --dataset digits --image-size 8 --epochs 16 --batch-size 16 "
                             "--lr 0.05 --local-steps 11", targets=(0.7, 0.8, 0.9)),
    # beyond convs: the small ViT on the digits at 16×16 (16 patches of 4×4), heads and MLP neurons pruned; no
    # augmentation (random shifts cost a ViT half its accuracy here: 42% against 86% after 10 epochs, one rank)
    "digits-vit": dict(args="--model vit_tiny --dataset digits --image-size 16 --epochs 24 --batch-size 16 "
                            "--lr 0.05 --local-epochs 1", settings={"augment": "none"}, targets=(0.6, 0.7, 0.8)),
    # ResNet-18 on CIFAR-size generated data (the emulated cluster's model; minutes per run on 2 cores)
    "synthetic-r18": dict(args="--model resnet18 --dataset synthetic --image-size 32 --epochs 8 --batch-size 32 "
                               "--lr 0.05 --local-epochs 1", targets=(0.5, 0.7, 0.8)),
}

VARIANTS: Dict[str, str] = {
    "dense": "--method dense",
    "localsgd": "--method localsgd",
    "localsgd-hier": "--method localsgd-hier",
    "diloco": "--method diloco",
    "topk": "--method topk --topk-ratio 0.01",
    "pactrain": "--method pactrain --sparsity channel:0.5",
    "pactrain-structured": "--method pactrain --sparsity channel:0.5 --pactrain-structure structured",
    # the rivals with a linear lr warm-up over the first epoch(s), as PruneX's recipe warms up
    **{f"{name}-warmup{w}": f"{flags} --warmup-epochs {w}" for w in (1, 2) for name, flags in (
        ("localsgd-hier", "--method localsgd-hier"), ("pactrain", "--method pactrain --sparsity channel:0.5"))},
    # the command line's defaults: the measured recipe (ConsensusConfig's tuning guide)
    "prunex": "--method prunex --sparsity channel:0.5",
    # the paper's round (ConsensusConfig.paper): for ablations
    "prunex-paper": "--method prunex --sparsity channel:0.5 --paper",
    # one flat consensus over the world, the paper's "PruneX (AR)": the recipe without its node tier (no node_sync,
    # no payload_dtype)
    "prunex-flat": "--method prunex-flat --sparsity channel:0.5",
    # the recipe, one lever off or on at a time
    "prunex-dense": "--method prunex --sparsity dense",
    "prunex-no-warmup": "--method prunex --sparsity channel:0.5 --warmup-epochs 0",
    "prunex-layer-budget": "--method prunex --sparsity channel:0.5 --channel-budget layer",   # each layer keeps half
    "prunex-overlap": "--method prunex --sparsity channel:0.5 --overlap on",
    # beyond convs (a ViT): half the heads of every attention module; half of every MLP's hidden units (fc1's
    # rows with fc2's columns, one group); both
    "prunex-heads": "--method prunex --sparsity head:0.5",
    "prunex-neurons": "--method prunex --sparsity neuron:0.5 --coupled",
    "prunex-vit": "--method prunex --sparsity head:0.5+neuron:0.5 --coupled",
    "pactrain-vit": "--method pactrain --sparsity head:0.5+neuron:0.5",   # the same layers, unstructured
}


def read_run(run_dir: str, targets) -> dict:
    """A finished run as the JSON keeps it, read by ``prunex-hvd report``'s own loader."""
    run = load_run(run_dir)
    final = run["final"] or {}
    scored = [r for r in run["metrics"] if r.get("test_acc") is not None]
    curve = [[round(r["epoch"], 4), r["test_acc"]] for r in scored]
    rec = {"curve": curve, "epochs_to": {str(t): epochs_to_target(run, t) for t in targets},
           "final_acc": final.get("test_acc"), "density": final.get("density"),
           "inter_bytes": final.get("inter_bytes"), "wall_s": final.get("wall_s")}
    if final.get("test_acc_no_recal") is not None:   # BatchNorm recalibrated (bn_recalibrate): also as it came
        rec["curve_no_recal"] = [[round(r["epoch"], 4), r["test_acc_no_recal"]] for r in scored]
        rec["final_acc_no_recal"] = final["test_acc_no_recal"]
    return rec


def launch_command(launcher: str, python: str, train_args: List[str]) -> List[str]:
    if launcher == "torchrun":
        return [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                "-m", "prunex_hvd.app.cli"] + train_args
    return ["mpirun", "-np", "4", "-x", "PRUNEX_RANKS_PER_NODE", "-x", "OMP_NUM_THREADS", python, "-m",
            "prunex_hvd.app.cli"] + train_args


def run_one(task: str, variant: str, seed: int, args) -> dict:
    spec = TASKS[task]
    run_dir = os.path.join(args.out, task, f"{variant}-s{seed}")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    settings = []
    if spec.get("settings"):   # beside the run's folder: its own must hold nothing but the run
        with open(run_dir + ".settings.json", "w") as f:
            json.dump(spec["settings"], f)
        settings = ["--config", run_dir + ".settings.json"]
    method = re.search(r"--method (\S+)", VARIANTS[variant]).group(1)
    train_args = ["train"] + spec["args"].split() + settings + VARIANTS[variant].split() + \
        ["--seed", str(seed), "--threads", str(args.threads), "--checkpoint-every", "0",
         "--out", run_dir] + flags_for_method(method, args.extra.split())   # --extra: what applies to each
    env = dict(os.environ, PRUNEX_RANKS_PER_NODE="2", OMP_NUM_THREADS=str(args.threads),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1",
               OMPI_MCA_btl="self,vader,tcp", OMPI_MCA_btl_tcp_if_include="lo", OMPI_MCA_oob_tcp_if_include="lo")
    t0 = time.perf_counter()
    with open(run_dir + ".log", "w") as log:
        proc = subprocess.run(launch_command(args.launcher, args.python, train_args), env=env, stdout=log,
                              stderr=subprocess.STDOUT, timeout=args.run_timeout)
    rec = {"task": task, "variant": variant, "seed": seed, "flags": VARIANTS[variant], "rc": proc.returncode,
           "seconds": round(time.perf_counter() - t0, 1)}
    if args.extra:
        rec["extra"] = args.extra   # --extra's flags, after the variant's (argparse keeps the last value)
    if proc.returncode == 0:
        rec.update(read_run(run_dir, spec["targets"]))
    with open(os.path.join(args.out, "runs.jsonl"), "a") as f:   # kept as they finish: a cut-off sweep keeps them
        f.write(json.dumps(rec) + "\n")
    print(f"{task} {variant} s{seed}: rc {proc.returncode}, final {rec.get('final_acc')}, "
          f"epochs to {rec.get('epochs_to')} ({rec['seconds']} s)", file=sys.stderr, flush=True)
    return rec


def summarize(runs: List[dict]) -> List[dict]:
    """One row per task, variant and --extra, over its seeds."""
    out = []
    row = lambda r: (r["task"], r["variant"], r.get("extra", ""))  # noqa: E731
    for key in sorted({row(r) for r in runs}, key=lambda k: (k[0], list(VARIANTS).index(k[1]), k[2])):
        rs = [r for r in runs if row(r) == key and r["rc"] == 0]
        extra = {"extra": key[2]} if key[2] else {}
        if not rs:
            out.append({"task": key[0], "variant": key[1], **extra, "runs": 0})
            continue
        targets = TASKS[key[0]]["targets"]
        mean = lambda xs: None if any(x is None for x in xs) else sum(xs) / len(xs)  # noqa: E731
        n = min(len(r["curve"]) for r in rs)
        out.append({"task": key[0], "variant": key[1], **extra, "runs": len(rs),
                    "final_acc": mean([r["final_acc"] for r in rs]),
                    "epochs_to": {str(t): mean([r["epochs_to"][str(t)] for r in rs]) for t in targets},
                    "reached": {str(t): sum(r["epochs_to"][str(t)] is not None for r in rs) for t in targets},
                    "acc_by_epoch": [[rs[0]["curve"][i][0], mean([r["curve"][i][1] for r in rs])] for i in range(n)],
                    "density": mean([r["density"] for r in rs]), "inter_bytes": mean([r["inter_bytes"] for r in rs])})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="digits")
    ap.add_argument("--variants", default="localsgd,prunex-paper,prunex")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--jobs", type=int, default=1, help="jobs side by side")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--launcher", default="mpirun", choices=("mpirun", "torchrun"))
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--extra", default="", help="flags added to every run")
    ap.add_argument("--run-timeout", type=float, default=3600)
    ap.add_argument("--out", default="runs/learning")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    if args.list:
        print(json.dumps({"tasks": TASKS, "variants": VARIANTS}, indent=1))
        return 0
    for name, known in (("tasks", TASKS), ("variants", VARIANTS)):
        unknown = [v for v in getattr(args, name).split(",") if v not in known]
        if unknown:
            ap.error(f"unknown {name} {unknown}; known: {', '.join(known)}")
    os.makedirs(args.out, exist_ok=True)
    jobs = [(t, v, int(s)) for t in args.tasks.split(",") for s in args.seeds.split(",")
            for v in args.variants.split(",")]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        runs = list(pool.map(lambda j: run_one(*j, args), jobs))
    emit({"bench": "learning", "launcher": args.launcher, "threads_per_rank": args.threads, "runs": runs,
          "summary": summarize(runs)}, os.path.join(args.out, "learning.json"))
    for task in args.tasks.split(","):   # the curves of every run in the task's folder, this sweep's and earlier
        done = sorted(os.path.join(args.out, task, d) for d in os.listdir(os.path.join(args.out, task))
                      if os.path.isfile(os.path.join(args.out, task, d, "metrics.jsonl")))
        if done:
            made = make_report(done, out_dir=os.path.join(args.out, task, "report"), targets=TASKS[task]["targets"])
            print(f"{task}: plots and report.md in {made['out_dir']}", file=sys.stderr)
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
