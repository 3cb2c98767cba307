"""BatchNorm statistics for the model as it is now: the consensus model, or the pruned model at the end.

A round-based method's consensus model (PruneX's z, local SGD's average) carries BatchNorm running statistics
averaged from what each rank measured on *its own* weights during the round. Those are not the statistics of
the consensus weights: after a projection cuts half the channels, or when the ranks drifted apart, the mismatch
alone can put a model that classifies well at chance (digits, the recipe after round 1: 14% with the round's
statistics, 17% recalibrated; round 2: 34% against 51%). :func:`recalibrate_batchnorm` measures them again on
a few training batches with the weights held (``torch.optim.swa_utils.update_bn``'s pass, the SWA recipe), then
averages them over the ranks so that every rank holds the same model.

Exactly: with ``momentum=None`` a BatchNorm layer's running mean and variance are the plain means over the
batches it saw of each batch's mean and (unbiased) variance. Every rank sums its own, weighted by its batch
count, and the world's sum over the world's count is what one process would hold after all the ranks' batches
(tests/app/test_batchnorm.py checks it against that single-process reference).
"""
from __future__ import annotations

import itertools
from typing import Iterable, List

import torch
from torch.optim.swa_utils import update_bn

from .dist import comm, runtime


def tracked_batchnorms(model: torch.nn.Module) -> List[torch.nn.modules.batchnorm._BatchNorm]:
    """The BatchNorm layers that keep running statistics: what :func:`recalibrate_batchnorm` measures."""
    return [m for m in model.modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


def recalibrate_batchnorm(model: torch.nn.Module, batches: Iterable, num_batches: int, world="auto") -> int:
    """Re-measure every BatchNorm layer's running mean and variance on up to ``num_batches`` of ``batches``
    (tensors, or tuples whose first item is the input) with the weights as they are, in place, and average them
    over ``world``'s ranks, weighted by each rank's batch count. ``world``: a communicator
    (``prunex_hvd.comm.groups().world``), ``"auto"`` (that one once ``prunex_hvd.init()`` ran, else this process
    alone) or None (this process alone). Collective over ``world``: every rank calls it, each with its own
    batches. Returns the batches used in all.

        opt.finalize()
        px.recalibrate_batchnorm(model, train_loader, num_batches=8)   # after a pruned, averaged model

    Training is not touched: no parameter moves, no optimizer state, no random numbers drawn (unless the model
    draws its own in train mode: Dropout). Batches are moved to the model's device. To evaluate mid-run without
    keeping the statistics, save ``model.buffers()`` first (``prunex-hvd train`` does). A model without tracked
    BatchNorm (a ViT's LayerNorm) is left as it is and 0 is returned, on every rank. Each layer's
    ``num_batches_tracked`` becomes the world's batch count.
    """
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 1:
        raise ValueError(f"num_batches must be an int >= 1, got {num_batches!r}")
    if isinstance(world, str):
        if world != "auto":
            raise ValueError(f"world must be a communicator, 'auto' or None, got {world!r}")
        world = comm.groups().world if runtime.is_initialized() else None
    layers = tracked_batchnorms(model)
    if not layers:
        return 0
    taken = []   # update_bn takes every batch it is given: count them as they pass
    device = next(model.parameters(), torch.empty(0)).device
    update_bn((taken.append(None) or b for b in itertools.islice(batches, num_batches)), model, device=device)
    if world is None or world.size == 1:
        if not taken:
            raise ValueError("recalibrate_batchnorm: the batches yielded nothing; the statistics were reset")
        return len(taken)
    stats = [t for m in layers for t in (m.running_mean, m.running_var)]
    flat = torch.cat([t.reshape(-1).to(torch.float64) * len(taken) for t in stats]
                     + [torch.tensor([float(len(taken))], dtype=torch.float64, device=stats[0].device)])
    with world.ledger.tagged("eval"):   # bookkeeping for evaluation, not training traffic
        world.allreduce_(flat, "sum")
    total = int(flat[-1].item())
    if total == 0:   # every rank sees the same sum, so every rank raises
        raise ValueError("recalibrate_batchnorm: no rank's batches yielded anything; the statistics were reset")
    offset = 0
    for t in stats:
        t.copy_((flat[offset: offset + t.numel()] / total).view_as(t))
        offset += t.numel()
    for m in layers:
        m.num_batches_tracked.fill_(total)
    return total


def snapshot_buffers(model: torch.nn.Module) -> List[torch.Tensor]:
    """Copies of every buffer (BatchNorm statistics and their counters), for :func:`restore_buffers`."""
    return [b.detach().clone() for b in model.buffers()]


def restore_buffers(model: torch.nn.Module, saved: List[torch.Tensor]) -> None:
    with torch.no_grad():
        for b, old in zip(model.buffers(), saved):
            b.copy_(old)


__all__ = ["recalibrate_batchnorm", "restore_buffers", "snapshot_buffers", "tracked_batchnorms"]
