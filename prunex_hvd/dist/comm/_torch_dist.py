"""torch.distributed plumbing shared by the gloo and nccl backends.

When the job was not started by torchrun, the default process group is bootstrapped from the launcher's
world (Horovod or MPI): rank 0 picks an address and a free port and tells the others over the control plane.
"""
from __future__ import annotations

import os
from typing import List

import torch
import torch.distributed as dist

from ..net import free_port, reachable_address
from ..watchdog import default_timeout
from .base import Communicator, Groups, build_groups

def ensure_world(topo, control) -> None:
    if dist.is_initialized():
        if dist.get_world_size() != topo.size or dist.get_rank() != topo.rank:
            raise RuntimeError(f"torch.distributed is initialised as rank {dist.get_rank()}/"
                               f"{dist.get_world_size()} but this job is rank {topo.rank}/{topo.size}")
        return
    # under horovodrun, Gloo on the interface Horovod chose: by default it binds to the address of the host name,
    # which on many hosts is a loopback one (127.0.1.1), unreachable from the other hosts
    if os.environ.get("HOROVOD_GLOO_IFACE") and not os.environ.get("GLOO_SOCKET_IFNAME"):
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["HOROVOD_GLOO_IFACE"]
    addr = control.broadcast_object((reachable_address(), free_port()) if topo.rank == 0 else None)
    dist.init_process_group("gloo", init_method=f"tcp://{addr[0]}:{addr[1]}", rank=topo.rank,
                            world_size=topo.size, timeout=default_timeout())


class TorchDistCommunicator(Communicator):
    pads_allgather = True
    reduce_avg_natively = False

    def __init__(self, pg, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pg = pg

    def _allreduce(self, tensor, op):
        self._allreduce_async(tensor, op)()

    def _allreduce_async(self, tensor, op):
        """torch.distributed's own async op: Gloo works in its threads, NCCL on its stream (``wait()`` then
        orders the caller's stream after it, as a blocking call does). The blocking allreduce waits at once."""
        native_avg = op == "avg" and self.reduce_avg_natively
        reduce_op = dist.ReduceOp.AVG if native_avg else dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        work = dist.all_reduce(tensor, op=reduce_op, group=self.pg, async_op=True)

        def finish():
            work.wait()
            if op == "avg" and not native_avg:
                tensor.div_(self.size)
        return finish

    def _bor(self, mask):
        dist.all_reduce(mask, op=dist.ReduceOp.BOR if self.has_bor else dist.ReduceOp.MAX, group=self.pg)

    def _broadcast(self, tensor, root):
        dist.broadcast(tensor, src=self.ranks[root], group=self.pg)

    def _allgather_equal(self, tensor) -> List[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(out, tensor, group=self.pg)
        return out

    def _allgather_unequal(self, tensor, dims) -> List[torch.Tensor]:
        longest = max(d[0] for d in dims)
        padded = tensor.new_zeros((longest,) + tuple(tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        return [t[: d[0]] for t, d in zip(self._allgather_equal(padded), dims)]

    def _barrier(self):
        self._allreduce(torch.zeros(1, device=self.device), "sum")

    device = "cpu"


def make_groups(topo, cls, backend: str, ledger=None) -> Groups:
    """Create every group of :func:`group_plans`. ``new_group`` is collective over the whole world, so every rank
    creates every group, in the same order."""
    def make(plan, index):
        pg = dist.new_group(list(plan.ranks), backend=backend, timeout=default_timeout())
        return None if index is None else cls(pg, plan.tier, plan.ranks, plan.nodes, index, ledger, racks=plan.racks)
    return build_groups(topo, backend, make)
