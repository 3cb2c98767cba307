"""The pure H-SADMM math, alone: the node candidate is the argmin, ρ adaptation and dual rescaling, buckets."""
import pytest
import torch

from prunex_hvd.engine import admm
from prunex_hvd.engine.buckets import BucketLayout


def _argmin(f, shape):
    y = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([y], lr=1, max_iter=200, tolerance_grad=1e-14, tolerance_change=1e-16)

    def closure():
        opt.zero_grad()
        loss = f(y)
        loss.backward()
        return loss
    opt.step(closure)
    return y.detach()


@pytest.mark.parametrize("P,M,lam", [(1, 1, 0.0), (2, 2, 0.0), (4, 3, 0.7)])
def test_node_candidate_is_the_argmin(P, M, lam):
    g = torch.Generator().manual_seed(P * 10 + M)
    shape = (5, 3)
    thetas = [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(P)]
    us = [torch.randn(shape, generator=g, dtype=torch.float64) * 0.1 for _ in range(P)]
    z, v = torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)
    rho1, rho2 = 0.3, 0.05
    cand = admm.node_candidate(sum(t + u for t, u in zip(thetas, us)), z, v, rho1, rho2, P, M, lam)
    f = lambda x: admm.node_objective(x, thetas, us, z, v, rho1, rho2, M, lam)  # noqa: E731
    # gradient vanishes at the candidate ...
    x = cand.clone().requires_grad_(True)
    f(x).backward()
    assert x.grad.abs().max() < 1e-10
    # ... and a numerical minimisation from elsewhere lands on it
    torch.testing.assert_close(_argmin(f, shape), cand, rtol=1e-8, atol=1e-8)
    # the paper's printed Eq. 9 (no P in the normaliser) is not the argmin once P > 1
    if P > 1:
        wrong = (rho1 * sum(t + u for t, u in zip(thetas, us)) + rho2 * (z - v)) / (lam / M + rho1 + rho2)
        assert f(wrong) > f(cand) + 1e-6


def test_release_rho_halves_down_to_the_start_and_never_raises():
    assert admm.release_rho(0.08, start=0.001) == 0.04
    assert admm.release_rho(0.0015, start=0.001) == 0.001       # not below the start
    assert admm.release_rho(0.001, start=0.001) == 0.001
    assert admm.release_rho(0.0005, start=0.001) == 0.0005      # balanced below the start: left there


def test_adapt_rho_balances_and_caps():
    assert admm.adapt_rho(1.0, primal=100.0, dual=1.0, rho_max=10) == 2.0
    assert admm.adapt_rho(1.0, primal=1.0, dual=100.0, rho_max=10) == 0.5
    assert admm.adapt_rho(1.0, primal=5.0, dual=1.0, rho_max=10) == 1.0      # within μ=10: unchanged
    assert admm.adapt_rho(8.0, primal=100.0, dual=1.0, rho_max=10) == 10.0    # capped


def test_rescale_dual_keeps_unscaled_dual():
    u = torch.tensor([1.0, -2.0])
    y = 0.5 * u           # unscaled dual with ρ = 0.5
    admm.rescale_dual(u, 0.5, 1.0)
    torch.testing.assert_close(1.0 * u, y)


def test_update_dual_in_place():
    u = torch.zeros(3)
    out = admm.update_dual(u, torch.tensor([1.0, 2, 3]), torch.tensor([0.5, 0.5, 0.5]))
    assert out is u and u.tolist() == [0.5, 1.5, 2.5]


def test_bucket_layout_packs_by_size_and_keeps_big_tensors_whole():
    layout = BucketLayout([10, 20, 30, 100, 5], torch.float32, "cpu", bucket_bytes=4 * 40)
    assert [len(b) for b in layout.buffers] == [30, 30, 100, 5]
    assert [v.numel() for v in layout.views] == [10, 20, 30, 100, 5]
    layout.views[1].fill_(7)
    assert layout.buffers[0][10:30].eq(7).all() and layout.place[3] == (2, 0)
    assert layout.total_numel == 165


@pytest.mark.parametrize("N", [1, 2, 3])
def test_rack_candidate_is_the_argmin(N):
    g = torch.Generator().manual_seed(N)
    shape = (4, 3)
    r = lambda: torch.randn(shape, generator=g, dtype=torch.float64)  # noqa: E731
    z_is, vs, z, t = [r() for _ in range(N)], [0.1 * r() for _ in range(N)], r(), 0.1 * r()
    rho2, rho3 = 0.05, 0.007
    cand = admm.rack_candidate(sum(a + b for a, b in zip(z_is, vs)), z, t, rho2, rho3, N)
    f = lambda w: admm.rack_objective(w, z_is, vs, z, t, rho2, rho3)  # noqa: E731
    x = cand.clone().requires_grad_(True)
    f(x).backward()
    assert x.grad.abs().max() < 1e-12
    torch.testing.assert_close(_argmin(f, shape), cand, rtol=1e-8, atol=1e-8)


