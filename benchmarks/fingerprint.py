"""The engine's results on the thread tier, recorded and compared bit for bit: a check that a refactoring changed
nothing where it meant to change nothing.

    python benchmarks/fingerprint.py record /tmp/before.pt      # on the old code
    python benchmarks/fingerprint.py compare /tmp/before.pt     # on the new code: torch.equal, or what differs

Each case trains a small model on an M×P thread cluster (:mod:`prunex_hvd.dist.comm.threads`) for a few rounds
and records, per rank, z of every entry after every round, the model after ``finalize()`` and the engine's byte
counts. The cases are the recipe (on a chain, a residual net with coupled streams, a ViT, overlapped, with racks,
on one node) and the paper's round. ``compare`` prints JSON: the cases, and every tensor or count that differs.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchjson import emit  # noqa: E402

ROUNDS, STEPS = 5, 3
RECIPE = dict(rho1=0.01, rho2=0.001, rho_max=0.5, adaptive_rho=True, restart="global", node_sync=True,
              payload_dtype="bf16", freeze_round=0, channel_budget="global", bucket_mb=0.002)
PAPER = dict(rho1=0.05, rho2=0.02, rho_max=10.0, adaptive_rho=True, restart="none", node_sync=False,
             payload_dtype=None, freeze_round=None, freeze_patience=3, channel_budget="layer", bucket_mb=0.002)
# name: (nodes, ranks per node, nodes per rack, model, sparsity, coupled, knobs)
CASES = {
    "recipe-2x2-chain": (2, 2, None, "chain", "channel:0.5", False, RECIPE),
    "recipe-2x3-streams": (2, 3, None, "residual", "channel:0.5", "streams", RECIPE),
    "recipe-2x2-vit": (2, 2, None, "vit", "head:0.5+neuron:0.5", True, RECIPE),
    "recipe-2x2-overlap": (2, 2, None, "chain", "channel:0.5", False, dict(RECIPE, overlap=1)),
    "recipe-4x2-racks": (4, 2, 2, "chain", "channel:0.5", False, RECIPE),
    "recipe-1x3": (1, 3, None, "chain", "channel:0.5", False, RECIPE),
    "paper-2x2-chain": (2, 2, None, "chain", "channel:0.5", False, PAPER),
    "paper-2x3-mixed": (2, 3, None, "chain", {"3.*": "filter:0.5+channel:0.5", "0.weight": "shape:0.5"}, False,
                        PAPER),
}


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        bn = nn.BatchNorm2d
        self.stem, self.bn0 = nn.Conv2d(3, 8, 3, padding=1), bn(8)
        self.a, self.bna, self.b, self.bnb = nn.Conv2d(8, 6, 3, padding=1), bn(6), nn.Conv2d(6, 8, 3, padding=1), bn(8)
        self.c, self.bnc = nn.Conv2d(8, 10, 3, padding=1), bn(10)
        self.head = nn.Linear(10, 5)

    def forward(self, x):
        s = torch.relu(self.bn0(self.stem(x)))
        s = torch.relu(self.bnb(self.b(torch.relu(self.bna(self.a(s))))) + s)
        t = torch.relu(self.bnc(self.c(s)))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(t, 1), 1))


def make_model(kind: str, rank: int) -> nn.Module:
    torch.manual_seed(1234)
    if kind == "residual":
        model = Residual()
    elif kind == "vit":
        from prunex_hvd.app.models.vit import VisionTransformer
        model = VisionTransformer(num_classes=5, patch=2, dim=8, depth=1, num_heads=4, max_image_size=6)
    else:
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                              nn.Conv2d(8, 12, 3, padding=1), nn.BatchNorm2d(12), nn.ReLU(),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(12, 5))
    if rank:   # the engine must broadcast rank 0's
        g = torch.Generator().manual_seed(rank)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g))
    return model


def run_case(name: str) -> list:
    from prunex_hvd.dist.comm.threads import thread_cluster
    from prunex_hvd.engine.config import ConsensusConfig, Structure
    from prunex_hvd.engine.hsadmm import HSADMM
    from prunex_hvd.engine.sparsity import native

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from threaded import run_ranks

    nodes, local, per_rack, kind, sparsity, coupled, knobs = CASES[name]
    size = nodes * local
    models = [make_model(kind, r) for r in range(size)]
    config = ConsensusConfig(sparsity=sparsity, coupled=coupled, local_steps=STEPS, **knobs)
    structure = Structure.resolve(models[0], config)
    native.module()
    cluster = thread_cluster(nodes, local, nodes_per_rack=per_rack)

    def rank_run(rank):
        model = models[rank.topo.rank]
        eng = HSADMM(model, rank.topo, rank.groups, config, structure, ledger=rank.ledger)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        g = torch.Generator().manual_seed(100 + rank.topo.rank)
        x, y = torch.randn(16, 3, 6, 6, generator=g), torch.randint(0, 5, (16,), generator=g)
        zs, reports = [], []
        for rnd in range(ROUNDS):
            for _ in range(STEPS):   # what the wrapped optimizer's step() does
                model.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                eng.sync_node_grads()
                eng.add_proximal_grad()
                opt.step()
                eng.after_step()
            report = eng.consensus_round(steps=(rnd + 1) * STEPS)
            zs.append({e.name: e.z.detach().clone() for e in eng.entries})
            reports.append({k: v for k, v in report.items() if k.endswith("_bytes")})
        eng.finalize()
        return {"z": zs, "final": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "bytes": dict(eng.bytes), "reports": reports}
    return run_ranks(nodes, local, rank_run, cluster=cluster)


def differences(want, got, where: str) -> list:
    if isinstance(want, torch.Tensor):
        return [] if isinstance(got, torch.Tensor) and want.dtype == got.dtype and torch.equal(want, got) else [where]
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(want) != set(got):
            return [f"{where} (keys)"]
        return [d for k in want for d in differences(want[k], got[k], f"{where}.{k}")]
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(want) != len(got):
            return [f"{where} (length)"]
        return [d for i, (a, b) in enumerate(zip(want, got)) for d in differences(a, b, f"{where}[{i}]")]
    return [] if want == got else [f"{where}: {want!r} -> {got!r}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("record", "compare"))
    ap.add_argument("file")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated, of " + ", ".join(CASES))
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = [c for c in args.cases.split(",") if c]
    runs = {name: run_case(name) for name in names}
    if args.action == "record":
        torch.save(runs, args.file)
        emit({"recorded": names, "file": args.file})
        return
    want = torch.load(args.file, weights_only=False)
    diff = {name: differences(want[name], runs[name], name) for name in names if name in want}
    emit({"cases": names, "identical": not any(diff.values()),
          "differences": {k: v[:20] for k, v in diff.items() if v}})
    sys.exit(0 if not any(diff.values()) else 1)


if __name__ == "__main__":
    main()
