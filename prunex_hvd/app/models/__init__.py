"""Model registry: built-in CIFAR ResNets and a small ViT by name, plus `torchvision:NAME` where torchvision
imports (`torchvision:vit_b_16` among them, at --image-size 224).

    from prunex_hvd.app import models
    net = models.build("resnet18", num_classes=10, in_channels=3)
    models.default_image_size("resnet_small")   # 16
"""
from __future__ import annotations

import difflib
import importlib
import numbers
from typing import Callable, Dict

import torch
from torch import nn

from .resnet import resnet18, resnet50, resnet152, resnet_small, wide_resnet50_2
from .vit import vit_tiny

__all__ = ["NAMES", "build", "canonical_name", "default_image_size", "describe", "trained_like_batchnorm"]

TORCHVISION_PREFIX = "torchvision:"

_BUILDERS: Dict[str, Callable[..., nn.Module]] = {
    "resnet_small": resnet_small,
    "resnet18": resnet18,
    "resnet50": resnet50,
    "resnet152": resnet152,
    "wide_resnet50_2": wide_resnet50_2,
    "vit_tiny": vit_tiny,
}
NAMES = tuple(_BUILDERS)

_TITLES = {
    "resnet_small": "tiny CIFAR ResNet (16/32/64, one BasicBlock per stage)",
    "resnet18": "CIFAR ResNet-18",
    "resnet50": "CIFAR ResNet-50",
    "resnet152": "CIFAR ResNet-152",
    "wide_resnet50_2": "CIFAR Wide ResNet-50-2",
    "vit_tiny": "small ViT for 32x32 (patch 4, width 128, 4 blocks of 4 heads)",
}

# Parameter counts for 10 classes and 3 input channels (tests check them against real builds). A table, not a
# build: even a meta-device build pays ~1.5 s the first time for kaiming_normal_.
_PARAMS = {
    "resnet_small": 78_042,
    "resnet18": 11_173_962,
    "resnet50": 23_520_842,
    "resnet152": 58_156_618,
    "wide_resnet50_2": 66_847_050,
    "vit_tiny": 546_186,
}

# Aliases are matched after lower-casing and dropping '-', '_' and spaces, so "ResNet-18", "resnet_18",
# "WRN50_2" and "wide-resnet50-2" all resolve.
_ALIASES = {
    "resnetsmall": "resnet_small", "small": "resnet_small",
    "resnet18": "resnet18",
    "resnet50": "resnet50",
    "resnet152": "resnet152",
    "wideresnet502": "wide_resnet50_2", "wrn502": "wide_resnet50_2",
    "vittiny": "vit_tiny", "vit": "vit_tiny",
}


def _key(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch not in "-_ ")


def _names_hint() -> str:
    return ", ".join(NAMES) + ", or torchvision:NAME"


