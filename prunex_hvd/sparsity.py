"""Structured sparsity: which groups of a conv weight survive, and how to ship only those.

Pure tensor functions, no communication; CPU and CUDA alike.

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
"""
from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from . import native

KINDS = ("filter", "channel", "shape")   # also the application order
_ORDER = {k: i for i, k in enumerate(KINDS)}
_DENSE_WORDS = ("", "dense")


# --------------------------------------------------------------------------------------------- specs

def _fmt_keep(keep: float) -> str:
    # Short form when it round-trips ("0.5", "1"), exact repr otherwise, so str(spec) parses back equal.
    s = f"{keep:.12g}"
    return s if float(s) == keep else repr(keep)


def _check_part(kind, keep) -> Tuple[str, float]:
    if kind not in _ORDER:
        raise ValueError(f"unknown structure kind {kind!r}; valid kinds: {', '.join(KINDS)}")
    try:
        keep = float(keep)
    except (TypeError, ValueError):
        raise ValueError(f"{kind}: keep ratio {keep!r} is not a number") from None
    if not (0.0 < keep <= 1.0):     # also rejects nan
        raise ValueError(f"{kind}:{keep!r}: keep ratio must be in (0, 1]")
    return kind, keep


@dataclass(frozen=True)
class StructureSpec:
    """A structured-sparsity constraint: ``(kind, keep)`` pairs in application order; ``()`` is dense.

    Built by :func:`parse_spec`; direct construction is validated and put in canonical order too, so two
    specs meaning the same thing compare (and hash) equal.
    """
    parts: tuple = ()

    def __post_init__(self):
        parts = [_check_part(*p) for p in self.parts]
        kinds = [k for k, _ in parts]
        for k in KINDS:
            if kinds.count(k) > 1:
                raise ValueError(f"structure kind {k!r} given more than once")
        object.__setattr__(self, "parts", tuple(sorted(parts, key=lambda p: _ORDER[p[0]])))

    @property
    def is_dense(self) -> bool:
        """No constraint at all: every entry is kept."""
        return not self.parts

    def __str__(self) -> str:
        if self.is_dense:
            return "dense"
        return "+".join(f"{k}:{_fmt_keep(v)}" for k, v in self.parts)


DENSE = StructureSpec(())


def parse_spec(spec) -> StructureSpec:
    """``"filter:0.3+shape:0.8"`` → :class:`StructureSpec`, parts in the order filter → channel → shape.

    ``None``, ``""`` and ``"dense"`` mean no constraint; a :class:`StructureSpec` is returned as is.
    Whitespace and letter case are ignored. The number is the fraction of groups *kept*, in (0, 1].
    """
    if isinstance(spec, StructureSpec):
        return spec
    if spec is None:
        return DENSE
    if not isinstance(spec, str):
        raise TypeError(f"sparsity spec must be a str like 'channel:0.5', a StructureSpec or None, "
                        f"not {type(spec).__name__}")
    text = "".join(spec.split()).lower()
    if text in _DENSE_WORDS:
        return DENSE
    parts = []
    for item in text.split("+"):
        kind, sep, num = item.partition(":")
        if kind not in _ORDER:
            raise ValueError(f"sparsity spec {spec!r}: unknown structure kind {kind!r}; "
                             f"valid kinds: {', '.join(KINDS)} (or 'dense')")
        if not sep or not num:
            raise ValueError(f"sparsity spec {spec!r}: {kind!r} needs a keep ratio, e.g. '{kind}:0.5'")
        try:
            keep = float(num)
        except ValueError:
            raise ValueError(f"sparsity spec {spec!r}: keep ratio {num!r} of {kind!r} is not a number") from None
        if not (0.0 < keep <= 1.0):
            raise ValueError(f"sparsity spec {spec!r}: {kind}:{num}: keep ratio must be in (0, 1]")
        if any(k == kind for k, _ in parts):
            raise ValueError(f"sparsity spec {spec!r}: structure kind {kind!r} given more than once")
        parts.append((kind, keep))
    return StructureSpec(tuple(parts))


