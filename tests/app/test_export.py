"""`prunex-hvd export` / prunex_hvd.app.export: the slim model computes what the masked one does, on real data
(the digits test set), with the channels the masks allow physically gone; save/load; clear errors."""
import json
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from prunex_hvd import sparsity
from prunex_hvd.app import cli, export, models
from prunex_hvd.app.data import ShardedLoader
from prunex_hvd.engine.dependencies import channel_couplings, channel_streams
from prunex_hvd.app.models.resnet import Bottleneck, ResNet


@pytest.fixture(scope="module")
def digit_batches(digits):
    """The digits test set (conftest.py) in normalised batches of 120."""
    return list(ShardedLoader(digits, 120, 0, 1, train=False).batches())


def pruned(model, spec, coupled=False, only=None):
    """The model with its conv weights projected as the engine's finalize() leaves them (``coupled``: False,
    True for pairs, "streams" for pairs and residual streams)."""
    ws = {n: p for n, p in model.named_parameters() if p.dim() == 4 and (only is None or only(n))}
    specs = {n: sparsity.parse_spec(spec) for n in ws}
    new = sparsity.coupled_project(ws, specs, channel_couplings(model) if coupled else {},
                                   channel_streams(model) if coupled == "streams" else ())
    with torch.no_grad():
        for n, w in new.items():
            ws[n].copy_(w)
    return model.eval()


def build(name, seed=0):
    torch.manual_seed(seed)
    return models.trained_like_batchnorm(models.build(name, num_classes=10, in_channels=1), seed)


def read_channels(weights):
    """Input channels that at least one of these conv weights reads (non-zero column block)."""
    live = torch.zeros(weights[0].shape[1], dtype=torch.bool)
    for w in weights:
        live |= (w != 0).any(dim=(0, 2, 3))
    return int(live.sum())


def assert_same_function(masked, small, digit_batches):
    same = export.compare(masked, small, digit_batches)
    assert same["samples"] == 360 and same["same_prediction"] == 1.0
    assert same["max_abs_diff"] <= 1e-5 * max(1.0, same["max_abs_output"]), same


def test_resnet_small_channel_pruning_removes_what_no_layer_reads(digit_batches):
    masked = pruned(build("resnet_small"), "channel:0.5")
    w = {n: p.detach().clone() for n, p in masked.named_parameters()}
    small, report = export.slim(masked, digit_batches[0][0][:2], calibration=digit_batches[0][0][:32])
    assert_same_function(masked, small, digit_batches)
    # the widths follow from the masked weights alone: a feature map keeps the channels some reader reads
    for stage, width in (("layer1", 16), ("layer2", 32), ("layer3", 64)):
        inner = read_channels([w[f"{stage}.0.conv2.weight"]])
        assert inner == width // 2
        assert small.get_submodule(f"{stage}.0.conv1").out_channels == inner
        assert small.get_submodule(f"{stage}.0.bn1").num_features == inner
        assert small.get_submodule(f"{stage}.0.conv2").in_channels == inner
    stream1 = read_channels([w["layer1.0.conv1.weight"], w["layer2.0.conv1.weight"], w["layer2.0.downsample.0.weight"]])
    assert small.conv1.out_channels == small.layer1[0].conv2.out_channels == stream1
    assert small.layer2[0].conv1.in_channels == small.layer2[0].downsample[0].in_channels == stream1
    stream2 = read_channels([w["layer3.0.conv1.weight"], w["layer3.0.downsample.0.weight"]])
    assert small.layer2[0].conv2.out_channels == small.layer3[0].conv1.in_channels == stream2
    assert small.fc.in_features == 64    # the classifier is dense: the last stream keeps every channel
    assert report["removed"] == report["unread"] == 8 + 16 + 32 + (16 - stream1) + (32 - stream2)
    assert export.count_params(small)["params"] < 0.55 * export.count_params(masked)["params"]
    assert all(torch.equal(p, w[n]) for n, p in masked.named_parameters())   # the input model is untouched


