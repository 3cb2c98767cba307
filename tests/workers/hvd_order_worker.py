"""A Horovod user's script under horovodrun, with ``hvd.init()`` and ``px.init()`` in the order ``--order`` names
(or one of them left out). The script does what Horovod scripts do around the wrap: broadcast_parameters,
broadcast_optimizer_state after it (as Horovod's ImageNet example), a metric averaged with hvd.allreduce, and
it trains two rounds. Writes OUT/rank{R}.json with the topology, the steps and rounds counted and the final
model's digest, or, when the order is one PruneX refuses, "[rank R] hvd-order worker error: ...".

``--refused-first ORDER`` first makes the calls of an order PruneX refuses and the wrap (each rank prints
"[rank R] refused: ..." with the error it caught), then goes on with ``--order`` in the same process: a refusal
leaves nothing behind."""
import argparse
import hashlib
import os
import sys

import torch
import torch.nn as nn

import worker_io

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models_for_tests import toy_cnn  # noqa: E402

ORDERS = {   # name: (calls before the wrap, in order; the wrapper's backend)
    "hvd-then-px": (["hvd", "px"], "auto"),
    "px-then-hvd": (["px", "hvd"], "auto"),
    "hvd-only": (["hvd"], "auto"),
    "neither": ([], "auto"),   # the wrap initialises; hvd.init() comes after it
    "hvd-dynamic-then-px-horovod": (["hvd-dynamic", "px-horovod"], "horovod"),
    "px-horovod-then-hvd": (["px-horovod", "hvd"], "horovod"),
    "hvd-then-px-horovod": (["hvd", "px-horovod"], "horovod"),   # refused: Horovod without dynamic sets
    "hvd-only-wrap-horovod": (["hvd"], "horovod"),                # refused likewise, at the wrap
}


def init_in_order(hvd, px, calls):
    for call in calls:
        if call == "hvd":
            hvd.init()
        elif call == "hvd-dynamic":
            hvd.init(process_sets="dynamic")
        elif call == "px":
            px.init()
        else:
            px.init(backend="horovod")


def refused(hvd, px, order):
    calls, backend = ORDERS[order]
    model = toy_cnn(0)
    try:
        init_in_order(hvd, px, calls)
        px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, sparsity="channel:0.5",
                                local_steps=2, backend=backend)
    except Exception as exc:  # noqa: BLE001 - the parent test checks the message
        print(f"[rank {os.environ['HOROVOD_RANK']}] refused: {type(exc).__name__}: {exc}", flush=True)
    else:
        raise AssertionError(f"{order} was not refused")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--order", required=True, choices=sorted(ORDERS))
    ap.add_argument("--refused-first", default=None, choices=sorted(ORDERS))
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import horovod.torch as hvd
    import prunex_hvd as px
    if a.refused_first:
        refused(hvd, px, a.refused_first)
    calls, backend = ORDERS[a.order]
    init_in_order(hvd, px, calls)
    rank = int(os.environ["HOROVOD_RANK"])
    model = toy_cnn(rank)   # different weights on every rank: broadcast_parameters (or the wrap) makes them equal
    if calls:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                                  sparsity="channel:0.5", local_steps=2, backend=backend)
    if not calls:
        hvd.init()
    hvd.broadcast_optimizer_state(opt, root_rank=0)   # on a fresh optimizer: a zero-gradient step() first
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        x, y = torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    mean_loss = hvd.allreduce(loss.detach(), name="loss").item()   # Horovod's metric averaging, after PruneX's
    opt.finalize()
    topo = px.topology()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    worker_io.report(a.out, hvd.rank(), {"rank": hvd.rank(), "size": hvd.size(), "nodes": topo.num_nodes,
                                         "backend": px.comm.groups().backend, "rounds": opt.rounds_done(),
                                         "steps": opt.stats()["steps"],
                                         "mean_loss": mean_loss, "digest": digest}, 1)


if __name__ == "__main__":
    worker_io.run(main, "hvd-order")