def resolve_specs(named_params, sparsity) -> dict:
    """Which parameters get which structure: ``{name: StructureSpec}`` for the constrained conv weights only.

    ``sparsity`` is ``None`` (nothing), one spec for every 4-D parameter, or a dict ``{glob: spec}`` whose
    globs (:func:`fnmatch.fnmatchcase`, case-sensitive) match parameter names; for each 4-D parameter the
    first matching glob in dict order decides, so ``{"conv1.*": "dense", "*": "channel:0.5"}`` spares
    ``conv1``. A glob that matches nothing, or that asks for structure on non-conv parameters only, is an
    error rather than a silent no-op: a typo there would otherwise train a dense model.
    """
    params = [(name, p) for name, p in named_params]
    if sparsity is None:
        return {}
    if not isinstance(sparsity, Mapping):
        spec = parse_spec(sparsity)
        if spec.is_dense:
            return {}
        return {name: spec for name, p in params if p.dim() == 4}

    rules = []
    for glob, s in sparsity.items():
        if not isinstance(glob, str):
            raise TypeError(f"sparsity dict keys must be parameter-name globs (str), not {glob!r}")
        try:
            spec = parse_spec(s)
        except (ValueError, TypeError) as e:
            raise type(e)(f"sparsity[{glob!r}]: {e}") from None
        matched = [(name, p) for name, p in params if fnmatch.fnmatchcase(name, glob)]
        if not matched:
            some = ", ".join(name for name, _ in params[:6]) + (", ..." if len(params) > 6 else "")
            raise ValueError(f"sparsity glob {glob!r} matches no parameter (names look like: {some or 'none'})")
        if not spec.is_dense and not any(p.dim() == 4 for _, p in matched):
            name, p = matched[0]
            raise ValueError(f"sparsity[{glob!r}] = {str(spec)!r}: {name!r} (shape {tuple(p.shape)}) is not a conv "
                             f"weight (4-D); structured sparsity applies to conv weights only")
        rules.append((glob, spec))

    out = {}
    for name, p in params:
        if p.dim() != 4:
            continue
        for glob, spec in rules:
            if fnmatch.fnmatchcase(name, glob):
                if not spec.is_dense:
                    out[name] = spec
                break
    return out


def _suggest(overrides: dict, sparsity) -> dict:
    """The user's ``sparsity`` with ``overrides`` ({name: spec}) put first, as a dict to paste back."""
    rules = dict(sparsity) if isinstance(sparsity, Mapping) else {"*": str(parse_spec(sparsity))}
    return {**overrides, **{g: (s if isinstance(s, str) else str(parse_spec(s))) for g, s in rules.items()
                            if g not in overrides}}


