"""Compute on the frozen structure only: a conv or linear whose weight is held on ``rows ⊗ cols`` multiplies its
kept block, not the zeros around it.

Once the masks freeze (θ is then held on the structure), a structured weight ``W`` is zero outside its kept output rows ``R``
and input channels ``C``. For a conv (a linear alike, channels on the last dim)

    conv(x, W) = scatter_R( conv(x[:, C], W[R][:, C]) )     (zeros, or the bias, on the rows outside R)

exactly, and so are the gradients the step uses: ``x``'s outside ``C`` are zero either way, and ``W``'s outside
the block are zero here where the dense layer computes values the masked step then zeroes (so a
``clip_grad_norm_`` or an inf check before the step sees the pruned model's gradient alone). Exact while ``W`` is
zero outside the block: the engine switches a layer on only then, and anything else writing the weights
(weight noise, a SAM-like perturbation) must keep them there.

At ``channel:0.5`` each conv does about half the multiply-adds (ResNet-18, 8x8 inputs, one CPU thread: a step
0.61x as long, benchmarks/log/2026-11-27-compact-compute.md). Only the forward changes: the parameters keep their full
shape and identity, so the optimizer, the consensus and checkpoints see the same tensors as before. On CPU a large
weight's block is cut out, and its gradient put back, by one pass each of the native kernel that packs a round's
payload (:func:`kept_block_plan`): ATen's index_select backward zero-fills the weight and scatters into it.

:func:`conv2d_on_support` and :func:`linear_on_support` are the math (pure functions). :func:`compute_on_support`
turns a plain ``nn.Conv2d`` / ``nn.Linear`` into one that uses them, by swapping its class for a subclass (as
``torch.nn.utils.parametrize`` does), so a deep copy or a pickle keeps the behaviour; the kept indices are
non-persistent integer buffers, so ``.to(device)`` moves them and ``state_dict()`` does not hold them.
:func:`compute_in_full` turns it back. Subclasses of those layers, grouped or transposed convs are left alone
(dense compute, still exact). ``torch.fx`` traces a compact layer as the leaf it was
(:mod:`prunex_hvd.engine.dependencies`), and export makes its copy plain first.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .sparsity import KernelPlan, gather_plan, read_channels, recover, shrink

__all__ = ["KeptBlockPlan", "compute_in_full", "compute_on_support", "conv2d_on_support", "is_compact",
           "kept_block_plan", "linear_on_support", "plain_type", "supports"]


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


# Below this many weight elements ATen's index_select is as fast as the kernel plus a custom autograd function's
# Python (one CPU thread: a 64x64 3x3 weight's block and gradient take 0.10 ms by ATen, 0.25 ms by the kernel; a
# 512x512 one 8.7 ms against 4.2 ms). A ResNet-18 step at 8x8 was 25 ms faster from 1 << 17, 22 from 1 << 15 or 19.
_KERNEL_NUMEL = 1 << 17


class KeptBlockPlan(NamedTuple):
    """How a CPU weight's block is cut out and its gradient put back by the native kernel
    (:class:`~prunex_hvd.engine.sparsity.KernelPlan`); ``row_idx`` / ``col_idx`` the block's GEMM rows and columns."""
    kernel: KernelPlan
    row_idx: Tensor
    col_idx: Tensor


class _KeptBlock(torch.autograd.Function):
    """``weight[out_idx][:, in_idx]`` in one native pass, and its gradient as the full weight's in one pass that
    writes every element once (ATen's index_select backward zero-fills the weight's size and scatters twice)."""

    @staticmethod
    def forward(ctx, weight: Tensor, plan: KeptBlockPlan, n_in: int):
        ctx.plan, ctx.shape = plan, weight.shape
        block = shrink(weight.detach(), plan.row_idx, plan.col_idx, plan=plan.kernel)
        ctx.block_shape = (block.shape[0], n_in, *weight.shape[2:])
        return block.view(ctx.block_shape)

    @staticmethod
    def jvp(ctx, tangent: Tensor, *_):   # forward-mode AD (a dual weight): the tangent's block, by ATen
        return shrink(tangent, ctx.plan.row_idx, ctx.plan.col_idx, plan=None).view(ctx.block_shape)

    @staticmethod
    def backward(ctx, grad: Tensor):
        # under create_graph the gradient needs grad, and recover takes ATen's differentiable path instead
        plan = ctx.plan
        return recover(grad.contiguous(), plan.row_idx, plan.col_idx, ctx.shape, plan=plan.kernel), None, None


