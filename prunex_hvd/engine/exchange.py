"""The exchange: every collective the engine issues, over the node and the leaders (two tiers), chosen once at
construction (three tiers: :mod:`prunex_hvd.engine.racks`), each tagged in the ledger.

Non-leaders never cross nodes: whatever goes job-wide goes up to the node's leader, across the leaders, and back
down the node.
"""
from __future__ import annotations

import contextlib
import time
from typing import List, Optional

import torch

from ..dist.comm.accounting import ledger as default_ledger
from .buckets import BucketLayout
from .codec import PayloadCodec
from .state import ConsensusState
from .verdict import nonfinite


class Exchange:
    """Two tiers: the node's ranks (``groups.intra``) and the node leaders (``groups.inter``, None elsewhere)."""

    def __init__(self, state: ConsensusState, groups, ledger=None):
        self.state, self.groups = state, groups
        self.topo = state.topo
        self.ledger = ledger or default_ledger()
        self.dense: Optional[BucketLayout] = None   # θ + u and the float buffers, summed over the node (phase 1)
        self.in_flight: list = []   # the leaders' async average (overlap), until received

    # -- whole-job collectives ------------------------------------------------------------------------------
    def tree_(self, tensor: torch.Tensor, op: str, tag: Optional[str] = None) -> torch.Tensor:
        """Combine ``tensor`` over the whole hierarchy and hand the result to every rank (collective), its traffic
        under ``tag`` when given."""
        with self.ledger.tagged(tag) if tag else contextlib.nullcontext():
            return self._combine_(tensor, op)

    def _combine_(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """The leaders across nodes, then each leader to its node."""
        return self.groups.leaders_then_node_(tensor, op, self.topo.num_nodes)

    def up_the_tree_(self, tensor: torch.Tensor) -> None:
        """The node leaders' part of :meth:`tree_` for a sum, without the hand-down into the node. An average in
        flight on the leaders' group completes first: a group's collectives run in the order they were issued
        (the next round's guard meets the leaders before the round in flight is folded in)."""
        self._complete_in_flight()
        if self.groups.inter is not None:
            self.groups.inter.allreduce_(tensor, "sum")

    def _complete_in_flight(self) -> None:
        with self.ledger.tagged("consensus"):
            for work in self.in_flight:
                work.wait()

    def sum_over_job(self, local: torch.Tensor) -> torch.Tensor:
        """Sum a small float64 tensor over every rank, hierarchically (non-leaders never cross nodes). It
        travels on the model's device, so a CUDA model's round stays on NCCL."""
        local = local.to(self.state.device)
        with self.ledger.tagged("residuals"):
            self.groups.intra.allreduce_(local, "sum")
            self.tree_(local, "sum")
        return local.cpu()

    def broadcast_model(self) -> None:
        """Rank 0's parameters and float buffers to everyone, leaders first: nothing but the leaders crosses
        nodes (the world group would route through non-leaders)."""
        s = self.state
        tensors = [p.detach() for _, p in s.params] + [b for _, b in s.buffers]
        layout = s.layout([p.numel() for _, p in s.params])
        with self.ledger.tagged("broadcast-init"):
            for k, t in enumerate(tensors):
                layout.views[k].copy_(t.reshape(-1))
            for buf in layout.buffers:
                self.tree_(buf, "broadcast")
            for k, t in enumerate(tensors):
                t.copy_(layout.views[k].view_as(t))

    # -- a change of nodes (:mod:`.joining`) -------------------------------------------------------------------
    def job_rows(self, row: torch.Tensor) -> torch.Tensor:
        """Every rank's small ``row``, stacked in rank order (over the world group: once per change of nodes)."""
        with self.ledger.tagged("welcome"):
            rows = self.groups.world.allgather(row.to(self.state.device), same_shape=True)
        return torch.stack([r.cpu() for r in rows])

    def from_rank_(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """``tensor`` as world rank ``rank`` holds it, on every rank, in place (over the world group)."""
        world = self.groups.world
        with self.ledger.tagged("welcome"):
            return world.broadcast_(tensor, root=list(world.ranks).index(rank))

    # -- within the node ------------------------------------------------------------------------------------
    def node_sum_(self, tensor: torch.Tensor) -> None:
        self.groups.intra.allreduce_(tensor, "sum")

    def node_broadcast_(self, tensor: torch.Tensor) -> None:
        """The node leader's ``tensor`` to the node's ranks."""
        self.groups.intra.broadcast_(tensor, root=0)

    def node_average_grads(self, layout: BucketLayout) -> None:
        """``node_sync``: the gradient buckets averaged over the node's ranks."""
        with self.ledger.tagged("node-sync"):
            for buf in layout.buffers:
                self.groups.intra.allreduce_(buf, "avg")

    def intra_sum(self) -> List[bool]:
        """Phase 1: θ + u (and the float buffers) into the dense buckets, summed over the node. Returns this
        rank's own inf/NaN flags, looked for before the sum mixes them in (or a pruned entry hides them)."""
        s = self.state
        if self.dense is None:
            self.dense = s.layout([e.param.numel() for e in s.entries])
        n = len(s.entries)
        for k, e in enumerate(s.entries):
            if s.state_dtype == s.dtype:
                torch.add(e.param.detach().reshape(-1), e.u.reshape(-1), out=self.dense.views[k])
            else:   # added in float32, rounded once to the payload
                self.dense.views[k].copy_(e.param.detach().reshape(-1)).add_(e.u.reshape(-1))
        for j, (_, b) in enumerate(s.buffers):
            self.dense.views[n + j].copy_(b.reshape(-1))
        flags = nonfinite(self.dense, n)
        with self.ledger.tagged("intra-sum"):
            for buf in self.dense.buffers:
                self.groups.intra.allreduce_(buf, "sum")
        return flags

    # -- the consensus exchange (phase 4) -------------------------------------------------------------------
    def average(self, layout: BucketLayout, codec: PayloadCodec, gathers: dict) -> Optional[List[torch.Tensor]]:
        """Phase 4: the compact buckets averaged among the leaders and handed to each node. Returns the new
        consensus between the node and the top (none with two tiers)."""
        with self.ledger.tagged("consensus"):
            for buf in layout.buffers:
                self.groups.leaders_then_node_(buf, "avg", self.topo.num_nodes)
        return None

    def start(self, layout: BucketLayout) -> list:
        """Phase 4 left in flight (``overlap``): the leaders' average started; the handles to wait on."""
        with self.ledger.tagged("consensus"):
            self.in_flight = [self.groups.inter.allreduce_async_(buf, "avg") for buf in layout.buffers] \
                if self.groups.inter is not None else []
        return self.in_flight

    def receive(self, works: list, layout: BucketLayout) -> float:
        """The average started by :meth:`start` completes: the leaders wait for it, then hand it to their node.
        Returns the seconds the leaders' average kept this rank waiting, here or in an earlier wait."""
        waited_before = sum(work.wait_seconds for work in works if work.completed)
        t0 = time.perf_counter()
        with self.ledger.tagged("consensus"):
            for work in works:
                work.wait()
            for buf in layout.buffers:
                self.groups.intra.broadcast_(buf, root=0)
        self.in_flight = []
        return waited_before + time.perf_counter() - t0

    # -- what the consensus exchange carries, counted on its carrier ----------------------------------------
    def carriers(self) -> list:
        """The (group, op) hops the consensus payload takes across nodes (for the bytes' ring model); a single
        node's flat consensus is carried by the node group."""
        return [(self.groups.inter if self.topo.num_nodes > 1 else self.groups.intra, "allreduce")]