def canonical_name(name: str) -> str:
    """The registry name for `name` ("ResNet-18" -> "resnet18"); `torchvision:NAME` is kept as given."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model name must be a non-empty string, got {name!r}; choose one of {_names_hint()}")
    text = name.strip()
    if text.lower().startswith(TORCHVISION_PREFIX):
        tv_name = text[len(TORCHVISION_PREFIX):].strip()
        if not tv_name:
            raise ValueError("'torchvision:' needs a model name after the colon, e.g. torchvision:resnet18")
        return TORCHVISION_PREFIX + tv_name
    try:
        return _ALIASES[_key(text)]
    except KeyError:
        close = difflib.get_close_matches(_key(text), list(_ALIASES), n=1)
        hint = f" (did you mean {_ALIASES[close[0]]!r}?)" if close else ""
        raise ValueError(f"unknown model {name!r}{hint}; choose one of {_names_hint()}") from None


def _torchvision_models():
    """torchvision.models, or ValueError saying why not.

    Any exception counts as 'not available': a torchvision built for another torch (e.g. a CUDA wheel
    next to CPU torch) raises RuntimeError/OSError on import, not ImportError.
    """
    try:
        return importlib.import_module("torchvision").models
    except Exception as exc:  # see docstring
        raise ValueError(
            f"--model torchvision:NAME needs torchvision, which failed to import here "
            f"({type(exc).__name__}: {exc}). torchvision is an optional extra for GPU hosts: "
            f"pip install 'prunex_hvd[vision]' with a torch build that matches it. "
            f"Built-in models: {', '.join(NAMES)}") from exc


def _replace_first_conv(model: nn.Module, in_channels: int) -> None:
    """Swap the first registered Conv2d for one of the same config that takes `in_channels` inputs."""
    for qualname, conv in model.named_modules():
        if isinstance(conv, nn.Conv2d):
            break
    else:
        raise ValueError(f"{type(model).__name__} has no Conv2d, cannot set in_channels={in_channels}")
    if conv.in_channels == in_channels:
        return
    if conv.groups != 1:
        raise ValueError(f"first conv {qualname!r} of {type(model).__name__} is grouped, cannot set in_channels")
    parent_name, _, attr = qualname.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    new = nn.Conv2d(in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride, padding=conv.padding,
                    dilation=conv.dilation, bias=conv.bias is not None, padding_mode=conv.padding_mode,
                    device=conv.weight.device, dtype=conv.weight.dtype)
    setattr(parent, attr, new)


def _build_torchvision(tv_name: str, num_classes: int, in_channels: int) -> nn.Module:
    tvm = _torchvision_models()
    if not hasattr(tvm, "get_model"):
        raise ValueError("--model torchvision:NAME needs torchvision >= 0.14 (torchvision.models.get_model)")
    known = sorted(tvm.list_models())
    if tv_name.lower() not in known:  # get_model lower-cases too
        raise ValueError(f"torchvision has no model {tv_name!r}; torchvision models: {', '.join(known)}")
    model = tvm.get_model(tv_name, weights=None, num_classes=num_classes)
    if in_channels != 3:
        _replace_first_conv(model, in_channels)
    return model


def build(name: str, num_classes: int = 10, in_channels: int = 3) -> nn.Module:
    """A freshly initialised float32 model by registry name, alias or `torchvision:NAME`."""
    if isinstance(num_classes, bool) or not isinstance(num_classes, numbers.Integral) or num_classes < 2:
        raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
    if isinstance(in_channels, bool) or not isinstance(in_channels, numbers.Integral) or in_channels < 1:
        raise ValueError(f"in_channels must be an integer >= 1, got {in_channels!r}")
    canon = canonical_name(name)
    if canon.startswith(TORCHVISION_PREFIX):
        return _build_torchvision(canon[len(TORCHVISION_PREFIX):], int(num_classes), int(in_channels))
    return _BUILDERS[canon](num_classes=int(num_classes), in_channels=int(in_channels))


def default_image_size(name: str) -> int:
    """Side of the square input the demo/synthetic data should use: 16 for resnet_small, else 32."""
    return 16 if canonical_name(name) == "resnet_small" else 32


def describe(name: str) -> str:
    """One line such as "CIFAR ResNet-18 (11.2M params)" (counted for 10 classes, 3 input channels); builds nothing."""
    canon = canonical_name(name)
    if canon.startswith(TORCHVISION_PREFIX):
        return f"torchvision model {canon[len(TORCHVISION_PREFIX):]} (random init, via torchvision.models.get_model)"
    n = _PARAMS[canon]
    count = f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"
    return f"{_TITLES[canon]} ({count} params)"


def trained_like_batchnorm(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every BatchNorm2d the kind of state training leaves (scales, shifts of both signs, running
    statistics), in place. A fresh model's BatchNorm is the identity, under which a pruned channel is exactly
    zero; with trained-like state it carries a constant, so checks of pruning and export see what they would
    after training."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                n = m.num_features
                m.running_mean.copy_(0.2 * torch.randn(n, generator=g))
                m.running_var.copy_(0.5 + torch.rand(n, generator=g))
                m.weight.copy_(0.5 + torch.rand(n, generator=g))
                m.bias.copy_(0.3 * torch.randn(n, generator=g))
    return model
