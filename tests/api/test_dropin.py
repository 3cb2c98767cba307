"""What existing training scripts do around the optimizer, in one process (a 1×1 cluster): mixed precision with a
GradScaler (plain and Horovod's pattern), torch.compile, a DDP-wrapped model, Horovod's keyword arguments,
gradient accumulation and clipping. The multi-rank behaviour (a rank skipping a step, the rounds still aligned)
is in test_dropin_launch.py."""
import copy

import pytest
import torch
import torch.nn as nn

import prunex_hvd as px
from engine_cases import AMP_PATTERNS, amp_step
from models_for_tests import toy_cnn

pytestmark = pytest.mark.usefixtures("single_process")   # conftest.py
KNOBS = dict(sparsity="channel:0.5", local_steps=3, rho1=0.05, rho2=0.01, coupled=True)


def wrapped(model, **kw):
    return px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                                   **dict(KNOBS, **kw))


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def momenta(opt):
    return [s["momentum_buffer"].clone() for s in opt.state.values() if s.get("momentum_buffer") is not None]


def plain_step(model, opt, x, y):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()


@pytest.mark.parametrize("pattern", AMP_PATTERNS)
def test_a_scaled_step_is_the_unscaled_step(pattern):
    """GradScaler's scale is a power of two: the unscaled gradients are exactly the plain ones, so a run under the
    scaler equals the same run without it, bit for bit, rounds included."""
    ref_model, model = toy_cnn(0), toy_cnn(0)
    ref, opt, scaler = wrapped(ref_model), wrapped(model), torch.amp.GradScaler("cpu")
    for x, y in batches(7):
        plain_step(ref_model, ref, x, y)
        amp_step(model, opt, scaler, x, y, pattern=pattern)
    assert opt.rounds_done() == ref.rounds_done() == 2
    for a, b in zip(params(model), params(ref_model)):
        assert torch.equal(a, b)


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs CUDA (float16 autocast)")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("pattern", AMP_PATTERNS)
def test_a_step_with_inf_is_skipped_and_counted(pattern, device):
    """The scaler finds a NaN: θ and the momentum stay, the scale halves, and the step still counts toward the
    round (every rank sees the same number of iterations, whichever ones its scaler skipped). CPU: bfloat16
    autocast; CUDA: float16, what GPU scripts use."""
    model = toy_cnn(0).to(device)
    opt, scaler = wrapped(model), torch.amp.GradScaler(device)
    data = batches(6)
    amp_step(model, opt, scaler, *data[0], device=device)
    before, buffers, scale = params(model), momenta(opt), scaler.get_scale()
    amp_step(model, opt, scaler, *data[1], float("nan"), pattern, device)
    assert all(torch.equal(a, b) for a, b in zip(params(model), before))
    assert all(torch.equal(a, b) for a, b in zip(momenta(opt), buffers))
    assert scaler.get_scale() == scale / 2 and opt.stats()["steps"] == 2
    amp_step(model, opt, scaler, *data[2], device=device)
    assert opt.rounds_done() == 1 and opt.stats()["steps"] == 3
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")   # the scaler's, removed after step


def test_horovods_state_initialisation_is_not_a_training_step():
    """hvd.broadcast_optimizer_state() on a fresh optimizer sets every gradient to zero and calls step() to create
    the state: the momentum buffers appear, θ stays, and the step is not counted (the rounds keep their period)."""
    model = toy_cnn(0)
    opt = wrapped(model)
    before = params(model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert len(momenta(opt)) == len(before) and opt.stats()["steps"] == 0
    assert all(torch.equal(a, b) for a, b in zip(params(model), before))
    for x, y in batches(3):
        plain_step(model, opt, x, y)
    assert opt.rounds_done() == 1 and opt.stats()["steps"] == 3
    for p in model.parameters():   # later, an all-zero gradient is a step like any other
        p.grad = torch.zeros_like(p)
    opt.step()
    assert opt.stats()["steps"] == 4


def test_fused_inner_optimizer_under_the_scaler_unscales_once():
    """An optimizer that handles the scaler itself (fused SGD reads grad_scale / found_inf) sees unscaled,
    checked gradients and no scaler state: the same step as without the scaler."""
    try:
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1, fused=True)
    except (RuntimeError, ValueError) as exc:
        pytest.skip(f"fused SGD is not available on CPU here: {exc}")
    ref_model, model = toy_cnn(0), toy_cnn(0)
    ref = px.DistributedOptimizer(torch.optim.SGD(ref_model.parameters(), lr=0.05, fused=True), ref_model, **KNOBS)
    opt = px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, fused=True), model, **KNOBS)
    scaler = torch.amp.GradScaler("cpu")
    for x, y in batches(4):
        plain_step(ref_model, ref, x, y)
        amp_step(model, opt, scaler, x, y)
    for a, b in zip(params(model), params(ref_model)):
        assert torch.equal(a, b)


