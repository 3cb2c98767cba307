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
import difflib
import json
import logging
import re
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
    if cfg.elastic:
        from prunex_hvd.app.elastic_train import train_elastic
        summary = train_elastic(cfg)
    else:
        summary = train.train(cfg)
    if "stopped_after_round" in summary or train.runtime.topology().rank != 0:
        return 0
    print(f"final test accuracy {100 * summary['final_test_acc']:.2f}% (the finalized model)   "
          f"density {summary['density']:.3f}   wall {summary['wall_s']:.1f} s")
    if summary["dense_inter_bytes"]:
        print(f"inter-node traffic {summary['inter_bytes'] / 2**20:.2f} MB; counterfactual, the same rounds sent "
              f"dense: {summary['dense_inter_bytes'] / 2**20:.2f} MB "
              f"({summary['inter_bytes'] / summary['dense_inter_bytes']:.3f}x)"
              + (f"; across racks {summary['cross_rack_bytes'] / 2**20:.2f} MB" if summary.get("num_racks") else ""))
    else:
        print("one node: nothing crossed a node boundary")
    print(f"results in {cfg.out}: metrics.jsonl, summary.json, final_model.pt; plots: prunex-hvd report {cfg.out}")
    return 0


def _compare(args) -> int:
    import os

    from prunex_hvd.app import methods, report, train

    wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [_unknown("method", m, methods.METHODS) for m in wanted if m not in methods.METHODS]
    if unknown or not wanted:
        raise ValueError(f"--methods: {'; '.join(unknown) or 'no method given'}; it takes a comma-separated list of "
                         f"{', '.join(methods.METHODS)}")
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
    if made["summary"]:
        print("\n".join(report.against_dense(made["summary"])))
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
    """The flags' values as a TrainConfig (the consensus's knobs go into its ``consensus``): a ``--config`` file's
    settings first, the flags given on the command line over them."""
    from prunex_hvd.app.methods import ONLY_FOR
    from prunex_hvd.app.train import TrainConfig

    flat = dict(args.file_settings)
    flat.update({k: v for k, v in vars(args).items() if k in _flat_names() and k in args.given})
    if isinstance(flat.get("elastic"), int) and not isinstance(flat["elastic"], bool):   # --elastic [MIN_NODES]
        flat["min_nodes"], flat["elastic"] = flat["elastic"], True
    flat.setdefault("method", args.method)
    if args.command == "train":   # (compare runs several methods: each reads the settings that apply to it)
        for name in sorted(args.given):
            if name in ONLY_FOR and flat["method"] not in ONLY_FOR[name]:
                raise ValueError(f"--{name.replace('_', '-')} does not apply to --method {flat['method']}: only to "
                                 f"{', '.join(ONLY_FOR[name])}")
    if isinstance(flat.get("sparsity"), str) and flat["sparsity"].lstrip().startswith("{"):
        try:   # here, not in argparse: an error every rank prints, the same way as any other
            flat["sparsity"] = json.loads(flat["sparsity"])
        except json.JSONDecodeError as exc:
            raise ValueError(f"--sparsity looks like JSON but does not parse: {exc}") from None
    try:
        cfg = TrainConfig.from_flat(**flat)
        cfg.validate()   # here, where a setting's error can name the flag that set it
        return cfg
    except ValueError as exc:
        raise ValueError(_as_flags(str(exc), args.given)) from None


def _as_flags(message: str, given) -> str:
    """A setting's error as the user typed it: a setting given by its flag is named by the flag (a leading name,
    or any name with an underscore); one from a --config file keeps its JSON key."""
    for name in sorted(given, key=len, reverse=True):
        flag = "--" + name.replace("_", "-")
        if message.startswith(name + " ") or message.startswith(name + "="):
            message = flag + message[len(name):]
        if "_" in name:
            message = re.sub(rf"(?<![\w-]){re.escape(name)}(?![\w])", flag, message)
    return message


