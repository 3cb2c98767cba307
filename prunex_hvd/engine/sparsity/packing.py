"""Packing: the kept block of a tensor cut out (:func:`shrink`) and put back (:func:`recover`), as one gather
per layer while masks hold (:func:`gather_plan`), with the native CPU column kernel (:mod:`.native`) where
ATen's paths are slow. Pure tensor functions, no communication.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from . import native
from .projection import gemm_view

# ----------------------------------------------------------------------------------- shrink / recover
#
# Index sets are expected as masks_to_indices gives them: int64, ascending, no repeats. That lets a full set
# be recognised by its length alone (no device sync), and full sets take a cheaper path: one index_select /
# index_copy_ along the other dimension, or a plain copy when both are full.

def _idx(idx, device) -> Tensor:
    return torch.as_tensor(idx, dtype=torch.long, device=device)


def _out2d(out: Tensor, r: int, c: int, who: str) -> Tensor:
    if out.numel() != r * c:
        raise ValueError(f"{who}: out has {out.numel()} elements, the block needs {r}x{c} = {r * c}")
    if not out.is_contiguous():
        raise ValueError(f"{who}: out must be contiguous (e.g. a slice of a flat buffer)")
    return out.view(r, c)


def _channel_runs(col_idx: Tensor, ksize: int) -> Optional[Tensor]:
    """Channel numbers when ``col_idx`` is whole, aligned runs of ``ksize`` columns (a channel mask), else None.

    Only asked on CPU: there gathering 9-float chunks per channel is about twice as fast as gathering single
    columns, and the check is a few µs. On CUDA the check would need a host sync, which costs more than it saves.
    """
    if ksize <= 1 or col_idx.numel() % ksize or col_idx.device.type != "cpu":
        return None
    # numpy on a CPU tensor is a zero-copy view, and its small ops cost ~1 µs where torch's cost ~8 µs each.
    runs = col_idx.numpy().reshape(-1, ksize)
    first = runs[:, 0]
    # Sorted and unique, so a run spanning exactly ksize-1 is consecutive; starting at a multiple of ksize it
    # is one whole channel.
    if ((first % ksize == 0) & (runs[:, -1] - first == ksize - 1)).all():
        return torch.from_numpy(first // ksize)
    return None


class GatherPlan(NamedTuple):
    """Shrink and recover of one layer as one gather each, for as long as its masks hold.

    The tensor is read as rows of ``chunk`` elements: whole GEMM rows when every column is kept (filter
    structure), whole kernels when the columns come in whole channels (on CPU), single elements on CUDA.
    ``kept``: the chunk numbers of the compact block, in order (shrink gathers them). ``slot``: for every chunk
    of the tensor its place in the block, or -1 where it is pruned (recover gathers by it, see
    :func:`recover_gather`)."""
    chunk: int
    kept: Tensor
    slot: Tensor


class KernelPlan(NamedTuple):
    """CPU: shrink and recover of a row and column subset as one pass each of the native kernel
    (:mod:`prunex_hvd.engine.sparsity.native`).

    The kept rows (``rows``; None when every row is kept) all keep the same ``block_shape[1]`` columns: ``bits``
    is that column mask packed 8 columns to a byte, ``offs[b]`` the kept columns before byte ``b`` (``offs[-1]``
    all of them), and the first ``vector_blocks`` bytes can be moved as whole SIMD vectors without a store
    leaving the row."""
    n_rows: int
    n_cols: int
    block_shape: Tuple[int, int]
    rows: Optional[Tensor]
    bits: Tensor
    offs: Tensor
    vector_blocks: int


# torch's own grain: below it one thread copies faster than two start up
_PARALLEL_NUMEL = 32768


def _kernel_plan(row_idx: Tensor, col_idx: Tensor, n_rows: int, n_cols: int) -> Optional[KernelPlan]:
    """:func:`gather_plan`'s :class:`KernelPlan` for a CPU, non-dense index set; None without the kernel."""
    if native.module() is None:
        return None
    mask = torch.zeros(-(-n_cols // 8) * 8, dtype=torch.uint8)
    mask[col_idx] = 1
    bits = (mask.view(-1, 8) << torch.arange(8, dtype=torch.uint8)).sum(1, dtype=torch.uint8)
    offs = torch.zeros(bits.numel() + 1, dtype=torch.int32)
    torch.cumsum(mask.view(-1, 8).sum(1, dtype=torch.int32), 0, out=offs[1:])
    r, c = row_idx.numel(), col_idx.numel()
    # A block's vector may reach 8 elements past its first kept one: only those ending inside the row qualify.
    vector_blocks = int(((offs[: n_cols // 8] + 8) <= c).sum())
    rows = None if r == n_rows else row_idx.contiguous()
    return KernelPlan(n_rows, n_cols, (r, c), rows, bits, offs, vector_blocks)


def _run_kernel(expand: bool, plan: KernelPlan, full: Tensor, block: Tensor) -> bool:
    """One kernel pass, ``full`` → ``block`` (shrink) or back (``expand``), if the tensors are what it takes
    (CPU, contiguous, one 4- or 8-byte dtype, the plan's sizes); else False, for ATen's path. Kept lean: on a
    small layer this Python takes as long as the pass itself."""
    if native.compress is None and native.module() is None:   # a plan unpickled before anything loaded the kernel
        return False
    numel = plan.n_rows * plan.n_cols
    r, c = plan.block_shape
    if not (full.dtype is block.dtype and full.is_cpu and block.is_cpu and full.numel() == numel
            and block.numel() == r * c and full.is_contiguous() and block.is_contiguous()):
        return False
    size = full.element_size()
    if size != 4 and size != 8:
        return False
    src, dst = (block, full) if expand else (full, block)
    rows = 0 if plan.rows is None else plan.rows.data_ptr()
    threads = torch.get_num_threads() if numel >= _PARALLEL_NUMEL else 1
    (native.expand if expand else native.compress)(
        src.data_ptr(), dst.data_ptr(), size, threads, plan.n_rows, rows, r, plan.bits.data_ptr(),
        plan.offs.data_ptr(), plan.n_cols, c, plan.vector_blocks)
    return True


def _kernel_chunks(row_idx: Tensor, col_idx: Tensor, shape: torch.Size) -> Optional[Tensor]:
    """Numbers of the kept kernel-sized chunks in ``tensor.view(-1, KH*KW)`` for a channel-structured column
    set on CPU: (row r, channel c) → r·C_in + c. One dim-0 gather of whole chunks is a row-wise memcpy in ATen,
    ~2-4× faster than gathering along dim 1."""
    ksize = shape[2] * shape[3] if len(shape) == 4 else 1
    ch = _channel_runs(col_idx, ksize)
    return None if ch is None else (row_idx[:, None] * shape[1] + ch[None, :]).reshape(-1)


Plan = Union[GatherPlan, KernelPlan]


def gather_plan(row_idx, col_idx, shape, use_kernel: bool = True) -> Optional[Plan]:
    """How to shrink and recover a layer with these index sets, computed once per mask (pass it as ``plan=``):
    None for a dense set (a plain copy); on CPU a :class:`KernelPlan` (the native kernel; where it is
    unavailable, a :class:`GatherPlan` of whole rows, or of whole kernels if the columns are whole channels,
    else None: single-element gathers there are slower than a scatter).

    On CUDA every structure gets a :class:`GatherPlan`: each kernel launch costs about what copying a layer
    does, so one gather beats the two or three launches of the general path. ``use_kernel=False``: no
    :class:`KernelPlan` (ATen's paths only, as where the kernel cannot be built)."""
    shape = torch.Size(shape)
    n_rows = shape[0]
    n_cols = shape.numel() // n_rows if n_rows else 0
    device = col_idx.device if isinstance(col_idx, Tensor) else torch.device("cpu")
    row_idx, col_idx = _idx(row_idx, device), _idx(col_idx, device)
    r, c = row_idx.numel(), col_idx.numel()
    if (r, c) == (n_rows, n_cols):
        return None
    if use_kernel and device.type == "cpu" and (kplan := _kernel_plan(row_idx, col_idx, n_rows, n_cols)) is not None:
        return kplan
    if c == n_cols:
        chunk, kept = n_cols, row_idx
    elif device.type == "cuda":
        chunk, kept = 1, (row_idx[:, None] * n_cols + col_idx[None, :]).reshape(-1)
    else:
        kept = _kernel_chunks(row_idx, col_idx, shape)
        if kept is None:
            return None
        chunk = n_cols // shape[1]
    # int32 halves the index memory on CUDA (one per element there); index_select takes either.
    itype = torch.int32 if device.type == "cuda" and shape.numel() < 2**31 else torch.long
    slot = torch.full((shape.numel() // chunk,), -1, dtype=itype, device=device)
    slot[kept] = torch.arange(kept.numel(), dtype=itype, device=device)
    return GatherPlan(chunk, kept.to(itype), slot)


def recover_gather(rows_with_zero: Tensor, index: Tensor, shape, out: Optional[Tensor] = None) -> Tensor:
    """:func:`recover` as one dim-0 gather: ``result.view(-1, chunk)[j] = rows_with_zero[index[j]]``.

    ``rows_with_zero`` is the compact block viewed as rows of ``chunk`` elements followed, somewhere, by a row of
    zeros; ``index`` is the plan's ``slot`` with every -1 pointing at that zero row
    (:meth:`prunex_hvd.engine.buckets.BucketLayout.chunk_rows` gives both). Unlike zero-fill + scatter, it writes every
    element once: on CPU at the speed of a copy. ``out``: a contiguous tensor of ``shape`` to write instead."""
    if out is None:
        return rows_with_zero.index_select(0, index).view(shape)
    if out.shape != shape or not out.is_contiguous():
        raise ValueError(f"recover_gather: out must be contiguous of shape {tuple(shape)}, got {tuple(out.shape)}")
    torch.index_select(rows_with_zero, 0, index, out=out.view(-1, rows_with_zero.shape[1]))
    return out


def _take_cols(g: Tensor, row_idx: Tensor, col_idx: Tensor, shape: torch.Size, out: Optional[Tensor]) -> Tensor:
    """``g[row_idx][:, col_idx]`` for a column subset (rows: any subset, or all) of the tensor of ``shape``."""
    idx = _kernel_chunks(row_idx, col_idx, shape)
    if idx is None:
        # Rows first: dropping rows is a contiguous-chunk copy, and the column gather then runs over fewer rows.
        g = g if row_idx.numel() == g.shape[0] else g.index_select(0, row_idx)
        return torch.index_select(g, 1, col_idx, out=out) if out is not None else g.index_select(1, col_idx)
    ksize = shape[2] * shape[3]
    chunks = g.reshape(-1, ksize)   # a view unless g is a non-contiguous input
    if out is not None:
        torch.index_select(chunks, 0, idx, out=out.view(-1, ksize))
        return out
    return chunks.index_select(0, idx).view(row_idx.numel(), -1)


def shrink(tensor: Tensor, row_idx, col_idx, out: Optional[Tensor] = None, plan: Optional[Plan] = None) -> Tensor:
    """The kept block ``gemm_view(tensor)[row_idx][:, col_idx]`` as a contiguous ``(len(row_idx), len(col_idx))``.

    With ``out`` (any contiguous tensor of that many elements, e.g. a slice of a flat communication bucket)
    the block is written there and ``out`` is returned viewed as 2-D; ``out`` may have another dtype (it is
    cast). The ``out`` path is not differentiable. ``plan``: :func:`gather_plan` of these index sets, cached
    while they hold: the block is then one gather.
    """
    if isinstance(plan, KernelPlan):
        # not differentiable, and it writes through pointers: only out=, or a tensor that needs no grad
        if out is not None or not tensor.requires_grad:
            block = out if out is not None else torch.empty(plan.block_shape, dtype=tensor.dtype)
            if _run_kernel(False, plan, tensor, block):
                return block.view(*plan.block_shape)
        plan = None   # a dtype or layout the kernel does not take: ATen's path
    if plan is not None and tensor.is_contiguous():
        # Kept lean: on a GPU every microsecond of Python here is as long as the gather itself.
        if out is None:
            return tensor.view(-1, plan.chunk).index_select(0, plan.kept).view(len(row_idx), -1)
        if out.dtype == tensor.dtype and out.is_contiguous() and out.numel() == plan.kept.numel() * plan.chunk:
            src = tensor.detach() if tensor.requires_grad else tensor   # out= refuses autograd
            torch.index_select(src.view(-1, plan.chunk), 0, plan.kept, out=out.view(-1, plan.chunk))
            return out.view(len(row_idx), -1)
    g = gemm_view(tensor)
    n_rows, n_cols = g.shape
    row_idx, col_idx = _idx(row_idx, g.device), _idx(col_idx, g.device)
    r, c = row_idx.numel(), col_idx.numel()
    all_rows, all_cols = r == n_rows, c == n_cols
    if out is None:
        if all_rows and all_cols:
            return g.clone(memory_format=torch.contiguous_format)
        if all_cols:
            return g.index_select(0, row_idx)
        return _take_cols(g, row_idx, col_idx, tensor.shape, None)

    o = _out2d(out, r, c, "shrink")
    with torch.no_grad():
        if o.dtype != g.dtype or o.device != g.device:
            o.copy_(shrink(tensor.detach(), row_idx, col_idx))
        elif all_rows and all_cols:
            o.copy_(g)
        elif all_cols:
            torch.index_select(g, 0, row_idx, out=o)
        else:
            _take_cols(g, row_idx, col_idx, tensor.shape, o)
    return o


def shrink_into(tensor: Tensor, row_idx, col_idx, out: Tensor, plan: Optional[Plan] = None) -> None:
    """:func:`shrink` into ``out`` without the 2-D view of it that :func:`shrink` returns: what a round calls
    for every layer (on a small layer on CPU, making that view costs a third of the kernel's pass)."""
    if not (isinstance(plan, KernelPlan) and _run_kernel(False, plan, tensor, out)):
        shrink(tensor, row_idx, col_idx, out=out, plan=plan)


def recover(compact: Tensor, row_idx, col_idx, shape, out: Optional[Tensor] = None,
            plan: Optional[Plan] = None) -> Tensor:
    """Inverse of :func:`shrink`: a tensor of ``shape``, zero except at ``row_idx × col_idx`` (gemm view).

    ``compact`` is the block, flat or 2-D. With ``out`` (a tensor of ``shape``) it is zero-filled, written and
    returned (not differentiable); otherwise a new tensor of ``compact``'s dtype and device is made.
    ``recover(shrink(W, r, c), r, c, W.shape)`` equals ``W`` wherever ``W`` is supported on ``r × c``.
    ``plan``: :func:`gather_plan` of these index sets, cached (a :class:`KernelPlan`: one native pass, every
    element written once; a :class:`GatherPlan`: one scatter of its chunks after the zero-fill, where
    :func:`recover_gather` needs no zero-fill at all).
    """
    if isinstance(plan, KernelPlan):
        # as in shrink: out=, or a block that needs no grad; anything the kernel does not take goes on below
        if out is None and not compact.requires_grad:
            dst = torch.empty(shape, dtype=compact.dtype)
        else:
            dst = out if out is not None and out.shape == shape else None
        if dst is not None and _run_kernel(True, plan, dst, compact):
            return dst
        plan = None
    shape = torch.Size(shape)
    n_rows = shape[0]
    n_cols = shape.numel() // n_rows if n_rows else 0
    device = compact.device if out is None else out.device
    row_idx, col_idx = _idx(row_idx, device), _idx(col_idx, device)
    r, c = row_idx.numel(), col_idx.numel()
    if compact.numel() != r * c:
        raise ValueError(f"recover: compact has {compact.numel()} elements, expected {r}x{c} = {r * c}")
    if out is not None and out.shape != shape:
        raise ValueError(f"recover: out has shape {tuple(out.shape)}, expected {tuple(shape)}")
    if out is not None and not out.is_contiguous():
        # gemm_view of a non-contiguous tensor is a copy; build contiguously and copy back once.
        with torch.no_grad():
            return out.copy_(recover(compact.detach(), row_idx, col_idx, shape))

    block = compact.reshape(r, c)
    if out is None:
        res = block.new_zeros(shape) if (r, c) != (n_rows, n_cols) else None
        return _scatter(res, block, row_idx, col_idx, shape, n_rows, n_cols, plan)
    with torch.no_grad():
        block = block.detach().to(device=out.device, dtype=out.dtype)
        if (r, c) != (n_rows, n_cols):
            out.zero_()
        _scatter(out, block, row_idx, col_idx, shape, n_rows, n_cols, plan)
    return out


def _scatter(dst, block, row_idx, col_idx, shape, n_rows, n_cols, plan=None) -> Tensor:
    r, c = block.shape
    if (r, c) == (n_rows, n_cols):       # dense: nothing to zero, a straight copy
        if dst is None:
            return block.reshape(shape).clone(memory_format=torch.contiguous_format)
        return dst.copy_(block.reshape(shape))
    g = gemm_view(dst)                   # a view: dst is contiguous here
    ksize = shape[2] * shape[3] if len(shape) == 4 else 1
    if plan is None and 1 < ksize and c < n_cols:
        kept = _kernel_chunks(row_idx, col_idx, shape)
        plan = None if kept is None else GatherPlan(ksize, kept, kept)
    if plan is not None:                 # whole chunks: one dim-0 copy of rows of plan.chunk elements
        dst.view(-1, plan.chunk).index_copy_(0, plan.kept.long(), block.reshape(-1, plan.chunk))
    elif c == n_cols:
        g.index_copy_(0, row_idx, block)
    elif r == n_rows:
        # scatter_ with a broadcast (stride-0) index: about 2.5x faster than index_copy_ along dim 1 on CPU.
        g.scatter_(1, col_idx[None, :].expand(r, c), block)
    else:
        # Spread the columns into a rows-only block first, then drop whole rows in: two cheap copies instead
        # of a 2-D index_put_ that must compute a flat offset per element.
        wide = block.new_zeros(r, n_cols)
        wide.scatter_(1, col_idx[None, :].expand(r, c), block)
        g.index_copy_(0, row_idx, wide)
    return dst
