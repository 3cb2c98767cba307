"""The rack tier's exchange: θ → z_i → w_r → z, the nodes of a rack meeting at the rack's consensus w_r and the rack
leaders across the spine (docs/algorithm.md, "A third tier: racks").
"""
from __future__ import annotations

from typing import List

import torch

from . import admm, sparsity
from .buckets import BucketLayout
from .codec import PayloadCodec
from .exchange import Exchange


class RackExchange(Exchange):
    """Three tiers: the node (``groups.intra``), the node leaders of a rack (``groups.rack``), the rack leaders
    (``groups.spine``). No overlapped exchange (it would need its own fold per tier)."""

    def __init__(self, state, groups, ledger=None):
        super().__init__(state, groups, ledger)
        topo = self.topo
        if (topo.is_leader and groups.rack is None) or (topo.is_rack_leader and groups.spine is None):
            raise RuntimeError(f"the {groups.backend} backend made no rack or spine group for rank "
                               f"{topo.rank}, a {'rack' if topo.is_rack_leader else 'node'} leader")
        if state.config.overlap is not False:
            raise ValueError(f"the rack tier ({topo.num_racks} racks of {topo.nodes_per_rack} nodes) does not "
                             f"support overlap={state.config.overlap!r}: turn it off, or set rack_tier=False for "
                             f"two tiers over all nodes")

    def _combine_(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """Over the nodes of each rack, then the rack leaders across the spine, and back down the rack and the
        node."""
        return self.groups.racks_then_down_(tensor, op)

    def up_the_tree_(self, tensor: torch.Tensor) -> None:
        """A sum over the rack, across the spine and back down the rack (not into the node)."""
        for comm in (self.groups.rack, self.groups.spine):
            if comm is not None:
                comm.allreduce_(tensor, "sum")
        if self.groups.rack is not None:
            self.groups.rack.broadcast_(tensor, root=0)

    def average(self, layout: BucketLayout, codec: PayloadCodec, gathers: dict) -> List[torch.Tensor]:
        """Phase 4 with racks, on the compact buckets the node leaders filled with z_i + v_i: (a) the node leaders
        of each rack sum them over the rack's switch and hand the sum to their node; (b) every rank forms its
        rack's candidate w_r from it, on the global support; (c) the rack leaders average w_r + t_r across the
        spine, in the same buckets (the sum has been read), and the average goes back down the rack and the
        node. The float buffers ride along: each rack's mean of its nodes' means, then the mean over racks. A
        narrow payload carries changes at both levels, each against its sender's own base: z_i + v_i − s_i into
        the rack (the rack's sum recovered from the sum of its nodes' bases, which every rank of the rack keeps),
        w_r + t_r − s_r across the spine. Returns the new w_r; ``layout`` then holds z's payload."""
        s = self.state
        N, n = self.topo.nodes_per_rack, len(s.entries)
        codec.pending_spine = []
        with self.ledger.tagged("consensus"):         # (a) Σ_{i∈r}(z_i + v_i), compact
            for buf in layout.buffers:
                if self.groups.rack is not None:
                    self.groups.rack.allreduce_(buf, "sum")
                self.groups.intra.broadcast_(buf, root=0)
        w_new = []                                    # (b) the rack candidate, the same on every rank of the rack
        sums = codec.recover(layout, gathers, [e.rack_sum for e in s.entries] if s.delta_coded else None)
        codec.pending_rack = sums if s.delta_coded else None
        for e, rack_sum in zip(s.entries, sums):
            w = admm.rack_candidate(rack_sum, e.z, e.t, e.rho2, e.rho3, N)
            w_new.append(sparsity.apply_masks(w, e.rows, e.cols) if e.structured else w)
        if self.topo.is_rack_leader:                  # (c) w_r + t_r across the spine, compact
            for k, e in enumerate(s.entries):
                c = w_new[k] + e.t
                c = codec.encode(c, e.sent_spine, e, codec.pending_spine) if s.delta_coded \
                    else c.to(s.payload_dtype)
                codec.put(layout, k, e, c)
        for j in range(len(s.buffers)):               # the rack's mean (of the nodes' changes, narrow)
            if s.delta_coded and self.topo.is_rack_leader:
                layout.views[n + j].copy_(codec.encode_average(layout.views[n + j].to(s.state_dtype).div_(N), 0.0,
                                                               s.buffer_ef_spine[j], codec.pending_spine))
            elif not s.delta_coded:
                layout.views[n + j].div_(N)
        with self.ledger.tagged("consensus"):
            for buf in layout.buffers:
                if self.groups.spine is not None:
                    self.groups.spine.allreduce_(buf, "avg")
                if self.groups.rack is not None:
                    self.groups.rack.broadcast_(buf, root=0)
                self.groups.intra.broadcast_(buf, root=0)
        return w_new

    def start(self, layout: BucketLayout) -> list:
        raise AssertionError("the rack tier has no overlapped exchange (refused at construction)")

    def carriers(self) -> list:
        """The rack sum and z's way down the rack (rack group), the spine's average."""
        return [(self.groups.rack, "allreduce"), (self.groups.spine, "allreduce"), (self.groups.rack, "broadcast")]
