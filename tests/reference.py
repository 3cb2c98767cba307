"""A single-process reference of one H-SADMM round over all M×P ranks, written plainly from docs/algorithm.md in
float64 (the engine runs in the model's dtype; tests compare to float tolerance)."""
import math

import torch

from prunex_hvd.engine.sparsity import structured_masks
from prunex_hvd.engine.sparsity.projection import BUDGET_FLOOR

MU, TAU = 10.0, 2.0


def _adapt(rho, primal, dual, rho_max):
    if primal > MU * dual:
        rho *= TAU
    elif dual > MU * primal:
        rho /= TAU
    return min(rho, rho_max)


def _top(score, k):
    order = sorted(range(len(score)), key=lambda c: (-float(score[c]), c))   # ties: lowest index kept
    mask = torch.zeros(len(score), dtype=torch.bool)
    mask[order[:k]] = True
    return mask


def _keep(spec):
    assert str(spec).startswith("channel:") and "+" not in str(spec), spec
    return float(str(spec).split(":")[1])


def _consumer_keep(spec):
    """A coupled consumer's channel keep: its spec is a channel stage, then perhaps a shape stage (a linear
    consumer: a feature stage)."""
    parts = dict(part.split(":") for part in str(spec).split("+"))
    assert set(parts) in ({"channel"}, {"channel", "shape"}, {"feature"}), spec
    return float(parts.get("channel", parts.get("feature")))


