"""An in-process backend for tests and debugging: M×P ranks as Python threads of one process.

    cluster = thread_cluster(num_nodes=2, local_size=2)
    # in rank r's thread (tests/threaded.py's run_ranks starts them):
    topo, groups, ledger = cluster[r]
    groups.intra.allreduce_(t, "sum")

Not a launcher backend (it is not in ``prunex_hvd.dist.comm.BACKENDS``): it lets a test run the engine's real
collectives over any M×P layout in one process, in seconds, with a debugger attached. The public methods,
their validation and their byte accounting are :class:`~prunex_hvd.dist.comm.base.Communicator`'s, so each rank's
own :class:`~prunex_hvd.dist.comm.accounting.CommLedger` reads as it would under mpirun with the same layout.

Each group is a rendezvous: a :class:`threading.Barrier` over its members and one slot per member. A
collective deposits its tensor, waits, reads every slot into a result of its own (sums in group-rank order,
so every member's is bit-identical), waits again (nobody may touch its tensor before all have read it), then
writes its own tensor. Members calling different collectives on one group raise the same error together. A
barrier that times out, or :meth:`ThreadCluster.abort` (a rank failed), breaks every barrier of the cluster:
the other ranks raise :class:`ClusterAborted` at once instead of hanging.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch

from ..topology import Topology, group_nodes
from .accounting import CommLedger
from .base import Communicator, Groups, build_groups, group_plans

DEFAULT_TIMEOUT_S = 120.0


class ClusterAborted(RuntimeError):
    """Another rank of the thread cluster failed, or a collective waited past the timeout."""


class _Rendezvous:
    """Where the members of one group meet: a barrier and a slot per member."""

    def __init__(self, cluster: "ThreadCluster", name: str, size: int):
        self.cluster, self.name = cluster, name
        self.barrier = threading.Barrier(size, timeout=cluster.timeout)
        self.slots: List[Optional[tuple]] = [None] * size

    def exchange(self, index: int, kind: str, tensor: Optional[torch.Tensor], read: Callable, check_shapes: bool):
        """Deposit ``(kind, tensor)``, wait for every member, return ``read(tensors in group order)``: each
        member runs ``read`` itself and must not return views of the others' tensors."""
        self.slots[index] = (kind, tensor)
        self._wait(kind)
        out = error = None
        try:
            _check_same_collective(self.name, kind, self.slots, check_shapes)   # the same verdict on every member
            out = read([t for _, t in self.slots])
        except Exception as exc:   # raised after the second wait: a member leaving early would deposit anew
            error = exc            # while the others still read
        self._wait(kind)   # every member has read: the slots and tensors may change again
        if error is not None:
            raise error
        return out

    def _wait(self, kind: str) -> None:
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            self.cluster.abort(f"{kind} on the {self.name} group waited more than {self.cluster.timeout:g} s "
                               "for its other members")
            raise ClusterAborted(f"{kind} on the {self.name} group stopped: {self.cluster.abort_reason}") from None


def _check_same_collective(group: str, kind: str, slots: Sequence[tuple], check_shapes: bool) -> None:
    kinds = [k for k, _ in slots]
    if len(set(kinds)) > 1:
        raise RuntimeError(f"members of the {group} group called different collectives: "
                           + "; ".join(f"member {i}: {k}" for i, k in enumerate(kinds)))
    if check_shapes:
        shapes = [(tuple(t.shape), t.dtype) for _, t in slots]
        if len(set(shapes)) > 1:
            raise ValueError(f"{kind} on the {group} group: members sent different tensors: "
                             + "; ".join(f"member {i}: {s} {d}" for i, (s, d) in enumerate(shapes)))


def _reduce(tensors: List[torch.Tensor], op: str) -> torch.Tensor:
    """Reduce in group order: every member does the same operations on the same inputs."""
    out = tensors[0].clone()
    for t in tensors[1:]:
        t = t.to(out.device)
        if op in ("sum", "avg"):
            out.add_(t)
        elif op == "max":
            torch.maximum(out, t, out=out)
        else:   # "bor"
            out.bitwise_or_(t)
    return out.div_(len(tensors)) if op == "avg" else out


