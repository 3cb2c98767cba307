"""Gloo backend (torch.distributed): CPU collectives over TCP, no MPI needed. GPU tensors are staged
through host memory."""
from __future__ import annotations

import torch.distributed as dist

from . import _torch_dist
from .base import staged_on_cpu

class GlooCommunicator(_torch_dist.TorchDistCommunicator):
    backend = "gloo"
    has_bor = True

    _allreduce = staged_on_cpu(_torch_dist.TorchDistCommunicator._allreduce)
    _bor = staged_on_cpu(_torch_dist.TorchDistCommunicator._bor)
    _broadcast = staged_on_cpu(_torch_dist.TorchDistCommunicator._broadcast)
    _allgather_equal = staged_on_cpu(_torch_dist.TorchDistCommunicator._allgather_equal)


def available() -> str | None:
    return None if dist.is_available() and dist.is_gloo_available() else "torch was built without gloo"


def make_groups(topo, control, ledger=None):
    _torch_dist.ensure_world(topo, control)
    return _torch_dist.make_groups(topo, GlooCommunicator, "gloo", ledger)
