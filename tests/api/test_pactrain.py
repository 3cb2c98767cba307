"""PacTrain (prunex_hvd.baselines.pactrain): the pure pieces, the wrapper in one process, and a real launch.

The launch runs 4 ranks as 2 emulated nodes × 2 under mpirun; rank 0 checks every step against the dense
reference built from the gathered pre-communication gradients (see tests/workers/pactrain_worker.py). Here
we check what it reports: the phases (full sync, then compact), and the exact bytes per step under the
accounting's ring model."""
import io
import math

import pytest
import torch
import torch.nn as nn

import prunex_hvd as px
from launching import needs_mpirun, worker_results
from shared_launches import register
from models_for_tests import toy_cnn
from prunex_hvd.baselines import pactrain
from prunex_hvd.baselines.pactrain import (MaskTracker, grasp_masks, grasp_scores, magnitude_masks, step_seed,
                                           ternarize)


# --------------------------------------------------------------------------------------------- pure

def test_magnitude_masks_keep_the_ceil_largest_with_lowest_index_on_ties():
    w = torch.tensor([1.0, -3.0, 3.0, 2.0, 0.5])
    assert magnitude_masks({"w": w}, {"w": 0.4})["w"].tolist() == [False, True, True, False, False]
    ties = torch.tensor([2.0, -2.0, 2.0, 1.0])
    assert magnitude_masks({"t": ties}, {"t": 0.5})["t"].tolist() == [True, True, False, False]
    g = torch.Generator().manual_seed(0)
    conv = torch.randn(8, 3, 3, 3, generator=g)   # 216 entries
    m = magnitude_masks({"c": conv}, {"c": 0.3})["c"]
    assert m.shape == conv.shape and m.dtype == torch.bool
    assert int(m.sum()) == math.ceil(0.3 * 216) == 65
    assert conv.abs()[m].min() >= conv.abs()[~m].max()


def _tiny_mlp():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def test_grasp_hg_matches_autograd_hvp_and_finite_differences():
    model = _tiny_mlp()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(7, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (7,), generator=g)
    names = ["0.weight", "2.weight"]
    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    scores = grasp_scores(model, nn.functional.cross_entropy, x, y, names)

    def loss_of(*ws):
        full = {n: p.detach() for n, p in params.items()}
        full.update(dict(zip(names, ws)))
        return nn.functional.cross_entropy(torch.func.functional_call(model, full, (x,)), y)
    ws = tuple(params[n].detach() for n in names)
    grad = torch.autograd.functional.vjp(loss_of, ws)[1]   # g = ∇L over the named weights
    _, hg = torch.autograd.functional.hvp(loss_of, ws, grad)
    for n, w, h in zip(names, ws, hg):
        torch.testing.assert_close(scores[n], -w * h)
    # finite differences of the gradient along g: (∇L(θ+εg) - ∇L(θ-εg)) / 2ε ≈ Hg
    eps = 1e-5
    plus = torch.autograd.functional.vjp(loss_of, tuple(w + eps * d for w, d in zip(ws, grad)))[1]
    minus = torch.autograd.functional.vjp(loss_of, tuple(w - eps * d for w, d in zip(ws, grad)))[1]
    for n, w, p, m in zip(names, ws, plus, minus):
        torch.testing.assert_close(scores[n], -w * (p - m) / (2 * eps), rtol=1e-5, atol=1e-8)
    for n, p in params.items():   # the model is left as it was
        assert torch.equal(p.detach(), before[n]) and p.grad is None


def test_grasp_scores_leave_batchnorm_statistics_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))
    stats = {n: b.clone() for n, b in model.named_buffers()}
    grasp_scores(model, nn.functional.cross_entropy, torch.randn(5, 3, 6, 6), torch.randint(0, 2, (5,)),
                 ["0.weight"])
    for n, b in model.named_buffers():
        assert torch.equal(b, stats[n]), n


def test_grasp_masks_keep_the_lowest_scores():
    s = torch.tensor([0.5, -1.0, 2.0, -1.0, 0.0, 3.0])
    assert grasp_masks({"s": s}, {"s": 0.5})["s"].tolist() == [False, True, False, True, True, False]
    assert grasp_masks({"s": s}, {"s": 0.3})["s"].tolist() == [False, True, False, True, False, False]


