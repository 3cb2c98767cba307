"""H-SADMM on a real launch, checked round by round against a single-process reference.

Each rank trains a small CNN on its own data. Before and after every consensus round the ranks' states are
gathered to rank 0 over the launcher's control plane (never through the accounted groups), and rank 0 runs
`reference_round` — the round's math written out plainly over all M×P ranks — and compares. Writes
OUT/rank{R}.json with the ledger, stats and final model digest for the parent test."""
import argparse
import json
import os
import sys

import torch
import torch.nn as nn

import worker_io

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from reference import reference_round  # noqa: E402


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


def make_model(kind="chain"):
    torch.manual_seed(1234)
    if kind == "residual":
        return Residual()
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 12, 3, padding=1), nn.BatchNorm2d(12), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(12, 5))


def snapshot(opt, model):
    eng = opt._engine
    return {"theta": {e.name: e.param.detach().cpu().clone() for e in eng.entries},
            "u": {e.name: e.u.cpu().clone() for e in eng.entries},
            "z_i": {e.name: e.z_i.cpu().clone() for e in eng.entries},
            "v": {e.name: e.v.cpu().clone() for e in eng.entries},
            "z": {e.name: e.z.cpu().clone() for e in eng.entries},
            "rho1": {e.name: e.rho1 for e in eng.entries}, "rho2": {e.name: e.rho2 for e in eng.entries},
            "masks": {e.name: (e.rows.cpu().clone(), e.cols.cpu().clone()) for e in eng.structured},
            "buffers": {n: b.detach().cpu().clone() for n, b in eng.buffers},
            "frozen": eng.frozen}


def live_channels(w, dim):
    """The input channels (dim 1) or filters (dim 0) of a conv weight that are not all zero."""
    other = [d for d in range(w.dim()) if d != dim]
    return (w.detach().abs().sum(other) != 0).nonzero().flatten().tolist()


def compare(name, got, want, rtol=1e-4, atol=1e-6):
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--sparsity", default="channel:0.5")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--local-steps", type=int, default=3)
    ap.add_argument("--freeze-round", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--coupled", action="store_true")
    ap.add_argument("--coupled-streams", dest="coupled", action="store_const", const="streams")
    ap.add_argument("--model", default="chain", choices=("chain", "residual"))
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import prunex_hvd as px
    from prunex_hvd.runtime import state
    topo = px.init(backend=a.backend)
    control = state()[1]
    if a.device == "cuda":
        torch.cuda.set_device(topo.local_rank % torch.cuda.device_count())
    model = make_model(a.model).to(a.device)
    if topo.rank != 0:   # different starting points: construction must broadcast rank 0's
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
    spec = json.loads(a.sparsity) if a.sparsity.startswith("{") else a.sparsity
    opt = px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4),
                                  model, sparsity=spec, local_steps=10**6, rho1=0.05, rho2=0.02,
                                  weight_decay_z=0.01, freeze_round=a.freeze_round, bucket_mb=0.002,
                                  backend=a.backend, coupled=a.coupled)
    start = control.allgather_object({k: v.cpu().clone() for k, v in model.state_dict().items()})
    for k in start[0]:
        assert all(torch.equal(s[k], start[0][k]) for s in start), f"{k} differs after construction"
    px.comm.reset()
    g = torch.Generator().manual_seed(100 + topo.rank)   # different data on every rank
    x = torch.randn(16, 3, 6, 6, generator=g).to(a.device)
    y = torch.randint(0, 5, (16,), generator=g).to(a.device)
    reports, checks, ref_rounds = [], 0, []
    for rnd in range(a.rounds):
        for _ in range(a.local_steps):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        before = control.allgather_object(snapshot(opt, model))
        report = opt.consensus()
        after = control.allgather_object(snapshot(opt, model))
        reports.append(report)
        if topo.rank == 0:
            eng = opt._engine
            want = reference_round(before, topo.node_ranks, {e.name: e.spec for e in eng.structured},
                                   weight_decay_z=0.01, rho_max=eng.rho_max, adaptive=eng.adaptive_rho,
                                   freezes=after[0]["frozen"] and not before[0]["frozen"],
                                   couplings=eng.couplings, streams=eng.streams)
            for r, got in enumerate(after):
                node = topo.node_of(r)
                for name in got["theta"]:
                    compare(f"round {rnd} rank {r} u[{name}]", got["u"][name], want["u"][r][name])
                    compare(f"round {rnd} rank {r} z_i[{name}]", got["z_i"][name], want["z_i"][node][name])
                    compare(f"round {rnd} rank {r} v[{name}]", got["v"][name], want["v"][node][name])
                    compare(f"round {rnd} rank {r} z[{name}]", got["z"][name], want["z"][name])
                    assert got["rho1"][name] == want["rho1"][name], (name, got["rho1"][name], want["rho1"][name])
                    assert got["rho2"][name] == want["rho2"][name], (name, got["rho2"][name], want["rho2"][name])
                for name, (rows, cols) in got["masks"].items():
                    assert torch.equal(rows, want["masks"][name][0]) and torch.equal(cols, want["masks"][name][1])
                for name in got["buffers"]:
                    compare(f"round {rnd} rank {r} buffer {name}", got["buffers"][name], want["buffers"][name])
                checks += 1
            sent = want["sent_masks"].items()
            ref_rounds.append({"frozen_before": before[0]["frozen"],
                               "compact": {n: [int(r.sum()), int(c.sum())] for n, (r, c) in sent}})
    opt.finalize()
    final = control.allgather_object({k: v.cpu().clone() for k, v in model.state_dict().items()})
    for k in final[0]:
        assert all(torch.equal(s[k], final[0][k]) for s in final), f"{k} differs after finalize"
    result = {"rank": topo.rank, "topology": topo.as_dict(), "reports": reports,
              "stats": {k: v for k, v in opt.stats().items() if k not in ("residuals",)},
              "ledger": px.comm.summary(by_op=True), "checks": checks,
              "compact": {e.name: [int(e.rows.sum()), int(e.cols.sum())] for e in opt._engine.structured},
              "ref_rounds": ref_rounds, "couplings": opt._engine.couplings,
              "streams": [list(map(list, s)) for s in opt._engine.streams],
              "final_support": {n: [int((p.detach().reshape(p.shape[0], -1).abs().sum(1) != 0).sum()),
                                    int((p.detach().abs().sum((0, 2, 3)) != 0).sum()),
                                    int((p.detach().reshape(p.shape[0], -1).abs().sum(0) != 0).sum())]
                                for n, p in model.named_parameters() if p.dim() == 4},
              # per stream, per member (readers, then writers): the channels it still reads / writes
              "stream_live": [[live_channels(model.get_parameter(n), dim) for dim, names in ((1, r), (0, w))
                               for n in names] for r, w in opt._engine.streams],
              "shapes": {n: list(p.shape) for n, p in model.named_parameters()},
              "numels": {e.name: e.param.numel() for e in opt._engine.entries},
              "buffer_numel": sum(b.numel() for _, b in opt._engine.buffers)}
    worker_io.report(a.out, topo.rank, result, checks)


if __name__ == "__main__":
    worker_io.run(main, "engine")
