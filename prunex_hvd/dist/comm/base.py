"""The one small interface every backend implements, with validation and accounting done once here.

A :class:`Communicator` is one group (intra-node, the leaders' inter-node group, or the world). Public
methods check their input, time the backend's ``_op`` and write a record to the ledger; backends only move
bytes. All members of a group must call the same collectives in the same order.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from .. import watchdog
from .accounting import CommLedger, ledger as default_ledger, record_ring

REDUCE_OPS = ("sum", "avg", "max")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Communicator:
    """Collectives on one group.

    ``ranks`` are the world ranks of the members in group order, ``nodes`` their node indices, ``racks`` their
    rack indices (default: every node its own rack), ``rank`` my index in the group. ``tier`` is ``intra``,
    ``inter``, ``rack``, ``spine`` or ``world`` (:func:`group_plans`)."""

    backend = "base"
    has_bor = True  # False: bitwise-or is done as MAX, exact only for 0/1 masks (checked)
    pads_allgather = False  # True: unequal allgathers travel padded to the largest member (accounted so)
    # dtypes the backend reduces natively; others travel widened (and are accounted at the wider size)
    reducible = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8,
                           torch.int16, torch.int32, torch.int64})

    def __init__(self, tier: str, ranks: Sequence[int], nodes: Sequence[int], rank: int,
                 ledger: Optional[CommLedger] = None, racks: Optional[Sequence[int]] = None):
        self.tier = tier
        self.ranks = tuple(ranks)
        self.nodes = tuple(nodes)
        self.racks = tuple(racks) if racks is not None else self.nodes
        self.rank = rank
        self.size = len(self.ranks)
        self.ledger = ledger or default_ledger()
        self._worker: Optional[_CommThread] = None   # the async collectives' thread, made on first use
        self._worker_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.tier} ranks={list(self.ranks)} me={self.rank}>"

    # -- public, accounted -------------------------------------------------------------------------
    def allreduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place allreduce; ``op`` is ``"sum"``, ``"avg"`` or ``"max"``. Returns ``tensor``."""
        self._check_allreduce(tensor, op, "allreduce_")
        self._reduce("allreduce", self._allreduce, tensor, op)
        return tensor

    def allreduce_async_(self, tensor: torch.Tensor, op: str = "sum") -> "Work":
        """Start an in-place allreduce and return at once: the tensor is the result after ``wait()`` on the
        returned :class:`Work` (do not read or write it before). Every member starts the same async collectives
        in the same order; blocking collectives on *other* groups may run meanwhile (the overlapped round's
        leaders exchange across nodes while their node steps). Accounted when waited on: ``seconds`` is the
        time ``wait()`` blocked, the exposed part of the transfer."""
        self._check_allreduce(tensor, op, "allreduce_async_")
        wire = self.wire_dtype(tensor.dtype)
        carried = tensor if wire == tensor.dtype else tensor.to(wire)
        finish = self._allreduce_async(carried, op)
        done = (lambda: tensor.copy_(carried)) if carried is not tensor else None
        return Work(self, "allreduce", [tensor.numel() * wire.itemsize] * self.size, finish, done)

    def bor_(self, mask: torch.Tensor) -> torch.Tensor:
        """In-place bitwise OR of a uint8 mask across the group. Returns ``mask``.

        Backends without a native BOR (NCCL, Horovod) use MAX, which equals OR for 0/1 masks; other values
        are refused there rather than silently wrong."""
        self._check(mask, "bor_")
        if mask.dtype != torch.uint8:
            raise ValueError(f"bor_ needs a uint8 mask (send torch.bool masks as uint8), got {mask.dtype}")
        if not self.has_bor and mask.numel() and int(mask.max()) > 1:
            raise ValueError(f"the {self.backend} backend has no bitwise-or; bor_ there takes 0/1 masks only")
        self._reduce("bor", self._bor, mask)
        return mask

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """In-place broadcast from group rank ``root``. Returns ``tensor``."""
        self._check(tensor, "broadcast_")
        if not 0 <= root < self.size:
            raise ValueError(f"broadcast root {root} is not a rank of this group of {self.size}")
        with self._accounted("broadcast", [nbytes(tensor)] * self.size, root=root):
            self._broadcast(tensor, root)
        return tensor

    def allgather(self, tensor: torch.Tensor, same_shape: bool = False) -> List[torch.Tensor]:
        """Every member's tensor, in group order.

        The first dimension may differ across members (the other dimensions and the dtype may not); the
        shapes are then exchanged first (accounted as ``allgather_sizes``). Pass ``same_shape=True`` when
        every member is known to send the same shape, to skip that exchange (one collective, not two)."""
        self._check(tensor, "allgather")
        if same_shape:
            with self._accounted("allgather", [nbytes(tensor)] * self.size):
                return self._allgather_equal(tensor.contiguous())
        shape = torch.tensor([tensor.dim()] + list(tensor.shape), dtype=torch.int64, device=tensor.device)
        shape = torch.nn.functional.pad(shape, (0, 9 - shape.numel())) if shape.numel() < 9 else shape
        if shape.numel() > 9:
            raise ValueError("allgather supports tensors of at most 8 dimensions")
        with self._accounted("allgather_sizes", [nbytes(shape)] * self.size):
            shapes = self._allgather_equal(shape)
        dims = [tuple(int(x) for x in s[1:1 + int(s[0])]) for s in shapes]
        ref = dims[self.rank]
        for r, d in enumerate(dims):
            if len(d) != len(ref) or d[1:] != ref[1:]:
                raise ValueError(f"allgather: member {r} sends shape {d}, member {self.rank} {ref}; "
                                 "only the first dimension may differ")
        sizes = [int(torch.Size(d).numel()) * tensor.element_size() for d in dims]
        if self.pads_allgather:
            sizes = [max(sizes)] * self.size
        with self._accounted("allgather", sizes):
            if len(set(dims)) == 1:
                return self._allgather_equal(tensor.contiguous())
            return self._allgather_unequal(tensor.contiguous(), dims)

    def barrier(self) -> None:
        with self._accounted("barrier", [0] * self.size):
            self._barrier()

    # -- backend hooks -----------------------------------------------------------------------------
    def _allreduce(self, tensor, op):
        raise NotImplementedError

    def _allreduce_async(self, tensor, op) -> Callable[[], None]:
        """Start ``_allreduce`` and return what completes it. Here: on this group's own communication thread
        (one per group, so its collectives keep their order), for transports whose blocking calls release the
        GIL and allow other threads' collectives on other groups (MPI at THREAD_MULTIPLE, the thread
        cluster); torch.distributed and Horovod override it with their own async operations."""
        with self._worker_lock:
            if self._worker is None:
                self._worker = _CommThread(f"prunex-{self.tier}-comm")
        return self._worker.submit(self._allreduce_in_background, tensor, op).result

    def _allreduce_in_background(self, tensor, op):
        """What the communication thread runs for an async allreduce: the blocking one, unless the backend has
        a way that leaves the cores to the local steps computing meanwhile (MPI)."""
        self._allreduce(tensor, op)

    def _bor(self, mask):
        raise NotImplementedError

    def _broadcast(self, tensor, root):
        raise NotImplementedError

    def _allgather_equal(self, tensor) -> List[torch.Tensor]:
        raise NotImplementedError

    def _allgather_unequal(self, tensor, dims) -> List[torch.Tensor]:
        raise NotImplementedError

    def _barrier(self):
        raise NotImplementedError

    # -- helpers -----------------------------------------------------------------------------------
    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a reduction of ``dtype`` travels in on this backend."""
        if dtype in self.reducible:
            return dtype
        if dtype.is_floating_point:
            return torch.float32
        return torch.int32 if torch.int32 in self.reducible else torch.int64

    def _reduce(self, op, impl, tensor, *args):
        wire = self.wire_dtype(tensor.dtype)
        with self._accounted(op, [tensor.numel() * wire.itemsize] * self.size):
            if wire == tensor.dtype:
                impl(tensor, *args)
            else:
                wide = tensor.to(wire)
                impl(wide, *args)
                tensor.copy_(wide)

    def _check_allreduce(self, tensor, op, what):
        if op not in REDUCE_OPS:
            raise ValueError(f"allreduce op must be one of {REDUCE_OPS}, got {op!r}")
        self._check(tensor, what)
        if not tensor.is_floating_point() and op == "avg":
            raise ValueError(f"allreduce op 'avg' needs a floating tensor, got {tensor.dtype}")

    def _check(self, tensor, what):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{what} takes a torch.Tensor, got {type(tensor).__name__}")
        if what.endswith("_") and not tensor.is_contiguous():
            raise ValueError(f"{what} works in place and needs a contiguous tensor")

    def _accounted(self, op, sizes, root=0):
        return _Accounted(self, op, sizes, root)


class _CommThread:
    """One daemon thread running a group's async collectives in order (daemon: a collective a dead peer never
    joins must not keep the process from exiting; the watchdog stops the job)."""

    def __init__(self, name: str):
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:   # handed to wait(), on the caller's thread
                future.set_exception(exc)


class Work:
    """An allreduce in flight (:meth:`Communicator.allreduce_async_`). ``wait()`` blocks until it is done,
    once; it is watched (a dead peer stops the job, named) and accounted there like a blocking collective."""

    def __init__(self, comm: Communicator, op: str, sizes: List[int], finish: Callable[[], None],
                 done: Optional[Callable[[], None]] = None):
        self.comm, self.op, self.sizes = comm, op, sizes
        self._finish, self._done = finish, done
        self.completed = False
        self.wait_seconds = 0.0

    def wait(self) -> None:
        if self.completed:
            return
        t0 = time.perf_counter()
        with self.comm._accounted(self.op, self.sizes):
            self._finish()
            if self._done is not None:
                self._done()
        self.completed = True
        self.wait_seconds = time.perf_counter() - t0


class _Accounted:
    __slots__ = ("comm", "op", "sizes", "root", "t0")

    def __init__(self, comm, op, sizes, root):
        self.comm, self.op, self.sizes, self.root = comm, op, sizes, root

    def __enter__(self):
        wd = watchdog.current()   # every collective is watched: a dead or stalled peer stops the job, named
        if wd is not None:
            wd.enter(f"{self.op} on the {self.comm.tier} group", world=False)
        self.t0 = time.perf_counter()

    def __exit__(self, exc_type, exc, tb):
        wd = watchdog.current()
        if wd is not None:
            wd.leave()
            if exc_type is not None and issubclass(exc_type, Exception):
                wd.stop_if_rank_died()   # a peer's death shows here as an opaque transport error
        if exc_type is not None:
            return False
        record_ring(self.comm, self.op, self.sizes, time.perf_counter() - self.t0, self.comm.ledger.current_tag,
                    self.root, model_op="allgather" if self.op == "allgather_sizes" else None)
        return False


class SingleCommunicator(Communicator):
    """A group of one: every collective is the identity (no bytes move)."""
    backend = "single"

    def _allreduce(self, tensor, op):
        pass

    def _allreduce_async(self, tensor, op):
        return lambda: None

    def _bor(self, mask):
        pass

    def _broadcast(self, tensor, root):
        pass

    def _allgather_equal(self, tensor):
        return [tensor.clone()]

    def _allgather_unequal(self, tensor, dims):
        return [tensor.clone()]

    def _barrier(self):
        pass


@dataclass(frozen=True)
class GroupPlan:
    """One group a backend creates: its tier, which group of the tier it is (the node or rack number, 0 for the
    others), and its members (world ranks in group order) with their nodes and racks."""
    tier: str
    index: int
    ranks: Tuple[int, ...]
    nodes: Tuple[int, ...]
    racks: Tuple[int, ...]

    def member(self, world_rank: int) -> Optional[int]:
        """``world_rank``'s index in the group, or None."""
        return self.ranks.index(world_rank) if world_rank in self.ranks else None