def test_ternarize_is_unbiased_ternary_int8_and_reproducible():
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(40, generator=g)
    grad[::7] = 0.0
    scale = float(grad.abs().max()) * 1.25
    draws = 5000
    t = ternarize(grad.repeat(draws), scale, torch.Generator().manual_seed(1))
    assert t.dtype == torch.int8 and set(t.unique().tolist()) <= {-1, 0, 1}
    t = t.view(draws, -1)
    assert torch.all(t[:, grad == 0] == 0)
    assert torch.all(t * torch.sign(grad).to(torch.int8) >= 0)   # never the wrong sign
    mean = t.double().mean(0) * scale
    # per-entry std of scale·t is <= scale; 6 standard errors of the mean
    assert torch.all((mean - grad.double()).abs() <= 6 * scale / math.sqrt(draws)), (mean - grad).abs().max()
    again = ternarize(grad.repeat(draws), scale, torch.Generator().manual_seed(1)).view(draws, -1)
    assert torch.equal(t, again)
    assert torch.equal(ternarize(torch.zeros(5), 0.0, None), torch.zeros(5, dtype=torch.int8))
    assert step_seed(0, 1, 2) != step_seed(0, 2, 1) and step_seed(3, 1, 2) == step_seed(3, 1, 2)


def test_mask_tracker_is_stable_after_exactly_patience_unchanged_steps_and_resets_on_change():
    tr = MaskTracker(patience=3)
    a = [torch.tensor([True, False, True]), torch.tensor([True])]
    b = [torch.tensor([True, True, True]), torch.tensor([True])]
    assert [tr.observe(a) for _ in range(4)] == [False, False, False, True]
    assert tr.count() == 3 and [i.tolist() for i in tr.indices()] == [[0, 2], [0]]
    cached = tr.indices()
    assert tr.observe(a) and tr.indices() is cached
    a[0][1] = True   # the caller's buffer changes in place: the tracker kept its own copy
    assert not tr.observe(a) and tr.unchanged == 0
    assert [tr.observe(b) for _ in range(3)] == [False, False, True]
    state = tr.state_dict()
    other = MaskTracker(patience=3)
    other.load_state_dict(state)
    assert other.stable and other.unchanged == 3 and [i.tolist() for i in other.indices()] == [[0, 1, 2], [0]]
    with pytest.raises(ValueError, match="patience"):
        MaskTracker(0)


# --------------------------------------------------------------------------------------------- one process

# (the single_process fixture is in conftest.py)


def make(seed=0, lr=0.05, **kw):
    model = toy_cnn(seed)
    opt = pactrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-3),
                                        model, **kw)
    return model, opt


def task(n=64, seed=1):
    """Learnable: the class is the channel (of 3, plus 'none') with the largest mean."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 6, 6, generator=g) * 0.5
    y = torch.randint(0, 4, (n,), generator=g)
    for i in range(n):
        if y[i] < 3:
            x[i, y[i]] += 1.0
    return x, y


def train(model, opt, steps, seed=1, batch=16):
    x, y = task(seed=seed)
    losses = []
    for s in range(steps):
        i = (s % (len(x) // batch)) * batch
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[i:i + batch]), y[i:i + batch])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def pruned_stay_zero(model, opt):
    for name, p in model.named_parameters():
        if name in opt._masks:
            assert torch.all(p.detach()[~opt._masks[name]] == 0), name


@pytest.mark.parametrize("terngrad", [False, True])
def test_trains_and_pruned_weights_stay_exactly_zero(single_process, terngrad):
    model, opt = make(terngrad=terngrad, patience=2)
    assert isinstance(opt, torch.optim.SGD)
    pruned_stay_zero(model, opt)
    losses = train(model, opt, 80)
    assert sum(losses[-8:]) / 8 < 0.6 * sum(losses[:8]) / 8, losses
    pruned_stay_zero(model, opt)
    for name, p in model.named_parameters():   # GSE: the synchronised gradient is masked too
        if name in opt._masks:
            assert torch.all(p.grad[~opt._masks[name]] == 0), name
    s = opt.stats()
    assert s["steps"] == s["rounds"] == 80 and s["mask_stable"] and s["terngrad"] == terngrad
    assert s["inter_bytes"] == s["intra_bytes"] == 0     # one process: nothing moves
    kept = sum(int(m.sum()) for m in opt._masks.values())
    total = sum(p.numel() for p in model.parameters())
    assert s["compact_elements"] == total - sum(m.numel() for m in opt._masks.values()) + kept
    opt.finalize()


@pytest.mark.parametrize("spec,want", [
    ("channel:0.5", {"0.weight": 0.5, "3.weight": 0.5}),
    ("filter:0.5+channel:0.5", {"0.weight": math.ceil(0.25 * 216) / 216, "3.weight": 0.25}),
    ({"0.*": "dense", "*": "shape:0.3"}, {"3.weight": math.ceil(0.3 * 432) / 432}),
])
def test_density_is_the_product_of_the_specs_keep_ratios(single_process, spec, want):
    model, opt = make(sparsity=spec)
    assert opt.layer_density() == pytest.approx(want)
    numel = {n: p.numel() for n, p in model.named_parameters()}
    assert opt.density() == pytest.approx(sum(want[n] * numel[n] for n in want) / sum(numel[n] for n in want))
    fresh = dict(toy_cnn().named_parameters())
    for name, p in model.named_parameters():
        if name in want:
            assert int(torch.count_nonzero(p.detach())) == round(want[name] * numel[name]), name
        else:
            assert torch.equal(p.detach(), fresh[name].detach()), name   # other params untouched


def test_on_a_vit_it_prunes_the_layers_prunex_would(single_process):
    """The same density comparison on a transformer: head:0.5 holds q/k/v/proj, neuron:0.5 the MLPs' fc1."""
    from prunex_hvd.app import models
    torch.manual_seed(0)
    model = models.build("vit_tiny", num_classes=10, in_channels=1)
    opt = pactrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                        sparsity="head:0.5+neuron:0.5")
    want = {f"blocks.{b}.{n}.weight": 0.5 for b in range(4) for n in ("attn.q", "attn.k", "attn.v", "attn.proj",
                                                                       "mlp.fc1")}
    assert opt.layer_density() == pytest.approx(want)