def test_gradient_accumulation_and_clipping_between_backward_and_step():
    """Two backward passes, clip_grad_norm_, step: the user's optimizer steps on the clipped sum plus the
    proximal term (added in step(), after the user's clipping)."""
    model = toy_cnn(0)
    opt = wrapped(model, backward_passes_per_step=2)
    data = batches(8)
    for x, y in data[:6]:   # two rounds: z_i and u are no longer trivial
        plain_step(model, opt, x, y)
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9)
    state = copy.deepcopy(opt.state_dict())   # load_state_dict would share the momentum buffers
    ref_opt.load_state_dict({"state": state["state"], "param_groups": state["param_groups"]})
    opt.zero_grad()
    for x, y in data[6:]:
        nn.functional.cross_entropy(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    entries = {e.name: e for e in opt._engine.entries}
    for (name, p), g in zip(ref_model.named_parameters(), grads):
        e = entries[name]
        p.grad = g + e.rho1 * (p.detach() - e.z_i + e.u)
    ref_opt.step()
    for a, b in zip(params(model), params(ref_model)):
        torch.testing.assert_close(a, b)
    assert opt.stats()["steps"] == 7


def test_a_compiled_model_trains_as_its_module_does():
    """torch.compile: the coupled trace goes through the original module, names stay the user's, and the run
    (rounds, freezing, finalize) equals the uncompiled one."""
    ref_model, model = toy_cnn(0), toy_cnn(0)
    compiled = torch.compile(model, backend="aot_eager")
    ref, opt = wrapped(ref_model, freeze_round=2), wrapped(compiled, freeze_round=2)
    assert set(opt.stats()["layer_density"]) == set(ref.stats()["layer_density"])
    assert not any("_orig_mod" in n for n in opt.stats()["layer_density"])
    for x, y in batches(9):
        for m, o in ((ref_model, ref), (compiled, opt)):
            o.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    assert opt.stats()["frozen"] and opt.rounds_done() == 3
    opt.finalize()
    ref.finalize()
    for a, b in zip(params(model), params(ref_model)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    x = batches(1, seed=5)[0][0]
    torch.testing.assert_close(compiled(x), ref_model(x), rtol=1e-5, atol=1e-5)


def test_a_model_in_ddp_is_refused_with_what_to_remove(tmp_path):
    import torch.distributed as dist
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(toy_cnn(0))
        with pytest.raises(ValueError, match=r"wrapped in DistributedDataParallel.*pass the module itself.*"
                                             r"node_sync=True"):
            wrapped(ddp)
        with pytest.raises(ValueError, match="wrapped in DistributedDataParallel"):
            wrapped(torch.compile(ddp, backend="eager"))
        from prunex_hvd.baselines import averaging
        with pytest.raises(ValueError, match="wrapped in DistributedDataParallel"):
            averaging.LocalSGD(torch.optim.SGD(ddp.parameters(), lr=0.1), ddp, period=2)
    finally:
        dist.destroy_process_group()


class _Compressor:   # Horovod's compressors are classes named so; matched by name, as without Horovod
    pass


def horovod_compression(name):
    try:
        import horovod.torch as hvd
        return {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[name]
    except ImportError:
        return type({"none": "NoneCompressor", "fp16": "FP16Compressor"}[name], (_Compressor,), {})


def horovod_op(name):
    hvd = pytest.importorskip("horovod.torch")
    return getattr(hvd, name)


def test_horovods_first_line_says_to_pass_the_model():
    model = toy_cnn(0)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"needs the model: named_parameters= is not enough.*"
                                         r"px.DistributedOptimizer\(optimizer, model"):
        px.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    with pytest.raises(ValueError, match="needs the model"):
        px.DistributedOptimizer(sgd)
    opt = px.DistributedOptimizer(sgd, model, named_parameters=model.named_parameters(), **KNOBS)
    assert opt.stats()["steps"] == 0
    with pytest.raises(ValueError, match="not the model's"):
        px.DistributedOptimizer(sgd, model, named_parameters=toy_cnn(1).named_parameters(), **KNOBS)


def test_horovods_compression_and_op():
    model = toy_cnn(0)
    # none changes nothing: the recipe's bf16, or the payload asked for
    assert wrapped(model, compression=horovod_compression("none"))._engine.config.payload_dtype == "bf16"
    assert wrapped(model, compression=horovod_compression("none"), payload_dtype=None)._engine.config.payload_dtype \
        is None
    assert wrapped(model, compression=horovod_compression("fp16"))._engine.config.payload_dtype == "fp16"
    with pytest.raises(ValueError, match=r"asks for payload_dtype='fp16', but payload_dtype='bf16'"):
        wrapped(model, compression=horovod_compression("fp16"), payload_dtype="bf16")
    with pytest.raises(ValueError, match="compression=Topk.*hvd.Compression.none or hvd.Compression.fp16"):
        wrapped(model, compression=type("Topk", (), {}))
    assert wrapped(model, op=horovod_op("Average")).stats()["steps"] == 0
    for name in ("Sum", "Adasum"):
        with pytest.raises(ValueError, match=r"only hvd.Average .* remove op="):
            wrapped(model, op=horovod_op(name))


@pytest.mark.parametrize("kw, message", [
    (dict(backward_passes_per_step=0), "backward_passes_per_step must be an integer >= 1"),
    (dict(gradient_predivide_factor=2.0), r"gradient_predivide_factor= \(gradients are not reduced.*remove it"),
    (dict(sparse_as_dense=True), r"sparse_as_dense= \(PruneX exchanges dense"),
    (dict(process_set=object()), r"process_set= \(PruneX forms its own groups"),
])
def test_horovods_other_arguments_are_refused_clearly(kw, message):
    with pytest.raises(ValueError, match=message):
        wrapped(toy_cnn(0), **kw)


def test_sparse_gradients_are_refused_naming_the_module():
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"modules with sparse gradients \(0\).*sparse=False"):
        px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, sparsity={})