def test_three_tier_admm_reaches_the_consensus_optimum():
    """The tree θ → z_i → w_r → z with the exact steps (quadratic f_ij(θ) = ½‖θ − a_ij‖², no structure): every
    copy converges to the minimiser of Σ f_ij, the mean of the a_ij, whatever ρ per tier; a wrong normaliser in
    either candidate would stop short of it."""
    racks, nodes, ranks, shape = 2, 3, 2, (6,)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(racks, nodes, ranks, *shape, generator=g, dtype=torch.float64)
    rho1, rho2, rho3 = 1.0, 0.5, 0.25
    theta, u = a.clone(), torch.zeros_like(a)
    z_i, v = a.mean(2), torch.zeros(racks, nodes, *shape, dtype=torch.float64)
    w, t = z_i.mean(1), torch.zeros(racks, *shape, dtype=torch.float64)
    z = w.mean(0)
    for _ in range(600):
        theta = (a + rho1 * (z_i[:, :, None] - u)) / (1 + rho1)                 # exact θ-step
        z_i = admm.node_candidate((theta + u).sum(2), w[:, None], v, rho1, rho2, ranks, racks * nodes)
        w = admm.rack_candidate((z_i + v).sum(1), z, t, rho2, rho3, nodes)
        z = admm.global_average(list(w + t))
        admm.update_dual(u, theta, z_i[:, :, None])
        admm.update_dual(v, z_i, w[:, None])
        admm.update_dual(t, w, z)
    optimum = a.mean((0, 1, 2))
    for copies in (theta, z_i, w, z[None]):
        torch.testing.assert_close(copies, optimum.expand_as(copies), rtol=0, atol=1e-9)


def test_momentum_weight_is_nesterovs_sequence():
    a, gammas = 1.0, []
    for _ in range(4):
        a_next, gamma = admm.momentum_weight(a)
        assert a_next * a_next - a_next == pytest.approx(a * a)   # a_{k+1}² − a_{k+1} = a_k²
        a = a_next
        gammas.append(gamma)
    assert gammas == pytest.approx([0.0, 0.2817, 0.4340, 0.5311], abs=1e-4)
    old, new = torch.tensor([1.0, 2.0]), torch.tensor([2.0, 2.0])
    assert torch.equal(admm.extrapolate(new, old, 0.5), torch.tensor([2.5, 2.0]))
    assert admm.extrapolate(new, old, 0.0) is not new and torch.equal(admm.extrapolate(new, old, 0.0), new)
    assert admm.combined_residual(4.0, 9.0, 0.5) == 0.5 * 4.0 + 9.0 / 0.5


def _two_tier_rounds(acceleration, rho2, rounds=400, tol=1e-8):
    """Two-tier consensus ADMM with exact steps on f_ij(θ) = ½‖θ − a_ij‖² (2 nodes × 2 ranks), accelerated on the
    inter tier as the engine's phase 10 does. Returns (rounds until every copy is within ``tol`` of the optimum,
    the final z)."""
    nodes, ranks, shape = 2, 2, (5,)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(nodes, ranks, *shape, generator=g, dtype=torch.float64) * torch.tensor([1.0, 10.0])[:, None, None]
    rho1 = 1.0
    theta, u = a.clone(), torch.zeros_like(a)
    z_i, v = a.mean(1), torch.zeros(nodes, *shape, dtype=torch.float64)
    z = z_i.mean(0)
    z_hat, z_prev, v_prev, m_a, combined = z.clone(), z.clone(), v.clone(), 1.0, float("inf")
    optimum = a.mean((0, 1))
    for k in range(1, rounds + 1):
        theta = (a + rho1 * (z_i[:, None] - u)) / (1 + rho1)
        z_i_new = admm.node_candidate((theta + u).sum(1), z_hat, v, rho1, rho2, ranks, nodes)
        z_new = admm.global_average(list(z_i_new + v))
        r_sq, s_sq = float((z_i_new - z_new).pow(2).sum()), rho2 ** 2 * nodes * float((z_new - z_hat).pow(2).sum())
        admm.update_dual(u, theta, z_i_new[:, None])
        admm.update_dual(v, z_i_new, z_new)
        z_i, z = z_i_new, z_new
        gamma = 0.0
        if acceleration == "fast-admm":
            c = admm.combined_residual(r_sq, s_sq, rho2)
            m_a, gamma = admm.momentum_weight(m_a) if c < admm.RESTART_ETA * combined else (1.0, 0.0)
            combined = c
            v, v_prev = admm.extrapolate(v, v_prev, gamma), v
        z_hat, z_prev = admm.extrapolate(z, z_prev, gamma), z.clone()
        if max(float((x - optimum).abs().max()) for x in (theta, z_i, z)) < tol:
            return k, z
    return None, z


