"""Who am I, which node and rack am I on, am I the leader.

:func:`init` asks the launcher (Horovod, MPI or torchrun) for every rank's node, checks that all ranks agree,
and returns a :class:`Topology`. The grouping itself (:func:`group_nodes`) is a pure function of what every
rank reported, so every rank reaches the same answer, or the same error, without talking further.

Racks group nodes (a leaf switch's nodes): from ``nodes_per_rack`` (``PRUNEX_NODES_PER_RACK``: consecutive
nodes), else from Slurm's switch topology (``SLURM_TOPOLOGY_ADDR``: nodes under one leaf switch), else every
node is its own rack, which is the two-tier hierarchy.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, asdict
from typing import Hashable, Optional, Sequence, Tuple

ENV_RANKS_PER_NODE = "PRUNEX_RANKS_PER_NODE"
ENV_NODES_PER_RACK = "PRUNEX_NODES_PER_RACK"


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
    rack_nodes: Tuple[Tuple[int, ...], ...] = ()   # the nodes of every rack; () = every node its own rack

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

    @property
    def racks(self) -> Tuple[Tuple[int, ...], ...]:
        """The nodes of every rack, racks numbered by their lowest node."""
        return self.rack_nodes or tuple((i,) for i in range(self.num_nodes))

    @property
    def num_racks(self) -> int:
        return len(self.racks)

    @property
    def nodes_per_rack(self) -> int:
        return len(self.racks[0])

    def rack_of(self, node: int) -> int:
        return next(r for r, nodes in enumerate(self.racks) if node in nodes)

    @property
    def rack(self) -> int:
        return self.rack_of(self.node)

    @property
    def rack_node_leaders(self) -> Tuple[int, ...]:
        """World ranks of the node leaders of my rack: the group that forms the rack consensus."""
        return tuple(self.node_ranks[n][0] for n in self.racks[self.rack])

    @property
    def rack_leaders(self) -> Tuple[int, ...]:
        """World ranks of every rack's leader (its first node's leader): the only ranks that cross racks."""
        return tuple(self.node_ranks[nodes[0]][0] for nodes in self.racks)

    @property
    def is_rack_leader(self) -> bool:
        return self.rank in self.rack_leaders

    def flattened(self) -> "Topology":
        """The same ranks seen as one node: a flat consensus (every rank in one group, no leaders' tier)."""
        return Topology(rank=self.rank, size=self.size, local_rank=self.rank, local_size=self.size, node=0,
                        num_nodes=1, node_ranks=(tuple(range(self.size)),), launcher=self.launcher, grouping="flat")

    def as_dict(self) -> dict:
        d = asdict(self)
        d["node_ranks"] = [list(r) for r in self.node_ranks]
        d["is_leader"] = self.is_leader
        d["rack_nodes"] = [list(r) for r in self.racks]
        d.update(rack=self.rack, num_racks=self.num_racks, is_rack_leader=self.is_rack_leader)
        return d

    def __str__(self) -> str:
        racks = f" rack {self.rack}/{self.num_racks}" if self.rack_nodes else ""
        return (f"rank {self.rank}/{self.size} node {self.node}/{self.num_nodes}{racks} local "
                f"{self.local_rank}/{self.local_size}{' leader' if self.is_leader else ''}")


def _parse_count(value, name: str) -> Optional[int]:
    """``None``/``""``/``0`` mean no override; anything else must be a positive integer."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        n = int(value)
        if n != float(value):
            raise ValueError
    except (TypeError, ValueError):
        raise TopologyError(f"{name} must be a positive integer, got {value!r}") from None
    if n == 0:
        return None
    if n < 1:
        raise TopologyError(f"{name} must be a positive integer, got {value!r}")
    return n


def parse_ranks_per_node(value) -> Optional[int]:
    return _parse_count(value, "ranks_per_node")


def parse_nodes_per_rack(value) -> Optional[int]:
    return _parse_count(value, "nodes_per_rack")


def slurm_rack_key(environ=os.environ) -> Optional[str]:
    """This host's leaf switch from Slurm's tree topology (``SLURM_TOPOLOGY_ADDR`` = "spine.leaf.host"): the
    address without its last part, or None where Slurm gives no switch above the host."""
    addr = environ.get("SLURM_TOPOLOGY_ADDR", "")
    parts = addr.split(".")
    return ".".join(parts[:-1]) if len(parts) > 1 and all(parts) else None


def _fmt_ranks(ranks: Sequence[int]) -> str:
    ranks = list(ranks)
    return ",".join(map(str, ranks[:8])) + (",…" if len(ranks) > 8 else "")


def group_nodes(rank: int, reports: Sequence[tuple], launcher: str, grouping: str) -> Topology:
    """Build the topology from ``reports[r] = (node_key, ranks_per_node[, nodes_per_rack, rack_key])`` of every
    rank ``r`` (the overrides as each rank parsed them; ``rack_key``: :func:`slurm_rack_key`).

    With an override, node = rank // ranks_per_node (the node keys are ignored). Nodes are numbered by their
    lowest rank; local ranks follow world-rank order. Racks: rack = node // nodes_per_rack with that override,
    else nodes grouped by rack key when every rank has one, else one rack per node. Raises
    :class:`TopologyError` (the same one on every rank, since every rank holds the same reports) for
    inconsistent overrides, unequal nodes or unequal racks."""
    size = len(reports)
    reports = [tuple(r) + (None,) * (4 - len(r)) for r in reports]
    rpn = _agreed_override([r[1] for r in reports], "ranks_per_node", ENV_RANKS_PER_NODE)
    if rpn is not None:
        if size % rpn:
            raise TopologyError(f"ranks_per_node={rpn} does not divide the world size {size}: "
                                "every node needs the same number of ranks")
        keys = [r // rpn for r in range(size)]
        grouping = "override"
    else:
        keys = [r[0] for r in reports]
    node_ranks = _groups_by_key(keys)
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
                    node_ranks=node_ranks, launcher=launcher, grouping=grouping,
                    rack_nodes=_group_racks(node_ranks, [r[2] for r in reports], [r[3] for r in reports]))


def _groups_by_key(keys: Sequence[Hashable]) -> Tuple[Tuple[int, ...], ...]:
    """The indices sharing each key, in index order; the groups numbered by their lowest index."""
    members = {}
    for i, k in enumerate(keys):
        members.setdefault(k, []).append(i)
    return tuple(tuple(ms) for ms in sorted(members.values(), key=lambda ms: ms[0]))


def _agreed_override(values: Sequence[Optional[int]], name: str, env: str) -> Optional[int]:
    if len(set(values)) > 1:
        by_value = {}
        for r, o in enumerate(values):
            by_value.setdefault(o, []).append(r)
        detail = "; ".join(f"{'unset' if o is None else o} on ranks {_fmt_ranks(rs)}" for o, rs in by_value.items())
        raise TopologyError(f"ranks disagree about {name} ({env}): {detail}. "
                            "Set the same value on every rank (mpirun -x).")
    return values[0] if values else None


def _group_racks(node_ranks, overrides, keys) -> Tuple[Tuple[int, ...], ...]:
    """The nodes of every rack (see :func:`group_nodes`); () when every node is its own rack."""
    npr = _agreed_override(overrides, "nodes_per_rack", ENV_NODES_PER_RACK)
    num_nodes = len(node_ranks)
    if npr is not None:
        if num_nodes % npr:
            raise TopologyError(f"nodes_per_rack={npr} does not divide the {num_nodes} nodes: every rack needs "
                                "the same number of nodes")
        racks = tuple(tuple(range(r, r + npr)) for r in range(0, num_nodes, npr))
    elif any(k is not None for k in keys):
        node_key = []
        for i, ranks in enumerate(node_ranks):
            seen = {keys[r] for r in ranks}
            if len(seen) > 1 or None in seen:
                raise TopologyError(f"the ranks of node {i} ({_fmt_ranks(ranks)}) report different racks "
                                    f"(SLURM_TOPOLOGY_ADDR's switches: {sorted(map(str, seen))}); set "
                                    f"nodes_per_rack / {ENV_NODES_PER_RACK}")
            node_key.append(seen.pop())
        racks = _groups_by_key(node_key)
    else:
        return ()
    if len({len(ns) for ns in racks}) > 1:
        detail = "; ".join(f"rack {r}: {len(ns)} node{'s' if len(ns) > 1 else ''} ({_fmt_ranks(ns)})"
                           for r, ns in enumerate(racks))
        raise TopologyError(f"racks of different sizes: the rack tier needs the same number of nodes in every "
                            f"rack, got {detail}. Set nodes_per_rack / {ENV_NODES_PER_RACK}.")
    return () if len(racks[0]) == 1 else racks


def requested_ranks_per_node(ranks_per_node=None) -> Optional[int]:
    """The argument if given, else env ``PRUNEX_RANKS_PER_NODE``."""
    if ranks_per_node is None:
        ranks_per_node = os.environ.get(ENV_RANKS_PER_NODE)
    return parse_ranks_per_node(ranks_per_node)


def requested_nodes_per_rack(nodes_per_rack=None) -> Optional[int]:
    """The argument if given, else env ``PRUNEX_NODES_PER_RACK``."""
    if nodes_per_rack is None:
        nodes_per_rack = os.environ.get(ENV_NODES_PER_RACK)
    return parse_nodes_per_rack(nodes_per_rack)
