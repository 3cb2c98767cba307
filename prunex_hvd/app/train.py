"""``prunex-hvd train``: the training application around a wrapped optimizer.

One process per rank, under horovodrun, mpirun or torchrun. Each rank trains on its own disjoint shard;
the method (``--method``, see :mod:`prunex_hvd.app.methods`) does the communication. Rank 0 shows progress and
writes, in ``--out``:

* ``metrics.jsonl``: one line per round (``"event": "round"``; per epoch for methods that talk every step)
  and a last ``"event": "final"`` line for the finalized model;
* ``summary.json`` at the end, and ``final_model.pt`` (the finalized model's state dict);
* ``checkpoint.json`` + ``ckpt/`` every ``checkpoint_every`` rounds (see :mod:`prunex_hvd.app.checkpoint`).

A resumed run continues exactly where the checkpoint was taken (same batches, same RNG, same optimizer and
engine state), so on CPU it ends bit for bit where the uninterrupted run ends.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import random
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F

from ..batchnorm import recalibrate_batchnorm, restore_buffers, snapshot_buffers, tracked_batchnorms
from ..dist import comm, runtime
from ..dist.agreement import call_agreed
from ..engine.config import ConsensusConfig
from . import checkpoint, methods, models
from .methods import PRUNEX_METHODS
from .report import run_config
from .data import AUGMENTS, ShardedLoader, load_dataset


# --warmup-epochs auto: PruneX's methods warm the lr up linearly over the first two epochs, at most an eighth of the
# run so that a short one still trains mostly at its full lr; the other methods take the user's schedule as it is. A
# node's first rounds from a random start step alone on the node's batch, which diverges at ResNet-18's lr 0.05
# without it (benchmarks/log/2026-11-29-warmup-a-task-needs.md). The library leaves the lr to the user's script.
AUTO_WARMUP_EPOCHS = 2.0
AUTO_WARMUP_MAX_FRACTION = 1 / 8
# A training loss above this many times a uniform guess's, ln(classes), means the lr diverges on each worker's batch:
# ResNet-18 on digits at 8×8, lr 0.05, a node's batch of 32, no warm-up: 3.9-5.0 in the first rounds for PruneX and
# hierarchical local SGD (ln 10 = 2.30), at most 3.2 with the two-epoch warm-up (8% under the 3.45 this sets), 2.5-2.9
# for PacTrain's batch of 64 (benchmarks/log/2026-11-29-warmup-a-task-needs.md). Said once a process, on rank 0.
DIVERGING_LOSS = 1.5
# The final model's BatchNorm statistics: measured over a whole epoch, but at most this many batches a rank (a
# cumulative mean over 64 ranks' 256 batches is far past the point where it moves; an epoch of a large dataset on
# few ranks would cost a third of a training epoch in forward passes)
FINAL_BN_BATCHES = 256


@dataclass
class TrainConfig:
    """Every knob of a run: the consensus's in ``consensus`` (:class:`ConsensusConfig`, whose defaults are the
    recipe), the application's here. The trainer's schedule is in epochs: ``local_steps`` comes from
    ``local_epochs`` unless asked for.

    :meth:`from_flat` builds one from the command line's flat names (``--rho1``, ``--freeze-round 0``, ...)
    and :meth:`as_dict` writes it back flat."""
    model: str = "resnet18"
    dataset: str = "digits"                    # embedded: a run needs no download and no --data-dir
    data_dir: Optional[str] = None
    image_size: Optional[int] = None
    augment: Optional[str] = None              # train-time augmentation: cifar | shift | none (None: the dataset's)
    method: str = "prunex"
    consensus: ConsensusConfig = field(default_factory=ConsensusConfig)
    epochs: float = 10
    local_epochs: Optional[float] = 1.0        # epochs of local steps per round (None: consensus.local_steps)
    batch_size: int = 128
    test_batch_size: int = 256
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    nesterov: bool = False
    lr_schedule: str = "cosine"                # cosine | constant
    warmup_epochs: Optional[float] = None       # linear lr warm-up (None: auto, see warmup())
    topk_ratio: float = 0.01                   # topk: fraction of each layer's gradient sent per step
    topk_warmup_steps: int = 0                 # topk: dense steps first
    pactrain_score: str = "magnitude"          # pactrain: magnitude | grasp
    pactrain_patience: int = 3                 # pactrain: steps the mask must hold before compact allreduce
    pactrain_structure: str = "unstructured"   # pactrain: unstructured (the paper) | structured (PruneX's masks)
    terngrad: bool = False                     # pactrain: ternary gradients with a shared scale
    hier_intra_steps: Optional[int] = None     # localsgd-hier: steps between node averages (divides the round)
    diloco_outer_lr: float = 0.7               # diloco: the outer Nesterov SGD's lr and momentum (the paper's)
    diloco_outer_momentum: float = 0.9
    ranks_per_node: Optional[int] = None
    nodes_per_rack: Optional[int] = None
    timeout: Optional[float] = None            # s a collective may wait before the job stops naming who is missing
    elastic: bool = False                      # a lost node costs a round, not the job (horovodrun elastic mode)
    min_nodes: int = 1                         # elastic: fewer nodes left than this stops the job
    seed: int = 0
    out: str = "runs/run"
    checkpoint_every: int = 1                  # rounds; 0: only at the end of a --stop-after-rounds slice
    resume: bool = False
    stop_after_rounds: Optional[int] = None    # a time-boxed slice: checkpoint and stop after this many more rounds
    eval_every: int = 1                        # rounds
    bn_recalibrate: int = 8                    # training batches per rank the evaluated model's BatchNorm statistics
                                               # are measured again on, a whole epoch (at most FINAL_BN_BATCHES)
                                               # for the final model (0: the round's own statistics)
    threads: Optional[int] = None
    device: str = "auto"                       # auto: this rank's GPU (local rank) when CUDA is there, else cpu
    progress: bool = True                      # a progress bar on rank 0, when its standard error is a terminal
    extra: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_flat(cls, **flat) -> "TrainConfig":
        """From flat names, the command line's: the consensus's knobs go into ``consensus`` (on
        :class:`ConsensusConfig`'s defaults, or :meth:`ConsensusConfig.paper`'s with ``paper=True``, which also
        has no lr warm-up unless one is asked for); ``local_steps=N`` asks for N steps a round instead of
        ``local_epochs``; ``warmup_epochs`` is ``"auto"`` (None: :data:`AUTO_WARMUP_EPOCHS` for PruneX's methods,
        0 for the others) or a number of epochs."""
        if flat.get("warmup_epochs") == "auto":
            flat["warmup_epochs"] = None
        paper = flat.pop("paper", False)
        if paper and flat.get("warmup_epochs") is None:
            flat["warmup_epochs"] = 0.0
        base = ConsensusConfig.paper() if paper else ConsensusConfig()
        knobs = {k: flat.pop(k) for k in ConsensusConfig.knob_names() if k in flat}
        if knobs.get("local_steps", 0) is None:
            del knobs["local_steps"]   # not asked for: local_epochs decides
        elif "local_steps" in knobs:
            flat["local_epochs"] = None
        return cls(consensus=ConsensusConfig.from_knobs(knobs, base=base, who="TrainConfig"), **flat)

    def as_dict(self) -> Dict[str, Any]:
        """Flat, as :meth:`from_flat` reads it (what ``config.json`` and the summary hold)."""
        out = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "consensus"}
        return dict(out, **copy.deepcopy(self.consensus.knobs()))

    def resolved(self, steps_per_epoch: int) -> "TrainConfig":
        """The schedule in steps: the consensus's ``local_steps`` from ``local_epochs`` (where it is not None), and
        ``warmup_epochs`` None as the method's own (:meth:`warmup`)."""
        c = self.consensus
        local_steps = c.local_steps if self.local_epochs is None else max(1, round(self.local_epochs * steps_per_epoch))
        return dataclasses.replace(self, warmup_epochs=self.warmup(),
                                   consensus=dataclasses.replace(c, local_steps=local_steps))

    def warmup(self) -> float:
        """Epochs of linear lr warm-up: as asked, or with None (auto) :data:`AUTO_WARMUP_EPOCHS` for PruneX's
        methods, at most :data:`AUTO_WARMUP_MAX_FRACTION` of the run, and 0 for the others (their users' schedule
        unchanged)."""
        if self.warmup_epochs is not None:
            return self.warmup_epochs
        if self.method not in PRUNEX_METHODS:
            return 0.0
        return min(AUTO_WARMUP_EPOCHS, AUTO_WARMUP_MAX_FRACTION * self.epochs)

    def validate(self) -> None:
        for name in ("epochs", "lr"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        v = self.local_epochs
        if not (v is None or (isinstance(v, (int, float)) and math.isfinite(v) and v > 0)):
            raise ValueError(f"local_epochs must be None or a finite number > 0, got {v!r}")
        if not isinstance(self.consensus, ConsensusConfig):
            raise ValueError(f"consensus must be a ConsensusConfig, got {type(self.consensus).__name__}")
        for name in ("batch_size", "test_batch_size", "eval_every"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if isinstance(self.bn_recalibrate, bool) or not isinstance(self.bn_recalibrate, int) \
                or self.bn_recalibrate < 0:
            raise ValueError(f"bn_recalibrate must be an int >= 0 (training batches per rank; 0: off), got "
                             f"{self.bn_recalibrate!r}")
        if self.augment is not None and self.augment not in AUGMENTS:
            raise ValueError(f"augment must be one of {', '.join(AUGMENTS)} (or None: the dataset's), got "
                             f"{self.augment!r}")
        if self.lr_schedule not in ("cosine", "constant"):
            raise ValueError(f"lr_schedule must be 'cosine' or 'constant', got {self.lr_schedule!r}")
        warmup = self.warmup_epochs
        if not (warmup is None or (isinstance(warmup, (int, float)) and math.isfinite(warmup) and warmup >= 0)):
            raise ValueError(f"warmup_epochs must be None (auto) or a finite number >= 0, got {warmup!r}")
        if self.momentum < 0 or self.weight_decay < 0:
            raise ValueError("momentum and weight_decay must be >= 0")
        if self.consensus.rho_max == "auto" and self.momentum >= 1 and self.method in PRUNEX_METHODS:
            raise ValueError(f"--rho-max auto caps rho by the lr and momentum's gain 1/(1 - momentum), which needs "
                             f"momentum < 1 (got {self.momentum!r}): pass --rho-max N")
        if isinstance(self.min_nodes, bool) or not isinstance(self.min_nodes, int) or self.min_nodes < 1:
            raise ValueError(f"min_nodes must be an integer >= 1, got {self.min_nodes!r}")
        if self.elastic and self.method not in PRUNEX_METHODS:
            raise ValueError(f"elastic training runs PruneX (prunex, prunex-flat), not {self.method!r}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every!r}")
        if self.stop_after_rounds is not None and self.stop_after_rounds < 1:
            raise ValueError(f"stop_after_rounds must be >= 1, got {self.stop_after_rounds!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.method not in methods.METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose from {', '.join(methods.METHODS)}")
        structured_pactrain = self.method == "pactrain" and self.pactrain_structure == "structured"
        if self.consensus.coupled and self.method not in PRUNEX_METHODS and not structured_pactrain:
            raise ValueError(f"--coupled is a PruneX option (prunex, prunex-flat; pactrain with --pactrain-structure "
                             f"structured), not one of {self.method!r}")


def loss_diverges(loss: float, num_classes: int) -> bool:
    """Whether a round's mean training loss says the lr diverges: above DIVERGING_LOSS × ln(classes), or not
    finite."""
    return not loss <= DIVERGING_LOSS * math.log(num_classes)   # NaN compares False


def _lr_factor(cfg: TrainConfig, steps_per_epoch: int):
    """The scheduler's factor at each step: a linear warm-up, then cosine (or constant) to the end."""
    total = max(1, round(cfg.epochs * steps_per_epoch))
    warmup = round(cfg.warmup() * steps_per_epoch)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.lr_schedule == "constant":
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return factor


def _set_threads(requested: Optional[int], control) -> int:
    """Share the host's cores among the ranks on it (emulated nodes put several ranks on one host)."""
    if requested is None:
        hosts = control.allgather_object(socket.gethostname())
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        requested = max(1, cores // hosts.count(socket.gethostname()))
    torch.set_num_threads(requested)
    return requested


def _pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but CUDA is not available on this host")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def evaluate_recalibrated(model: torch.nn.Module, test_loader: ShardedLoader, train_loader: ShardedLoader,
                          num_batches: int, world, control, keep: bool = False) -> Dict[str, float]:
    """The model's accuracy with its BatchNorm statistics measured again on ``num_batches`` training batches per
    rank (:func:`prunex_hvd.batchnorm.recalibrate_batchnorm`), and as it came (``*_no_recal``). The statistics are
    put back unless ``keep``. Without ``world`` (0 batches, or no BatchNorm), the plain evaluation."""
    if world is None:
        return evaluate(model, test_loader, control)
    came = evaluate(model, test_loader, control)
    saved = None if keep else snapshot_buffers(model)
    try:
        recalibrate_batchnorm(model, train_loader.batches(), num_batches, world)
        result = evaluate(model, test_loader, control)
    finally:   # training goes on with the round's statistics, even after an error here
        if saved is not None:
            restore_buffers(model, saved)
    return dict(result, test_acc_no_recal=came["test_acc"], test_loss_no_recal=came["test_loss"])


def evaluate(model: torch.nn.Module, loader: ShardedLoader, control) -> Dict[str, float]:
    """Accuracy and loss over the whole test set: each rank scores its shard, the control plane sums."""
    was_training = model.training
    model.eval()
    correct, loss_sum, count = 0, 0.0, 0
    with torch.no_grad():
        for x, y in loader.batches():
            out = model(x)
            loss_sum += float(F.cross_entropy(out, y, reduction="sum"))
            correct += int((out.argmax(1) == y).sum())
            count += len(y)
    model.train(was_training)
    parts = control.allgather_object((correct, loss_sum, count))
    n = sum(p[2] for p in parts)
    return {"test_acc": sum(p[0] for p in parts) / n, "test_loss": sum(p[1] for p in parts) / n}


class _MetricsLog:
    """Rank 0 appends JSON lines; on resume, lines past the checkpoint are dropped first."""

    def __init__(self, path: str, enabled: bool, keep_steps_upto: Optional[int]):
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        lines: List[str] = []
        if keep_steps_upto is not None and os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except ValueError:   # a line cut short by the kill that made us resume
                        continue
                    if rec.get("event") == "round" and rec["step"] <= keep_steps_upto:
                        lines.append(line)
        checkpoint.atomic_write_bytes(path, lambda f: f.write("".join(lines).encode()))

    @classmethod
    def appending(cls, path: str, enabled: bool) -> "_MetricsLog":
        """A log that appends to ``path`` as it stands (elastic training: a new rank 0 after a change of nodes)."""
        log = cls.__new__(cls)
        log.path, log.enabled = path, enabled
        return log

    def write(self, record: Dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


# The settings removed from the run's config (benchmarks/log/removed-knobs.md) at the value that meant "off": a run's
# config.json from before holds them all, and a resume or a --config of it means nothing else where they are off.
REMOVED_OFF = {"relaxation": 1.0, "rho_growth": 1.0, "keep_ramp_rounds": 0, "rho2_release_round": None,
               "acceleration": "none", "keep_start_norm": False, "sync_rounds": 0, "sync_powersgd_rank": 0,
               "overlap_after_freeze": True, "overlap_steps": None, "weight_decay_z": 0.0, "budget_floor": 0.1,
               "balance_rho2": True, "retrain": "admm", "masked_retrain": True, "compact_compute": True,
               "freeze_fraction": None, "ramp_fraction": None, "release_fraction": None, "round_pull": 1.0}
REMOVED_ANY = ("outer_momentum",)   # meant nothing without its knob (acceleration)


def removed_settings(settings: Dict[str, Any]) -> List[str]:
    """The removed settings in ``settings`` (a run's flat config) that were not off, as ``"name value"`` (a
    ``round_pull`` of None is a ``rho_max`` number, which says the same)."""
    return [f"{k} {v!r}" for k, v in settings.items()
            if k in REMOVED_OFF and v != REMOVED_OFF[k] and not (k == "round_pull" and v is None)]


# what only says how this launch runs, not what the job computes: free to change between a run's slices
_LAUNCH_SETTINGS = frozenset({"out", "resume", "stop_after_rounds", "checkpoint_every", "threads", "timeout", "progress",
                              "data_dir"})


def changed_settings(began: Dict[str, Any], now: Dict[str, Any]) -> List[str]:
    """The settings a resumed run changes from the run's so far (both :meth:`TrainConfig.as_dict`; knobs the
    earlier run did not have are left out), as ``"knob old -> new"``. The checkpoint refuses another job (model,
    data, ranks, ...) and takes these, but a default that moved between versions (``freeze_round``) would
    otherwise change the run without a word."""
    now = json.loads(json.dumps(now))   # as config.json holds it (tuples as lists)
    gone = set(REMOVED_OFF) | set(REMOVED_ANY)   # (removed_settings says which of those were on)
    return [f"{k} {began[k]!r} -> {now.get(k)!r}" for k in sorted(began)
            if k not in _LAUNCH_SETTINGS and k not in gone and began[k] != now.get(k)]


_BYTE_KEYS = ("inter_bytes", "intra_bytes", "dense_inter_bytes", "cross_rack_bytes")


def _job_totals(control, stats: Dict[str, Any]) -> Dict[str, int]:
    rows = control.allgather_object([int(stats.get(k, 0)) for k in _BYTE_KEYS])
    return {k: sum(r[i] for r in rows) for i, k in enumerate(_BYTE_KEYS)}


def train(cfg: TrainConfig) -> Dict[str, Any]:
    """Run (or resume) a training job. Collective: every rank calls it with the same config. Returns the
    summary on every rank (``{"stopped_after_round": K}`` when a ``stop_after_rounds`` slice ended)."""
    import prunex_hvd as px
    from tqdm import tqdm

    cfg.validate()
    if cfg.elastic:
        raise ValueError("elastic=True runs in prunex_hvd.app.elastic_train.train_elastic (prunex-hvd train --elastic)")
    topo = px.init(backend=cfg.consensus.backend, ranks_per_node=cfg.ranks_per_node, timeout=cfg.timeout,
                   nodes_per_rack=cfg.nodes_per_rack)
    _, control = runtime.state()
    threads = _set_threads(cfg.threads, control)
    rank, is_main = topo.rank, topo.rank == 0
    device = call_agreed(control, _pick_device, cfg.device, topo.local_rank)
    if not cfg.resume:   # refuse before any data, model or collective set-up is paid for
        exists = os.path.exists(os.path.join(cfg.out, "metrics.jsonl")) if is_main else None
        control.agree(f"{cfg.out} already holds a run: pass --resume to continue it, or choose another --out"
                      if control.broadcast_object(exists, root=0) else None, ValueError)

    data = call_agreed(control, load_dataset, cfg.dataset, data_dir=cfg.data_dir,
                   image_size=cfg.image_size or models.default_image_size(cfg.model), seed=cfg.seed)
    if cfg.augment is not None:
        data.augment = cfg.augment
    torch.manual_seed(cfg.seed)
    model = call_agreed(control, models.build, cfg.model, num_classes=data.num_classes, in_channels=data.in_channels)
    model.to(device)
    train_loader = call_agreed(control, ShardedLoader, data, cfg.batch_size, rank, topo.size, seed=cfg.seed, train=True,
                           device=device)
    test_loader = ShardedLoader(data, cfg.test_batch_size, rank, topo.size, seed=cfg.seed, train=False, device=device)
    steps_per_epoch = len(train_loader)
    auto_warmup = cfg.warmup_epochs is None   # resolved() sets it
    cfg = cfg.resolved(steps_per_epoch)
    local_steps = cfg.consensus.local_steps
    total_steps = max(1, round(cfg.epochs * steps_per_epoch))

    base = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                           nesterov=cfg.nesterov)
    train_loader.set_epoch(0)
    opt = call_agreed(control, methods.wrap, cfg.method, base, model, cfg,
                      sample_batch=lambda: next(iter(train_loader.batches())))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_factor(cfg, steps_per_epoch))
    bn_world = comm.groups().world if cfg.bn_recalibrate and tracked_batchnorms(model) else None   # collective

    def scored(num_batches: int, keep: bool = False) -> Dict[str, float]:
        return evaluate_recalibrated(model, test_loader, train_loader, num_batches, bn_world, control, keep)
    if is_main and auto_warmup and cfg.warmup_epochs > 0:   # said once the job is known to be sound
        logging.getLogger("prunex_hvd").info(
            "%s: the lr warms up linearly to %g over the first %g epoch(s) (--warmup-epochs auto; 0 turns it off)",
            cfg.method, cfg.lr, cfg.warmup_epochs)

    meta = {"model": cfg.model, "dataset": cfg.dataset, "method": cfg.method, "sparsity": str(cfg.consensus.sparsity),
            "coupled": cfg.consensus.coupled, "world_size": topo.size, "num_nodes": topo.num_nodes,
            "ranks_per_node": topo.local_size, "batch_size": cfg.batch_size, "local_steps": local_steps,
            "seed": cfg.seed, "warmup_epochs": cfg.warmup_epochs}   # (another warm-up would bend the lr schedule)
    os.makedirs(cfg.out, exist_ok=True)
    step, wall_offset, resumed = 0, 0.0, False
    if cfg.resume:
        state = checkpoint.load(cfg.out, meta, rank, control)
        gone = removed_settings(run_config(cfg.out) or {}) if is_main and state is not None else []
        control.agree(f"{cfg.out} was started with {', '.join(gone)}, which this version no longer has "
                      f"(benchmarks/log/removed-knobs.md): resume it with the version that started it"
                      if gone else None, ValueError)
        if state is not None:
            model.load_state_dict(state["model"])   # copies into the tensors on `device`
            opt.load_state_dict(state["optimizer"])
            sched.load_state_dict(state["scheduler"])
            torch.set_rng_state(state["rng"]["torch"])
            random.setstate(state["rng"]["python"])
            np.random.set_state(state["rng"]["numpy"])
            step, wall_offset, resumed = int(state["step"]), float(state["wall_s"]), True
            changed = changed_settings(run_config(cfg.out) or {}, cfg.as_dict()) if is_main else []
            if changed:
                logging.getLogger("prunex_hvd").warning(
                    "resumed with settings other than the run's so far (its config.json): %s", "; ".join(changed))
    log = _MetricsLog(os.path.join(cfg.out, "metrics.jsonl"), is_main, step if resumed else None)
    if is_main:
        checkpoint.atomic_write_json(os.path.join(cfg.out, "config.json"),
                                     {"config": cfg.as_dict(), "meta": meta, "threads_per_rank": threads,
                                      "launcher": topo.launcher, "topology_grouping": topo.grouping})

    def save_checkpoint(tag: int) -> None:
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                 "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
                 "step": step, "wall_s": wall}
        checkpoint.save(cfg.out, tag, state, meta, rank, control)

    def record(stats: Dict[str, Any], running: Dict[str, float], with_eval: bool) -> Dict[str, Any]:
        parts = control.allgather_object((float(running["loss"]), int(running["correct"]), running["count"]))
        n = max(1, sum(p[2] for p in parts))
        rec = {"event": "round", "method": cfg.method, "round": stats["rounds"], "step": step,
               "epoch": step / steps_per_epoch, "wall_s": wall, "lr": sched.get_last_lr()[0],
               "train_loss": sum(p[0] for p in parts) / n, "train_acc": sum(p[1] for p in parts) / n,
               "test_acc": None, "test_loss": None}
        if with_eval:
            with opt.consensus_weights():
                rec.update(scored(cfg.bn_recalibrate))
        rec.update(_job_totals(control, stats))
        for key in ("density", "layer_density", "residuals", "rho", "mask_drift", "frozen", "exchange_wait_s"):
            if key in stats:
                rec[key] = stats[key]
        log.write(rec)
        return rec

    model.train()
    bar = tqdm(total=total_steps, initial=step, disable=not (cfg.progress and is_main and sys.stderr.isatty()),
               unit="step",
               dynamic_ncols=True, mininterval=0.5, desc=f"{cfg.method} {cfg.model}")

    def zero() -> Dict[str, Any]:   # summed on the device: no host sync per step
        return {"loss": torch.zeros((), device=device), "correct": torch.zeros((), dtype=torch.long, device=device),
                "count": 0}
    running = zero()
    last = {"test_acc": None, "inter_bytes": 0, "density": opt.stats().get("density", 1.0)}
    t_start, wall = time.perf_counter(), wall_offset
    rounds_seen = rounds_at_start = opt.rounds_done()
    per_epoch = opt.records_per_epoch   # methods that talk every step log once an epoch
    stopped = None
    warned_diverging = False
    while step < total_steps and stopped is None:
        epoch, start_batch = divmod(step, steps_per_epoch)
        train_loader.set_epoch(epoch)
        for x, y in train_loader.batches(start=start_batch):
            opt.zero_grad()   # set_to_none by default; Horovod 0.28 takes no argument
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            running["loss"] += loss.detach() * len(y)
            running["correct"] += (out.argmax(1) == y).sum()
            running["count"] += len(y)
            if step == total_steps and not per_epoch and opt.rounds_done() == rounds_seen and step % local_steps:
                opt.consensus()   # the last local steps join the consensus the final model is made of
            if (per_epoch and step % steps_per_epoch == 0) or (not per_epoch and opt.rounds_done() != rounds_seen) \
                    or step == total_steps:
                stats = opt.stats()   # not every step: it sums masks and residuals per layer
                rounds_seen = stats["rounds"]
                wall = wall_offset + time.perf_counter() - t_start
                with_eval = rounds_seen % cfg.eval_every == 0 or step == total_steps
                rec = record(stats, running, with_eval)
                running = zero()
                if is_main and not warned_diverging and loss_diverges(rec["train_loss"], data.num_classes):
                    warned_diverging = True
                    logging.getLogger("prunex_hvd").warning(
                        "epoch %.2f: training loss %.3g, above %g x a uniform guess's loss (ln %d = %.2f): the lr "
                        "(%g now, peak %g, --warmup-epochs %g) diverges on each worker's batch; warm it up longer or "
                        "lower it", rec["epoch"], rec["train_loss"], DIVERGING_LOSS, data.num_classes,
                        math.log(data.num_classes), rec["lr"], cfg.lr, cfg.warmup_epochs)
                last.update({k: rec[k] for k in ("test_acc", "inter_bytes", "density") if rec.get(k) is not None})
                if cfg.checkpoint_every and rounds_seen and rounds_seen % cfg.checkpoint_every == 0:
                    save_checkpoint(step)
                if cfg.stop_after_rounds is not None and step < total_steps \
                        and rounds_seen - rounds_at_start >= cfg.stop_after_rounds:
                    if not (cfg.checkpoint_every and rounds_seen % cfg.checkpoint_every == 0):
                        save_checkpoint(step)
                    stopped = rounds_seen
                t_start, wall_offset = time.perf_counter(), wall  # eval and checkpoints are not training time
            bar.update(1)
            if bar.n % 10 == 0 or step == total_steps:
                bar.set_postfix(epoch=f"{step / steps_per_epoch:.1f}", loss=f"{float(loss.detach()):.3f}",
                                acc="-" if last["test_acc"] is None else f"{100 * last['test_acc']:.1f}%",
                                density=f"{last['density']:.2f}",
                                inter_MB=f"{last['inter_bytes'] / 2**20:.1f}", refresh=False)
            if stopped is not None or step >= total_steps:
                break
    bar.close()
    if stopped is not None:
        if is_main:
            print(f"stopped after round {stopped} (step {step}/{total_steps}); continue with --resume --out {cfg.out}")
        return {"stopped_after_round": stopped, "step": step}

    opt.finalize()
    # the final model keeps statistics measured for its own weights, over a whole epoch: 8 batches a rank cost the
    # end 0.07-0.14 points on digits and 0.14-0.56 on ResNet-18 (benchmarks/log/2026-11-29-bn-recalibrate.md), an
    # epoch nothing
    final = scored(min(steps_per_epoch, FINAL_BN_BATCHES), keep=True)
    stats = opt.stats()
    totals = _job_totals(control, stats)
    params_total = sum(p.numel() for p in model.parameters())
    params_nonzero = sum(int(torch.count_nonzero(p)) for p in model.parameters())
    summary = {"name": os.path.basename(os.path.normpath(cfg.out)), "method": cfg.method, "model": cfg.model,
               "dataset": cfg.dataset, "sparsity": str(cfg.consensus.sparsity), "world_size": topo.size,
               "num_nodes": topo.num_nodes, "ranks_per_node": topo.local_size, "launcher": topo.launcher,
               "num_racks": topo.num_racks if topo.rack_nodes else None,
               "backend": runtime.default_backend(), "epochs": cfg.epochs, "rounds": stats["rounds"],
               "steps": step, "local_steps": local_steps, "final_test_acc": final["test_acc"],
               "final_test_loss": final["test_loss"], "density": stats.get("density", 1.0),
               **{f"final_{k}": final[k] for k in ("test_acc_no_recal", "test_loss_no_recal") if k in final},
               "layer_density": stats.get("layer_density", {}), **totals, "wall_s": wall,
               "exchange_wait_s": stats.get("exchange_wait_s"),
               "params_total": params_total, "params_nonzero": params_nonzero, "args": cfg.as_dict()}
    log.write({"event": "final", "method": cfg.method, "round": stats["rounds"], "step": step,
               "epoch": step / steps_per_epoch, "wall_s": wall, **final, **totals,
               "density": summary["density"], "layer_density": summary["layer_density"]})
    if is_main:
        write_results(cfg, model, data, summary)
    return summary


def write_results(cfg: TrainConfig, model: torch.nn.Module, data, summary: Dict[str, Any]) -> None:
    """``final_model.pt`` (the finalized model, its state dict on CPU: it loads anywhere) and ``summary.json``,
    atomically, into the run folder."""
    checkpoint.atomic_torch_save(os.path.join(cfg.out, "final_model.pt"),
                                 {"model": cfg.model,
                                  "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                                  "sparsity": str(cfg.consensus.sparsity), "num_classes": data.num_classes,
                                  "in_channels": data.in_channels, "image_size": data.image_size,
                                  "dataset": cfg.dataset})
    checkpoint.atomic_write_json(os.path.join(cfg.out, "summary.json"), summary)
