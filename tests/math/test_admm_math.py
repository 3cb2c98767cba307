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


@pytest.mark.parametrize("P,seed", [(1, 11), (2, 22), (4, 43)])
def test_node_candidate_is_the_argmin(P, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (5, 3)
    thetas = [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(P)]
    us = [torch.randn(shape, generator=g, dtype=torch.float64) * 0.1 for _ in range(P)]
    z, v = torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)
    rho1, rho2 = 0.3, 0.05
    cand = admm.node_candidate(sum(t + u for t, u in zip(thetas, us)), z, v, rho1, rho2, P)
    f = lambda x: admm.node_objective(x, thetas, us, z, v, rho1, rho2)  # noqa: E731
    # gradient vanishes at the candidate ...
    x = cand.clone().requires_grad_(True)
    f(x).backward()
    assert x.grad.abs().max() < 1e-10
    # ... and a numerical minimisation from elsewhere lands on it
    torch.testing.assert_close(_argmin(f, shape), cand, rtol=1e-8, atol=1e-8)
    # the paper's printed Eq. 9 (no P in the normaliser) is not the argmin once P > 1
    if P > 1:
        wrong = (rho1 * sum(t + u for t, u in zip(thetas, us)) + rho2 * (z - v)) / (rho1 + rho2)
        assert f(wrong) > f(cand) + 1e-6


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
        z_i = admm.node_candidate((theta + u).sum(2), w[:, None], v, rho1, rho2, ranks)
        w = admm.rack_candidate((z_i + v).sum(1), z, t, rho2, rho3, nodes)
        z = admm.global_average(list(w + t))
        admm.update_dual(u, theta, z_i[:, :, None])
        admm.update_dual(v, z_i, w[:, None])
        admm.update_dual(t, w, z)
    optimum = a.mean((0, 1, 2))
    for copies in (theta, z_i, w, z[None]):
        torch.testing.assert_close(copies, optimum.expand_as(copies), rtol=0, atol=1e-9)