def _channel_mask_by_hand(w, keep):
    """Independent of the projection code: keep ceil(keep·C_in) input channels of largest ‖W[:, c]‖ (ties: lowest
    index), every output filter, as a weight-shaped bool mask."""
    norms = w.detach().double().square().sum((0, 2, 3))
    k = math.ceil(keep * w.shape[1])
    kept = sorted(range(w.shape[1]), key=lambda c: (-float(norms[c]), c))[:k]
    mask = torch.zeros_like(w, dtype=torch.bool)
    mask[:, kept] = True
    return mask


def test_structured_masks_are_prunex_channels_at_init_and_stay(single_process):
    fresh = dict(toy_cnn().named_parameters())
    model, opt = make(structure="structured")
    for name in ("0.weight", "3.weight"):
        want = _channel_mask_by_hand(fresh[name], 0.5)
        assert torch.equal(opt._masks[name], want), name
        assert torch.equal(model.get_parameter(name).detach() != 0, want), name   # pruned at once
    assert opt.layer_density() == {"0.weight": pytest.approx(2 / 3), "3.weight": 0.5}   # ceil(0.5·3) of 3 channels
    losses = train(model, opt, 60)
    assert sum(losses[-8:]) / 8 < 0.7 * sum(losses[:8]) / 8, losses
    for name in ("0.weight", "3.weight"):   # whole input channels, still exactly zero after training
        w = model.get_parameter(name).detach()
        dropped = ~opt._masks[name][0, :, 0, 0]
        assert torch.all(w[:, dropped] == 0) and torch.all(opt._masks[name][:, ~dropped]), name


def test_structured_coupled_drops_the_producers_filters_with_the_consumers_channels(single_process):
    model, opt = make(structure="structured", coupled=True)
    read = opt._masks["3.weight"][0, :, 0, 0]           # the 8 channels conv 3 reads
    assert int(read.sum()) == 4
    assert torch.equal(opt._masks["0.weight"][:, 0, 0, 0], read)   # conv 0 keeps exactly those filters
    assert not opt._masks["0.weight"][~read].any()                  # the others whole gone
    assert opt.layer_density() == {"0.weight": pytest.approx(4 / 8 * 2 / 3), "3.weight": 0.5}


