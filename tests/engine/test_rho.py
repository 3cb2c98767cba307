"""The ρ policy's contract (:mod:`prunex_hvd.engine.rho`): residual balancing per layer and tier, capped at
``rho_max``, with the scaled duals rescaled so the unscaled ones (ρ·u) keep their value."""
import torch

from prunex_hvd.engine import admm, rho

from components import state as make_state, topology


def totals(s, r_intra, s_intra, r_inter, s_inter_sq=0.0):
    """Summed squares as the verdict returns them: every layer alike."""
    n = len(s.entries)
    return torch.tensor([[r_intra ** 2, s_intra ** 2, r_inter ** 2]] * n, dtype=torch.float64), [s_inter_sq] * n


def test_rho_grows_where_the_primal_residual_dominates_and_the_duals_keep_their_unscaled_value():
    s = make_state(rho1=0.01, rho2=0.001, rho_max=0.015)
    for e in s.entries:
        e.u.normal_()
        e.v.normal_()
    before = [(e.rho1 * e.u.clone(), e.rho2 * e.v.clone()) for e in s.entries]
    rho.adapt(s, *totals(s, r_intra=1.0, s_intra=0.01, r_inter=0.001, s_inter_sq=1.0))
    for e, (yu, yv) in zip(s.entries, before):
        assert e.rho1 == 0.015   # ×τ = 0.02, capped
        assert e.rho2 == 0.001 / admm.TAU   # the dual residual dominates the inter tier: ρ2 shrinks
        torch.testing.assert_close(e.rho1 * e.u, yu)
        torch.testing.assert_close(e.rho2 * e.v, yv)
        assert e.residuals == {"r_intra": 1.0, "s_intra": 0.01, "r_inter": 0.001, "s_inter": 1.0}


def test_balanced_residuals_and_adaptive_rho_off_leave_rho_alone():
    for knobs, r, d in (({}, 1.0, 1.0), ({"adaptive_rho": False}, 100.0, 0.01)):
        s = make_state(**knobs)
        rho.adapt(s, *totals(s, r, d, r, d * d))
        assert all((e.rho1, e.rho2) == (0.01, 0.001) for e in s.entries)
        assert all(e.residuals["r_intra"] == r for e in s.entries)


def test_one_node_has_no_inter_tier_to_balance():
    s = make_state(topo=topology(num_nodes=1, local_size=2))
    rho.adapt(s, *totals(s, 1.0, 0.01, 5.0, 0.0))
    assert all(e.rho2 == 0.001 and "r_inter" not in e.residuals and e.rho1 > 0.01 for e in s.entries)
