"""compact_compute: a layer held on its frozen block multiplies that block alone, with the dense masked layer's
outputs and gradients (the reference), and the engine switches it on at the freeze and off at finalize."""
import copy
import io

import pytest
import torch
import torch.nn as nn

import prunex_hvd as px
from models_for_tests import toy_cnn
from prunex_hvd.engine import compact_compute as cc
from prunex_hvd.engine import sparsity
from prunex_hvd.engine.sparsity import native


@pytest.fixture(params=["aten", "kernel"])
def block_path(request, monkeypatch):
    """Each way a weight's block is cut out: ATen's index_select, or the native kernel (made to take every layer;
    it takes only large ones by default)."""
    if request.param == "kernel":
        if native.module() is None:
            pytest.skip("the native kernel is not built here")
        monkeypatch.setattr(cc, "_KERNEL_NUMEL", 0)
    else:
        monkeypatch.setattr(cc, "_KERNEL_NUMEL", float("inf"))
    return request.param


def _masked(layer, rows, cols):
    """``layer`` with its weight zero outside ``rows ⊗ cols`` (its GEMM view), as masked retraining holds it."""
    with torch.no_grad():
        layer.weight.copy_(sparsity.apply_masks(layer.weight, rows, cols))
    return layer


def _grads(layer, x):
    x = x.clone().requires_grad_(True)
    layer.zero_grad()
    y = layer(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()   # an uneven upstream gradient
    return y.detach(), x.grad, [p.grad.clone() for p in layer.parameters()]


@pytest.mark.parametrize("spec,bias", [("channel:0.5", False), ("filter:0.5", True), ("channel:0.5+filter:0.25", True),
                                       ("channel:0.5+shape:0.5", True), ("shape:0.4", False)])
def test_a_conv_on_its_block_is_the_masked_conv_forward_and_backward(spec, bias, block_path):
    torch.manual_seed(0)
    dense = nn.Conv2d(6, 8, 3, padding=1, stride=2, bias=bias)
    rows, cols = sparsity.structured_masks(dense.weight.detach(), sparsity.parse_spec(spec))
    _masked(dense, rows, cols)
    compact = copy.deepcopy(dense)
    # shape:0.4 keeps some position of every channel here: no channel to skip, the layer stays plain
    assert cc.compute_on_support(compact, rows, cols) == (spec != "shape:0.4")
    assert (type(compact) is nn.Conv2d) == (spec == "shape:0.4")
    assert (getattr(compact, "_kept_plan", None) is not None) == (block_path == "kernel" and spec != "shape:0.4")
    x = torch.randn(4, 6, 9, 9)
    want, got = _grads(dense, x), _grads(compact, x)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    for g, w in zip(got[2], want[2]):   # the weight's gradient outside the block: 0 (the masked step zeroes it)
        torch.testing.assert_close(g * (sparsity.apply_masks(torch.ones_like(g), rows, cols) if g.dim() == 4 else 1),
                                   w * (sparsity.apply_masks(torch.ones_like(w), rows, cols) if w.dim() == 4 else 1),
                                   rtol=1e-5, atol=1e-6)
    assert float(sparsity.apply_masks(got[2][0], ~rows, torch.ones_like(cols)).abs().sum()) == 0.0


@pytest.mark.parametrize("shape", [(5, 10), (3, 4, 10)])
def test_a_linear_on_its_block_is_the_masked_linear(shape, block_path):
    torch.manual_seed(1)
    dense = nn.Linear(10, 7)
    rows = torch.tensor([True, False, True, True, False, False, True])
    cols = torch.rand(10) < 0.5
    _masked(dense, rows, cols)
    compact = copy.deepcopy(dense)
    assert cc.compute_on_support(compact, rows, cols)
    assert (compact._kept_plan is not None) == (block_path == "kernel")
    x = torch.randn(*shape)
    want, got = _grads(dense, x), _grads(compact, x)
    for g, w in zip(got[:2], want[:2]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2][0] * rows[:, None] * cols[None, :], want[2][0] * rows[:, None] * cols[None, :])
    torch.testing.assert_close(got[2][1], want[2][1])   # every bias row: the dropped rows still write theirs