def kept_block_plan(weight: Tensor, in_idx: Optional[Tensor], out_idx: Optional[Tensor]) -> Optional[KeptBlockPlan]:
    """The native kernel's plan for ``weight``'s block ``out_idx ⊗ in_idx`` (whole input channels), or None where
    ATen's index_select is as fast: a small weight, a weight off the CPU, or no kernel built."""
    if not weight.is_cpu or weight.numel() < _KERNEL_NUMEL:
        return None
    ksize = weight[0, 0].numel()
    rows = torch.arange(weight.shape[0]) if out_idx is None else out_idx.cpu()
    chans = torch.arange(weight.shape[1]) if in_idx is None else in_idx.cpu()
    cols = (chans[:, None] * ksize + torch.arange(ksize)).reshape(-1)
    kernel = gather_plan(rows, cols, weight.shape)
    return KeptBlockPlan(kernel, rows, cols) if isinstance(kernel, KernelPlan) else None


def _transformed(weight: Tensor) -> bool:
    """Whether ``weight`` is traced by ``torch.compile`` or wrapped by a ``torch.func`` transform (grad, vmap,
    jvp): the kernel writes through raw pointers, which neither can follow, so ATen's ops go there."""
    return torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(weight)


def _kept_block(weight: Tensor, bias: Optional[Tensor], in_idx: Optional[Tensor], out_idx: Optional[Tensor],
                plan: Optional[KeptBlockPlan] = None):
    """The weight's block ``out_idx ⊗ in_idx`` (dim 0 ⊗ dim 1) and the bias of its rows. ``plan``
    (:func:`kept_block_plan`): the weight's block by the native kernel, where it takes the weight."""
    b = bias if bias is None or out_idx is None else bias.index_select(0, out_idx)
    if plan is not None and weight.is_cpu and weight.dtype in (torch.float32, torch.float64) \
            and weight.is_contiguous() and not _transformed(weight):
        return _KeptBlock.apply(weight, plan, weight.shape[1] if in_idx is None else in_idx.numel()), b
    w = weight
    if out_idx is not None:   # rows first: the dim-1 gather and its backward then run over fewer rows
        w = w.index_select(0, out_idx)
    if in_idx is not None:
        w = w.index_select(1, in_idx)
    return w, b


def conv2d_on_support(x: Tensor, weight: Tensor, bias: Optional[Tensor], in_idx: Optional[Tensor],
                      out_idx: Optional[Tensor], conv, plan: Optional[KeptBlockPlan] = None) -> Tensor:
    """``conv(x, weight, bias)`` computed on the input channels ``in_idx`` and output filters ``out_idx`` alone
    (``None``: all); equal to the dense conv when ``weight`` is zero outside them. ``conv(x, w, b)`` is the
    layer's own (``nn.Conv2d._conv_forward``: stride, padding and padding mode). ``x`` is ``(N, C, H, W)`` or
    unbatched ``(C, H, W)``. ``plan``: :func:`kept_block_plan` (the same result, faster)."""
    if x.dim() == 3:
        return conv2d_on_support(x.unsqueeze(0), weight, bias, in_idx, out_idx, conv, plan).squeeze(0)
    y = conv(x if in_idx is None else x.index_select(1, in_idx), *_kept_block(weight, bias, in_idx, out_idx, plan))
    return y if out_idx is None else _scatter_rows(y, out_idx, weight.shape[0], 1, bias)


def linear_on_support(x: Tensor, weight: Tensor, bias: Optional[Tensor], in_idx: Optional[Tensor],
                      out_idx: Optional[Tensor], plan: Optional[KeptBlockPlan] = None) -> Tensor:
    """``F.linear(x, weight, bias)`` on the input features ``in_idx`` and output rows ``out_idx`` alone."""
    y = F.linear(x if in_idx is None else x.index_select(-1, in_idx),
                 *_kept_block(weight, bias, in_idx, out_idx, plan))
    return y if out_idx is None else _scatter_rows(y, out_idx, weight.shape[0], -1, bias)


class _SupportConv2d(nn.Conv2d):
    """An ``nn.Conv2d`` computing on its kept block (:func:`compute_on_support`)."""
    _in_idx: Optional[Tensor]
    _out_idx: Optional[Tensor]
    _kept_plan: Optional[KeptBlockPlan]

    def forward(self, x: Tensor) -> Tensor:
        return conv2d_on_support(x, self.weight, self.bias, self._in_idx, self._out_idx, self._conv_forward,
                                 self._kept_plan)


class _SupportLinear(nn.Linear):
    """An ``nn.Linear`` computing on its kept block (:func:`compute_on_support`)."""
    _in_idx: Optional[Tensor]
    _out_idx: Optional[Tensor]
    _kept_plan: Optional[KeptBlockPlan]

    def forward(self, x: Tensor) -> Tensor:
        return linear_on_support(x, self.weight, self.bias, self._in_idx, self._out_idx, self._kept_plan)


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
    module._kept_plan = kept_block_plan(module.weight, in_idx, out_idx)   # CPU only: kept as a plain attribute
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
        del module._buffers["_in_idx"], module._buffers["_out_idx"], module._kept_plan