def check_layer_types(model: torch.nn.Module, specs: Mapping[str, "StructureSpec"], sparsity=None) -> None:
    """``ValueError`` when a structured weight belongs to a layer whose weight the GEMM view does not fit.

    * ``ConvTranspose2d``: its weight is ``(C_in, C_out/groups, KH, KW)``, so 'filter' would drop its input
      channels and 'channel' its outputs. It must stay dense.
    * a grouped ``Conv2d`` (``groups > 1``): dim 1 holds ``C_in/groups`` channels of EACH group, so 'channel c'
      or a 'shape' column would be dropped at the same place in every group at once, not as the user means
      it. Dropping output filters is valid there: 'filter:K' is accepted. A depthwise conv (one input channel
      per filter) passes with 'channel:K' too: that stage can drop nothing there (:func:`stages_removing_nothing`
      reports it).

    ``sparsity`` (the user's argument, optional) only shapes the message: it shows the dict to write instead.
    """
    problems, overrides = [], {}
    for module_name, module in model.named_modules():
        name = f"{module_name}.weight" if module_name else "weight"
        spec = specs.get(name)
        if spec is None or getattr(module, "weight", None) is None:
            continue
        kind = type(module).__name__
        if isinstance(module, torch.nn.modules.conv._ConvTransposeNd):
            problems.append(f"{name!r} belongs to a {kind}, whose weight is (C_in, C_out/groups, KH, KW): "
                            f"'filter' would drop its input channels and 'channel' its outputs")
            overrides[name] = "dense"
        elif isinstance(module, torch.nn.Conv2d) and module.groups > 1:
            per_group = module.weight.shape[1]
            ksize = module.weight.shape[2] * module.weight.shape[3]
            bad = [k for k, _ in spec.parts if (k == "channel" and per_group > 1) or (k == "shape" and
                                                                                     per_group * ksize > 1)]
            if bad:
                problems.append(f"{name!r} belongs to a grouped {kind} (groups={module.groups}, {per_group} input "
                                f"channels per group): {' and '.join(repr(k) for k in bad)} would drop the same "
                                f"position in every group at once")
                keeps = dict(spec.parts)
                overrides[name] = f"filter:{_fmt_keep(keeps.get('filter', keeps[bad[0]]))}"
    if problems:
        advice = "leave it dense" if len(problems) == 1 else "leave them dense"
        if any(s.startswith("filter") for s in overrides.values()):
            advice += " (a grouped conv may lose whole output filters)"
        instead = _suggest(overrides, sparsity if sparsity is not None else "dense")
        raise ValueError("structured sparsity does not fit these layers: " + "; ".join(problems) +
                         f". Instead, {advice}, e.g. sparsity={instead!r}")


def stages_removing_nothing(shapes: Mapping[str, Tuple[int, ...]],
                            specs: Mapping[str, "StructureSpec"]) -> dict:
    """``{name: (kind, ...)}``: the stages of each layer's spec that can remove nothing from its weight, whatever
    its values: a keep ratio below 1 whose kept count is still every group (``channel:K`` on a stem that reads
    one input channel, or on a depthwise conv; ``filter:K`` on a one-filter layer; ``shape:K`` keeping at least
    the columns the channel stage left). A stage written with keep 1 asks for nothing and is not listed.
    ``shapes``: ``{name: weight shape}`` (tensors work too)."""
    out = {}
    for name, spec in specs.items():
        spec = parse_spec(spec)
        shape = tuple(getattr(shapes[name], "shape", shapes[name]))
        if len(shape) != 4:
            continue
        c_out, c_in = shape[0], shape[1]
        ksize = shape[2] * shape[3]
        columns_left = c_in * ksize
        idle = []
        for kind, keep in spec.parts:
            if kind == "filter":
                removes = keep_count(keep, c_out) < c_out
            elif kind == "channel":
                kept = keep_count(keep, c_in)
                removes, columns_left = kept < c_in, kept * ksize
            else:   # shape ranks all C_in*KH*KW columns, the channel stage's zeros among them
                removes = keep_count(keep, c_in * ksize) < columns_left
            if not removes and keep < 1.0:
                idle.append(kind)
        if idle:
            out[name] = tuple(idle)
    return out


# --------------------------------------------------------------------------------------------- masks

def gemm_view(weight: Tensor) -> Tensor:
    """``(C_out, C_in, KH, KW)`` → ``(C_out, C_in*KH*KW)``; a view when ``weight`` is contiguous.

    Any tensor with at least one dimension is read the same way (1-D: one column), so dense parameters can
    go through :func:`shrink` / :func:`recover` with full index sets.
    """
    if weight.dim() == 0:
        raise ValueError("gemm_view needs a tensor with at least one dimension")
    return weight.reshape(weight.shape[0], -1)


