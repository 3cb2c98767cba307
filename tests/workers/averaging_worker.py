"""The round-based rivals (local SGD, hierarchical local SGD, DiLoCo) on a real launch, step by step against a
plain single-process reference of their math.

    mpirun -np 4 -x PRUNEX_RANKS_PER_NODE=2 python averaging_worker.py --methods localsgd,localsgd-hier,diloco --out DIR

For each method every rank trains a small CNN (with BatchNorm) on its own data for ``--steps`` steps, then
asks for one more round (``consensus()``, as the trainer does for a last, short round) and finalizes. After
every step all ranks' parameters and buffers are gathered to rank 0 over the launcher's control plane (never
through the accounted groups), and rank 0 holds W copies of the model stepping on the same batches:
``period`` steps of SGD, then the method's round in plain torch (means over ranks; a node's ranks for the
hierarchical one's node period; DiLoCo's outer Nesterov step on the mean pseudo-gradient). Writes
OUT/rank{R}.json with each method's stats and ledger."""
import argparse
import copy

import torch
import torch.nn as nn

import worker_io

PERIOD, INTRA, OUTER_LR, OUTER_MOMENTUM = 4, 2, 0.7, 0.9


def make_model():
    torch.manual_seed(1234)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 12, 3, padding=1), nn.BatchNorm2d(12), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(12, 5))


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def batch(gen):
    return torch.randn(8, 3, 6, 6, generator=gen), torch.randint(0, 5, (8,), generator=gen)


def state_of(model):
    return [p.detach().clone() for p in model.parameters()] + \
        [b.clone() for b in model.buffers() if b.is_floating_point()]


def mean_into(models, which):
    """Every model in ``models`` takes their mean of ``which`` ("params" or "buffers")."""
    get = (lambda m: list(m.parameters())) if which == "params" else \
        (lambda m: [b for b in m.buffers() if b.is_floating_point()])
    with torch.no_grad():
        for ts in zip(*(get(m) for m in models)):
            avg = torch.stack([t.detach() for t in ts]).mean(0)
            for t in ts:
                t.copy_(avg)


class Reference:
    """W copies of the model, each with its own SGD, and the method's round in plain torch."""

    def __init__(self, method, start, node_ranks):
        self.method, self.node_ranks = method, node_ranks
        self.models = [copy.deepcopy(start) for _ in range(sum(len(n) for n in node_ranks))]
        self.opts = [sgd(m) for m in self.models]
        self.gens = [torch.Generator().manual_seed(100 + r) for r in range(len(self.models))]
        self.global_params = [p.detach().clone() for p in start.parameters()]
        self.outer = torch.optim.SGD(self.global_params, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
        self.snapshot = None

    def step(self, step):
        for m, o, g in zip(self.models, self.opts, self.gens):
            x, y = batch(g)
            o.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
        if step % PERIOD == 0:
            self.round()
        elif self.method == "localsgd-hier" and step % INTRA == 0:
            for ranks in self.node_ranks:
                mean_into([self.models[r] for r in ranks], "params")

    def round(self):
        mean_into(self.models, "buffers")
        mean_into(self.models, "params")
        if self.method == "diloco":
            with torch.no_grad():
                mean = [p.detach().clone() for p in self.models[0].parameters()]
                for g, m in zip(self.global_params, mean):
                    g.grad = g - m
                self.outer.step()
                for model in self.models:
                    for p, g in zip(model.parameters(), self.global_params):
                        p.copy_(g)
        self.snapshot = state_of(self.models[0])


def wrap(method, model, opt, backend):
    from prunex_hvd.baselines import averaging
    if method == "localsgd":
        return averaging.LocalSGD(opt, model, period=PERIOD, backend=backend)
    if method == "localsgd-hier":
        return averaging.HierarchicalLocalSGD(opt, model, period=PERIOD, intra_period=INTRA, backend=backend)
    return averaging.DiLoCo(opt, model, period=PERIOD, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM,
                            backend=backend)


def close(got, want, what):
    for k, (a, b) in enumerate(zip(got, want)):
        worker_io.assert_close(a, b, f"{what} tensor {k}", rtol=1e-5, atol=1e-6)


def run_method(px, control, topo, method, steps, backend):
    model = make_model()
    if topo.rank != 0:   # different starting points: construction must broadcast rank 0's
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
    opt = wrap(method, model, sgd(model), backend)
    px.comm.reset()
    ref = Reference(method, model, topo.node_ranks) if topo.rank == 0 else None
    gen = torch.Generator().manual_seed(100 + topo.rank)
    checks = 0
    for step in range(1, steps + 1):
        x, y = batch(gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        states = control.allgather_object(state_of(model))
        if ref is not None:
            ref.step(step)
            for r, s in enumerate(states):
                close(s, state_of(ref.models[r]), f"{method} step {step} rank {r}")
            checks += 1
        assert opt.rounds_done() == step // PERIOD
    opt.consensus()   # the last, short round
    if ref is not None:
        ref.round()
    with opt.consensus_weights():
        shown = control.allgather_object(state_of(model))
    opt.finalize()
    final = control.allgather_object(state_of(model))
    if ref is not None:
        for r in range(topo.size):
            close(shown[r], ref.snapshot, f"{method} consensus_weights rank {r}")
            close(final[r], ref.snapshot, f"{method} final rank {r}")
        checks += 1
    stats = opt.stats()
    return {"stats": {k: v for k, v in stats.items() if k != "layer_density"},
            "ledger": px.comm.summary(by_op=True), "checks": checks}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--methods", default="localsgd,localsgd-hier,diloco")
    ap.add_argument("--steps", type=int, default=10)   # rounds after 4 and 8, a short one at 10
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import prunex_hvd as px
    from prunex_hvd.dist.runtime import state
    topo = px.init(backend=a.backend)
    control = state()[1]
    result = {m: run_method(px, control, topo, m, a.steps, a.backend) for m in a.methods.split(",")}
    result["numels"] = {"params": sum(p.numel() for p in make_model().parameters()),
                        "buffers": sum(b.numel() for b in make_model().buffers() if b.is_floating_point())}
    worker_io.report(a.out, topo.rank, result, sum(r["checks"] for k, r in result.items() if k != "numels"))


if __name__ == "__main__":
    worker_io.run(main, "averaging")
