"""``dense``: plain data-parallel training, as everyone runs it: every step, every gradient is averaged
over all ranks.

Under Horovod (horovodrun, or mpirun with Horovod installed) this *is* ``horovod.torch.DistributedOptimizer``
(tensor fusion, gradients allreduced while backward runs), with our byte counters wrapped around its
``synchronize()``: one record per step for the fused allreduce of all gradients, on the world group, under
the same ring model as every other method. Without Horovod it is the torch.distributed equivalent: the
gradients packed into ``bucket_mb`` buckets and allreduce-averaged over the world group after backward.

Nothing to tune: it is the reference every other method must beat on bytes without losing accuracy.
"""
from __future__ import annotations

import time
import types
from typing import Optional

import torch

from ..dist import agreement, runtime, watchdog
from ..dist.comm import groups as comm_groups
from ..dist.comm.accounting import record_ring
from .common import (MethodOptimizer, Traffic, allreduce_gradients, broadcast_model, check_wrapping, flat_layout,
                     mix_into)


class _Allreduce(MethodOptimizer):
    """The torch.distributed equivalent of Horovod's optimizer: bucketed allreduce-avg of the gradients."""

    def __init__(self, params, model, world, bucket_mb):
        super(self.__class__, self).__init__(params)
        self._method_setup(model, world)
        self._layout = flat_layout(self._params, bucket_mb)

    def _communicate(self) -> None:
        allreduce_gradients(self._params, self._layout, self._world)


def _account_horovod(opt, model, world) -> None:
    """Wrap counters around Horovod's own optimizer: its ``synchronize()`` waits for the fused allreduce of
    every gradient; we record that allreduce under the ring model and add the harness interface from
    :class:`MethodOptimizer`, bound onto the instance (not a subclass: Horovod's class calls
    ``super(self.__class__, self)``)."""
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    opt._model, opt._world, opt._traffic, opt._steps, opt._dense_inter = model, world, Traffic(world.ledger), 0, 0
    synchronize, base_state_dict, base_load = opt.synchronize, opt.state_dict, opt.load_state_dict

    def accounted_synchronize(self):
        t0 = time.perf_counter()
        with watchdog.waiting("Horovod's gradient allreduce", world=True, transport=True):
            synchronize()
        payload = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
        rec = record_ring(world, "allreduce", [payload] * world.size, time.perf_counter() - t0, "gradients",
                          backend="horovod")   # Horovod moved the bytes, over the world
        self._traffic.inter += rec.cross_node_bytes
        self._traffic.cross_rack += rec.cross_rack_bytes
        self._traffic.intra += rec.wire_bytes - rec.cross_node_bytes
        self._dense_inter += rec.cross_node_bytes   # dense is its own counterfactual
        self._steps += 1

    def state_dict(self):
        return self._with_method_state(base_state_dict())

    def load_state_dict(self, sd):
        sd, method = self._split_method_state(sd)
        base_load(sd)   # Horovod's own: it also resets its pending handles
        self._restore_method_state(method)

    for name, fn in (("synchronize", accounted_synchronize), ("state_dict", state_dict),
                     ("load_state_dict", load_state_dict)):
        setattr(opt, name, types.MethodType(fn, opt))
    for name in ("stats", "rounds_done", "density", "layer_density", "_extra_stats", "consensus", "consensus_weights",
                 "finalize", "_with_method_state", "_split_method_state", "_restore_method_state",
                 "_method_state", "_load_method_state"):
        setattr(opt, name, types.MethodType(getattr(MethodOptimizer, name), opt))
    opt.records_per_epoch = True


def DistributedOptimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module, bucket_mb: float = 32,
                         backend: Optional[str] = None):
    """Dense data-parallel training of ``model`` with ``optimizer``: Horovod's DistributedOptimizer when
    launched under Horovod, else a bucketed allreduce over the world group. Collective; rank 0's model is
    broadcast first. Returns the wrapped optimizer with ``stats()`` and the harness interface."""
    agreement.checked_construction("the dense optimizer", backend, model,
                                   lambda: (check_wrapping(optimizer, model, bucket_mb), {"bucket_mb": bucket_mb}))
    topo = runtime.topology()
    world = comm_groups(backend).world
    broadcast_model(model, world)
    if topo.launcher == "horovod":
        import horovod.torch as hvd
        opt = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        _account_horovod(opt, model, world)
        return opt
    return mix_into(optimizer, _Allreduce, model, world, bucket_mb)
