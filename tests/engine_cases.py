"""What the engine's multi-rank checks share, whether the ranks are processes under a launcher
(workers/engine_worker.py, run by test_engine_launch.py) or threads of one process (test_engine_threads.py):
the models and training settings, per-rank snapshots, the round-by-round comparison with
:func:`reference.reference_round`, and the checks of every rank's result (bytes, final structure)."""
import copy
import json
import math

import torch
import torch.nn as nn

from prunex_hvd.engine.config import ConsensusConfig
from prunex_hvd.engine.sparsity.projection import BUDGET_FLOOR
from reference import MU, reference_round

ROUNDS, LOCAL_STEPS = 4, 3
# what every engine case trains with; freeze_round=3 of 4 rounds leaves one round on frozen masks
SETTINGS = dict(rho1=0.05, rho2=0.02, rho_max=10.0, adaptive_rho=True, freeze_round=3, freeze_patience=3,
                bucket_mb=0.002)   # tiny buckets: every round packs several
FLOAT_BYTES = 4   # the models are float32


def paper_config(**knobs):
    """The round the engine cases check unless they say otherwise: the paper's (every rank stepping alone, z in
    the model's dtype, each layer its own channel count) restarting at z, with :data:`SETTINGS`; ``knobs`` on
    top."""
    return ConsensusConfig.paper(**{**SETTINGS, "restart": "global", **knobs})


# the specs each case resolves to, by parameter name
CHANNEL = {"0.weight": "channel:0.5", "3.weight": "channel:0.5"}
MIXED_SPARSITY = {"3.*": "filter:0.5+channel:0.5", "0.weight": "shape:0.5"}
MIXED = {"3.weight": "filter:0.5+channel:0.5", "0.weight": "shape:0.5"}
PAIR = {"3.weight": "0.weight"}   # coupled=True on the chain: conv 3 reads conv 0's channels
# a coupled consumer whose shape stage drops whole kernel positions: its producer must keep every channel it reads
SHAPED_CONSUMER = {"0.weight": "channel:0.5", "3.weight": "channel:0.5+shape:0.2"}
RESIDUAL = {f"{n}.weight": "channel:0.5" for n in ("stem", "a", "b", "c", "d")}
RESIDUAL_PAIR = {"b.weight": "a.weight"}
STREAM = [(("a.weight", "c.weight", "d.weight"), ("b.weight", "stem.weight"))]


class Residual(nn.Module):
    """A residual stream: written by the stem and by b (after a -> b, a coupled pair), read by a, c and the
    shortcut d; c + d is the head's stream (a linear reads it, so it is not coupled)."""

    def __init__(self):
        super().__init__()
        bn = nn.BatchNorm2d
        self.stem, self.bn0 = nn.Conv2d(3, 8, 3, padding=1), bn(8)
        self.a, self.bna, self.b, self.bnb = nn.Conv2d(8, 6, 3, padding=1), bn(6), nn.Conv2d(6, 8, 3, padding=1), bn(8)
        self.c, self.bnc, self.d, self.bnd = nn.Conv2d(8, 10, 3, padding=1), bn(10), nn.Conv2d(8, 10, 1), bn(10)
        self.head = nn.Linear(10, 5)

    def forward(self, x):
        s = torch.relu(self.bn0(self.stem(x)))
        s = torch.relu(self.bnb(self.b(torch.relu(self.bna(self.a(s))))) + s)
        t = torch.relu(self.bnc(self.c(s)) + self.bnd(self.d(s)))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(t, 1), 1))


# beyond convs: a ViT block (separate q/k/v) and nn.MultiheadAttention (packed), each with an MLP
VIT_HEADS = {f"blocks.0.attn.{n}.weight": "head:0.5" for n in ("q", "k", "v", "proj")}
VIT = dict(VIT_HEADS, **{"blocks.0.mlp.fc1.weight": "neuron:0.5"})
VIT_COUPLED = dict(VIT, **{"blocks.0.mlp.fc2.weight": "feature:0.5"})
VIT_PAIR = {"blocks.0.mlp.fc2.weight": "blocks.0.mlp.fc1.weight"}
MHA_COUPLED = {"attn.in_proj_weight": "head:0.5", "attn.out_proj.weight": "head:0.5", "fc1.weight": "neuron:0.5",
               "fc2.weight": "feature:0.5"}
MHA_PAIR = {"fc2.weight": "fc1.weight"}