def _unknown(what: str, word: str, names) -> str:
    """``unknown WHAT 'word' (did you mean 'x'?)``: the closest of ``names``, if one is close."""
    close = difflib.get_close_matches(word, list(names), n=1)
    return f"unknown {what} {word!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def _one_of(what: str, names):
    """An argparse type: one of ``names``, else an error that suggests the closest."""
    def parse(text: str) -> str:
        if text not in names:
            raise argparse.ArgumentTypeError(f"{_unknown(what, text, names)}; choose one of {', '.join(names)}")
        return text
    return parse


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number >= 1, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a whole number >= 1, not {value}")
    return value


def _flat_names():
    from prunex_hvd.app.train import TrainConfig
    from prunex_hvd.engine.config import ConsensusConfig

    return {f.name for f in dataclasses.fields(TrainConfig)} | set(ConsensusConfig.knob_names()) | {"paper"}


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


def _overlap(text: str):
    if text.lower() in ("on", "true", "yes"):
        return True
    if text.lower() in ("off", "false", "no", "0"):
        return False
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"on, off or a number of steps, not {text!r}") from None


_COUPLED = {"off": False, "pairs": True, "streams": "streams"}


def _coupled(text: str):
    if text not in _COUPLED:
        raise argparse.ArgumentTypeError(f"off, pairs or streams, not {text!r}")
    return _COUPLED[text]

# Knobs measured and removed: the flag is refused, naming the log entry that says what it did and how to bring it
# back (benchmarks/log/removed-knobs.md).
REMOVED_FLAGS = {flag: entry for entry, flags in {
    "relaxation": ("--relaxation",), "rho_growth": ("--rho-growth",), "keep_ramp_rounds": ("--keep-ramp-rounds",),
    "rho2_release_round": ("--rho2-release-round",), "acceleration": ("--acceleration", "--outer-momentum"),
    "keep_start_norm": ("--keep-start-norm", "--no-keep-start-norm"), "sync_rounds": ("--sync-rounds",),
    "sync_powersgd_rank": ("--sync-powersgd-rank",),
    "overlap_after_freeze": ("--overlap-after-freeze", "--no-overlap-after-freeze"), "overlap_steps": ("--overlap-steps",),
    "weight_decay_z": ("--weight-decay-z",), "budget_floor": ("--budget-floor",),
    "balance_rho2": ("--balance-rho2", "--no-balance-rho2"), "retrain": ("--retrain",),
    "masked_retrain": ("--masked-retrain", "--no-masked-retrain"),
    "compact_compute": ("--compact-compute", "--no-compact-compute"),
}.items() for flag in flags}
# Settings with no flag of their own: a --config file (or the Python API) sets them.
CONFIG_ONLY = ("restart", "adaptive_rho", "freeze_patience", "rack_tier", "rho3", "bucket_mb", "augment",
               "test_batch_size", "nesterov", "lr_schedule", "eval_every", "bn_recalibrate", "progress",
               "topk_warmup_steps", "pactrain_score", "pactrain_patience", "terngrad", "diloco_outer_lr",
               "diloco_outer_momentum")


def refuse_removed_flags(argv) -> None:
    """A removed knob's flag, or a setting that has only a --config key, gets a ``ValueError`` that says so."""
    for token, after in zip(argv, list(argv[1:]) + [None]):
        flag, _, value = token.partition("=")
        if flag == "--coupled-streams":
            raise ValueError("--coupled-streams is now --coupled streams")
        if flag == "--freeze-round" and (value or after or "").lower() == "auto":
            raise ValueError("--freeze-round auto was removed (benchmarks/log/removed-knobs.md, 'freeze_fraction'): "
                             "the masks are chosen at the start by default (0); give a round number to freeze later")
        if flag in REMOVED_FLAGS:
            entry = REMOVED_FLAGS[flag]
            raise ValueError(f"{flag} was removed: the measurements did not earn it a place (benchmarks/log/"
                             f"removed-knobs.md, '{entry}', says what it did and the commit to bring it back from)")
        name = flag[2:].replace("-", "_").removeprefix("no_") if flag.startswith("--") else None
        if name in CONFIG_ONLY:
            raise ValueError(f"{flag} is not a flag: set {name!r} in a --config JSON file (a run's config.json "
                             f"holds every setting), or through the Python API")


