"""mpi4py backend: zero-copy on CPU tensors (the tensor's own memory is the MPI buffer).

Groups come from ``Split``: the node group by node index, the leaders' group by ``Split(color, UNDEFINED)``
so non-leaders get ``COMM_NULL`` and hold no leader communicator. GPU tensors are staged through host memory
(no CUDA-aware MPI is assumed); use the ``nccl`` backend for them.
"""
from __future__ import annotations

import time
from typing import List

import numpy as np
import torch

from .base import Communicator, Groups, build_groups, group_plans, staged_on_cpu

def _buf(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()  # shares memory with the tensor: no copy


RING_POLL_S = 0.005   # the background ring sleeps this long between two tests of its sends and receives
_RING_TAG = 7321       # point-to-point traffic has its own context: the group's collectives never match it


class MPICommunicator(Communicator):
    backend = "mpi"
    has_bor = True
    # MPI has no half-precision types: float16 / bfloat16 travel as 2-byte words reduced by our own ops
    # (:func:`_half_ops`), each add done in float32 and rounded once, as torch adds half tensors
    reducible = frozenset({torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8, torch.int8,
                           torch.int16, torch.float16, torch.bfloat16})

    def __init__(self, comm, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from mpi4py import MPI
        self.MPI = MPI
        self.comm = comm

    @staged_on_cpu
    def _allreduce(self, tensor, op):
        if tensor.dtype in (torch.float16, torch.bfloat16):
            mpi_op = _half_ops(self.MPI)[tensor.dtype, "max" if op == "max" else "sum"]
            self.comm.Allreduce(self.MPI.IN_PLACE, [_buf(tensor.view(torch.int16)), self.MPI.SHORT], op=mpi_op)
        else:
            self.comm.Allreduce(self.MPI.IN_PLACE, _buf(tensor), op=self.MPI.MAX if op == "max" else self.MPI.SUM)
        if op == "avg":
            tensor.div_(self.size)

    @staged_on_cpu
    def _allreduce_in_background(self, tensor, op):
        """The async allreduce, on the group's communication thread: a ring (reduce-scatter, then allgather) of
        nonblocking sends and receives, tested every ``RING_POLL_S``. A blocking MPI collective on that thread
        spins a core for the whole transfer, beside the local steps computing meanwhile; MPI's own Iallreduce
        may pick a slower algorithm (Open MPI's libnbc: reduce, then broadcast, below 4 members: twice the
        time). On the emulated cluster a frozen overlapped round took 5.00 s polled every 5 ms, 5.35 s every
        0.5 ms (each poll takes the GIL from the steps) and 5.46 s with the blocking call
        (benchmarks/log/2026-11-26-overlap-polled-ring.md). It sends what the ledger's ring model counts; each
        chunk is combined on one member (for half types in float32, rounded once, as ``_half_ops``) and copied
        to the others, so all end equal."""
        flat, size, me = tensor.view(-1), self.size, self.rank
        bounds = [flat.numel() * k // size for k in range(size + 1)]

        def chunk(k):
            k %= size
            return flat[bounds[k]:bounds[k + 1]]

        if size > 1 and flat.numel():
            scratch = torch.empty(bounds[-1] - bounds[-2], dtype=flat.dtype)   # the widest chunk
            for step in range(size - 1):       # reduce-scatter: member r ends with chunk r + 1 complete
                mine = chunk(me - step - 1)
                incoming = scratch[:mine.numel()]
                self._send_recv_polled(chunk(me - step), incoming)
                if op == "max":
                    torch.maximum(mine, incoming, out=mine)
                else:
                    mine.add_(incoming)
            for step in range(size - 1):       # allgather: the complete chunks go round
                self._send_recv_polled(chunk(me + 1 - step), chunk(me - step))
        if op == "avg":
            tensor.div_(size)

    def _send_recv_polled(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Send to the next member and receive from the previous one, sleeping between tests."""
        size = self.size
        requests = [self.comm.Irecv(_bytes(recv), source=(self.rank - 1) % size, tag=_RING_TAG),
                    self.comm.Isend(_bytes(send), dest=(self.rank + 1) % size, tag=_RING_TAG)]
        while not self.MPI.Request.Testall(requests):
            time.sleep(RING_POLL_S)

    @staged_on_cpu
    def _bor(self, mask):
        self.comm.Allreduce(self.MPI.IN_PLACE, _buf(mask), op=self.MPI.BOR)

    @staged_on_cpu
    def _broadcast(self, tensor, root):
        if tensor.dtype in (torch.float16, torch.bfloat16, torch.bool):
            self.comm.Bcast(_buf(tensor.view(torch.uint8)), root=root)
        else:
            self.comm.Bcast(_buf(tensor), root=root)

    @staged_on_cpu
    def _allgather_equal(self, tensor) -> List[torch.Tensor]:
        out = torch.empty((self.size,) + tuple(tensor.shape), dtype=tensor.dtype)
        self.comm.Allgather(_bytes(tensor), _bytes(out))
        return list(out.unbind(0))

    @staged_on_cpu
    def _allgather_unequal(self, tensor, dims) -> List[torch.Tensor]:
        counts = [int(torch.Size(d).numel()) * tensor.element_size() for d in dims]
        displs = np.concatenate([[0], np.cumsum(counts[:-1])]).astype(np.int64).tolist()
        flat = torch.empty(sum(counts), dtype=torch.uint8)
        self.comm.Allgatherv(_bytes(tensor), [_buf(flat), counts, displs, self.MPI.BYTE])
        return [flat[o:o + c].view(tensor.dtype).view(d).clone() for o, c, d in zip(displs, counts, dims)]

    def _barrier(self):
        self.comm.Barrier()


_HALF_OPS: dict = {}


def _to_float32(words: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    if dtype == torch.float16:
        return words.view(np.float16).astype(np.float32)
    return (words.astype(np.uint32) << 16).view(np.float32)   # bfloat16: the high half of a float32


def _from_float32(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Round to nearest even, as torch does (NaN stays NaN)."""
    if dtype == torch.float16:
        with np.errstate(over="ignore"):   # beyond 65504: inf, as torch rounds it
            return x.astype(np.float16).view(np.int16)
    bits = x.view(np.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    rounded = np.where(np.isnan(x), (bits >> 16) | 0x40, rounded)   # keep NaN quiet, never round it to inf
    return rounded.astype(np.uint16).view(np.int16)


def _half_ops(MPI) -> dict:
    """``{(dtype, "sum" | "max"): MPI.Op}`` for float16 and bfloat16 carried as MPI.SHORT: each pair of values
    widened to float32, combined, rounded once (commutative, so MPI may use any algorithm)."""
    if not _HALF_OPS:
        for dtype in (torch.float16, torch.bfloat16):
            for name, combine in (("sum", np.add), ("max", np.maximum)):
                def reduce(inbuf, inoutbuf, datatype, dtype=dtype, combine=combine):
                    a = np.frombuffer(inbuf, dtype=np.int16)
                    out = np.frombuffer(inoutbuf, dtype=np.int16)
                    out[:] = _from_float32(combine(_to_float32(a, dtype), _to_float32(out, dtype)), dtype)
                _HALF_OPS[dtype, name] = MPI.Op.Create(reduce, commute=True)
    return _HALF_OPS


def _bytes(t: torch.Tensor):
    return _buf(t.reshape(-1).view(torch.uint8))


def make_groups(topo, ledger=None) -> Groups:
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if world.Get_size() != topo.size:
        raise RuntimeError(f"MPI world has {world.Get_size()} ranks but the job has {topo.size}: "
                           "the mpi backend needs a launch by mpirun/srun (use gloo or horovod otherwise)")
    mine = {p.tier: p for p in group_plans(topo) if p.member(topo.rank) is not None}
    splits = {"world": world.Dup()}   # one Split per tier, every rank coloured by its group of the tier

    def make(plan, index):
        if plan.tier not in splits:
            my = mine.get(plan.tier)
            splits[plan.tier] = world.Split(color=MPI.UNDEFINED if my is None else my.index,
                                            key=0 if my is None else my.member(topo.rank))
        if index is None:
            return None
        return MPICommunicator(splits[plan.tier], plan.tier, plan.ranks, plan.nodes, index, ledger, racks=plan.racks)
    return build_groups(topo, "mpi", make)