class ThreadCommunicator(Communicator):
    """One group of a :class:`ThreadCluster`, seen by one member (one thread)."""

    backend = "threads"
    has_bor = True

    def __init__(self, rendezvous: _Rendezvous, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._meeting = rendezvous

    def _meet(self, kind, tensor, read, check_shapes=True):
        return self._meeting.exchange(self.rank, kind, tensor, read, check_shapes)

    def _allreduce(self, tensor, op):
        tensor.copy_(self._meet(f"allreduce {op}", tensor, lambda ts: _reduce(ts, op)))

    def _bor(self, mask):
        mask.copy_(self._meet("bor", mask, lambda ts: _reduce(ts, "bor")))

    def _broadcast(self, tensor, root):
        tensor.copy_(self._meet(f"broadcast from {root}", tensor, lambda ts: ts[root].to(tensor.device, copy=True)))

    def _allgather_equal(self, tensor) -> List[torch.Tensor]:
        return self._meet("allgather", tensor, lambda ts: [t.to(tensor.device, copy=True) for t in ts])

    def _allgather_unequal(self, tensor, dims) -> List[torch.Tensor]:
        return self._meet("allgather", tensor, lambda ts: [t.to(tensor.device, copy=True) for t in ts],
                          check_shapes=False)

    def _barrier(self):
        self._meet("barrier", None, lambda ts: None, check_shapes=False)


@dataclass(frozen=True)
class ThreadRank:
    """What one rank's thread works with: its topology, its groups, and its own ledger."""
    topo: Topology
    groups: Groups
    ledger: CommLedger

    def __iter__(self):   # topo, groups, ledger = cluster[r]
        return iter((self.topo, self.groups, self.ledger))


class ThreadCluster:
    """M nodes × P ranks in one process: ``cluster[r]`` is rank r's :class:`ThreadRank`. Each rank must run
    in a thread of its own (``tests/threaded.py``'s ``run_ranks``); groups are every backend's
    (:func:`~prunex_hvd.dist.comm.base.group_plans`): world, the node's ranks, the leaders (``None`` on
    non-leaders), and with ``nodes_per_rack`` the rack and spine groups."""

    def __init__(self, num_nodes: int, local_size: int, timeout: float = DEFAULT_TIMEOUT_S,
                 keep_records: bool = False, nodes_per_rack: Optional[int] = None):
        if num_nodes < 1 or local_size < 1:
            raise ValueError(f"a thread cluster needs at least 1 node × 1 rank, got {num_nodes} × {local_size}")
        self.timeout = timeout
        self.abort_reason: Optional[str] = None
        self._lock = threading.Lock()
        size = num_nodes * local_size
        reports = [(r // local_size, None, nodes_per_rack, None) for r in range(size)]
        topos = [group_nodes(r, reports, launcher="single", grouping="threads") for r in range(size)]
        self._meetings = {(p.tier, p.index): _Rendezvous(self, f"{p.tier} ({p.index})", len(p.ranks))
                          for p in group_plans(topos[0])}
        self.ranks: List[ThreadRank] = []
        for topo in topos:
            ledger = CommLedger(keep_records=keep_records)

            def make(plan, index, ledger=ledger):
                return None if index is None else ThreadCommunicator(
                    self._meetings[plan.tier, plan.index], plan.tier, plan.ranks, plan.nodes, index, ledger,
                    racks=plan.racks)
            self.ranks.append(ThreadRank(topo, build_groups(topo, "threads", make), ledger))

    def __len__(self) -> int:
        return len(self.ranks)

    def __getitem__(self, rank: int) -> ThreadRank:
        return self.ranks[rank]

    def __iter__(self):
        return iter(self.ranks)

    def abort(self, reason: str = "aborted") -> None:
        """Break every group's barrier: ranks waiting in a collective, or entering one later, raise
        :class:`ClusterAborted`. The first reason given is kept. The cluster cannot be used afterwards."""
        with self._lock:
            if self.abort_reason is None:
                self.abort_reason = reason
        for meeting in self._meetings.values():
            meeting.barrier.abort()

    @property
    def aborted(self) -> bool:
        return self.abort_reason is not None


def thread_cluster(num_nodes: int, local_size: int, timeout: float = DEFAULT_TIMEOUT_S,
                   keep_records: bool = False, nodes_per_rack: Optional[int] = None) -> ThreadCluster:
    """``num_nodes`` × ``local_size`` ranks for threads of this process, each with its own ledger
    (``keep_records=True`` keeps every record); ``nodes_per_rack`` groups the nodes into racks. A collective
    waiting ``timeout`` seconds aborts the cluster."""
    return ThreadCluster(num_nodes, local_size, timeout, keep_records, nodes_per_rack)