def group_plans(topo) -> List[GroupPlan]:
    """Every group of every tier, in the order every rank creates them (collective creation must agree): one
    ``intra`` per node, ``inter`` (the node leaders), with racks one ``rack`` group per rack (its node leaders)
    and ``spine`` (the rack leaders, the only ranks that cross racks), then ``world``."""
    node_of = [topo.node_of(r) for r in range(topo.size)]
    rack_of = [topo.rack_of(n) for n in node_of]

    def plan(tier, index, ranks):
        ranks = tuple(ranks)
        return GroupPlan(tier, index, ranks, tuple(node_of[r] for r in ranks), tuple(rack_of[r] for r in ranks))
    plans = [plan("intra", n, ranks) for n, ranks in enumerate(topo.node_ranks)] + [plan("inter", 0, topo.leaders)]
    if topo.rack_nodes:
        plans += [plan("rack", r, [topo.node_ranks[n][0] for n in nodes]) for r, nodes in enumerate(topo.racks)]
        plans.append(plan("spine", 0, topo.rack_leaders))
    return plans + [plan("world", 0, range(topo.size))]


def build_groups(topo, backend: str, make: Callable[[GroupPlan, Optional[int]], Optional[Communicator]]) -> "Groups":
    """Call ``make(plan, my_index)`` for every :func:`group_plans` entry in order (``my_index`` None where this
    rank is not a member: collective transports still create the group) and collect this rank's groups."""
    mine: dict = {}
    for plan in group_plans(topo):
        index = plan.member(topo.rank)
        comm = make(plan, index)
        if index is not None:
            mine[plan.tier] = comm
    return Groups(world=mine["world"], intra=mine["intra"], inter=mine.get("inter"), backend=backend,
                  rack=mine.get("rack"), spine=mine.get("spine"))


