"""Top-K gradient sparsification with error feedback (the ``topk`` baseline).

The compression itself (nothing is lost: sent + residual adds up to every gradient ever seen), the wrapper
in one process (trains, stats, exact resume, errors), and a 4-rank launch as 2 nodes × 2 where rank 0
checks every step against a plain reference and the bytes against the ring-model formula exactly."""
import io
import math

import pytest
import torch
import torch.nn as nn

from prunex_hvd.baselines import topk

from launching import needs_mpirun, worker_results
from shared_launches import register
from models_for_tests import toy_cnn


# -- the compression ---------------------------------------------------------------------------------------
def dense(values, indices, n):
    out = torch.zeros(n, dtype=values.dtype)
    out[indices.long()] = values
    return out


def test_error_feedback_loses_nothing():
    g = torch.Generator().manual_seed(0)
    n, k, steps = 257, 13, 20
    residual, sent_total, grad_total = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    for _ in range(steps):
        grad = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 3   # uneven magnitudes
        acc = grad + residual
        acc_before = acc.clone()
        values, indices, residual = topk.topk_compress(acc, k)
        assert torch.equal(acc, acc_before), "topk_compress must not modify its input"
        assert indices.dtype == torch.int32 and values.dtype == acc.dtype
        assert values.numel() == k and indices.unique().numel() == k
        sent = dense(values, indices, n)
        assert int((sent != 0).sum()) == k
        torch.testing.assert_close(sent + residual, acc, rtol=0, atol=0)   # a split, not an approximation
        chosen = torch.zeros(n, dtype=torch.bool)
        chosen[indices.long()] = True
        assert acc.abs()[chosen].min() >= acc.abs()[~chosen].max()         # the largest |acc| were picked
        assert torch.equal(residual[chosen], torch.zeros(k))
        sent_total += sent
        grad_total += grad
    torch.testing.assert_close(sent_total + residual, grad_total)


def test_compress_edges_and_errors():
    acc = torch.tensor([0.5, -3.0, 2.0, -0.25])
    values, indices, residual = topk.topk_compress(acc, 2)
    assert sorted(indices.tolist()) == [1, 2] and sorted(values.tolist()) == [-3.0, 2.0]
    assert residual.tolist() == [0.5, 0.0, 0.0, -0.25]
    values, indices, residual = topk.topk_compress(acc, 4)   # k = n: everything goes, nothing stays
    assert torch.equal(residual, torch.zeros(4)) and sorted(indices.tolist()) == [0, 1, 2, 3]
    for bad in (0, 5, 1.0, True):
        with pytest.raises(ValueError, match="k must be"):
            topk.topk_compress(acc, bad)
    with pytest.raises(ValueError, match="flat"):
        topk.topk_compress(acc.view(2, 2), 1)
    assert [topk.layer_k(n, 0.01) for n in (1, 100, 101, 1000)] == [1, 1, 2, 10]
    assert topk.layer_k(100, 0.07) == 7   # 0.07 * 100 is 7.000000000000001 in floating point


# -- one process -------------------------------------------------------------------------------------------
# (the single_process fixture is in conftest.py)


def make(seed=0, **kw):
    model = toy_cnn(seed)
    args = dict(ratio=0.2)
    args.update(kw)
    opt = topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, **args)
    return model, opt


def batches(steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(32, 3, 6, 6, generator=g), torch.randint(0, 4, (32,), generator=g)
    return [(x, y)] * steps


def train(model, opt, data):
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_single_process_trains_and_reports(single_process):
    model, opt = make(warmup_steps=2)
    assert isinstance(opt, torch.optim.SGD)
    losses = train(model, opt, batches(40))
    assert losses[-1] < 0.5 * losses[0], losses
    s = opt.stats()
    for key in ("rounds", "steps", "inter_bytes", "intra_bytes", "dense_inter_bytes", "density"):
        assert key in s
    assert s["rounds"] == s["steps"] == 40 and s["density"] == 1.0
    assert s["inter_bytes"] == s["intra_bytes"] == 0 == s["dense_inter_bytes"]   # a group of one sends nothing
    numels = [p.numel() for p in model.parameters()]
    assert s["sent_elements_per_step"] == sum(max(1, math.ceil(0.2 * n)) for n in numels)
    assert s["topk_ratio"] == 0.2 and opt.records_per_epoch
    with opt.consensus_weights():
        pass
    opt.finalize()


def test_sparse_step_in_one_process_is_topk_of_grad_plus_residual(single_process):
    model, opt = make(ratio=0.1)
    params = list(model.parameters())
    train(model, opt, batches(3))
    x, y = batches(1, seed=5)[0]
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in params]
    residual = opt._residual.clone()
    opt.step()
    off = 0
    for p, grad in zip(params, grads):
        n = p.numel()
        values, idx, res = topk.topk_compress(grad.reshape(-1) + residual[off:off + n], max(1, math.ceil(0.1 * n)))
        torch.testing.assert_close(p.grad.reshape(-1), dense(values, idx, n), rtol=0, atol=0)
        torch.testing.assert_close(opt._residual[off:off + n], res, rtol=0, atol=0)
        off += n