def reference_heads(weights, group, keep):
    """An attention module's head masks, written plainly: head h's score is the sum of squares of its rows
    h·d … (h+1)·d − 1 in every q/k/v block and of the same columns of the output projection."""
    h = group.num_heads
    score = [0.0] * h
    for name, blocks in group.rows:
        w = weights[name].double()
        d = w.shape[0] // (blocks * h)
        for b in range(blocks):
            for j in range(h):
                score[j] += float(w[(b * h + j) * d:(b * h + j + 1) * d].pow(2).sum())
    for name in group.cols:
        w = weights[name].double()
        d = w.shape[1] // h
        for j in range(h):
            score[j] += float(w[:, j * d:(j + 1) * d].pow(2).sum())
    kept = _top(score, max(1, math.ceil(keep * h - 1e-9)))
    out = {}
    for name, blocks in group.rows:
        w = weights[name]
        d = w.shape[0] // (blocks * h)
        out[name] = (torch.tensor([bool(kept[(r // d) % h]) for r in range(w.shape[0])]),
                     torch.ones(w.shape[1], dtype=torch.bool))
    for name in group.cols:
        w = weights[name]
        d = w.shape[1] // h
        out[name] = (torch.ones(w.shape[0], dtype=torch.bool),
                     torch.tensor([bool(kept[c // d]) for c in range(w.shape[1])]))
    return out


def reference_budget(weights, specs, floor=BUDGET_FLOOR):
    """One channel budget across the layers held to a plain channel:K / feature:K, written plainly: the budget is
    the per-layer projection's kept weights, sum of ceil(K·C)·m (m = weights in one input channel); each layer
    first keeps its max(1, ceil(floor·C)) channels (at most ceil(K·C)) of largest mean square, then all other
    channels, one list ordered by mean square (ties: layer order, then index), are taken in turn, each kept if
    its weights fit in what the budget has left. ``floor``: the engine's BUDGET_FLOOR unless given."""
    forced, rest, budget = {}, [], 0
    for li, (name, spec) in enumerate(specs.items()):
        if "+" in str(spec) or str(spec).split(":")[0] not in ("channel", "feature"):
            continue
        keep = str(spec).split(":")[1]
        w = weights[name].double()
        c_in = w.shape[1]
        m = w.numel() // c_in
        mean_square = [float(w[:, c].pow(2).sum()) / m for c in range(c_in)]
        k = max(1, math.ceil(float(keep) * c_in - 1e-9))
        first = min(k, max(1, math.ceil(floor * c_in - 1e-9)))
        order = sorted(range(c_in), key=lambda c: (-mean_square[c], c))
        forced[name] = torch.zeros(c_in, dtype=torch.bool)
        forced[name][order[:first]] = True
        budget += (k - first) * m
        rest += [(-mean_square[c], li, c, name, m) for c in order[first:]]
    for _, _, c, name, m in sorted(rest):
        if m <= budget:
            budget -= m
            forced[name][c] = True
    return forced


def reference_masks(weights, specs, couplings, streams=(), heads=(), global_budget=False):
    """Projection supports, written plainly: per layer, except coupled groups (channel-only specs).

    A residual stream (readers, writers) first: input channel c of every reader and filter c of every writer
    are one group ranked by their summed squares. Then a coupled pair: input channel c of the consumer and
    filter c of the producer, ranked by their summed squares, where a producer that reads a stream counts only
    its stream's kept input channels; a consumer's shape stage then runs on its kept channels, and the
    producer keeps the filters of the channels the consumer still reads at any kernel position. A layer's
    other side is its own stages on the weight with the group's zeros in. A linear pair (an MLP) is the same
    with one column per input feature; an attention module's heads are :func:`reference_heads`. ``global_budget``
    (channel_budget="global", no couplings): the input channels of :func:`reference_budget`."""
    in_heads = {n for g in heads for n in g.members}
    out = {name: structured_masks(weights[name], spec) for name, spec in specs.items() if name not in in_heads}
    if global_budget:
        assert not couplings and not streams
        for name, ch in reference_budget(weights, specs).items():
            w = weights[name]
            out[name] = (torch.ones(w.shape[0], dtype=torch.bool), ch.repeat_interleave(w[0].numel() // w.shape[1]))
    for g in heads:
        out.update(reference_heads(weights, g, float(str(specs[g.members[0]]).split(":")[1])))
    rows, chans = {}, {}   # fixed by a group: filters (writers, producers), input channels (readers, consumers)
    consumer_cols = {}
    for readers, writers in streams:
        ws = {n: weights[n].double() for n in readers + writers}
        keeps = {_keep(specs[n]) for n in readers + writers}
        assert len(keeps) == 1, keeps
        score = sum(ws[n].pow(2).sum((0, 2, 3)) for n in readers) + \
            sum(ws[n].pow(2).reshape(ws[n].shape[0], -1).sum(1) for n in writers)
        ch = _top(score, max(1, math.ceil(keeps.pop() * len(score) - 1e-9)))
        rows.update({n: ch for n in writers})
        chans.update({n: ch for n in readers})
    assert not set(couplings) & set(couplings.values()), "chains of pairs are not written out here"
    for consumer, producer in couplings.items():
        # (out, in, kernel positions): a linear weight has one position
        wc = weights[consumer].double().reshape(*weights[consumer].shape[:2], -1)
        wp = weights[producer].double().reshape(*weights[producer].shape[:2], -1)
        if producer in chans:
            wp = wp * chans[producer][None, :, None]
        if consumer in rows:
            wc = wc * rows[consumer][:, None, None]
        score = wc.pow(2).sum((0, 2)) + wp.pow(2).reshape(wp.shape[0], -1).sum(1)
        chans[consumer] = _top(score, max(1, math.ceil(_consumer_keep(specs[consumer]) * wc.shape[1] - 1e-9)))
        consumer_cols[consumer] = structured_masks(weights[consumer], specs[consumer], rows=rows.get(consumer),
                                                   channels=chans[consumer])[1]
        rows[producer] = consumer_cols[consumer].view(wc.shape[1], -1).any(1)
    for name in set(rows) | set(chans):
        w = weights[name]
        r = rows.get(name, torch.ones(w.shape[0], dtype=torch.bool))
        # a layer's own columns (every stage of its spec) where no group fixes its input channels
        cols = consumer_cols[name] if name in consumer_cols else \
            chans[name].repeat_interleave(w[0, 0].numel()) if name in chans else \
            structured_masks(w * r.view(-1, *[1] * (w.dim() - 1)), specs[name])[1]
        out[name] = (r, cols)
    return out


def _rounded_changes(targets, old, errors, payload, support):
    """Per node: q = round(target − old + e) in ``payload`` (float32 arithmetic, as the engine's state), off the
    support nothing; the new error (target − old + e − q on the support). Returns ([q], [new error])."""
    sent, new_errors = [], []
    for target, error in zip(targets, errors):
        delta = target - old + error
        q = delta.to(payload).masked_fill(~support, 0)
        sent.append(q)
        new_errors.append((delta - q.float()).masked_fill(~support, 0))
    return sent, new_errors


def _own_changes(targets, bases, payload, support, anchored):
    """Per sender: q = round(target − base) in ``payload`` on the support (float32 arithmetic, as the engine's
    state), nothing off it, and the new base (base + q on the support); ``anchored``: q is the target itself, in
    float32, and so is the new base. Returns ([q], [new base])."""
    sent, new_bases = [], []
    for target, base in zip(targets, bases):
        q = target.masked_fill(~support, 0) if anchored else (target - base).to(payload).masked_fill(~support, 0)
        sent.append(q)
        new_bases.append(q.clone() if anchored else (base + q.float()).masked_fill(~support, 0))
    return sent, new_bases


def payload_ulp(sent) -> float:
    """One step of the payload's dtype at the largest value sent: how far one value rounded the other way
    (the engine forms z_i in float32, this reference in float64) can move z or an error."""
    biggest = max(float(q.float().abs().max()) for q in sent)
    return biggest * torch.finfo(sent[0].dtype).eps


def _payload_sum(sent):
    """The payloads added up as the transports do it: in node order in the payload's dtype (each add rounded
    once)."""
    total = sent[0].clone()
    for q in sent[1:]:
        total.add_(q)
    return total


def _payload_average(sent):
    """The leaders' average of their payloads: :func:`_payload_sum` divided by M, then widened."""
    return _payload_sum(sent).div_(len(sent)).float()


def _rack_steps(name, states, node_ranks, racks, z_i, v, z_old, support, payload, anchored, out):
    """The rack and global steps of one entry, on the global ``support``: w_r = (ρ2·Σ_{i∈r}(z_i + v_i) +
    ρ3·(z − t_r)) / (N·ρ2 + ρ3), z = mean_r(w_r + t_r). With a narrow ``payload`` each sum travels as its
    senders' rounded changes against their own bases: z_i + v_i − s_i (node leaders, ``sent``; the rack's sum
    recovered from its ``rack_sum``), w_r + t_r − s_r (rack leaders, ``sent_spine``); ``anchored``: whole values
    in float32. The new bases, rack sums and the payload step go into ``out``. Returns (w, t, w_old per rack,
    z)."""
    d = lambda x: x.double()  # noqa: E731
    rho2, rho3, N = states[0]["rho2"][name], states[0]["rho3"][name], len(racks[0])
    leader = [node_ranks[nodes[0]][0] for nodes in racks]   # a rank of the rack, holding its w_r and t_r
    t = [d(states[r]["t"][name]) for r in leader]
    w_old = [d(states[r]["w"][name]) for r in leader]
    on = support.bool()
    if payload is None:
        sums = [support * sum(z_i[i] + v[i] for i in nodes) for nodes in racks]
    else:
        sums, out["sent"][name], out["rack_sum"][name], ulps = [], [None] * len(node_ranks), [], []
        for k, nodes in enumerate(racks):
            sent, bases = _own_changes([(z_i[i] + v[i]).float() for i in nodes],
                                       [states[node_ranks[i][0]]["sent"][name] for i in nodes], payload, on, anchored)
            for i, base in zip(nodes, bases):
                out["sent"][name][i] = base
            rack_sum = _payload_sum(sent).float()
            if not anchored:
                rack_sum = rack_sum + states[leader[k]]["rack_sum"][name].masked_fill(~on, 0)
            out["rack_sum"][name].append(rack_sum)
            sums.append(d(rack_sum))
            ulps.append(payload_ulp(sent))
    w = [support * (rho2 * sums[k] + rho3 * (z_old - t[k])) / (N * rho2 + rho3) for k in range(len(racks))]
    if payload is None:
        return w, t, w_old, torch.stack([w[k] + t[k] for k in range(len(racks))]).mean(0) * support
    sent, out["sent_spine"][name] = _own_changes([(w[k] + t[k]).float() for k in range(len(racks))],
                                                 [states[r]["sent_spine"][name] for r in leader], payload, on,
                                                 anchored)
    out["ulp"][name] = max(ulps + [payload_ulp(sent)])
    return w, t, w_old, d(_payload_average(sent) + (0 if anchored else states[0]["z"][name].masked_fill(~on, 0)))


def reference_round(states, node_ranks, specs, rho_max, adaptive=True, freezes=False, couplings=None, streams=(),
                    restart="none", payload=None, anchored=False, racks=None, heads=(), global_budget=False):
    """``states[r]``: rank r's snapshot before the round (theta, u, z_i, v, z, rho1, rho2, masks, buffers,
    frozen). Returns the expected state after it: u per rank, z_i / v per node, z, rho, masks, buffers, and θ
    per rank (where ``restart="global"`` moves it to z). ``adaptive``: residual balancing of ρ1, ρ2 and ρ3.
    ``freezes``: the masks freeze at the end of this round, cut to the requested structure from z. ``payload``
    (a torch dtype narrower than float32, M > 1): what the leaders send is rounded(z_i + v_i − s_i) on the
    support, s_i their base (``sent`` in the states, returned updated: s_i + q), added up in node order in the
    payload's dtype, averaged, and added to z_old; the float buffers as their change against ``round_buffers``
    with error feedback (``buffer_ef``). ``anchored``: whole values in float32 instead, every base and error
    starting again from them. ``racks`` (the nodes of every rack; docs/algorithm.md, "A third tier: racks"):
    three tiers, z_i answering to its rack's w_r (``w``, ``t``, ``rho3`` in the states, returned per rack).
    ``global_budget``: the projections keep the channels of one budget across layers (:func:`reference_budget`)."""
    M, P = len(node_ranks), len(node_ranks[0])
    node_of = {r: i for i, ranks in enumerate(node_ranks) for r in ranks}
    rack_of = {i: k for k, nodes in enumerate(racks or ()) for i in nodes}
    assert restart in ("none", "global"), restart
    frozen = states[0]["frozen"]
    out = {"u": [{} for _ in states], "z_i": [{} for _ in range(M)], "v": [{} for _ in range(M)], "z": {},
           "rho1": {}, "rho2": {}, "masks": {}, "sent_masks": {}, "node_masks": {}, "buffers": {}, "residuals": {},
           "sent": {}, "buffer_ef": {}, "ulp": {}, "w": [{} for _ in racks or ()], "t": [{} for _ in racks or ()],
           "rho3": {}, "sent_spine": {}, "rack_sum": {}, "buffer_ef_spine": {}}
    d = lambda t: t.double()  # noqa: E731
    couplings = couplings or {}
    cands = {}
    for name in states[0]["theta"]:
        rho1, rho2 = states[0]["rho1"][name], states[0]["rho2"][name]
        z_old = d(states[0]["z"][name])
        cands[name] = []
        for i, ranks in enumerate(node_ranks):
            node_sum = sum(d(states[r]["theta"][name]) + d(states[r]["u"][name]) for r in ranks)
            upper = d(states[ranks[0]]["w"][name]) if racks else z_old   # the consensus z_i answers to
            cands[name].append((rho1 * node_sum + rho2 * (upper - d(states[ranks[0]]["v"][name]))) / (P * rho1 + rho2))
    projected = [reference_masks({n: cands[n][i].float() for n in specs}, specs, couplings, streams, heads,
                                 global_budget) for i in range(M)]
    for name in states[0]["theta"]:
        rho1, rho2 = states[0]["rho1"][name], states[0]["rho2"][name]
        z_old = d(states[0]["z"][name])
        z_i, node_masks = [], []
        for i, ranks in enumerate(node_ranks):
            cand = cands[name][i]
            if name in specs:
                rows, cols = states[ranks[0]]["masks"][name] if frozen else projected[i][name]
                cand = cand * torch.outer(rows, cols).reshape(cand.shape)
                node_masks.append((rows, cols))
            z_i.append(cand)
        support = torch.ones_like(z_old)
        if name in specs:
            rows = torch.stack([m[0] for m in node_masks]).any(0)
            cols = torch.stack([m[1] for m in node_masks]).any(0)
            out["masks"][name] = out["sent_masks"][name] = (rows, cols)
            out["node_masks"][name] = node_masks   # each node's own, before the OR
            support = torch.outer(rows, cols).reshape(z_old.shape).double()
        v = [d(states[ranks[0]]["v"][name]) for ranks in node_ranks]
        if racks:
            w, t, w_old, z = _rack_steps(name, states, node_ranks, racks, z_i, v, z_old, support, payload, anchored,
                                         out)
            upper = [w[rack_of[i]] for i in range(M)]
        elif payload is None:
            z = torch.stack([z_i[i] + v[i] for i in range(M)]).mean(0) * support
        else:
            sent, out["sent"][name] = _own_changes([(z_i[i] + v[i]).float() for i in range(M)],
                                                   [states[ranks[0]]["sent"][name] for ranks in node_ranks],
                                                   payload, support.bool(), anchored)
            z = d(_payload_average(sent) + (0 if anchored else states[0]["z"][name].masked_fill(~support.bool(), 0)))
            out["ulp"][name] = payload_ulp(sent)
        # consensus ADMM (Boyd et al. §7.1): every copy counts on both sides. The copies of z_i are the M·P
        # ranks' θ (each rank's own z_i moved), the copies of z are the M nodes' z_i.
        r_intra = math.sqrt(sum(float((d(states[r]["theta"][name]) - z_i[node_of[r]]).pow(2).sum())
                                for r in range(len(states))))
        s_intra = rho1 * math.sqrt(sum(float((z_i[node_of[r]] - d(states[r]["z_i"][name])).pow(2).sum())
                                       for r in range(len(states))))
        if not racks:
            upper = [z] * M
        r_inter = math.sqrt(sum(float((z_i[i] - upper[i]).pow(2).sum()) for i in range(M)))
        if racks:   # ρ2's tier: nodes against their rack (N copies of each w_r); ρ3's: racks against z
            N, R = len(racks[0]), len(racks)
            s_inter = rho2 * math.sqrt(sum(N * float((w[k] - w_old[k]).pow(2).sum()) for k in range(R)))
            r_spine = math.sqrt(sum(float((w[k] - z).pow(2).sum()) for k in range(R)))
            s_spine = states[0]["rho3"][name] * math.sqrt(R * float((z - z_old).pow(2).sum()))
        else:
            s_inter = rho2 * math.sqrt(sum(float((z - z_old).pow(2).sum()) for _ in range(M)))
        new1 = _adapt(rho1, r_intra, s_intra, rho_max) if adaptive else rho1
        # one node: no inter-node tier to balance (r_inter is 0 by construction)
        new2 = _adapt(rho2, r_inter, s_inter, rho_max) if adaptive and M > 1 else rho2
        if racks:
            rho3 = states[0]["rho3"][name]
            new3 = _adapt(rho3, r_spine, s_spine, rho_max) if adaptive else rho3
            out["rho3"][name] = new3
            for k in range(len(racks)):
                out["w"][k][name] = w[k].float()
                out["t"][k][name] = ((t[k] + w[k] - z) * (rho3 / new3)).float()
        for i in range(M):
            out["z_i"][i][name] = z_i[i].float()
            out["v"][i][name] = ((v[i] + z_i[i] - upper[i]) * (rho2 / new2)).float()
        for r, s in enumerate(states):
            out["u"][r][name] = ((d(s["u"][name]) + d(s["theta"][name]) - z_i[node_of[r]]) * (rho1 / new1)).float()
        out["z"][name] = z.float()
        out["rho1"][name], out["rho2"][name] = new1, new2
        out["residuals"][name] = (r_intra, s_intra) + ((r_inter, s_inter) if M > 1 else ()) + \
            ((r_spine, s_spine) if racks else ())
    if freezes:
        for name, (rows, cols) in reference_masks({n: out["z"][n] for n in specs}, specs, couplings,
                                                  streams, heads, global_budget).items():
            out["masks"][name] = (rows, cols)
            out["z"][name] = out["z"][name] * torch.outer(rows, cols).reshape(out["z"][name].shape)
            for w in out["w"]:   # with racks, w_r is cut to the frozen structure as z is
                w[name] = w[name] * torch.outer(rows, cols).reshape(w[name].shape)
    for name in states[0]["buffers"]:
        if payload is None:
            out["buffers"][name] = torch.stack([d(s["buffers"][name]) for s in states]).mean(0).float()
            continue
        node_means = [torch.stack([d(states[r]["buffers"][name]) for r in ranks]).mean(0).float()
                      for ranks in node_ranks]
        ones = torch.ones_like(node_means[0], dtype=torch.bool)
        if anchored:   # whole means in float32 (each rack's mean of its nodes', then the mean over racks)
            means = [_payload_sum([node_means[i] for i in nodes]) / len(nodes) for nodes in racks] if racks \
                else node_means
            out["buffers"][name] = _payload_average(means)
            out["buffer_ef"][name] = [torch.zeros_like(m) for m in node_means]
            out["buffer_ef_spine"][name] = [torch.zeros_like(m) for m in means] if racks else None
            out["ulp"]["buffer " + name] = payload_ulp(node_means)
            continue
        sent, out["buffer_ef"][name] = _rounded_changes(
            node_means, states[0]["round_buffers"][name], [states[ranks[0]]["buffer_ef"][name] for ranks in node_ranks],
            payload, ones)
        if racks:   # each rack's mean change, rounded again (with the rack leader's error) across the spine
            changes = [_payload_sum([sent[i] for i in nodes]).float() / len(nodes) for nodes in racks]
            rack_ulp = payload_ulp(sent)
            sent, out["buffer_ef_spine"][name] = _rounded_changes(
                changes, torch.zeros_like(changes[0]),
                [states[node_ranks[nodes[0]][0]]["buffer_ef_spine"][name] for nodes in racks], payload, ones)
            out["ulp"]["buffer " + name] = max(rack_ulp, payload_ulp(sent))
        out["buffers"][name] = states[0]["round_buffers"][name] + _payload_average(sent)
        out["ulp"]["buffer " + name] = payload_ulp(sent)
    # where θ starts the next local steps: the consensus (after the freeze's cut), or where the steps left it
    out["theta"] = [{name: out["z"][name] if restart == "global" else s["theta"][name] for name in s["theta"]}
                    for s in states]
    return out
