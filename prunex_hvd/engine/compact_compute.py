"""Compute on the frozen structure only: a conv or linear whose weight is held on ``rows ⊗ cols`` multiplies its
kept block, not the zeros around it.

Once the masks freeze (``masked_retrain``), a structured weight ``W`` is zero outside its kept output rows ``R``
and input channels ``C``. For a conv (a linear alike, channels on the last dim)

    conv(x, W) = scatter_R( conv(x[:, C], W[R][:, C]) )     (zeros, or the bias, on the rows outside R)

exactly, and so are the gradients the step uses: ``x``'s outside ``C`` are zero either way, and ``W``'s outside
the block are zero here where the dense layer computes values the masked step then zeroes (so a
``clip_grad_norm_`` or an inf check before the step sees the pruned model's gradient alone). Exact while ``W`` is
zero outside the block: the engine switches a layer on only then, and anything else writing the weights
(weight noise, a SAM-like perturbation) must keep them there.

At ``channel:0.5`` each conv does about half the multiply-adds (ResNet-18, 8x8 inputs, one CPU thread: a step
0.60x as long, benchmarks/README "Compact compute"). Only the forward changes: the parameters keep their full
shape and identity, so the optimizer, the consensus and checkpoints see the same tensors as before.

:func:`conv2d_on_support` and :func:`linear_on_support` are the math (pure functions). :func:`compute_on_support`
turns a plain ``nn.Conv2d`` / ``nn.Linear`` into one that uses them, by swapping its class for a subclass (as
``torch.nn.utils.parametrize`` does), so a deep copy or a pickle keeps the behaviour; the kept indices are
non-persistent integer buffers, so ``.to(device)`` moves them and ``state_dict()`` does not hold them.
:func:`compute_in_full` turns it back. Subclasses of those layers, grouped or transposed convs are left alone
(dense compute, still exact). ``torch.fx`` traces a compact layer as the leaf it was
(:mod:`prunex_hvd.engine.dependencies`), and export makes its copy plain first.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .sparsity import read_channels

__all__ = ["compute_in_full", "compute_on_support", "conv2d_on_support", "is_compact", "linear_on_support",
           "plain_type", "supports"]


def _scatter_rows(y: Tensor, out_idx: Tensor, n_out: int, dim: int, bias: Optional[Tensor]) -> Tensor:
    """``y``'s rows ``out_idx`` along ``dim`` put into a tensor of ``n_out`` rows; the others 0 (plus the bias)."""
    shape = list(y.shape)
    shape[dim] = n_out
    full = y.new_zeros(shape)
    if bias is not None:   # a dropped filter still writes its bias, as the dense layer does (in y's dtype: autocast)
        view = [1] * len(shape)
        view[dim] = n_out
        full = full + bias.view(view).to(y.dtype)
    return full.index_copy(dim, out_idx, y)


def _kept_block(weight: Tensor, bias: Optional[Tensor], in_idx: Optional[Tensor], out_idx: Optional[Tensor]):
    """The weight's block ``out_idx ⊗ in_idx`` (dim 0 ⊗ dim 1) and the bias of its rows."""
    w, b = weight, bias
    if in_idx is not None:
        w = w.index_select(1, in_idx)
    if out_idx is not None:
        w = w.index_select(0, out_idx)
        b = None if b is None else b.index_select(0, out_idx)
    return w, b


def conv2d_on_support(x: Tensor, weight: Tensor, bias: Optional[Tensor], in_idx: Optional[Tensor],
                      out_idx: Optional[Tensor], conv) -> Tensor:
    """``conv(x, weight, bias)`` computed on the input channels ``in_idx`` and output filters ``out_idx`` alone
    (``None``: all); equal to the dense conv when ``weight`` is zero outside them. ``conv(x, w, b)`` is the
    layer's own (``nn.Conv2d._conv_forward``: stride, padding and padding mode). ``x`` is ``(N, C, H, W)`` or
    unbatched ``(C, H, W)``."""
    if x.dim() == 3:
        return conv2d_on_support(x.unsqueeze(0), weight, bias, in_idx, out_idx, conv).squeeze(0)
    y = conv(x if in_idx is None else x.index_select(1, in_idx), *_kept_block(weight, bias, in_idx, out_idx))
    return y if out_idx is None else _scatter_rows(y, out_idx, weight.shape[0], 1, bias)