class MhaNet(nn.Module):
    """Patches → nn.MultiheadAttention (packed in_proj_weight) → an MLP, each residual → mean → a linear head."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 2, stride=2)
        self.attn = nn.MultiheadAttention(8, 4, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(8, 12), nn.Linear(12, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = x + self.attn(x, x, x, need_weights=False)[0]
        x = x + self.fc2(nn.functional.gelu(self.fc1(x)))
        return self.head(x.mean(1))


def make_model(kind="chain", rank=0):
    """The same model on every rank, except that ranks other than 0 are moved off it, each its own way:
    construction must broadcast rank 0's. Seeds torch's global RNG (threads: call it before they start)."""
    torch.manual_seed(1234)
    if kind == "residual":
        model = Residual()
    elif kind in ("vit", "vit-even"):
        from prunex_hvd.app.models.vit import VisionTransformer
        model = VisionTransformer(num_classes=5, patch=2, dim=8, depth=1, num_heads=4, max_image_size=6)
        if kind == "vit-even":
            even_groups(model.blocks[0])
    elif kind == "mha":
        model = MhaNet()
    else:
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                              nn.Conv2d(8, 12, 3, padding=1), nn.BatchNorm2d(12), nn.ReLU(),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(12, 5))
    if rank != 0:
        g = torch.Generator().manual_seed(rank)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g))
    return model


@torch.no_grad()
def even_groups(block, heads=4):
    """Every head (its rows of q/k/v and columns of proj) and every MLP hidden unit (fc1 row, fc2 column) scaled
    to the same norm: the nodes' few steps, on their own data, then decide which are kept, and they disagree."""
    def even(w, dim, groups):
        parts = w.view(groups, -1, w.shape[1]) if dim == 0 else w.view(w.shape[0], groups, -1)
        norms = parts.square().sum((1, 2) if dim == 0 else (0, 2)).sqrt()
        parts.mul_((norms.mean() / norms).view((-1, 1, 1) if dim == 0 else (1, -1, 1)))
    for name in ("q", "k", "v"):
        even(getattr(block.attn, name).weight, 0, heads)
    even(block.attn.proj.weight, 1, heads)
    even(block.mlp.fc1.weight, 0, block.mlp.fc1.weight.shape[0])
    even(block.mlp.fc2.weight, 1, block.mlp.fc2.weight.shape[1])


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)


def rank_batch(rank, device="cpu"):
    """Rank ``rank``'s own data (its own generator: different on every rank, safe in threads)."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(16, 3, 6, 6, generator=g)
    y = torch.randint(0, 5, (16,), generator=g)
    return x.to(device), y.to(device)


def local_steps(model, step, x, y, steps=LOCAL_STEPS):
    """``steps`` training steps on one batch; ``step()`` is the (wrapped) optimizer's step."""
    for _ in range(steps):
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        step()


AMP_PATTERNS = ("scaler.step", "horovod", "unscale-first")


def amp_step(model, opt, scaler, x, y, bad=None, pattern="scaler.step", device="cpu"):
    """One training step under autocast (bfloat16 on CPU, float16 on CUDA) and ``scaler``; ``bad`` (inf or NaN)
    written into one gradient after backward. ``pattern``: ``scaler.step`` alone; ``horovod``, Horovod's AMP
    example (``synchronize()``, ``unscale_``, ``step`` under ``skip_synchronize()``); ``unscale-first``, the
    same with ``unscale_`` before ``synchronize()``."""
    opt.zero_grad()
    with torch.autocast(device, dtype=torch.bfloat16 if device == "cpu" else torch.float16):
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
    scaler.scale(loss).backward()
    if bad is not None:
        next(model.parameters()).grad.view(-1)[0] = bad
    if pattern == "scaler.step":
        scaler.step(opt)
    else:
        for call in ((opt.synchronize, lambda: scaler.unscale_(opt)) if pattern == "horovod"
                     else (lambda: scaler.unscale_(opt), opt.synchronize)):
            call()
        with opt.skip_synchronize():
            scaler.step(opt)
    scaler.update()


def amp_local_steps(model, opt, scaler, x, y, steps, first_step, inf_steps, pattern="scaler.step"):
    """``local_steps`` by :func:`amp_step`, an inf in a gradient at the global steps in ``inf_steps`` (counted
    from ``first_step``). Returns, per step, whether θ moved."""
    moved = []
    for j in range(first_step, first_step + steps):
        before = [p.detach().clone() for p in model.parameters()]
        amp_step(model, opt, scaler, x, y, float("inf") if j in inf_steps else None, pattern)
        moved.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters())))
    return moved


def run_with_snapshot(eng, model, opt, rank, total, take_at=None, saved=None):
    """One rank's run to step ``total``, a round every ``LOCAL_STEPS`` steps, then finalize(): resumed from
    ``saved`` (this rank's snapshot at step ``take_at``) if given, else from the start, taking a snapshot (model,
    optimizer, ``eng.state_dict()``) at step ``take_at`` if given. Returns (the final model state, the engine's
    bytes, the snapshot)."""
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        eng.load_state_dict(saved["engine"])
    x, y = rank_batch(rank)
    snap = None

    def step():   # what the wrapped optimizer's step() does
        eng.sync_node_grads()
        eng.add_proximal_grad()
        opt.step()
        eng.after_step()
    for t in range(take_at if saved is not None else 0, total):
        if saved is None and t == take_at:
            snap = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
                    "engine": eng.state_dict()}
        local_steps(model, step, x, y, 1)
        if (t + 1) % LOCAL_STEPS == 0:
            eng.consensus_round(steps=t + 1)
    eng.finalize()
    return model_state(model), dict(eng.bytes), snap


def model_state(model):
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def assert_same_everywhere(states, when):
    """Every rank's ``model_state`` is bit-identical to rank 0's."""
    for k in states[0]:
        assert all(torch.equal(s[k], states[0][k]) for s in states), f"{k} differs {when}"


