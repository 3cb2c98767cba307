"""Model registry, the hand-written CIFAR ResNets and the small ViT: shapes, parameter counts, aliases, errors."""
import importlib
import sys
import types

import pytest
import torch
from torch import nn

from prunex_hvd.app import models
from prunex_hvd.app.models import resnet

# 10 classes, 3 input channels. resnet18/50/152 and wide_resnet50_2 equal torchvision's counts with the
# 7x7 stem swapped for a 3x3 one and a 10-way head (e.g. resnet50: 25,557,032 - 7,680 - 2,028,510).
PARAMS = {
    "resnet_small": 78_042,
    "resnet18": 11_173_962,
    "resnet50": 23_520_842,
    "resnet152": 58_156_618,
    "wide_resnet50_2": 66_847_050,
    "vit_tiny": 546_186,
}
RESNETS = tuple(n for n in models.NAMES if n.startswith(("resnet", "wide")))
BIG = ("resnet152", "wide_resnet50_2")   # real init is ~1 s: build them once, count the rest on meta


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def meta_build(name, **kw):
    with torch.device("meta"):
        return models.build(name, **kw)


def check_dtypes_and_convs(model):
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert convs and all(c.weight.dim() == 4 and c.bias is None for c in convs)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(b.dtype == torch.float32 for n, b in model.named_buffers() if not n.endswith("num_batches_tracked"))


def test_names_and_param_table_agree():
    assert models.NAMES == ("resnet_small", "resnet18", "resnet50", "resnet152", "wide_resnet50_2", "vit_tiny")
    assert set(PARAMS) == set(models.NAMES)


@pytest.mark.parametrize("name", [n for n in RESNETS if n not in BIG])
@pytest.mark.parametrize("in_channels", [1, 3])
def test_build_forward(name, in_channels):
    torch.manual_seed(0)
    model = models.build(name, num_classes=10, in_channels=in_channels).eval()
    check_dtypes_and_convs(model)
    assert model.conv1.in_channels == in_channels
    with torch.no_grad():
        out = model(torch.randn(2, in_channels, 32, 32))
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    # the first conv is the only layer that depends on in_channels
    assert n_params(model) == PARAMS[name] - (3 - in_channels) * model.conv1.weight[:, 0].numel()


@pytest.mark.parametrize("name", BIG)
def test_big_models(name):
    # one real build (~1 s of init) and a single-image forward; in_channels=3 is counted in test_param_counts
    model = models.build(name, num_classes=10, in_channels=1).eval()
    check_dtypes_and_convs(model)
    assert model.conv1.in_channels == 1
    with torch.no_grad():
        assert model(torch.randn(1, 1, 32, 32)).shape == (1, 10)
    assert n_params(model) == PARAMS[name] - 2 * model.conv1.weight[:, 0].numel()


@pytest.mark.parametrize("name", models.NAMES)
def test_param_counts(name):
    m = meta_build(name, num_classes=10, in_channels=3)   # meta: shapes only, no memory or init
    assert n_params(m) == PARAMS[name]
    n = PARAMS[name]
    assert models.describe(name).endswith(f"({n / 1e6:.1f}M params)" if n >= 1e6 else f"({n / 1e3:.0f}K params)")


def test_resnet18_is_the_cifar_figure():
    assert n_params(meta_build("resnet18")) == 11_173_962
    assert n_params(meta_build("resnet18", num_classes=100)) == 11_173_962 + 90 * 513


def test_wide_resnet_doubles_bottleneck_width():
    r50, wrn = meta_build("resnet50"), meta_build("wide_resnet50_2")
    assert wrn.layer1[0].conv1.out_channels == 2 * r50.layer1[0].conv1.out_channels == 128
    assert wrn.layer4[0].conv3.out_channels == r50.layer4[0].conv3.out_channels == 2048
    assert [len(getattr(meta_build("resnet152"), f"layer{i}")) for i in (1, 2, 3, 4)] == [3, 8, 36, 3]


def test_projection_shortcuts_only_where_shape_changes():
    m = meta_build("resnet18")
    assert m.layer1[0].downsample is None and m.layer1[1].downsample is None
    for stage in (m.layer2, m.layer3, m.layer4):
        proj = stage[0].downsample
        assert isinstance(proj[0], nn.Conv2d) and proj[0].kernel_size == (1, 1) and proj[0].stride == (2, 2)
        assert isinstance(proj[1], nn.BatchNorm2d) and stage[1].downsample is None
    assert meta_build("resnet50").layer1[0].downsample is not None   # 64 -> 256 channels at stride 1
    assert m.conv1.kernel_size == (3, 3) and m.conv1.stride == (1, 1)
    assert not any(isinstance(x, nn.MaxPool2d) for x in m.modules())


def test_init():
    torch.manual_seed(0)
    m = models.build("resnet_small")
    bns = [x for x in m.modules() if isinstance(x, nn.BatchNorm2d)]
    assert all(torch.equal(b.weight, torch.ones_like(b.weight)) and not b.bias.any() for b in bns)
    # kaiming fan_out: std = sqrt(2 / (out_channels * k * k))
    w = m.layer3[0].conv2.weight
    assert abs(w.std().item() - (2 / (64 * 9)) ** 0.5) < 0.1 * (2 / (64 * 9)) ** 0.5


def fit_four_images(model, opt, steps):
    """Loss after ``steps`` steps on 4 fixed images, against the first: a model that can learn halves it."""
    x, y = torch.randn(4, 1, 16, 16), torch.tensor([0, 1, 2, 1])
    assert model(x).shape == (4, 3)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses[-1] / losses[0]


def test_resnet_small_trains():
    torch.manual_seed(0)
    model = models.build("resnet_small", num_classes=3, in_channels=1)
    assert fit_four_images(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), 8) < 0.5


