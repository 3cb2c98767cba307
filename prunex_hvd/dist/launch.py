"""How the processes were started, and a small channel for Python objects across them.

The *control plane* (one per launcher) carries only tiny objects at set-up: node keys, error messages, the
torch.distributed rendezvous address. Tensors never go through it; they go through :mod:`prunex_hvd.dist.comm`.
"""
from __future__ import annotations

import functools
import importlib.util
import itertools
import os
import pickle
import time
from typing import Any, Hashable, List, Optional

from . import watchdog

MPI_ENV_VARS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MV2_COMM_WORLD_SIZE",
                "MPI_LOCALNRANKS")


def launched_by_horovodrun_gloo() -> bool:
    return "HOROVOD_RANK" in os.environ and "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ


def launched_by_mpi() -> bool:
    return any(v in os.environ for v in MPI_ENV_VARS)


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or all(
        v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def horovod_installed() -> bool:
    return importlib.util.find_spec("horovod") is not None


def detect() -> str:
    """Discovery order of the design: Horovod (launched by horovodrun or MPI), MPI, torchrun, single."""
    if horovod_installed() and (launched_by_horovodrun_gloo() or launched_by_mpi()):
        return "horovod"
    if launched_by_mpi():
        return "mpi"
    if launched_by_torchrun():
        return "torchrun"
    return "single"


def _watched(fn):
    """A control-plane call is a world-wide collective: watched, and counted as a point every rank passes."""
    what = f"control-plane {fn.__name__.replace('_object', '')}"

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        with watchdog.waiting(what, world=True, transport=True):
            return fn(self, *args, **kwargs)
    return wrapper


def wait_politely(done, max_sleep: float = 0.01) -> None:
    """Poll ``done()`` with a growing sleep (0.1 ms up to ``max_sleep``) until it is true.

    Horovod's and Open MPI's own waits spin (sched_yield): with more ranks than cores the ranks that arrived
    first take the CPU from the one they all wait for (measured on a 2-core host, 4 ranks: 3 ranks spinning at
    35-70 % CPU while the fourth imported torch). Control-plane calls are rare, so a few ms of latency is
    nothing next to that."""
    delay = 1e-4
    while not done():
        time.sleep(delay)
        delay = min(2 * delay, max_sleep)


class Control:
    """World-wide exchange of small picklable objects (all ranks must call, in the same order)."""
    name = "single"
    grouping = "single"  # how node_key() finds nodes, reported in Topology.grouping
    rank = 0
    size = 1

    def allgather_object(self, obj: Any) -> List[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return obj

    def node_key(self) -> Hashable:
        """Something equal on the ranks of one node and different across nodes."""
        return 0

    def agree(self, error: Optional[str], exc_type: type = RuntimeError) -> None:
        """Collective check: if any rank reports an error, every rank raises ``exc_type`` naming them all.

        Use it for every check whose answer may differ across ranks, so no rank goes on into a collective
        that the failing ranks will never join."""
        errors = self.allgather_object(error)
        bad = [(r, e) for r, e in enumerate(errors) if e]
        if bad:
            first = bad[0][1]
            if all(e == first for _, e in bad):
                if len(bad) == self.size and first.endswith("]") and " [on " in first:
                    raise exc_type(first)   # already agreed one level down: it names its ranks
                ranks = "all ranks" if len(bad) == self.size else "rank(s) " + ",".join(str(r) for r, _ in bad)
                raise exc_type(f"{first} [on {ranks}]")
            raise exc_type("; ".join(f"rank {r}: {e}" for r, e in bad))


class MPIControl(Control):
    name = "mpi"
    grouping = "mpi-shared-memory"

    def __init__(self):
        from mpi4py import MPI
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()

    # every rank arrives (a non-blocking barrier, waited for politely) before the blocking object collective
    @_watched
    def allgather_object(self, obj):
        wait_politely(self.comm.Ibarrier().Test)
        return self.comm.allgather(obj)

    @_watched
    def broadcast_object(self, obj, root=0):
        wait_politely(self.comm.Ibarrier().Test)
        return self.comm.bcast(obj, root=root)

    def node_key(self):
        # ranks sharing memory form a node; its lowest world rank names it
        shared = self.comm.Split_type(self.MPI.COMM_TYPE_SHARED, key=self.rank)
        key = shared.allreduce(self.rank, op=self.MPI.MIN)
        shared.Free()
        return key


class HorovodControl(Control):
    name = "horovod"
    grouping = "horovod-cross-rank"

    def __init__(self):
        if launched_by_mpi():
            import mpi4py.MPI  # noqa: F401  (MPI initialised by mpi4py first: THREAD_MULTIPLE, shared with Horovod)
        import horovod.torch as hvd
        self.hvd = hvd
        if not hvd.is_initialized():
            # dynamic process sets let the horovod backend build the node and leader groups after discovery
            hvd.init(process_sets="dynamic")
        self.rank = hvd.rank()
        self.size = hvd.size()
        self._calls = 0

    # Every call gets the same explicit name on all ranks (Horovod would name it by the object's type: ranks
    # sending None and str would wait on each other forever), and is waited for politely.
    def _name(self, what: str) -> str:
        self._calls += 1
        return f"prunex.control.{what}.{self._calls}"

    def _wait(self, handle):
        wait_politely(lambda: self.hvd.poll(handle))
        return self.hvd.synchronize(handle)

    @_watched
    def allgather_object(self, obj):
        import torch
        name = self._name("allgather")
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = self._wait(self.hvd.allgather_async(torch.tensor([data.numel()]), name=name + ".sizes")).tolist()
        gathered = self._wait(self.hvd.allgather_async(data, name=name)).numpy().tobytes()
        starts = itertools.accumulate(sizes, initial=0)
        return [pickle.loads(gathered[start:start + n]) for start, n in zip(starts, sizes)]

    @_watched
    def broadcast_object(self, obj, root=0):
        import torch
        name = self._name("broadcast")
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if self.rank == root else None
        size = torch.tensor([data.numel() if data is not None else 0])
        self._wait(self.hvd.broadcast_async_(size, root_rank=root, name=name + ".size"))
        if data is None:
            data = torch.empty(int(size), dtype=torch.uint8)
        self._wait(self.hvd.broadcast_async_(data, root_rank=root, name=name))
        return pickle.loads(data.numpy().tobytes())

    def node_key(self):
        # Horovod numbers hosts by cross_rank (the rank among processes of the same local rank)
        return self.hvd.cross_rank()


class TorchrunControl(Control):
    name = "torchrun"
    grouping = "torchrun-group-rank"

    def __init__(self):
        import torch.distributed as dist
        self.dist = dist
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method="env://", timeout=watchdog.default_timeout())
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()

    @_watched
    def allgather_object(self, obj):
        out = [None] * self.size
        self.dist.all_gather_object(out, obj)
        return out

    @_watched
    def broadcast_object(self, obj, root=0):
        box = [obj]
        self.dist.broadcast_object_list(box, src=root)
        return box[0]

    def node_key(self):
        if "GROUP_RANK" in os.environ:  # torchrun's node rank
            return int(os.environ["GROUP_RANK"])
        return self.rank - int(os.environ.get("LOCAL_RANK", 0))


def describe(launcher: str) -> str:
    """The launch as a user would name it, for error messages."""
    if launcher == "horovod":
        return "horovodrun --mpi / mpirun (Horovod)" if launched_by_mpi() else "horovodrun --gloo"
    return {"mpi": "mpirun", "torchrun": "torchrun", "single": "a single process"}[launcher]


def make_control(launcher: str) -> Control:
    return {"horovod": HorovodControl, "mpi": MPIControl, "torchrun": TorchrunControl,
            "single": Control}[launcher]()