def test_fast_admm_reaches_the_optimum_in_fewer_rounds():
    """The acceleration's math on a problem with a known answer: with a weak inter-node pull (ρ2 = 0.02, the
    regime where plain ADMM crawls), fast ADMM with restart reaches the consensus optimum, as plain ADMM does, in
    far fewer rounds."""
    plain, z_plain = _two_tier_rounds("none", 0.02, rounds=5000)
    fast, z_fast = _two_tier_rounds("fast-admm", 0.02, rounds=5000)
    assert plain is not None and fast is not None, (plain, fast)
    assert fast < plain / 2, (fast, plain)
    torch.testing.assert_close(z_fast, z_plain, rtol=0, atol=1e-7)


# -- PowerSGD's pieces (sync_powersgd_rank) --------------------------------------------------------------------

def test_lowrank_compressible_at_most_halves_and_keeps_small_tensors_whole():
    from prunex_hvd.engine import lowrank
    assert lowrank.matrix_shape((12, 4, 3, 3)) == (12, 36) and lowrank.matrix_shape((7,)) == (7, 1)
    assert lowrank.compressible(12, 36, 2)          # 2·48·2 = 192 <= 432
    assert not lowrank.compressible(5, 12, 2)       # 2·17·2 = 68 > 60: sent whole
    assert lowrank.compressible(5, 12, 1)           # 34 <= 60
    assert not lowrank.compressible(7, 1, 1) and not lowrank.compressible(12, 36, 0)


def test_lowrank_round_trip_is_the_projection_of_the_mean_and_keeps_the_rest_as_error():
    """One power step by hand: P = orth(mean M_i Q), Q = mean M_iᵀ P, M̂ = P Qᵀ = P Pᵀ mean(M_i), each node's
    error M_i − M̂; a matrix of rank <= r comes back exactly when P spans its columns."""
    from prunex_hvd.engine import lowrank
    g = torch.Generator().manual_seed(3)
    ms = [torch.randn(6, 9, generator=g, dtype=torch.float64) for _ in range(3)]
    q = lowrank.initial_q(9, 2, seed=5, dtype=torch.float64)
    assert torch.equal(q, lowrank.initial_q(9, 2, seed=5, dtype=torch.float64))   # every node draws the same
    p = lowrank.orthonormalize_(sum(lowrank.project(m, q) for m in ms) / 3)
    torch.testing.assert_close(p.t() @ p, torch.eye(2, dtype=torch.float64))
    q_new = sum(lowrank.back_project(m, p) for m in ms) / 3
    mean = sum(ms) / 3
    errors = [torch.empty_like(m) for m in ms]
    outs = [lowrank.reconstruct_(m.clone(), p, q_new, e) for m, e in zip(ms, errors)]
    torch.testing.assert_close(outs[0], p @ p.t() @ mean)
    assert all(torch.equal(o, outs[0]) for o in outs)
    for m, e in zip(ms, errors):
        torch.testing.assert_close(e, m - outs[0])
    low = torch.randn(6, 2, generator=g, dtype=torch.float64) @ torch.randn(2, 9, generator=g, dtype=torch.float64)
    p = lowrank.orthonormalize_(lowrank.project(low, q))
    torch.testing.assert_close(p @ lowrank.back_project(low, p).t(), low)


def test_lowrank_orthonormalize_leaves_a_dead_direction_at_zero_not_nan():
    from prunex_hvd.engine import lowrank
    p = torch.zeros(5, 3)
    p[:, 0] = torch.arange(5.0)
    out = lowrank.orthonormalize_(p)
    assert torch.isfinite(out).all() and torch.equal(out[:, 1:], torch.zeros(5, 2))
    torch.testing.assert_close(out[:, 0].abs(), torch.arange(5.0) / torch.arange(5.0).norm())
