"""``backend="auto"``: route each collective by where its tensor lives.

CUDA tensors go over NCCL (when CUDA is present), CPU tensors over MPI when the job runs under MPI, else
over gloo. Both sides are real groups of their own backends writing to the same ledger."""
from __future__ import annotations

from .base import Communicator, Groups


class AutoCommunicator(Communicator):
    backend = "auto"

    def __init__(self, cpu: Communicator, cuda: Communicator | None):
        super().__init__(cpu.tier, cpu.ranks, cpu.nodes, cpu.rank, cpu.ledger, racks=cpu.racks)
        self.cpu, self.cuda = cpu, cuda

    def _pick(self, tensor) -> Communicator:
        if tensor.device.type == "cuda" and self.cuda is not None:
            return self.cuda
        return self.cpu

    # dispatch whole public calls so the chosen backend validates and accounts under its own name
    def allreduce_(self, tensor, op="sum"):
        return self._pick(tensor).allreduce_(tensor, op)

    def allreduce_async_(self, tensor, op="sum"):
        return self._pick(tensor).allreduce_async_(tensor, op)

    def bor_(self, mask):
        return self._pick(mask).bor_(mask)

    def broadcast_(self, tensor, root=0):
        return self._pick(tensor).broadcast_(tensor, root)

    def allgather(self, tensor, same_shape=False):
        return self._pick(tensor).allgather(tensor, same_shape)

    def barrier(self):
        self.cpu.barrier()


def cpu_backend(launcher: str) -> str:
    from ..launch import launched_by_mpi
    return "mpi" if launched_by_mpi() and launcher in ("mpi", "horovod") else "gloo"


def combine(cpu: Groups, cuda: Groups | None) -> Groups:
    def pair(a, b):
        return None if a is None else AutoCommunicator(a, b)
    return Groups(world=pair(cpu.world, cuda and cuda.world), intra=pair(cpu.intra, cuda and cuda.intra),
                  inter=pair(cpu.inter, cuda and cuda.inter), backend="auto",
                  rack=pair(cpu.rack, cuda and cuda.rack), spine=pair(cpu.spine, cuda and cuda.spine))
