"""The mask policy: Π_S's support for every structured layer (coupled channel groups, one channel budget), the OR of
the nodes' masks, the freeze, and the compact bucket layout and retraining support the masks imply.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional

import torch

from . import sparsity
from .buckets import BucketLayout
from .config import Structure
from .state import ConsensusState

log = logging.getLogger(__name__)


class MaskPolicy:
    """Chooses, merges and freezes the masks of ``state``'s structured entries. The nodes' masks are OR-ed among the
    leaders through ``exchange`` (the masks are small: one bit per row and column)."""

    def __init__(self, state: ConsensusState, structure: Structure, exchange):
        self.state, self.exchange = state, exchange
        self.couplings = dict(structure.couplings)   # {consumer conv: producer conv}, pruned as one channel group
        self.streams = list(structure.streams)       # [(readers, writers)]: one channel group per residual stream
        # channel_budget="global": the layers sharing one budget of kept weights (their channels their own)
        self.budget_layers = sparsity.own_channel_layers(structure.specs, self.couplings, self.streams) \
            if state.config.channel_budget == "global" else []
        self.heads = list(structure.heads)           # attention modules whose heads are kept or dropped whole
        self.compact: Optional[BucketLayout] = None
        self.gathers: Dict[int, tuple] = {}   # entry -> (its bucket rows with a zero row, gather index)
        self._gathers_of: Optional[BucketLayout] = None   # the layout they index
        self._support: Optional[List[torch.Tensor]] = None   # dense masks of the retraining phase

    def masks(self, weights: Dict[str, torch.Tensor]) -> List[tuple]:
        """Π_S's support for every structured entry (in ``state.structured`` order), coupled channel groups
        (pairs, residual streams) pruned together, the channels of ``budget_layers`` from one budget across them
        (``channel_budget="global"``)."""
        specs = {e.name: e.spec for e in self.state.structured}
        channels = sparsity.budget_channels(weights, {n: specs[n] for n in self.budget_layers}) \
            if self.budget_layers else None
        masks = sparsity.coupled_masks(weights, specs, self.couplings, self.streams, self.heads, channels)
        return [masks[e.name] for e in self.state.structured]

    def project(self, z_i_new: List[torch.Tensor]) -> None:
        """Phase 3, in place on the structured candidates: Π_S and the global masks (leaders OR them); once
        frozen, the frozen masks alone."""
        s = self.state
        structured_ks = [k for k, e in enumerate(s.entries) if e.structured]
        if not s.frozen:
            local = self.masks({s.entries[k].name: z_i_new[k] for k in structured_ks})
            for k, (rows, cols) in zip(structured_ks, local):
                z_i_new[k] = sparsity.apply_masks(z_i_new[k], rows, cols)
            self._merge(local)
        else:
            s.mask_drift = 0.0
            for k in structured_ks:
                z_i_new[k] = sparsity.apply_masks(z_i_new[k], s.entries[k].rows, s.entries[k].cols)

    def _merge(self, local) -> None:
        """OR every node's row/col masks among the leaders, then hand the result to the node."""
        s = self.state
        if not s.structured:
            s.mask_drift = 0.0
            return
        flat = self.flat(local)
        self.exchange.tree_(flat, "bor", tag="masks")   # one node: every rank projected the same z_i already
        changed = kept_total = 0
        for e, (rows, cols) in zip(s.structured, self.split(flat)):
            both = int((rows & e.rows).sum()) * int((cols & e.cols).sum())
            changed += int(rows.sum()) * int(cols.sum()) + int(e.rows.sum()) * int(e.cols.sum()) - 2 * both
            kept_total += len(e.rows) * len(e.cols)
            e.set_masks(rows, cols)
        s.mask_drift = changed / kept_total
        if changed:
            self.compact = None   # the compact shapes changed: new buckets

    def _agreed(self, chosen: List[tuple]) -> List[tuple]:
        """Rank 0's masks on every rank. Every rank chooses from the same z, but which of two near-equal norms
        wins can depend on the BLAS path or the thread count: the ranks take one choice, not their own."""
        if not chosen:
            return chosen
        flat = self.flat(chosen)
        self.exchange.tree_(flat, "broadcast", tag="masks")
        return self.split(flat)

    @staticmethod
    def flat(masks: List[tuple]) -> torch.Tensor:
        """Row and column masks, layer after layer, as one uint8 tensor (what the exchange carries)."""
        return torch.cat([torch.cat([r, c]) for r, c in masks]).to(torch.uint8)

    def split(self, flat: torch.Tensor) -> List[tuple]:
        """:meth:`flat`'s tensor back into (rows, cols) masks of the structured entries."""
        flat, out, offset = flat.bool(), [], 0
        for e in self.state.structured:
            nr, nc = len(e.rows), len(e.cols)
            out.append((flat[offset: offset + nr], flat[offset + nr: offset + nr + nc]))
            offset += nr + nc
        return out

    def due(self) -> bool:
        """Phase 9's test, after the round counter moved: freeze after ``freeze_round`` rounds or
        ``freeze_patience`` rounds without a mask change."""
        s, c = self.state, self.state.config
        if s.frozen:
            return False
        s.stable_rounds = s.stable_rounds + 1 if s.mask_drift == 0 else 0
        return (c.freeze_round is not None and s.round >= c.freeze_round) or s.stable_rounds >= c.freeze_patience

    def freeze(self) -> None:
        """Masks stop moving. The OR of the nodes' masks may keep more than was asked, so the frozen structure
        is the requested one, cut from the global z (the same on every rank; the masks rank 0 chose from it): the
        retraining phase then trains exactly the model that ``finalize()`` returns."""
        s = self.state
        for e, (rows, cols) in zip(s.structured, self._agreed(self.masks({e.name: e.z for e in s.structured}))):
            e.set_masks(rows, cols)
            e.z = sparsity.apply_masks(e.z, e.rows, e.cols)
            if e.w is not None:   # the racks' consensus too: every tier above the nodes on the frozen structure
                e.w = sparsity.apply_masks(e.w, e.rows, e.cols)
        self.forget_layout()
        s.frozen = True

    def say_frozen(self) -> None:
        s = self.state
        if s.topo.rank == 0:
            when = f"round {s.round}: masks frozen" if s.round else \
                "masks chosen from the start weights and frozen before the first step (freeze_round=0)"
            log.info("%s, density %.3f of the structured weights", when, self.density())

    def forget_layout(self) -> None:
        """The masks were set anew (a freeze, a load): the compact layout and the support are made again."""
        self.compact = self._support = None

    def saved(self) -> tuple:
        """The masks as they stand, to put back if the round is refused (:meth:`restore`)."""
        return ([(e.rows, e.cols, e.row_idx, e.col_idx, e.plan) for e in self.state.structured],
                self.state.mask_drift, self.compact)

    def restore(self, saved) -> None:
        masks, self.state.mask_drift, self.compact = saved
        for e, (rows, cols, row_idx, col_idx, plan) in zip(self.state.structured, masks):
            e.rows, e.cols, e.row_idx, e.col_idx, e.plan = rows, cols, row_idx, col_idx, plan

    @property
    def retraining(self) -> bool:
        """θ is held on the frozen structure (the retraining phase, after the freeze): its pruned entries stay 0."""
        return self.state.frozen and bool(self.state.structured)

    def support(self) -> List[torch.Tensor]:
        """The frozen structure as dense 0/1 masks, one per structured entry."""
        if self._support is None:
            self._support = [sparsity.apply_masks(torch.ones_like(e.param), e.rows, e.cols)
                             for e in self.state.structured]
        return self._support

    def compact_layout(self, dtype: Optional[torch.dtype] = None) -> BucketLayout:
        """The compact buckets in ``dtype`` (the payload's by default), made again whenever the masks change.
        Layers with a gather plan (CUDA; CPU without the native kernel) recover z by one gather from their bucket
        slice (:attr:`gathers`), pruned chunks reading a zero row kept past each bucket's end (never sent): z is
        written once, not zero-filled and then scattered. (On CPU the kernel's plan does the same in one pass.)"""
        s = self.state
        dtype = dtype or s.payload_dtype
        if self.compact is None or self.compact.dtype != dtype:
            tail = 2 * max((e.plan.chunk for e in s.structured if isinstance(e.plan, sparsity.GatherPlan)),
                           default=0)
            self.compact = s.layout((e.compact_numel() for e in s.entries), zero_tail=tail, dtype=dtype)
        if self._gathers_of is not self.compact:   # a new layout, or one restored with its masks
            self.gathers, self._gathers_of = {}, self.compact
            for k, e in enumerate(s.entries):
                if e.structured and isinstance(e.plan, sparsity.GatherPlan):
                    rows, zero_row = self.compact.chunk_rows(k, e.plan.chunk)
                    self.gathers[k] = (rows, e.plan.slot.masked_fill(e.plan.slot < 0, zero_row))
        return self.compact

    def density(self) -> float:
        """Fraction of structured weights kept by the global masks."""
        kept = sum(int(e.rows.sum()) * int(e.cols.sum()) for e in self.state.structured)
        total = sum(e.param.numel() for e in self.state.structured)
        return kept / total if total else 1.0

    def layer_density(self) -> Dict[str, float]:
        return {e.name: sparsity.density(e.rows, e.cols) for e in self.state.structured}
