"""Structured sparsity: which groups of a conv weight survive, and how to ship only those.

A conv weight ``W`` of shape ``(C_out, C_in, KH, KW)`` is read as its GEMM matrix ``(C_out, C_in*KH*KW)``
(:func:`gemm_view`). A structure keeps whole groups of that matrix:

* ``filter:K``  keeps ``ceil(K*C_out)`` rows (output filters),
* ``channel:K`` keeps ``ceil(K*C_in)`` input channels; channel ``c`` is the column block
  ``c*KH*KW ... (c+1)*KH*KW - 1`` (all of ``W[:, c]``),
* ``shape:K``   keeps ``ceil(K*C_in*KH*KW)`` single columns (one kernel position of one channel).

``K`` is the *keep* ratio. Each stage keeps the groups of largest L2 norm (ties: lowest index), which makes
``W * mask`` the Frobenius-nearest member of that structured set (the projection Π_S of ADMM): the error is
the sum of the squared norms of the dropped groups, so dropping the smallest ones is optimal.

A composite spec such as ``"filter:0.5+channel:0.5"`` is applied in the fixed order filter → channel → shape;
each stage ranks the norms of the matrix already masked by the stages before it. Whatever the spec, the
result is two masks, one over rows and one over columns, and the kept entries are ``rows ⊗ cols``. So the
kept part of a tensor is a dense block that :func:`shrink` cuts out and :func:`recover` puts back: the two
index sets are the only metadata a receiver needs.

    spec = parse_spec("channel:0.5")
    rows, cols = structured_masks(conv.weight, spec)
    r, c = masks_to_indices(rows, cols)
    block = shrink(conv.weight, r, c)                 # (len(r), len(c)), contiguous
    w = recover(block, r, c, conv.weight.shape)       # == project(conv.weight, spec)

A linear weight ``(out, in)`` is its own GEMM matrix: ``neuron:K`` keeps ``ceil(K*out)`` rows, ``feature:K``
``ceil(K*in)`` input columns. ``head:K`` keeps ``ceil(K*H)`` of an attention module's ``H`` heads, a head being its
rows of every q/k/v projection and its columns of the output projection, ranked together (:func:`head_masks`).
Either way each weight's support is still two masks, one over rows and one over columns.

Modules: :mod:`.spec` (parsing and checking specs), :mod:`.projection` (the masks, alone or coupled across
layers), :mod:`.packing` (shrink / recover, with the native CPU kernel in :mod:`.native`). Pure tensor
functions, no communication; CPU and CUDA alike. Everything public is re-exported here.
"""
from .packing import (GatherPlan, KernelPlan, Plan, gather_plan, recover, recover_gather, shrink,
                      shrink_into)
from .projection import (apply_masks, budget_channels, coupled_masks, coupled_project, density, gemm_view,
                         head_masks, head_scores, masks_to_indices, own_channel_layers, project, read_channels,
                         square_f32, stream_channels, stream_keep, structured_masks, support_mask)
from .spec import (CONV_KINDS, DENSE, HEAD_KINDS, KINDS, LINEAR_KINDS, StructureSpec, Targets, check_layer_types,
                   keep_count, parse_spec, resolve_specs, stages_removing_nothing)

__all__ = ["CONV_KINDS", "DENSE", "HEAD_KINDS", "KINDS", "LINEAR_KINDS", "GatherPlan", "KernelPlan", "Plan",
           "StructureSpec", "Targets", "apply_masks", "budget_channels", "check_layer_types", "coupled_masks",
           "coupled_project", "density", "gather_plan", "gemm_view", "head_masks", "head_scores", "keep_count",
           "masks_to_indices", "own_channel_layers", "parse_spec", "project", "read_channels",
           "recover", "recover_gather", "resolve_specs", "shrink", "shrink_into", "square_f32",
           "stages_removing_nothing", "stream_channels", "stream_keep", "structured_masks", "support_mask"]