def test_autocast_and_unbatched_inputs_give_what_the_dense_layer_gives(block_path):
    torch.manual_seed(3)
    linear, conv = nn.Linear(8, 6), nn.Conv2d(3, 4, 3, padding=1)
    rows, cols = torch.tensor([True, False, True, False, True, True]), torch.rand(8) < 0.5
    conv_rows, conv_cols = torch.tensor([True, False, True, True]), torch.zeros(27, dtype=torch.bool)
    conv_cols[9:] = True
    _masked(linear, rows, cols), _masked(conv, conv_rows, conv_cols)
    compact_linear, compact_conv = copy.deepcopy(linear), copy.deepcopy(conv)
    assert cc.compute_on_support(compact_linear, rows, cols) and cc.compute_on_support(compact_conv, conv_rows,
                                                                                        conv_cols)
    x, img = torch.randn(5, 8), torch.randn(2, 3, 6, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):   # the bias of the dropped rows joins in the output's dtype
        for dense, compact, inp in ((linear, compact_linear, x), (conv, compact_conv, img)):
            want, got = dense(inp), compact(inp)
            assert got.dtype == want.dtype == torch.bfloat16
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(compact_conv(img[0]), conv(img[0]), rtol=1e-5, atol=1e-6)   # (C, H, W)


def test_the_swap_survives_copies_and_pickles_and_undoes_to_the_plain_layer(block_path):
    conv = nn.Conv2d(4, 6, 3)
    rows, cols = torch.ones(6, dtype=torch.bool), torch.zeros(4 * 9, dtype=torch.bool)
    cols[9:27] = True   # input channels 1 and 2
    _masked(conv, rows, cols)
    keys = list(conv.state_dict())
    assert cc.compute_on_support(conv, rows, cols)
    assert isinstance(conv, nn.Conv2d) and list(conv.state_dict()) == keys
    x = torch.randn(2, 4, 5, 5)
    for twin in (copy.deepcopy(conv), torch.load(io.BytesIO(_saved(conv)), weights_only=False)):
        assert type(twin) is type(conv)
        torch.testing.assert_close(twin(x), conv(x))
        with torch.no_grad():
            twin.weight.mul_(2)   # its own weight, not the original's
        torch.testing.assert_close(twin(x) - twin.bias.view(1, -1, 1, 1),
                                   2 * (conv(x) - conv.bias.view(1, -1, 1, 1)), rtol=1e-5, atol=1e-5)
    assert "_in_idx" not in conv.state_dict()
    before = conv(x)
    conv.double()   # the indices stay integers
    assert conv._in_idx.dtype == torch.int64
    torch.testing.assert_close(conv(x.double()).float(), before, rtol=1e-5, atol=1e-6)
    conv.half()   # a dtype the kernel does not take: ATen's path
    torch.testing.assert_close(conv(x.half()).float(), before, rtol=1e-2, atol=1e-2)
    cc.compute_in_full(conv)
    assert type(conv) is nn.Conv2d and not hasattr(conv, "_in_idx") and not hasattr(conv, "_kept_plan")
    assert list(conv.state_dict()) == keys
    cc.compute_in_full(conv)   # a no-op on a plain layer


@pytest.mark.parametrize("spec", ["channel:0.5", "filter:0.5+channel:0.5"])
def test_a_gradient_of_the_gradient_is_the_masked_conv_s(spec, block_path):
    """create_graph (a gradient penalty): the block's backward is differentiated in turn, so the kernel steps
    aside for ATen's differentiable ops there."""
    torch.manual_seed(4)
    dense = nn.Conv2d(6, 8, 3, padding=1)
    rows, cols = sparsity.structured_masks(dense.weight.detach(), sparsity.parse_spec(spec))
    _masked(dense, rows, cols)
    compact = copy.deepcopy(dense)
    assert cc.compute_on_support(compact, rows, cols)
    x = torch.randn(3, 6, 5, 5)
    support = sparsity.apply_masks(torch.ones_like(dense.weight), rows, cols)
    grads = []
    for layer in (dense, compact):
        layer.zero_grad()
        inp = x.clone().requires_grad_(True)
        out = torch.tanh(layer(inp))
        g_in, g_w = torch.autograd.grad(out.pow(2).sum(), (inp, layer.weight), create_graph=True)
        (g_in.pow(2).sum() + (g_w * support).pow(2).sum()).backward()
        grads.append(layer.weight.grad * support)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)


