"""``prunex-hvd``: the command line.

    prunex-hvd info [--backend B] [--ranks-per-node N] [--probe-mb MB] [--json]
        under any launcher: the topology every rank sees, the backends usable here, and with --probe-mb a
        real collective on each tier with its accounted bytes.

    prunex-hvd train --model resnet18 --dataset cifar10 --data-dir data --sparsity channel:0.5 --out runs/NAME ...
        under any launcher: train with --method (PruneX by default); metrics, checkpoints, summary in --out.

    prunex-hvd compare --methods dense,localsgd,diloco,prunex [train options] --out runs/cmp
        under any launcher: the same training with each method in turn, then a table and the plots.

    prunex-hvd report runs/A runs/B ... [--out DIR] [--targets 0.9,0.95]
        plots (accuracy vs epoch, time and inter-node bytes, epochs to target, residuals, density, masks) and
        a markdown table; runs named NAME-s<seed> are averaged as one variant in the epoch figures.

    prunex-hvd export runs/NAME [--out model_slim.pt]
        the run's finalized model with its pruned channels physically removed: checked against the masked
        model on the test set, parameters, FLOPs and CPU latency of both printed and written to JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys


def _info(args) -> int:
    import torch

    import prunex_hvd as px
    from prunex_hvd.dist.runtime import state

    topo = px.init(backend=args.backend, ranks_per_node=args.ranks_per_node, nodes_per_rack=args.nodes_per_rack)
    _, control = state()
    usable = {b: px.comm.unavailable_reason(b, topo.launcher) or "ok" for b in px.comm.BACKENDS}
    probe = None
    if args.probe_mb:
        g = px.comm.groups()
        t = torch.ones(int(args.probe_mb * 2**20) // 4)
        px.comm.reset()
        g.intra.allreduce_(t, "sum")                          # the node's sum
        g.leaders_then_node_(t, "avg", topo.num_nodes)      # leaders average across nodes, hand it to the node
        probe = px.comm.summary()
    rows = control.allgather_object({"topology": topo.as_dict(), "probe": probe})
    if topo.rank != 0:
        return 0
    if args.json:
        print(json.dumps({"launcher": topo.launcher, "grouping": topo.grouping, "backends": usable,
                          "ranks": rows}, indent=2))
        return 0
    racks = f" in {topo.num_racks} racks × {topo.nodes_per_rack}" if topo.rack_nodes else ""
    print(f"{topo.size} ranks on {topo.num_nodes} node(s) × {topo.local_size}{racks}; launcher {topo.launcher}, "
          f"nodes by {topo.grouping}, backend {args.backend}")
    print(f"{'rank':>4} {'rack':>4} {'node':>4} {'local':>5} {'leader':>6}"
          + ("   inter-node MB sent   intra MB" if probe else ""))
    for row in rows:
        t, p = row["topology"], row["probe"]
        lead = "rack" if t["is_rack_leader"] and topo.rack_nodes else "yes" if t["is_leader"] else ""
        line = f"{t['rank']:>4} {t['rack']:>4} {t['node']:>4} {t['local_rank']:>5} {lead:>6}"
        if p:
            line += f"   {p['total']['cross_node_bytes'] / 2**20:>18.2f}   {p['intra']['payload_bytes'] / 2**20:>8.2f}"
        print(line)
    print("backends: " + "; ".join(f"{b}: {why}" for b, why in usable.items()))
    return 0


def _train(args) -> int:
    from prunex_hvd.app import train

    cfg = _train_config(args)
    summary = train.train(cfg)
    if "stopped_after_round" in summary or train.runtime.topology().rank != 0:
        return 0
    ratio = summary["inter_bytes"] / summary["dense_inter_bytes"] if summary["dense_inter_bytes"] else float("nan")
    print(f"final test accuracy {100 * summary['final_test_acc']:.2f}% (the finalized model)   "
          f"density {summary['density']:.3f}   wall {summary['wall_s']:.1f} s\n"
          f"inter-node traffic {summary['inter_bytes'] / 2**20:.2f} MB; the same rounds exchanged dense: "
          f"{summary['dense_inter_bytes'] / 2**20:.2f} MB ({ratio:.3f}x)"
          + (f"; across racks {summary['cross_rack_bytes'] / 2**20:.2f} MB" if summary.get("num_racks") else ""))
    print(f"results in {cfg.out}: metrics.jsonl, summary.json, final_model.pt; plots: prunex-hvd report {cfg.out}")
    return 0


def _compare(args) -> int:
    import os

    from prunex_hvd.app import methods, report, train

    wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in wanted if m not in methods.METHODS]
    if unknown or not wanted:
        raise ValueError(f"--methods takes a comma-separated list of {', '.join(methods.METHODS)}; "
                         f"got {args.methods!r}")
    base = _train_config(args)
    dirs = []
    for method in wanted:   # one after the other, in the same processes, same data, sampler and counters
        out = os.path.join(args.out, method)
        train.train(train.dataclasses.replace(base, method=method, out=out))
        dirs.append(out)
    if train.runtime.topology().rank != 0:
        return 0
    runs = [report.load_run(d) for d in dirs]
    made = report.make_report(dirs, os.path.join(args.out, "report"))
    table = report.comparison_table(runs)
    with open(os.path.join(args.out, "comparison.md"), "w") as f:
        f.write(table)
    print("\n" + table)
    print(f"runs in {args.out}/<method>; plots and report.md in {made['out_dir']}")
    return 0


def _report(args) -> int:
    from prunex_hvd.app import report

    return report.run_args(args)


def _export(args) -> int:
    from prunex_hvd.app import export

    import torch

    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    try:
        sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-sizes takes comma-separated integers >= 1, got {args.batch_sizes!r}")
    if args.repeats < 1 or (args.samples is not None and args.samples < 1):
        raise ValueError("--repeats and --samples must be >= 1")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or threads)
    try:
        report = export.export_run(args.run, out=args.out, json_out=args.json, data_dir=args.data_dir,
                                   samples=args.samples, batch_sizes=sizes, repeats=args.repeats,
                                   measure=not args.no_latency)
    finally:
        torch.set_num_threads(threads)
    print(export.format_report(report))
    return 0


def _train_config(args):
    """The flags' values as a TrainConfig (the consensus's knobs go into its ``consensus``)."""
    from prunex_hvd.app.train import TrainConfig

    flat = {k: v for k, v in vars(args).items() if k in _flat_names()}
    if isinstance(flat.get("sparsity"), str) and flat["sparsity"].lstrip().startswith("{"):
        try:   # here, not in argparse: an error every rank prints, the same way as any other
            flat["sparsity"] = json.loads(flat["sparsity"])
        except json.JSONDecodeError as exc:
            raise ValueError(f"--sparsity looks like JSON but does not parse: {exc}") from None
    return TrainConfig.from_flat(**flat)


def _flat_names():
    from prunex_hvd.app.train import TrainConfig
    from prunex_hvd.engine.config import ConsensusConfig

    return {f.name for f in dataclasses.fields(TrainConfig)} | set(ConsensusConfig.knob_names())


def _number_or(kind, **words):
    """An argparse type: a number of ``kind`` (int or float), or one of ``words`` (case-insensitive), which map to
    their values."""
    choices = ["an integer" if kind is int else "a number"] + [repr(w) for w in words if w]

    def parse(text: str):
        if text.lower() in words:
            return words[text.lower()]
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{', '.join(choices[:-1])} or {choices[-1]}, not {text!r}") from None
    return parse


_freeze_round = _number_or(int, auto="auto", none=None, **{"": None})
_ramp_rounds = _number_or(int, auto="auto")
_release_round = _number_or(int, auto="auto", none=None)
_warmup_epochs = _number_or(float, auto="auto")
_rho_max = _number_or(float, auto="auto")


def _add_train_args(p: argparse.ArgumentParser) -> None:
    from prunex_hvd.app import methods, models
    from prunex_hvd.app.data import AUGMENTS, DATASETS
    from prunex_hvd.app.train import TrainConfig as D

    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=D.model, help=f"{', '.join(models.NAMES)}, or torchvision:NAME (GPU hosts)")
    g.add_argument("--dataset", default=D.dataset, choices=DATASETS,
                   help="digits: embedded, no download; cifar10: needs --data-dir; synthetic: for benchmarks")
    g.add_argument("--data-dir", default=D.data_dir, help="folder holding cifar-10-batches-py/")
    g.add_argument("--image-size", type=int, default=None, help="input side in pixels (default: the model's)")
    g.add_argument("--augment", default=None, choices=AUGMENTS,
                   help="train-time augmentation (default: the dataset's: shift for digits, cifar for cifar10; a ViT "
                        "on the digits learns far better without: none)")
    g = schedule = p.add_argument_group("schedule")
    g.add_argument("--method", default=D.method, choices=list(methods.METHODS))
    g.add_argument("--epochs", type=float, default=D.epochs)
    g.add_argument("--local-epochs", type=float, default=D.local_epochs, help="epochs of local steps per round")
    g.add_argument("--batch-size", type=int, default=D.batch_size, help="per rank")
    g.add_argument("--test-batch-size", type=int, default=D.test_batch_size)
    g.add_argument("--lr", type=float, default=D.lr,
                   help="per update. prunex/prunex-flat update on one rank's batch between rounds, dense on the "
                        "average over all ranks: from a dense lr L over W ranks start PruneX near L/W")
    g.add_argument("--momentum", type=float, default=D.momentum)
    g.add_argument("--weight-decay", type=float, default=D.weight_decay)
    g.add_argument("--nesterov", action="store_true")
    g.add_argument("--lr-schedule", default=D.lr_schedule, choices=("cosine", "constant"))
    g.add_argument("--warmup-epochs", type=_warmup_epochs, default="auto",
                   help="linear lr warm-up: epochs, or auto (two epochs for prunex / prunex-flat, at most an eighth of "
                        "the run; none for the others: a round-based consensus loses most in its first rounds at full "
                        "lr)")
    g.add_argument("--seed", type=int, default=D.seed)
    g = p.add_argument_group("H-SADMM (prunex, prunex-flat); defaults are a recipe measured to converge in "
                             "tens of rounds, the paper's are rho1=1.5e-3 rho2=1.5e-4")
    _consensus_flags({"consensus": g, "schedule": schedule})
    g = p.add_argument_group("baselines (--method dense | topk | pactrain | localsgd | localsgd-hier | diloco | "
                             "prunex-flat); the round-based ones talk every --local-steps / --local-epochs")
    g.add_argument("--topk-ratio", type=float, default=D.topk_ratio, help="topk: fraction of each layer sent")
    g.add_argument("--topk-warmup-steps", type=int, default=D.topk_warmup_steps, help="topk: dense steps first")
    g.add_argument("--pactrain-score", default=D.pactrain_score, choices=("magnitude", "grasp"),
                   help="pactrain: how weights are scored for pruning (keep ratio from --sparsity)")
    g.add_argument("--pactrain-patience", type=int, default=D.pactrain_patience,
                   help="pactrain: steps the mask must hold before gradients travel compacted")
    g.add_argument("--pactrain-structure", default=D.pactrain_structure, choices=("unstructured", "structured"),
                   help="pactrain: single weights (the paper), or PruneX's structure at init (whole channels, "
                        "filters, heads, each layer keeping its own ratio: --channel-budget layer; --coupled as "
                        "for prunex)")
    g.add_argument("--terngrad", action="store_true", help="pactrain: ternary gradients with a shared scale")
    g.add_argument("--hier-intra-steps", type=int, default=D.hier_intra_steps,
                   help="localsgd-hier: steps between averages within a node; must divide the round's steps "
                        "(default: the largest divisor not above a quarter of them)")
    g.add_argument("--diloco-outer-lr", type=float, default=D.diloco_outer_lr, help="diloco: outer Nesterov SGD lr")
    g.add_argument("--diloco-outer-momentum", type=float, default=D.diloco_outer_momentum,
                   help="diloco: outer Nesterov SGD momentum")
    g = p.add_argument_group("job")
    _consensus_flags({"job": g})
    g.add_argument("--ranks-per-node", type=int, default=None,
                   help="emulate nodes: node = rank // N (same as env PRUNEX_RANKS_PER_NODE)")
    g.add_argument("--nodes-per-rack", type=int, default=None,
                   help="racks of N consecutive nodes (same as env PRUNEX_NODES_PER_RACK; default: Slurm's switch "
                        "topology where set, else one rack per node)")
    g.add_argument("--timeout", type=float, default=None,
                   help="seconds a collective may wait for the other ranks before the job stops, naming the ranks "
                        "that did not arrive (a dead rank: within ~1 s); default env PRUNEX_TIMEOUT_S or 600, 0: off")
    g.add_argument("--out", default=D.out, help="run folder: metrics.jsonl, summary.json, checkpoints")
    g.add_argument("--checkpoint-every", type=int, default=D.checkpoint_every,
                   help="rounds between checkpoints (0: off)")
    g.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    g.add_argument("--stop-after-rounds", type=int, default=None,
                   help="run this many rounds, checkpoint and stop (time-boxed slices of one schedule)")
    g.add_argument("--eval-every", type=int, default=D.eval_every, help="rounds between test evaluations")
    g.add_argument("--bn-recalibrate", type=int, default=D.bn_recalibrate, metavar="N",
                   help="measure the evaluated model's BatchNorm statistics again on N training batches per rank, "
                        "the final model's on a whole epoch (at most 256 batches), weights held, averaged over the "
                        "ranks (every method; 0: the round's own statistics)")
    g.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank (default: cores / ranks on the host)")
    g.add_argument("--device", default=D.device, choices=("auto", "cpu", "cuda"),
                   help="auto: the GPU of this local rank when CUDA is available, else cpu")
    g.add_argument("--no-progress", dest="progress", action="store_false")


# how the command line shows the consensus's knobs where a plain --name VALUE (or --no-name for a switch that
# is on) would not do; the help is the knob's own (ConsensusConfig) unless given here
_FLAGS = {
    "local_steps": dict(group="schedule", default=None, help="steps per round (overrides --local-epochs)"),
    "freeze_round": dict(type=_freeze_round,
                         help="round after which masks freeze: 0 (the channels chosen from the initial weights "
                              "before the first step, every round training the pruned model), N (1: the channels "
                              "round 1 chose), auto (a third of the planned rounds) or none (only "
                              "--freeze-patience)"),
    "keep_ramp_rounds": dict(type=_ramp_rounds,
                             help="rounds over which every keep ratio falls from 1 to its target (cubic), masks "
                                  "freezing only after: 0 (the default: the target from round 1), N, or auto (a "
                                  "quarter of the planned rounds)"),
    "rho2_release_round": dict(type=_release_round,
                               help="from the end of this round rho2 (and rho3) stop being balanced and halve each "
                                    "round back to where they started: N, auto (after a third of the planned "
                                    "rounds) or none (the default: balanced to the end)"),
    "rho_max": dict(type=_rho_max, default="auto",
                    help="cap of the balanced rho's: N, or auto (where a round's steps would pull θ back once its "
                         "distance to the anchor under the proximal term alone: (1 - momentum)/(lr x local steps))"),
    "adaptive_rho": dict(help="balance primal and dual residuals per layer by rescaling rho (--no-adaptive-rho: "
                              "every rho fixed, or on the --rho-growth schedule)"),
    "masked_retrain": dict(help="after freezing, keep θ on the frozen structure (--no-masked-retrain: only z is "
                                "masked)"),
    "payload_dtype": dict(choices=("fp32", "bf16", "fp16"),
                          help="what the inter-node exchange carries (default: the model's dtype); bf16 / fp16 "
                               "send the change since the last consensus, rounded, with error feedback: half "
                               "the bytes"),
    "overlap_steps": dict(type=int, help="with --overlap: fold each round's exchange in after this many of the "
                                         "next round's local steps (default: a quarter of a round)"),
    "rho3": dict(type=float, help="with racks: pull of each rack's consensus toward the global z (default: "
                                  "--rho2)"),
    "backend": dict(group="job"),
    "hierarchical": None,   # the method decides: prunex or prunex-flat
}


def _consensus_flags(groups: dict) -> None:
    """The one place the consensus's knobs (:class:`ConsensusConfig`'s fields) become flags, with the
    trainer's recipe (``train.RECIPE``) as defaults; each lands in ``groups[its group]`` (default
    ``"consensus"``); knobs whose group is not in ``groups`` are left to another call."""
    from prunex_hvd.app.train import RECIPE
    from prunex_hvd.engine.config import ACCELERATIONS, CHANNEL_BUDGETS, RESTARTS, RETRAINS, ConsensusConfig

    for f in dataclasses.fields(ConsensusConfig):
        special = _FLAGS.get(f.name, {})
        if special is None or special.get("group", "consensus") not in groups:
            continue
        g = groups[special.get("group", "consensus")]
        flag, default, text = "--" + f.name.replace("_", "-"), getattr(RECIPE, f.name), f.metadata["help"]
        if f.name == "coupled":
            c = g.add_mutually_exclusive_group()
            c.add_argument("--coupled", action="store_true",
                           help="channel pruning with dependencies: a conv's dropped input channels also drop the "
                                "filters (and BN channels) that produce them and nothing else reads; less traffic, "
                                "smaller model")
            c.add_argument("--coupled-streams", dest="coupled", action="store_const", const="streams",
                           help="--coupled, and every residual stream one channel group: all convs reading and "
                                "writing it drop the same channels (readers' channel:K), so export removes all of "
                                "them")
        elif f.type == "bool":   # --name / --no-name, the recipe's value by default
            g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                           help=special.get("help", text))
        else:
            kind = special.get("type", {"float": float, "int": int}.get(f.type))   # annotations are strings
            g.add_argument(flag, type=kind, default=special.get("default", default), help=special.get("help", text),
                           choices={"restart": RESTARTS, "acceleration": ACCELERATIONS,
                                    "retrain": RETRAINS, "channel_budget": CHANNEL_BUDGETS}.get(
                                        f.name, special.get("choices")))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="prunex-hvd", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="topology, usable backends, and an optional probe of each tier")
    info.add_argument("--backend", default="auto")
    info.add_argument("--ranks-per-node", type=int, default=None,
                      help="emulate nodes: node = rank // N (same as env PRUNEX_RANKS_PER_NODE)")
    info.add_argument("--nodes-per-rack", type=int, default=None,
                      help="racks of N consecutive nodes (same as env PRUNEX_NODES_PER_RACK)")
    info.add_argument("--probe-mb", type=float, default=0.0,
                      help="run a hierarchical allreduce of this many MB and show the bytes per tier")
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=_info)
    train = sub.add_parser("train", help="train a model with --method under any launcher")
    _add_train_args(train)
    train.set_defaults(func=_train)
    cmp_ = sub.add_parser("compare", help="train several --methods in turn on the same setup and tabulate them")
    _add_train_args(cmp_)
    cmp_.add_argument("--methods", default="dense,topk,pactrain,localsgd,localsgd-hier,diloco,prunex-flat,prunex",
                      help="comma-separated; each run goes to --out/<method>")
    cmp_.set_defaults(func=_compare, out="runs/compare")
    from prunex_hvd.app import report   # its arguments are its own; the module imports matplotlib only to draw

    rep = report.add_arguments(sub.add_parser("report", help="plots and a markdown table from run folders"))
    rep.set_defaults(func=_report)
    exp = sub.add_parser("export", help="remove the pruned channels of a run's final model for real: a smaller dense "
                                        "model, checked, counted and timed against the masked one")
    exp.add_argument("run", help="run folder of a finished `prunex-hvd train` (holds final_model.pt)")
    exp.add_argument("--out", default=None,
                     help="slim model file: .pt = plain torch.nn module (torch.load(p, weights_only=False)), "
                          ".pt2 = torch.export archive (torch.export.load(p).module()); default RUN/model_slim.pt")
    exp.add_argument("--json", default=None, help="report file (default: --out with .json)")
    exp.add_argument("--data-dir", default=None, help="where the run's dataset lives, if not where training read it")
    exp.add_argument("--samples", type=int, default=None, help="test images for the equivalence check (default: all)")
    exp.add_argument("--batch-sizes", default="1,64", help="batch sizes timed on CPU")
    exp.add_argument("--repeats", type=int, default=20, help="timed repetitions per model and batch size (median)")
    exp.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    exp.add_argument("--no-latency", action="store_true", help="skip the timing")
    exp.set_defaults(func=_export)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    _show_the_library_log()
    try:
        code = args.func(args)
    except (ValueError, RuntimeError, FloatingPointError) as exc:   # the same message on every rank
        print(f"prunex-hvd: error: {exc}", file=sys.stderr, flush=True)
        _let_the_others_say_it()
        return 2
    from prunex_hvd.dist import runtime
    runtime.finish()   # every rank leaves together, its groups taken down before the interpreter goes
    return code


def _show_the_library_log() -> None:
    """The library logs what a user wants to see (freezing, ρ changes, refused rounds) on rank 0 and stays
    silent unless asked; the command asks, once per process."""
    logger = logging.getLogger("prunex_hvd")
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("prunex-hvd: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


class _Stderr(logging.StreamHandler):
    """A handler writing to whatever ``sys.stderr`` is when a record comes (tests and tools replace it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def _let_the_others_say_it() -> None:
    """The launcher tears the job down at the first non-zero exit: in a multi-rank job, wait a moment so the
    other ranks (which raised the same error) print it too."""
    import time

    from prunex_hvd.dist import runtime
    if runtime.is_initialized() and runtime.topology().size > 1:
        time.sleep(2)


if __name__ == "__main__":
    sys.exit(main())
