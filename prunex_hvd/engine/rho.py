"""The ρ policy: each layer's residuals from the round's summed squares, and residual balancing of ρ1, ρ2 (and ρ3
with racks) with the scaled duals rescaled alike (Boyd et al. §3.4.1; docs/algorithm.md, "Adaptive ρ").

No communication: the squares arrive summed over the job, so every rank decides the same.
"""
from __future__ import annotations

import logging
from typing import List

import torch

from . import admm
from .state import ConsensusState

log = logging.getLogger(__name__)


def adapt(state: ConsensusState, totals: torch.Tensor, s_top_sq: List[float]) -> None:
    """Phase 8: per-layer residuals into each entry's ``residuals``; with ``adaptive_rho``, ρ1 balanced on the
    node tier, ρ2 on the nodes' (where there is an inter-node tier), ρ3 on the racks' (where there are racks), each
    capped at ``rho_max``, and the duals u, v, t rescaled by ρ_old/ρ_new so the unscaled duals keep their value."""
    changed = []
    c = state.config
    for k, e in enumerate(state.entries):
        # with racks ρ2's tier is nodes against their rack, then ρ3's racks against z (r_spine, s_spine)
        r_intra, s_intra, r_inter, s_inter, *spine = admm.residual_norms(*totals[k].tolist(), s_top_sq[k])
        r_spine, s_spine = spine or (0.0, 0.0)
        e.residuals = {"r_intra": r_intra, "s_intra": s_intra}
        if state.inter_tier:
            e.residuals.update(r_inter=r_inter, s_inter=s_inter)
        if state.rack_tier:
            e.residuals.update(r_spine=r_spine, s_spine=s_spine)
        if not c.adaptive_rho:
            continue
        rho1 = admm.adapt_rho(e.rho1, r_intra, s_intra, c.rho_max)
        rho2 = admm.adapt_rho(e.rho2, r_inter, s_inter, c.rho_max) if state.inter_tier else e.rho2
        rho3 = admm.adapt_rho(e.rho3, r_spine, s_spine, c.rho_max) if state.rack_tier else e.rho3
        changed += [f"{e.name} {which} {old:.3g}->{new:.3g}" for which, old, new in
                    (("rho1", e.rho1, rho1), ("rho2", e.rho2, rho2), ("rho3", e.rho3, rho3)) if new != old]
        admm.rescale_dual(e.u, e.rho1, rho1)
        admm.rescale_dual(e.v, e.rho2, rho2)
        if state.rack_tier:
            admm.rescale_dual(e.t, e.rho3, rho3)
        e.rho1, e.rho2, e.rho3 = rho1, rho2, rho3
    if changed and state.topo.rank == 0:
        shown = ", ".join(changed[:6]) + (f" and {len(changed) - 6} more" if len(changed) > 6 else "")
        log.info("round %d: rho changed %d time(s): %s", state.round + 1, len(changed), shown)
