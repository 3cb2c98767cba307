"""Accuracy per epoch: PruneX (each lever on and off) against local SGD, hierarchical local SGD, DiLoCo and dense.

    python benchmarks/bench_learning.py --tasks digits --variants prunex,prunex-restart,localsgd \
        --seeds 0,1 [--jobs 2] [--launcher mpirun|torchrun] [--out runs/learning]
    python benchmarks/bench_learning.py --list          # the tasks and variants

Every run is ``prunex-hvd train`` on 4 ranks as 2 emulated nodes × 2 (``PRUNEX_RANKS_PER_NODE=2``), one round
per epoch, with its task's shared recipe (model, data, epochs, batch, lr, ρ's, freeze point): a variant only
adds its own flags, so every method sees the same round period and the same user recipe. ``--jobs N`` runs N
jobs side by side (on a 16-core host 4 jobs of 4 single-thread ranks fill it; here keep 1).

Per run the JSON has the test accuracy of the consensus model after every round (``curve``: epoch, accuracy;
its BatchNorm statistics measured again, the trainer's ``--bn-recalibrate``, and in ``curve_no_recal`` as the
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
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchjson import emit  # noqa: E402
from prunex_hvd.app.report import epochs_to_target, load_run, make_report  # noqa: E402

# the shared recipe of each task: what a user would run, the same for every method. Each pins the round the masks
# freeze after, as every table before 2026-11-28 ran; the command line's recipe has frozen after round 1 since
# (variant prunex-freeze1, benchmarks/README "Masks frozen after round 1")
TASKS: Dict[str, dict] = {
    # make demo's task: 1,797 real handwritten digits, 16×16
    "digits": dict(args="--model resnet_small --dataset digits --epochs 24 --batch-size 16 --lr 0.05 "
                        "--local-epochs 1 --freeze-round 8", targets=(0.90, 0.95, 0.97)),
    # a CIFAR-size input and a deeper net on generated data: noisy low-frequency templates, 32×32×3
    "synthetic": dict(args="--model resnet_small --dataset synthetic --image-size 16 --epochs 16 --batch-size 32 "
                           "--lr 0.05 --local-epochs 1 --freeze-round 5", targets=(0.5, 0.7, 0.8)),
    # the emulated cluster's task: ResNet-18 on digits at 8×8, two rounds an epoch (benchmarks/README.md)
    "digits8-r18": dict(args="--model resnet18 --dataset digits --image-size 8 --epochs 16 --batch-size 16 "
                             "--lr 0.05 --local-steps 11 --freeze-round 4", targets=(0.7, 0.8, 0.9)),
    # beyond convs: the small ViT on the digits at 16×16 (16 patches of 4×4), heads and MLP neurons pruned; no
    # augmentation (random shifts cost a ViT half its accuracy here: 42% against 86% after 10 epochs, one rank)
    "digits-vit": dict(args="--model vit_tiny --dataset digits --image-size 16 --augment none --epochs 24 "
                            "--batch-size 16 --lr 0.05 --local-epochs 1 --freeze-round 8", targets=(0.6, 0.7, 0.8)),
    # ResNet-18 on CIFAR-size generated data (the emulated cluster's model; minutes per run on 2 cores)
    "synthetic-r18": dict(args="--model resnet18 --dataset synthetic --image-size 32 --epochs 8 --batch-size 32 "
                               "--lr 0.05 --local-epochs 1 --freeze-round 3", targets=(0.5, 0.7, 0.8)),
}

# The paper's round as measured: θ stays, adaptive ρ from the demo's 0.01 / 0.001, no relaxation, growth, ramp or
# lr warm-up.
# Every PruneX variant spells all of these, then its levers (argparse keeps the last value), so it means what the
# tables in benchmarks/README.md say whatever the command line's recipe is.
PAPER_ROUND = (
    "--rho1 0.01 --rho2 0.001 --adaptive-rho --restart none --relaxation 1 --rho-growth 1 --keep-ramp-rounds 0 "
    "--no-node-sync --warmup-epochs 0")


def prunex(sparsity: str = "channel:0.5", levers: str = "") -> str:
    return f"--method prunex --sparsity {sparsity} {PAPER_ROUND} {levers}".strip()


GROW = "--rho-growth 1.3 --no-adaptive-rho"
# the recipe of 2026-11-28's sweeps without its channel budget: masks frozen after round 1 whatever the task pins,
# no keep ramp
FREEZE1 = "--method prunex --sparsity channel:0.5 --freeze-round 1 --keep-ramp-rounds 0"
VARIANTS: Dict[str, str] = {
    "dense": "--method dense",
    "localsgd": "--method localsgd",
    "localsgd-hier": "--method localsgd-hier",
    "diloco": "--method diloco",
    "pactrain": "--method pactrain --sparsity channel:0.5",
    "pactrain-structured": "--method pactrain --sparsity channel:0.5 --pactrain-structure structured",
    "prunex-plain": prunex(),
    "prunex-dense-plain": prunex("dense"),
    "prunex-restart": prunex(levers="--restart global"),
    "prunex-restart-node": prunex(levers="--restart node"),
    "prunex-dense-restart": prunex("dense", "--restart global"),
    "prunex-relax": prunex(levers="--restart global --relaxation 1.6"),
    "prunex-relax-norestart": prunex(levers="--relaxation 1.6"),
    "prunex-ramp": prunex(levers="--restart global --keep-ramp-rounds 6"),
    "prunex-grow": prunex(levers=f"--restart global {GROW}"),
    "prunex-coupled-restart": prunex(levers="--coupled --restart global"),
    "prunex-grow-adaptive": prunex(levers="--restart global --rho-growth 1.3"),
    "prunex-relax-grow": prunex(levers=f"--restart global --relaxation 1.6 {GROW}"),
    "prunex-relax13": prunex(levers="--restart global --relaxation 1.3"),
    "prunex-relax-ramp": prunex(levers="--restart global --relaxation 1.6 --keep-ramp-rounds 4"),
    "prunex-dense-grow": prunex("dense", f"--restart global {GROW}"),
    "prunex-grow-relax13": prunex(levers=f"--restart global {GROW} --relaxation 1.3"),   # the recipe before node_sync
    "prunex-dense-grow-relax13": prunex("dense", f"--restart global {GROW} --relaxation 1.3"),
    "prunex-dense-relax": prunex("dense", "--restart global --relaxation 1.6"),
    "prunex-grow-relax13-sync": prunex(levers=f"--restart global {GROW} --relaxation 1.3 --node-sync"),
    "prunex-restart-sync": prunex(levers="--restart global --node-sync"),   # = the recipe since node_sync
    "prunex-dense-restart-sync": prunex("dense", "--restart global --node-sync"),
    "prunex-restart-sync-freeze1": prunex(levers="--restart global --node-sync --freeze-round 1"),
    "prunex-restart-sync-freeze2": prunex(levers="--restart global --node-sync --freeze-round 2"),
    **{f"prunex-restart-sync-ramp{r}": prunex(levers=f"--restart global --node-sync --keep-ramp-rounds {r}")
       for r in (4, 6, 8, 12)},
    "prunex-restart-sync-freeze10": prunex(levers="--restart global --node-sync --freeze-round 10"),
    "prunex-restart-sync-ramp8-freeze12": prunex(levers="--restart global --node-sync --keep-ramp-rounds 8 "
                                                        "--freeze-round 12"),
    # the command line's defaults (whatever they are now), the masks freezing at the task's round
    "prunex": "--method prunex --sparsity channel:0.5",
    "prunex-no-warmup": "--method prunex --sparsity channel:0.5 --warmup-epochs 0",   # the recipe without its warm-up
    "prunex-bf16": "--method prunex --sparsity channel:0.5 --payload-dtype bf16",
    "prunex-fp16": "--method prunex --sparsity channel:0.5 --payload-dtype fp16",
    "prunex-fixed-rho": "--method prunex --sparsity channel:0.5 --no-adaptive-rho",   # ρ held at 0.01 / 0.001
    # the recipe of 2026-11-28's sweeps (its masks freeze after round 1 whatever the task pins; each layer keeps
    # half its channels)
    "prunex-freeze1": f"{FREEZE1} --channel-budget layer",
    # ... retraining by plain averaging from round 2; ... with ρ2 held (ρ1 still balanced)
    "prunex-freeze1-average": f"{FREEZE1} --channel-budget layer --retrain average",
    "prunex-freeze1-hold-rho2": f"{FREEZE1} --channel-budget layer --no-balance-rho2",
    # ρ2 balanced for the first third of the rounds, then released: halved back to its start (rho2_release_round)
    "prunex-release-rho2": f"{FREEZE1} --channel-budget layer --rho2-release-round auto",
    # one channel budget across the layers (channel_budget="global"): the recipe since the twelfth sweep; ... with
    # ρ2 released after a third of the rounds
    "prunex-global-budget": f"{FREEZE1} --channel-budget global",
    # ... with the masks chosen from the initial weights before the first step (freeze_round=0): the recipe since
    # the sixteenth sweep, which ran it as prunex-global-budget --extra '--freeze-round 0'
    "prunex-start-frozen": "--method prunex --sparsity channel:0.5 --freeze-round 0 --keep-ramp-rounds 0 "
                           "--channel-budget global",
    "prunex-global-release-rho2": f"{FREEZE1} --channel-budget global --rho2-release-round auto",
    # ... with ρ2 held where it starts (residual balancing of ρ1 only)
    "prunex-global-hold-rho2": f"{FREEZE1} --channel-budget global --no-balance-rho2",
    # ... without the lr warm-up (the recipe's evaluations measure BatchNorm statistics again since 2026-11-29)
    "prunex-global-no-warmup": f"{FREEZE1} --channel-budget global --warmup-epochs 0",
    # without the lr warm-up: frozen after round 1, or a third of the way (--freeze-round auto)
    **{f"prunex-no-warmup-freeze{f}": f"--method prunex --sparsity channel:0.5 --warmup-epochs 0 --freeze-round {f} "
                                      "--keep-ramp-rounds 0" for f in ("1", "auto")},
    "prunex-hold-rho2": "--method prunex --sparsity channel:0.5 --no-balance-rho2",   # ρ1 balanced, ρ2 held
    **{f"prunex-rhomax{str(m).replace('.', '')}": f"--method prunex --sparsity channel:0.5 --rho-max {m}"
       for m in (0.05, 0.1, 0.2, 1.0)},   # the recipe, residual balancing capped lower
    "prunex-rhomax-auto": "--method prunex --sparsity channel:0.5 --rho-max auto",   # capped by the round's pull
    "prunex-noramp": "--method prunex --sparsity channel:0.5 --keep-ramp-rounds 0",   # the recipe, no keep ramp
    # the recipe before the sixth sweep (2026-11-27): the keep ramp over the first quarter of the rounds
    "prunex-ramp-auto": "--method prunex --sparsity channel:0.5 --keep-ramp-rounds auto",
    # ... with the masks freezing where --freeze-round auto puts them (a third of the rounds; the command line's
    # default until 2026-11-28), not the task's
    "prunex-noramp-freeze-auto": "--method prunex --sparsity channel:0.5 --keep-ramp-rounds 0 --freeze-round auto",
    # ... and the masks freezing once the lr's two-epoch warm-up ends (round 2 at one round an epoch)
    "prunex-noramp-freeze2": "--method prunex --sparsity channel:0.5 --keep-ramp-rounds 0 --freeze-round 2",
    "prunex-uncapped": "--method prunex --sparsity channel:0.5 --rho-max 10",   # the recipe before --rho-max auto
    "prunex-fixed-rho-freeze1": "--method prunex --sparsity channel:0.5 --no-adaptive-rho --freeze-round 1 "
                                "--keep-ramp-rounds 0",
    # momentum across rounds (the recipe, then acceleration): fast ADMM with restart; z alone (DiLoCo's outer step)
    "prunex-fast-admm": "--method prunex --sparsity channel:0.5 --acceleration fast-admm",
    "prunex-fast-admm-fixed-rho": "--method prunex --sparsity channel:0.5 --acceleration fast-admm --no-adaptive-rho",
    **{f"prunex-nesterov{str(b).replace('.', '')}": f"--method prunex --sparsity channel:0.5 --acceleration nesterov "
                                                    f"--outer-momentum {b}" for b in (0.3, 0.5, 0.9)},
    # the retraining phase (after the freeze): the recipe's ADMM, or plain averaging of the pruned model
    **{f"prunex-retrain-{r}": f"--method prunex --sparsity channel:0.5 --retrain {r}" for r in ("admm", "average")},
    # a linear lr warm-up over the first epoch(s) (the trainer's --warmup-epochs), PruneX's and the rivals'
    **{f"{name}-warmup{w}": f"{flags} --warmup-epochs {w}" for w in (1, 2) for name, flags in (
        ("prunex", "--method prunex --sparsity channel:0.5"), ("prunex-dense", "--method prunex --sparsity dense"),
        ("localsgd-hier", "--method localsgd-hier"), ("pactrain", "--method pactrain --sparsity channel:0.5"))},
    "prunex-warmup1-average": "--method prunex --sparsity channel:0.5 --warmup-epochs 1 --retrain average",
    # the warm-up with ρ2 held (ρ1 still balanced), then also averaging after the freeze; the warm-up of 2 epochs
    "prunex-hold-rho2-average": "--method prunex --sparsity channel:0.5 --no-balance-rho2 --retrain average",
    "prunex-warmup2-hold-rho2": "--method prunex --sparsity channel:0.5 --no-balance-rho2 --warmup-epochs 2",
    "prunex-warmup2-average": "--method prunex --sparsity channel:0.5 --warmup-epochs 2 --retrain average",
    "prunex-overlap": "--method prunex --sparsity channel:0.5 --overlap",   # the recipe, overlapped once frozen
    **{f"prunex-overlap-s{k}": f"--method prunex --sparsity channel:0.5 --overlap --overlap-steps {k}"
       for k in (1, 2, 4)},
    # every round overlapped, from the first (before overlap_after_freeze, what prunex-overlap* meant)
    "prunex-overlap-every": "--method prunex --sparsity channel:0.5 --overlap --no-overlap-after-freeze",
    **{f"prunex-overlap-every-s{k}": f"--method prunex --sparsity channel:0.5 --overlap --overlap-steps {k} "
                                     "--no-overlap-after-freeze" for k in (1, 2, 4)},
    "prunex-dense-overlap-every-s4": "--method prunex --sparsity dense --overlap --overlap-steps 4 "
                                     "--no-overlap-after-freeze",
    "prunex-dense": "--method prunex --sparsity dense",
    # beyond convs (a ViT): half the heads of every attention module; half of every MLP's hidden units (fc1's
    # rows with fc2's columns, one group); both
    "prunex-heads": "--method prunex --sparsity head:0.5",
    "prunex-neurons": "--method prunex --sparsity neuron:0.5 --coupled",
    "prunex-vit": "--method prunex --sparsity head:0.5+neuron:0.5 --coupled",
    "prunex-vit-freeze1": "--method prunex --sparsity head:0.5+neuron:0.5 --coupled --freeze-round 1 "
                          "--keep-ramp-rounds 0",   # ... frozen after round 1 (the recipe since 2026-11-28)
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
    if final.get("test_acc_no_recal") is not None:   # BatchNorm recalibrated (--bn-recalibrate): also as it came
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
    train_args = ["train"] + spec["args"].split() + VARIANTS[variant].split() + \
        ["--seed", str(seed), "--threads", str(args.threads), "--no-progress", "--checkpoint-every", "0",
         "--out", run_dir] + args.extra.split()
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
    ap.add_argument("--variants", default="localsgd,prunex-plain,prunex")
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