def snapshot(eng):
    """One rank's engine state, as ``reference_round`` takes it."""
    return {"theta": {e.name: e.param.detach().cpu().clone() for e in eng.entries},
            "u": {e.name: e.u.cpu().clone() for e in eng.entries},
            "z_i": {e.name: e.z_i.cpu().clone() for e in eng.entries},
            "v": {e.name: e.v.cpu().clone() for e in eng.entries},
            "z": {e.name: e.z.cpu().clone() for e in eng.entries},
            "rho1": {e.name: e.rho1 for e in eng.entries}, "rho2": {e.name: e.rho2 for e in eng.entries},
            "masks": {e.name: (e.rows.cpu().clone(), e.cols.cpu().clone()) for e in eng.structured},
            "buffers": {n: b.detach().cpu().clone() for n, b in eng.state.buffers},
            "round_buffers": {n: b.cpu().clone() for (n, _), b in zip(eng.state.buffers, eng.state.round_buffers)},
            "sent": {e.name: e.sent.cpu().clone() for e in eng.entries if e.sent is not None},
            "round": eng.state.round, "anchored_at": eng.state.anchored_at,
            "buffer_ef": {n: ef.cpu().clone() for (n, _), ef in zip(eng.state.buffers, eng.state.buffer_ef)},
            "frozen": eng.frozen,
            # three tiers (racks): the rank's rack consensus, its dual and ρ3
            "w": {e.name: e.w.cpu().clone() for e in eng.entries if e.w is not None},
            "t": {e.name: e.t.cpu().clone() for e in eng.entries if e.t is not None},
            "rho3": {e.name: e.rho3 for e in eng.entries},
            "sent_spine": {e.name: e.sent_spine.cpu().clone() for e in eng.entries if e.sent_spine is not None},
            "rack_sum": {e.name: e.rack_sum.cpu().clone() for e in eng.entries if e.rack_sum is not None},
            "buffer_ef_spine": {n: ef.cpu().clone() for (n, _), ef in zip(eng.state.buffers, eng.state.buffer_ef_spine)}}


