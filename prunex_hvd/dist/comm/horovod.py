"""Horovod backend: collectives on Horovod process sets (one per node, one for the leaders).

Process sets are added after start-up, so Horovod must run with dynamic process sets: ``prunex_hvd.init()``
starts it that way. If your script calls ``hvd.init()`` itself, call it as
``hvd.init(process_sets="dynamic")`` (or call ``prunex_hvd.init()`` first). Horovod has no bitwise-or, so mask
OR is MAX (exact for 0/1 masks). GPU tensors go to Horovod as they are when it was built with GPU
operations, else through host memory.
"""
from __future__ import annotations

import os
from typing import List

import torch

from ..launch import wait_politely
from .base import Communicator, Groups, build_groups, staged_on_cpu

def _hvd():
    import horovod.torch as hvd
    return hvd


class HorovodCommunicator(Communicator):
    backend = "horovod"
    has_bor = False
    # Horovod's torch allreduce takes only these; uint8 masks travel as int32 (4 bytes each, accounted so)
    reducible = frozenset({torch.float16, torch.float32, torch.float64, torch.int32, torch.int64})

    def __init__(self, process_set, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hvd = _hvd()
        self.process_set = process_set
        self.gpu_ops = self.hvd.nccl_built() or self.hvd.cuda_built()
        self._outstanding = 0   # async allreduces in flight

    def _name(self, op, tensor, shape=None):
        # Our collectives are synchronous, so a name only has to tell apart what differs: group, op, dtype
        # and shape (the same on every member). Stable names keep Horovod's response cache small and warm.
        shape = tuple(tensor.shape) if shape is None else shape
        dims = "x".join(map(str, shape)) or "scalar"
        return f"prunex.{self.tier}.{self.ranks[0]}x{self.size}.{op}.{str(tensor.dtype)[6:]}.{dims}"

    def _wait(self, handle, tensor):
        """The op's result once it is done. Horovod's own wait spins: on CPU, ranks sharing cores would take them
        from the background threads that run the ops (a 4-rank engine round on 2 cores: 18 s spinning, 6 s
        polled), so a CPU op is polled with a short growing sleep first. A GPU op waits Horovod's way (latency)."""
        if tensor.device.type == "cpu":
            wait_politely(lambda: self.hvd.poll(handle), max_sleep=2e-3)
        return self.hvd.synchronize(handle)

    def _maybe_stage(self, fn, tensor, *args):
        if tensor.device.type != "cpu" and not self.gpu_ops:
            return staged_on_cpu(fn)(self, tensor, *args)
        return fn(self, tensor, *args)

    def _allreduce(self, tensor, op):
        self._maybe_stage(HorovodCommunicator._allreduce_impl, tensor, op)

    def _allreduce_impl(self, tensor, op):
        self._wait(self.hvd.allreduce_async_(tensor, op=self._op(op), name=self._name("allreduce", tensor),
                                             process_set=self.process_set), tensor)

    def _op(self, op):
        return {"avg": self.hvd.Average, "max": self.hvd.Max}.get(op, self.hvd.Sum)

    def _allreduce_async(self, tensor, op):
        """Horovod's own async allreduce, progressed by its background thread."""
        if tensor.device.type != "cpu" and not self.gpu_ops:
            return super()._allreduce_async(tensor, op)   # staged through host memory on the comm thread
        # names must differ among the ops in flight (a round's buckets may share a shape); numbered by how many
        # are in flight, they repeat round after round and keep Horovod's response cache warm
        name = self._name(f"allreduce-async{self._outstanding}", tensor)
        handle = self.hvd.allreduce_async_(tensor, op=self._op(op), name=name, process_set=self.process_set)
        self._outstanding += 1

        def finish():
            try:
                self._wait(handle, tensor)
            finally:
                self._outstanding -= 1
        return finish

    def _bor(self, mask):
        self._maybe_stage(HorovodCommunicator._bor_impl, mask)

    def _bor_impl(self, mask):
        self._wait(self.hvd.allreduce_async_(mask, op=self.hvd.Max, name=self._name("bor", mask),
                                             process_set=self.process_set), mask)

    def _broadcast(self, tensor, root):
        self._maybe_stage(HorovodCommunicator._broadcast_impl, tensor, root)

    def _broadcast_impl(self, tensor, root):
        if tensor.dtype == torch.bfloat16:   # Horovod has no bfloat16 tensors: the same bits as int16
            tensor = tensor.view(torch.int16)
        self._wait(self.hvd.broadcast_async_(tensor, root_rank=self.ranks[root],
                                             name=self._name("broadcast", tensor), process_set=self.process_set),
                   tensor)

    def _allgather_equal(self, tensor) -> List[torch.Tensor]:
        return self._allgather_unequal(tensor, [tuple(tensor.shape)] * self.size)

    def _allgather_unequal(self, tensor, dims) -> List[torch.Tensor]:
        # Horovod's allgather takes unequal first dimensions itself
        flat = tensor.reshape(1) if tensor.dim() == 0 else tensor
        src = flat if flat.device.type == "cpu" or self.gpu_ops else flat.cpu()
        out = self._wait(self.hvd.allgather_async(src, name=self._name("allgather", src, shape=tuple(src.shape[1:])),
                                                  process_set=self.process_set), src)
        out = out.to(tensor.device)
        return [o.reshape(d) for o, d in zip(torch.split(out, [d[0] if d else 1 for d in dims]), dims)]

    def _barrier(self):
        self.hvd.barrier(process_set=self.process_set)


def available(launcher: str) -> str | None:
    try:
        hvd = _hvd()
    except ImportError as exc:
        return f"Horovod is not importable ({exc}); `make setup` builds it"
    if launcher != "horovod" or not hvd.is_initialized():
        from ..launch import describe
        return ("the horovod backend needs a launch by horovodrun or mpirun with Horovod installed "
                f"(this job was started by {describe(launcher)})")
    if os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0") in ("0", ""):
        return ("Horovod was initialised without dynamic process sets: call prunex_hvd.init() before "
                "hvd.init(), or hvd.init(process_sets='dynamic')")
    return None


_created = {}


def _process_set(ranks):
    hvd = _hvd()
    ranks = tuple(ranks)
    if ranks == tuple(range(hvd.size())):
        return hvd.global_process_set
    if ranks not in _created:
        _created[ranks] = hvd.add_process_set(list(ranks))
    return _created[ranks]


def make_groups(topo, control, ledger=None) -> Groups:
    def make(plan, index):   # every rank adds every set, in the same order
        ps = _process_set(plan.ranks)
        return None if index is None else HorovodCommunicator(ps, plan.tier, plan.ranks, plan.nodes, index, ledger,
                                                              racks=plan.racks)
    return build_groups(topo, "horovod", make)