def test_function_transforms_and_forward_mode_give_the_masked_conv_s(block_path):
    """torch.func (grad, jvp) and forward-mode AD cannot follow the kernel's raw pointers: ATen's ops go there."""
    import torch.autograd.forward_ad as fwAD
    from torch.func import functional_call, grad, jvp
    torch.manual_seed(5)
    dense = nn.Conv2d(6, 8, 3, padding=1)
    rows, cols = sparsity.structured_masks(dense.weight.detach(), sparsity.parse_spec("channel:0.5"))
    _masked(dense, rows, cols)
    compact = copy.deepcopy(dense)
    assert cc.compute_on_support(compact, rows, cols)
    x, w, t = torch.randn(2, 6, 5, 5), dense.weight.detach(), torch.randn_like(dense.weight)
    support = sparsity.apply_masks(torch.ones_like(w), rows, cols)
    t = t * support
    got, want = ([grad(lambda v, m=m: functional_call(m, {"weight": v, "bias": m.bias}, (x,)).pow(2).sum())(w)
                  * support for m in (compact, dense)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got, want = ([jvp(lambda v, m=m: functional_call(m, {"weight": v, "bias": m.bias}, (x,)), (w,), (t,))[1]
                  for m in (compact, dense)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    outs = []
    for m in (compact, dense):
        with fwAD.dual_level():
            out = functional_call(m, {"weight": fwAD.make_dual(w, t), "bias": m.bias}, (x,))
            outs.append(fwAD.unpack_dual(out).tangent)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)


def test_a_compact_layer_unpickled_before_the_kernel_loads_still_runs(monkeypatch):
    """A compact layer saved with its kernel plan and loaded in a new process: the kernel loads on first use."""
    conv = nn.Conv2d(128, 128, 3)
    rows, cols = torch.ones(128, dtype=torch.bool), torch.zeros(128 * 9, dtype=torch.bool)
    cols[: 64 * 9] = True
    _masked(conv, rows, cols)
    x = torch.randn(1, 128, 4, 4)
    want = conv(x)
    assert cc.compute_on_support(conv, rows, cols)
    twin = torch.load(io.BytesIO(_saved(conv)), weights_only=False)
    monkeypatch.setattr(native, "compress", None)   # as in a process that has not loaded it
    monkeypatch.setattr(native, "expand", None)
    monkeypatch.setitem(native._state, "tried", False)
    torch.testing.assert_close(twin(x), want, rtol=1e-4, atol=1e-5)


def test_the_kernel_takes_large_cpu_weights_only():
    big, small = nn.Conv2d(128, 128, 3), nn.Conv2d(8, 8, 3)   # 147456 and 576 weights
    for layer in (big, small):
        rows, cols = torch.ones(layer.out_channels, dtype=torch.bool), torch.zeros(layer.in_channels * 9,
                                                                                   dtype=torch.bool)
        cols[: layer.in_channels * 9 // 2] = True
        assert cc.compute_on_support(layer, rows, cols)
    assert small.weight.numel() < cc._KERNEL_NUMEL <= big.weight.numel()
    assert small._kept_plan is None and (big._kept_plan is not None) == (native.module() is not None)
    assert cc.kept_block_plan(small.weight, small._in_idx, None) is None


def _saved(module) -> bytes:
    blob = io.BytesIO()
    torch.save(module, blob)
    return blob.getvalue()


def test_layers_it_cannot_or_need_not_compact_are_left_alone():
    grouped = nn.Conv2d(4, 4, 3, groups=2)
    assert not cc.supports(grouped)
    assert not cc.compute_on_support(grouped, torch.ones(4, dtype=torch.bool), torch.zeros(18, dtype=torch.bool))

    class MyConv(nn.Conv2d):
        pass
    assert not cc.supports(MyConv(2, 2, 1)) and not cc.supports(nn.ConvTranspose2d(2, 2, 1))
    conv = nn.Conv2d(2, 3, 1)
    assert not cc.compute_on_support(conv, torch.ones(3, dtype=torch.bool), torch.ones(2, dtype=torch.bool))
    assert type(conv) is nn.Conv2d   # the whole weight is the block: nothing to save
    with pytest.raises(ValueError, match=r"masks of 3 rows x 5 columns do not fit a weight of shape \(3, 2, 1, 1\)"):
        cc.compute_on_support(conv, torch.ones(3, dtype=torch.bool), torch.ones(5, dtype=torch.bool))


# the engine's runs: the paper's round restarting at z (each conv keeps its own half of its channels, so both
# turn compact; the lr as SGD sets it), the masks frozen after round 2
ENGINE_RUN = dict(sparsity="channel:0.5", local_steps=3, rho1=0.05, rho2=0.01, freeze_round=2)
ROUND = px.ConsensusConfig.paper(restart="global")


def _run(steps=15, **kw):
    model = toy_cnn(0)
    opt = px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model, ROUND,
                                  **dict(ENGINE_RUN, **kw))
    g = torch.Generator().manual_seed(1)
    compact_at = []
    for step in range(steps):
        x, y = torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        compact_at.append(type(model[3]) is not nn.Conv2d)
    return model, opt, compact_at


@pytest.mark.usefixtures("single_process")
@pytest.mark.parametrize("knobs,plain_steps", [({}, 5), ({"restart": "none"}, 6)])
def test_the_engine_compacts_from_the_freeze_to_finalize_and_trains_the_same_model(knobs, plain_steps, block_path,
                                                                                    monkeypatch):
    model, opt, compact_at = _run(**knobs)
    with monkeypatch.context() as mp:   # the dense-compute run: no layer taken for compact compute
        mp.setattr(cc, "supports", lambda layer: False)
        ref, ref_opt, ref_at = _run(**knobs)
    # frozen at the round after step 6 (2 rounds of 3 steps); θ restarts on z there, or (restart="none") is on
    # the structure after step 7 masks it
    assert compact_at == [False] * plain_steps + [True] * (15 - plain_steps)
    assert not any(ref_at)
    opt.finalize()
    ref_opt.finalize()
    assert all(type(m) in (nn.Conv2d, nn.Linear) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.usefixtures("single_process")
def test_the_gradient_mask_is_skipped_only_where_every_structured_weight_is_checked(monkeypatch):
    """add_proximal_grad(grads_on_structure=True) skips the mask only when θ was checked on the structure for every
    structured weight: here one sits in a conv subclass that compact compute leaves alone, so it is masked."""
    from prunex_hvd.engine.steps import StepHooks

    class MyConv(nn.Conv2d):
        pass
    monkeypatch.setattr(StepHooks, "syncs_node_grads", property(lambda self: True))   # as on a node of two ranks
    for own_conv in (False, True):
        model = toy_cnn(0)
        if own_conv:
            model[3].__class__ = MyConv
        opt = px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, ROUND,
                                      sparsity="channel:0.5", local_steps=1, freeze_round=1, node_sync=True)
        eng = opt._engine
        x = torch.randn(8, 3, 6, 6)
        for _ in range(3):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        assert eng.frozen and eng.steps.computing_compact
        for e in eng.structured:
            e.param.grad = torch.ones_like(e.param)   # nonzero outside the structure: the mask alone clears it
        eng.add_proximal_grad(grads_on_structure=True)
        outside = sum(float((e.param.grad * (1 - m)).abs().sum()) for e, m in zip(eng.structured,
                                                                               eng.masks.support()))
        assert (outside == 0.0) == own_conv


@pytest.mark.usefixtures("single_process")
def test_a_resumed_run_computes_on_the_block_again():
    model, opt, _ = _run(steps=9)
    blob = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, blob)
    fresh = toy_cnn(0)
    fresh_opt = px.DistributedOptimizer(torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9), fresh, ROUND,
                                        **ENGINE_RUN)
    assert type(fresh[3]) is nn.Conv2d
    blob.seek(0)
    saved = torch.load(blob, weights_only=False)
    fresh.load_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["opt"])
    assert type(fresh[3]) is type(model[3]) is not nn.Conv2d
    torch.testing.assert_close(fresh[3]._in_idx, model[3]._in_idx)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_compact_layer_moves_to_the_gpu_with_its_indices():
    conv = nn.Conv2d(4, 6, 3)
    rows, cols = torch.ones(6, dtype=torch.bool), torch.zeros(4 * 9, dtype=torch.bool)
    cols[:18] = True
    _masked(conv, rows, cols)
    x = torch.randn(2, 4, 5, 5)
    want = conv(x)
    assert cc.compute_on_support(conv, rows, cols)
    conv.cuda()
    assert conv._in_idx.is_cuda
    torch.testing.assert_close(conv(x.cuda()).cpu(), want, rtol=1e-4, atol=1e-5)


def test_a_compact_layer_traces_and_exports_as_the_layer_it_was():
    from prunex_hvd.app import export
    from prunex_hvd.engine.dependencies import channel_couplings, symbolic_trace
    torch.manual_seed(2)
    model = toy_cnn(0).eval()
    rows, cols = torch.ones(6, dtype=torch.bool), torch.zeros(8 * 9, dtype=torch.bool)
    cols[:36] = True   # conv 3 reads channels 0-3 of conv 0's 8
    _masked(model[3], rows, cols)
    plain_graph = [(n.op, str(n.target)) for n in symbolic_trace(model).graph.nodes]
    plain_pairs = channel_couplings(model)
    x = torch.randn(4, 3, 6, 6)
    want = model(x)
    assert cc.compute_on_support(model[3], rows, cols)
    assert [(n.op, str(n.target)) for n in symbolic_trace(model).graph.nodes] == plain_graph
    assert channel_couplings(model) == plain_pairs
    small, report = export.slim(model, x)
    assert report["removed"] == 4 and cc.is_compact(model[3])   # conv 0's unread filters go; the model is not touched
    torch.testing.assert_close(small(x), want, rtol=1e-4, atol=1e-5)