def test_structured_heads_on_a_vit_are_prunex_heads(single_process):
    from prunex_hvd.app import models
    from prunex_hvd.engine.config import ConsensusConfig, Structure
    from prunex_hvd.engine.sparsity.projection import coupled_masks
    torch.manual_seed(0)
    model = models.build("vit_tiny", num_classes=10, in_channels=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = pactrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                        sparsity="head:0.5", structure="structured")
    structure = Structure.resolve(model, ConsensusConfig(sparsity="head:0.5"))
    support = coupled_masks(before, structure.specs, {}, (), structure.heads)
    assert set(opt._masks) == set(support) and len(support) == 16
    for name, (rows, cols) in support.items():
        assert torch.equal(opt._masks[name], rows[:, None] & cols[None, :]), name
    q = opt._masks["blocks.0.attn.q.weight"]
    assert int(q.all(1).sum()) == 64 and int(q.any(1).sum()) == 64   # 2 of 4 heads of 32 rows, whole rows


def test_grasp_masks_from_the_single_rank_scores(single_process):
    x, y = task(n=16, seed=3)
    ref_model = toy_cnn()
    ref = grasp_masks(grasp_scores(ref_model, nn.functional.cross_entropy, x, y, ["0.weight", "3.weight"]),
                      {"0.weight": 0.5, "3.weight": 0.5})
    model, opt = make(score="grasp", grasp_batch=(x, y))
    for name in ref:
        assert torch.equal(opt._masks[name], ref[name]), name
    assert opt.density() == 0.5
    train(model, opt, 10)
    pruned_stay_zero(model, opt)


def test_methods_registry_builds_pactrain(single_process):
    from prunex_hvd.app import methods
    from prunex_hvd.app.train import TrainConfig
    model = toy_cnn()
    cfg = TrainConfig.from_flat(sparsity="channel:0.5", pactrain_score="grasp", pactrain_patience=1, terngrad=True,
                                seed=4)
    opt = methods.wrap("pactrain", torch.optim.SGD(model.parameters(), lr=0.05), model, cfg,
                       sample_batch=lambda: task(n=8))
    train(model, opt, 3)
    s = opt.stats()
    assert set(methods.STATS_KEYS) <= set(s) and s["terngrad"] and s["mask_stable"]
    structured = TrainConfig.from_flat(method="pactrain", sparsity="channel:0.5", coupled=True,
                                       pactrain_structure="structured")
    structured.validate()   # --coupled is taken by structured PacTrain (refused for single weights: test_train_single)
    model = toy_cnn()
    opt = methods.wrap("pactrain", torch.optim.SGD(model.parameters(), lr=0.05), model, structured,
                       sample_batch=lambda: task(n=8))
    assert torch.equal(opt._masks["0.weight"][:, 0, 0, 0], opt._masks["3.weight"][0, :, 0, 0])   # coupled reached it


def test_state_dict_resume_is_bit_exact(single_process):
    model_a, opt_a = make(terngrad=True, patience=3, seed=0)
    train(model_a, opt_a, 5, seed=5)          # past the patience: the tracker is stable
    blob = io.BytesIO()
    torch.save({"model": model_a.state_dict(), "opt": opt_a.state_dict()}, blob)
    train(model_a, opt_a, 6, seed=6)

    px.shutdown()
    model_b, opt_b = make(terngrad=True, patience=3, seed=99)   # another start: all must come from the checkpoint
    blob.seek(0)
    ck = torch.load(blob, weights_only=False)
    model_b.load_state_dict(ck["model"])
    opt_b.load_state_dict(ck["opt"])
    assert opt_b.stats()["mask_stable"] and opt_b.stats()["steps"] == 5
    for name in opt_a._masks:
        assert torch.equal(opt_a._masks[name], opt_b._masks[name])
    train(model_b, opt_b, 6, seed=6)
    for (n, a), (_, b) in zip(model_a.state_dict().items(), model_b.state_dict().items()):
        assert torch.equal(a, b), n
    sa, sb = opt_a.stats(), opt_b.stats()
    assert sa == sb


def test_bad_state_is_refused(single_process):
    model, opt = make()
    with pytest.raises(ValueError, match="no 'method' state"):
        opt.load_state_dict(torch.optim.SGD(model.parameters(), lr=0.1).state_dict())
    other_model, other = make(sparsity={"3.weight": "channel:0.5"})
    with pytest.raises(ValueError, match="same model and sparsity"):
        opt.load_state_dict(other.state_dict())


