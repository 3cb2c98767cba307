"""Projection onto a structured set: the masks of a conv weight's kept filters, channels or columns, of a linear
weight's kept neurons or features, alone or coupled across layers that must drop the same channels, and of an
attention module's kept heads. Pure tensor functions, no communication.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Optional, Tuple

import torch
from torch import Tensor

from .spec import CONV_KINDS, HEAD_KINDS, LINEAR_KINDS, StructureSpec, keep_count, parse_spec

# --------------------------------------------------------------------------------------------- masks

def gemm_view(weight: Tensor) -> Tensor:
    """``(C_out, C_in, KH, KW)`` → ``(C_out, C_in*KH*KW)``; a view when ``weight`` is contiguous.

    Any tensor with at least one dimension is read the same way (1-D: one column), so dense parameters can
    go through :func:`shrink` / :func:`recover` with full index sets.
    """
    if weight.dim() == 0:
        raise ValueError("gemm_view needs a tensor with at least one dimension")
    return weight.reshape(weight.shape[0], -1)


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
    and shape columns combine with AND. A dense spec gives all-True masks (for a tensor of any rank). A linear
    weight ``(out, in)`` is its own GEMM matrix: ``neuron`` is its filter stage (rows) and ``feature`` its
    channel stage (one column per input feature). ``head`` is decided per attention module
    (:func:`head_masks`), never here.

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
    kinds = {k for k, _ in spec.parts}
    if kinds & set(HEAD_KINDS):
        raise ValueError(f"{str(spec)!r}: 'head:K' prunes an attention module's heads across its q/k/v and output "
                         f"projections at once (head_masks), not one weight alone")
    if kinds & set(CONV_KINDS) and weight.dim() != 4:
        raise ValueError(f"structured sparsity {str(spec)!r} needs a conv weight (4-D: C_out, C_in, KH, KW), "
                         f"got shape {tuple(weight.shape)}")
    if kinds & set(LINEAR_KINDS) and weight.dim() != 2:
        raise ValueError(f"structured sparsity {str(spec)!r} needs a linear weight (2-D: out, in), "
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
        if kind in ("filter", "neuron"):
            if not tied:
                rows = _top_mask(masked.sum(1), keep_count(keep, n_rows))
        elif kind in ("channel", "feature"):
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


def own_channel_layers(specs: Mapping[str, "StructureSpec"], couplings: Mapping[str, str] = None,
                       streams=()) -> list:
    """The layers whose input channels are theirs alone to choose, and all their weights with them, in ``specs``
    order: held to a plain ``channel:K`` or ``feature:K``, in no coupled pair (a consumer's channels go with its
    producer's filters, which a producer keeps only some of) and no residual stream (readers and writers alike).
    What :func:`budget_channels` can share one budget among."""
    grouped = set(couplings or ()) | set((couplings or {}).values()) | \
        {n for readers, writers in streams for n in (*readers, *writers)}
    return [n for n, spec in specs.items() if n not in grouped
            and [kind for kind, _ in parse_spec(spec).parts] in (["channel"], ["feature"])]


BUDGET_FLOOR = 0.1   # under one channel budget, every layer keeps at least this fraction of its input channels


def budget_channels(weights: Mapping[str, Tensor], specs: Mapping[str, "StructureSpec"],
                    floor: float = BUDGET_FLOOR) -> dict:
    """One budget of kept weights shared by every layer held to a plain ``channel:K`` (conv) or ``feature:K``
    (linear): ``{name: bool[C_in]}``, the input channels each keeps. Layers with other specs are not in it.

    The budget is what the per-layer projection keeps, B = Σ_l ceil(K_l·C_l)·m_l, where m_l is the number of
    weights in one input channel of layer l. The projection onto {every layer channel-sparse, Σ kept weights
    ≤ B} keeps the channels of largest total squared norm under that budget, a knapsack; this is the greedy
    answer by density ‖W_l[:, c]‖² / m_l, the mean squared weight (not always the exact one): first each
    layer's ``max(1, ceil(floor·C_l))`` densest (at most its ceil(K_l·C_l); ``floor`` :data:`BUDGET_FLOOR`: binds on
    neither ResNet measured, whose thinnest layers keep 22–31% of their channels), so no layer is cut off, then one
    ranking of all the other channels (ties: layer order, then lowest index), each kept if its weights fit in
    what the budget has left (one of a large layer that does not fit leaves the room to smaller ones after
    it). The total kept never exceeds the per-layer projection's; large layers of small weights give up
    channels to small ones.
    """
    if isinstance(floor, bool) or not 0 < floor <= 1:
        raise ValueError(f"budget floor must be a fraction in (0, 1], got {floor!r}")
    chosen, budget, ranked = {}, 0, []
    for name, spec in specs.items():
        spec = parse_spec(spec)
        kinds = [kind for kind, _ in spec.parts]
        if not {"channel", "feature"} & set(kinds):
            continue
        if len(kinds) != 1:
            raise ValueError(f"a channel budget across layers ranks whole input channels: {name} is held to "
                             f"{str(spec)!r}; give it 'channel:K' alone, leave it out, or use the per-layer budget")
        w = weights[name]
        c_in = w.shape[1]
        per_channel = w.numel() // c_in
        density = gemm_view(square_f32(w)).view(w.shape[0], c_in, -1).sum((0, 2)) / per_channel
        k = keep_count(spec.parts[0][1], c_in)
        forced = min(k, keep_count(floor, c_in))
        order = torch.sort(density, descending=True, stable=True).indices
        mask = torch.zeros(c_in, dtype=torch.bool, device=w.device)
        mask[order[:forced]] = True
        chosen[name] = mask
        budget += (k - forced) * per_channel
        rest = order[forced:]
        ranked.append((density[rest].double().cpu(), rest.cpu(), torch.full((len(rest),), per_channel),
                       torch.full((len(rest),), len(chosen) - 1)))
    if not ranked:
        return chosen
    density, index, cost, layer = (torch.cat(t) for t in zip(*ranked))
    # descending density; layer order, then lowest index among ties (each layer's rest is already in that order)
    order = torch.sort(density, descending=True, stable=True).indices.tolist()
    index, cost, layer, cheapest = index.tolist(), cost.tolist(), layer.tolist(), int(cost.min())
    taken = [[] for _ in chosen]
    for i in order:
        if cost[i] <= budget:
            budget -= cost[i]
            taken[layer[i]].append(index[i])
        elif budget < cheapest:
            break
    for (name, mask), idx in zip(chosen.items(), taken):
        if idx:
            mask[torch.tensor(idx, device=mask.device)] = True
    return chosen


def head_scores(weights: Mapping[str, Tensor], group) -> Tensor:
    """Each head's squared norm over its whole group (``float32`` at least, ``[num_heads]``): its rows of every
    q/k/v block and its columns of the output projection (``group``: a
    :class:`~prunex_hvd.engine.dependencies.HeadGroup`)."""
    h = group.num_heads
    score = sum(square_f32(weights[n]).sum(1).view(blocks, h, -1).sum((0, 2)) for n, blocks in group.rows)
    return score + sum(square_f32(weights[n]).sum(0).view(h, -1).sum(1).to(score.device) for n in group.cols)


def head_masks(weights: Mapping[str, Tensor], group, keep: float) -> dict:
    """``{name: (rows, cols)}`` for every weight of an attention module with ``ceil(keep·num_heads)`` heads kept,
    those of largest :func:`head_scores` (ties: lowest index): the Frobenius-nearest point where each head is
    all there or all zero across its q/k/v rows and output-projection columns."""
    heads = _top_mask(head_scores(weights, group), keep_count(keep, group.num_heads))
    out = {}
    for n, blocks in group.rows:
        w = weights[n]
        rows = heads.view(1, -1, 1).expand(blocks, -1, w.shape[0] // (blocks * group.num_heads)).reshape(-1)
        out[n] = (rows.to(w.device), torch.ones(w.shape[1], dtype=torch.bool, device=w.device))
    for n in group.cols:
        w = weights[n]
        cols = heads.repeat_interleave(w.shape[1] // group.num_heads)
        out[n] = (torch.ones(w.shape[0], dtype=torch.bool, device=w.device), cols.to(w.device))
    return out


def read_channels(cols: Tensor, c_in: int) -> Tensor:
    """The input channels a column mask reads (``bool[c_in]``): channel ``c`` counts when ANY of its kernel
    positions is kept. A shape stage can drop some positions of a kept channel, its first one included, and the
    producer filter behind that channel is still read through the others."""
    return cols.view(c_in, -1).any(1)


def coupled_masks(weights: Mapping[str, Tensor], specs: Mapping[str, "StructureSpec"],
                  couplings: Mapping[str, str], streams=(), heads=(), channels=None) -> dict:
    """Masks ``{name: (rows, cols)}`` for every name in ``specs``, with channel pruning coupled along
    ``couplings`` (``{consumer: producer}``, from :func:`prunex_hvd.engine.dependencies.channel_couplings`) and
    ``streams`` (``(readers, writers)`` name tuples, from :func:`prunex_hvd.engine.dependencies.channel_streams`).

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

    ``heads``: attention modules' :class:`~prunex_hvd.engine.dependencies.HeadGroup`, each decided as one group
    (:func:`head_masks`) at its members' ``head:K``; their weights are in no pair or stream.

    ``channels`` (``{name: bool[C_in]}``, e.g. :func:`budget_channels`): input channels decided beforehand, in
    place of those layers' channel stage; such a layer may be in no pair or stream.
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
            if c in specs and p in specs and any(k in ("channel", "feature") for k, _ in parse_spec(specs[c]).parts)}
    twice = [n for n in live if n in stream_cols] + [n for n in live.values() if n in stream_rows]
    if twice:   # a conv's input channels, and its filters, belong to one group each
        raise ValueError(f"{twice[0]} is in a coupled pair and a residual stream on the same side")
    in_heads = {n for g in heads for n in g.members}
    clash = [n for n in (*live, *live.values(), *stream_rows, *stream_cols) if n in in_heads]
    if clash:
        raise ValueError(f"{clash[0]} is in an attention module's head group and in a coupled pair or stream")
    channels = channels or {}
    held = [n for n in channels if n in live or n in stream_cols]
    if held:   # its input channels would be decided twice
        raise ValueError(f"{held[0]}'s input channels are given and also decided by a coupled pair or stream")
    consumer_of = {p: c for c, p in live.items()}
    out: dict = {}
    for group in heads:
        keep = parse_spec(specs[group.members[0]]).keep("head")
        out.update(head_masks(weights, group, keep))
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
                                         channels=stream_cols.get(name, channels.get(name)))
        return out[name]

    for name in specs:
        masks(name)
    return out


