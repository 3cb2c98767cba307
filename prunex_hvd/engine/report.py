"""The round's report and the engine's byte counts: what crossed node (and rack) boundaries, read from the ledger,
beside what the consensus payload and its dense counterfactual put on their carrier by the ring model.
"""
from __future__ import annotations

import torch

from ..dist.comm.accounting import ring_cross_node_bytes
from .buckets import BucketLayout

NO_BYTES = {"inter": 0, "intra": 0, "inter_consensus": 0, "dense_inter": 0, "cross_rack": 0}


class Traffic:
    """The bytes and exposed wait of every round so far (:attr:`bytes`, :attr:`exchange_wait_s`)."""

    def __init__(self, state, exchange):
        self.state, self.exchange = state, exchange
        self.ledger = exchange.ledger
        self.bytes = dict(NO_BYTES)
        self.exchange_wait_s = 0.0   # time ranks waited on the consensus exchange, all rounds

    def count(self, before: dict) -> tuple:
        """The bytes put on the wire since ``before`` (a ledger summary), added to :attr:`bytes`: what crossed
        node boundaries (``inter``), the rest (``intra``), and the part of ``inter`` that crossed racks
        (``cross_rack``). Returns (inter, intra, cross_rack)."""
        after, before = self.ledger.summary()["total"], before["total"]
        cross = after["cross_node_bytes"] - before["cross_node_bytes"]
        intra = after["wire_bytes"] - before["wire_bytes"] - cross
        cross_rack = after["cross_rack_bytes"] - before["cross_rack_bytes"]
        self.bytes["inter"] += cross
        self.bytes["intra"] += intra
        self.bytes["cross_rack"] += cross_rack
        return cross, intra, cross_rack

    def round(self, before: dict, seconds: float, payload: BucketLayout, wait: float, in_flight: bool,
              density: float) -> dict:
        """The round's report. Bytes as the ring model puts them on the wire: ``inter`` = what crossed node
        boundaries, ``intra`` = the rest. The consensus exchange and its dense counterfactual are counted on the
        group that carries it (the leaders; the one group of a flat consensus), so their ratio is exact;
        ``payload``: the round's compact buckets."""
        s = self.state
        cross, intra, cross_rack = self.count(before)
        dense_numel = self.exchange.dense.total_numel
        compact_numel = payload.total_numel
        if s.topo.num_nodes == 1:             # flat: every rank's dense θ+u sum is the exchange
            compact_numel = dense_numel
        hops = self.exchange.carriers()

        def on_carrier(numel: int, dtype: torch.dtype) -> int:
            total = 0
            for comm, op in hops:
                if comm is not None:   # None on ranks that send nothing across
                    sizes = [numel * comm.wire_dtype(dtype).itemsize] * comm.size
                    total += ring_cross_node_bytes(op, sizes, comm.rank, comm.nodes)
            return total
        consensus = on_carrier(compact_numel, payload.dtype if s.topo.num_nodes > 1 else s.dtype)
        dense = on_carrier(dense_numel, s.dtype)   # (in the model's dtype)
        self.bytes["inter_consensus"] += consensus
        self.bytes["dense_inter"] += dense
        self.exchange_wait_s += wait
        return {"round": s.round, "seconds": seconds, "exchange_wait_seconds": wait,
                "in_flight": in_flight, "inter_bytes": cross, "intra_bytes": intra,
                "consensus_bytes": consensus, "dense_inter_bytes": dense, "cross_rack_bytes": cross_rack,
                "density": density, "mask_drift": s.mask_drift, "frozen": s.frozen}