def _add_train_args(p: argparse.ArgumentParser, one_method: bool = True) -> None:
    """``train``'s flags on ``p``; ``one_method=False``: without ``--method`` (``compare`` takes ``--methods``)."""
    from prunex_hvd.app import methods, models
    from prunex_hvd.app.data import DATASETS
    from prunex_hvd.app.train import TrainConfig as D
    from prunex_hvd.engine.config import CHANNEL_BUDGETS, ConsensusConfig

    C = ConsensusConfig()
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=D.model, help=f"{', '.join(models.NAMES)}, or torchvision:NAME (GPU hosts)")
    g.add_argument("--dataset", default=D.dataset, choices=DATASETS,
                   help="digits: embedded, no download; cifar10: needs --data-dir; synthetic: for benchmarks")
    g.add_argument("--data-dir", default=D.data_dir, help="folder holding cifar-10-batches-py/")
    g.add_argument("--image-size", type=int, default=None, help="input side in pixels (None: the model's)")
    g = p.add_argument_group("schedule")
    if one_method:
        g.add_argument("--method", default=D.method, type=_one_of("method", methods.METHODS), metavar="METHOD",
                       help=f"how the ranks talk: {', '.join(methods.METHODS)}")
    g.add_argument("--epochs", type=float, default=D.epochs, help="epochs of training")
    g.add_argument("--local-epochs", type=float, default=D.local_epochs, help="epochs of local steps per round")
    g.add_argument("--local-steps", type=int, default=None, help="steps per round (overrides --local-epochs)")
    g.add_argument("--batch-size", type=int, default=D.batch_size, help="per rank")
    g.add_argument("--lr", type=float, default=D.lr,
                   help="the same for every method: keep your dense run's lr (Horovod's lr x size included); "
                        "docs/tuning.md, 'The learning rate'")
    g.add_argument("--momentum", type=float, default=D.momentum, help="SGD's momentum")
    g.add_argument("--weight-decay", type=float, default=D.weight_decay, help="SGD's weight decay")
    g.add_argument("--warmup-epochs", type=_number_or(float, auto="auto"), default="auto",
                   help="linear lr warm-up: epochs, or auto (two epochs for prunex / prunex-flat, at most an eighth of "
                        "the run; none for the others)")
    g.add_argument("--seed", type=int, default=D.seed, help="model, data order and augmentation")
    g = p.add_argument_group("H-SADMM (prunex, prunex-flat): the defaults are the measured recipe "
                             "(help(prunex_hvd.ConsensusConfig) is the tuning guide)")
    g.add_argument("--sparsity", default=C.sparsity, help=_help("sparsity"))
    g.add_argument("--coupled", type=_coupled, nargs="?", const=True, default="off", metavar="{off,pairs,streams}",
                   help="prune a conv's input channels with the filters that produce them (pairs; --coupled alone), "
                        "and each residual stream as one group (streams): less traffic, a smaller exported model")
    g.add_argument("--channel-budget", default=C.channel_budget, choices=CHANNEL_BUDGETS, help=_help("channel_budget"))
    g.add_argument("--freeze-round", type=_number_or(int, none=None), default=C.freeze_round,
                   help="round after which the masks freeze: 0 (chosen from the initial weights before the first "
                        "step), N, or none (once they hold for 3 rounds)")
    g.add_argument("--rho1", type=float, default=C.rho1, help=_help("rho1"))
    g.add_argument("--rho2", type=float, default=C.rho2, help=_help("rho2"))
    g.add_argument("--rho-max", type=_number_or(float, auto="auto"), default=C.rho_max, help=_help("rho_max"))
    g.add_argument("--node-sync", action=argparse.BooleanOptionalAction, default=C.node_sync, help=_help("node_sync"))
    g.add_argument("--payload-dtype", type=_number_or(str, none=None), default=C.payload_dtype,
                   choices=("bf16", "fp16", "fp32", None), metavar="{bf16,fp16,fp32,none}", help=_help("payload_dtype"))
    g.add_argument("--overlap", type=_overlap, default=C.overlap, metavar="{off,on,N}",
                   help="hide each round's inter-node exchange behind the next round's first steps: on (folded in "
                        "after a quarter of a round) or N steps")
    g.add_argument("--paper", action="store_true",
                   help="start from the paper's round instead of the recipe (rho 1.5e-3 / 1.5e-4, no restart, no "
                        "node sync, masks frozen when stable, per-layer channels; no lr warm-up unless asked): for "
                        "ablations")
    g = p.add_argument_group("baselines (--method dense | topk | pactrain | localsgd | localsgd-hier | diloco); the "
                             "round-based ones talk every --local-steps / --local-epochs")
    g.add_argument("--topk-ratio", type=float, default=D.topk_ratio, help="topk: fraction of each layer sent")
    g.add_argument("--pactrain-structure", default=D.pactrain_structure, choices=("unstructured", "structured"),
                   help="pactrain: single weights (the paper), or PruneX's structure at init")
    g.add_argument("--hier-intra-steps", type=int, default=D.hier_intra_steps,
                   help="localsgd-hier: steps between averages within a node; must divide the round's steps "
                        "(None: the largest divisor not above a quarter of them)")
    g = p.add_argument_group("job")
    g.add_argument("--config", default=None, metavar="JSON",
                   help="a file of settings (a run's config.json, or {\"name\": value, ...} of any TrainConfig or "
                        "ConsensusConfig field); the flags given here go over it")
    g.add_argument("--backend", default=C.backend, help=_help("backend"))
    g.add_argument("--ranks-per-node", type=int, default=None,
                   help="emulate nodes: node = rank // N (same as env PRUNEX_RANKS_PER_NODE)")
    g.add_argument("--nodes-per-rack", type=int, default=None,
                   help="racks of N consecutive nodes (same as env PRUNEX_NODES_PER_RACK; None: Slurm's switch "
                        "topology where set, else one rack per node)")
    g.add_argument("--timeout", type=float, default=None,
                   help="seconds a collective may wait for the other ranks before the job stops, naming the ranks "
                        "that did not arrive (None: env PRUNEX_TIMEOUT_S or 600; 0: off)")
    g.add_argument("--out", default=D.out, help="run folder: metrics.jsonl, summary.json, checkpoints")
    g.add_argument("--checkpoint-every", type=int, default=D.checkpoint_every,
                   help="rounds between checkpoints (0: off)")
    g.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    g.add_argument("--stop-after-rounds", type=int, default=None,
                   help="run this many rounds, checkpoint and stop (time-boxed slices of one schedule)")
    g.add_argument("--elastic", nargs="?", type=_positive_int, const=D.min_nodes, default=None, metavar="MIN_NODES",
                   help="under horovodrun's elastic mode (--host-discovery-script) a lost node costs the round in "
                        "progress, not the job, and a node that comes back joins at the next round; fewer nodes "
                        f"left than MIN_NODES (default {D.min_nodes}) stop the job. Elsewhere the job stops at a "
                        "loss, as without it (prunex, prunex-flat)")
    g.add_argument("--threads", type=_positive_int, default=None,
                   help="torch threads per rank (None: cores / ranks on the host)")
    g.add_argument("--device", default=D.device, choices=("auto", "cpu", "cuda"),
                   help="auto: the GPU of this local rank when CUDA is available, else cpu")