def linear_on_support(x: Tensor, weight: Tensor, bias: Optional[Tensor], in_idx: Optional[Tensor],
                      out_idx: Optional[Tensor]) -> Tensor:
    """``F.linear(x, weight, bias)`` on the input features ``in_idx`` and output rows ``out_idx`` alone."""
    y = F.linear(x if in_idx is None else x.index_select(-1, in_idx), *_kept_block(weight, bias, in_idx, out_idx))
    return y if out_idx is None else _scatter_rows(y, out_idx, weight.shape[0], -1, bias)


class _SupportConv2d(nn.Conv2d):
    """An ``nn.Conv2d`` computing on its kept block (:func:`compute_on_support`)."""
    _in_idx: Optional[Tensor]
    _out_idx: Optional[Tensor]

    def forward(self, x: Tensor) -> Tensor:
        return conv2d_on_support(x, self.weight, self.bias, self._in_idx, self._out_idx, self._conv_forward)


class _SupportLinear(nn.Linear):
    """An ``nn.Linear`` computing on its kept block (:func:`compute_on_support`)."""
    _in_idx: Optional[Tensor]
    _out_idx: Optional[Tensor]

    def forward(self, x: Tensor) -> Tensor:
        return linear_on_support(x, self.weight, self.bias, self._in_idx, self._out_idx)


_SWAPS = {nn.Conv2d: _SupportConv2d, nn.Linear: _SupportLinear}
_PLAIN = {v: k for k, v in _SWAPS.items()}


def supports(module: nn.Module) -> bool:
    """Whether :func:`compute_on_support` applies to ``module``: a plain ``nn.Conv2d`` (not grouped) or
    ``nn.Linear``, or one it already turned."""
    if type(module) in _PLAIN:
        return True
    if type(module) is nn.Conv2d:
        return module.groups == 1
    return type(module) is nn.Linear


def compute_on_support(module: nn.Module, rows: Tensor, cols: Tensor) -> bool:
    """Make ``module`` compute on the block ``rows ⊗ cols`` of its weight's GEMM view (``rows``: output
    filters or features, ``cols``: ``C_in*KH*KW`` columns of a conv, ``in_features`` of a linear). An input
    channel counts when any of its kernel positions is kept (``shape:K`` keeps single positions: the zeros
    inside a kept channel are still multiplied). Returns False, changing nothing, where :func:`supports` says
    no or the block is the whole weight."""
    if not supports(module):
        return False
    n_out, n_in = module.weight.shape[0], module.weight.shape[1]
    if rows.numel() != n_out or cols.numel() != module.weight[0].numel():
        raise ValueError(f"masks of {rows.numel()} rows x {cols.numel()} columns do not fit a weight of shape "
                         f"{tuple(module.weight.shape)}")
    channels = read_channels(cols, n_in)
    dev = module.weight.device
    in_idx = None if bool(channels.all()) else channels.nonzero().flatten().to(dev)
    out_idx = None if bool(rows.all()) else rows.nonzero().flatten().to(dev)
    if in_idx is None and out_idx is None:
        compute_in_full(module)
        return False
    module.__class__ = _SWAPS.get(type(module), type(module))
    for name, idx in (("_in_idx", in_idx), ("_out_idx", out_idx)):   # buffers: they follow .to(device); not saved
        module._buffers.pop(name, None)
        module.register_buffer(name, idx, persistent=False)
    return True


def is_compact(module: nn.Module) -> bool:
    """Whether :func:`compute_on_support` made ``module`` compute on its kept block."""
    return type(module) in _PLAIN


def plain_type(module: nn.Module) -> type:
    """The layer's type as the user made it (``nn.Conv2d`` for one computing on its kept block)."""
    return _PLAIN.get(type(module), type(module))


def compute_in_full(module: nn.Module) -> None:
    """Undo :func:`compute_on_support`: ``module`` is a plain layer again (a no-op on any other module)."""
    plain = _PLAIN.get(type(module))
    if plain is not None:
        module.__class__ = plain
        del module._buffers["_in_idx"], module._buffers["_out_idx"]