def test_state_dict_round_trips_the_residual_exactly(single_process):
    model, opt = make(warmup_steps=1)
    train(model, opt, batches(5))
    assert opt._residual.abs().sum() > 0
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)   # as a checkpoint does: a copy, not live references
    buf.seek(0)
    saved = torch.load(buf)
    residual = opt._residual.clone()
    tail = batches(4, seed=7)
    want = train(model, opt, tail)

    model2, opt2 = make(seed=3, warmup_steps=1)
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved)
    assert torch.equal(opt2._residual, residual)
    assert opt2.stats()["steps"] == 5
    assert train(model2, opt2, tail) == want                       # resume continues bit-exactly
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    assert torch.equal(opt2._residual, opt._residual)

    with pytest.raises(ValueError, match="no 'method' state"):
        opt2.load_state_dict({k: v for k, v in saved.items() if k != "method"})
    other = nn.Sequential(*[nn.Linear(3, 3) for _ in range(4)])   # as many parameters, other shapes
    opt3 = topk.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9), other)
    with pytest.raises(ValueError, match="another model"):
        opt3.load_state_dict(saved)


def test_unused_parameter_gets_a_zero_gradient(single_process):
    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Linear(4, 2), "unused": nn.Linear(4, 2)})
    opt = topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, ratio=0.5)
    model["used"](torch.randn(3, 4)).sum().backward()
    opt.step()
    assert torch.equal(model["unused"].weight.grad, torch.zeros(2, 4))
    assert opt.stats()["sent_elements_per_step"] == 2 * (4 + 1)


@pytest.mark.parametrize("kw, match", [
    (dict(ratio=0), "ratio"), (dict(ratio=1.5), "ratio"), (dict(ratio=-0.1), "ratio"),
    (dict(ratio=float("nan")), "ratio"), (dict(ratio="0.1"), "ratio"), (dict(ratio=True), "ratio"),
    (dict(warmup_steps=-1), "warmup_steps"), (dict(warmup_steps=1.5), "warmup_steps"),
    (dict(bucket_mb=0), "bucket_mb"),
])
def test_bad_arguments(single_process, kw, match):
    with pytest.raises(ValueError, match=match):
        make(**kw)


def test_foreign_parameters_and_non_optimizers_are_refused(single_process):
    model, other = nn.Linear(3, 2), nn.Linear(3, 2)
    with pytest.raises(ValueError, match="not the model's"):
        topk.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1), model)
    with pytest.raises(ValueError, match="torch.optim.Optimizer"):
        topk.DistributedOptimizer(object(), model)
    with pytest.raises(ValueError, match="closure"):
        opt = topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
        opt.step(lambda: 0.0)


# -- four ranks, two nodes ---------------------------------------------------------------------------------
STEPS, WARMUP = 5, 2


LAUNCH_CASE = register("mpirun-2x2", "topk", "topk_worker", "--backend", "mpi", "--steps", str(STEPS),
                       "--warmup-steps", str(WARMUP))


@needs_mpirun
@pytest.mark.launch
def test_topk_mpirun_matches_reference_and_byte_formula(shared_launch):
    proc, out = shared_launch("mpirun-2x2")
    results = worker_results(proc, out, "topk", case=LAUNCH_CASE)
    assert results[0]["checks"] == 4 * STEPS
    K = sum(results[0]["ks"])
    numel = sum(results[0]["numels"])
    buckets = results[0]["bucket_numels"]
    assert len(buckets) > 1 and sum(buckets) == numel   # the warm-up really ran in several buckets
    assert results[0]["stats"]["sent_elements_per_step"] == K
    # ring 0→1→2→3→0 over nodes {0,1} {2,3}: ranks 1 and 3 send across. An allgather of blocks B has each
    # rank send 3B (values K·4 + indices K·4); a dense allreduce of B sends 2·3/4·B.
    sparse_rank = 3 * (4 * K + 4 * K)
    dense_rank = sum(2 * 3 * (4 * n) // 4 for n in buckets)
    per_rank = (STEPS - WARMUP) * sparse_rank + WARMUP * dense_rank
    assert sum(r["stats"]["inter_bytes"] for r in results) == 2 * per_rank
    dense_counterfactual = STEPS * (2 * 3 * 4 * numel // 4)
    for res in results:
        rank, stats, led = res["rank"], res["stats"], res["ledger"]
        crosses = rank in (1, 3)
        assert res["topology"]["node"] == rank // 2
        assert stats["rounds"] == stats["steps"] == STEPS
        assert stats["inter_bytes"] == (per_rank if crosses else 0), f"rank {rank}"
        assert stats["intra_bytes"] == (0 if crosses else per_rank), f"rank {rank}"
        assert stats["dense_inter_bytes"] == (dense_counterfactual if crosses else 0), f"rank {rank}"
        by_op = led["world"]["by_op"]
        assert set(by_op) == {"allgather[gradients]", "allreduce[gradients]"}, by_op
        assert by_op["allgather[gradients]"]["ops"] == 2 * (STEPS - WARMUP)
        assert by_op["allgather[gradients]"]["payload_bytes"] == (STEPS - WARMUP) * 8 * K
        assert by_op["allreduce[gradients]"]["ops"] == WARMUP * len(buckets)
        assert led["total"]["cross_node_bytes"] == stats["inter_bytes"], f"rank {rank}"
        assert led["total"]["wire_bytes"] == stats["inter_bytes"] + stats["intra_bytes"], f"rank {rank}"
        assert led["intra"]["ops"] == 0 and led["inter"]["ops"] == 0
