"""The H-SADMM updates as pure tensor functions: no communication, no state.

Notation (docs/algorithm.md): θ a rank's parameter, u its intra dual, z_i the node consensus, v_i the inter dual,
z the global consensus; ρ1 (intra) and ρ2 (inter) penalties; P ranks per node, M nodes. Duals are *scaled* (u = y/ρ), so a change of ρ must rescale them (:func:`rescale_dual`).

Residuals follow consensus ADMM (Boyd et al. 2011, §7.1): for N copies x_k of one variable z̄, the primal
residual is r = √(Σ_k ‖x_k − z̄‖²) and the dual one s = ρ√N‖z̄⁺ − z̄‖. H-SADMM has two tiers of copies: the
M·P ranks' θ of their node's z_i (s_intra = ρ1√(P·Σ_i‖Δz_i‖²)) and the M nodes' z_i of the global z
(s_inter = ρ2√M‖Δz‖). Counting the dual side once per node, as the primal side is counted once per rank,
would bias residual balancing toward larger ρ.
"""
from __future__ import annotations

import math
from typing import Sequence, Tuple

import torch

MU = 10.0   # residual balance that triggers a ρ change (Boyd et al. 2011, §3.4.1)
TAU = 2.0   # factor of a ρ change


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the consensus state (u, z_i, v, z) and its arithmetic use for a model of ``dtype``: float32 for
    half-precision models (as AMP keeps float32 master weights: in float16, ρ2·z of weights ~1e-3 falls into
    subnormals, and ρ1θ + ρ1(u − z_i) cancels in bfloat16), the model's own dtype otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def node_candidate(node_sum: torch.Tensor, z: torch.Tensor, v: torch.Tensor, rho1: float, rho2: float,
                   local_size: int) -> torch.Tensor:
    """Exact minimiser over z_i of the augmented Lagrangian (:func:`node_objective`):

        z̃_i = (ρ1·Σ_j(θ_ij + u_ij) + ρ2·(z − v_i)) / (P·ρ1 + ρ2)

    ``node_sum`` is Σ_j(θ_ij + u_ij) over the node's P ranks; it may arrive in a narrower dtype than ``z``
    (the payload's) and is widened first. (The paper's Eq. 9 omits P and writes z_i^k where z^k belongs.)"""
    node_sum = node_sum.to(z.dtype)
    return (node_sum * rho1 + (z - v) * rho2) / (local_size * rho1 + rho2)


def node_objective(z_i: torch.Tensor, thetas: Sequence[torch.Tensor], us: Sequence[torch.Tensor],
                   z: torch.Tensor, v: torch.Tensor, rho1: float, rho2: float) -> torch.Tensor:
    """The part of the augmented Lagrangian that depends on z_i:
    Σ_j ρ1/2‖θ_ij − z_i + u_ij‖² + ρ2/2‖z_i − z + v_i‖²."""
    out = rho2 / 2 * (z_i - z + v).pow(2).sum()
    for theta, u in zip(thetas, us):
        out = out + rho1 / 2 * (theta - z_i + u).pow(2).sum()
    return out


def rack_candidate(rack_sum: torch.Tensor, z: torch.Tensor, t: torch.Tensor, rho2: float, rho3: float,
                   nodes_per_rack: int) -> torch.Tensor:
    """Three tiers (racks, docs/algorithm.md "A third tier: racks"): the exact minimiser over the rack consensus
    w_r of :func:`rack_objective`,

        w̃_r = (ρ2·Σ_{i∈r}(z_i + v_i) + ρ3·(z − t_r)) / (N·ρ2 + ρ3)

    ``rack_sum`` is Σ(z_i + v_i) over the rack's N nodes, v_i their duals against w_r, t_r the rack's dual against
    the global z. The node candidate is :func:`node_candidate` with w_r in the place of z (and ρ2 its penalty)."""
    rack_sum = rack_sum.to(z.dtype)
    return (rack_sum * rho2 + (z - t) * rho3) / (nodes_per_rack * rho2 + rho3)


def rack_objective(w: torch.Tensor, z_is: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], z: torch.Tensor,
                   t: torch.Tensor, rho2: float, rho3: float) -> torch.Tensor:
    """The part of the three-tier augmented Lagrangian that depends on w_r:
    Σ_{i∈r} ρ2/2‖z_i − w_r + v_i‖² + ρ3/2‖w_r − z + t_r‖²."""
    out = rho3 / 2 * (w - z + t).pow(2).sum()
    for z_i, v in zip(z_is, vs):
        out = out + rho2 / 2 * (z_i - w + v).pow(2).sum()
    return out


def global_average(node_values: Sequence[torch.Tensor]) -> torch.Tensor:
    """z-step: the mean over nodes of (z_i + v_i) on the global support (the caller compacts to it); with racks,
    the mean over racks of (w_r + t_r)."""
    return torch.stack(list(node_values)).mean(0)


def update_dual(dual: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Scaled dual ascent in place: dual += a − b (u += θ − z_i, v_i += z_i − z)."""
    return dual.add_(a).sub_(b)


def adapt_rho(rho: float, primal: float, dual: float, rho_max: float, mu: float = MU, tau: float = TAU) -> float:
    """Residual balancing: grow ρ when the primal residual dominates, shrink it when the dual one does."""
    if primal > mu * dual:
        rho = rho * tau
    elif dual > mu * primal:
        rho = rho / tau
    return min(rho, rho_max)


def rescale_dual(dual: torch.Tensor, rho_old: float, rho_new: float) -> torch.Tensor:
    """Keep the unscaled dual y = ρ·u fixed when ρ changes: u ← u·ρ_old/ρ_new."""
    if rho_new != rho_old:
        dual.mul_(rho_old / rho_new)
    return dual


def sq_norm(t: torch.Tensor) -> torch.Tensor:
    """‖t‖² in float64, as a 0-dim tensor on ``t``'s device. Nothing waits for it: on a GPU a round reads all of
    its residual norms at once (one host sync per round, not four per layer)."""
    return torch.linalg.vector_norm(t, dtype=torch.float64).square()


def dual_residual_sq(change_sq: torch.Tensor, rho: float, copies: int) -> torch.Tensor:
    """s² = ρ²·N·‖Δz̄‖² for a consensus variable held in N copies (Boyd et al. §7.1)."""
    return change_sq * (rho * rho * copies)


def residual_norms(*squares: float) -> Tuple[float, ...]:
    """The residuals from their squares (r_intra², s_intra², r_inter², s_inter²[, r_spine², s_spine²]), a sum's
    rounding below zero read as 0."""
    return tuple(math.sqrt(max(x, 0.0)) for x in squares)