def _help(knob: str) -> str:
    from prunex_hvd.engine.config import ConsensusConfig

    return next(f.metadata["help"] for f in dataclasses.fields(ConsensusConfig) if f.name == knob)


def _settings_file(path: str) -> dict:
    """A --config file's flat settings: a run's config.json (its ``config``) or a plain ``{name: value}``."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--config {path}: {exc}") from None
    settings = doc.get("config", doc) if isinstance(doc, dict) else None
    if not isinstance(settings, dict):
        raise ValueError(f"--config {path}: expected a JSON object of settings, got {type(doc).__name__}")
    from prunex_hvd.app.train import REMOVED_ANY, REMOVED_OFF, removed_settings

    on = removed_settings(settings)
    if on:   # (a run's config.json from before holds every removed knob, off where it meant nothing)
        raise ValueError(f"--config {path}: {', '.join(on)} was removed (benchmarks/log/removed-knobs.md, "
                         f"'{on[0].split()[0]}')")
    if settings.get("round_pull") == REMOVED_OFF["round_pull"]:   # the cap from the lr, now rho_max="auto"
        settings = dict(settings, rho_max="auto")
    settings = {k: v for k, v in settings.items() if k not in REMOVED_OFF and k not in REMOVED_ANY}
    for name in settings:
        if name not in _flat_names():
            raise ValueError(f"--config {path}: {name!r} is not a setting of prunex-hvd train")
    return {k: v for k, v in settings.items() if k not in ("out", "resume")}


def build_parser() -> argparse.ArgumentParser:
    import prunex_hvd

    ap = argparse.ArgumentParser(prog="prunex-hvd", description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", action="version", version=f"prunex-hvd {prunex_hvd.__version__}")
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
    shown = argparse.ArgumentDefaultsHelpFormatter
    train = sub.add_parser("train", help="train a model with --method under any launcher", formatter_class=shown)
    _add_train_args(train)
    train.set_defaults(func=_train)
    cmp_ = sub.add_parser("compare", help="train several --methods in turn on the same setup and tabulate them",
                          formatter_class=shown)
    _add_train_args(cmp_, one_method=False)
    cmp_.add_argument("--methods", default="dense,topk,pactrain,localsgd,localsgd-hier,diloco,prunex-flat,prunex",
                      help="comma-separated; each run goes to --out/<method>")
    cmp_.set_defaults(func=_compare, out="runs/compare", method="prunex")   # (each run sets its own method)
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


def parse(argv) -> argparse.Namespace:
    """The command line as the commands read it: for ``train`` and ``compare`` the flags given (``given``) and the
    ``--config`` file's settings (``file_settings``) too. A removed or config-only flag, or a bad ``--config``
    file, raises ``ValueError``; argparse's own errors exit 2."""
    parser = build_parser()
    command = next((t for t in argv if not t.startswith("-")), None)
    if command in ("train", "compare"):
        refuse_removed_flags(argv)
    args = parser.parse_args(argv)
    if command in ("train", "compare"):
        args.given = _given_flags(parser, command, argv)
        args.file_settings = _settings_file(args.config) if args.config else {}
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse(argv)
    except ValueError as exc:
        build_parser().exit(2, f"prunex-hvd: error: {exc}\n")
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