def compare(name, got, want, rtol=1e-4, atol=1e-6, ulp=None):
    """``ulp`` (a narrow payload's step at its largest value): a few values may sit one rounding step away
    (the reference forms z_i in float64, the engine in float32, so a value near a rounding boundary can round
    the other way), never more than that step, and never many (an error fed back wrongly moves most)."""
    if ulp is not None:
        off = ~torch.isclose(got, want, rtol=rtol, atol=atol)
        assert int(off.sum()) <= max(2, off.numel() // 50), f"{name}: {int(off.sum())} of {off.numel()} values differ"
        assert float((got - want).abs().max()) <= 1.01 * ulp + atol, \
            f"{name}: off by {float((got - want).abs().max()):.3g}, more than one payload step {ulp:.3g}"
        return
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def global_budget(config):
    """Whether the config counts channels in one budget across layers (the reference's ``global_budget``)."""
    return config.channel_budget == "global"


def expected_round(rnd, before, after, node_ranks, eng):
    """The reference round over all ranks' states before round ``rnd``, under ``eng``'s settings."""
    c = eng.config
    specs = {e.name: e.spec for e in eng.structured}
    return reference_round(before, node_ranks, specs, rho_max=c.rho_max, adaptive=c.adaptive_rho,
                           freezes=after[0]["frozen"] and not before[0]["frozen"],
                           couplings=eng.masks.couplings, streams=eng.masks.streams, restart=c.restart,
                           payload=eng.state.payload_dtype if eng.state.delta_coded else None,
                           anchored=anchored(before[0], eng),
                           racks=[list(r) for r in eng.state.topo.racks] if eng.state.rack_tier else None, heads=eng.masks.heads,
                           global_budget=global_budget(c))


def anchored(before, eng):
    """Whether a narrow payload's round from the state ``before`` (a snapshot) sends whole values."""
    from prunex_hvd.engine.codec import ANCHOR_EVERY
    return eng.state.delta_coded and (before["anchored_at"] is None
                                      or before["round"] - before["anchored_at"] >= ANCHOR_EVERY)


def in_exact_agreement(want, name, tier):
    """Whether ``tier`` ("inter": r/s_inter, "spine": r/s_spine) of ``name`` is in exact agreement in the reference
    round ``want``, its residuals under 1e-6: a conv bias before BatchNorm has no gradient, and without a ridge
    nothing pulls z off it. Residual balancing there weighs float32 noise against noise, so that tier's ρ may
    step either way."""
    first = {"inter": 2, "spine": 4}[tier]
    return max(want["residuals"][name][first:first + 2]) < 1e-6


def rho1_on_rounding(want, name):
    """Whether the reference round ``want``'s ρ1 decision for ``name`` rests on float32 rounding: θ agrees with
    z_i to under 1e-6 (a conv bias before BatchNorm has no data gradient; only the optimizer's weight decay moves
    it off z_i between rounds) and one residual is within a quarter of μ times the other, where the engine's
    float32 residuals may tip the balance either way."""
    r, s = want["residuals"][name][:2]
    return r < 1e-6 and any(MU / 1.25 < a / b < MU * 1.25 for a, b in ((s, r), (r, s)) if b > 0)


def check_round(rnd, before, after, node_ranks, eng, want=None, theta=True, buffers=True):
    """Every rank's state after round ``rnd`` (``after[r]``, θ included unless ``theta=False``) against the
    reference round over all ranks' states before it (``want``, :func:`expected_round` by default); ``eng`` (any
    rank's engine) gives the settings; ``buffers=False`` leaves the float buffers (and their rounding errors) to
    the caller. Returns what the round sent, for :func:`check_results`: whether the masks were frozen before
    it, and the compact (rows, cols) per layer."""
    want = want or expected_round(rnd, before, after, node_ranks, eng)
    node_of = {r: i for i, ranks in enumerate(node_ranks) for r in ranks}
    rack_of = {i: k for k, nodes in enumerate(eng.state.topo.racks) for i in nodes} if eng.state.rack_tier else None
    for r, got in enumerate(after):
        node = node_of[r]
        for name in got["w"] if rack_of else ():   # every rank of a rack holds its w_r, t_r
            ulp = want["ulp"].get(name)
            compare(f"round {rnd} rank {r} w[{name}]", got["w"][name], want["w"][rack_of[node]][name], ulp=ulp)
            compare(f"round {rnd} rank {r} t[{name}]", got["t"][name], want["t"][rack_of[node]][name], ulp=ulp)
            assert got["rho3"][name] == want["rho3"][name] or in_exact_agreement(want, name, "spine"), \
                (rnd, r, name, got["rho3"][name], want["rho3"][name])
        assert bool(got["w"]) == bool(rack_of), f"rank {r}: rack state {'missing' if rack_of else 'unexpected'}"
        for name in got["theta"]:
            ulp = want["ulp"].get(name)   # a narrow payload: z (and so v, θ after a restart) may round apart
            # where a ρ decision rests on rounding (allowed below) the scaled dual follows the engine's ρ: the
            # unscaled one, ρ·u, is what must agree
            u_scale = want["rho1"][name] / got["rho1"][name]
            v_scale = want["rho2"][name] / got["rho2"][name]
            compare(f"round {rnd} rank {r} u[{name}]", got["u"][name], want["u"][r][name] * u_scale)
            compare(f"round {rnd} rank {r} z_i[{name}]", got["z_i"][name], want["z_i"][node][name])
            compare(f"round {rnd} rank {r} v[{name}]", got["v"][name], want["v"][node][name] * v_scale, ulp=ulp)
            compare(f"round {rnd} rank {r} z[{name}]", got["z"][name], want["z"][name], ulp=ulp)
            if theta:
                compare(f"round {rnd} rank {r} theta[{name}]", got["theta"][name], want["theta"][r][name], ulp=ulp)
            assert got["rho1"][name] == want["rho1"][name] or rho1_on_rounding(want, name), \
                (rnd, r, name, got["rho1"][name], want["rho1"][name], want["residuals"][name])
            assert got["rho2"][name] == want["rho2"][name] or in_exact_agreement(want, name, "inter"), \
                (rnd, r, name, got["rho2"][name], want["rho2"][name], want["residuals"][name])
        for name, (rows, cols) in got["masks"].items():
            assert torch.equal(rows, want["masks"][name][0]) and torch.equal(cols, want["masks"][name][1]), \
                (rnd, r, name)
        for name in got["buffers"] if buffers else ():
            compare(f"round {rnd} rank {r} buffer {name}", got["buffers"][name], want["buffers"][name],
                    ulp=want["ulp"].get("buffer " + name))
        if eng.state.delta_coded:   # the leaders' bases and the buffers' errors; nobody else keeps one
            leader = r == node_ranks[node][0]
            rack_leader = rack_of is not None and r == node_ranks[eng.state.topo.racks[rack_of[node]][0]][0]
            for key in ("sent", "buffer_ef") if buffers else ("sent",):
                for name, kept in got[key].items():
                    compare(f"round {rnd} rank {r} {key}[{name}]", kept,
                            want[key][name][node] if leader else torch.zeros_like(kept),
                            ulp=want["ulp"][name if key == "sent" else "buffer " + name])
            for key in (("sent_spine", "buffer_ef_spine") if buffers else ("sent_spine",)) if rack_of else ():
                for name, kept in got[key].items():   # the rack leaders', across the spine
                    compare(f"round {rnd} rank {r} {key}[{name}]", kept,
                            want[key][name][rack_of[node]] if rack_leader else torch.zeros_like(kept),
                            ulp=want["ulp"][name if key == "sent_spine" else "buffer " + name])
            for name, kept in got["rack_sum"].items() if rack_of else ():   # every rank of the rack
                compare(f"round {rnd} rank {r} rack_sum[{name}]", kept, want["rack_sum"][name][rack_of[node]],
                        ulp=want["ulp"][name])
    return {"frozen_before": before[0]["frozen"], "anchored": anchored(before[0], eng),
            "compact": {n: [int(r.sum()), int(c.sum())] for n, (r, c) in want["sent_masks"].items()},
            # the layers whose nodes chose different masks this round: the OR had work to do
            "nodes_differ": sorted(n for n, masks in want["node_masks"].items()
                                   if any(not (torch.equal(m[0], masks[0][0]) and torch.equal(m[1], masks[0][1]))
                                          for m in masks))}


def theta_of(model):
    """θ and the float buffers (BatchNorm statistics) of a model, by name."""
    return {n: t.detach().cpu().clone() for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if t.is_floating_point()}


def prox_gradient(eng):
    """The proximal gradient the engine would add now to a zero data gradient (no collective)."""
    params = [e.param for e in eng.entries]
    saved = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    eng.add_proximal_grad()
    out = {e.name: e.param.grad.detach().cpu().clone() for e in eng.entries}
    for p, g in zip(params, saved):
        p.grad = g
    return out


def overlapped_rounds(eng, model, step, x, y, consensus, rounds=ROUNDS, steps=LOCAL_STEPS):
    """``overlap``: ``rounds`` rounds of one rank, recording what :func:`check_overlapped_round` reads: the state
    when each round starts, once it is folded in (where the engine folds it: at the next round, or after
    ``config.overlap_steps`` of its local steps), θ and the buffers just before that fold and the local step it
    came after, and θ with the proximal gradient while it is in flight; ``consensus()`` runs a round and returns
    its report."""
    rec = {"before": [], "after": [], "pre_fold": [], "fold_step": [], "launched": [], "reports": [],
           "folded_prox": []}
    count = {"steps": 0}
    fold = eng.overlap.fold

    def watched_fold():
        rec["pre_fold"].append(theta_of(model))
        rec["fold_step"].append(count["steps"])
        out = fold()
        rec["after"].append(snapshot(eng))
        rec["folded_prox"].append(prox_gradient(eng))   # what the steps after the fold add
        return out
    eng.overlap.fold = watched_fold

    def counted_step():   # counted first: a fold inside step j (after_step) comes after j steps
        count["steps"] += 1
        step()
    for rnd in range(rounds):
        count["steps"] = 0
        local_steps(model, counted_step, x, y, steps)
        pending = eng.overlap.in_flight is not None   # folded in by consensus(), just before this round starts
        if not pending:
            rec["before"].append(snapshot(eng))
        rec["reports"].append(consensus())
        if pending:
            rec["before"].append(rec["after"][-1])
        elif eng.overlap.in_flight is None:   # a blocking round (before the masks freeze)
            rec["after"].append(snapshot(eng))
            rec["pre_fold"].append(None)
            rec["fold_step"].append(None)
            rec["folded_prox"].append(None)
        rec["launched"].append({"theta": theta_of(model), "prox": prox_gradient(eng), "in_flight": eng.overlap.in_flight is not None})
    count["steps"] = 0   # the last round is folded in by complete(), with no steps after it
    eng.complete()
    eng.overlap.fold = fold
    return rec


def check_overlapped_rounds(recs, node_ranks, eng, rounds=ROUNDS):
    """Every round of :func:`overlapped_rounds`' records: an overlapped one (the masks frozen when it starts)
    against the delayed math, a blocking one (before the masks freeze) against the blocking round's. Returns the
    summaries."""
    out = []
    for rnd in range(rounds):
        overlapped = len(node_ranks) > 1 and recs[0]["before"][rnd]["frozen"]
        assert all(rec["launched"][rnd]["in_flight"] == overlapped for rec in recs), (rnd, overlapped)
        if overlapped:
            out.append(check_overlapped_round(rnd, recs, node_ranks, eng))
        else:
            out.append(check_round(rnd, [rec["before"][rnd] for rec in recs], [rec["after"][rnd] for rec in recs],
                                   node_ranks, eng))
    return out


def expected_prox(state, name, theta, z_i, u):
    """ρ1(θ − z_i + u) at ``state``'s ρ1 (a snapshot), on the frozen structure once its masks are frozen: what
    :func:`prox_gradient` reads from the engine."""
    prox = state["rho1"][name] * (theta.double() - z_i.double() + u.double())
    if state["frozen"] and name in state["masks"]:
        prox = prox * torch.outer(*state["masks"][name]).reshape(prox.shape)
    return prox.float()


def check_overlapped_round(rnd, recs, node_ranks, eng):
    """The delayed math (docs/algorithm.md, "Overlapped rounds") for round ``rnd``, from every rank's
    :func:`overlapped_rounds` record: once folded in, u, z_i, v, z, ρ, masks and buffers are the blocking round's
    (reference_round of the state it started from). While it is in flight the local steps pull toward its z_i,
    with its u, at the ρ1 it started with, from θ as sent; the fold moves θ by z − θ_sent (``restart="global"``).
    Returns check_round's summary."""
    before = [rec["before"][rnd] for rec in recs]
    after = [rec["after"][rnd] for rec in recs]
    want = expected_round(rnd, before, after, node_ranks, eng)
    out = check_round(rnd, before, after, node_ranks, eng, want=want, theta=False, buffers=False)
    node_of = {r: i for i, ranks in enumerate(node_ranks) for r in ranks}
    for r in range(len(recs)):   # the consensus model's buffers: the round's average, as the blocking round's
        for name in before[r]["buffers"]:
            compare(f"round {rnd} rank {r} consensus buffer {name}", after[r]["round_buffers"][name],
                    want["buffers"][name], ulp=want["ulp"].get("buffer " + name))
        if eng.state.delta_coded:
            leader = r == node_ranks[node_of[r]][0]
            for name, ef in after[r]["buffer_ef"].items():
                compare(f"round {rnd} rank {r} buffer_ef[{name}]", ef,
                        want["buffer_ef"][name][node_of[r]] if leader else torch.zeros_like(ef),
                        ulp=want["ulp"]["buffer " + name])
    restart = eng.config.restart
    fold_at = min(eng.overlap.fold_after, LOCAL_STEPS)
    for r, rec in enumerate(recs):
        flight, pre_fold, b = rec["launched"][rnd], rec["pre_fold"][rnd], before[r]
        last = rnd == len(rec["fold_step"]) - 1
        assert rec["fold_step"][rnd] == (0 if last else fold_at), (rnd, r, rec["fold_step"])
        assert flight["in_flight"] == (len(node_ranks) > 1), (rnd, r)
        z_i = want["z_i"][node_of[r]]
        for name in b["theta"]:
            ulp = want["ulp"].get(name)
            assert torch.equal(flight["theta"][name], b["theta"][name]), (rnd, r, name)   # steps go on from θ
            u = b["u"][name].double() + b["theta"][name].double() - z_i[name].double()
            compare(f"round {rnd} rank {r} proximal gradient[{name}] in flight", flight["prox"][name],
                    expected_prox(b, name, flight["theta"][name], z_i[name], u))
            target = want["z"][name] if restart == "global" else b["theta"][name]
            folded = pre_fold[name] + (target - b["theta"][name])   # rebased: the steps since, on the consensus
            compare(f"round {rnd} rank {r} theta[{name}] after the fold", after[r]["theta"][name], folded, ulp=ulp)
            a = after[r]   # the steps after the fold pull toward the folded z_i, with its u, at the new ρ1
            compare(f"round {rnd} rank {r} proximal gradient[{name}] after the fold", rec["folded_prox"][rnd][name],
                    expected_prox(a, name, a["theta"][name], a["z_i"][name], a["u"][name]))
        for name in b["buffers"]:   # a rank's own running statistics follow its steps: the fold leaves them
            assert torch.equal(after[r]["buffers"][name], pre_fold[name]), (rnd, r, name)
    return out


def live_channels(w, dim):
    """The input channels (dim 1) or filters (dim 0) of a conv weight that are not all zero."""
    other = [d for d in range(w.dim()) if d != dim]
    return (w.detach().abs().sum(other) != 0).nonzero().flatten().tolist()


def engine_stats(eng):
    """The part of ``DistributedOptimizer.stats()`` that :func:`check_results` reads, from the engine."""
    return {"inter_bytes": eng.bytes["inter"], "inter_consensus_bytes": eng.bytes["inter_consensus"],
            "cross_rack_bytes": eng.bytes["cross_rack"],
            "dense_inter_bytes": eng.bytes["dense_inter"], "layer_density": eng.layer_density()}


def rank_result(eng, model, topo, reports, stats, ledger_summary):
    """One rank's result after ``finalize()``, JSON-ready; rank 0's also gets ``checks`` and ``ref_rounds``
    (from :func:`check_round`) before :func:`check_results` reads it."""
    return {"rank": topo.rank, "topology": topo.as_dict(), "rack_tier": eng.state.rack_tier,
            "guarded": eng.syncs_node_grads, "reports": reports,
            "stats": stats,
            "ledger": ledger_summary,
            "compact": {e.name: [int(e.rows.sum()), int(e.cols.sum())] for e in eng.structured},
            "couplings": eng.masks.couplings, "streams": [list(map(list, s)) for s in eng.masks.streams],
            "heads": [[g.num_heads, [list(r) for r in g.rows], list(g.cols)] for g in eng.masks.heads],
            # the rows, input channels and columns still nonzero (a linear weight: rows and columns)
            "final_support": {n: [int((p.detach().reshape(p.shape[0], -1).abs().sum(1) != 0).sum()),
                                  int((p.detach().abs().sum((0, 2, 3)) != 0).sum()) if p.dim() == 4 else None,
                                  int((p.detach().reshape(p.shape[0], -1).abs().sum(0) != 0).sum())]
                              for n, p in model.named_parameters() if p.dim() in (2, 4)},
            # per stream, per member (readers, then writers): the channels it still reads / writes
            "stream_live": [[live_channels(model.get_parameter(n), dim) for dim, names in ((1, r), (0, w))
                             for n in names] for r, w in eng.masks.streams],
            "shapes": {n: list(p.shape) for n, p in model.named_parameters()},
            "numels": {e.name: e.param.numel() for e in eng.entries},
            "buffer_numel": sum(b.numel() for _, b in eng.state.buffers)}


def guard_bytes(res, rounds):
    """node_sync's guard at ``rounds`` rounds: each carries every rank's place and step count (two float64 a rank)
    across the leaders; none without node_sync on nodes of more than one rank."""
    return rounds * 2 * res["topology"]["size"] * 8 if res["guarded"] else 0


def keep(k, n):
    return max(1, min(n, math.ceil(k * n - 1e-9)))


def ring_allreduce_bytes(payload, members):
    """What each member of a ring allreduce sends (prunex_hvd.dist.comm.accounting's model): 2(n-1)/n of it."""
    return 2 * (members - 1) * payload // members


def check_rack_ledger(res, per_round, masks, residuals, mask_itemsize=1, guard=0, frozen_masks=0):
    """Three tiers: what one rank put on each tier's groups over the run, exactly. The node leaders sum the
    compact payload over their rack and pass z's payload down it; the rack leaders alone average it (and OR the
    masks, sum the residuals) across the spine, which is all that crosses racks; nobody uses the flat leaders'
    group. Every hop of a rack or spine group leaves its node (one member per node). ``masks``: the OR's bytes
    (``mask_itemsize`` a value); the way down carries them as uint8. ``guard``: node_sync's guard's bytes at the
    rounds (:func:`guard_bytes`), up the tree and down the rack."""
    rank, topo, ledger = res["rank"], res["topology"], res["ledger"]
    consensus = sum(per_round)
    by_op = {tier: {op: v["payload_bytes"] for op, v in ledger[tier].get("by_op", {}).items()}
             for tier in ("rack", "spine")}
    assert ledger["inter"]["ops"] == 0, f"rank {rank}: the flat leaders' group was used"
    if topo["is_leader"]:
        want = {"allreduce[consensus]": consensus, "broadcast[consensus]": consensus, "bor[masks]": masks,
                "broadcast[masks]": masks // mask_itemsize + frozen_masks, "allreduce[residuals]": residuals,
                "broadcast[residuals]": residuals, "allreduce[guard]": guard, "broadcast[guard]": guard}
        assert by_op["rack"] == {op: n for op, n in want.items() if n}, f"rank {rank}: {by_op['rack']}"
    else:
        assert ledger["rack"]["ops"] == 0, f"rank {rank}"
    if topo["is_rack_leader"]:
        want = {"allreduce[consensus]": consensus, "bor[masks]": masks, "broadcast[masks]": frozen_masks,
                "allreduce[residuals]": residuals, "allreduce[guard]": guard}
        assert by_op["spine"] == {op: n for op, n in want.items() if n}, f"rank {rank}"
    else:
        assert ledger["spine"]["ops"] == 0 and ledger["total"]["cross_rack_bytes"] == 0, f"rank {rank}"
    for tier in ("rack", "spine"):
        assert ledger[tier]["cross_node_bytes"] == ledger[tier]["wire_bytes"], f"rank {rank} {tier}"
    assert ledger["total"]["cross_node_bytes"] == ledger["rack"]["wire_bytes"] + ledger["spine"]["wire_bytes"]
    assert ledger["total"]["cross_rack_bytes"] == ledger["spine"]["cross_rack_bytes"] == ledger["spine"]["wire_bytes"]
    if topo["num_racks"] == 2 and topo["is_rack_leader"]:   # two rack leaders: all of it crosses once
        assert ledger["spine"]["cross_rack_bytes"] == consensus + masks + residuals + guard \
            + (topo["rack"] == 0) * frozen_masks   # the broadcast's last rack leader sends nothing
    assert res["stats"]["cross_rack_bytes"] == ledger["total"]["cross_rack_bytes"]
    assert res["stats"]["inter_bytes"] == ledger["total"]["cross_node_bytes"]
    if topo["is_leader"]:   # the consensus exchange as the ring model puts it: rack sum, spine average, way down
        nodes = topo["rack_nodes"][topo["rack"]]
        last_of_chain = nodes.index(topo["node"]) == len(nodes) - 1   # a broadcast's last member sends nothing
        want = [ring_allreduce_bytes(p, len(nodes)) + (0 if last_of_chain else p)
                + topo["is_rack_leader"] * ring_allreduce_bytes(p, topo["num_racks"]) for p in per_round]
        assert res["stats"]["inter_consensus_bytes"] == sum(want), f"rank {rank}"


def check_results(results, specs, mask_itemsize=1, couplings=None, streams=(), payload_bytes=FLOAT_BYTES,
                  freeze_round=SETTINGS["freeze_round"], global_budget=False):
    """What every rank reported after ``ROUNDS`` rounds on M nodes × P ranks: the reference checks ran; the
    leaders' inter-node payload is exactly the compact sizes (plus masks and the residual sum) while non-leaders
    send nothing across (with one node nothing crosses at all); the model is at the requested structure after
    finalize(), the same density on every rank. ``payload_bytes``: the size of one value of the consensus
    exchange (2 with a bf16 / fp16 payload; the dense counterfactual stays in the model's float32).
    ``global_budget`` (channel_budget="global"): each layer keeps at least BUDGET_FLOOR of its channels and all of
    them together no more weights than the per-layer projection would."""
    topo = results[0]["topology"]
    num_nodes, size = topo["num_nodes"], topo["size"]
    assert results[0]["couplings"] == (couplings or {})
    assert results[0]["streams"] == [list(map(list, s)) for s in streams]
    ref_rounds = results[0]["ref_rounds"]
    assert results[0]["checks"] == size * ROUNDS and len(ref_rounds) == ROUNDS
    assert [r["frozen_before"] for r in ref_rounds] == [rnd >= freeze_round for rnd in range(ROUNDS)]
    shapes, numels = results[0]["shapes"], results[0]["numels"]
    dense_numel = sum(n for name, n in numels.items() if name not in specs) + results[0]["buffer_numel"]
    mask_bytes = sum(shapes[n][0] + math.prod(shapes[n][1:]) for n in specs) * mask_itemsize
    # an anchored round of a narrow payload sends float32
    per_round = [(FLOAT_BYTES if rr["anchored"] else payload_bytes)
                 * (dense_numel + sum(r * c for r, c in rr["compact"].values())) for rr in ref_rounds]
    unfrozen = sum(not rr["frozen_before"] for rr in ref_rounds)
    # the freeze within the rounds hands rank 0's masks down the tree (uint8)
    frozen_masks = mask_bytes // mask_itemsize * (not ref_rounds[0]["frozen_before"] and freeze_round is not None
                                                  and 0 < freeze_round <= ROUNDS)
    # per-layer residual sums (float64; 5 a layer with racks) + each rank's round, step count, inf/NaN flag +
    # per-layer inf/NaN flags
    width = 5 if results[0]["rack_tier"] else 3
    residuals = ROUNDS * (len(numels) * width + size * 3 + len(numels) + 1) * 8
    dense_round = FLOAT_BYTES * (sum(numels.values()) + results[0]["buffer_numel"])
    guard = guard_bytes(results[0], ROUNDS) if num_nodes > 1 else 0
    budget_used = {}   # per rank, with a budget across layers: kept weights beyond the per-layer projection's
    for res in results:
        rank, leader = res["rank"], res["topology"]["is_leader"]
        inter = res["ledger"]["inter"]
        if res["rack_tier"]:
            check_rack_ledger(res, per_round, unfrozen * mask_bytes, residuals, mask_itemsize, guard, frozen_masks)
        elif leader:
            by_op = {op: v["payload_bytes"] for op, v in inter.get("by_op", {}).items()}
            if num_nodes > 1:
                want = {"allreduce[consensus]": sum(per_round), "bor[masks]": unfrozen * mask_bytes,
                        "broadcast[masks]": frozen_masks, "allreduce[residuals]": residuals,
                        "allreduce[guard]": guard}
                assert by_op == {op: n for op, n in want.items() if n}, f"rank {rank}"
            else:   # one node: no inter-node tier, the leaders' group of one is never used
                assert inter["ops"] == 0, f"rank {rank}: {inter}"
            if num_nodes == 2:   # two leaders: all of it crosses once (a broadcast's last leader sends nothing)
                last_of_chain = res["topology"]["node"] == 1
                assert inter["cross_node_bytes"] == inter["payload_bytes"] - last_of_chain * frozen_masks
            assert res["stats"]["inter_bytes"] == inter["cross_node_bytes"]
            assert res["stats"]["inter_consensus_bytes"] == sum(ring_allreduce_bytes(p, num_nodes) for p in per_round)
            assert res["stats"]["dense_inter_bytes"] == ROUNDS * ring_allreduce_bytes(dense_round, num_nodes)
        else:
            assert inter["ops"] == 0 and res["stats"]["inter_bytes"] == 0, f"non-leader {rank} sent inter-node"
        if not res["rack_tier"]:
            assert res["ledger"]["total"]["cross_node_bytes"] == (inter["cross_node_bytes"] if leader else 0)
        assert res["ledger"]["world"]["ops"] == 0
        # after finalize(): exactly the requested structure
        for name, spec in specs.items():
            if len(shapes[name]) == 2:
                check_linear_support(res, name, spec, shapes[name], couplings or {})
                continue
            c_out, c_in, kh, kw = shapes[name]
            rows, channels, cols = res["final_support"][name]
            parts = dict(p.split(":") for p in spec.split("+"))
            want_rows = keep(float(parts["filter"]), c_out) if "filter" in parts else c_out
            consumer = {p: c for c, p in (couplings or {}).items()}.get(name)
            if consumer:   # coupled producer: one filter per channel its consumer reads (at any kernel position)
                want_rows = res["final_support"][consumer][1]
            stream = next((s for s in streams if name in s[1]), None)
            if stream:     # a stream writer: one filter per channel the stream's readers kept
                want_rows = keep(float(specs[stream[0][0]].split(":")[1]), c_out)
            assert rows == want_rows, (name, rows)
            if global_budget and "channel" in parts:
                assert keep(BUDGET_FLOOR, c_in) <= channels <= c_in, (name, channels)
                budget_used[rank] = budget_used.get(rank, 0) + (channels - keep(float(parts["channel"]), c_in)) * \
                    c_out * kh * kw
            elif "channel" in parts:   # a shape stage after it may leave a kept channel without any position
                kept = keep(float(parts["channel"]), c_in)
                assert channels <= kept if "shape" in parts else channels == kept, (name, channels)
            if "shape" in parts:
                assert cols == keep(float(parts["shape"]), c_in * kh * kw), (name, cols)
        # after finalize(): every channel of a stream is read and written by all of its convs, or by none
        for s, live in zip(streams, res["stream_live"]):
            assert len(live) == len(s[0]) + len(s[1]) and all(m == live[0] for m in live), (s, live)
            assert len(live[0]) == keep(float(specs[s[0][0]].split(":")[1]), shapes[s[0][0]][1])
    assert all(extra <= 0 for extra in budget_used.values()), budget_used
    # every rank reports the same final density
    assert len({json.dumps(r["stats"]["layer_density"], sort_keys=True) for r in results}) == 1


def check_linear_support(res, name, spec, shape, couplings):
    """A linear weight after finalize(): ``neuron:K`` keeps ceil(K·out) rows (a coupled producer: one per
    feature its reader kept), ``feature:K`` ceil(K·in) columns, ``head:K`` ceil(K·H) heads' rows or columns."""
    rows, _, cols = res["final_support"][name]
    kind, k = spec.split(":")
    want_rows, want_cols = shape
    for heads, members, out_cols in res["heads"]:
        kept = keep(float(k), heads)
        if name in [m for m, _ in members]:
            want_rows = shape[0] // heads * kept
        elif name in out_cols:
            want_cols = shape[1] // heads * kept
    if kind == "neuron":
        consumer = {p: c for c, p in couplings.items()}.get(name)
        want_rows = res["final_support"][consumer][2] if consumer else keep(float(k), shape[0])
    elif kind == "feature":
        want_cols = keep(float(k), shape[1])
    assert (rows, cols) == (want_rows, want_cols), (name, spec, rows, cols, want_rows, want_cols)
