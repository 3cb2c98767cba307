"""NCCL backend (torch.distributed): collectives on CUDA tensors, GPU to GPU. NCCL has no bitwise-or, so
mask OR is MAX (exact for 0/1 masks, which is all the engine sends)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import _torch_dist


class NCCLCommunicator(_torch_dist.TorchDistCommunicator):
    backend = "nccl"
    has_bor = False
    reduce_avg_natively = True
    reducible = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8,
                           torch.int32, torch.int64})

    @property
    def device(self):
        return torch.device("cuda", torch.cuda.current_device())

    def _check(self, tensor, what):
        super()._check(tensor, what)
        if tensor.device.type != "cuda":
            raise ValueError(f"the nccl backend takes CUDA tensors, got one on {tensor.device}; "
                             "backend='auto' routes CPU tensors over mpi/gloo")


def available() -> str | None:
    if not torch.cuda.is_available():
        return "the nccl backend needs CUDA, and torch sees no GPU here (use mpi, gloo or horovod)"
    if not dist.is_nccl_available():
        return "torch was built without NCCL"
    return None


def make_groups(topo, control, ledger=None):
    torch.cuda.set_device(topo.local_rank % torch.cuda.device_count())
    _torch_dist.ensure_world(topo, control)
    return _torch_dist.make_groups(topo, NCCLCommunicator, "nccl", ledger)