def flags_for_method(method: str, argv) -> list:
    """``train``'s command line ``argv`` without the flags (and their values) that do not apply to ``method``:
    for harnesses that give every method one shared command line."""
    from prunex_hvd.app.methods import ONLY_FOR

    by_flag = _actions_by_flag(build_parser(), "train")
    out, skip_value = [], False
    for token in argv:
        if skip_value and not token.startswith("-"):
            skip_value = False
            continue
        skip_value = False
        action = by_flag.get(token.split("=", 1)[0])
        if action is not None and action.dest in ONLY_FOR and method not in ONLY_FOR[action.dest]:
            skip_value = "=" not in token and action.nargs != 0   # its value follows, if it takes one
            continue
        out.append(token)
    return out


def _actions_by_flag(parser: argparse.ArgumentParser, command: str) -> dict:
    """{flag: its argparse action} of ``command`` (a BooleanOptionalAction's --no-X among its flags)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {flag: a for a in sub._actions for flag in a.option_strings}


def _given_flags(parser: argparse.ArgumentParser, command: str, argv) -> set:
    """The settings (argparse dests) whose flags the command line gave."""
    by_flag = {flag: a.dest for flag, a in _actions_by_flag(parser, command).items()}
    given = set()
    for token in argv:
        flag = token.split("=", 1)[0]
        matches = [f for f in by_flag if f == flag] or [f for f in by_flag if f.startswith(flag) and flag.startswith("--")]
        if len(matches) == 1:   # (argparse takes unambiguous prefixes too)
            given.add(by_flag[matches[0]])
    return given


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
