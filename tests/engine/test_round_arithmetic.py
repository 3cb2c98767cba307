"""The round's own arithmetic on thread clusters (tests/threaded.py), each case against the float64 reference:
dual residuals counted per copy at both tiers, no ρ2 adaptation without an inter-node tier, half-precision
models with float32 consensus state, and the consensus model (z with the last round's BatchNorm statistics)
that finalize() and consensus_weights() put on every rank."""
import math

import pytest
import torch
import torch.nn as nn

from engine_cases import SETTINGS as ENGINE_SETTINGS, make_model, model_state, paper_config, rank_batch, sgd, snapshot
from prunex_hvd.engine import admm
from prunex_hvd.engine.hsadmm import HSADMM
from prunex_hvd.engine.steps import StepHooks
from reference import reference_round
from threaded import run_ranks

# the engine cases' round (the paper's, restarting at z) and settings, masks left free to move
SETTINGS = dict(ENGINE_SETTINGS, freeze_round=None, freeze_patience=100)


def own_sgd(model, rank):
    """SGD with weight decay at the rank's own lr: the conv biases a BatchNorm cancels (no gradient of their own)
    still move, and differently on every node, so no residual is 0 but for rounding, where a ρ decision would
    rest on the noise."""
    return torch.optim.SGD(model.parameters(), lr=0.05 * (1 + 0.1 * rank), momentum=0.9, weight_decay=0.1)


def engine(rank, model, sparsity="channel:0.5", **overrides):
    topo, groups, ledger = rank
    return HSADMM(model, topo, groups, paper_config(sparsity=sparsity, **dict(SETTINGS, **overrides)), ledger=ledger)


def train_steps(eng, model, opt, x, y, steps):
    """``steps`` local steps as the wrapped optimizer takes them."""
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x).float(), y).backward()
        eng.add_proximal_grad()
        opt.step()
        eng.after_step()


def rounds_with_snapshots(num_nodes, local_size, rounds, models, sparsity="channel:0.5", steps=3,
                          optimizer=lambda model, rank: sgd(model), **overrides):
    """Every rank trains ``steps`` steps on its own batch with ``optimizer(model, rank)``, then a round,
    ``rounds`` times; returns per round the ranks' snapshots before and after it, and every rank's engine."""
    def body(rank):
        r = rank.topo.rank
        model = models[r]
        eng = engine(rank, model, sparsity, **overrides)
        opt = optimizer(model, r)
        x, y = rank_batch(r)
        x = x.to(next(model.parameters()).dtype)
        out = []
        for _ in range(rounds):
            train_steps(eng, model, opt, x, y, steps)
            before = snapshot(eng)
            eng.consensus_round(steps=None)
            out.append((before, dict(snapshot(eng), residuals={e.name: dict(e.residuals) for e in eng.entries})))
        return out, eng
    results = run_ranks(num_nodes, local_size, body)
    per_round = [([res[0][k][0] for res in results], [res[0][k][1] for res in results]) for k in range(rounds)]
    return per_round, [res[1] for res in results]


# -- 5. dual residuals: every copy counts ------------------------------------------------------------------

@pytest.mark.parametrize("layout", [(2, 4), (3, 2), (1, 3)], ids=lambda l: f"{l[0]}x{l[1]}")
def test_residuals_and_rho_decisions_match_the_reference(layout):
    """At M=2, P=4 the old count (s_intra summed once per node, s_inter once in all) was √P and √M too small and
    took 14 of 60 ρ decisions differently; every residual of every layer now equals the reference's."""
    M, P = layout
    models = [make_model(rank=r) for r in range(M * P)]
    per_round, engines = rounds_with_snapshots(M, P, 4, models, optimizer=own_sgd)
    specs = {e.name: e.spec for e in engines[0].structured}
    for rnd, (before, after) in enumerate(per_round):
        want = reference_round(before, engines[0].topo.node_ranks, specs, rho_max=10.0)
        for name, expected in want["residuals"].items():
            got = after[0]["residuals"][name]
            keys = ("r_intra", "s_intra", "r_inter", "s_inter")[:len(expected)]
            assert set(got) == set(keys), (rnd, name, got)
            for key, value in zip(keys, expected):
                assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (rnd, name, key)
            assert (after[0]["rho1"][name], after[0]["rho2"][name]) == (want["rho1"][name], want["rho2"][name]), \
                (rnd, name, got, expected)


# -- 6. one node: no inter-node tier -----------------------------------------------------------------------

