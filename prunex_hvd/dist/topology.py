"""Who am I, which node am I on, am I the leader.

:func:`init` asks the launcher (Horovod, MPI or torchrun) for every rank's node, checks that all ranks agree,
and returns a :class:`Topology`. The grouping itself (:func:`group_nodes`) is a pure function of what every
rank reported, so every rank reaches the same answer, or the same error, without talking further.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, asdict
from typing import Hashable, Optional, Sequence, Tuple

ENV_RANKS_PER_NODE = "PRUNEX_RANKS_PER_NODE"


class TopologyError(ValueError):
    """The launch does not describe M nodes × P ranks, or the ranks disagree about it."""


@dataclass(frozen=True)
class Topology:
    rank: int
    size: int
    local_rank: int
    local_size: int
    node: int
    num_nodes: int
    node_ranks: Tuple[Tuple[int, ...], ...]  # world ranks of every node, in local-rank order
    launcher: str   # horovod | mpi | torchrun | single
    grouping: str   # how nodes were found: override | horovod-cross-rank | mpi-shared-memory | torchrun-group-rank | single

    @property
    def is_leader(self) -> bool:
        """Local rank 0 of its node: the rank that talks across nodes."""
        return self.local_rank == 0

    @property
    def leaders(self) -> Tuple[int, ...]:
        return tuple(ranks[0] for ranks in self.node_ranks)

    @property
    def local_ranks(self) -> Tuple[int, ...]:
        """World ranks of my node."""
        return self.node_ranks[self.node]

    def node_of(self, rank: int) -> int:
        for node, ranks in enumerate(self.node_ranks):
            if rank in ranks:
                return node
        raise ValueError(f"rank {rank} is not in a world of {self.size}")

    def flattened(self) -> "Topology":
        """The same ranks seen as one node: a flat consensus (every rank in one group, no leaders' tier)."""
        return Topology(rank=self.rank, size=self.size, local_rank=self.rank, local_size=self.size, node=0,
                        num_nodes=1, node_ranks=(tuple(range(self.size)),), launcher=self.launcher, grouping="flat")

    def as_dict(self) -> dict:
        d = asdict(self)
        d["node_ranks"] = [list(r) for r in self.node_ranks]
        d["is_leader"] = self.is_leader
        return d

    def __str__(self) -> str:
        return (f"rank {self.rank}/{self.size} node {self.node}/{self.num_nodes} local "
                f"{self.local_rank}/{self.local_size}{' leader' if self.is_leader else ''}")


def parse_ranks_per_node(value) -> Optional[int]:
    """``None``/``""``/``0`` mean no override; anything else must be a positive integer."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        n = int(value)
        if n != float(value):
            raise ValueError
    except (TypeError, ValueError):
        raise TopologyError(f"ranks_per_node must be a positive integer, got {value!r}") from None
    if n == 0:
        return None
    if n < 1:
        raise TopologyError(f"ranks_per_node must be a positive integer, got {value!r}")
    return n


def _fmt_ranks(ranks: Sequence[int]) -> str:
    ranks = list(ranks)
    return ",".join(map(str, ranks[:8])) + (",…" if len(ranks) > 8 else "")


def group_nodes(rank: int, reports: Sequence[Tuple[Hashable, Optional[int]]], launcher: str,
                grouping: str) -> Topology:
    """Build the topology from ``reports[r] = (node_key, ranks_per_node_override)`` of every rank ``r``.

    With an override, node = rank // ranks_per_node (the node keys are ignored). Nodes are numbered by their
    lowest rank; local ranks follow world-rank order. Raises :class:`TopologyError` (the same one on every
    rank, since every rank holds the same reports) for inconsistent overrides or unequal nodes."""
    size = len(reports)
    overrides = [o for _, o in reports]
    if len(set(overrides)) > 1:
        by_value = {}
        for r, o in enumerate(overrides):
            by_value.setdefault(o, []).append(r)
        detail = "; ".join(f"{'unset' if o is None else o} on ranks {_fmt_ranks(rs)}" for o, rs in by_value.items())
        raise TopologyError(f"ranks disagree about ranks_per_node ({ENV_RANKS_PER_NODE}): {detail}. "
                            "Set the same value on every rank (mpirun -x).")
    rpn = overrides[0] if size else None
    if rpn is not None:
        if size % rpn:
            raise TopologyError(f"ranks_per_node={rpn} does not divide the world size {size}: "
                                "every node needs the same number of ranks")
        keys = [r // rpn for r in range(size)]
        grouping = "override"
    else:
        keys = [k for k, _ in reports]
    members = {}
    for r, k in enumerate(keys):
        members.setdefault(k, []).append(r)
    node_ranks = tuple(tuple(rs) for rs in sorted(members.values(), key=lambda rs: rs[0]))
    counts = {len(rs) for rs in node_ranks}
    if len(counts) > 1:
        detail = "; ".join(f"node {i}: {len(rs)} rank{'s' if len(rs) > 1 else ''} ({_fmt_ranks(rs)})"
                           for i, rs in enumerate(node_ranks))
        raise TopologyError("heterogeneous nodes: H-SADMM needs the same number of ranks on every node, got "
                            f"{detail}. Launch the same number of slots per host (-H host1:4,host2:4) or set "
                            f"ranks_per_node / {ENV_RANKS_PER_NODE}.")
    node = next(i for i, rs in enumerate(node_ranks) if rank in rs)
    return Topology(rank=rank, size=size, local_rank=node_ranks[node].index(rank),
                    local_size=len(node_ranks[node]), node=node, num_nodes=len(node_ranks),
                    node_ranks=node_ranks, launcher=launcher, grouping=grouping)


def requested_ranks_per_node(ranks_per_node=None) -> Optional[int]:
    """The argument if given, else env ``PRUNEX_RANKS_PER_NODE``."""
    if ranks_per_node is None:
        ranks_per_node = os.environ.get(ENV_RANKS_PER_NODE)
    return parse_ranks_per_node(ranks_per_node)
