"""Byte and time accounting shared by every backend.

Every collective that goes through a :class:`~prunex_hvd.dist.comm.base.Communicator` leaves one record here:
the op, the group's tier (``intra`` / ``inter`` / ``world``), the payload this rank put into the collective,
the seconds it took, and the bytes this rank *sends across node boundaries* under a ring model of the
collective's algorithm.

The ring model ("say how"):

* the group's members form a ring in group-rank order; rank ``k`` sends only to ``k+1 (mod n)``;
* allreduce (and the bitwise-or of masks, an allreduce too): reduce-scatter + allgather, each rank sends
  ``2 (n-1)/n · B`` bytes;
* allgather of blocks ``B_0 … B_{n-1}``: each rank forwards every block but its successor's,
  ``Σ B - B_{k+1}`` bytes;
* broadcast: a pipeline chain starting at the root, every member but the last in the chain sends ``B``;
* a rank's sent bytes cross a node boundary when its successor lives on another node.

On the leaders' group (one rank per node) every link is inter-node; on an intra-node group none is; on the
world group of emulated nodes with contiguous ranks, ``M`` of the ``N`` ring links cross. For two nodes the
model is exact for any allreduce algorithm (each leader sends ``B`` and receives ``B``).
"""
from __future__ import annotations

import threading
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, asdict
from typing import Dict, List, Sequence, Optional

TIERS = ("intra", "inter", "rack", "spine", "world")


@dataclass(frozen=True)
class CommRecord:
    op: str
    tier: str
    backend: str
    payload_bytes: int   # what this rank put into the collective (its message size)
    wire_bytes: int      # what this rank sends under the ring model
    cross_node_bytes: int  # the part of wire_bytes that crosses a node boundary
    seconds: float
    tag: str = ""        # what the traffic was for (set with CommLedger.tagged), e.g. "consensus"
    cross_rack_bytes: Optional[int] = None   # the part that crosses a rack boundary (None: every node a rack)


def ring_sent_bytes(op: str, nbytes: Sequence[int], index: int, root: int = 0) -> int:
    """Bytes the member at ``index`` sends for ``op`` on a ring of ``len(nbytes)`` members.

    ``nbytes[k]`` is member k's payload (all equal except for an unequal allgather)."""
    n = len(nbytes)
    if n <= 1:
        return 0
    if op in ("allreduce", "bor"):
        return 2 * (n - 1) * nbytes[index] // n
    if op == "allgather":
        return sum(nbytes) - nbytes[(index + 1) % n]
    if op == "broadcast":
        # chain root -> root+1 -> ... ; the member just before the root (the chain's last) sends nothing
        return 0 if (index + 1) % n == root % n else nbytes[index]
    if op == "barrier":
        return 0
    raise ValueError(f"no traffic model for op {op!r}")


def ring_cross_node_bytes(op: str, nbytes: Sequence[int], index: int, nodes: Sequence[int],
                          root: int = 0) -> int:
    """The part of :func:`ring_sent_bytes` that leaves the node (successor on another node)."""
    n = len(nodes)
    if n <= 1 or nodes[index] == nodes[(index + 1) % n]:
        return 0
    return ring_sent_bytes(op, nbytes, index, root)


def record_ring(group, op: str, sizes: Sequence[int], seconds: float, tag: str, root: int = 0,
                backend: Optional[str] = None, model_op: Optional[str] = None) -> CommRecord:
    """Add to ``group.ledger`` the record of ``op`` by ``group`` (a communicator: its tier, backend, rank, nodes
    and racks), member k sending ``sizes[k]`` bytes, as the ring model of ``model_op`` (default ``op``) puts it on
    the wire; ``backend`` overrides the group's (the transport that moved the bytes). Returns the record."""
    model_op = model_op or op
    rec = CommRecord(
        op=op, tier=group.tier, backend=backend or group.backend, payload_bytes=sizes[group.rank],
        wire_bytes=ring_sent_bytes(model_op, sizes, group.rank, root),
        cross_node_bytes=ring_cross_node_bytes(model_op, sizes, group.rank, group.nodes, root),
        seconds=seconds, tag=tag,
        cross_rack_bytes=ring_cross_node_bytes(model_op, sizes, group.rank, group.racks, root))
    group.ledger.add(rec)
    return rec


class CommLedger:
    """Per-process totals by tier and op. Thread-safe; cheap enough to stay on in production.

    ``keep_records=True`` also keeps every :class:`CommRecord` (tests, debugging)."""

    def __init__(self, keep_records: bool = False):
        self._lock = threading.Lock()
        self._local = threading.local()
        self.keep_records = keep_records
        self.reset()

    @property
    def current_tag(self) -> str:
        return getattr(self._local, "tag", "")

    @contextmanager
    def tagged(self, tag: str):
        """Label the collectives issued inside the block; ``summary(by_op=True)`` keys them ``op[tag]``."""
        before = self.current_tag
        self._local.tag = tag
        try:
            yield
        finally:
            self._local.tag = before

    def reset(self) -> None:
        with self._lock:
            self._totals: Dict[tuple, List[float]] = defaultdict(lambda: [0, 0, 0, 0, 0.0, 0])
            self.records: List[CommRecord] = []

    def add(self, rec: CommRecord) -> None:
        with self._lock:
            t = self._totals[(rec.tier, f"{rec.op}[{rec.tag}]" if rec.tag else rec.op)]
            t[0] += 1
            t[1] += rec.payload_bytes
            t[2] += rec.wire_bytes
            t[3] += rec.cross_node_bytes
            t[4] += rec.seconds
            t[5] += rec.cross_node_bytes if rec.cross_rack_bytes is None else rec.cross_rack_bytes
            if self.keep_records:
                self.records.append(rec)

    def summary(self, by_op: bool = False) -> Dict[str, dict]:
        """``{tier: {ops, payload_bytes, wire_bytes, cross_node_bytes, seconds, cross_rack_bytes}}`` plus
        ``total``.

        With ``by_op=True`` each tier also carries ``by_op: {op: {...}}`` (``op[tag]`` for tagged traffic)."""
        keys = ("ops", "payload_bytes", "wire_bytes", "cross_node_bytes", "seconds", "cross_rack_bytes")
        out = {tier: dict.fromkeys(keys, 0) for tier in TIERS + ("total",)}
        with self._lock:
            items = [(k, list(v)) for k, v in self._totals.items()]
        for (tier, op), vals in items:
            for dest in (out[tier], out["total"]):
                for k, v in zip(keys, vals):
                    dest[k] += v
            if by_op:
                out[tier].setdefault("by_op", {})[op] = dict(zip(keys, vals))
        for tier in out.values():
            tier["seconds"] = float(tier["seconds"])
        return out


_default_ledger = CommLedger()


def ledger() -> CommLedger:
    """The process-wide ledger every communicator writes to unless given its own."""
    return _default_ledger


def summary(by_op: bool = False) -> Dict[str, dict]:
    return _default_ledger.summary(by_op)


def reset() -> None:
    _default_ledger.reset()


def tagged(tag: str):
    """``with px.comm.tagged("consensus"): ...`` labels the traffic of the block in the default ledger."""
    return _default_ledger.tagged(tag)


def record_dict(rec: CommRecord) -> dict:
    return asdict(rec)