def coupled_project(weights: Mapping[str, Tensor], specs: Mapping[str, "StructureSpec"],
                    couplings: Mapping[str, str], streams=(), heads=(), channels=None) -> dict:
    """``{name: W ⊙ mask}`` with the masks of :func:`coupled_masks`."""
    return {name: apply_masks(weights[name], rows, cols)
            for name, (rows, cols) in coupled_masks(weights, specs, couplings, streams, heads, channels).items()}


def masks_to_indices(rows: Tensor, cols: Tensor) -> Tuple[Tensor, Tensor]:
    """The kept row and column numbers, int64, ascending: what :func:`shrink` / :func:`recover` take."""
    return rows.nonzero().flatten(), cols.nonzero().flatten()


def support_mask(weight: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """The bool mask ``rows ⊗ cols`` in ``weight``'s shape (and on its device): the entries a projection keeps."""
    return (rows.to(weight.device)[:, None] & cols.to(weight.device)[None, :]).reshape(weight.shape)


def apply_masks(weight: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """``W ⊙ (rows ⊗ cols)`` as a new tensor of ``weight``'s shape and dtype.

    Uses masked_fill rather than a multiply so dropped entries are exactly 0 even when they hold inf/nan.
    """
    return weight.masked_fill(~support_mask(weight, rows, cols), 0)


def project(weight: Tensor, spec) -> Tensor:
    """Π_S(W): the Frobenius-nearest structured-sparse tensor (exactly so for a single structure kind)."""
    return apply_masks(weight, *structured_masks(weight, parse_spec(spec)))


def density(rows: Tensor, cols: Tensor) -> float:
    """Fraction of GEMM entries kept: ``|rows| * |cols| / (C_out * C_in*KH*KW)``."""
    return int(rows.sum()) * int(cols.sum()) / (rows.numel() * cols.numel())