@pytest.mark.parametrize("coupled", [False, True], ids=["per-layer", "coupled"])
def test_resnet18_channel_pruning(digit_batches, coupled):
    masked = pruned(build("resnet18", seed=1), "channel:0.5", coupled=coupled)
    small, report = export.slim(masked, digit_batches[0][0][:2], calibration=digit_batches[0][0][:32])
    assert_same_function(masked, small, digit_batches)
    blocks = [f"layer{s}.{b}" for s in range(1, 5) for b in range(2)]
    for block in blocks:
        conv2 = masked.get_submodule(f"{block}.conv2")
        kept = read_channels([conv2.weight])
        assert kept == sparsity.keep_count(0.5, conv2.in_channels)
        assert small.get_submodule(f"{block}.conv1").out_channels == kept
        assert small.get_submodule(f"{block}.conv2").in_channels == kept
        # what remains of the block's inner feature map is read and (coupled) written by live filters
        assert bool((small.get_submodule(f"{block}.conv2").weight != 0).any(dim=(0, 2, 3)).all())
        if coupled:
            assert bool((small.get_submodule(f"{block}.conv1").weight != 0).flatten(1).any(1).all())
    assert report["removed"] >= sum(masked.get_submodule(f"{b}.conv1").out_channels // 2 for b in blocks)
    params = export.count_params(small)["params"]
    assert params < 0.5 * export.count_params(masked)["params"]


@pytest.mark.parametrize("name", ["resnet_small", "resnet18"])
def test_stream_coupled_masks_are_removed_whole(digit_batches, name):
    """coupled="streams": every zero the masks put into a coupled group goes. What stays are the zero input
    channels of convs reading a stream the linear head also reads (ResNet-18's layer4.1.conv1): that stream is
    not coupled and no mask could free it. No channel is left as a BatchNorm constant."""
    masked = pruned(build(name, seed=1), "channel:0.5", coupled="streams")
    small, report = export.slim(masked, digit_batches[0][0][:2], calibration=digit_batches[0][0][:32])
    assert_same_function(masked, small, digit_batches)
    assert report["kept_constant"] == report["folded"] == report["zero_constant"] == 0
    grouped = {n for s in channel_streams(masked) for n in s.readers} | set(channel_couplings(masked))
    ungrouped = {n: p for n, p in masked.named_parameters() if p.dim() == 4 and n not in grouped}
    assert set(ungrouped) == ({"conv1.weight", "layer4.1.conv1.weight"} if name == "resnet18" else {"conv1.weight"})
    # their zero input columns in live filters (conv1 reads the 1-channel input: none there)
    left = sum(int((p != 0).flatten(1).any(1).sum()) * int((p == 0).all(0).all(-1).all(-1).sum()) * p[0, 0].numel()
               for p in ungrouped.values())
    m, s = export.count_params(masked), export.count_params(small)
    assert s["params"] - s["params_nonzero"] == left and (left > 0) == (name == "resnet18")
    if name == "resnet18":   # vs ~0.49 with per-layer or pair-coupled masks (test_resnet18_channel_pruning)
        assert s["params"] < 0.42 * m["params"]
        x = digit_batches[0][0][:1]
        assert export.count_flops(small, x) < 0.32 * export.count_flops(masked, x)


def test_dead_filters_fold_into_the_next_bias_or_stay(digit_batches):
    """filter pruning on a bottleneck's 3x3 conv: each dead filter leaves relu(BN shift), a constant, for the
    1x1 conv3. Positive constants fold into conv3's bias, zero ones just go; without the fold the outputs
    would change."""
    torch.manual_seed(2)
    net = models.trained_like_batchnorm(
        ResNet(Bottleneck, (1, 1, 1), (8, 16, 32), (1, 2, 2), stem_channels=16, in_channels=1), 2)
    masked = pruned(net, "filter:0.5", only=lambda n: n.endswith("conv2.weight"))
    small, report = export.slim(masked, digit_batches[0][0][:2], calibration=digit_batches[0][0][:32])
    assert_same_function(masked, small, digit_batches)
    assert report["folded"] > 0 and report["zero_constant"] > 0 and report["unread"] == 0
    assert report["removed"] == report["folded"] + report["zero_constant"] == sum(
        masked.get_submodule(f"layer{s}.0.conv2").out_channels // 2 for s in (1, 2, 3))
    folded = [m for n, m in small.named_modules() if isinstance(m, nn.Conv2d) and m.bias is not None]
    assert {n for n, m in small.named_modules() if m in folded} <= {f"layer{s}.0.conv3" for s in (1, 2, 3)}
    with torch.no_grad():
        for m in folded:
            m.bias.zero_()
    assert export.compare(masked, small, digit_batches[:1])["max_abs_diff"] > 1e-3


def test_constant_channels_read_by_a_padded_conv_are_kept(digit_batches):
    """filter pruning on a BasicBlock's conv1: the constant reaches conv2, a padded 3x3 that sees zeros at the
    border instead: folding would be wrong there, so positive constants stay and only zero ones go."""
    masked = pruned(build("resnet_small", seed=3), "filter:0.5", only=lambda n: n.endswith("0.conv1.weight"))
    small, report = export.slim(masked, digit_batches[0][0][:2], calibration=digit_batches[0][0][:32])
    assert_same_function(masked, small, digit_batches)
    assert report["kept_constant"] > 0 and report["zero_constant"] > 0 and report["folded"] == 0
    assert report["kept_constant"] + report["zero_constant"] == 8 + 16 + 32


@pytest.mark.parametrize("name", ["resnet_small", "resnet18"])
def test_save_and_load(tmp_path, digit_batches, name):
    masked = pruned(build(name, seed=4), "channel:0.5")
    x = digit_batches[0][0][:32]
    small, _ = export.slim(masked, x[:2], calibration=x)
    with torch.inference_mode():
        want = small(x)
    how = export.save(small, str(tmp_path / "slim.pt"), x)
    assert "weights_only=False" in how
    torch.save({"x": x, "y": want}, tmp_path / "io.pt")
    # a user without this package: prunex_hvd cannot be imported in that process
    code = ("import sys; sys.modules['prunex_hvd'] = None\n"
            "import torch\n"
            f"m = torch.load({str(tmp_path / 'slim.pt')!r}, weights_only=False)\n"
            f"io = torch.load({str(tmp_path / 'io.pt')!r})\n"
            "assert isinstance(m, torch.nn.Module)\n"
            "m.train(); m.eval()\n"
            "with torch.inference_mode():\n"
            "    d = (m(io['x']) - io['y']).abs().max().item()\n"
            "assert d <= 1e-5 * max(1.0, io['y'].abs().max().item()), d\n"
            "print('params', sum(p.numel() for p in m.parameters()))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == str(export.count_params(small)["params"])

    export.save(small, str(tmp_path / "slim.pt2"), x)
    ep = torch.export.load(str(tmp_path / "slim.pt2")).module()
    tol = 1e-5 * max(1.0, float(want.abs().max()))
    with torch.inference_mode():
        assert (ep(x) - want).abs().max() <= tol
        assert (ep(x[:1]) - want[:1]).abs().max() <= tol   # the batch size is not baked in
    with pytest.raises(ValueError, match=r"\.pt .*\.pt2"):
        export.save(small, str(tmp_path / "slim.onnx"), x)


@pytest.mark.parametrize("how", ["dense", "unstructured"])
def test_a_model_without_structured_sparsity_is_refused(how, digit_batches):
    model = build("resnet_small").eval()
    if how == "unstructured":   # half the weights zero, but never a whole filter or channel
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 4:   # checkerboard over (out, in, kh, kw)
                    o, i, h, w = torch.meshgrid(*[torch.arange(n) for n in p.shape], indexing="ij")
                    p.mul_((o + i + h + w) % 2)
        assert export.count_params(model)["params_nonzero"] < 0.6 * export.count_params(model)["params"]
    with pytest.raises(ValueError, match="not trained with structured sparsity"):
        export.slim(model, digit_batches[0][0][:2])


def flops_by_hand(model, x):
    """2 x multiply-adds of every conv and linear, from the shapes seen in a forward pass."""
    total = []

    def hook(m, inp, out):
        if isinstance(m, nn.Conv2d):
            k = m.in_channels // m.groups * m.kernel_size[0] * m.kernel_size[1]
            total.append(2 * out.numel() * k)
        else:
            total.append(2 * out.numel() * m.in_features)
    hooks = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.inference_mode():
        model(x)
    for h in hooks:
        h.remove()
    return sum(total)


@pytest.mark.usefixtures("single_process")
def test_export_a_real_run_from_the_command_line(tmp_path, capsys):
    run = tmp_path / "run"
    rc = cli.main(["train", "--model", "resnet_small", "--dataset", "digits", "--epochs", "2", "--local-epochs", "0.5",
                   "--threads", "1", "--out", str(run)])
    assert rc == 0, capsys.readouterr()
    capsys.readouterr()
    out = tmp_path / "export" / "slim.pt"
    rc = cli.main(["export", str(run), "--out", str(out), "--repeats", "3", "--batch-sizes", "1,8", "--threads", "1"])
    text = capsys.readouterr()
    assert rc == 0, text.err
    assert "slim/masked" in text.out and "latency b=8 (ms)" in text.out and "same prediction 100.0%" in text.out
    report = json.loads((tmp_path / "export" / "slim.json").read_text())
    assert report["method"] == "prunex" and report["sparsity"] == "channel:0.5"
    eq = report["equivalence"]
    assert eq["samples"] == 360 and eq["max_abs_diff"] <= eq["tolerance"] and eq["same_prediction"] == 1.0

    masked, _ = export.load_run_model(str(run))
    small = export.load(str(out))
    x = torch.zeros(1, 1, 16, 16)
    for key, model in (("masked", masked), ("slim", small)):
        assert report[key]["params"] == sum(p.numel() for p in model.parameters())
        assert report[key]["flops"] == flops_by_hand(model, x)
    assert report["slim"]["params"] < 0.55 * report["masked"]["params"]
    # the recipe's one channel budget keeps the early layers, whose maps are largest, and cuts the last stage's
    # wide convs: half the weights, ~0.8 of the multiply-adds (--channel-budget layer: ~0.45)
    assert report["ratio"]["flops"] == report["slim"]["flops"] / report["masked"]["flops"]
    assert 0.6 < report["ratio"]["flops"] < 0.9
    for bs in ("1", "8"):
        row = report["latency"]["batch"][bs]
        assert row["masked"]["ratio"] == 1.0 and row["slim"]["median_ms"] > 0
        assert row["slim"]["ratio"] == row["slim"]["median_ms"] / row["masked"]["median_ms"]
    assert report["latency"]["repeats"] == 3 and report["latency"]["threads"] == 1

    # the same run with a dense model in it: refused, nothing written
    blob = torch.load(run / "final_model.pt")
    blob["state_dict"] = models.build("resnet_small", num_classes=10, in_channels=1).state_dict()
    dense = tmp_path / "dense_run"
    dense.mkdir()
    torch.save(blob, dense / "final_model.pt")
    (dense / "summary.json").write_text(json.dumps({"method": "dense"}))
    rc = cli.main(["export", str(dense), "--no-latency"])
    err = capsys.readouterr().err
    assert rc == 2 and "not trained with structured sparsity" in err and "method dense" in err
    assert not (dense / "model_slim.pt").exists()


@pytest.mark.parametrize("case,message", [
    ("missing", "not a run folder"),
    ("unfinished", "has no final_model.pt"),
    ("foreign", "not a prunex-hvd final model"),
    ("suffix", r"must end in \.pt"),
])
def test_bad_run_folders_are_clear_errors(tmp_path, capsys, case, message):
    run = tmp_path / "run"
    args = ["export", str(run)]
    if case != "missing":
        run.mkdir()
        (run / "metrics.jsonl").write_text('{"event": "round"}\n')
    if case == "foreign":
        torch.save({"weights": torch.zeros(2)}, run / "final_model.pt")
    if case == "suffix":
        args += ["--out", str(tmp_path / "slim.onnx")]
    rc = cli.main(args)
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("prunex-hvd: error: ") and re.search(message, err), err


# ------------------------------------------------------------------------------------- beyond convs: a ViT

def vit_pruned(spec, coupled, seed=0):
    """vit_tiny with biases and norms like a trained model's (nonzero: a dropped neuron's GELU(b) is a constant,
    not a zero), its weights projected as finalize() leaves them."""
    from prunex_hvd import ConsensusConfig
    from prunex_hvd.engine.config import Structure

    torch.manual_seed(seed)
    model = models.build("vit_tiny", num_classes=10, in_channels=1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.3)
    structure = Structure.resolve(model, ConsensusConfig(sparsity=spec, coupled=coupled))
    ws = {n: p for n, p in model.named_parameters() if n in structure.specs}
    new = sparsity.coupled_project(ws, structure.specs, structure.couplings, structure.streams, structure.heads)
    with torch.no_grad():
        for n, w in new.items():
            ws[n].copy_(w)
    return model.eval()


@pytest.mark.parametrize("spec,coupled,heads,hidden,folded", [("head:0.5+neuron:0.5", True, 2, 128, 0),
                                                               ("head:0.25", False, 1, 256, 0),
                                                               ("neuron:0.5", False, 4, 128, 128)])
def test_a_vit_loses_its_pruned_heads_and_hidden_units(digit_batches, spec, coupled, heads, hidden, folded):
    """Heads go whole (q/k/v rows, output-projection columns, num_heads); an MLP's hidden units go with fc2's
    columns (coupled) or, alone, as constants GELU(b) folded into fc2's bias."""
    masked = vit_pruned(spec, coupled)
    x = digit_batches[0][0]
    small, report = export.slim(masked, x[:2], calibration=x[:32])
    assert_same_function(masked, small, digit_batches)
    for block in small.blocks:
        assert block.attn.num_heads == heads and block.attn.q.out_features == block.attn.k.out_features == \
            block.attn.v.out_features == block.attn.proj.in_features == 32 * heads
        assert block.mlp.fc1.out_features == block.mlp.fc2.in_features == hidden
        assert block.mlp.fc2.out_features == 128   # the residual stream stays whole
    assert report["heads"] == 16 and report["heads_removed"] == 4 * (4 - heads)
    assert report["folded"] == 4 * folded and report["removed"] == 4 * (256 - hidden)
    assert export.count_params(small)["params"] < export.count_params(masked)["params"] or heads == 4


def test_multihead_attention_keeps_its_zero_heads_and_says_why():
    import engine_cases

    torch.manual_seed(0)
    model = engine_cases.MhaNet().eval()
    with torch.no_grad():   # head 1 of 4 (head_dim 2) gone from the output projection
        model.attn.out_proj.weight[:, 2:4] = 0
    x = torch.randn(8, 3, 6, 6)
    small, report = export.slim(model, x[:2], calibration=x)
    assert report["attention"] == [{"module": "attn", "heads": 4, "removed": 0,
                                    "skipped": "nn.MultiheadAttention ties num_heads × head_dim to its embedding "
                                               "width: its zero heads stay"}]
    assert torch.allclose(small(x), model(x), atol=1e-6)
