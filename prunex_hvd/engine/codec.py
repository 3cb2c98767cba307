"""What a node sends across nodes and how z is read back: z_i + v_i shrunk onto the global support into compact
buckets, in a narrower dtype as the change since the last z with error feedback; z recovered from the average.

No communication here (the exchange carries the buckets): tensors in, tensors out, and the rounding errors a
round leaves, kept in :class:`prunex_hvd.engine.state.ConsensusState` once the round is accepted.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from . import sparsity
from .buckets import BucketLayout
from .state import ConsensusState, Entry


class PayloadCodec:
    """Codes one rank's compact payload. With ``state.delta_coded`` (a payload narrower than the state: bf16) each
    tensor travels as q = round(target − base + e), e the error its last rounding left; the new errors wait in
    :attr:`pending` (and :attr:`pending_spine`, a rack leader's across the spine) until :meth:`commit`."""

    def __init__(self, state: ConsensusState):
        self.state = state
        self.pending: Optional[list] = None
        self.pending_spine: Optional[list] = None

    def encode(self, target: torch.Tensor, base, ef: torch.Tensor, e: Optional[Entry], pending: list) -> torch.Tensor:
        """What a narrow payload carries for one tensor: q = round(target − base + ef) in the payload's dtype. The
        new error target − base + ef − q (on the global support: pruned entries are dropped, as z's are) waits in
        ``pending`` until the round is accepted."""
        delta = target.sub_(base).add_(ef)   # ``target`` is the caller's own temporary
        q = delta.to(self.state.payload_dtype)
        error = delta.sub_(q)
        if e is not None and e.structured:
            error = sparsity.apply_masks(error, e.rows, e.cols)
        pending.append(error)
        return q

    def fill(self, layout: BucketLayout, z_i_new: List[torch.Tensor], dense_views: List[torch.Tensor]) -> None:
        """Phase 4's payload: leaders shrink z_i + v_i onto the global support into the compact buckets (which
        the round then averages across nodes and hands to each node). One node: z = z_i + v, every rank has
        it, nothing to exchange. A narrow payload carries z_i + v_i − z + e instead (with racks − w_r), rounded;
        e, the rounding error, is sent again next round (error feedback), and z is recovered as z + the
        average. The float buffers travel as the node's mean (``dense_views``: the node's sums)."""
        s = self.state
        n, P = len(s.entries), s.topo.local_size
        self.pending = []
        if s.topo.is_leader or not s.inter_tier:
            for k, e in enumerate(s.entries):
                c = z_i_new[k] + e.v
                if s.delta_coded:   # one pass
                    c = self.encode(c, e.w if s.rack_tier else e.z, e.ef, e, self.pending)
                else:
                    c = c.to(s.payload_dtype)
                self.put(layout, k, e, c)
            for j, (_, b) in enumerate(s.buffers):
                mean = dense_views[n + j].view_as(b) / P
                if s.delta_coded:
                    mean = self.encode(mean.to(s.state_dtype), s.round_buffers[j].to(s.state_dtype),
                                       s.buffer_ef[j], None, self.pending)
                layout.views[n + j].copy_(mean.reshape(-1))

    @staticmethod
    def put(layout: BucketLayout, k: int, e: Entry, c: torch.Tensor) -> None:
        """Entry ``k``'s coded tensor into its slot: shrunk onto the global support when structured."""
        if e.structured:
            sparsity.shrink_into(c, e.row_idx, e.col_idx, layout.views[k], plan=e.plan)
        else:
            layout.views[k].copy_(c.reshape(-1))

    def recover(self, layout: BucketLayout, gathers: dict,
                bases: Optional[List[torch.Tensor]] = None) -> List[torch.Tensor]:
        """Phase 5: z of every entry from the compact buckets (one pass per layer; ``gathers``: the entries read
        by one gather, see :meth:`prunex_hvd.engine.masks.MaskPolicy.compact_layout`), in the state's dtype (a
        narrow payload's average is the change: added to the last z, cut to the new support; ``bases``: what it
        is the change of, in place of z)."""
        s = self.state
        z_new = []
        for k, e in enumerate(s.entries):
            if k in gathers:
                z = sparsity.recover_gather(*gathers[k], e.z.shape)
            elif e.structured:
                z = sparsity.recover(layout.views[k], e.row_idx, e.col_idx, e.z.shape, plan=e.plan)
            else:
                z = layout.views[k].view_as(e.z).clone()
            z = z.to(s.state_dtype)
            if s.delta_coded:
                base = e.z if bases is None else bases[k]
                z += sparsity.apply_masks(base, e.rows, e.cols) if e.structured else base
            z_new.append(z)
        return z_new

    def decode_buffers(self, layout: BucketLayout) -> List[torch.Tensor]:
        """The float buffers' averages from the buckets (a narrow payload's: the change of the last averages)."""
        s = self.state
        n = len(s.entries)
        averages = []
        for j, (_, b) in enumerate(s.buffers):
            avg = layout.views[n + j].view_as(b)
            if s.delta_coded:
                avg = (s.round_buffers[j].to(s.state_dtype) + avg.to(s.state_dtype)).to(b.dtype)
            averages.append(avg)
        return averages

    def commit(self) -> None:
        """The round is accepted: its rounding errors become the ones the next round sends again."""
        s = self.state
        if s.delta_coded and self.pending:   # leaders: the errors of this round's rounding
            for ef, new in zip([e.ef for e in s.entries] + s.buffer_ef, self.pending):
                ef.copy_(new)
        if s.delta_coded and self.pending_spine:   # rack leaders: the spine's
            for ef, new in zip([e.ef_spine for e in s.entries] + s.buffer_ef_spine, self.pending_spine):
                ef.copy_(new)
        self.pending = self.pending_spine = None