@pytest.mark.parametrize("size", [8, 16, 32])
def test_resnet_small_any_small_image(size):
    with torch.no_grad():
        assert models.build("resnet_small").eval()(torch.randn(1, 3, size, size)).shape == (1, 10)


def test_hooks_see_autograd_consistent_tensors():
    # the engine hooks convs; in-place ops after them must not trip autograd's version checks
    model = models.build("resnet_small")
    kept = []
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            m.register_forward_hook(lambda mod, inp, out: kept.append(out))
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    assert len(kept) == 9 and all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("alias,canon", [
    ("resnet-18", "resnet18"), ("ResNet18", "resnet18"), ("RESNET_50", "resnet50"), ("resnet-152", "resnet152"),
    ("wrn50_2", "wide_resnet50_2"), ("WRN50-2", "wide_resnet50_2"), ("wideresnet50_2", "wide_resnet50_2"),
    ("Wide_ResNet50_2", "wide_resnet50_2"), ("small", "resnet_small"), (" resnet_small ", "resnet_small"),
])
def test_aliases(alias, canon):
    assert models.canonical_name(alias) == canon
    assert type(meta_build(alias)) is resnet.ResNet
    assert models.describe(alias) == models.describe(canon)


def test_default_image_size_and_describe():
    assert models.default_image_size("small") == 16
    assert all(models.default_image_size(n) == 32 for n in models.NAMES[1:])
    assert models.default_image_size("torchvision:resnet18") == 32
    assert models.describe("resnet18") == "CIFAR ResNet-18 (11.2M params)"
    assert models.describe("resnet_small").endswith("(78K params)")
    assert "torchvision" in models.describe("torchvision:vgg11")


@pytest.mark.parametrize("name", ["resnet34", "", "vgg", "torchvision:"])
def test_unknown_names(name):
    with pytest.raises(ValueError) as e:
        models.build(name)
    if name != "torchvision:":
        assert all(n in str(e.value) for n in models.NAMES)


@pytest.mark.parametrize("kw", [{"num_classes": 1}, {"num_classes": 0}, {"in_channels": 0}, {"num_classes": 2.0}])
def test_bad_sizes(kw):
    with pytest.raises(ValueError):
        models.build("resnet_small", **kw)


def _torchvision_imports() -> bool:
    try:
        importlib.import_module("torchvision")
        return True
    except Exception:  # a CUDA wheel next to CPU torch raises non-ImportErrors
        return False


def test_torchvision_missing_is_a_clear_error():
    if _torchvision_imports():
        pytest.skip("torchvision imports here")
    with pytest.raises(ValueError) as e:
        models.build("torchvision:resnet18")
    msg = str(e.value)
    assert "torchvision" in msg and "prunex_hvd[vision]" in msg and "resnet_small" in msg


@pytest.fixture
def fake_torchvision(monkeypatch):
    """A stand-in torchvision whose get_model builds our resnet_small: exercises the adapter code here."""
    calls = []

    def get_model(name, weights=None, num_classes=1000):
        calls.append((name, weights, num_classes))
        return resnet.resnet_small(num_classes=num_classes)

    tv = types.ModuleType("torchvision")
    tv.models = types.SimpleNamespace(get_model=get_model, list_models=lambda: ["alexnet", "tiny"])
    monkeypatch.setitem(sys.modules, "torchvision", tv)
    return calls


def test_torchvision_adapter(fake_torchvision):
    model = models.build("TorchVision: tiny", num_classes=7, in_channels=1)
    assert fake_torchvision == [("tiny", None, 7)]
    c = model.conv1
    assert (c.in_channels, c.out_channels, c.kernel_size, c.padding, c.bias) == (1, 16, (3, 3), (1, 1), None)
    assert model(torch.randn(2, 1, 16, 16)).shape == (2, 7)
    with pytest.raises(ValueError, match="alexnet"):
        models.build("torchvision:nope")


def test_torchvision_broken_import_is_a_clear_error(monkeypatch):
    # a mismatched CUDA build fails with RuntimeError/OSError, not ImportError
    real = importlib.import_module

    def fail(name, *a, **k):
        if name == "torchvision":
            raise RuntimeError("operator torchvision::nms does not exist")
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", fail)
    with pytest.raises(ValueError, match="torchvision::nms does not exist") as e:
        models.build("torchvision:resnet18")
    assert "pip install 'prunex_hvd[vision]'" in str(e.value)


@pytest.mark.parametrize("in_channels", [1, 3])
@pytest.mark.parametrize("size", [8, 16, 32])
def test_vit_tiny_any_image_up_to_32(in_channels, size):
    torch.manual_seed(0)
    model = models.build("vit", num_classes=7, in_channels=in_channels).eval()
    with torch.no_grad():
        out = model(torch.randn(2, in_channels, size, size))
    assert out.shape == (2, 7) and torch.isfinite(out).all()
    assert n_params(model) == PARAMS["vit_tiny"] - (3 - in_channels) * 128 * 16 - 3 * 129
    attn = model.blocks[0].attn
    assert attn.num_heads == 4 and attn.q.weight.shape == (128, 128) and model.blocks[0].mlp.fc1.out_features == 256


def test_vit_tiny_trains_and_traces():
    torch.manual_seed(0)
    model = models.build("vit_tiny", num_classes=3, in_channels=1)
    x = torch.randn(4, 1, 16, 16)
    traced = torch.fx.symbolic_trace(model)   # coupling and export walk the fx graph
    assert torch.allclose(traced(x), model(x))
    assert fit_four_images(model, torch.optim.AdamW(model.parameters(), lr=3e-3), 12) < 0.5