@dataclass
class Groups:
    """The groups of one backend, ChainerMN style. ``inter`` is ``None`` on non-leaders. With racks
    (``topo.rack_nodes``), ``rack`` is the node leaders of my rack and ``spine`` the rack leaders (``None`` where
    this rank is not a member, and everywhere without racks)."""
    world: Communicator
    intra: Communicator
    inter: Optional[Communicator]
    backend: str
    rack: Optional[Communicator] = None
    spine: Optional[Communicator] = None

    def leaders_then_node_(self, tensor: torch.Tensor, op: str, num_nodes: int) -> torch.Tensor:
        """The hierarchy's one pattern, in place: the leaders combine ``tensor`` across the ``num_nodes`` nodes
        (``op``: ``"sum"``, ``"avg"`` or ``"max"`` allreduce, ``"bor"``, or ``"broadcast"`` from node 0's
        leader), then each leader broadcasts the result within its node, so non-leaders never cross nodes.
        With one node a reduction moves nothing (the node's ranks already hold the node's value); a broadcast
        still reaches the node. Collective: every rank of the job calls it. Returns ``tensor``."""
        if num_nodes > 1:
            if self.inter is not None:   # a leader
                _combine_(self.inter, tensor, op)
            self.intra.broadcast_(tensor, root=0)
        elif op == "broadcast":
            self.intra.broadcast_(tensor, root=0)
        return tensor

    def racks_then_down_(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """:meth:`leaders_then_node_` over three tiers (racks): the node leaders of each rack combine ``tensor``
        over the rack's switch, the rack leaders across the spine, then it goes back down the rack and the node
        (a ``"broadcast"`` from rank 0 just goes down). Only rack leaders cross racks. Collective: every rank
        calls it. Returns ``tensor``."""
        if op == "broadcast":
            if self.spine is not None:
                self.spine.broadcast_(tensor, root=0)
        else:
            if self.rack is not None:
                _combine_(self.rack, tensor, op)
            if self.spine is not None:
                _combine_(self.spine, tensor, op)
        if self.rack is not None:
            self.rack.broadcast_(tensor, root=0)
        self.intra.broadcast_(tensor, root=0)
        return tensor


def _combine_(comm: Communicator, tensor: torch.Tensor, op: str) -> None:
    """``op`` on one group: a broadcast from its rank 0, a bitwise or, or an allreduce."""
    if op == "broadcast":
        comm.broadcast_(tensor, root=0)
    elif op == "bor":
        comm.bor_(tensor)
    else:
        comm.allreduce_(tensor, op)


def staged_on_cpu(fn):
    """Run a CPU-only transport on a tensor that may live on a GPU: copy there and back."""
    def wrapper(self, tensor, *args):
        if tensor.device.type == "cpu":
            return fn(self, tensor, *args)
        host = tensor.detach().cpu()
        out = fn(self, host, *args)
        if out is None:
            tensor.copy_(host)
            return None
        return [o.to(tensor.device) for o in out]
    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper
