"""``prunex-hvd train --elastic``: the training job of :mod:`.train` as elastic training (:mod:`prunex_hvd.elastic`).

Under ``horovodrun``'s elastic mode a lost node costs the round in progress, not the job, and a node that comes
back joins at the next round; under ``torchrun`` its agent restarts the workers, which go on from their node's
commits; under any other launch the job runs once and a lost rank ends it (fail-fast, then ``--resume``). What
differs from :func:`.train.train`:

* **Data by a cursor.** Each epoch has one order of the whole training set (:meth:`ShardedLoader.permutation`);
  the job keeps a cursor, the samples of the epoch it has consumed, and each step rank r of W takes the r-th block
  of ``batch_size`` after it. The cursor is committed with the model, so after a change of nodes the ranks there
  are now split what is left of the epoch: nothing is skipped, and the steps a loss undid are taken again.
* **The lr by epoch.** The schedule (warm-up, cosine) is a function of the epochs done, cursor included, since the
  steps per epoch change with the number of ranks; ``local_steps`` stays as the starting ranks resolved it.
* **A commit every round** (:meth:`prunex_hvd.elastic.State.commit`) after its metrics line, and a checkpoint every
  ``checkpoint_every`` rounds over the ranks there are then; ``--resume`` continues one with as many ranks, nodes
  and ranks per node as wrote it. ``metrics.jsonl`` gets a ``nodes`` line for every change.
"""
from __future__ import annotations

import logging
import math
import os
import random
import time
from typing import Any, Dict

import numpy as np
import torch
import torch.nn.functional as F

from .. import elastic
from ..batchnorm import tracked_batchnorms
from ..dist import comm, runtime, watchdog
from . import checkpoint, methods, models
from .data import ShardedLoader, load_dataset
from .methods import PRUNEX_METHODS
from .train import (FINAL_BN_BATCHES, TrainConfig, _MetricsLog, _job_totals, _pick_device, evaluate_recalibrated,
                    write_results)

log = logging.getLogger("prunex_hvd")


def lr_at(cfg: TrainConfig, epochs_done: float) -> float:
    """The lr after ``epochs_done`` epochs: a linear warm-up over ``cfg.warmup_epochs``, then cosine (or constant)."""
    warmup = cfg.warmup_epochs
    if epochs_done < warmup:
        return cfg.lr * min(1.0, (epochs_done + 1e-12) / warmup)
    if cfg.lr_schedule == "constant":
        return cfg.lr
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (epochs_done - warmup) / max(1e-12, cfg.epochs - warmup))))


