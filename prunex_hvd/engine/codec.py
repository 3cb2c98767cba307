"""What a node sends across nodes and how z is read back: z_i + v_i shrunk onto the global support into compact
buckets; with a narrower payload (bf16) each sender's change since what it last sent, and one round in
:data:`ANCHOR_EVERY` the whole value in float32; z recovered from the average.

No communication here (the exchange carries the buckets): tensors in, tensors out, and what a round leaves (each
sender's new base, the buffers' rounding errors), kept in :class:`prunex_hvd.engine.state.ConsensusState` once the
round is accepted. docs/algorithm.md, "A narrow inter-node payload", derives the coding.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from . import sparsity
from .buckets import BucketLayout
from .state import ConsensusState, Entry

# A narrow payload's bases drift from z by the rounding inside the payload's sum, which no sender sees: one round
# in this many sends whole values in float32 and every base starts again from what was sent. Rare, because each
# costs a round of float32 (here 1/128 more bytes over a run: ResNet-18 at channel:0.5 coupled sends 0.198× of
# dense a round in bf16, so 0.1993× on average) and the drift is small (docs/algorithm.md).
ANCHOR_EVERY = 128


def code_change(target: torch.Tensor, sent: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """A sender's change against its own base: q = round(target − sent) in ``dtype`` and the new base sent + q,
    what the receivers now hold of this sender (``target`` is overwritten: the caller's own temporary). The
    change shrinks as the sender's value settles, so its rounding does."""
    q = target.sub_(sent).to(dtype)
    return q, target.copy_(q).add_(sent)


def code_with_feedback(target: torch.Tensor, base, error: torch.Tensor,
                       dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """An average's change with error feedback: q = round(target − base + error) in ``dtype`` and the new error
    (``target`` is overwritten). For plain averages (the float buffers), where no dual carries the rounding."""
    delta = target.sub_(base).add_(error)
    q = delta.to(dtype)
    return q, delta.sub_(q)


class PayloadCodec:
    """Codes one rank's compact payload. With ``state.delta_coded`` (a payload narrower than the state: bf16) an
    entry travels as q = round(z_i + v_i − s_i), s_i the sender's base (what it has sent so far, summed), and the
    float buffers as their change with error feedback; a round in :data:`ANCHOR_EVERY` (and one whose bases are
    unknown: loaded from a state without them) is anchored: whole values in the state's dtype. The new bases and
    errors wait in :attr:`pending` (and :attr:`pending_spine`, :attr:`pending_rack` with racks) until
    :meth:`commit`."""

    def __init__(self, state: ConsensusState):
        self.state = state
        self.pending: Optional[list] = None
        self.pending_spine: Optional[list] = None
        self.pending_rack: Optional[list] = None
        self.anchored = False   # this round's payload holds whole values (set by :meth:`fill`)

    def round_dtype(self) -> torch.dtype:
        """The dtype of the next round's compact buckets: the payload's, or the state's in an anchored round."""
        s = self.state
        due = s.anchored_at is None or s.round - s.anchored_at >= ANCHOR_EVERY
        return s.state_dtype if s.delta_coded and due else s.payload_dtype

    def is_anchored(self, layout: BucketLayout) -> bool:
        return self.state.delta_coded and layout.dtype != self.state.payload_dtype

    def encode(self, target: torch.Tensor, sent: torch.Tensor, e: Optional[Entry], pending: list) -> torch.Tensor:
        """One tensor of a narrow payload from ``target`` (the caller's own temporary): its change against
        ``sent``, rounded, or in an anchored round ``target`` itself. The new base (on the global support:
        pruned entries are dropped, as z's are) waits in ``pending``."""
        if self.anchored:
            q = new = target
        else:
            q, new = code_change(target, sent, self.state.payload_dtype)
        pending.append(sparsity.apply_masks(new, e.rows, e.cols) if e is not None and e.structured else new.clone())
        return q

    def encode_average(self, target: torch.Tensor, base, error: torch.Tensor, pending: list) -> torch.Tensor:
        """One float buffer of a narrow payload: its change with error feedback, or whole when anchored (its
        error then starts again from zero)."""
        if self.anchored:
            pending.append(torch.zeros_like(error))
            return target
        q, new_error = code_with_feedback(target, base, error, self.state.payload_dtype)
        pending.append(new_error)
        return q

    def fill(self, layout: BucketLayout, z_i_new: List[torch.Tensor], dense_views: List[torch.Tensor]) -> None:
        """Phase 4's payload: leaders shrink z_i + v_i onto the global support into the compact buckets (which
        the round then averages across nodes and hands to each node). One node: z = z_i + v, every rank has
        it, nothing to exchange. A narrow payload carries each leader's change against its base instead (with
        racks too: the rack recovers its sum from its own), rounded, and z is recovered as z + the average
        change. The float buffers travel as the node's mean (``dense_views``: the node's sums), narrow: its
        change since the last average, with error feedback."""
        s = self.state
        n, P = len(s.entries), s.topo.local_size
        self.pending, self.anchored = [], self.is_anchored(layout)
        if s.topo.is_leader or not s.inter_tier:
            for k, e in enumerate(s.entries):
                c = z_i_new[k] + e.v
                c = self.encode(c, e.sent, e, self.pending) if s.delta_coded else c.to(s.payload_dtype)
                self.put(layout, k, e, c)
            for j, (_, b) in enumerate(s.buffers):
                mean = dense_views[n + j].view_as(b) / P
                if s.delta_coded:
                    mean = self.encode_average(mean.to(s.state_dtype), s.round_buffers[j].to(s.state_dtype),
                                               s.buffer_ef[j], self.pending)
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
            if s.delta_coded and not self.anchored:
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
            if s.delta_coded and not self.anchored:
                avg = (s.round_buffers[j].to(s.state_dtype) + avg.to(s.state_dtype)).to(b.dtype)
            averages.append(avg)
        return averages

    def commit(self) -> None:
        """The round is accepted: its senders' new bases (and the buffers' errors) become the next round's."""
        s = self.state
        kept = ((self.pending, [e.sent for e in s.entries] + s.buffer_ef),              # node leaders
                (self.pending_spine, [e.sent_spine for e in s.entries] + s.buffer_ef_spine),   # rack leaders
                (self.pending_rack, [e.rack_sum for e in s.entries]))                   # every rank of a rack
        for new, old in kept:
            if s.delta_coded and new:
                for t, value in zip(old, new):
                    t.copy_(value)
        if self.anchored:
            s.anchored_at = s.round
        self.pending = self.pending_spine = self.pending_rack = None