def keep_count(keep: float, n: int) -> int:
    """How many of ``n`` groups a keep ratio keeps: ``ceil(keep*n)`` clamped to ``[1, n]``.

    ``keep*n`` in floating point can land a hair above an integer (``0.1+0.2`` is not ``0.3``); the small
    tolerance stops that from keeping one extra group.
    """
    n = int(n)
    if n < 1:
        raise ValueError(f"keep_count: need at least one group, got n={n}")
    if not (0.0 < keep <= 1.0):
        raise ValueError(f"keep ratio must be in (0, 1], got {keep!r}")
    k = math.ceil(keep * n - max(1e-9, n * 1e-12))
    return min(max(k, 1), n)


def _top_mask(norms: Tensor, k: int) -> Tensor:
    # Stable descending sort: among equal norms the lowest index comes first, so it is the one kept.
    order = torch.sort(norms, descending=True, stable=True).indices[:k]
    mask = torch.zeros(norms.shape[0], dtype=torch.bool, device=norms.device)
    mask[order] = True
    return mask


def structured_masks(weight: Tensor, spec, rows: Optional[Tensor] = None,
                     channel_bonus: Optional[Tensor] = None,
                     channels: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The projection's support: ``(rows: bool[C_out], cols: bool[C_in*KH*KW])`` on ``weight.device``.

    Stages run filter → channel → shape, each ranking the weight as masked by the stages before it. Channel
    and shape columns combine with AND. A dense spec gives all-True masks (for a tensor of any rank).

    Coupled pruning (:func:`coupled_masks`) passes ``rows``, the row mask decided by the layer that reads
    this one's output (it replaces the filter stage), and ``channel_bonus``, squared norms (``[C_in]``) of the
    producer filters that go with each input channel, added to the channel stage's scores, or ``channels``
    (``bool[C_in]``), the input channels kept by a residual stream's group (it replaces the channel stage).
    """
    spec = parse_spec(spec)
    w = gemm_view(weight.detach())
    n_rows, n_cols = w.shape
    cols = torch.ones(n_cols, dtype=torch.bool, device=w.device)
    if spec.is_dense:
        return torch.ones(n_rows, dtype=torch.bool, device=w.device), cols
    if weight.dim() != 4:
        raise ValueError(f"structured sparsity {str(spec)!r} needs a conv weight (4-D: C_out, C_in, KH, KW), "
                         f"got shape {tuple(weight.shape)}")
    tied = rows is not None
    rows = rows.to(w.device) if tied else torch.ones(n_rows, dtype=torch.bool, device=w.device)
    # Rank on squares (same order as L2 norms, one rounding fewer), in float32 at least so half-precision
    # weights neither overflow nor collapse distinct norms into ties.
    sq = square_f32(w)
    c_in = weight.shape[1]
    ksize = n_cols // c_in
    for kind, keep in spec.parts:   # already in filter -> channel -> shape order
        masked = sq * rows[:, None] * cols[None, :]
        if kind == "filter":
            if not tied:
                rows = _top_mask(masked.sum(1), keep_count(keep, n_rows))
        elif kind == "channel":
            score = masked.view(n_rows, c_in, ksize).sum((0, 2))
            if channel_bonus is not None:
                score = score + channel_bonus.to(score)
            ch = channels.to(w.device) if channels is not None else _top_mask(score, keep_count(keep, c_in))
            cols = cols & ch.repeat_interleave(ksize)
        else:  # shape
            cols = cols & _top_mask(masked.sum(0), keep_count(keep, n_cols))
    return rows, cols


def square_f32(t: Tensor) -> Tensor:
    """Squares in float32 at least (float64 stays float64): for ranking, without overflow or false ties."""
    return t.detach().to(torch.float64 if t.dtype == torch.float64 else torch.float32).square()


def _channel_keep(spec) -> Optional[float]:
    return next((keep for kind, keep in parse_spec(spec).parts if kind == "channel"), None)


def stream_keep(specs: Mapping[str, "StructureSpec"], readers, writers=()) -> float:
    """The channel keep ratio of a residual stream's group: its readers' ``channel:K``. ``ValueError`` when a
    reader has no channel stage or the readers ask for different ratios (one mask cannot honour both), or when
    a member is missing from ``specs`` (a dense layer cannot take the group's zeros)."""
    missing = [n for n in (*readers, *writers) if n not in specs]
    if missing:
        raise ValueError(f"residual stream {list(readers)}: {missing} {'is' if len(missing) == 1 else 'are'} not "
                         f"structured (dense), so the stream's channels cannot be pruned as one group")
    keeps = {n: _channel_keep(specs[n]) for n in readers}
    if None in keeps.values() or len(set(keeps.values())) != 1:
        raise ValueError("the convs reading one residual stream share one channel mask, so they need the same "
                         "'channel:K' keep ratio; got " + ", ".join(f"{n}: {str(parse_spec(specs[n]))!r}"
                                                                    for n in readers))
    return next(iter(keeps.values()))


def stream_channels(weights: Mapping[str, Tensor], readers, writers, keep: float) -> Tensor:
    """The channels a residual stream keeps (``bool[C]``): channel ``c`` of the group is input channel ``c`` of
    every reader and filter ``c`` of every writer, scored by their joint squared norm; the ``ceil(keep*C)``
    largest stay (ties: lowest index). With every member constrained by this group alone, that is the
    Frobenius-nearest point where all members share one channel set."""
    score = sum(square_f32(weights[n]).sum((0, 2, 3)) for n in readers)
    score = score + sum(gemm_view(square_f32(weights[n])).sum(1).to(score.device) for n in writers)
    return _top_mask(score, keep_count(keep, score.numel()))


def read_channels(cols: Tensor, c_in: int) -> Tensor:
    """The input channels a column mask reads (``bool[c_in]``): channel ``c`` counts when ANY of its kernel
    positions is kept. A shape stage can drop some positions of a kept channel, its first one included, and the
    producer filter behind that channel is still read through the others."""
    return cols.view(c_in, -1).any(1)


def coupled_masks(weights: Mapping[str, Tensor], specs: Mapping[str, "StructureSpec"],
                  couplings: Mapping[str, str], streams=()) -> dict:
    """Masks ``{name: (rows, cols)}`` for every name in ``specs``, with channel pruning coupled along
    ``couplings`` (``{consumer: producer}``, from :func:`prunex_hvd.dependencies.channel_couplings`) and
    ``streams`` (``(readers, writers)`` name tuples, from :func:`prunex_hvd.dependencies.channel_streams`).

    For a coupled pair, input channel ``c`` of the consumer and filter ``c`` of the producer are one group:
    the consumer's channel stage ranks channels by the squared norm of its column block plus that of the
    producer's filter, and the producer keeps exactly the filters of the channels the consumer still reads,
    at any kernel position (:func:`read_channels`; its own filter stage, if its spec has one, is superseded).
    A pair counts only when both are in ``specs`` and the consumer's spec has a channel stage. A producer may
    have one consumer only (``ValueError`` otherwise: the other would read filters pruned for the first).
    Without couplings this is :func:`structured_masks` per layer.

    A stream is one group over all its members (:func:`stream_channels`, keep from :func:`stream_keep`): its
    readers' channel stage and its writers' filter stage are replaced by the group's channel set. Streams are
    decided first, on the weights as they are; pairs then rank given them (a producer that reads a stream
    scores only its filters' kept columns: the exact choice given the stream's).
    """
    readers_of: dict = {}
    for consumer, producer in couplings.items():
        readers_of.setdefault(producer, []).append(consumer)
    shared = {p: c for p, c in readers_of.items() if len(c) > 1}
    if shared:
        p, c = next(iter(shared.items()))
        raise ValueError(f"couplings: {p} is the producer of {len(c)} consumers ({', '.join(c)}); a producer's "
                         f"filters can follow one consumer's channels only (a conv called twice, or a feature map "
                         f"read by several convs, is not a pair)")
    stream_rows, stream_cols = {}, {}
    for readers, writers in streams:
        ch = stream_channels(weights, readers, writers, stream_keep(specs, readers, writers))
        for n in writers:
            stream_rows[n] = ch
        for n in readers:
            stream_cols[n] = ch
    live = {c: p for c, p in couplings.items()
            if c in specs and p in specs and any(k == "channel" for k, _ in parse_spec(specs[c]).parts)}
    twice = [n for n in live if n in stream_cols] + [n for n in live.values() if n in stream_rows]
    if twice:   # a conv's input channels, and its filters, belong to one group each
        raise ValueError(f"{twice[0]} is in a coupled pair and a residual stream on the same side")
    consumer_of = {p: c for c, p in live.items()}
    out: dict = {}
    busy = set()   # a cycle of pairs would recurse for ever

    def masks(name):   # consumers before their producers: a producer's rows are its consumer's channels
        if name not in out:
            if name in busy:
                raise ValueError(f"couplings form a cycle through {name}: a conv cannot produce its own input")
            busy.add(name)
            rows, bonus = stream_rows.get(name), None
            if name in consumer_of:
                _, ccols = masks(consumer_of[name])
                rows = read_channels(ccols, weights[consumer_of[name]].shape[1])
            if name in live:
                producer = gemm_view(square_f32(weights[live[name]]))
                if live[name] in stream_cols:   # the producer's columns are the stream's: only those count
                    producer = producer.view(producer.shape[0], len(stream_cols[live[name]]), -1) * \
                        stream_cols[live[name]].to(producer)[None, :, None]
                bonus = producer.reshape(producer.shape[0], -1).sum(1)
            out[name] = structured_masks(weights[name], specs[name], rows=rows, channel_bonus=bonus,
                                         channels=stream_cols.get(name))
        return out[name]

    for name in specs:
        masks(name)
    return out


def coupled_project(weights: Mapping[str, Tensor], specs: Mapping[str, "StructureSpec"],
                    couplings: Mapping[str, str], streams=()) -> dict:
    """``{name: W ⊙ mask}`` with the masks of :func:`coupled_masks`."""
    return {name: apply_masks(weights[name], rows, cols)
            for name, (rows, cols) in coupled_masks(weights, specs, couplings, streams).items()}


def masks_to_indices(rows: Tensor, cols: Tensor) -> Tuple[Tensor, Tensor]:
    """The kept row and column numbers, int64, ascending: what :func:`shrink` / :func:`recover` take."""
    return rows.nonzero().flatten(), cols.nonzero().flatten()


def _mask2d(weight: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    return (rows.to(weight.device)[:, None] & cols.to(weight.device)[None, :]).reshape(weight.shape)


def apply_masks(weight: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """``W ⊙ (rows ⊗ cols)`` as a new tensor of ``weight``'s shape and dtype.

    Uses masked_fill rather than a multiply so dropped entries are exactly 0 even when they hold inf/nan.
    """
    return weight.masked_fill(~_mask2d(weight, rows, cols), 0)


def project(weight: Tensor, spec) -> Tensor:
    """Π_S(W): the Frobenius-nearest structured-sparse tensor (exactly so for a single structure kind)."""
    return apply_masks(weight, *structured_masks(weight, parse_spec(spec)))


def density(rows: Tensor, cols: Tensor) -> float:
    """Fraction of GEMM entries kept: ``|rows| * |cols| / (C_out * C_in*KH*KW)``."""
    return int(rows.sum()) * int(cols.sum()) / (rows.numel() * cols.numel())


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
    (:mod:`prunex_hvd.native`).

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
    (:meth:`prunex_hvd.buckets.BucketLayout.chunk_rows` gives both). Unlike zero-fill + scatter, it writes every
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
