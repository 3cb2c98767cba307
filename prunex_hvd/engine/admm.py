"""The H-SADMM updates as pure tensor functions: no communication, no state.

Notation (docs/algorithm.md): θ a rank's parameter, u its intra dual, z_i the node consensus, v_i the inter dual,
z the global consensus; ρ1 (intra) and ρ2 (inter) penalties; λ the z-step weight decay; P ranks per node,
M nodes. Duals are *scaled* (u = y/ρ), so a change of ρ must rescale them (:func:`rescale_dual`).

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
                   local_size: int, num_nodes: int, weight_decay_z: float = 0.0) -> torch.Tensor:
    """Exact minimiser over z_i of the augmented Lagrangian (:func:`node_objective`):

        z̃_i = (ρ1·Σ_j(θ_ij + u_ij) + ρ2·(z − v_i)) / (λ/M + P·ρ1 + ρ2)

    ``node_sum`` is Σ_j(θ_ij + u_ij) over the node's P ranks; it may arrive in a narrower dtype than ``z``
    (the payload's) and is widened first. (The paper's Eq. 9 omits P and writes z_i^k where z^k belongs.)"""
    node_sum = node_sum.to(z.dtype)
    denom = weight_decay_z / num_nodes + local_size * rho1 + rho2
    return (node_sum * rho1 + (z - v) * rho2) / denom


def node_mean(node_sum: torch.Tensor, count: int, dtype: torch.dtype) -> torch.Tensor:
    """The consensus once the penalties are dropped (``retrain="average"``, after the masks freeze): the plain
    mean of the ``count`` copies summed in ``node_sum`` (a node's θ, or a rack's z_i), as local SGD averages:
    :func:`node_candidate`'s limit as ρ2/ρ1 → 0 with the duals at 0. A new tensor in ``dtype`` (the state's)."""
    return node_sum.to(dtype) / count


def node_objective(z_i: torch.Tensor, thetas: Sequence[torch.Tensor], us: Sequence[torch.Tensor],
                   z: torch.Tensor, v: torch.Tensor, rho1: float, rho2: float, num_nodes: int,
                   weight_decay_z: float = 0.0) -> torch.Tensor:
    """The part of the augmented Lagrangian that depends on z_i:
    λ/(2M)‖z_i‖² + Σ_j ρ1/2‖θ_ij − z_i + u_ij‖² + ρ2/2‖z_i − z + v_i‖²."""
    out = weight_decay_z / (2 * num_nodes) * z_i.pow(2).sum()
    for theta, u in zip(thetas, us):
        out = out + rho1 / 2 * (theta - z_i + u).pow(2).sum()
    return out + rho2 / 2 * (z_i - z + v).pow(2).sum()


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


def relax(new: torch.Tensor, old: torch.Tensor, alpha: float) -> torch.Tensor:
    """Over-relaxation (Boyd et al. 2011, §3.4.3): α·new + (1 − α)·old, the point the next tier and the dual see in
    place of ``new`` (θ against the old z_i, z_i against the old z). α = 1 is plain ADMM; α ∈ [1.5, 1.8] often
    converges faster. A new tensor, in ``old``'s dtype."""
    new = new.to(old.dtype)
    if alpha == 1.0:
        return new.clone()
    return torch.lerp(old, new, alpha)


def grow_rho(rho: float, growth: float, rho_max: float) -> float:
    """The scheduled ρ of the next round: ×``growth`` (ADMM pruning, Zhang et al. 2018, grows ρ 1.3–2× a round so
    the weights are driven onto the structure), capped at ``rho_max``; ``growth`` = 1 leaves ρ alone."""
    return min(rho * growth, rho_max) if growth != 1.0 else rho


def release_rho(rho: float, start: float, tau: float = TAU) -> float:
    """The released ρ of the next round: ÷``tau`` a round back down to ``start`` (the ρ the run began with), and
    never raised: the damping a balanced ρ2 built up, undone over a few rounds rather than at once."""
    return rho if rho <= start else max(rho / tau, start)


RESTART_ETA = 0.999   # fast ADMM keeps its momentum while the combined residual falls below η × the last one


def combined_residual(primal_sq: float, dual_sq: float, rho: float) -> float:
    """Goldstein et al. (2014)'s combined residual of a tier, c = ρ·r² + s²/ρ (in scaled form: ρ‖v − v̂‖² +
    ρ‖z − ẑ‖², as r = ‖z_i − z‖ summed over the copies is v's step and s = ρ√M‖z − ẑ‖ z's). It falls at every
    round of convergent ADMM; fast ADMM restarts its momentum when it does not."""
    return rho * primal_sq + dual_sq / rho


def momentum_weight(a: float) -> Tuple[float, float]:
    """Nesterov's sequence as fast ADMM uses it (Goldstein et al. 2014, Alg. 8): a_{k+1} = (1 + √(1 + 4a_k²))/2
    and the extrapolation weight γ_k = (a_k − 1)/a_{k+1}. From a = 1 (a start or a restart) γ is 0, then
    0.28, 0.43, 0.53, ... → 1. Returns (a_{k+1}, γ_k)."""
    a_next = (1.0 + math.sqrt(1.0 + 4.0 * a * a)) / 2.0
    return a_next, (a - 1.0) / a_next


def extrapolate(new: torch.Tensor, old: torch.Tensor, gamma: float) -> torch.Tensor:
    """new + γ·(new − old): the point the next round leans on (a new tensor; ``new`` itself at γ = 0 is cloned)."""
    return new.clone() if gamma == 0.0 else torch.lerp(old, new, 1.0 + gamma)


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