def train_elastic(cfg: TrainConfig) -> Dict[str, Any]:
    """Run (or ``--resume``) ``cfg`` as elastic training; returns the summary on every rank."""
    import prunex_hvd as px

    if cfg.method not in PRUNEX_METHODS:
        raise ValueError(f"--elastic trains PruneX (prunex, prunex-flat), not {cfg.method!r}")
    if cfg.stop_after_rounds is not None:
        raise ValueError("--stop-after-rounds with --elastic: an elastic job runs to its end (checkpoints every "
                         "--checkpoint-every rounds)")
    if runtime.elastic_launch() and (cfg.ranks_per_node or cfg.nodes_per_rack):
        raise ValueError("--ranks-per-node / --nodes-per-rack under horovodrun's elastic mode: the hosts are the "
                         "nodes, and racks are not elastic")
    if cfg.timeout is not None:   # every change of nodes forms the job again, with the timeout the env gives
        os.environ[watchdog.ENV_TIMEOUT] = str(cfg.timeout)
    elastic.join_rendezvous()   # before the data and the model: the ranks already training wait for this one
    if not runtime.elastic_launch():   # fail-fast: the job is formed once, now
        px.init(backend=cfg.consensus.backend, ranks_per_node=cfg.ranks_per_node, timeout=cfg.timeout,
                nodes_per_rack=cfg.nodes_per_rack)
    local_rank = int(os.environ.get("HOROVOD_LOCAL_RANK", os.environ.get("LOCAL_RANK", 0)))
    device = _pick_device(cfg.device, local_rank)
    ranks_here = os.environ.get("HOROVOD_LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", 1))   # horovodrun, torchrun
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // int(ranks_here)))
    data = load_dataset(cfg.dataset, data_dir=cfg.data_dir,
                        image_size=cfg.image_size or models.default_image_size(cfg.model), seed=cfg.seed)
    if cfg.augment is not None:
        data.augment = cfg.augment
    torch.manual_seed(cfg.seed)
    model = models.build(cfg.model, num_classes=data.num_classes, in_channels=data.in_channels).to(device)
    n_train = len(data.train_y)
    start_ranks = int(os.environ.get("HOROVOD_SIZE", 0)) or runtime.topology().size
    cfg = cfg.resolved(max(1, n_train // (start_ranks * cfg.batch_size)))
    base = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                           nesterov=cfg.nesterov)
    opt = methods.wrap(cfg.method, base, model, cfg)
    state = elastic.State(model, opt, min_nodes=cfg.min_nodes, epoch=0, cursor=0, step=0, wall=0.0)
    os.makedirs(cfg.out, exist_ok=True)
    perms: Dict[int, torch.Tensor] = {}

    @elastic.run
    def job(state: elastic.State) -> Dict[str, Any]:
        topo = px.topology()
        control = runtime.state()[1]
        is_main, first = topo.rank == 0, state.changes[-1]["fresh"]   # the job's first forming
        B, W = cfg.batch_size, topo.size
        view = ShardedLoader(data, B, topo.rank, W, seed=cfg.seed, train=True, device=device)
        test_loader = ShardedLoader(data, cfg.test_batch_size, topo.rank, W, seed=cfg.seed, train=False, device=device)
        bn_world = comm.groups().world if cfg.bn_recalibrate and tracked_batchnorms(model) else None
        meta = {"model": cfg.model, "dataset": cfg.dataset, "method": cfg.method,
                "sparsity": str(cfg.consensus.sparsity), "coupled": cfg.consensus.coupled, "world_size": W,
                "num_nodes": topo.num_nodes, "ranks_per_node": topo.local_size, "batch_size": B,
                "local_steps": opt.local_steps, "seed": cfg.seed, "warmup_epochs": cfg.warmup_epochs,
                "elastic": True}
        keep_upto = None
        if first:
            exists = os.path.exists(os.path.join(cfg.out, "metrics.jsonl")) if is_main else None
            control.agree(None if cfg.resume or not control.broadcast_object(exists, root=0) else
                          f"{cfg.out} already holds a run: pass --resume to continue it, or choose another --out",
                          ValueError)
            saved = checkpoint.load(cfg.out, meta, topo.rank, control) if cfg.resume else None
            if saved is not None:
                model.load_state_dict(saved["model"])
                opt.load_state_dict(saved["optimizer"])
                for name, value in saved["values"].items():
                    setattr(state, name, value)
                torch.set_rng_state(saved["rng"]["torch"])
                random.setstate(saved["rng"]["python"])
                np.random.set_state(saved["rng"]["numpy"])
                keep_upto = state.step
                state.save()
            if is_main:
                checkpoint.atomic_write_json(os.path.join(cfg.out, "config.json"),
                                             {"config": cfg.as_dict(), "meta": meta, "launcher": topo.launcher,
                                              "topology_grouping": topo.grouping})
        path = os.path.join(cfg.out, "metrics.jsonl")
        metrics = _MetricsLog(path, is_main, keep_upto) if first else _MetricsLog.appending(path, is_main)
        if not first:
            metrics.write({"event": "nodes", "step": state.step, **state.changes[-1]})

        def scored(num_batches: int, keep: bool = False) -> Dict[str, float]:
            return evaluate_recalibrated(model, test_loader, view, num_batches, bn_world, control, keep)

        running = [0.0, 0, 0]   # loss sum, correct, count since the last round
        t0 = time.perf_counter()
        model.train()
        while state.epoch + state.cursor / n_train < cfg.epochs:
            if state.cursor + W * B > n_train:   # the epoch's last partial step is dropped
                state.epoch, state.cursor = state.epoch + 1, 0
                continue
            if state.epoch not in perms:
                perms.clear()
                perms[state.epoch] = view.permutation(state.epoch)
            at = state.cursor + topo.rank * B
            x, y = view.batch_of(perms[state.epoch][at:at + B], state.epoch, (state.cursor, topo.rank))
            for group in opt.param_groups:
                group["lr"] = lr_at(cfg, state.epoch + state.cursor / n_train)
            opt.zero_grad()
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            before = opt.rounds_done()
            opt.step()
            state.cursor += W * B
            state.step += 1
            running[0] += float(loss.detach()) * len(y)
            running[1] += int((out.argmax(1) == y).sum())
            running[2] += len(y)
            ends_epoch = state.cursor + W * B > n_train   # (the next step starts the next epoch)
            last = state.epoch + (1 if ends_epoch else state.cursor / n_train) >= cfg.epochs
            if last and opt.rounds_done() == before and opt.stats()["steps"] % opt.local_steps:
                opt.consensus()   # the last local steps join the consensus the final model is made of
            if opt.rounds_done() == before:
                continue
            state.wall += time.perf_counter() - t0
            parts = control.allgather_object(tuple(running))
            n = max(1, sum(p[2] for p in parts))
            rec = {"event": "round", "method": cfg.method, "round": opt.rounds_done(), "step": state.step,
                   "epoch": state.epoch + state.cursor / n_train, "wall_s": state.wall, "ranks": W,
                   "nodes": topo.num_nodes, "lr": opt.param_groups[0]["lr"],
                   "train_loss": sum(p[0] for p in parts) / n, "train_acc": sum(p[1] for p in parts) / n,
                   "test_acc": None, "test_loss": None}
            if opt.rounds_done() % cfg.eval_every == 0 or last:
                with opt.consensus_weights():
                    rec.update(scored(cfg.bn_recalibrate))
            stats = opt.stats()
            rec.update(_job_totals(control, stats), density=stats["density"], frozen=stats["frozen"])
            metrics.write(rec)
            running = [0.0, 0, 0]
            if cfg.checkpoint_every and opt.rounds_done() % cfg.checkpoint_every == 0:
                checkpoint.save(cfg.out, state.step, {
                    "model": model.state_dict(), "optimizer": opt.state_dict(),
                    "values": {k: getattr(state, k) for k in ("epoch", "cursor", "step", "wall")},
                    "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                            "numpy": np.random.get_state()}}, meta, topo.rank, control)
            state.commit()   # (raises when hosts were added: the round is logged and saved first)
            t0 = time.perf_counter()

        opt.finalize()
        final = scored(min(len(view), FINAL_BN_BATCHES), keep=True)
        stats = opt.stats()
        totals = _job_totals(control, stats)
        summary = {"name": os.path.basename(os.path.normpath(cfg.out)), "method": cfg.method, "model": cfg.model,
                   "dataset": cfg.dataset, "sparsity": str(cfg.consensus.sparsity), "world_size": W,
                   "num_nodes": topo.num_nodes, "ranks_per_node": topo.local_size, "launcher": topo.launcher,
                   "backend": runtime.default_backend(), "epochs": cfg.epochs, "rounds": stats["rounds"],
                   "steps": state.step, "local_steps": opt.local_steps,
                   "final_test_acc": final["test_acc"], "final_test_loss": final["test_loss"],
                   "density": stats["density"], **totals, "wall_s": state.wall, "elastic_changes": state.changes,
                   "args": cfg.as_dict()}
        metrics.write({"event": "final", "method": cfg.method, "round": stats["rounds"], "step": state.step,
                       "epoch": cfg.epochs, "wall_s": state.wall, **final, **totals, "density": stats["density"]})
        if is_main:
            write_results(cfg, model, data, summary)
        return summary

    return job(state)


__all__ = ["train_elastic", "lr_at"]