@pytest.mark.parametrize("kw,message", [
    ({"score": "snip"}, "score must be one of magnitude, grasp"),
    ({"score": "grasp"}, "needs grasp_batch"),
    ({"score": "grasp", "grasp_batch": torch.zeros(3)}, "pair of tensors"),
    ({"patience": 0}, "patience must be an integer >= 1"),
    ({"patience": 1.5}, "patience must be an integer >= 1"),
    ({"bucket_mb": 0}, "bucket_mb must be a finite number > 0"),
    ({"sparsity": "channel:1.5"}, r"keep ratio must be in \(0, 1\]"),
    ({"sparsity": {"6.weight": "channel:0.5"}}, "not a conv weight"),
    ({"structure": "blocks"}, "structure must be one of unstructured, structured"),
    ({"structure": "structured", "score": "grasp", "grasp_batch": (torch.zeros(2, 3, 6, 6), torch.zeros(2).long())},
     "use score='magnitude'"),
    ({"coupled": True}, "needs structure='structured'"),
])
def test_bad_arguments_are_clear_value_errors(single_process, kw, message):
    with pytest.raises(ValueError, match=message):
        make(**kw)


def test_optimizer_must_hold_only_the_models_parameters(single_process):
    model = toy_cnn()
    stray = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="not the model's"):
        pactrain.DistributedOptimizer(torch.optim.SGD(list(model.parameters()) + [stray], lr=0.1), model)
    with pytest.raises(ValueError, match="does not take a closure"):
        model, opt = make()
        opt.step(lambda: 0.0)


# --------------------------------------------------------------------------------------------- launch

STEPS, PATIENCE = 5, 2


def ring_allreduce_job_cross(nbytes: int) -> int:
    """Bytes the whole job sends across nodes for one world allreduce of ``nbytes`` on 2 nodes × 2:
    ring 0→1→2→3→0, ranks 1 and 3 cross, each sends 2·(4-1)/4·B (the ledger's integer formula)."""
    return 2 * (2 * 3 * nbytes // 4)


LAUNCH_CASE = register("mpirun-2x2", "pactrain", "pactrain_worker", "--backend", "mpi", "--steps", str(STEPS),
                       "--patience", str(PATIENCE))


@pytest.mark.launch
@needs_mpirun
def test_pactrain_mpirun_two_nodes(shared_launch):
    proc, out = shared_launch("mpirun-2x2")
    results = worker_results(proc, out, "pactrain", case=LAUNCH_CASE)
    for mode in ("plain", "terngrad", "structured"):
        res0 = results[0][mode]
        assert res0["checks"] == STEPS, mode               # rank 0 checked every step against the reference
        assert res0["world_nodes"] == [0, 0, 1, 1]
        numels, buckets = res0["numels"], res0["bucket_numels"]
        total = sum(numels.values())
        assert sum(buckets) == total and len(buckets) > 1  # several buckets (bucket_mb=0.002)
        for name, (kept, n) in res0["pruned"].items():
            whole, read, c_in = res0["channels"][name]
            if mode == "structured":   # half the input channels, each whole or gone
                assert whole == read == math.ceil(0.5 * c_in) and kept == n // c_in * whole, name
            else:
                assert kept == math.ceil(0.5 * n) and read == c_in, name
        kept_total = total - sum(n - kept for kept, n in res0["pruned"].values())
        phases = [s["stable"] for s in res0["steps"]]
        assert phases == [False] * PATIENCE + [True] * (STEPS - PATIENCE), phases
        w = res0["int8_wire_itemsize"]
        for step in range(STEPS):
            per_rank = [res[mode]["steps"][step]["inter"] for res in results]
            assert per_rank[0] == per_rank[2] == 0, per_rank      # their ring successor is on their node
            job = sum(per_rank)
            compact = res0["steps"][step]["compact"]
            if mode != "terngrad":   # plain and structured: float32 payloads
                if phases[step]:
                    assert sum(compact) == kept_total
                    want = sum(ring_allreduce_job_cross(c * 4) for c in compact if c)
                    assert want == 2 * 1.5 * kept_total * 4
                else:
                    want = sum(ring_allreduce_job_cross(b * 4) for b in buckets)
                    assert want == 2 * 1.5 * total * 4
            else:
                payloads = [c for c in compact if c] if phases[step] else buckets
                want = ring_allreduce_job_cross(len(payloads) * 4) \
                    + sum(ring_allreduce_job_cross(n * w) for n in payloads)
            assert job == want, (mode, step, per_rank, want)
        assert sum(res[mode]["stats"]["inter_bytes"] for res in results) == \
            sum(sum(res[mode]["steps"][s]["inter"] for res in results) for s in range(STEPS))
        assert sum(res[mode]["stats"]["dense_inter_bytes"] for res in results) == \
            STEPS * ring_allreduce_job_cross(total * 4)