def test_one_node_keeps_rho2_and_reports_no_inter_residuals():
    """With one node z = z_i, so r_inter is 0 and residual balancing used to halve ρ2 every round without
    limit (0.02 → 0.02/2^6 after six rounds). Now ρ2 stays, and no inter residual is reported."""
    models = [make_model(rank=r) for r in range(3)]
    per_round, engines = rounds_with_snapshots(1, 3, 6, models)
    for eng in engines:
        assert not eng.state.inter_tier
        for e in eng.entries:
            assert e.rho2 == SETTINGS["rho2"], (e.name, e.rho2)
            assert set(e.residuals) == {"r_intra", "s_intra"}
    assert any(e.rho1 != SETTINGS["rho1"] for e in engines[0].entries)   # the intra tier still adapts


# -- 7. half-precision models --------------------------------------------------------------------------------

def test_node_candidate_of_a_half_payload_keeps_small_terms():
    """Weights ~1e-3 with ρ2=1.5e-4: ρ2·z lies in float16's subnormals (flushed or coarse). The candidate in
    the float32 state from a float16 node sum is as good as the payload's own rounding."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(10_000, generator=g, dtype=torch.float64) * 1e-3
    node_sum = 4 * z + torch.randn(10_000, generator=g, dtype=torch.float64) * 1e-4
    v = torch.zeros_like(z)
    exact = admm.node_candidate(node_sum, z, v, 1.5e-3, 1.5e-4, 4)
    state = admm.state_dtype(torch.float16)
    assert state == torch.float32
    got = admm.node_candidate(node_sum.half(), z.to(state), v.to(state), 1.5e-3, 1.5e-4, 4)
    assert got.dtype == torch.float32
    rel = float((got.double() - exact).norm() / exact.norm())
    assert rel < 5e-4, rel   # the float16 node sum's rounding (2^-11 relative) and no more
    in_half = admm.node_candidate(node_sum.half(), z.half(), v.half(), 1.5e-3, 1.5e-4, 4)
    assert float((in_half.double() - exact).norm() / exact.norm()) > 4 * rel   # what the state dtype avoids


# errors against the float64 reference (relative to ‖θ‖, worst over layers, ranks and rounds), in units of the
# payload dtype's eps: the node sum travels in the model's dtype (one rounding for z_i and u), the compact z
# through a second sum in it. Measured: float16 0.41 / 0.21 / 1.64 eps, bfloat16 0.52 / 0.26 / 0.65 eps.
HALF_BOUNDS_IN_EPS = {"z_i": 1.0, "u": 1.0, "z": 4.0}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_model_against_the_float64_reference(dtype):
    """A float16 / bfloat16 model on 2 nodes × 2: the state stays float32, every round within the payload's
    rounding of the float64 reference (dense consensus: a mask choice flipped by a rounding is not an error)."""
    models = [make_model(rank=r).to(dtype) for r in range(4)]
    with torch.no_grad():
        for model in models:
            for p in model.parameters():
                p.mul_(0.05)   # weights of ~1e-3..1e-2, where ρ·z used to fall into float16's subnormals
    per_round, engines = rounds_with_snapshots(2, 2, 4, models, sparsity=None, rho1=1.5e-3, rho2=1.5e-4)
    assert all(e.u.dtype == e.z.dtype == torch.float32 for eng in engines for e in eng.entries)
    worst = {"z_i": 0.0, "u": 0.0, "z": 0.0}
    for before, after in per_round:
        want = reference_round(before, engines[0].topo.node_ranks, {}, rho_max=10.0)
        for r, got in enumerate(after):
            for name, theta in before[r]["theta"].items():
                scale = max(float(theta.double().norm()), 1e-12)
                for key, expected in (("z_i", want["z_i"][r // 2][name]), ("u", want["u"][r][name]),
                                      ("z", want["z"][name])):
                    err = float((got[key][name].double() - expected.double()).norm()) / scale
                    worst[key] = max(worst[key], err)
    eps = torch.finfo(dtype).eps
    print(f"\n{dtype}: worst error relative to |theta|:", {k: f"{v:.2e} ({v / eps:.2f} eps)" for k, v in worst.items()})
    assert all(worst[k] < HALF_BOUNDS_IN_EPS[k] * eps for k in worst), worst


def test_half_precision_proximal_gradient_does_not_cancel():
    """grad += ρ1(θ − z_i + u) for a bfloat16 model: formed as ρ1θ + ρ1(u − z_i), two nearly equal terms whose
    difference bfloat16 cannot hold; now θ − (z_i − u) in float32 first."""
    def body(rank):
        model = nn.Sequential(nn.Conv2d(3, 4, 3)).to(torch.bfloat16)
        torch.nn.init.constant_(model[0].weight, 0.5)
        eng = engine(rank, model, None, rho1=1.5e-3)
        e = eng.entries[0]
        e.z_i.fill_(0.5 - 1e-4)   # θ − z_i = 1e-4: a quarter of bfloat16's step at 0.5
        e.u.fill_(3e-5)
        eng.steps.refresh_prox()
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        eng.add_proximal_grad()
        return float(e.param.grad.double().mean())
    got = run_ranks(1, 1, body)[0]
    exact = 1.5e-3 * (1e-4 + 3e-5)
    assert got == pytest.approx(exact, rel=1e-2), (got, exact)


# -- 4. the consensus model: identical on every rank ------------------------------------------------------

def test_finalize_and_consensus_weights_give_every_rank_the_same_model():
    """Steps after the last round move each rank's BatchNorm statistics its own way. finalize() and
    consensus_weights() put z and the statistics averaged in that round into the model: bit-identical on every
    rank, without communication; consensus_weights() restores the rank's own afterwards. Training ends with
    finalize(): another round raises."""
    models = [make_model(rank=r) for r in range(4)]

    def body(rank):
        r = rank.topo.rank
        model = models[r]
        eng = engine(rank, model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        x, y = rank_batch(r)
        train_steps(eng, model, opt, x, y, 3)
        eng.consensus_round()
        averaged = {n: b.clone() for n, b in eng.state.buffers}
        train_steps(eng, model, opt, x, y, 2)            # steps after the round: own data, own statistics
        own = model_state(model)
        ops = rank.ledger.summary()["total"]["ops"]
        with eng.consensus_weights():
            during = model_state(model)
        assert all(torch.equal(v, own[k]) for k, v in model_state(model).items()), "not restored"
        eng.finalize()
        assert rank.ledger.summary()["total"]["ops"] == ops, "the consensus model needs no communication"
        with pytest.raises(RuntimeError, match="after finalize"):
            eng.consensus_round()
        return own, during, model_state(model), averaged
    results = run_ranks(2, 2, body)
    owns, durings, finals, averaged = zip(*results)
    bn = "1.running_mean"
    assert not torch.equal(owns[0][bn], owns[1][bn])   # the case is real: the ranks' own statistics differ
    for states in (durings, finals):
        for k in states[0]:
            assert all(torch.equal(s[k], states[0][k]) for s in states), k
    assert torch.equal(finals[0][bn], averaged[0]["1.running_mean"])
    for name in ("0.weight", "3.weight"):   # the weights are z, at the requested structure
        w = finals[0][name]
        assert int((w.abs().sum((0, 2, 3)) != 0).sum()) == math.ceil(0.5 * w.shape[1])


def test_the_wrapped_optimizer_refuses_to_step_after_finalize(single_process):
    import prunex_hvd as px
    model = make_model()
    opt = px.DistributedOptimizer(sgd(model), model, sparsity="channel:0.5", local_steps=2)
    x, y = rank_batch(0)
    for _ in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    opt.finalize()
    with pytest.raises(RuntimeError, match=r"step\(\) after finalize\(\)"):
        opt.step()
    with pytest.raises(RuntimeError, match=r"after finalize\(\)"):
        opt.consensus()


def test_the_proximal_cache_is_built_once_where_the_masks_freeze(monkeypatch):
    """The cache ρ1(u − z_i) is built once z_i has its final value, not once by the freeze and again after: at
    construction with freeze_round=0, and once by each round on the frozen masks (their values checked against
    the reference in tests/engine/test_engine_threads.py)."""
    built = []
    original = StepHooks.refresh_prox

    def counting(self, in_flight=None):
        built.append(self.state.round)
        original(self, in_flight)
    monkeypatch.setattr(StepHooks, "refresh_prox", counting)

    def body(rank):
        model = make_model()
        eng = engine(rank, model, freeze_round=0)
        at_start, built[:] = list(built), []
        opt = sgd(model)
        x, y = rank_batch(0)
        rounds = []
        for _ in range(2):
            train_steps(eng, model, opt, x, y, 2)
            built[:] = []
            eng.consensus_round(steps=None)
            rounds.append(list(built))
        return eng.frozen, at_start, rounds
    frozen, at_start, rounds = run_ranks(1, 1, body)[0]
    assert frozen and at_start == [0]
    assert rounds == [[0], [1]]   # (in each round's settle, before its count moves on)
